"""`inferlab-report DIR`: the table and plots of a run or a sweep.

Reads every bench job under DIR (a directory with result.json, or a Hydra job directory whose
run left none) and prints one row per run whose columns are the settings that vary between runs
(what was swept) and the figures (latencies in milliseconds), then the runs that failed, each with
its settings and error (from result.json or the job's error.txt), then, for a sweep (DIR holds
Hydra's multirun.yaml), every job the sweep was to run with its status: ok, failed, or missing (it
left no directory). Writes into DIR: report.csv (the table); report.md (what ran, the table with
the repeats' 95% intervals, the figures, the failed runs and the sweep's jobs); when the sweep
varies the load, latency.png/.pdf/.svg: TTFT and TPOT p50 and p99, SLO attainment, goodput and
throughput against the offered load, one line per value of whatever else varied, with the repeats'
95% intervals as bands and a row per class (inferlab.experiment.figures); else
report.png/.pdf/.svg, throughput per configuration. `--format vllm` writes each run's figures under
vLLM's `vllm bench serve` field names instead (inferlab.experiment.vllm_format), into DIR/vllm/.
"""

import argparse
import csv
import json
import os
import re
import sys
from dataclasses import dataclass

from inferlab.experiment.figures import Panel, latency_figure, save_figure, throughput_figure
from inferlab.experiment.vllm_format import vllm_result

FIGURES = {  # result key (dotted: nested) -> column title; a column shows when some run has the figure
    "output_tokens_per_s": "output tok/s",
    "prefill_tokens_per_s": "prefill tok/s",
    "decode_tokens_per_s": "decode tok/s",
    "request_throughput": "req/s",
    "ttft_s.p50": "TTFT p50 ms",
    "ttft_s.p90": "TTFT p90 ms",
    "ttft_s.p99": "TTFT p99 ms",
    "tpot_s.p50": "TPOT p50 ms",
    "tpot_s.p99": "TPOT p99 ms",
    "slo_attainment": "SLO attained",
    "goodput": "goodput req/s",
    "wall_time_s": "wall s",
    "num_prefill_tokens": "prefill tokens",
    "prefix_cache_hit_rate": "prefix hit",
    "num_preemptions": "preemptions",
    "load_imbalance": "load imbalance",
    "num_repeats": "repeats",
}
MILLISECONDS = {"ttft_s.p50", "ttft_s.p90", "ttft_s.p99", "tpot_s.p50", "tpot_s.p99"}  # results hold seconds
PLOTTED = ("output_tokens_per_s", "prefill_tokens_per_s", "decode_tokens_per_s")
KINDS = ("model", "scheduler", "kv_cache", "attention", "sampler", "router")
LATENCY_PANELS = (
    Panel("ttft_s.p50", "TTFT p50 (ms)", 1000),
    Panel("ttft_s.p99", "TTFT p99 (ms)", 1000),
    Panel("tpot_s.p50", "TPOT p50 (ms)", 1000),
    Panel("tpot_s.p99", "TPOT p99 (ms)", 1000),
)
RATE_PANELS = (
    Panel("output_tokens_per_s", "output throughput (tok/s)", rate=True),
    Panel("slo_attainment", "SLO attainment (%)", 100, rate=True),
    Panel("goodput", "goodput (requests/s within their SLOs)", rate=True),
)


@dataclass
class FailedRun:
    run: str  # directory relative to the report's root
    settings: list[str]  # the run's overrides
    reason: str


@dataclass
class SweepJob:
    number: int  # Hydra's job number
    overrides: list[str]
    run: str | None  # its directory relative to the report's root; None when it left none
    status: str  # "ok", "failed: why" or "missing"


JOB_ERROR_FILE = "error.txt"  # what a failed sweep job writes (inferlab.cli)


def _error_file_reason(directory: str) -> str | None:
    try:
        with open(os.path.join(directory, JOB_ERROR_FILE)) as f:
            return f.readline().strip() or "failed (error.txt says no more)"
    except OSError:
        return None


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
        elif JOB_ERROR_FILE in files:
            failed.append(FailedRun(run, overrides, _error_file_reason(directory)))
        elif job is not None and job.endswith("bench"):
            failed.append(FailedRun(run, overrides, "no result.json: the job did not finish"))
    results.sort(key=lambda item: natural_key(item[0]))
    failed.sort(key=lambda item: natural_key(item.run))
    return results, failed


