"""`inferlab-report DIR`: the table and plots of a run or a sweep.

Reads every bench job under DIR (a directory with result.json, or a Hydra job directory whose
run left none) and prints one row per run whose columns are the settings that vary between runs
(what was swept) and the figures, then the runs that failed, each with its settings and error.
Writes into DIR: report.csv (the table); report.png (throughput per configuration); and, when the
sweep varies the load, latency.png: TTFT and TPOT p50 and p99 against the request rate, one line
per value of whatever else varied, with error bars from repeats.
"""

import argparse
import csv
import json
import math
import os
import re
import sys
from dataclasses import dataclass

FIGURES = {  # result key (dotted: nested) -> column title; a column shows when some run has the figure
    "output_tokens_per_s": "output tok/s",
    "prefill_tokens_per_s": "prefill tok/s",
    "decode_tokens_per_s": "decode tok/s",
    "request_throughput": "req/s",
    "ttft_s.p50": "TTFT p50 s",
    "ttft_s.p99": "TTFT p99 s",
    "tpot_s.p50": "TPOT p50 s",
    "tpot_s.p99": "TPOT p99 s",
    "slo_attainment": "SLO attained",
    "goodput": "goodput req/s",
    "wall_time_s": "wall s",
    "num_prefill_tokens": "prefill tokens",
    "prefix_cache_hit_rate": "prefix hit",
    "num_preemptions": "preemptions",
    "num_repeats": "repeats",
}
PLOTTED = ("output_tokens_per_s", "prefill_tokens_per_s", "decode_tokens_per_s")
KINDS = ("model", "scheduler", "kv_cache", "attention", "sampler")
LATENCY_PANELS = (("ttft_s", "p50"), ("ttft_s", "p99"), ("tpot_s", "p50"), ("tpot_s", "p99"))
LOG_SPREAD = 10  # an axis whose largest value is this many times its smallest gets a log scale


@dataclass
class FailedRun:
    run: str  # directory relative to the report's root
    settings: list[str]  # the run's overrides
    reason: str


def natural_key(path: str) -> list:
    """Sorts sweep job dirs 0, 1, 2, ..., 10 rather than 0, 1, 10, 2."""
    return [int(part) if part.isdigit() else part for part in re.split(r"(\d+)", path)]


def _hydra_job(directory: str) -> tuple[str | None, list[str]]:
    """(job name, overrides) a Hydra job directory recorded in .hydra/, or (None, []) without one."""
    from omegaconf import OmegaConf

    hydra_dir = os.path.join(directory, ".hydra")
    if not os.path.isdir(hydra_dir):
        return None, []
    try:
        config = OmegaConf.load(os.path.join(hydra_dir, "config.yaml"))
        job = str(OmegaConf.select(config, "job.name"))
    except Exception:  # a job killed while Hydra wrote its config: still a run that failed
        job = "bench"
    try:
        overrides = [str(o) for o in OmegaConf.load(os.path.join(hydra_dir, "overrides.yaml"))]
    except Exception:
        overrides = []
    return job, overrides


def load_runs(root: str) -> tuple[list[tuple[str, dict]], list[FailedRun]]:
    """(run directory relative to root, result) of every finished bench run under root, and the
    runs that failed: a result.json holding an error or not JSON, or a bench job directory of
    Hydra's whose run wrote no result.json (killed, timed out, or still running)."""
    results, failed = [], []
    for directory, subdirs, files in os.walk(root):
        subdirs[:] = [d for d in subdirs if d not in (".hydra", ".submitit")]
        run = os.path.relpath(directory, root)
        job, overrides = _hydra_job(directory)
        if "result.json" in files:
            try:
                with open(os.path.join(directory, "result.json")) as f:
                    result = json.load(f)
            except (OSError, json.JSONDecodeError) as e:
                failed.append(FailedRun(run, overrides, f"unreadable result.json ({e})"))
                continue
            if not isinstance(result, dict) or not (result.get("error") or isinstance(result.get("choices"), dict)):
                failed.append(
                    FailedRun(run, overrides, "result.json is not a bench result (an object with its choices)")
                )
            elif result.get("error"):
                failed.append(FailedRun(run, result.get("overrides") or overrides, str(result["error"])))
            else:
                results.append((run, result))
        elif job is not None and job.endswith("bench"):
            failed.append(FailedRun(run, overrides, "no result.json: the job did not finish"))
    results.sort(key=lambda item: natural_key(item[0]))
    failed.sort(key=lambda item: natural_key(item.run))
    return results, failed


