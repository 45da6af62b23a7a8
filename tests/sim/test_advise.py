"""`advise`: coordinate descent over S, K, updating engines and lane slots, on real simulations."""

import itertools
import math
from pathlib import Path

import pytest

from app.sim.advise import (
    Advice,
    Outcome,
    Settings,
    advice_figure,
    advise,
    advised_workload,
    current_settings,
    evaluate,
    knob_grid,
    plot_advice,
    workload_changes,
)
from app.sim.workload import Workload, load_workload

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"


def test_grid_always_holds_the_current_value() -> None:
    workload = load_workload(EXAMPLES / "small-trace.yaml")
    start = current_settings(workload)
    grid = knob_grid(workload, start)
    assert start.surplus_groups in grid["surplus_groups"]
    assert start.max_staleness in grid["max_staleness"]
    assert dict(start.lane_slots)["reset"] in grid["reset"]
    # The hand-written config's own updating engines (None: the policy's default) come first.
    assert grid["max_updating_engines"][0] is start.max_updating_engines is None
    assert all(v >= 1 for v in grid["max_updating_engines"][1:] if v is not None)


def test_advice_is_never_worse_than_the_current_settings() -> None:
    workload = load_workload(EXAMPLES / "small-trace.yaml")
    progress: list[tuple[int, int]] = []
    advice = advise(
        workload, passes=1, workers=2, knobs=["surplus_groups"], on_run=lambda d, p: progress.append((d, p))
    )
    assert advice.recommended.batch_collection_s <= advice.current.batch_collection_s
    assert progress[-1] == (len(advice.evaluated), len(advice.evaluated))
    # A round's candidates are counted as it starts, before any of them finishes: the bar never sits
    # full while simulations run.
    for (done, planned), (next_done, next_planned) in itertools.pairwise(progress):
        if done == planned:
            assert next_done == done
            assert next_planned > planned
    # The recommendation is one of the simulated candidates, and re-simulating it gives the same figure.
    again = evaluate(workload, advice.recommended.settings)
    assert again.batch_collection_s == advice.recommended.batch_collection_s
    assert isinstance(advice.recommended.settings, Settings)
    if advice.beats_current:
        assert "cut mean batch collection time" in advice.verdict()
    else:
        assert "matches the current config" in advice.verdict()


def test_progress_counts_the_whole_search_from_its_first_report() -> None:
    """The total was each round's own: a log read `advise: 24/24 simulations` with 23 more to run, and
    the bar filled at every round. Now it is the whole search's from the first report, never below what
    has run, and the last report is the count that ran."""
    workload = load_workload(EXAMPLES / "small-trace.yaml")
    progress: list[tuple[int, int]] = []
    advice = advise(
        workload,
        passes=2,
        workers=2,
        knobs=["surplus_groups", "max_staleness"],
        on_run=lambda d, p: progress.append((d, p)),
    )
    ran = len(advice.evaluated)
    assert progress[-1] == (ran, ran)
    assert all(done <= planned for done, planned in progress)
    first_done, first_planned = progress[0]
    assert first_done == 0
    assert first_planned >= ran > 2, progress


def test_the_current_candidate_is_the_hand_written_config_as_it_runs() -> None:
    from app.sim.run import policy_for, simulate

    workload = load_workload(EXAMPLES / "small-trace.yaml")
    outcome = evaluate(workload, current_settings(workload))
    policy = policy_for(workload, "full")
    assert policy.adaptive_lanes  # the sweep runs full as it is, adaptive lanes included
    report = simulate(workload, policy, "full")
    assert outcome.batch_collection_s == report["batch_collection_s"]["mean"]


