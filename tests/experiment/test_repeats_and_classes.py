"""Repeats that vary (each drawn from bench.seed + i, a simulation's noise reseeded, confidence
intervals over them) and SLO classes (bench.classes, a trace line's own class and settings, the
per-class figures and the tenants' fairness), with the settings they refuse."""

import json
import math
import re

import numpy as np
import pytest

from inferlab.conf import BenchConfig, compose
from inferlab.conf.bench import BenchConfigError, RequestClass, validate_bench
from inferlab.experiment.latency import RequestRecord, aggregate_repeats, ci95, latency_figures, t_975
from inferlab.experiment.workload import build_workload

VOCAB, MAX_LEN = 1000, 4096
POISSON = dict(arrival="poisson", request_rate=10.0, num_seqs=40, min_len=8, max_len=64)
TWO_CLASSES = [
    {"name": "interactive", "weight": 1.0, "slo_ttft_s": 0.5, "priority": 0, "metadata": {"deadline": 0.5}},
    {"name": "batch", "weight": 3.0, "slo_ttft_s": 20.0, "slo_tpot_s": 1.0, "priority": 1},
]


def trace_file(tmp_path, lines: list[dict]) -> str:
    path = tmp_path / "trace.jsonl"
    path.write_text("".join(json.dumps(line) + "\n" for line in lines))
    return str(path)


def lines_of(count: int, **extra) -> list[dict]:
    return [
        {"timestamp": 100 * i, "input_length": 40 + i, "output_length": 5, "hash_ids": [i], **extra}
        for i in range(count)
    ]


# -- repeats --------------------------------------------------------------------------------------


def test_repeat_i_draws_the_workload_from_seed_plus_i():
    bench = BenchConfig(**POISSON)
    first, second = (build_workload(bench, VOCAB, MAX_LEN, repeat) for repeat in (0, 1))
    assert first.seed == 0 and second.seed == 1
    assert [r.arrival_s for r in first.requests] != [r.arrival_s for r in second.requests]
    assert [r.output_len for r in first.requests] != [r.output_len for r in second.requests]
    seeded = build_workload(BenchConfig(**POISSON, seed=1), VOCAB, MAX_LEN)
    assert [(r.arrival_s, r.prompt_token_ids, r.output_len) for r in seeded.requests] == [
        (r.arrival_s, r.prompt_token_ids, r.output_len) for r in second.requests
    ]
    # each request's sampling seed is drawn too, the same for the same draw
    seeds = [[p.seed for p in w.sampling_params(bench)] for w in (first, second, seeded)]
    assert seeds[0] != seeds[1] == seeds[2] and len(set(seeds[0])) == len(seeds[0])


def test_a_traces_timestamps_and_lengths_stay_while_classes_are_drawn_again(tmp_path):
    bench = BenchConfig(arrival="trace", trace=trace_file(tmp_path, lines_of(60)), classes=TWO_CLASSES)
    first, second = (build_workload(bench, VOCAB, MAX_LEN, repeat) for repeat in (0, 1))
    assert [(r.arrival_s, r.output_len, len(r.prompt_token_ids)) for r in first.requests] == [
        (r.arrival_s, r.output_len, len(r.prompt_token_ids)) for r in second.requests
    ]
    assert [r.metadata["class"] for r in first.requests] != [r.metadata["class"] for r in second.requests]


def test_the_t_quantiles_and_the_interval():
    assert [round(t_975(df), 3) for df in (1, 2, 10, 30)] == [12.706, 4.303, 2.228, 2.042]
    assert t_975(31) == pytest.approx(2.0395, abs=1e-3) and t_975(1000) == pytest.approx(1.9623, abs=1e-3)
    values = [1.0, 2.0, 3.0, 4.0]
    assert ci95(values) == pytest.approx(3.1824 * np.std(values, ddof=1) / 2)
    assert ci95([1.0]) is None and ci95([1.0, None]) is None


