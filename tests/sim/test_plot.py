"""Plots of a bench report (app/sim/plot.py): readable whatever the rungs and the sweep's values."""

import itertools
import math
from pathlib import Path
from typing import Any

import pytest
from matplotlib.colors import to_rgba

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


def test_the_family_plot_colours_only_the_emulated_systems_as_peers(tmp_path: Path) -> None:
    """`bench --family --peers --plot`: the two borrowing variants of `full` were drawn in the peers'
    colour, and no legend said what the colours meant."""
    from app.sim.plot import FAMILY_COLOURS, family_figure, plot_family

    own = ["sync", "completion", "lanes", "full", "full (borrowing serving CPUs)", "full (S = K·B)"]
    rungs = {name: {"mean_s": 100.0 + 10 * i, "lower_bound_s": 90.0} for i, name in enumerate(own + PEERS)}
    result = {"workloads": {"default": {"rungs": rungs}, "trace": {"rungs": rungs}}}
    figure = family_figure(result)
    for ax in figure.axes:
        colours = {
            label.get_text(): bar.get_facecolor()
            for label, bar in zip(ax.get_xticklabels(), ax.patches, strict=True)
        }
        peers = {name for name, colour in colours.items() if colour == to_rgba(FAMILY_COLOURS["peer"])}
        assert peers == set(PEERS)
        assert colours["full"] == to_rgba(FAMILY_COLOURS["full"])
    (legend,) = figure.legends
    assert [t.get_text() for t in legend.get_texts()] == [
        "full",
        "Corral's ladder and variants of full",
        "other systems, emulated (docs/peers.md)",
    ]
    plot_family(result, tmp_path / "family.png")
    assert (tmp_path / "family.png").stat().st_size > 0


@pytest.mark.parametrize("count", [1, 2, 3, 4, 5])
def test_the_family_plot_legend_fits_the_figure_above_the_panels(count: int) -> None:
    """With one workload (the README's rerun of `benchmarks.family --workloads default`) the figure was
    5.2 inches wide and its one-row legend of three entries was cut off at both sides."""
    import matplotlib.pyplot as plt

    from app.sim.plot import family_figure

    rungs = {
        name: {"mean_s": 100.0 + 10 * i, "lower_bound_s": 90.0} for i, name in enumerate(["full", *PEERS])
    }
    figure = family_figure({"workloads": {f"w{i}": {"rungs": rungs} for i in range(count)}})
    figure.canvas.draw()
    (legend,) = figure.legends
    box, whole = legend.get_window_extent(), figure.bbox
    assert whole.x0 <= box.x0
    assert box.x1 <= whole.x1
    assert whole.y0 <= box.y0
    assert box.y1 <= whole.y1
    for ax in figure.axes:  # the panels' titles sit below it
        assert ax.get_tightbbox().y1 <= box.y0 + 1
    plt.close(figure)


def test_the_bench_plot_shows_the_staleness_sweep() -> None:
    """`--staleness-sweep` (docs/simulator.md's example passes one) was in the report and the table but
    not in the plot, whose --help says it draws the ladder and the sweeps."""
    rows = [
        {"max_staleness": k, "surplus_groups": s, "batch_collection_s": 100.0 + k + s,
         "discarded_groups": {"stale": k * s}}
        for s in (2, 64) for k in (1, 2)
    ]  # fmt: skip
    figure = bench_figure(make_bench(sweeps={**make_bench()["sweeps"], "max_staleness": rows}))
    (panel,) = [ax for ax in figure.axes if ax.get_title() == "staleness bound sweep (full)"]
    assert sorted(round(bar.get_height(), 1) for bar in panel.patches) == [103.0, 104.0, 165.0, 166.0]
    assert [t.get_text() for t in panel.get_xticklabels()] == ["K = 1", "K = 2"]
    assert [t.get_text() for t in panel.get_legend().get_texts()] == ["S = 2", "S = 64"]
    labels = {a.get_text() for a in panel.texts}
    assert {"103\n2 stale", "166\n128 stale"} <= labels


def test_a_rung_without_a_batch_is_no_bar_at_zero_but_says_so(tmp_path: Path) -> None:
    """A report of no batch has a null mean (it was 0.0): the plots drew it as a bar of 0 s, the
    fastest rung; they now leave it out and label it `no batch`, and the ladder table says so too."""
    from app.cli.sim import ladder_table, sweep_table
    from app.sim.plot import family_figure

    nothing = {"mean": None, "p50": None, "p90": None}
    bench = make_bench()
    bench["policies"]["lanes"]["batch_collection_s"] = nothing
    bench["sweeps"]["surplus"][1]["batch_collection_s"] = None
    bench["sweeps"]["ablations"]["full without lanes"]["batch_collection_s"] = None
    figure = bench_figure(bench)
    ladder, sweep, ablations = figure.axes[0], figure.axes[1], figure.axes[2]
    assert " no batch" in [t.get_text() for t in ladder.texts]
    assert "no batch" in [t.get_text() for t in ablations.texts]
    assert 0.0 not in [bar.get_width() for bar in ladder.patches]
    (means, _) = sweep.lines
    assert math.isnan(means.get_ydata()[1])  # a gap in the line, not a point at 0
    plot_bench(bench, tmp_path / "bench.png")
    rungs = {"sync": {"mean_s": 10.0, "lower_bound_s": 5.0}, "full": {"mean_s": None, "lower_bound_s": 5.0}}
    figure = family_figure({"workloads": {"default": {"rungs": rungs}}})
    assert "no batch" in [t.get_text() for t in figure.axes[0].texts]
    # The tables of `corral bench`: words where there is no mean, and no ratio against it.
    for name, rep in bench["policies"].items():
        rep.update(batches=0 if name == "lanes" else 4, lower_bound_s=140.0, trainer_idle_fraction=0.5,
                   discarded_groups={"stale": 0}, restarted_trajectories=0)  # fmt: skip
        rep["batch_collection_s"].setdefault("p50", 1.0)
    (row,) = [line for line in ladder_table(bench).splitlines() if line.startswith("| lanes |")]
    assert row.startswith("| lanes | no batch |  |  | n/a | 140.0 |")
    for row in [*bench["sweeps"]["surplus"], *bench["sweeps"]["ablations"].values()]:
        row.update(p90_s=None if row["batch_collection_s"] is None else 1.0, trainer_idle_fraction=0.5,
                   discarded_groups={"stale": 0}, wasted_trajectory_s={})  # fmt: skip
    bench["sweeps"]["max_staleness"] = []
    table = sweep_table(bench)
    assert "| S = 1 | no batch |  |" in table
    assert "| without lanes | no batch |  |" in table
