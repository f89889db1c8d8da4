"""job=bench on a cluster: result.json's replicas, the router under plugins, the load imbalance and
what the simulation cost; bench.trace_copies; runs that keep only first and last token times; and
the report's latency-load lines, one per router."""

import json
import os

import pytest

from inferlab.conf import compose
from inferlab.conf.bench import BenchConfigError
from inferlab.core.blocks import BlockPrompt
from inferlab.experiment.bench import run_bench
from inferlab.experiment.report import latency_series, load_results, report
from inferlab.experiment.workload import build_workload

DATA = os.path.join(os.path.dirname(os.path.dirname(__file__)), "data")
MOONCAKE = os.path.join(DATA, "mooncake_conversation_200.jsonl")
SIM = [
    "job=bench",
    "executor=simulated",
    "engine.kvcache_block_size=16",
    "engine.num_kvcache_blocks=256",
    "engine.max_model_len=1024",
    "bench.warmup=false",
]
POISSON = ["bench.arrival=poisson", "bench.request_rate=50", "bench.num_seqs=40", "bench.max_len=200"]


def test_bench_on_a_simulated_cluster(tmp_path, capsys):
    cfg = compose([*SIM, *POISSON, "cluster.replicas=3", "router=prefix_aware", "router.cache_threshold=0.5"])
    result = run_bench(cfg, str(tmp_path))
    assert result["num_requests"] == 40 and result["num_failed_requests"] == 0
    assert result["plugins"]["router"] == "prefix_aware"
    assert result["plugin_options"]["router"]["cache_threshold"] == 0.5
    assert result["cluster"] == {"replicas": 3, "backend": "local", "gpus_per_replica": 1.0}
    replicas = result["replicas"]
    assert [r["replica_id"] for r in replicas] == [0, 1, 2]
    assert sum(r["num_requests"] for r in replicas) == 40
    for replica in replicas:
        assert set(replica) >= {
            "replica_id",
            "num_requests",
            "ttft_s",
            "tpot_s",
            "prefix_cache_hit_rate",
            "busy_fraction",
        }
        assert 0 < replica["busy_fraction"] <= 1
    assert result["load_imbalance"] >= 1 and result["router_us_per_request"] > 0
    assert result["simulated_requests_per_host_s"] == pytest.approx(40 / result["simulator_seconds"])
    lines = [json.loads(line) for line in (tmp_path / "requests.jsonl").read_text().splitlines()]
    assert sorted({line["replica_id"] for line in lines}) == [0, 1, 2]
    out = capsys.readouterr().out
    assert "3 replicas (local), router prefix_aware: load imbalance" in out
    assert "simulated requests a second of host time" in out
    assert f": {result['num_steps']} steps in " in out  # every replica's steps, not the first one's


def test_each_repeat_reseeds_every_simulated_replicas_noise(tmp_path):
    """Repeat i's step-time noise draws from bench.seed + i on every replica, as on one engine: the
    second repeat of seed 0 is the first of seed 1."""
    from inferlab.sim.profile import load_profile

    profile = load_profile("h200-qwen3-0.6b-triton")
    for m in profile.measurements:
        m["seconds_std"] = 0.05 * m["seconds"]
    path = tmp_path / "noisy.json"
    profile.save(str(path))
    trace = ["bench.arrival=trace", f"bench.trace={MOONCAKE}", "bench.max_requests=12", "bench.fit=scale"]
    args = [*SIM, *trace, f"executor.profile={path}", "engine.max_model_len=4096", "cluster.replicas=2"]
    two = run_bench(compose([*args, "bench.repeats=2"]), str(tmp_path / "two"))
    one = run_bench(compose([*args, "bench.seed=1"]), str(tmp_path / "one"))
    assert two["repeats"][0]["ttft_s"]["p50"] != two["repeats"][1]["ttft_s"]["p50"]
    assert two["repeats"][1]["ttft_s"] == pytest.approx(one["ttft_s"], rel=1e-9)


def test_one_replica_stays_the_single_engine(tmp_path):
    result = run_bench(compose([*SIM, *POISSON]), str(tmp_path))
    assert "replicas" not in result and "cluster" not in result and "router" not in result["plugins"]