def test_repeats_aggregate_classes_with_their_intervals():
    runs = [
        {"output_tokens_per_s": 10.0 + i, "ttft_s": {"p50": 1.0 + i}, "classes": {"a": {"num_requests": 2,
         "ttft_s": {"p99": 2.0 * i}, "tpot_s": {"p99": None}, "slo_attainment": 0.5 + 0.1 * i, "goodput": 1.0}}}
        for i in range(3)
    ]  # fmt: skip
    result = aggregate_repeats(runs)
    half = 4.3027 * 1.0 / math.sqrt(3)  # t(2) x std 1 / sqrt(3)
    assert result["ci95"]["output_tokens_per_s"] == pytest.approx(half)
    assert result["ttft_s"]["ci95"]["p50"] == pytest.approx(half)
    a = result["classes"]["a"]
    assert a["ttft_s"]["p99"] == pytest.approx(2.0) and a["ttft_s"]["ci95"]["p99"] == pytest.approx(2 * half)
    assert a["ci95"]["slo_attainment"] == pytest.approx(0.1 * half) and a["ci95"]["goodput"] == 0.0
    assert a["tpot_s"]["ci95"]["p99"] is None
    assert [r["output_tokens_per_s"] for r in result["repeats"]] == [10.0, 11.0, 12.0]


def sim_bench(tmp_path, *overrides: str) -> dict:
    from inferlab.experiment.bench import run_bench

    cfg = compose(
        [
            "job=bench",
            "executor=simulated",
            "executor.profile=h200-qwen3-0.6b-triton",
            "bench.warmup=false",
            *overrides,
        ]
    )
    run_bench(cfg, output_dir=str(tmp_path))
    return json.loads((tmp_path / "result.json").read_text())


def test_simulated_repeats_vary_and_carry_confidence_intervals(tmp_path):
    """The complaint: simulated repeats were bit-identical. Each now draws its own arrivals and
    lengths, so the figures spread and their intervals have width."""
    result = sim_bench(
        tmp_path,
        "bench.arrival=poisson",
        "bench.request_rate=20",
        "bench.num_seqs=30",
        "bench.max_len=256",
        "bench.repeats=3",
    )
    per_repeat = [r["ttft_s"]["p50"] for r in result["repeats"]]
    assert len(set(per_repeat)) == 3
    assert result["ttft_s"]["p50"] == pytest.approx(np.mean(per_repeat))
    assert result["ttft_s"]["ci95"]["p99"] > 0 and result["ci95"]["request_throughput"] > 0
    assert result["workload"]["seed"] == 0
    lines = [json.loads(line) for line in (tmp_path / "requests.jsonl").read_text().splitlines()]
    assert sorted({line["repeat"] for line in lines}) == [0, 1, 2]


def test_a_simulated_trace_replay_varies_by_its_measured_noise(tmp_path):
    """A trace keeps its arrivals in every repeat; with a profile that measured its steps' spread,
    the simulation's step times vary (seeded by bench.seed + i), and so do the repeats."""
    from inferlab.sim.profile import load_profile

    profile = load_profile("h200-qwen3-0.6b-triton")
    for m in profile.measurements:
        m["seconds_std"] = 0.05 * m["seconds"]
    path = tmp_path / "noisy.json"
    profile.save(str(path))
    trace = trace_file(tmp_path, lines_of(20))
    args = ("bench.arrival=trace", f"bench.trace={trace}", "bench.repeats=2", f"executor.profile={path}")
    noisy = sim_bench(tmp_path / "noisy", *args)
    quiet = sim_bench(tmp_path / "quiet", *args, "executor.noise=0")
    assert noisy["repeats"][0]["ttft_s"]["p50"] != noisy["repeats"][1]["ttft_s"]["p50"]
    assert noisy["std"]["tpot_s"]["p50"] > 0
    # no noise and the same arrivals: the repeats agree (to the clock's rounding, which starts later)
    quiet_tpots = [r["tpot_s"][s] for r in quiet["repeats"] for s in ("mean", "p50", "p99")]
    assert quiet_tpots[:3] == pytest.approx(quiet_tpots[3:], rel=1e-9)


