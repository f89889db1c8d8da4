"""inferlab-report on fabricated sweeps: latency-load curves whose plotted points are the results,
labels that name only what varied, and failed runs listed rather than dropped."""

import json
import os

import matplotlib
import pytest

from inferlab.experiment.figures import latency_figure
from inferlab.experiment.report import (
    LATENCY_PANELS,
    latency_series,
    load_runs,
    plot_throughput,
    report,
    run_label,
    swept_keys,
)

matplotlib.use("Agg")

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def write_run(root, name, choices, overrides=None, **figures):
    directory = os.path.join(root, name)
    os.makedirs(os.path.join(directory, ".hydra"), exist_ok=True)
    with open(os.path.join(directory, ".hydra", "config.yaml"), "w") as f:
        f.write("job:\n  name: bench\n")
    with open(os.path.join(directory, ".hydra", "overrides.yaml"), "w") as f:
        f.write("".join(f"- {o}\n" for o in overrides or []))
    if figures:
        with open(os.path.join(directory, "result.json"), "w") as f:
            json.dump({"choices": choices, "overrides": overrides or [], **figures}, f)


def latency(ttft50, ttft99, tpot50, tpot99, ci=None):
    result = {
        "output_tokens_per_s": 100.0,
        "request_throughput": 1.0,
        "ttft_s": {"mean": ttft50, "p50": ttft50, "p90": ttft99, "p99": ttft99},
        "tpot_s": {"mean": tpot50, "p50": tpot50, "p90": tpot99, "p99": tpot99},
    }
    if ci is not None:
        result["ttft_s"]["ci95"] = {"p50": ci, "p99": ci}
        result["tpot_s"]["ci95"] = {"p50": ci / 10, "p99": ci / 10}
        result["num_repeats"] = 3
    return result


BASE = {"model": "qwen3", "kv_cache": "paged", "attention": "torch", "bench.arrival": "poisson", "bench.num_seqs": 64}


@pytest.fixture
def rate_sweep(tmp_path):
    """fcfs and sjf at 1, 2, 4 and 16 requests/s (TTFT p99 growing 256-fold), sjf at 16 failed."""
    number = 0
    for scheduler, factor in (("fcfs", 1.0), ("sjf", 0.5)):
        for rate in (1.0, 2.0, 4.0, 16.0):
            choices = {**BASE, "scheduler": scheduler, "bench.request_rate": rate}
            overrides = [f"scheduler={scheduler}", f"bench.request_rate={rate}"]
            if scheduler == "sjf" and rate == 16.0:
                write_run(tmp_path, str(number), choices, overrides)  # killed: no result.json
            else:
                figures = latency(0.1 * rate * factor, 0.05 * rate**2, 0.01 * (1 + rate / 10), 0.02, ci=0.01 * rate)
                write_run(tmp_path, str(number), choices, overrides, **figures)
            number += 1
    return tmp_path


