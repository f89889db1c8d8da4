"""The nano-vllm-compatible surface: LLM(path, **settings).generate(prompts, params, use_tqdm)."""

import logging

import pytest
import torch

from inferlab import LLM, SamplingParams


@pytest.fixture(scope="module")
def llm(checkpoint):
    return LLM(
        checkpoint("gqa2-tied"),
        kvcache_block_size=16,
        num_kvcache_blocks=64,
        enforce_eager=True,
        max_num_batched_tokens=512,
        max_num_seqs=8,
        max_model_len=256,
        gpu_memory_utilization=0.5,
        tensor_parallel_size=1,
        device="cpu",
        dtype="float32",
        scheduler="fcfs",
        kv_cache="paged",
        attention="torch",
        model="qwen3",
        sampler="default",
    )


def test_outputs_in_input_order_with_per_prompt_params(llm):
    prompts = ["Hello, world!", [5, 6, 7, 8, 9, 10, 11], "Once upon a time"]
    params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in (9, 2, 5)]
    outputs = llm.generate(prompts, params, use_tqdm=False)
    assert [len(o["token_ids"]) for o in outputs] == [9, 2, 5]
    for prompt, param, out in zip(prompts, params, outputs):
        alone = llm.generate([prompt], param, use_tqdm=False)[0]
        assert alone == out
        assert out["text"] == llm.tokenizer.decode(out["token_ids"])


def test_outputs_are_built_as_requests_finish(llm, monkeypatch):
    # a finished request's text is decoded while the device computes the others' tokens
    build = llm.output
    still_running = []
    monkeypatch.setattr(llm, "output", lambda seq: still_running.append(llm.scheduler.has_unfinished()) or build(seq))
    params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in (2, 9)]
    outputs = llm.generate([[1, 2, 3], [4, 5, 6]], params, use_tqdm=False)
    assert still_running == [True, False]
    assert [len(o["token_ids"]) for o in outputs] == [2, 9]
    assert all(o["text"] == llm.tokenizer.decode(o["token_ids"]) for o in outputs)


def test_string_prompt_equals_its_token_ids(llm):
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    ids = llm.tokenizer.encode("The quick brown fox")
    assert llm.generate(["The quick brown fox"], params, use_tqdm=False) == llm.generate([ids], params, use_tqdm=False)


def test_default_sampling_params_and_eos(llm):
    out = llm.generate(["Hello"], use_tqdm=False)[0]
    assert 1 <= len(out["token_ids"]) <= SamplingParams().max_tokens
    if out["finish_reason"] == "stop":
        assert out["token_ids"][-1] == llm.tokenizer.eos_token_id


def test_max_model_len_caps_generation(llm):
    out = llm.generate([[3] * 250], SamplingParams(temperature=0, max_tokens=50, ignore_eos=True), use_tqdm=False)[0]
    assert len(out["token_ids"]) == 6 and out["finish_reason"] == "length"


def test_tqdm_shows_prefill_and_decode_rates(llm, capsys):
    llm.generate([[1, 2, 3]] * 3, SamplingParams(temperature=0, max_tokens=4, ignore_eos=True), use_tqdm=True)
    err = capsys.readouterr().err
    assert "Generating" in err and "Prefill=" in err and "Decode=" in err and "tok/s" in err


def test_step_api(llm):
    request_id = llm.add_request([4, 5, 6], SamplingParams(temperature=0, max_tokens=3, ignore_eos=True))
    finished = []
    while not llm.is_finished():
        finished += llm.step().finished
    assert [s.request_id for s in finished] == [request_id]
    assert (
        llm.output(finished[0])["token_ids"]
        == llm.generate([[4, 5, 6]], SamplingParams(temperature=0, max_tokens=3, ignore_eos=True), use_tqdm=False)[0][
            "token_ids"
        ]
    )


def test_embedded_default_model_runs():
    llm = LLM(kvcache_block_size=16, num_kvcache_blocks=32)
    out = llm.generate(["Hello, world!"], SamplingParams(max_tokens=5, ignore_eos=True), use_tqdm=False)[0]
    assert len(out["token_ids"]) == 5 and isinstance(out["text"], str)
    # the default device: CUDA where there is one (this file also runs on the GPU machine)
    assert llm.runner.device.type == ("cuda" if torch.cuda.is_available() else "cpu")
    assert llm.runner.dtype.is_floating_point


def test_embedded_model_says_once_that_its_text_is_gibberish(checkpoint, monkeypatch, caplog):
    from inferlab import tiny_model

    monkeypatch.setattr(tiny_model, "_announced", False)  # as in a fresh process
    caplog.set_level(logging.WARNING, logger="inferlab")
    LLM(checkpoint("gqa2-tied"), kvcache_block_size=16, num_kvcache_blocks=32, device="cpu")
    assert "embedded tiny model" not in caplog.text  # a path given: nothing to say
    for _ in range(2):
        LLM(kvcache_block_size=16, num_kvcache_blocks=32, device="cpu")
    said = [r.getMessage() for r in caplog.records if "embedded tiny model" in r.getMessage()]
    assert len(said) == 1
    assert "weights are random, so its text is gibberish" in said[0] and "LLM(path)" in said[0]


def test_embedded_model_is_built_deterministically(tmp_path):
    import hashlib

    from inferlab.tiny_model import make_checkpoint

    def digest(path):
        return {
            f.name: hashlib.sha256(f.read_bytes()).hexdigest()
            for f in sorted(path.iterdir())
            if f.suffix in (".safetensors", ".json")
        }

    a, b = tmp_path / "a", tmp_path / "b"
    make_checkpoint(str(a))
    make_checkpoint(str(b))
    assert digest(a) == digest(b) and "tokenizer.json" in digest(a)