def load_results(root: str) -> list[tuple[str, dict]]:
    """(run directory relative to root, result) for every finished run under root."""
    return load_runs(root)[0]


def swept_keys(results: list[dict]) -> list[str]:
    """The settings that vary across runs, in the order they first appear: a key counts when it
    takes more than one value among the runs that have it, so the options of one plugin (present
    only in its runs) follow from its choice and do not count. With one run, or nothing swept,
    the plugin choices."""
    keys = []
    for result in results:
        keys += [k for k in result.get("choices", {}) if k not in keys]
    differing = [
        k
        for k in keys
        if len({json.dumps(r["choices"][k], sort_keys=True) for r in results if k in r.get("choices", {})}) > 1
    ]
    return differing or [k for k in KINDS if any(k in r.get("choices", {}) for r in results)]


def figure(result: dict, key: str):
    """result's figure at a dotted key ("ttft_s.p50"), or None."""
    value = result
    for part in key.split("."):
        if not isinstance(value, dict):
            return None
        value = value.get(part)
    return value


def short_names(keys: list[str]) -> dict[str, str]:
    """Each key's name in labels: a plugin kind stays implicit (its value says it), other keys
    lose their section ("bench.request_rate" -> "request_rate") unless that makes two alike."""
    last = [k.rsplit(".", 1)[-1] for k in keys]
    return {k: k if last.count(name) > 1 else name for k, name in zip(keys, last)}


def run_label(choices: dict, keys: list[str]) -> str:
    """A short label naming a run's values of keys: "lpm, max_num_seqs=8"."""
    names = short_names(keys)
    parts = []
    for key in keys:
        if key not in choices:
            continue
        value = format_setting(choices[key])
        parts.append(value if key in KINDS else f"{names[key]}={value}")
    return ", ".join(parts)


def build_table(results: list[tuple[str, dict]]) -> tuple[list[str], list[list]]:
    """Header and rows: run, the swept settings, then each figure some run has."""
    keys = swept_keys([r for _, r in results])
    shown = [key for key in FIGURES if any(figure(r, key) is not None for _, r in results)]
    header = ["run", *keys, *(FIGURES[key] for key in shown)]
    rows = [
        [run, *(result.get("choices", {}).get(k) for k in keys), *(figure(result, key) for key in shown)]
        for run, result in results
    ]
    return header, rows


def format_setting(value) -> str:
    """A setting as typed on the command line: 0.5, not 0.500."""
    if value is None:
        return "-"
    return f"{value:g}" if isinstance(value, float) else str(value)


def format_cell(value) -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        return f"{value:.3f}" if abs(value) < 10 else f"{value:.1f}"
    return str(value)


def format_table(header: list[str], rows: list[list], num_figures: int) -> str:
    num_keys = len(header) - num_figures
    cells = [header] + [
        [format_setting(v) if i < num_keys else format_cell(v) for i, v in enumerate(row)] for row in rows
    ]
    widths = [max(len(row[i]) for row in cells) for i in range(len(header))]
    lines = [
        "  ".join(c.ljust(w) if i < num_keys else c.rjust(w) for i, (c, w) in enumerate(zip(row, widths)))
        for row in cells
    ]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


def format_failed(failed: list[FailedRun]) -> str:
    lines = [f"failed runs ({len(failed)}):"]
    for run in failed:
        settings = " ".join(run.settings) or "(no overrides recorded)"
        lines.append(f"  {run.run}  {settings}: {run.reason}")
    return "\n".join(lines)


def write_csv(path: str, header: list[str], rows: list[list]) -> None:
    with open(path, "w", newline="") as f:
        writer = csv.writer(f)
        writer.writerow(header)
        writer.writerows([["" if v is None else v for v in row] for row in rows])


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")  # files only: no display needed
    import matplotlib.pyplot as plt

    return plt


