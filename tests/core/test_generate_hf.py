"""Greedy output equals Hugging Face transformers' Qwen3ForCausalLM, token for token, through every
path that changes how K/V reach the cache: plain, prefix-cache hits, chunked prefill, preemption."""

import pytest
import torch

from inferlab import LLM, SamplingParams
from inferlab.core.batch import ScheduledBatch
from inferlab.core.request import Request

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
    hits_before = llm.kv_manager.prefix_cache_stats()[0]
    second = llm.generate(prompts, GREEDY, use_tqdm=False)
    assert [o["token_ids"] for o in first] == [o["token_ids"] for o in second]
    # every full block is reused except the one holding each prompt's last token (recomputed)
    assert llm.kv_manager.prefix_cache_stats()[0] - hits_before == 16 + 0 + 32
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
    tokens = llm.runner.launch(batch).tokens()
    llm.scheduler.resolve(llm.scheduler.advance(batch, tokens), tokens)
    batch = llm.scheduler.schedule()
    assert batch.num_scheduled_tokens == [10, 10]
    tokens = llm.runner.launch(batch).tokens()
    llm.scheduler.resolve(llm.scheduler.advance(batch, tokens), tokens)
    partial = [s for s in llm.scheduler.running if 0 < s.num_computed_tokens < s.num_prompt_tokens]
    assert len(partial) == 1
    while not llm.is_finished():
        llm.step()
    assert llm.kv_manager.num_free_blocks == llm.kv_manager.num_blocks


def test_one_token_sequences_lead_the_step_layout(checkpoint):
    """The runner lays a step's one-token sequences out first (attention backends may run them as
    decodes); each request's logits are still the ones it gets in a step of its own."""
    llm = LLM(checkpoint("gqa2-tied"), kvcache_block_size=16, num_kvcache_blocks=64)
    # batch order: a prompt's last chunk (samples), a decode, a first chunk (does not sample), a decode
    parts = [(4, 3, 7), (9, 1, 10), (0, 2, 8), (20, 1, 21)]  # (computed, scheduled, held) tokens
    requests = []
    for i, (computed, scheduled, held) in enumerate(parts):
        request = Request(100 + i, [(31 * i + 7 * j) % 300 + 3 for j in range(held)], GREEDY)
        request.num_computed_tokens = computed
        assert llm.kv_manager.allocate(request, computed + scheduled)
        requests.append(request)

    def step_of(rows):
        batch = ScheduledBatch(
            [requests[i] for i in rows],
            [parts[i][1] for i in rows],
            [llm.kv_manager.block_table(requests[i]) for i in rows],
        )
        return llm.runner.prepare_inputs(batch)

    step = step_of(range(4))
    assert (step.num_decodes, step.max_decode_seq_len, step.num_tokens) == (2, 21, 7)
    a, b, c, d = requests
    assert step.longs[:7].tolist() == [b.token_ids[9], d.token_ids[20], *a.token_ids[4:7], *c.token_ids[:2]]
    assert step.sample_rows == [0, 1, 3]  # in the batch's order
    assert step.longs[21:24].tolist() == [4, 0, 1]  # where a's, b's and d's last tokens are laid out
    assert step.longs[24:].tolist() == [len(r.token_ids) for r in (a, b, d)]  # the tokens they sample
    together = llm.runner.forward_logits(step)
    for row, i in enumerate(step.sample_rows):
        alone = llm.runner.forward_logits(step_of([i]))
        torch.testing.assert_close(together[row], alone[0], atol=1e-4, rtol=1e-4)


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
    assert llm.kv_manager.num_free_blocks == llm.kv_manager.num_blocks


def test_block_size_256_and_sharded_checkpoint(tmp_path, hf_greedy):
    from inferlab.tiny_model import make_checkpoint

    path = make_checkpoint(str(tmp_path / "sharded"), max_shard_size="40KB", tie_word_embeddings=False)
    assert len(list(tmp_path.glob("sharded/*.safetensors"))) > 1
    llm = LLM(path, kvcache_block_size=256, num_kvcache_blocks=4)
    prompts = prompts_of([3, 300])
    for prompt, out in zip(prompts, llm.generate(prompts, GREEDY, use_tqdm=False)):
        assert out["token_ids"] == hf_greedy(path, prompt, 10)


@pytest.mark.slow
def test_torch_compile_path_matches_hf(checkpoint, hf_greedy):
    """The fused (torch.compile) norms, rotary and SiLU, on by default on CUDA, compute the same."""
    path = checkpoint("gqa2-tied")
    llm = LLM(path, kvcache_block_size=16, num_kvcache_blocks=16, model_options={"torch_compile": True})
    prompts = prompts_of([9, 20])
    for prompt, out in zip(prompts, llm.generate(prompts, GREEDY, use_tqdm=False)):
        assert out["token_ids"] == hf_greedy(path, prompt, 10)
