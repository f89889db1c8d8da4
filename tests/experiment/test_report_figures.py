"""inferlab-report's figures and tables for a paper: milliseconds with significant digits, rounded
ticks, SLO attainment, goodput and per-class panels, titles that say what ran, report.md, PDF and
SVG beside PNG, and each run's figures under vLLM's benchmark names."""

import json

import matplotlib
import pytest
from test_report import BASE, write_run

from inferlab.experiment.figures import latency_figure, rounded
from inferlab.experiment.report import (
    describe_runs,
    format_cell,
    latency_panels,
    latency_series,
    load_runs,
    main,
    report,
)
from inferlab.experiment.vllm_format import vllm_result

matplotlib.use("Agg")


def dist(p50, p99, ci=None):
    d = {"mean": p50, "std": p50 / 2, "p50": p50, "p90": p99, "p99": p99}
    if ci is not None:
        d["ci95"] = {"mean": ci, "p50": ci, "p90": ci, "p99": ci}
    return d


def simulated_result(offered, ttft, classes=True) -> dict:
    result = {
        "output_tokens_per_s": 28314.2,
        "request_throughput": offered,
        "num_requests": 200,
        "num_prompt_tokens": 100_000,
        "num_output_tokens": 50_000,
        "num_failed_requests": 0,
        "num_aborted_requests": 0,
        "wall_time_s": 200 / offered,
        "ttft_s": dist(ttft, 3 * ttft, ci=ttft / 10),
        "tpot_s": dist(0.004, 0.0052),
        "itl_s": dist(0.004, 0.006),
        "e2e_s": dist(2.0, 4.0),
        "slo_attainment": 0.9,
        "goodput": 0.9 * offered,
        "ci95": {"output_tokens_per_s": 120.0, "slo_attainment": 0.02},
        "num_repeats": 3,
        "finished_at": "2026-12-08T10:00:00+0000",
        "plugins": {"model": "qwen3"},
        "simulated": {"profile": "measured: NVIDIA H200, qwen3 bfloat16, triton, TP 1"},
        "bench": {"arrival": "trace", "trace": "/data/mooncake_conversation_trace.jsonl", "max_requests": 200},
        "workload": {"arrival": "trace", "offered_request_rate": offered, "num_requests": 200},
    }
    if classes:
        result["classes"] = {
            name: {
                "num_requests": 100,
                "ttft_s": dist(ttft * f, 3 * ttft * f, ci=ttft / 20),
                "tpot_s": dist(0.004, 0.005),
                "slo_attainment": 1 - 0.1 * f,
                "goodput": offered / 2,
                "ci95": {"slo_attainment": 0.05, "goodput": 0.1},
            }
            for name, f in (("interactive", 1), ("batch", 3))
        }
    return result


@pytest.fixture
def trace_sweep(tmp_path):
    """fcfs and priority replaying a trace at three time scales, offering 5.12821, 10.2564 and
    20.5128 requests/s, with classes and SLOs, three repeats each."""
    number = 0
    for scheduler in ("fcfs", "priority"):
        for scale, offered in ((1.0, 5.12821), (0.5, 10.2564), (0.25, 20.5128)):
            choices = {**BASE, "scheduler": scheduler, "bench.arrival": "trace", "bench.time_scale": scale}
            result = simulated_result(offered, 0.00312 * (1 + scale) * (2 if scheduler == "fcfs" else 1))
            write_run(tmp_path, str(number), choices, [f"scheduler={scheduler}"], **result)
            number += 1
    return tmp_path


def test_cells_keep_significant_digits():
    assert [format_cell(v) for v in (0.00312, 3.1249, 28314.2, 0.0, 1500.0, 7, None)] == [
        "0.00312",
        "3.12",
        "28314",
        "0",
        "1500",
        "7",
        "-",
    ]
    assert [rounded(v) for v in (5.12821, 20.5128, 0.5, 1200.0, 0)] == ["5.13", "20.5", "0.5", "1,200", "0"]


def test_the_table_shows_milliseconds_and_report_md_the_intervals(trace_sweep, capsys):
    header, rows = report(str(trace_sweep))
    out = capsys.readouterr().out
    ttft = header.index("TTFT p50 ms")
    assert rows[0][ttft] == pytest.approx(1000 * 0.00312 * 2 * 2)  # a simulated H200's 12.5 ms, not 0.012 s
    assert "12.5" in out
    markdown = (trace_sweep / "report.md").read_text()
    assert (
        "simulated qwen3 on measured: NVIDIA H200" in markdown and "trace mooncake_conversation_trace.jsonl" in markdown
    )
    assert "Means over 3 repeats, ± the half-width of a 95% confidence interval." in markdown
    assert "| 12.5 ± 1.25 |" in markdown  # TTFT p50 in ms with its interval
    assert "![latency.png](latency.png)" in markdown
    for extension in ("png", "pdf", "svg"):
        assert (trace_sweep / f"latency.{extension}").stat().st_size > 1000