def plot_throughput(path: str, results: list[tuple[str, dict]], title: str) -> dict[str, list]:
    """One horizontal bar panel per throughput figure that some run has, one bar per run labelled
    with its swept settings. Returns {figure key: the values drawn, in run order}."""
    plt = _pyplot()
    keys = swept_keys([r for _, r in results])
    labels = [run_label(result.get("choices", {}), keys) or run for run, result in results]
    plotted = [key for key in PLOTTED if any(figure(r, key) is not None for _, r in results)]
    fig, axes = plt.subplots(
        1, len(plotted), figsize=(4.5 * len(plotted) + 1.5, 1.4 + 0.4 * len(results)), sharey=True, squeeze=False
    )
    positions = list(range(len(results)))[::-1]  # first run on top
    drawn = {}
    for ax, key in zip(axes[0], plotted):
        values = [figure(result, key) or 0 for _, result in results]
        bars = ax.barh(positions, values, color="tab:blue")
        ax.bar_label(bars, labels=[f"{v:.0f}" for v in values], padding=3, fontsize=8)
        ax.set_title(FIGURES[key])
        ax.set_xlim(0, max(values + [1]) * 1.25)
        drawn[key] = values
    axes[0][0].set_yticks(positions, labels, fontsize=8)
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return drawn


def load_axis(results: list[dict]) -> tuple[str, str] | None:
    """(how to read a run's load, the x axis title) when the sweep varies the load: the request rate
    it asked for, or, when bench.time_scale varies, the rate the time-scaled trace offers."""
    keys = swept_keys(results)
    if "bench.request_rate" in keys:
        return "bench.request_rate", "request rate (requests/s)"
    if "bench.time_scale" in keys:
        return "bench.time_scale", "offered request rate (requests/s, time-scaled trace)"
    return None


def run_load(result: dict, load_key: str) -> float | None:
    if load_key == "bench.time_scale":
        return figure(result, "workload.offered_request_rate")
    return result.get("choices", {}).get(load_key)


def latency_series(results: list[tuple[str, dict]], load_key: str) -> list[dict]:
    """The latency-load lines: one per combination of the other swept settings, each
    {"label", "x", and per panel "ttft_s.p50": (values, stds or None)}, points sorted by load.
    Runs without latency figures (a result written before the bench recorded them) are left out."""
    keys = [k for k in swept_keys([r for _, r in results]) if k != load_key]
    lines: dict[str, list[dict]] = {}
    for _, result in results:
        load = run_load(result, load_key)
        if load is None or figure(result, "ttft_s.p50") is None:
            continue
        lines.setdefault(run_label(result.get("choices", {}), keys), []).append(result)
    series = []
    for label, group in lines.items():
        group.sort(key=lambda r: run_load(r, load_key))
        line = {"label": label, "x": [run_load(r, load_key) for r in group]}
        for metric, stat in LATENCY_PANELS:
            values = [figure(r, f"{metric}.{stat}") for r in group]
            stds = [figure(r, f"std.{metric}.{stat}") for r in group]
            line[f"{metric}.{stat}"] = (values, stds if any(s is not None for s in stds) else None)
        series.append(line)
    return series


def _spread_needs_log(values: list) -> bool:
    positive = [v for v in values if v is not None and v > 0]
    return len(positive) > 1 and max(positive) / min(positive) >= LOG_SPREAD


def _readable_log_ticks(axis, sweep_values: list | None = None) -> None:
    """Log-axis ticks a reader need not decode: at the sweep's own values when they are few (the
    load axis), else at 1, 2 and 5 times powers of ten; labelled 0.5, 2, 30 rather than 10^k."""
    from matplotlib import ticker

    distinct = sorted({v for v in sweep_values or () if v is not None and v > 0})
    if 1 < len(distinct) <= 12:
        axis.set_major_locator(ticker.FixedLocator(distinct))
    else:
        axis.set_major_locator(ticker.LogLocator(subs=(1.0, 2.0, 5.0)))
    axis.set_major_formatter(ticker.FuncFormatter(lambda value, _: f"{value:g}"))
    axis.set_minor_formatter(ticker.NullFormatter())


