"""Greedy output equals Hugging Face transformers' Qwen3ForCausalLM, token for token, through every
path that changes how K/V reach the cache: plain, prefix-cache hits, chunked prefill, preemption."""

import pytest

from inferlab import LLM, SamplingParams

GREEDY = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)


def prompts_of(lengths, start=5):
    return [[(start + 7 * i + j * 13) % 300 + 3 for j in range(n)] for i, n in enumerate(lengths)]


@pytest.mark.parametrize("shape", ["gqa2-tied", "gqa4-untied", "mha-wide-head"])
def test_greedy_matches_hf(shape, checkpoint, hf_greedy):
    path = checkpoint(shape)
    llm = LLM(path, kvcache_block_size=16, num_kvcache_blocks=64)
    prompts = prompts_of([1, 7, 16, 33])
    outputs = llm.generate(prompts, GREEDY, use_tqdm=False)
    for prompt, out in zip(prompts, outputs):
        assert out["token_ids"] == hf_greedy(path, prompt, 10)


def test_second_generate_hits_prefix_cache(checkpoint, hf_greedy):
    path = checkpoint("gqa4-untied")
    llm = LLM(path, kvcache_block_size=16, num_kvcache_blocks=64)
    prompts = prompts_of([32, 16, 40])  # 32 and 16 are exactly 2 and 1 blocks
    first = llm.generate(prompts, GREEDY, use_tqdm=False)
    hits_before = llm.kv_cache.num_hit_tokens
    second = llm.generate(prompts, GREEDY, use_tqdm=False)
    assert [o["token_ids"] for o in first] == [o["token_ids"] for o in second]
    # every full block is reused except the one holding each prompt's last token (recomputed)
    assert llm.kv_cache.num_hit_tokens - hits_before == 16 + 0 + 32
    for prompt, out in zip(prompts, second):
        assert out["token_ids"] == hf_greedy(path, prompt, 10)


def test_fully_cached_prompt_of_exact_blocks(checkpoint, hf_greedy):
    """nano-vllm issue #144: a prompt whose every block is cached must still compute its last token."""
    path = checkpoint("gqa2-tied")
    llm = LLM(path, kvcache_block_size=16, num_kvcache_blocks=32)
    prompt = prompts_of([48])[0]
    long_prompt = prompt + [9] * 20  # caches all three blocks of `prompt`
    llm.generate([long_prompt], GREEDY, use_tqdm=False)
    out = llm.generate([prompt], GREEDY, use_tqdm=False)[0]
    assert out["token_ids"] == hf_greedy(path, prompt, 10)


def test_chunked_prefill(checkpoint, hf_greedy):
    path = checkpoint("gqa4-untied")
    # 24 tokens a step: prompts of 50 and 70 arrive in chunks, several partially prefilled at once
    llm = LLM(path, kvcache_block_size=16, num_kvcache_blocks=64, max_num_batched_tokens=24)
    prompts = prompts_of([50, 5, 70, 3])
    outputs = llm.generate(prompts, GREEDY, use_tqdm=False)
    for prompt, out in zip(prompts, outputs):
        assert out["token_ids"] == hf_greedy(path, prompt, 10)


def test_chunks_across_several_sequences(checkpoint):
    """The token budget splits prompts over steps and more than one sequence is mid-prefill."""
    llm = LLM(checkpoint("gqa2-tied"), kvcache_block_size=16, num_kvcache_blocks=64, max_num_batched_tokens=20)
    for prompt in prompts_of([30, 30, 30]):
        llm.add_request(prompt, GREEDY)
    batch = llm.scheduler.schedule()
    assert batch.num_scheduled_tokens == [20]
    llm.scheduler.postprocess(batch, llm.runner.launch(batch).tokens())
    batch = llm.scheduler.schedule()
    assert batch.num_scheduled_tokens == [10, 10]
    llm.scheduler.postprocess(batch, llm.runner.launch(batch).tokens())
    partial = [s for s in llm.scheduler.running if 0 < s.num_computed_tokens < s.num_prompt_tokens]
    assert len(partial) == 1
    while not llm.is_finished():
        llm.step()
    assert llm.kv_cache.num_free_blocks == llm.kv_cache.num_blocks


def test_preemption(checkpoint, hf_greedy):
    path = checkpoint("gqa2-tied")
    # 12 blocks of 16 tokens for 8 sequences that each grow to ~30 tokens: some must be preempted
    llm = LLM(path, kvcache_block_size=16, num_kvcache_blocks=12)
    prompts = prompts_of([20, 14, 25, 9, 17, 22, 12, 18])
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    outputs = llm.generate(prompts, params, use_tqdm=False)
    assert llm.scheduler.num_preemptions > 0
    for prompt, out in zip(prompts, outputs):
        assert out["token_ids"] == hf_greedy(path, prompt, 12)
    assert llm.kv_cache.num_free_blocks == llm.kv_cache.num_blocks


def test_block_size_256_and_sharded_checkpoint(tmp_path, hf_greedy):
    from inferlab.tiny_model import make_checkpoint

    path = make_checkpoint(str(tmp_path / "sharded"), max_shard_size="40KB", tie_word_embeddings=False)
    assert len(list(tmp_path.glob("sharded/*.safetensors"))) > 1
    llm = LLM(path, kvcache_block_size=256, num_kvcache_blocks=4)
    prompts = prompts_of([3, 300])
    for prompt, out in zip(prompts, llm.generate(prompts, GREEDY, use_tqdm=False)):
        assert out["token_ids"] == hf_greedy(path, prompt, 10)


def test_torch_compile_path_matches_hf(checkpoint, hf_greedy):
    """The fused (torch.compile) norms, rotary and SiLU, on by default on CUDA, compute the same."""
    path = checkpoint("gqa2-tied")
    llm = LLM(path, kvcache_block_size=16, num_kvcache_blocks=16, model_options={"torch_compile": True})
    prompts = prompts_of([9, 20])
    for prompt, out in zip(prompts, llm.generate(prompts, GREEDY, use_tqdm=False)):
        assert out["token_ids"] == hf_greedy(path, prompt, 10)
