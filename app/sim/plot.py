"""Plots of a bench report: the ladder against its lower bound, and the S sweep."""

from __future__ import annotations

import itertools
import math
from pathlib import Path
from typing import TYPE_CHECKING, Any

from app.outputs import save_figure
from app.runtime.report import NO_BATCH, drawn_s

if TYPE_CHECKING:
    from matplotlib.axes import Axes
    from matplotlib.figure import Figure


def plot_bench(result: dict[str, Any], out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig = bench_figure(result)
    save_figure(fig, out, dpi=110)
    plt.close(fig)


def bench_figure(result: dict[str, Any]) -> Figure:
    """The figure of `plot_bench`: however many rungs (`--peers` adds seven, with long names) and
    whatever values of S, the rung names stay readable (slanted), the stale-group bars keep apart, every
    series has a legend entry and each legend sits above its panel, off the data."""
    import matplotlib.pyplot as plt

    staleness = result["sweeps"].get("max_staleness", [])
    panels = 4 if staleness else 3
    fig, axes = plt.subplots(1, panels, figsize=(17 / 3 * panels, 5.5))
    ax1, ax2, ax4 = axes[0], axes[1], axes[-1]
    names = list(result["policies"])
    means = [drawn_s(result["policies"][n]["batch_collection_s"]["mean"]) for n in names]
    p90s = [drawn_s(result["policies"][n]["batch_collection_s"]["p90"]) for n in names]
    bounds = [result["policies"][n]["lower_bound_s"] for n in names]
    ys = range(len(names))  # one row per rung, the first on top: long names (`--peers`) stay readable
    ax1.barh([y - 0.2 for y in ys], means, height=0.4, label="mean")
    ax1.barh([y + 0.2 for y in ys], p90s, height=0.4, label="p90", alpha=0.6)
    ax1.vlines(
        bounds, [y - 0.4 for y in ys], [y + 0.4 for y in ys], color="black", label="lower bound", zorder=3
    )
    for y, m in zip(ys, means, strict=True):
        ax1.annotate(f" {_label(m)}", (_at(m), y - 0.2), ha="left", va="center", fontsize=7)
    ax1.set_yticks(list(ys), names, fontsize=8)
    ax1.invert_yaxis()
    ax1.set_xlabel("batch collection time (s)")
    _legend_above(ax1, "ablation ladder")
    sweep = result["sweeps"]["surplus"]
    if sweep:
        s = [row["surplus_groups"] for row in sweep]
        stale = [row["discarded_groups"]["stale"] for row in sweep]
        ax3 = ax2.twinx()
        ax3.bar(s, stale, width=_bar_width(s), alpha=0.25, color="red", label="stale groups discarded")
        ax3.set_ylim(0, 1.1 * max(1, *stale))  # all zero: an axis from 0, not around it
        ax3.yaxis.get_major_locator().set_params(integer=True)
        ax3.set_ylabel("stale groups discarded")
        ax2.set_zorder(ax3.get_zorder() + 1)  # the lines over the bars
        ax2.patch.set_visible(False)
        # A value of S that delivered no batch is a gap in the line, not a point at 0
        ax2.plot(s, [drawn_s(row["batch_collection_s"]) for row in sweep], marker="o", label="full: mean")
        ax2.plot(s, [row["lower_bound_s"] for row in sweep], linestyle="--", label="lower bound")
        ax2.set_xlabel("surplus groups S")
        ax2.xaxis.get_major_locator().set_params(integer=True)  # S is a count: no tick at 0.5
        ax2.set_ylabel("batch collection time (s)")
        _legend_above(ax2, "surplus sweep (full)", extra=ax3)
    if staleness:
        _staleness_panel(axes[2], staleness)
    ablations = result["sweeps"].get("ablations", {})
    if ablations and "full" in result["policies"]:
        labels = ["full", *(name.replace("full without ", "− ") for name in ablations)]
        values = [
            drawn_s(result["policies"]["full"]["batch_collection_s"]["mean"]),
            *(drawn_s(row["batch_collection_s"]) for row in ablations.values()),
        ]
        bars = ax4.bar(labels, values, color=["tab:green"] + ["tab:gray"] * len(ablations))
        for bar, value in zip(bars, values, strict=True):
            where = (bar.get_x() + bar.get_width() / 2, _at(value))
            ax4.annotate(_label(value), where, ha="center", va="bottom")
        ax4.set_ylabel("batch collection time (s)")
        ax4.set_title("full, minus one technique")
        ax4.set_xticks(range(len(labels)), labels, rotation=20, ha="right", rotation_mode="anchor")
    fig.tight_layout()
    return fig


def _staleness_panel(ax: Axes, rows: list[dict[str, Any]]) -> None:
    """`--staleness-sweep`: `full`'s mean for each K, one bar per S it ran at, each bar labelled with its
    stale groups discarded (the sweep was in the report and the table, not in the plot)."""
    ks = sorted({row["max_staleness"] for row in rows})
    surpluses = sorted({row["surplus_groups"] for row in rows})
    width = 0.8 / len(surpluses)
    for i, surplus in enumerate(surpluses):
        mine = {row["max_staleness"]: row for row in rows if row["surplus_groups"] == surplus}
        xs = [j + (i - (len(surpluses) - 1) / 2) * width for j, k in enumerate(ks) if k in mine]
        values = [drawn_s(mine[k]["batch_collection_s"]) for k in ks if k in mine]
        bars = ax.bar(xs, values, width=width, label=f"S = {surplus}")
        for bar, k in zip(bars, [k for k in ks if k in mine], strict=True):
            stale = mine[k]["discarded_groups"]["stale"]
            ax.annotate(
                f"{_label(bar.get_height())}\n{stale} stale",
                (bar.get_x() + bar.get_width() / 2, _at(bar.get_height())),
                ha="center",
                va="bottom",
                fontsize=7,
            )
    ax.set_xticks(range(len(ks)), [f"K = {k}" for k in ks])
    ax.set_ylabel("batch collection time (s)")
    ax.margins(y=0.15)  # room for the labels over the tallest bar
    _legend_above(ax, "staleness bound sweep (full)")


def _at(value: float) -> float:
    """Where a value's label goes: at the value, or at 0 for one not drawn."""
    return 0.0 if math.isnan(value) else value


def _label(value: float) -> str:
    return NO_BATCH if math.isnan(value) else f"{value:.0f}"


def _legend_above(ax: Axes, title: str, extra: Axes | None = None) -> None:
    """The panel's title, and under it, above the axes, one legend row for its series and `extra`'s
    (a twin axes' bars)."""
    handles, labels = ax.get_legend_handles_labels()
    if extra is not None:
        more = extra.get_legend_handles_labels()
        handles, labels = handles + more[0], labels + more[1]
    ax.legend(handles, labels, loc="lower center", bbox_to_anchor=(0.5, 1.0), ncols=len(labels), fontsize=8)
    ax.set_title(title, pad=26)


def _bar_width(values: list[int]) -> float:
    """Bars at `values` on a numeric axis that keep apart: 60% of the closest spacing."""
    points = sorted(set(values))
    gaps = [b - a for a, b in itertools.pairwise(points)]
    return 0.6 * min(gaps) if gaps else max(1.0, 0.1 * points[0])


def plot_family(result: dict[str, Any], out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig = family_figure(result)
    save_figure(fig, out, dpi=100)
    plt.close(fig)


FAMILY_COLOURS = {"full": "tab:green", "corral": "tab:gray", "peer": "tab:blue"}


def family_figure(result: dict[str, Any]) -> Figure:
    """The figure of `plot_family`: one panel per workload, mean batch collection time of every rung,
    `full` highlighted, with the clairvoyant lower bound of `full` as a line. A rung is coloured as a
    peer only when it is one of docs/peers.md's emulations (`app.sim.peers.PEERS`), and the colours have
    a legend: a hand-kept list of Corral's own rungs had missed the two borrowing variants of `full`,
    drawn as peers."""
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch

    from app.sim.peers import PEERS

    workloads = result["workloads"]
    fig, axes = plt.subplots(1, len(workloads), figsize=(5.2 * len(workloads), 5.4), squeeze=False)
    for ax, (name, data) in zip(axes[0], workloads.items(), strict=True):
        rungs = data["rungs"]
        labels = list(rungs)
        values = [drawn_s(rungs[r]["mean_s"]) for r in labels]
        kinds = ["full" if r == "full" else "peer" if r in PEERS else "corral" for r in labels]
        bars = ax.bar(range(len(labels)), values, color=[FAMILY_COLOURS[k] for k in kinds])
        for bar, value in zip(bars, values, strict=True):
            drawn = not math.isnan(value)  # a log axis has no 0: a missing bar's label sits at its foot
            ax.annotate(
                _label(value),
                (bar.get_x() + bar.get_width() / 2, value if drawn else 0.0),
                xycoords="data" if drawn else ("data", "axes fraction"),
                ha="center",
                va="bottom",
                fontsize=7,
            )
        if "full" in rungs:
            ax.axhline(
                rungs["full"]["lower_bound_s"],
                color="black",
                linestyle="--",
                linewidth=1,
                label="bound (full)",
            )
            ax.legend(loc="upper right", fontsize=8)
        ax.set_xticks(range(len(labels)), labels, rotation=60, ha="right", fontsize=8)
        ax.set_yscale("log")
        ax.set_title(name)
        ax.set_ylabel("mean batch collection time (s, log)")
    keys = [
        ("full", "full"),
        ("corral", "Corral's ladder and variants of full"),
        ("peer", "other systems, emulated (docs/peers.md)"),
    ]
    # One panel (5.2 in) is narrower than the legend in one row: it was cut off at both sides, so there
    # it takes a row an entry; the panels are laid out below however many rows it has.
    legend = fig.legend(
        handles=[Patch(color=FAMILY_COLOURS[k], label=text) for k, text in keys],
        loc="upper center",
        ncols=len(keys) if len(workloads) > 1 else 1,
        fontsize=9,
        frameon=False,
    )
    fig.canvas.draw()
    height = legend.get_window_extent().height / fig.bbox.height
    fig.tight_layout(rect=(0, 0, 1, 1 - height - 0.01))
    return fig