def sweep_jobs(root: str, runs: list[str], failed: list[FailedRun]) -> list[SweepJob] | None:
    """Every job of the sweep in root, expanded from its multirun.yaml as Hydra's basic sweeper
    expands it, each found by its overrides among the job directories, with its status; None
    when root holds no multirun.yaml (or one whose sweep cannot be expanded so)."""
    from omegaconf import OmegaConf

    path = os.path.join(root, "multirun.yaml")
    if not os.path.isfile(path):
        return None
    try:
        from hydra._internal.core_plugins.basic_sweeper import BasicSweeper
        from hydra.core.override_parser.overrides_parser import OverridesParser

        task = [str(o) for o in OmegaConf.load(path).hydra.overrides.task]
        expanded = BasicSweeper.split_arguments(OverridesParser.create().parse_overrides(task), None)[0]
    except Exception:  # another sweeper's syntax, or a file Hydra did not finish writing
        return None
    directories = {}
    for directory, subdirs, _ in os.walk(root):
        subdirs[:] = [d for d in subdirs if d not in (".hydra", ".submitit")]
        job, overrides = _hydra_job(directory)
        if job is not None:
            directories.setdefault(tuple(overrides), os.path.relpath(directory, root))
    reasons = {f.run: f.reason for f in failed}
    jobs = []
    for number, overrides in enumerate(expanded):
        run = directories.get(tuple(overrides))
        if run is None:
            status = "missing: it left no directory (the sweep stopped before it, or it has not run yet)"
        elif run in reasons:
            status = f"failed: {reasons[run]}"
        elif run in runs:
            status = "ok"
        else:
            status = "unknown: its directory holds no result"
        jobs.append(SweepJob(number, overrides, run, status))
    return jobs


def format_jobs(jobs: list[SweepJob]) -> str:
    """One line per job: its number, the overrides that differ between jobs, its status."""
    varying = [i for i in range(max(map(len, (j.overrides for j in jobs)), default=0))
               if len({tuple(j.overrides[i : i + 1]) for j in jobs}) > 1]  # fmt: skip
    lines = [f"jobs of the sweep ({len(jobs)}, from multirun.yaml):"]
    for job in jobs:
        settings = " ".join(job.overrides[i] for i in varying if i < len(job.overrides)) or " ".join(job.overrides)
        lines.append(f"  {job.number}  {settings}: {job.status}")
    return "\n".join(lines)


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
        [run, *(result.get("choices", {}).get(k) for k in keys), *(shown_value(result, key) for key in shown)]
        for run, result in results
    ]
    return header, rows


def shown_value(result: dict, key: str, statistic: str = ""):
    """A figure as the table shows it (latencies in ms); statistic "ci95": its interval's half-width."""
    if statistic:
        head, _, last = key.rpartition(".")
        value = figure(result, f"{head}.ci95.{last}" if head else f"ci95.{last}")
    else:
        value = figure(result, key)
    if value is not None and key in MILLISECONDS:
        return value * 1000
    return value


def format_setting(value) -> str:
    """A setting as typed on the command line: 0.5, not 0.500."""
    if value is None:
        return "-"
    return f"{value:g}" if isinstance(value, float) else str(value)


def format_cell(value) -> str:
    """A figure with three significant digits (0.0734, 5.13, 28314): milliseconds of a simulated
    H200's TTFT read 3.12, not 0.003."""
    if value is None:
        return "-"
    if isinstance(value, float):
        if value == int(value) and abs(value) < 1e15:
            return str(int(value)) if abs(value) >= 100 or value == 0 else f"{value:.3g}"
        return f"{value:.0f}" if abs(value) >= 100 else f"{value:.3g}"
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


def describe_runs(results: list[dict]) -> str:
    """What the runs ran, for titles: the model (or the profile a simulation stood on), the
    workload and the device, each value that differs between runs joined with " / "."""

    def unique(values) -> str:
        return " / ".join(dict.fromkeys(str(v) for v in values if v))

    models, workloads, devices = [], [], []
    for result in results:
        simulated = result.get("simulated")
        if simulated:
            models.append(
                f"simulated {result.get('plugins', {}).get('model') or 'model'} on {simulated.get('profile')}"
            )
        else:
            path = result.get("model_path") or ""
            models.append(os.path.basename(os.path.normpath(path)) if path else result.get("plugins", {}).get("model"))
            devices.append(result.get("device_name"))
        bench = result.get("bench") or {}
        workload = result.get("workload") or {}
        if bench.get("arrival") == "trace":
            requests = f", first {bench['max_requests']}" if bench.get("max_requests") else ""
            workloads.append(f"trace {os.path.basename(str(bench.get('trace')))}{requests}")
        elif workload.get("arrival") or bench.get("arrival"):
            count = workload.get("num_requests")
            workloads.append(
                f"{workload.get('arrival') or bench.get('arrival')}" + (f", {count} requests" if count else "")
            )
    return "; ".join(part for part in (unique(models), unique(workloads), unique(devices)) if part)


