"""Plots of a bench report (app/sim/plot.py): readable whatever the rungs and the sweep's values."""

import itertools
from pathlib import Path
from typing import Any

from app.sim.plot import bench_figure, plot_bench

PEERS = [
    "areal",
    "prime-rl",
    "pipelinerl",
    "slime",
    "skyrl",
    "areal (no concurrency cap)",
    "skyrl (no concurrency cap)",
]


def make_bench(**overrides: Any) -> dict[str, Any]:
    """A bench report as `corral bench --peers` writes it, as far as the plot reads it."""
    names = ["sync", "completion", "lanes", "full", *PEERS]
    policies = {
        name: {"batch_collection_s": {"mean": 200.0 + 10 * i, "p90": 260.0 + 10 * i}, "lower_bound_s": 140.0}
        for i, name in enumerate(names)
    }
    surplus = [
        {"surplus_groups": s, "batch_collection_s": 300.0 - 20 * s, "lower_bound_s": 150.0 - 5 * s,
         "discarded_groups": {"stale": stale}}
        for s, stale in [(0, 0), (1, 3), (2, 5), (4, 9)]
    ]  # fmt: skip
    ablations = {f"full without {t}": {"batch_collection_s": 300.0} for t in ("lanes", "completion order")}
    return {"policies": policies, "sweeps": {"surplus": surplus, "ablations": ablations}, **overrides}


def test_the_bench_plot_with_peers_is_readable(tmp_path: Path) -> None:
    """`bench --peers --plot`: the ladder's eleven names ran into one string ("syncompletionlanes…"),
    the stale-group bars (4 wide, at S 2 apart) overlapped and had no legend entry, and the legend
    covered the tallest bar."""
    figure = bench_figure(make_bench())
    figure.canvas.draw()
    renderer = figure.canvas.get_renderer()  # type: ignore[attr-defined]
    ladder, sweep, _, stale_axis = figure.axes
    names = [t.get_window_extent(renderer) for t in ladder.get_yticklabels()]
    assert len(names) == 4 + len(PEERS)
    for a, b in itertools.pairwise(names):
        assert not a.overlaps(b), "rung names overlap"
    bars = sorted((p.get_x(), p.get_x() + p.get_width()) for p in stale_axis.patches)
    assert len(bars) == 4
    for (_, end), (start, _) in itertools.pairwise(bars):
        assert end < start, "stale-group bars overlap"
    legend = sweep.get_legend()
    assert [t.get_text() for t in legend.get_texts()] == [
        "full: mean",
        "lower bound",
        "stale groups discarded",
    ]
    for ax in (ladder, sweep):
        box = ax.get_legend().get_window_extent(renderer)
        assert box.y0 >= ax.get_window_extent(renderer).y1 - 1, "the legend lies over the data"
    plot_bench(make_bench(), tmp_path / "bench.png")
    assert (tmp_path / "bench.png").stat().st_size > 0