def test_a_serving_set_below_its_engines_demand_is_advised_up() -> None:
    """Two engines of 2 cores each behind a 1-core serving set: every model turn crawls. The serving
    cores are a knob where lanes are pinned, and the advice moves the boundary."""
    import dataclasses

    from app.sim.advise import serving_grid
    from app.sim.workload import Workload

    base = load_workload(EXAMPLES / "small-trace.yaml")
    data = base.model_dump(by_alias=True)
    data["cpus"] = {**data["cpus"], "serving": 1}
    data["trace"] = base.trace
    workload = Workload.model_validate(data)
    start = current_settings(workload)
    assert start.serving_cores == 1
    assert serving_grid(workload, 1) == [1, 3, 4, 5, 6]  # demand 4 × ¾, 1, 1¼, 1½, and the current
    assert "serving_cores" in knob_grid(workload, start)
    assert "serving_cores" not in knob_grid(workload, start, pinned=False)
    assert knob_grid(workload, start)["borrow_serving_cpus"] == [0, 1]  # the workload's own (off) first
    assert start.borrow_serving_cpus is False
    advice = advise(workload, passes=1, workers=2, knobs=["serving_cores"])
    chosen = advice.recommended.settings
    assert chosen.serving_cores is not None
    assert chosen.serving_cores >= 3
    assert dataclasses.replace(chosen, serving_cores=1) == start  # only the boundary moved
    assert advice.recommended.batch_collection_s < advice.current.batch_collection_s
    assert advice.as_dict()["recommended"]["settings"]["serving_cores"] == chosen.serving_cores


def test_borrowing_is_a_knob_that_reaches_the_workload() -> None:
    from app.sim.advise import _workload_with

    workload = load_workload(EXAMPLES / "small-trace.yaml")
    start = current_settings(workload)
    borrowing = start.with_knob("borrow_serving_cpus", 1)
    assert borrowing.borrow_serving_cpus is True
    assert _workload_with(workload, borrowing).lanes.borrow_serving_cpus is True
    assert _workload_with(workload, start).lanes.borrow_serving_cpus is False
    assert evaluate(workload, borrowing).batch_collection_s > 0


def test_the_agent_gate_is_a_knob_run_as_corral_sim_runs_it() -> None:
    from app.sim.run import policy_for, simulate

    workload = load_workload(EXAMPLES / "small-trace.yaml")
    start = current_settings(workload)
    grid = knob_grid(workload, start)
    # full's own gate (1.0) first, then off, half and double; 1.0 is not simulated twice
    assert grid["agent_gate_percent"] == [None, 0, 50, 200]
    assert start.as_dict()["agent_gate"] is None
    assert start.gate() == "policy default"
    off, half = start.with_knob("agent_gate_percent", 0), start.with_knob("agent_gate_percent", 50)
    written = Workload.model_validate(advised_workload(workload, off))
    assert written.policy.agent_gate == 0.0
    assert policy_for(written, "full").agent_gate is None  # 0: no gate
    assert off.gate() == "off"
    assert advised_workload(workload, half)["policy"]["agent_gate"] == 0.5
    assert half.as_dict()["agent_gate"] == 0.5
    report = simulate(workload, policy_for(workload, "full", agent_gate=0.5), "full")
    assert evaluate(workload, half).batch_collection_s == report["batch_collection_s"]["mean"]
    assert report["agent_gate"]["factor"] == 0.5
    assert knob_grid(workload, half)["agent_gate_percent"] == [50, 0, 100, 200]


def test_attempts_admission_is_a_knob_tried_first_and_run_as_corral_sim_runs_it() -> None:
    from app.core.config import AdmissionMode
    from app.sim.advise import TIE_FRACTION
    from app.sim.run import policy_for, simulate

    workload = load_workload(EXAMPLES / "small-trace.yaml")
    start = current_settings(workload)
    assert start.attempts_admission is False  # the policy's own admission, as the config runs
    grid = knob_grid(workload, start)
    assert next(iter(grid)) == "attempts_admission"
    assert grid["attempts_admission"] == [0, 1]  # the current value first
    attempts = start.with_knob("attempts_admission", 1)
    assert attempts.as_dict()["admission"] == "attempts"
    assert start.as_dict()["admission"] is None
    # The candidate is what `corral sim --admission attempts` runs on the same workload.
    report = simulate(workload, policy_for(workload, "full", admission=AdmissionMode.ATTEMPTS), "full")
    assert evaluate(workload, attempts).batch_collection_s == report["batch_collection_s"]["mean"]
    assert evaluate(workload, attempts).batch_collection_s != evaluate(workload, start).batch_collection_s

    advice = advise(workload, passes=1, workers=2, knobs=["attempts_admission"])
    means = {o.settings.attempts_admission: o.batch_collection_s for o in advice.evaluated}
    assert set(means) == {False, True}
    wins = means[True] < means[False] * (1 - TIE_FRACTION)
    assert advice.recommended.settings.attempts_admission is wins


