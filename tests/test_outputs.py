"""Output files are written whole or not at all, and leave no `.tmp` behind whatever ends the write."""

from pathlib import Path

import matplotlib
import pytest
from factories import make_workload_data

from app.outputs import save_figure, write_atomically, write_text_atomically

matplotlib.use("Agg")


@pytest.mark.parametrize("ending", [KeyboardInterrupt, OSError, ValueError])
def test_an_interrupted_write_keeps_the_old_file_and_leaves_no_tmp(tmp_path: Path, ending: type) -> None:
    out = tmp_path / "report.json"
    out.write_text("old\n")

    def write(tmp: Path) -> None:
        tmp.write_text("half of the new")
        raise ending()

    with pytest.raises(ending):
        write_atomically(out, write)
    assert out.read_text() == "old\n"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["report.json"]


def test_a_write_creates_missing_directories_and_replaces_the_file(tmp_path: Path) -> None:
    out = tmp_path / "a" / "b" / "trace.jsonl"
    write_text_atomically(out, "one\n")
    write_text_atomically(out, "two\n")
    assert out.read_text() == "two\n"
    assert sorted(p.name for p in out.parent.iterdir()) == ["trace.jsonl"]


@pytest.mark.parametrize(
    ("name", "magic"), [("plot.png", b"\x89PNG"), ("plot.svg", b"<?xml"), ("plot", b"\x89PNG")]
)
def test_a_figure_is_saved_in_the_format_its_name_gives(tmp_path: Path, name: str, magic: bytes) -> None:
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots()
    ax.plot([0, 1], [1, 0])
    save_figure(fig, tmp_path / name, dpi=50)
    plt.close(fig)
    assert (tmp_path / name).read_bytes().startswith(magic)
    assert [p.name for p in tmp_path.iterdir()] == [name]


def test_a_report_whose_directory_became_a_file_is_kept_elsewhere(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # A user removed the report's directory during a run and put a file in its place: the finished
    # run's report was lost, with "File exists" and exit 2 (the code of a refused input).
    import json

    import typer

    from app.cli.common import write_json

    out = tmp_path / "sub" / "report.json"
    out.parent.mkdir()
    out.parent.rmdir()
    out.parent.write_text("a file now\n")
    with pytest.raises(typer.Exit) as ended:
        write_json(out, {"batches": 3, "policy": "full"})
    assert ended.value.exit_code == 1
    said = " ".join(capsys.readouterr().err.split())
    assert f"cannot write {out}: {out.parent} is not a directory; written to " in said
    kept = Path(said.split("written to ")[1].split(" instead")[0])
    try:
        assert json.loads(kept.read_text()) == {"batches": 3, "policy": "full"}
        assert kept.name.startswith("corral-report-")
    finally:
        kept.unlink()


def test_a_report_that_cannot_be_written_where_asked_still_gets_its_plot(tmp_path: Path) -> None:
    """`corral run --json /full-disk/r.json --plot ~/r.png`: the report was kept elsewhere, but the
    command ended before drawing the plot, so the run's plot was lost though its own disk had room."""
    import typer

    from app.cli.common import finish
    from app.sim.run import policy_for, simulate
    from app.sim.workload import Workload

    workload = Workload.model_validate(make_workload_data(batches=1))
    report = simulate(workload, policy_for(workload, "full"), "full", timeline=True)
    (tmp_path / "blocked").write_text("a file where the report's directory should be")
    plot = tmp_path / "plots" / "timeline.png"
    with pytest.raises(typer.Exit) as ended:
        finish(report, tmp_path / "blocked" / "r.json", plot, "0 restarted trajectories")
    assert ended.value.exit_code == 1
    assert plot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