# -- classes --------------------------------------------------------------------------------------


def test_requests_are_assigned_classes_by_weight_with_their_settings():
    bench = BenchConfig(**{**POISSON, "num_seqs": 2000}, classes=TWO_CLASSES)
    workload = build_workload(bench, VOCAB, MAX_LEN)
    names = [r.metadata["class"] for r in workload.requests]
    assert names.count("interactive") / len(names) == pytest.approx(0.25, abs=0.03)
    interactive = next(r for r in workload.requests if r.metadata["class"] == "interactive")
    batch = next(r for r in workload.requests if r.metadata["class"] == "batch")
    assert interactive.metadata == {"class": "interactive", "deadline": 0.5, "slo_ttft_s": 0.5}
    assert batch.metadata == {"class": "batch", "slo_ttft_s": 20.0, "slo_tpot_s": 1.0}
    assert (interactive.priority, batch.priority) == (0, 1)
    again = build_workload(bench, VOCAB, MAX_LEN)
    assert [r.metadata["class"] for r in again.requests] == names
    assert workload.summary()["classes"] == {"interactive": names.count("interactive"), "batch": names.count("batch")}
    # the prompts and arrivals are those of the workload without classes
    plain = build_workload(BenchConfig(**{**POISSON, "num_seqs": 2000}), VOCAB, MAX_LEN)
    assert [r.arrival_s for r in plain.requests] == [r.arrival_s for r in workload.requests]


def test_a_trace_lines_own_class_and_settings_win(tmp_path):
    lines = lines_of(4)
    lines[0].update({"class": "interactive"})
    lines[1].update({"class": "batch", "priority": 7, "slo_ttft_s": 3.0, "tenant": 42})
    lines[2].update({"slo_tpot_s": 0.25})  # no class: one is drawn, its own TPOT bound wins
    bench = BenchConfig(arrival="trace", trace=trace_file(tmp_path, lines), classes=TWO_CLASSES)
    requests = build_workload(bench, VOCAB, MAX_LEN).requests
    assert requests[0].metadata["class"] == "interactive" and requests[0].priority == 0
    assert requests[1].metadata == {"class": "batch", "slo_ttft_s": 3.0, "slo_tpot_s": 1.0, "tenant": "42"}
    assert requests[1].priority == 7
    assert requests[2].metadata["slo_tpot_s"] == 0.25 and requests[2].metadata["class"] in ("interactive", "batch")
    # without bench.classes, a line's own settings still hold (and it has no class)
    lines = lines_of(2)
    lines[0].update({"priority": 2, "slo_ttft_s": 1.0, "tenant": "t"})
    plain = build_workload(BenchConfig(arrival="trace", trace=trace_file(tmp_path, lines)), VOCAB, MAX_LEN).requests
    assert plain[0].priority == 2 and plain[0].metadata == {"slo_ttft_s": 1.0, "tenant": "t"}
    assert plain[1].metadata == {} and plain[1].priority == 0


def record(request_id, arrival, first, finish, tokens, metadata, prompt=10) -> RequestRecord:
    times = list(np.linspace(first, finish, tokens)) if tokens else []
    return RequestRecord(
        request_id=request_id,
        arrival_s=arrival,
        first_scheduled_s=arrival,
        first_token_s=times[0] if times else None,
        token_times_s=times,
        finish_s=finish,
        num_prompt_tokens=prompt,
        num_output_tokens=tokens,
        metadata=metadata,
    )