def make_outcome(settings: Settings, **overrides: float) -> Outcome:
    figures = {"batch_collection_s": 100.0, "p90_s": 120.0, "trainer_idle_fraction": 0.5}
    figures |= {"wasted_trajectory_s": 0.0, "lower_bound_s": 80.0, **overrides}
    return Outcome(settings=settings, **figures)


def test_an_advice_interrupted_before_any_candidate_says_there_is_none(tmp_path: Path) -> None:
    """Interrupted after only the current settings were simulated: the verdict said "the advice matches
    the current config: no candidate beat it", and the plot drew a line of one point on an axis of
    -0.04..0.04. It now says that no candidate was simulated, and the panel of candidates says so."""
    start = current_settings(load_workload(EXAMPLES / "small-trace.yaml"))
    current = make_outcome(start)
    alone = Advice(current, current, [current], complete=False)
    assert alone.verdict().startswith("no candidate was simulated, so there is no advice")
    assert "matches" not in alone.verdict()
    figure = advice_figure(alone)
    left, right = figure.axes
    assert [t.get_text() for t in left.get_xticklabels()] == ["current"]
    assert not right.axison
    assert not right.lines
    assert "no candidate simulated" in right.texts[0].get_text()
    plot_advice(alone, str(tmp_path / "a.png"))
    assert (tmp_path / "a.png").stat().st_size > 0
    # One candidate simulated: a real comparison again, both panels drawn.
    other = make_outcome(start.with_knob("surplus_groups", 0), batch_collection_s=150.0)
    one = Advice(current, current, [current, other], complete=False)
    assert one.verdict().startswith("the advice matches the current config")
    labels = [line.get_label() for line in advice_figure(one).axes[1].lines]
    assert labels == ["candidate", "its lower bound", "advised"]


def test_each_bar_of_the_advice_plot_has_its_own_lower_bound() -> None:
    """One dashed line at the current settings' bound ran across the advised bar too, labelled 'lower
    bound (current B+S)', though the advised S has a bound of its own."""
    start = current_settings(load_workload(EXAMPLES / "small-trace.yaml"))
    current = make_outcome(start, lower_bound_s=110.0)
    advised = make_outcome(start.with_knob("surplus_groups", 0), batch_collection_s=90.0, lower_bound_s=60.0)
    left = advice_figure(Advice(current, advised, [current, advised], complete=True)).axes[0]
    (bounds,) = left.collections
    segments = sorted(((x0, x1), y0) for (x0, y0), (x1, _) in bounds.get_segments())
    bars = sorted((bar.get_x(), bar.get_x() + bar.get_width()) for bar in left.patches)
    assert [x for x, _ in segments] == bars
    assert [y for _, y in segments] == [110.0, 60.0]
    assert "lower bound (its own B+S)" in [t.get_text() for t in left.get_legend().get_texts()]


def test_an_interrupted_pool_is_gone_before_the_interrupt_goes_on() -> None:
    """The pool's thread used to outlive the interrupt (`shutdown(wait=False)` forgot it), so at the
    interpreter's exit `concurrent.futures` could wake it through a pipe the thread was closing: an
    "OSError: [Errno 9] Bad file descriptor" traceback after advise's one line. When the interrupt
    leaves the block, the workers and the pool's thread are already gone."""
    import multiprocessing
    import threading
    import time
    from concurrent.futures.process import _ExecutorManagerThread

    from app.children import stopping_pool

    class Interrupted(Exception):
        pass

    def pool_threads() -> list[threading.Thread]:
        return [t for t in threading.enumerate() if isinstance(t, _ExecutorManagerThread) and t.is_alive()]

    before = set(multiprocessing.active_children())
    assert not pool_threads()
    started = time.monotonic()
    try:
        with stopping_pool(2) as pool:
            busy = [pool.submit(time.sleep, 60) for _ in range(4)]
            while not all(f.running() for f in busy[:2]):
                time.sleep(0.01)
            raise Interrupted
    except Interrupted:
        assert not pool_threads(), "the pool's thread outlived the interrupt"
        assert not set(multiprocessing.active_children()) - before, "a worker outlived the interrupt"
    assert time.monotonic() - started < 30