def test_the_latency_figure_has_attainment_goodput_and_class_panels(trace_sweep):
    results, _ = load_runs(str(trace_sweep))
    panels = latency_panels([r for _, r in results])
    titles = [p.title for p in panels]
    assert titles[:4] == ["TTFT p50 (ms)", "TTFT p99 (ms)", "TPOT p50 (ms)", "TPOT p99 (ms)"]
    assert "SLO attainment (%)" in titles and "goodput (requests/s within their SLOs)" in titles
    assert "interactive: TTFT p99 (ms)" in titles and "batch: SLO attainment (%)" in titles
    series = latency_series(results, "bench.time_scale", panels)
    fig = latency_figure(series, panels, "offered request rate (requests/s)", describe_runs([r for _, r in results]))
    by_title = {ax.get_title(): ax for ax in fig.axes if ax.get_visible()}
    attainment = by_title["batch: SLO attainment (%)"]
    assert list(attainment.lines[0].get_ydata()) == pytest.approx([70.0] * 3)  # 1 - 0.3, in %
    assert attainment.get_ylim() == (0.0, 105.0)
    ttft = by_title["TTFT p50 (ms)"]
    assert [t.get_text() for t in ttft.get_xticklabels()] == ["5.13", "10.3", "20.5"]  # rounded ticks
    assert "NVIDIA H200" in fig._suptitle.get_text() and "mooncake" in fig._suptitle.get_text()


def test_describe_runs_names_the_model_the_workload_and_the_device():
    real = {
        "model_path": "/models/Qwen3-8B",
        "device_name": "NVIDIA H100 80GB HBM3",
        "bench": {"arrival": "poisson"},
        "workload": {"arrival": "poisson", "num_requests": 200},
    }
    assert describe_runs([real]) == "Qwen3-8B; poisson, 200 requests; NVIDIA H100 80GB HBM3"
    other = {**real, "device_name": "NVIDIA H200"}
    assert describe_runs([real, other]).endswith("NVIDIA H100 80GB HBM3 / NVIDIA H200")


def test_vllm_format_uses_vllm_bench_serves_names():
    result = simulated_result(10.0, 0.05)
    fields = vllm_result(result)
    assert fields["request_throughput"] == 10.0 and fields["request_goodput"] == 9.0
    assert fields["output_throughput"] == 28314.2
    assert fields["mean_ttft_ms"] == pytest.approx(50.0) and fields["median_ttft_ms"] == pytest.approx(50.0)
    assert fields["std_ttft_ms"] == pytest.approx(25.0) and fields["p99_ttft_ms"] == pytest.approx(150.0)
    for name in ("ttft", "tpot", "itl", "e2el"):
        assert {f"mean_{name}_ms", f"median_{name}_ms", f"std_{name}_ms", f"p99_{name}_ms"} <= set(fields)
    assert fields["median_e2el_ms"] == pytest.approx(2000.0)
    assert fields["completed"] == 200 and fields["total_input_tokens"] == 100_000
    assert fields["total_token_throughput"] == pytest.approx(150_000 / 20)
    assert fields["request_rate"] == 10.0  # a trace's offered rate; a burst's is "inf"
    burst = vllm_result({**result, "bench": {"arrival": "burst"}, "workload": {"arrival": "burst"}})
    assert burst["request_rate"] == "inf"


def test_the_command_writes_each_runs_vllm_json(trace_sweep, capsys):
    main([str(trace_sweep), "--format", "vllm"])
    written = sorted((trace_sweep / "vllm").iterdir())
    assert [p.name for p in written] == [f"{i}.json" for i in range(6)]
    fields = json.loads(written[0].read_text())
    assert fields["median_ttft_ms"] == pytest.approx(1000 * 0.00312 * 2 * 2)
    assert not (trace_sweep / "latency.png").exists()  # only what was asked for
    with pytest.raises(SystemExit):
        main([str(trace_sweep), "--format", "csv"])


def test_bands_stay_where_the_axis_can_show_them():
    """An interval wider than its value (three repeats, one far off) on a log axis ends above
    zero, and an attainment's within 0-100 %, rather than stretching the axis."""
    from inferlab.experiment.figures import Panel

    panels = [Panel("ttft_s.p50", "TTFT p50 (ms)", 1000), Panel("slo_attainment", "SLO attainment (%)", 100, rate=True)]
    series = [
        {
            "label": "fcfs",
            "x": [1.0, 2.0, 4.0],
            "ttft_s.p50": ([0.005, 0.1, 2.0], [0.001, 0.5, 3.0]),
            "slo_attainment": ([1.0, 0.8, 0.3], [0.0, 0.5, 0.4]),
        }
    ]
    fig = latency_figure(series, panels, "offered load (requests/s)", "bands")
    ttft, attainment = fig.axes[:2]
    assert ttft.get_yscale() == "log" and ttft.get_ylim()[0] == pytest.approx(2.5)  # half the smallest value, in ms
    lows = ttft.collections[0].get_paths()[0].vertices[:, 1]
    assert lows.min() >= 2.5
    band = attainment.collections[0].get_paths()[0].vertices[:, 1]
    assert band.min() >= 0 and band.max() <= 100 and attainment.get_ylim() == (0.0, 105.0)