def plot_throughput(path: str, results: list[tuple[str, dict]], title: str) -> dict[str, list]:
    """One horizontal bar panel per throughput figure that some run has, one bar per run labelled
    with its swept settings and coloured by the first swept setting's value; written as path's
    PNG, PDF and SVG (path ending in .png). Returns {figure key: the values drawn, in run order}."""
    keys = swept_keys([r for _, r in results])
    labels = [run_label(result.get("choices", {}), keys) or run for run, result in results]
    groups = [format_setting(result.get("choices", {}).get(keys[0])) if keys else "" for _, result in results]
    plotted = [key for key in PLOTTED if any(figure(r, key) is not None for _, r in results)]
    drawn = {key: [figure(result, key) or 0 for _, result in results] for key in plotted}
    fig = throughput_figure(labels, groups, drawn, {key: FIGURES[key] for key in plotted}, title)
    save_figure(fig, os.path.splitext(path)[0])
    return drawn


def load_axis(results: list[dict]) -> tuple[str, str] | None:
    """(how to read a run's load, the x axis title) when the sweep varies the load: the request rate
    it asked for, or, when bench.time_scale varies, the rate the time-scaled trace offers."""
    keys = swept_keys(results)
    if "bench.request_rate" in keys:
        return "bench.request_rate", "offered load (requests/s)"
    if "bench.time_scale" in keys:
        return "bench.time_scale", "offered load (requests/s, time-scaled trace)"
    return None


def run_load(result: dict, load_key: str) -> float | None:
    if load_key == "bench.time_scale":
        return figure(result, "workload.offered_request_rate")
    return result.get("choices", {}).get(load_key)


def latency_panels(results: list[dict]) -> list[Panel]:
    """The panels of the latency-load figure: TTFT and TPOT p50 and p99; the throughput, SLO
    attainment and goodput where some run has them; and each class's TTFT p50 and p99, SLO
    attainment and goodput."""
    panels = list(LATENCY_PANELS)
    panels += [p for p in RATE_PANELS if any(figure(r, p.key) is not None for r in results)]
    classes = list(dict.fromkeys(name for r in results for name in (r.get("classes") or {})))
    for name in classes:
        panels += [
            Panel(f"classes.{name}.ttft_s.p50", f"{name}: TTFT p50 (ms)", 1000),
            Panel(f"classes.{name}.ttft_s.p99", f"{name}: TTFT p99 (ms)", 1000),
        ]
        panels += [
            Panel(f"classes.{name}.{key}", f"{name}: {title}", scale, rate=True)
            for key, title, scale in (("slo_attainment", "SLO attainment (%)", 100), ("goodput", "goodput (req/s)", 1))
            if any(figure(r, f"classes.{name}.{key}") is not None for r in results)
        ]
    return panels


def _interval_key(key: str) -> str:
    """Where a figure's 95% interval is: inside its distribution, or in its dict's ci95."""
    head, _, last = key.rpartition(".")
    if last.startswith("p") and last[1:].isdigit() or last in ("mean", "std"):
        return f"{head}.ci95.{last}"
    return f"{head}.ci95.{last}" if head else f"ci95.{last}"


def latency_series(results: list[tuple[str, dict]], load_key: str, panels=LATENCY_PANELS) -> list[dict]:
    """The latency-load lines: one per combination of the other swept settings, each
    {"label", "x", and per panel key (values, 95% interval half-widths or None)}, points sorted by
    load. Runs without latency figures (a result written before the bench recorded them) are left
    out."""
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
        for panel in panels:
            values = [figure(r, panel.key) for r in group]
            intervals = [figure(r, _interval_key(panel.key)) for r in group]
            line[panel.key] = (values, intervals if any(i is not None for i in intervals) else None)
        series.append(line)
    return series


def plot_latency(path: str, results: list[tuple[str, dict]], title: str) -> list[dict] | None:
    """Writes the latency-load figure as path's PNG, PDF and SVG (path ending in .png) when the
    sweep varies the load and some run has latency figures; returns the series drawn
    (latency_series), or None when there is no such plot."""
    axis = load_axis([r for _, r in results])
    if axis is None:
        return None
    panels = latency_panels([r for _, r in results])
    series = latency_series(results, axis[0], panels)
    if not series:
        return None
    save_figure(latency_figure(series, panels, axis[1], title), os.path.splitext(path)[0])
    return series


