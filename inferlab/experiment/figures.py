"""The figures of a sweep, drawn from what inferlab.experiment.report gathers: latency, SLO
attainment, goodput and throughput against the offered load (one line per configuration, bands
of the repeats' 95% confidence intervals, a row of panels per class), and throughput per
configuration where the load does not vary. Each figure is written as PNG, PDF and SVG.

Lines that coincide stay visible: each has its own colour, line style and hollow marker, the
markers shrinking from line to line so that equal points show as concentric rings.
"""

import math
from dataclasses import dataclass

LOG_SPREAD = 10  # an axis whose largest value is this many times its smallest gets a log scale
MARKERS = "osD^v<>ph*"
LINE_STYLES = ("-", "--", "-.", ":")
FORMATS = ("png", "pdf", "svg")
COLUMNS = 4  # panels a row


@dataclass(frozen=True)
class Panel:
    """One panel of the latency-load figure: the series key it plots, its title and the factor
    from the result's unit to the axis's (1000: seconds shown in ms, 100: fractions in %)."""

    key: str
    title: str
    scale: float = 1.0
    rate: bool = False  # a rate or a fraction: a linear axis from zero, never a log one


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")  # files only: no display needed
    import matplotlib.pyplot as plt

    return plt


def save_figure(fig, path: str) -> list[str]:
    """Writes fig as path's PNG, PDF and SVG (path without its extension); returns their names."""
    import os

    names = []
    for extension in FORMATS:
        name = f"{path}.{extension}"
        fig.savefig(name, dpi=150 if extension == "png" else None, bbox_inches="tight")
        names.append(os.path.basename(name))
    _pyplot().close(fig)
    return names


def line_style(number: int) -> dict:
    """The look of the number-th line: colour, line style and a hollow marker of falling size."""
    return {
        "color": f"C{number % 10}",
        "linestyle": LINE_STYLES[number % len(LINE_STYLES)],
        "marker": MARKERS[number % len(MARKERS)],
        "markersize": max(4.0, 10.0 - 1.5 * number),
        "markerfacecolor": "none",
        "markeredgewidth": 1.4,
        "linewidth": 1.6,
    }


def _spread_needs_log(values: list) -> bool:
    positive = [v for v in values if v is not None and v > 0]
    return len(positive) > 1 and max(positive) / min(positive) >= LOG_SPREAD


def rounded(value: float, _=None) -> str:
    """A tick label of at most three significant digits: 5.13, not 5.12821; 20.5, 1200, 0.5."""
    if value == 0:
        return "0"
    return f"{value:.3g}" if abs(value) < 1000 else f"{value:,.0f}"


def _ticks(axis, sweep_values: list | None = None, log: bool = False) -> None:
    """Ticks a reader need not decode: at the sweep's own values when they are few (the load
    axis), else matplotlib's, or 1, 2 and 5 times powers of ten on a log axis; labels rounded."""
    from matplotlib import ticker

    distinct = sorted({v for v in sweep_values or () if v is not None and v > 0})
    if 1 < len(distinct) <= 12:
        axis.set_major_locator(ticker.FixedLocator(distinct))
    elif log:
        axis.set_major_locator(ticker.LogLocator(subs=(1.0, 2.0, 5.0)))
    axis.set_major_formatter(ticker.FuncFormatter(rounded))
    axis.set_minor_formatter(ticker.NullFormatter())


def panel_grid(panels: list[Panel]) -> list[Panel | None]:
    """The panels laid out COLUMNS a row, each class's panels (keys "classes.<name>.") starting a
    row of their own; None where a row ends early."""
    grid: list[Panel | None] = []
    group = None
    for panel in panels:
        name = panel.key.split(".")[1] if panel.key.startswith("classes.") else None
        if name != group and len(grid) % COLUMNS:
            grid += [None] * (COLUMNS - len(grid) % COLUMNS)
        group = name
        grid.append(panel)
    return grid


def _values_and_intervals(line: dict, key: str) -> tuple[list, list]:
    values, intervals = line.get(key, ([], None))
    return values, intervals or [None] * len(values)


