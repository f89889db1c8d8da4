"""Overlap scheduling (the next step is scheduled before this one's tokens are read) changes when
the CPU works, never what is generated."""

import pytest

from inferlab import LLM, SamplingParams


def engines(path, **settings):
    base = {"kvcache_block_size": 16, "num_kvcache_blocks": 40, **settings}
    return LLM(path, overlap_scheduling=False, **base), LLM(path, overlap_scheduling=True, **base)


PROMPTS = [[(7 * i + 3 * j) % 200 + 3 for j in range(n)] for i, n in enumerate([5, 17, 33, 2, 48, 11, 20, 9])]


@pytest.mark.parametrize(
    "settings",
    [
        dict(),
        dict(max_num_batched_tokens=24),  # chunked prefill
        dict(num_kvcache_blocks=10),  # preemption
    ],
)
def test_greedy_outputs_unchanged(checkpoint, hf_greedy, settings):
    path = checkpoint("gqa4-untied")
    sync, overlap = engines(path, **settings)
    params = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
    expected = sync.generate(PROMPTS, params, use_tqdm=False)
    assert overlap.generate(PROMPTS, params, use_tqdm=False) == expected
    assert expected[1]["token_ids"] == hf_greedy(path, PROMPTS[1], 10)
    assert overlap.is_finished() and overlap.kv_manager.num_free_blocks == overlap.kv_manager.num_blocks
    if settings.get("num_kvcache_blocks") == 10:
        assert sync.scheduler.num_preemptions > 0 and overlap.scheduler.num_preemptions > 0


def test_stops_and_seeded_sampling_unchanged(checkpoint):
    sync, overlap = engines(checkpoint("gqa2-tied"))
    free = sync.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=12, ignore_eos=True), use_tqdm=False)
    params = []
    for i, out in enumerate(free):
        stop_token = out["token_ids"][4 + i % 3]  # ends each request early, at a different step
        text = out["text"]
        params.append(
            SamplingParams(temperature=0, max_tokens=12, stop_token_ids=[stop_token])
            if i % 2
            else SamplingParams(temperature=0, max_tokens=12, stop=[text[len(text) // 2 :][:2] or "x"])
        )
    params[0] = SamplingParams(temperature=0.9, top_p=0.9, max_tokens=12, seed=5)
    expected = sync.generate(PROMPTS, params, use_tqdm=False)
    assert overlap.generate(PROMPTS, params, use_tqdm=False) == expected
    assert any(o["finish_reason"] == "stop" for o in expected)


def test_step_api_reports_only_resolved_tokens(checkpoint):
    _, overlap = engines(checkpoint("gqa2-tied"))
    ids = [overlap.add_request(p, SamplingParams(temperature=0, max_tokens=3, ignore_eos=True)) for p in PROMPTS[:3]]
    reported = []
    while not overlap.is_finished():
        finished = overlap.step().finished
        for seq in finished:
            assert all(t >= 0 for t in seq.token_ids) and seq.num_output_tokens == 3
        reported += [s.request_id for s in finished]
    assert sorted(reported) == sorted(ids)
