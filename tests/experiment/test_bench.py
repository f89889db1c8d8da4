"""The bench workload: bench.py's exact numbers by default, fitted to the model, shared prefixes
on request."""

import json
import random

import pytest

from inferlab.conf import BenchConfig
from inferlab.experiment.workload import bench_workload


def bench_py_workload():
    """nano-vllm's bench.py, verbatim but for the LLM."""
    from random import randint, seed

    seed(0)
    num_seqs = 256
    max_input_len = 1024
    max_ouput_len = 1024
    prompt_token_ids = [[randint(0, 10000) for _ in range(randint(100, max_input_len))] for _ in range(num_seqs)]
    max_tokens = [randint(100, max_ouput_len) for _ in range(num_seqs)]
    return prompt_token_ids, max_tokens


def test_default_is_bench_py_workload():
    state = random.getstate()
    try:
        expected_prompts, expected_max_tokens = bench_py_workload()
    finally:
        random.setstate(state)
    prompts, params = bench_workload(BenchConfig(), vocab_size=151936, max_model_len=4096)
    assert prompts == expected_prompts
    assert [p.max_tokens for p in params] == expected_max_tokens
    assert all(p.temperature == 0.6 and p.ignore_eos for p in params)


def test_fits_a_tiny_vocabulary_and_max_model_len():
    bench = BenchConfig(num_seqs=40, min_len=10, max_len=90, min_output_len=5, max_output_len=60)
    prompts, params = bench_workload(bench, vocab_size=384, max_model_len=64)
    assert len(prompts) == 40
    assert all(0 <= t < 384 for prompt in prompts for t in prompt)
    assert all(
        1 <= len(prompt) <= 63 and p.max_tokens >= 1 and len(prompt) + p.max_tokens <= 64
        for prompt, p in zip(prompts, params)
    )
    assert any(len(prompt) == 63 for prompt in prompts)  # some prompts had to be cut


def test_shared_prefixes_keep_bench_py_numbers_after_them():
    plain = BenchConfig(num_seqs=30, min_len=5, max_len=20, seed=3)
    shared = BenchConfig(num_seqs=30, min_len=5, max_len=20, seed=3, shared_prefix_len=12, num_prefixes=3)
    plain_prompts, plain_params = bench_workload(plain, vocab_size=50000, max_model_len=4096)
    prompts, params = bench_workload(shared, vocab_size=50000, max_model_len=4096)
    assert [p[12:] for p in prompts] == plain_prompts
    assert [p.max_tokens for p in params] == [p.max_tokens for p in plain_params]
    prefixes = {tuple(p[:12]) for p in prompts}
    assert len(prefixes) == 3


@pytest.mark.parametrize(
    "settings,message",
    [
        (dict(num_seqs=0), "bench.num_seqs must be >= 1"),
        (dict(min_len=50, max_len=10), "1 <= min_len <= max_len, got 50, 10"),
        (dict(min_output_len=0), "1 <= min_output_len <= max_output_len"),
        (dict(num_prefixes=0), "bench.num_prefixes must be >= 1"),
        (dict(shared_prefix_len=-1), "bench.shared_prefix_len must be >= 0"),
    ],
)
def test_bad_settings_are_named(settings, message):
    with pytest.raises(ValueError, match=message):
        bench_workload(BenchConfig(**settings), vocab_size=384, max_model_len=4096)


TINY = [
    "job=bench",
    "engine.device=cpu",
    "engine.kvcache_block_size=16",
    "engine.num_kvcache_blocks=128",
    "engine.max_model_len=128",
    "bench.num_seqs=3",
    "bench.min_len=8",
    "bench.max_len=24",
    "bench.min_output_len=2",
    "bench.max_output_len=4",
]


def test_repeats_report_mean_and_std(tmp_path, one_torch_thread):
    from inferlab.conf import compose
    from inferlab.experiment.bench import run_bench

    result = run_bench(compose([*TINY, "bench.repeats=2", "bench.warmup=false"]), output_dir=str(tmp_path))
    saved = json.loads((tmp_path / "result.json").read_text())
    assert saved["num_repeats"] == 2 and len(saved["repeats"]) == 2
    per_repeat = [r["output_tokens_per_s"] for r in saved["repeats"]]
    assert saved["output_tokens_per_s"] == pytest.approx(sum(per_repeat) / 2)
    assert saved["std"]["output_tokens_per_s"] == pytest.approx(abs(per_repeat[0] - per_repeat[1]) / 2**0.5)
    # each repeat its own draw (bench.seed + i), on a fresh prefix cache: every prompt token computed
    assert [r["num_prefill_tokens"] for r in saved["repeats"]] == [r["num_prompt_tokens"] for r in saved["repeats"]]
    assert saved["num_output_tokens"] == result["num_output_tokens"]
    assert saved["ci95"]["output_tokens_per_s"] > 0 and set(saved["ttft_s"]["ci95"]) == {
        "mean",
        "std",
        "p50",
        "p90",
        "p99",
    }


def test_a_failed_run_writes_its_error_into_result_json(tmp_path):
    from inferlab.conf import compose
    from inferlab.experiment.bench import run_bench

    cfg = compose([*TINY, f"model.path={tmp_path / 'no-such-checkpoint'}"])
    with pytest.raises(Exception) as error:
        run_bench(cfg, output_dir=str(tmp_path / "run"))
    saved = json.loads((tmp_path / "run" / "result.json").read_text())
    assert saved["error"] == f"{type(error.value).__name__}: {error.value}"
    assert saved["choices"]["bench.num_seqs"] == 3 and saved["bench"]["num_seqs"] == 3