def test_latency_curves_plot_the_results(rate_sweep, capsys):
    report(str(rate_sweep))
    out = capsys.readouterr().out
    assert (rate_sweep / "latency.png").read_bytes()[:8] == PNG_MAGIC
    assert (rate_sweep / "latency.pdf").read_bytes()[:5] == b"%PDF-"
    assert b"<svg" in (rate_sweep / "latency.svg").read_bytes()[:2000]
    assert not (rate_sweep / "report.png").exists()  # bars say nothing a load axis does not
    assert "latency.png" in out.splitlines()[-1]
    results, failed = load_runs(str(rate_sweep))
    series = latency_series(results, "bench.request_rate", LATENCY_PANELS)
    assert [line["label"] for line in series] == ["fcfs", "sjf"]
    fig = latency_figure(series, list(LATENCY_PANELS), "request rate (requests/s)", "test")
    titles = [ax.get_title() for ax in fig.axes]
    assert titles == ["TTFT p50 (ms)", "TTFT p99 (ms)", "TPOT p50 (ms)", "TPOT p99 (ms)"]
    by_label = {}
    for _, result in results:
        by_label.setdefault(result["choices"]["scheduler"], []).append(result)
    for ax, panel in zip(fig.axes, LATENCY_PANELS):
        metric, stat = panel.key.split(".")
        assert [line.get_label() for line in ax.lines] == ["fcfs", "sjf"]
        assert len(ax.collections) == 2  # a band each: the repeats' 95% interval
        for line, band, label in zip(ax.lines, ax.collections, ["fcfs", "sjf"]):
            runs = by_label[label]
            assert list(line.get_xdata()) == [r["choices"]["bench.request_rate"] for r in runs]
            assert list(line.get_ydata()) == pytest.approx([1000 * r[metric][stat] for r in runs])  # in ms
            heights = band.get_paths()[0].vertices[:, 1]
            assert max(heights) - min(heights) >= 2000 * min(r[metric]["ci95"][stat] for r in runs) - 1e-9
    assert fig.axes[1].get_yscale() == "log"  # TTFT p99 spans 0.05 .. 12.8 s
    assert fig.axes[3].get_yscale() == "linear"  # TPOT p99 is flat
    assert fig.axes[0].get_xscale() == "log" and list(fig.axes[0].get_xticks()) == [1.0, 2.0, 4.0, 16.0]
    # the lines stay apart when they coincide: each its own colour, line style and marker
    (fcfs, sjf) = fig.axes[3].lines  # TPOT p99 is 20 ms for both policies
    assert list(sjf.get_ydata()) == pytest.approx(list(fcfs.get_ydata())[: len(sjf.get_ydata())])
    assert fcfs.get_linestyle() != sjf.get_linestyle() and fcfs.get_marker() != sjf.get_marker()
    assert fcfs.get_markersize() > sjf.get_markersize() and fcfs.get_markerfacecolor() == "none"


def test_failed_runs_are_listed(rate_sweep, capsys):
    write_run(
        rate_sweep,
        "8",
        {**BASE, "scheduler": "lpm"},
        ["scheduler=lpm", "bench.request_rate=16.0"],
        error="RuntimeError: the scheduler stalled",
    )
    header, rows = report(str(rate_sweep))
    out = capsys.readouterr().out
    assert len(rows) == 7
    assert "failed runs (2):" in out
    assert "  7  scheduler=sjf bench.request_rate=16.0: no result.json: the job did not finish" in out
    assert "  8  scheduler=lpm bench.request_rate=16.0: RuntimeError: the scheduler stalled" in out


def test_a_result_json_that_is_no_bench_result_is_a_failed_run(tmp_path, capsys):
    write_run(tmp_path, "0", {**BASE, "scheduler": "fcfs"}, ["scheduler=fcfs"], output_tokens_per_s=100.0)
    for name, content in (("1", "[]"), ("2", "{}")):  # a list raised AttributeError; {} became a row of dashes
        write_run(tmp_path, name, {}, [f"run={name}"])
        (tmp_path / name / "result.json").write_text(content)
    header, rows = report(str(tmp_path))
    out = capsys.readouterr().out
    assert len(rows) == 1 and "failed runs (2):" in out
    assert "  1  run=1: result.json is not a bench result (an object with its choices)" in out


def test_a_sweep_of_only_failed_runs_still_reports_them(tmp_path, capsys):
    write_run(tmp_path, "0", {}, ["scheduler=fcfs"])
    header, rows = report(str(tmp_path))
    assert rows == [] and "failed runs (1):" in capsys.readouterr().out


def test_labels_name_only_what_varied(tmp_path):
    triton_options = {"attention.decode_block_n": 64, "attention.prefill_block_m": 32, "attention.num_warps": 4}
    torch_run = {**BASE, "scheduler": "fcfs", "attention": "torch"}
    triton_run = {**BASE, "scheduler": "fcfs", "attention": "triton", **triton_options}
    assert swept_keys([{"choices": torch_run}, {"choices": triton_run}]) == ["attention"]
    assert run_label(triton_run, ["attention"]) == "triton"
    write_run(tmp_path, "0", torch_run, output_tokens_per_s=120.0)
    write_run(tmp_path, "1", triton_run, output_tokens_per_s=80.0)
    results, _ = load_runs(str(tmp_path))
    drawn = plot_throughput(str(tmp_path / "report.png"), results, "attention")
    assert drawn == {"output_tokens_per_s": [120.0, 80.0]}
    header, rows = report(str(tmp_path))
    assert header[:2] == ["run", "attention"] and "attention.decode_block_n" not in header
    # settings that vary are named briefly, keys kept whole where their last part would clash
    keys = ["scheduler", "engine.max_num_seqs", "bench.seed", "scheduler.seed"]
    choices = {"scheduler": "lpm", "engine.max_num_seqs": 8, "bench.seed": 1, "scheduler.seed": 2}
    assert run_label(choices, keys) == "lpm, max_num_seqs=8, bench.seed=1, scheduler.seed=2"
    assert run_label({"bench.request_rate": 0.5}, ["bench.request_rate"]) == "request_rate=0.5"