def test_settings_that_delivered_no_batch_rank_last_and_are_never_advised(tmp_path: Path) -> None:
    """A candidate of no batch has no mean (null, where it was 0.0 and so the fastest of all)."""
    from app.sim.advise import _choose

    start = current_settings(load_workload(EXAMPLES / "small-trace.yaml"))
    current = make_outcome(start)
    none = make_outcome(start.with_knob("surplus_groups", 0))
    none.batch_collection_s = none.p90_s = None
    advice = _choose(start, {start: current, none.settings: none}, complete=True)
    assert advice.recommended is current
    assert advice.evaluated == [current, none]
    assert none.mean_text() == "no batch delivered"
    figure = advice_figure(advice)
    plot_advice(advice, str(tmp_path / "a.png"))
    assert math.isnan(figure.axes[1].lines[0].get_ydata()[1])
    # Where the current settings delivered none, any that did are advised, and the verdict says why.
    advice = _choose(none.settings, {none.settings: none, start: current}, complete=True)
    assert advice.recommended is current
    assert advice.verdict() == "the advised settings deliver batches where the current ones delivered none"
    left = advice_figure(advice).axes[0]
    assert left.texts[0].get_text().startswith("no batch\n")


def test_a_candidate_that_cannot_be_simulated_is_ranked_last_and_the_search_goes_on(
    tmp_path: Path, monkeypatch
) -> None:
    """One candidate raising in its worker ended the whole search with a traceback, losing every
    simulation done; it is now kept with its error, and the CLI says so."""
    import app.sim.advise as advise_module

    workload = load_workload(EXAMPLES / "small-trace.yaml")
    real_grid = advise_module.knob_grid

    def grid_with_a_bad_value(*args, **kwargs):
        grid = real_grid(*args, **kwargs)
        return {**grid, "surplus_groups": [*grid["surplus_groups"], -3]}  # S < 0 fails to validate

    monkeypatch.setattr(advise_module, "knob_grid", grid_with_a_bad_value)
    advice = advise(workload, passes=1, workers=2, knobs=["surplus_groups"])
    assert advice.complete
    [failed] = advice.failed
    assert failed.settings.surplus_groups == -3
    assert failed.batch_collection_s is None
    assert "surplus_groups" in (failed.error or "")
    assert failed.mean_text().startswith("not simulated (ValidationError")
    assert advice.recommended.error is None
    assert advice.evaluated[-1] is failed
    assert advice.as_dict()["evaluated"][-1]["error"] == failed.error
    plot_advice(advice, str(tmp_path / "a.png"))  # a failed bar plots as no batch does
    # The current settings failing still ends the search: there is nothing to advise against.
    bad_start = current_settings(workload).with_knob("surplus_groups", -3)
    monkeypatch.setattr(advise_module, "current_settings", lambda _workload: bad_start)
    with pytest.raises(Exception, match="surplus_groups"):
        advise(workload, passes=1, workers=1, knobs=["surplus_groups"])


def test_faster_settings_that_cut_short_more_attempts_are_not_advised() -> None:
    """An attempt out of its agent time before its turns fails, so settings that are faster by cutting
    more attempts short deliver failures sooner: on `default` the fastest candidates cut 30-40% where
    the hand-written settings cut 12%. Advice may cut at most CUT_SHORT_SLACK more."""
    from app.sim.advise import _choose
    from app.sim.family import CUT_SHORT_SLACK

    start = current_settings(load_workload(EXAMPLES / "small-trace.yaml"))
    current = make_outcome(start)
    current.batch_collection_s, current.attempts_cut_short_share = 100.0, 0.12
    starving = make_outcome(start.with_knob("surplus_groups", 40))
    starving.batch_collection_s, starving.attempts_cut_short_share = 50.0, 0.12 + CUT_SHORT_SLACK + 0.01
    fair = make_outcome(start.with_knob("surplus_groups", 20))
    fair.batch_collection_s, fair.attempts_cut_short_share = 80.0, 0.12 + CUT_SHORT_SLACK
    seen = {o.settings: o for o in (current, starving, fair)}
    advice = _choose(start, seen, complete=True)
    assert advice.recommended is fair
    assert advice.passed_over == [starving]
    assert advice.as_dict()["passed_over_for_cut_attempts"] == 1
    # the plot marks it: the curve began with it, faster than the advised setting, and said nothing
    from app.sim.advise import advice_figure

    lines = {line.get_label(): line for line in advice_figure(advice).axes[1].lines}
    marked = lines["faster, not advised: cuts more attempts short"]
    assert list(marked.get_xdata()) == [advice.evaluated.index(starving)]
    assert list(lines["advised"].get_xdata()) == [advice.evaluated.index(fair)]
    assert fair.cut_text() == ", 17% of attempts cut short"
    # with nothing else, the current settings stand
    alone = _choose(start, {start: current, starving.settings: starving}, complete=True)
    assert alone.recommended is current
    assert not alone.beats_current