def test_per_class_figures_hold_each_requests_own_slos():
    """interactive: TTFT 0.2 and 0.8 against its 0.5 s bound; batch: TTFT 4 (bound 5) with TPOT
    0.5 (bound 1) and TTFT 1 with TPOT 2; a request without a class is held to the run's bound."""
    records = [
        record(0, 0.0, 0.2, 1.2, 3, {"class": "interactive", "slo_ttft_s": 0.5}),
        record(1, 1.0, 1.8, 2.8, 3, {"class": "interactive", "slo_ttft_s": 0.5}),
        record(2, 0.0, 4.0, 5.0, 3, {"class": "batch", "slo_ttft_s": 5.0, "slo_tpot_s": 1.0}),
        record(3, 2.0, 3.0, 9.0, 4, {"class": "batch", "slo_ttft_s": 5.0, "slo_tpot_s": 1.0}),
        record(4, 0.0, 3.0, 4.0, 2, {}),
    ]
    figures = latency_figures(records, wall_time_s=10.0, slo_ttft_s=2.0)
    assert figures["slo_attainment"] == pytest.approx(2 / 5) and figures["goodput"] == pytest.approx(0.2)
    interactive, batch = figures["classes"]["interactive"], figures["classes"]["batch"]
    assert interactive["num_requests"] == 2 and interactive["slo_attainment"] == 0.5
    assert interactive["goodput"] == pytest.approx(0.1)
    assert interactive["ttft_s"]["p50"] == pytest.approx(0.5)
    assert batch["slo_attainment"] == 0.5 and batch["tpot_s"]["mean"] == pytest.approx((0.5 + 2.0) / 2)
    assert set(figures["classes"]) == {"interactive", "batch"}
    # per-request SLOs alone (no run-wide bound) also make attainment count
    assert "slo_attainment" in latency_figures(records[:4], wall_time_s=10.0)


def test_tenant_fairness_is_jains_index_over_service_rates():
    """Tenant a's requests span 0..4 s and get 40 tokens (10 a second); b's get 20 tokens in 1 s."""
    records = [
        record(0, 0.0, 1.0, 2.0, 10, {"tenant": "a"}, prompt=10),
        record(1, 2.0, 3.0, 4.0, 10, {"tenant": "a"}, prompt=10),
        record(2, 1.0, 1.5, 2.0, 10, {"tenant": "b"}, prompt=10),
    ]
    figures = latency_figures(records, wall_time_s=4.0)
    assert figures["per_tenant"]["a"]["service_rate"] == pytest.approx(10.0)
    assert figures["per_tenant"]["b"]["service_rate"] == pytest.approx(20.0)
    assert figures["tenant_fairness"] == pytest.approx(30**2 / (2 * (100 + 400)))


def test_a_simulated_bench_reports_each_class(tmp_path):
    """Policies see the class's priority and metadata: under priority, the interactive class is
    served first, its TTFT below batch's; result.json and requests.jsonl carry the classes."""
    classes = (
        "bench.classes=[{name: interactive, weight: 1, slo_ttft_s: 0.05, priority: 0},"
        " {name: batch, weight: 1, slo_ttft_s: 5, priority: 1}]"
    )
    result = sim_bench(
        tmp_path,
        "scheduler=priority",
        "bench.num_seqs=64",
        "engine.max_num_seqs=8",
        classes,
        "bench.repeats=2",
    )
    interactive, batch = result["classes"]["interactive"], result["classes"]["batch"]
    assert interactive["num_requests"] + batch["num_requests"] == 64
    assert interactive["ttft_s"]["p50"] < batch["ttft_s"]["p50"]
    assert {"num_requests", "ttft_s", "tpot_s", "slo_attainment", "goodput"} <= set(interactive)
    assert "ci95" in interactive["ttft_s"] and "slo_attainment" in interactive["ci95"]
    lines = [json.loads(line) for line in (tmp_path / "requests.jsonl").read_text().splitlines()]
    assert {line["metadata"]["class"] for line in lines} == {"interactive", "batch"}
    assert all(line["priority"] == (0 if line["metadata"]["class"] == "interactive" else 1) for line in lines)
    assert sum(result["workload"]["classes"].values()) == 64  # repeat 0's draw