def latency_figure(series: list[dict], x_title: str, title: str):
    """The 2x2 latency-load figure of latency_series; returns the matplotlib Figure."""
    plt = _pyplot()
    fig, axes = plt.subplots(2, 2, figsize=(11, 7.5), squeeze=False)
    names = {"ttft_s": "TTFT", "tpot_s": "TPOT"}
    for ax, (metric, stat) in zip(axes.flat, LATENCY_PANELS):
        panel = f"{metric}.{stat}"
        for number, line in enumerate(series):
            values, stds = line[panel]
            points = [(x, y, s) for x, y, s in zip(line["x"], values, stds or [None] * len(values)) if y is not None]
            if not points:
                continue
            xs, ys, errors = zip(*points)
            ax.errorbar(
                xs,
                ys,
                yerr=[e or 0.0 for e in errors] if stds else None,
                marker="os^vD<>ph*"[number % 10],
                capsize=3,
                label=line["label"] or None,
            )
        ax.set_title(f"{names[metric]} {stat} (s)")
        ax.set_xlabel(x_title)
        ax.grid(True, which="both", alpha=0.3)
        ys = [y for line in series for y in line[panel][0]]
        if _spread_needs_log(ys):
            ax.set_yscale("log")
            _readable_log_ticks(ax.yaxis)
        else:
            ax.set_ylim(bottom=0)  # a linear latency axis from zero shows differences at their true size
        xs = [x for line in series for x in line["x"]]
        if _spread_needs_log(xs):
            ax.set_xscale("log")
            _readable_log_ticks(ax.xaxis, xs)
    handles, labels = axes[0][0].get_legend_handles_labels()
    if handles:
        fig.legend(handles, labels, loc="lower center", ncol=min(4, len(handles)), fontsize=9, frameon=False)
    fig.suptitle(title, fontsize=10)
    fig.tight_layout(rect=(0, 0.05 + 0.03 * math.ceil(len(handles) / 4) if handles else 0, 1, 1))
    return fig


def plot_latency(path: str, results: list[tuple[str, dict]], title: str) -> list[dict] | None:
    """Writes latency.png when the sweep varies the load and some run has latency figures;
    returns the series drawn (latency_series), or None when there is no such plot."""
    axis = load_axis([r for _, r in results])
    if axis is None:
        return None
    series = latency_series(results, axis[0])
    if not series:
        return None
    fig = latency_figure(series, axis[1], title)
    fig.savefig(path, dpi=100)
    _pyplot().close(fig)
    return series


def report(root: str) -> tuple[list[str], list[list]]:
    """Prints the table of root's runs and the failed ones, writes report.csv, report.png and, when
    the load varies, latency.png into root; returns the table's header and rows."""
    results, failed = load_runs(root)
    if not results and not failed:
        raise FileNotFoundError(f"no result.json under {root!r}: run `inferlab job=bench` (or a -m sweep) first")
    written = []
    header, rows = [], []
    if results:
        header, rows = build_table(results)
        num_figures = len(header) - 1 - len(swept_keys([r for _, r in results]))
        print(format_table(header, rows, num_figures))
        write_csv(os.path.join(root, "report.csv"), header, rows)
        written.append("report.csv")
        title = f"{os.path.normpath(root)} ({len(results)} runs" + (f", {len(failed)} failed)" if failed else ")")
        if any(figure(r, key) is not None for _, r in results for key in PLOTTED):
            plot_throughput(os.path.join(root, "report.png"), results, title)
            written.append("report.png")
        if plot_latency(os.path.join(root, "latency.png"), results, title) is not None:
            written.append("latency.png")
    if failed:
        print(format_failed(failed))
    if written:
        print(f"wrote {', '.join(os.path.join(root, name) for name in written)}")
    return header, rows


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="inferlab-report", description=__doc__.split("\n\n")[0])
    parser.add_argument("dir", help="a run or sweep directory (e.g. multirun/2026-01-01/12-00-00)")
    args = parser.parse_args(argv)
    if not os.path.isdir(args.dir):
        parser.error(f"{args.dir!r} is not a directory")
    try:
        report(args.dir)
    except FileNotFoundError as e:
        print(f"inferlab-report: {e}", file=sys.stderr)
        sys.exit(1)


if __name__ == "__main__":
    main()