def test_settings_whose_run_cannot_proceed_are_an_outcome_and_the_search_goes_on() -> None:
    """Where every group fails, a run stops with `RunCannotProceed`. That ended the whole search with a
    traceback when the current settings did so; it is now an outcome of no batch that says why."""
    small = load_workload(EXAMPLES / "small-trace.yaml")
    data = small.model_dump(mode="json", by_alias=True, exclude_none=True)
    data.pop("trace")
    data["trajectory"]["p_infra_error"] = 0.99  # nearly every attempt loses its sandbox
    workload = Workload.model_validate(data)
    outcome = evaluate(workload, current_settings(workload))
    assert outcome.batch_collection_s is None
    assert outcome.error is None  # simulated: not a failure to simulate
    assert outcome.stopped is not None
    assert "no batch can be filled" in outcome.stopped
    assert outcome.mean_text() == f"no batch delivered (stopped: {outcome.stopped})"
    assert outcome.as_dict()["stopped"] == outcome.stopped
    advice = advise(workload, passes=1, workers=1, knobs=["surplus_groups"])
    assert advice.complete
    assert len(advice.evaluated) > 1
    assert all(o.batch_collection_s is None for o in advice.evaluated)
    assert advice.verdict() == (
        f"none of the {len(advice.evaluated)} settings simulated delivered a batch; "
        f"the current ones stopped: {advice.current.stopped}"
    )
    # its plot says so in words: each bar's stop reason ran into the next one's, and the right panel
    # drew an empty line chart
    import matplotlib.pyplot as plt

    from app.sim.advise import advice_figure

    fig = advice_figure(advice)
    texts = [t.get_text() for ax in fig.axes for t in ax.texts]
    plt.close(fig)
    assert "no setting simulated delivered a batch" in texts
    assert [t.split("\n")[0] for t in texts if "idle" in t] == ["no batch", "no batch"]


def test_a_workload_carries_admission_and_the_gate_as_corral_sim_flags_do() -> None:
    """`policy.admission` and `policy.agent_gate` in a workload run as `--admission` and `--agent-gate`
    do, and advise starts from them as the workload's own settings."""
    from app.core.config import AdmissionMode
    from app.sim.run import policy_for, simulate

    workload = load_workload(EXAMPLES / "small-trace.yaml")
    data = workload.model_dump(by_alias=True)
    data["policy"] |= {"admission": "attempts", "agent_gate": 0.5}
    carried = Workload.model_validate(data)
    flags = policy_for(workload, "full", admission=AdmissionMode.ATTEMPTS, agent_gate=0.5)
    assert policy_for(carried, "full") == flags
    assert (
        simulate(carried, policy_for(carried, "full"), "full")["batch_collection_s"]
        == simulate(workload, flags, "full")["batch_collection_s"]
    )
    start = current_settings(carried)
    assert start.attempts_admission is True
    assert start.agent_gate_percent == 50
    assert start.own_admission is None
    # not by attempts, for this workload, is the rung's own admission (in flight for full)
    other = start.with_knob("attempts_admission", 0)
    assert policy_for(Workload.model_validate(advised_workload(carried, other)), "full").admission is (
        AdmissionMode.IN_FLIGHT
    )
    assert workload_changes(carried, start, other) == {"policy": {"admission": None}}


