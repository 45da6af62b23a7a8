"""Timeline plot of a run (simulated or real): one bar per group, batch deliveries, engine updates."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

from app.outputs import save_figure

if TYPE_CHECKING:
    from matplotlib.figure import Figure

COLOURS = {
    "delivered": "tab:green",
    "stale": "tab:red",
    "failed": "black",
    "cancelled": "tab:gray",
    "zero_variance": "tab:purple",
}


def plot_timeline(report: dict[str, Any], out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig = timeline_figure(report)
    save_figure(fig, out, dpi=110)
    plt.close(fig)


def timeline_title(report: dict[str, Any]) -> str:
    """`full: 3 batches, mean collection 12.5 s; ...`. A run stopped before its first batch says so: its
    report has no mean (null; it was 0.0, which the title gave as `0 batches, mean collection 0.0 s`)."""
    batches = report["batches"]
    legend = "thick: running, thin: ready and waiting for its batch"
    if not batches:
        return f"{report['policy']}: no batch delivered; {legend}"
    count = f"{batches} batch{'' if batches == 1 else 'es'}"
    mean = report["batch_collection_s"]["mean"]
    return f"{report['policy']}: {count}, mean collection {mean:.1f} s; {legend}"


def timeline_figure(report: dict[str, Any]) -> Figure:
    """The figure of `plot_timeline`."""
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch

    rows = report["groups_timeline"]
    fig, ax = plt.subplots(figsize=(13, max(4.0, min(12.0, 0.02 * len(rows) + 3))))
    for row in rows:
        start, done, end = row["admitted_s"], row["completed_s"], row["ended_s"]
        colour = COLOURS.get(row["outcome"], "tab:blue")
        running_until = done if done is not None else end
        if running_until is not None:
            ax.plot(
                [start, running_until], [row["group"]] * 2, color=colour, linewidth=1.6, solid_capstyle="butt"
            )
        if done is not None and end is not None and end > done:
            # Ready, waiting for its batch: the slot is held but no work is done.
            ax.plot([done, end], [row["group"]] * 2, color=colour, linewidth=0.6, alpha=0.5)
    for mark in report.get("batch_marks", []):
        ax.axvline(mark["delivered_s"], color="tab:blue", linewidth=0.6, alpha=0.6)
    for entry in report.get("update_log", []):
        if entry["phase"] == "end":
            ax.plot(entry["t"], -2, marker="v", color="tab:orange", markersize=4)
    faults = [e for e in report.get("engine_events", []) if e["state"] in ("unhealthy", "serving")]
    for event in faults:  # engine faults (docs/faults.md): down, and back again
        down = event["state"] == "unhealthy"
        ax.plot(event["t"], -4, marker="x" if down else "^", color="tab:brown" if down else "tab:cyan")
    handles = [Patch(color=c, label=k) for k, c in COLOURS.items()]
    handles.append(Patch(color="tab:blue", alpha=0.6, label="batch delivered"))
    handles.append(Patch(color="tab:orange", label="engine updated"))
    if faults:
        handles.append(Patch(color="tab:brown", label="engine down (x)"))
        handles.append(Patch(color="tab:cyan", label="engine back (^)"))
    ax.legend(handles=handles, loc="upper left", fontsize=8, ncols=4)
    ax.set_xlabel("time since start (s)")
    ax.set_ylabel("group (admission order)")
    ax.set_title(timeline_title(report))
    fig.tight_layout()
    return fig