def test_time_scaled_traces_are_placed_at_their_offered_rate(tmp_path):
    for number, (scale, offered) in enumerate([(1.0, 3.4), (0.5, 6.8), (0.25, 13.6)]):
        choices = {**BASE, "scheduler": "fcfs", "bench.arrival": "trace", "bench.time_scale": scale}
        write_run(
            tmp_path,
            str(number),
            choices,
            **latency(0.1 / scale, 0.3 / scale, 0.01, 0.02),
            workload={"offered_request_rate": offered},
        )
    report(str(tmp_path))
    results, _ = load_runs(str(tmp_path))
    (line,) = latency_series(results, "bench.time_scale", LATENCY_PANELS)
    assert line["x"] == [3.4, 6.8, 13.6] and line["ttft_s.p50"] == ([0.1, 0.2, 0.4], None)
    assert (tmp_path / "latency.png").is_file()


def test_no_latency_plot_when_the_load_does_not_vary(tmp_path, capsys):
    for number, scheduler in enumerate(["fcfs", "lpm"]):
        write_run(tmp_path, str(number), {**BASE, "scheduler": scheduler}, **latency(0.1, 0.2, 0.01, 0.02))
    header, rows = report(str(tmp_path))
    assert not (tmp_path / "latency.png").exists()
    assert "TTFT p50 ms" in header and [row[1] for row in rows] == ["fcfs", "lpm"]
    assert (tmp_path / "report.png").is_file() and (tmp_path / "report.svg").is_file()


ROUTER_OPTIONS = {
    "random": {"router.seed": 0},
    "round_robin": {},
    "least_load": {},
    "prefix_aware": {"router.cache_threshold": 0.3, "router.balance_abs_threshold": 64},
}


def test_a_sweep_over_routers_draws_one_line_per_router(tmp_path, capsys):
    """docs/cluster.md's study: four routers in one sweep, kv_aware's overlap_weight in a sweep of
    its own inside it; every router's options are among its choices, as flat_choices records them."""
    runs = [(router, options) for router, options in ROUTER_OPTIONS.items()]
    runs += [(f"kv_aware/{weight}", {"router.overlap_weight": float(weight)}) for weight in (1, 16)]
    for number, (name, options) in enumerate(runs):
        router = name.split("/")[0]
        for step, rate in enumerate((20.0, 60.0)):
            choices = {**BASE, "router": router, **options, "cluster.replicas": 8, "bench.request_rate": rate}
            figures = latency(0.1 * (number + 1) * rate, 0.2 * (number + 1) * rate, 0.01, 0.02)
            figures["ttft_s"]["p90"] = 0.15 * (number + 1) * rate
            write_run(tmp_path, os.path.join(name, str(step)), choices, **figures)
    header, rows = report(str(tmp_path))
    results, _ = load_runs(str(tmp_path))
    series = latency_series(results, "bench.request_rate", LATENCY_PANELS)
    labels = ["random", "round_robin", "least_load", "prefix_aware", "kv_aware, overlap_weight=1"]
    assert sorted(line["label"] for line in series) == sorted(labels + ["kv_aware, overlap_weight=16"])
    assert all(line["x"] == [20.0, 60.0] for line in series)
    assert (tmp_path / "latency.png").read_bytes()[:8] == PNG_MAGIC
    p90 = header.index("TTFT p90 ms")  # the study's table quotes TTFT p90
    assert len(rows) == 12
    assert [row[p90] for row in rows] == pytest.approx([1000 * r["ttft_s"]["p90"] for _, r in results])