def test_a_workload_s_own_admission_and_gate_are_named_as_its_own_and_full_s_gate_is_tried() -> None:
    """A workload's live admission read "policy default" (JSON null), as did a gate of 0.333, and with
    such a gate the policy's own 1.0 was never tried."""
    workload = load_workload(EXAMPLES / "small-trace.yaml")
    data = workload.model_dump(by_alias=True)
    data["policy"] |= {"admission": "live", "agent_gate": 0.333}
    own = current_settings(Workload.model_validate(data))
    assert own.admission() == "live (the workload's)"
    assert own.gate() == "0.333 (the workload's)"
    assert own.as_dict()["admission"] == "live"
    assert own.as_dict()["agent_gate"] == 0.333
    assert knob_grid(workload, own)["agent_gate_percent"] == [None, 0, 50, 100, 200]
    # a whole percent is a knob's value, however the float rounds (0.29 * 100 is 28.999999999999996)
    for gate, percent in ((0.29, 29), (0.57, 57), (0.07, 7), (1.1, 110)):
        data["policy"]["agent_gate"] = gate
        assert current_settings(Workload.model_validate(data)).agent_gate_percent == percent


def test_a_workload_s_admission_and_gate_are_full_s_alone() -> None:
    """An advised workload's gate of 0.05 turned `corral bench`'s sync and completion rungs into
    something else (sync 141.9 -> 637.0 s); a simulated run of `corral serve` ignored both."""
    from app.core.config import AdmissionMode
    from app.service.ports import run_policy
    from app.service.schemas import RunCreate
    from app.sim.run import policy_for

    workload = load_workload(EXAMPLES / "small-trace.yaml")
    data = workload.model_dump(mode="json", by_alias=True)
    data["policy"] |= {"admission": "attempts", "agent_gate": 0.05, "max_updating_engines": 1}
    carried = Workload.model_validate(data)
    full = policy_for(carried, "full")
    assert (full.admission, full.agent_gate, full.max_updating_engines) == (AdmissionMode.ATTEMPTS, 0.05, 1)
    for rung in ("sync", "completion", "lanes"):
        assert policy_for(carried, rung) == policy_for(workload, rung).with_changes(max_updating_engines=1)
    # a simulated run of `corral serve` takes them as `corral sim` does (the API's runs read no trace)
    untraced = {**data, "trace": None}
    for rung in ("full", "completion"):
        spec = RunCreate.model_validate({"kind": "sim", "policy": rung, "workload": untraced})
        assert run_policy(spec) == policy_for(Workload.model_validate(untraced), rung)
    assert run_policy(RunCreate.model_validate({"kind": "sim", "workload": untraced})).agent_gate == 0.05


def test_advice_over_seeds_judges_each_candidate_by_its_means() -> None:
    workload = load_workload(EXAMPLES / "small-trace.yaml")
    start = current_settings(workload)
    over = evaluate(workload, start, seeds=3)
    data = workload.model_dump(by_alias=True)
    each = [evaluate(Workload.model_validate({**data, "seed": workload.seed + i}), start) for i in range(3)]
    assert over.per_seed_s == [o.batch_collection_s for o in each]
    assert len(set(over.per_seed_s)) > 1  # the seeds differ, or this shows nothing
    assert over.batch_collection_s == pytest.approx(math.fsum(over.per_seed_s) / 3)
    assert over.wasted_trajectory_s == pytest.approx(sum(o.wasted_trajectory_s for o in each) / 3, abs=1e-3)
    assert evaluate(workload, start).per_seed_s is None
    advice = advise(workload, passes=1, workers=2, knobs=["attempts_admission"], seeds=2)
    assert advice.seeds == 2
    assert advice.as_dict()["seeds"] == 2
    assert all(len(o.per_seed_s or []) == 2 for o in advice.evaluated)


def test_a_seed_that_delivers_no_batch_leaves_no_mean() -> None:
    settings = Settings(4, 2, None, (("reset", 1),))
    ok = Outcome(settings, 10.0, 12.0, 0.5, 100.0, 5.0, attempts_cut_short_share=0.0)
    stopped = Outcome(settings, None, None, 1.0, 0.0, 0.0, stopped="every group failed")
    mean = Outcome.mean_of(settings, [ok, stopped])
    assert mean.batch_collection_s is None
    assert mean.stopped == "every group failed"
    assert mean.per_seed_s == [10.0, None]