# -- bad input ------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "classes,message",
    [
        ([{"name": "a", "weight": 0}, {"name": "b", "weight": 0}], "the weights must sum to a positive number, got 0"),
        ([{"name": "a", "slo": 1.0}], "bench.classes[0]: unknown field 'slo'; a class has name, weight"),
        ([{"name": "a", "slo_ttft_s": -1.0}], "bench.classes[0].slo_ttft_s must be a positive number of seconds"),
        ([{"name": "a", "slo_tpot_s": 0}], "bench.classes[0].slo_tpot_s must be a positive number of seconds"),
        ([{"name": "a", "weight": -2}], "bench.classes[0].weight must be a finite number >= 0"),
        ([{"name": "a"}, {"name": "a"}], "bench.classes[1].name 'a' is given twice"),
        ([{"weight": 1}], "bench.classes[0].name must be a non-empty name"),
        ([{"name": "a", "priority": 0.5}], "bench.classes[0].priority must be an integer"),
        ([{"name": "a", "metadata": 3}], "bench.classes[0].metadata must be a mapping"),
        ([RequestClass("a", weight=float("nan"))], "bench.classes[0].weight must be a finite number >= 0"),
    ],
)
def test_bad_classes_are_refused_naming_the_field(classes, message):
    with pytest.raises(BenchConfigError, match=re.escape(message)):
        validate_bench(BenchConfig(classes=classes))


def test_bad_classes_fail_at_compose_time_before_anything_runs():
    with pytest.raises(BenchConfigError, match=re.escape("bench.classes[0].slo_ttft_s must be a positive number")):
        compose(["job=bench", "bench.classes=[{name: a, slo_ttft_s: -1}]"])
    with pytest.raises(Exception, match="slo"):  # Hydra's own refusal of a field RequestClass lacks
        compose(["job=bench", "bench.classes=[{name: a, slo: 1}]"])


def test_a_trace_class_that_is_not_defined_is_refused_naming_its_line(tmp_path):
    lines = lines_of(5)
    lines[3]["class"] = "gold"
    trace = trace_file(tmp_path, lines)
    with pytest.raises(BenchConfigError, match=re.escape("line 4: class 'gold' is not defined in bench.classes")):
        validate_bench(BenchConfig(arrival="trace", trace=trace, classes=TWO_CLASSES))
    with pytest.raises(BenchConfigError, match=re.escape("(none is defined)")):
        validate_bench(BenchConfig(arrival="trace", trace=trace))


@pytest.mark.parametrize(
    "extra,message",
    [
        ({"priority": "high"}, "line 1: priority must be an integer"),
        ({"slo_ttft_s": -3}, "line 1: slo_ttft_s must be a positive number of seconds"),
        ({"class": 5}, "line 1: class 5 is not defined in bench.classes"),
    ],
)
def test_a_trace_lines_bad_settings_are_refused_naming_the_line(tmp_path, extra, message):
    trace = trace_file(tmp_path, lines_of(2, **extra))
    with pytest.raises(BenchConfigError, match=re.escape(message)):
        build_workload(BenchConfig(arrival="trace", trace=trace), VOCAB, MAX_LEN)


@pytest.mark.parametrize(
    "settings,message",
    [
        ({"repeats": 0}, "bench.repeats must be >= 1"),
        ({"repeats": -3}, "bench.repeats must be >= 1"),
        ({"classes": TWO_CLASSES, "num_priorities": 3}, "use one or the other"),
        ({"classes": {"name": "a"}}, "bench.classes must be a list of classes"),
    ],
)
def test_other_settings_that_cannot_run(settings, message):
    with pytest.raises(BenchConfigError, match=re.escape(message)):
        validate_bench(BenchConfig(**settings))