def markdown_report(
    root: str, results, failed, header: list[str], rows: list[list], figures: list[str], jobs=None
) -> str:
    """report.md: what ran, the table (latencies in ms, each with its repeats' 95% interval where
    there are repeats), the figures, the failed runs and the sweep's jobs (sweep_jobs)."""
    num_keys = len(header) - len([k for k in FIGURES if any(figure(r, k) is not None for _, r in results)])
    shown = [k for k in FIGURES if any(figure(r, k) is not None for _, r in results)]
    lines = [f"# {os.path.basename(os.path.normpath(root)) or root}", ""]
    if results:
        described = describe_runs([r for _, r in results])
        lines += [described, ""] if described else []
        repeats = {r.get("num_repeats") for _, r in results if r.get("num_repeats")}
        if repeats:
            lines += [
                f"Means over {', '.join(map(str, sorted(repeats)))} repeats, ± the half-width of a 95% confidence interval.",
                "",
            ]
        lines += ["| " + " | ".join(header) + " |", "|" + "---|" * num_keys + "---:|" * (len(header) - num_keys)]
        for (_, result), row in zip(results, rows):
            cells = [format_setting(v) for v in row[:num_keys]]
            for key, value in zip(shown, row[num_keys:]):
                interval = shown_value(result, key, "ci95")
                cells.append(format_cell(value) + (f" ± {format_cell(interval)}" if interval is not None else ""))
            lines.append("| " + " | ".join(cells) + " |")
        lines.append("")
    for name in figures:
        if name.endswith(".png"):
            lines += [f"![{name}]({name})", ""]
    if failed:
        lines += [f"Failed runs ({len(failed)}):", ""]
        lines += [
            f"- `{run.run}` {' '.join(run.settings) or '(no overrides recorded)'}: {run.reason}" for run in failed
        ]
        lines.append("")
    if jobs:
        lines += [format_jobs(jobs).splitlines()[0].capitalize(), ""]
        lines += [f"- {line.strip()}" for line in format_jobs(jobs).splitlines()[1:]]
        lines.append("")
    return "\n".join(lines)


def write_vllm_results(root: str, results: list[tuple[str, dict]]) -> list[str]:
    """Each run's figures under vLLM's field names (vllm_format.vllm_result), as DIR/vllm/<run>.json;
    returns the paths written."""
    directory = os.path.join(root, "vllm")
    os.makedirs(directory, exist_ok=True)
    paths = []
    for run, result in results:
        name = "run" if run == "." else run.replace(os.sep, "-")
        path = os.path.join(directory, f"{name}.json")
        with open(path, "w") as f:
            json.dump(vllm_result(result), f, indent=2)
        paths.append(path)
    return paths


def report(root: str, output_format: str = "inferlab") -> tuple[list[str], list[list]]:
    """Prints the table of root's runs and the failed ones, writes report.csv, report.md and the
    figures (latency-load when the load varies, else throughput per configuration) into root;
    with output_format "vllm", each run's figures under vLLM's names into root/vllm/ instead.
    Returns the table's header and rows."""
    results, failed = load_runs(root)
    jobs = sweep_jobs(root, [run for run, _ in results], failed)
    if not results and not failed and not jobs:
        raise FileNotFoundError(f"no result.json under {root!r}: run `inferlab job=bench` (or a -m sweep) first")
    if output_format == "vllm":
        paths = write_vllm_results(root, results)
        print("\n".join(paths) if paths else "no finished runs to write")
        if failed:
            print(format_failed(failed))
        return [], []
    written = []
    header, rows = [], []
    if results:
        header, rows = build_table(results)
        num_figures = len(header) - 1 - len(swept_keys([r for _, r in results]))
        print(format_table(header, rows, num_figures))
        write_csv(os.path.join(root, "report.csv"), header, rows)
        written.append("report.csv")
        counted = f"{len(results)} runs" + (f", {len(failed)} failed" if failed else "")
        described = describe_runs([r for _, r in results])
        title = (f"{described}\n" if described else "") + f"{os.path.normpath(root)} ({counted})"
        if plot_latency(os.path.join(root, "latency.png"), results, title) is not None:
            written += [f"latency.{extension}" for extension in ("png", "pdf", "svg")]
        elif any(figure(r, key) is not None for _, r in results for key in PLOTTED):
            plot_throughput(os.path.join(root, "report.png"), results, title)
            written += [f"report.{extension}" for extension in ("png", "pdf", "svg")]
    if failed:
        print(format_failed(failed))
    if jobs:
        print(format_jobs(jobs))
    with open(os.path.join(root, "report.md"), "w") as f:
        f.write(markdown_report(root, results, failed, header, rows, written, jobs))
    written.append("report.md")
    print(f"wrote {', '.join(os.path.join(root, name) for name in written)}")
    return header, rows


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="inferlab-report", description=__doc__.split("\n\n")[0])
    parser.add_argument("dir", help="a run or sweep directory (e.g. multirun/2026-01-01/12-00-00)")
    parser.add_argument(
        "--format",
        choices=("inferlab", "vllm"),
        default="inferlab",
        help="inferlab: table, report.md and figures; vllm: each run's figures as vllm bench serve's JSON",
    )
    args = parser.parse_args(argv)
    if not os.path.isdir(args.dir):
        parser.error(f"{args.dir!r} is not a directory")
    try:
        report(args.dir, args.format)
    except FileNotFoundError as e:
        print(f"inferlab-report: {e}", file=sys.stderr)
        sys.exit(1)


if __name__ == "__main__":
    main()