def latency_figure(series: list[dict], panels: list[Panel], x_title: str, title: str):
    """The latency-load figure: one panel per Panel (panel_grid's layout), one line per series
    entry ({"label", "x", and per panel key (values, ci95 half-widths or None)}), the intervals
    drawn as bands."""
    plt = _pyplot()
    grid = panel_grid(panels)
    rows = math.ceil(len(grid) / COLUMNS)
    fig, axes = plt.subplots(rows, COLUMNS, figsize=(4.2 * COLUMNS, 3.3 * rows + 0.9), squeeze=False)
    xs = [x for line in series for x in line["x"]]
    log_x = _spread_needs_log(xs)
    for ax, panel in zip(axes.flat, grid):
        if panel is None:
            ax.set_visible(False)
            continue
        values = [v * panel.scale for line in series for v in line.get(panel.key, ([], None))[0] if v is not None]
        log = not panel.rate and _spread_needs_log(values)
        # a band's ends stay where the axis can show them: above zero on a log axis, within 0-100 %
        floor = min((v for v in values if v > 0), default=1.0) / 2 if log else 0.0
        ceiling = 100.0 if panel.scale == 100 else float("inf")
        drawn = []
        for number, line in enumerate(series):
            points = [
                (x, y * panel.scale, (ci or 0.0) * panel.scale)
                for x, y, ci in zip(line["x"], *_values_and_intervals(line, panel.key))
                if y is not None
            ]
            if not points:
                continue
            px, py, pci = zip(*points)
            ax.plot(px, py, label=line["label"] or None, zorder=2 + number, **line_style(number))
            if any(pci):
                low = [max(y - ci, floor) for y, ci in zip(py, pci)]
                high = [min(y + ci, ceiling) for y, ci in zip(py, pci)]
                ax.fill_between(px, low, high, color=f"C{number % 10}", alpha=0.15, linewidth=0)
                drawn += high
            drawn += py
        ax.set_title(panel.title, fontsize=10)
        ax.set_xlabel(x_title, fontsize=8)
        ax.grid(True, which="major", alpha=0.3)
        if log:
            ax.set_yscale("log")
            ax.set_ylim(floor, 1.5 * max(drawn))
            _ticks(ax.yaxis, log=True)
        else:  # a linear axis from zero shows differences at their true size
            top = 105 if panel.scale == 100 else 1.08 * max(drawn, default=0)
            ax.set_ylim(0, top if top > 0 else None)
            _ticks(ax.yaxis)
        if log_x:
            ax.set_xscale("log")
        _ticks(ax.xaxis, xs, log=log_x)
        ax.tick_params(labelsize=8)
    for ax in list(axes.flat)[len(grid) :]:
        ax.set_visible(False)
    handles, labels = axes[0][0].get_legend_handles_labels()
    if handles:
        fig.legend(handles, labels, loc="lower center", ncol=min(4, len(handles)), fontsize=9, frameon=False)
    fig.suptitle(title, fontsize=10)
    legend_rows = math.ceil(len(handles) / 4) if handles else 0
    fig.tight_layout(rect=(0, 0.03 + 0.035 * legend_rows / rows, 1, 1))
    return fig


def throughput_figure(
    labels: list[str], groups: list[str], values: dict[str, list], titles: dict[str, str], title: str
):
    """Horizontal bars, one panel per throughput figure in values ({key: a value per run}), one bar
    per run labelled with its settings and coloured by its group (the first swept setting's
    value), with a legend of the groups when there are several."""
    plt = _pyplot()
    keys = list(values)
    fig, axes = plt.subplots(
        1, len(keys), figsize=(4.5 * len(keys) + 1.5, 1.6 + 0.4 * len(labels)), sharey=True, squeeze=False
    )
    positions = list(range(len(labels)))[::-1]  # first run on top
    names = list(dict.fromkeys(groups))
    colours = [f"C{names.index(g) % 10}" for g in groups]
    for ax, key in zip(axes[0], keys):
        bars = ax.barh(positions, values[key], color=colours)
        ax.bar_label(bars, labels=[rounded(v) for v in values[key]], padding=3, fontsize=8)
        ax.set_title(titles[key], fontsize=10)
        ax.set_xlim(0, max(values[key] + [1]) * 1.25)
    axes[0][0].set_yticks(positions, labels, fontsize=8)
    if len(names) > 1:
        from matplotlib.patches import Patch

        handles = [Patch(color=f"C{i % 10}", label=name) for i, name in enumerate(names)]
        fig.legend(handles=handles, loc="lower center", ncol=min(4, len(names)), fontsize=9, frameon=False)
    fig.suptitle(title, fontsize=10)
    fig.tight_layout(rect=(0, 0.06 if len(names) > 1 else 0, 1, 1))
    return fig