def test_a_bench_that_keeps_first_and_last_token_times(tmp_path):
    cfg = compose([*SIM, *POISSON, "cluster.replicas=2", "bench.record_token_times=false"])
    result = run_bench(cfg, str(tmp_path))
    assert result["itl_s"]["p50"] is None and result["tpot_s"]["p50"] is not None


def test_trace_copies_superimpose_the_trace_with_users_of_their_own():
    one = build_workload(
        compose(["bench.arrival=trace", f"bench.trace={MOONCAKE}", "bench.max_requests=20"]).bench, 50_000, 4096
    )
    three = build_workload(
        compose(
            ["bench.arrival=trace", f"bench.trace={MOONCAKE}", "bench.max_requests=20", "bench.trace_copies=3"]
        ).bench,
        50_000,
        4096,
    )
    assert len(three.requests) == 60 and three.summary()["num_prompt_tokens"] == 3 * one.summary()["num_prompt_tokens"]
    assert [r.arrival_s for r in three.requests] == [r.arrival_s for r in one.requests for _ in range(3)]
    assert all(isinstance(r.prompt_token_ids, BlockPrompt) for r in three.requests)
    # copy 0 is the trace itself; the copies share no block with it or with each other
    assert [list(r.prompt_token_ids) for r in three.requests[::3]] == [list(r.prompt_token_ids) for r in one.requests]
    first_blocks = [tuple(r.prompt_token_ids[:512]) for r in three.requests[:3]]
    assert len(set(first_blocks)) == 3  # every request opens with block 0: each copy its own
    copy1 = [tuple(r.prompt_token_ids[:512]) for r in three.requests[1::3]]
    assert len(set(copy1)) == 1  # within a copy the shared system prompt is shared


@pytest.mark.parametrize(
    "overrides, message",
    [
        (["bench.trace_copies=0", "bench.arrival=trace", f"bench.trace={MOONCAKE}"], "bench.trace_copies must be >= 1"),
        (["bench.trace_copies=2"], "bench.trace_copies applies to arrival=trace, not burst"),
    ],
)
def test_bad_trace_copies_are_refused(overrides, message):
    with pytest.raises(BenchConfigError, match=message):
        compose(["job=bench", *overrides])


def test_a_sweep_over_routers_draws_one_latency_line_per_router(tmp_path):
    for i, (router, rate) in enumerate([(r, q) for r in ("round_robin", "kv_aware") for q in (20, 80)]):
        cfg = compose(
            [
                *SIM,
                *POISSON[:1],
                f"bench.request_rate={rate}",
                "bench.num_seqs=30",
                "bench.max_len=100",
                "cluster.replicas=2",
                f"router={router}",
            ]
        )
        run_bench(cfg, str(tmp_path / str(i)))
    results = load_results(str(tmp_path))
    series = latency_series(results, "bench.request_rate")
    assert sorted(line["label"] for line in series) == ["kv_aware", "round_robin"]
    assert all(line["x"] == [20, 80] for line in series)
    header, _ = report(str(tmp_path))
    assert "router" in header and "load imbalance" in header


def test_generate_job_on_a_cluster(capsys):
    from inferlab.cli import generate

    cfg = compose(
        [
            "cluster.replicas=2",
            "router=least_load",
            "engine.device=cpu",
            "engine.num_kvcache_blocks=64",
            "generate.max_tokens=3",
        ]
    )
    generate(cfg)
    out = capsys.readouterr().out
    assert "router=least_load" in out and "9 tokens in" in out


def test_bad_router_options_fail_before_a_replica_is_built(monkeypatch, tmp_path):
    from inferlab.core import engine as engine_module
    from inferlab.core.plugins import PluginError

    monkeypatch.setattr(engine_module.LLMEngine, "__init__", lambda *a, **k: pytest.fail("an engine was built"))
    with pytest.raises(PluginError, match="router.overlap_weight must be a finite number >= 0"):
        run_bench(
            compose([*SIM, *POISSON, "cluster.replicas=2", "router=kv_aware", "router.overlap_weight=-2"]),
            str(tmp_path),
        )
