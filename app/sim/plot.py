"""Plots of a bench report: the ladder against its lower bound, and the S sweep."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from app.outputs import save_figure


def plot_bench(result: dict[str, Any], out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax1, ax2, ax4) = plt.subplots(1, 3, figsize=(17, 4.5))
    names = list(result["policies"])
    means = [result["policies"][n]["batch_collection_s"]["mean"] for n in names]
    p90s = [result["policies"][n]["batch_collection_s"]["p90"] for n in names]
    bounds = [result["policies"][n]["lower_bound_s"] for n in names]
    xs = range(len(names))
    ax1.bar([x - 0.2 for x in xs], means, width=0.4, label="mean")
    ax1.bar([x + 0.2 for x in xs], p90s, width=0.4, label="p90", alpha=0.6)
    ax1.scatter(list(xs), bounds, color="black", marker="_", s=600, label="lower bound", zorder=3)
    for x, m in zip(xs, means, strict=True):
        ax1.annotate(f"{m:.0f}", (x - 0.2, m), ha="center", va="bottom", fontsize=8)
    ax1.set_xticks(list(xs), names)
    ax1.set_ylabel("batch collection time (s)")
    ax1.set_title("ablation ladder")
    ax1.legend()
    sweep = result["sweeps"]["surplus"]
    if sweep:
        s = [row["surplus_groups"] for row in sweep]
        ax2.plot(s, [row["batch_collection_s"] for row in sweep], marker="o", label="full: mean")
        ax2.plot(s, [row["lower_bound_s"] for row in sweep], linestyle="--", label="lower bound")
        stale = [row["discarded_groups"]["stale"] for row in sweep]
        ax3 = ax2.twinx()
        ax3.bar(s, stale, width=4, alpha=0.25, color="red", label="stale groups")
        ax3.set_ylabel("stale groups discarded")
        ax2.set_xlabel("surplus groups S")
        ax2.set_ylabel("batch collection time (s)")
        ax2.set_title("surplus sweep (full)")
        ax2.legend(loc="upper right")
    ablations = result["sweeps"].get("ablations", {})
    if ablations and "full" in result["policies"]:
        labels = ["full", *(name.replace("full without ", "− ") for name in ablations)]
        values = [
            result["policies"]["full"]["batch_collection_s"]["mean"],
            *(row["batch_collection_s"] for row in ablations.values()),
        ]
        bars = ax4.bar(labels, values, color=["tab:green"] + ["tab:gray"] * len(ablations))
        for bar, value in zip(bars, values, strict=True):
            ax4.annotate(f"{value:.0f}", (bar.get_x() + bar.get_width() / 2, value), ha="center", va="bottom")
        ax4.set_ylabel("batch collection time (s)")
        ax4.set_title("full, minus one technique")
    fig.tight_layout()
    save_figure(fig, out, dpi=110)
    plt.close(fig)


def plot_family(result: dict[str, Any], out: Path) -> None:
    """One panel per workload: mean batch collection time of every rung, `full` highlighted, with the
    clairvoyant lower bound of `full` as a line."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    workloads = result["workloads"]
    fig, axes = plt.subplots(1, len(workloads), figsize=(5.2 * len(workloads), 5), squeeze=False)
    for ax, (name, data) in zip(axes[0], workloads.items(), strict=True):
        rungs = data["rungs"]
        labels = list(rungs)
        values = [rungs[r]["mean_s"] for r in labels]
        colors = [
            "tab:green" if r == "full" else "tab:gray" if r in LADDER_NAMES else "tab:blue" for r in labels
        ]
        bars = ax.bar(range(len(labels)), values, color=colors)
        for bar, value in zip(bars, values, strict=True):
            ax.annotate(
                f"{value:.0f}",
                (bar.get_x() + bar.get_width() / 2, value),
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
    fig.tight_layout()
    save_figure(fig, out, dpi=100)
    plt.close(fig)


LADDER_NAMES = {
    "sync",
    "completion",
    "lanes",
    "full (partitioned lanes)",
    "full (fixed lanes)",
    "full (S = K·B)",
}
