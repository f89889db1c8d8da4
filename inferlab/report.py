"""`inferlab-report DIR`: the table and plot of a run or a sweep.

Reads every result.json under DIR, prints one row per run whose columns are the choices that
differ between runs (what was swept) and the figures, and writes report.csv and report.png
(throughput per configuration) into DIR.
"""

import argparse
import csv
import json
import os
import re
import sys

FIGURES = {  # result key -> column title
    "output_tokens_per_s": "output tok/s",
    "prefill_tokens_per_s": "prefill tok/s",
    "decode_tokens_per_s": "decode tok/s",
    "wall_time_s": "wall s",
    "num_prefill_tokens": "prefill tokens",
    "prefix_cache_hit_rate": "prefix hit",
    "num_preemptions": "preemptions",
}
PLOTTED = ("output_tokens_per_s", "prefill_tokens_per_s", "decode_tokens_per_s")
KINDS = ("model", "scheduler", "kv_cache", "attention", "sampler")


def natural_key(path: str) -> list:
    """Sorts sweep job dirs 0, 1, 2, ..., 10 rather than 0, 1, 10, 2."""
    return [int(part) if part.isdigit() else part for part in re.split(r"(\d+)", path)]


def load_results(root: str) -> list[tuple[str, dict]]:
    """(run directory relative to root, result) for every result.json under root."""
    found = []
    for directory, _, files in os.walk(root):
        if "result.json" in files:
            with open(os.path.join(directory, "result.json")) as f:
                found.append((os.path.relpath(directory, root), json.load(f)))
    return sorted(found, key=lambda item: natural_key(item[0]))


def swept_keys(results: list[dict]) -> list[str]:
    """The choices whose values differ across runs, in the order they first appear; with one run
    (or nothing swept), the plugin choices."""
    keys = []
    for result in results:
        keys += [k for k in result.get("choices", {}) if k not in keys]
    differing = [k for k in keys if len({json.dumps(r.get("choices", {}).get(k), sort_keys=True) for r in results}) > 1]
    return differing or [k for k in KINDS if any(k in r.get("choices", {}) for r in results)]


def build_table(results: list[tuple[str, dict]]) -> tuple[list[str], list[list]]:
    """Header and rows: run, the swept choices, then the figures."""
    keys = swept_keys([r for _, r in results])
    header = ["run", *keys, *FIGURES.values()]
    rows = [
        [run, *(result.get("choices", {}).get(k) for k in keys), *(result.get(f) for f in FIGURES)]
        for run, result in results
    ]
    return header, rows


def format_cell(value) -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        return f"{value:.3f}" if abs(value) < 10 else f"{value:.1f}"
    return str(value)


def format_table(header: list[str], rows: list[list]) -> str:
    cells = [header] + [[format_cell(v) for v in row] for row in rows]
    widths = [max(len(row[i]) for row in cells) for i in range(len(header))]
    lines = [
        "  ".join(
            c.ljust(w) if i < len(header) - len(FIGURES) else c.rjust(w) for i, (c, w) in enumerate(zip(row, widths))
        )
        for row in cells
    ]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


def write_csv(path: str, header: list[str], rows: list[list]) -> None:
    with open(path, "w", newline="") as f:
        writer = csv.writer(f)
        writer.writerow(header)
        writer.writerows([["" if v is None else v for v in row] for row in rows])


def plot(path: str, header: list[str], rows: list[list], title: str) -> None:
    """One horizontal bar panel per throughput figure, one bar per configuration."""
    import matplotlib

    matplotlib.use("Agg")  # files only: no display needed
    import matplotlib.pyplot as plt

    num_keys = len(header) - 1 - len(FIGURES)
    labels = [
        " ".join(
            f"{k}={format_cell(v)}" for k, v in zip(header[1 : 1 + num_keys], row[1 : 1 + num_keys]) if v is not None
        )
        or row[0]
        for row in rows
    ]
    figure_index = {key: 1 + num_keys + i for i, key in enumerate(FIGURES)}
    fig, axes = plt.subplots(
        1, len(PLOTTED), figsize=(5 * len(PLOTTED), 1.2 + 0.45 * len(rows)), sharey=True, squeeze=False
    )
    positions = list(range(len(rows)))[::-1]  # first run on top
    for ax, key in zip(axes[0], PLOTTED):
        values = [row[figure_index[key]] or 0 for row in rows]
        bars = ax.barh(positions, values, color="tab:blue")
        ax.bar_label(bars, labels=[f"{v:.0f}" for v in values], padding=3, fontsize=8)
        ax.set_title(FIGURES[key])
        ax.set_xlim(0, max(values + [1]) * 1.25)
    axes[0][0].set_yticks(positions, labels, fontsize=8)
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def report(root: str) -> tuple[list[str], list[list]]:
    """Prints the table of root's results and writes report.csv and report.png into root."""
    results = load_results(root)
    if not results:
        raise FileNotFoundError(f"no result.json under {root!r}: run `inferlab job=bench` (or a -m sweep) first")
    header, rows = build_table(results)
    print(format_table(header, rows))
    write_csv(os.path.join(root, "report.csv"), header, rows)
    plot(os.path.join(root, "report.png"), header, rows, title=f"{os.path.abspath(root)} ({len(rows)} runs)")
    print(f"wrote {os.path.join(root, 'report.csv')} and {os.path.join(root, 'report.png')}")
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
