"""`corral advise`: search S, K, the admission mode (groups in flight, or attempts in flight), the
number of updating engines, the lane concurrency, the agent-phase gate (app.runtime.gate) and, where
lanes are pinned, how the cores split between serving and sandboxes and whether the lanes may borrow
the serving cores serving leaves idle, for the settings that minimise mean batch collection time on
a workload, by simulating each candidate.

The search is coordinate descent from the workload's own settings, which are simulated exactly as
the hand-written config runs (`full` with its own defaults: adaptive lanes, its update pacing and
updating engines), so the advice can never be slower than them: one knob at a time, every value of
that knob's grid is simulated (in parallel processes) with the other knobs held at the best found so
far, and the best is kept; two passes over the knobs. Every candidate runs the production scheduler
and runtime under the simulator on the same seeded draws, so differences come from the settings only.

Ranking: lower mean batch collection time wins. A candidate must beat the current settings by more
than `TIE_FRACTION` to be recommended over them; otherwise the advice says the current settings
match the best found, rather than recommending a change inside the noise of the model.
"""

from __future__ import annotations

import dataclasses
import math
import os
import statistics
import textwrap
from collections.abc import Callable, Iterable
from concurrent.futures import Future
from concurrent.futures.process import BrokenProcessPool
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from app.children import WorkerLost, stopping_pool
from app.core.config import AdmissionMode
from app.outputs import save_figure
from app.runtime.report import drawn_s
from app.sim.family import cut_short_share, cuts_more
from app.sim.lanes import LaneSharing
from app.sim.run import policy_for, simulate_unless_stopped
from app.sim.workload import Workload
from app.validation import MAX_DEFAULT_WORKERS

if TYPE_CHECKING:
    from matplotlib.figure import Figure

TIE_FRACTION = 0.01
LANES = ("reset", "exec", "validate", "cleanup")
MAX_LANE_SLOTS = 100_000

OnRun = Callable[[int, int], None]


@dataclass(frozen=True)
class Settings:
    surplus_groups: int
    max_staleness: int
    max_updating_engines: int | None  # None: the policy's own default (the hand-written config)
    lane_slots: tuple[tuple[str, int], ...]
    # Cores behind the serving/sandbox boundary for serving (`cpus.serving`); the rest are the sandbox
    # cores. None: the workload's own.
    serving_cores: int | None = None
    # Lanes also run on the serving cores serving leaves idle (`lanes.borrow_serving_cpus`). None: the
    # workload's own.
    borrow_serving_cpus: bool | None = None
    # B + S caps attempts in flight ((B + S)·G, `AdmissionMode.ATTEMPTS`); False: the workload's own
    # admission (`own_admission`), else the policy's (in flight, for full), as the hand-written config runs.
    attempts_admission: bool = False
    # The agent-phase gate's factor in percent (`policy.agent_gate` × 100; 0: no gate). None: the
    # workload's own (`own_gate`), else the policy's (1.0 for full).
    agent_gate_percent: int | None = None
    # Not knobs: what the workload itself sets, which the settings above fall back to (every candidate
    # has the same), so that they say so: a workload's live admission read "policy default".
    own_admission: str | None = None
    own_gate: float | None = None

    def with_knob(self, knob: str, value: int | None) -> Settings:
        if knob == "max_updating_engines":
            return dataclasses.replace(self, max_updating_engines=value)
        if knob == "agent_gate_percent":
            return dataclasses.replace(self, agent_gate_percent=value)
        if value is None:
            raise ValueError(f"{knob} needs a value")
        if knob == "serving_cores":
            return dataclasses.replace(self, serving_cores=value)
        if knob == "borrow_serving_cpus":
            return dataclasses.replace(self, borrow_serving_cpus=bool(value))
        if knob == "attempts_admission":
            return dataclasses.replace(self, attempts_admission=bool(value))
        if knob in LANES:
            slots = tuple((lane, value if lane == knob else n) for lane, n in self.lane_slots)
            return dataclasses.replace(self, lane_slots=slots)
        if knob == "surplus_groups":
            return dataclasses.replace(self, surplus_groups=value)
        if knob == "max_staleness":
            return dataclasses.replace(self, max_staleness=value)
        raise ValueError(f"unknown knob {knob!r}")

    def as_policy(self) -> dict[str, int | None]:
        return {
            "surplus_groups": self.surplus_groups,
            "max_staleness": self.max_staleness,
            "max_updating_engines": self.max_updating_engines,
        }

    def updating(self) -> str:
        return "policy default" if self.max_updating_engines is None else str(self.max_updating_engines)

    def admission(self) -> str:
        if self.attempts_admission:
            return AdmissionMode.ATTEMPTS.value
        return "policy default" if self.own_admission is None else f"{self.own_admission} (the workload's)"

    def gate_factor(self) -> float | None:
        """The gate's factor these settings run with (0: no gate); None: the policy's own."""
        return self.own_gate if self.agent_gate_percent is None else self.agent_gate_percent / 100

    def gate(self) -> str:
        factor = self.gate_factor()
        if factor is None:
            return "policy default"
        said = "off" if factor == 0 else f"{factor:g}"
        return f"{said} (the workload's)" if self.agent_gate_percent is None else said

    def as_dict(self) -> dict[str, Any]:
        return {
            **self.as_policy(),
            "lanes": dict(self.lane_slots),
            "serving_cores": self.serving_cores,
            "borrow_serving_cpus": self.borrow_serving_cpus,
            "admission": AdmissionMode.ATTEMPTS.value if self.attempts_admission else self.own_admission,
            # The gate's factor (0: off); None: the policy's own
            "agent_gate": self.gate_factor(),
        }


@dataclass
class Outcome:
    settings: Settings
    batch_collection_s: float | None  # None: no batch delivered, so no mean (ranked last)
    p90_s: float | None
    trainer_idle_fraction: float
    wasted_trajectory_s: float
    lower_bound_s: float
    error: str | None = None  # the candidate could not be simulated: why (ranked last, as no batch)
    # The share of its attempts that ran out of their agent time before the turns an idle machine
    # finishes in it, and failed (app.sim.family.cut_short_share); None where not simulated.
    attempts_cut_short_share: float | None = None
    # Why its run stopped before delivering a batch (`RunCannotProceed`: every group failed, or none
    # had a learning signal); it was simulated, and it ranks last, as no batch.
    stopped: str | None = None

    # With advise's `seeds` above 1: each seed's mean batch collection time, in seed order (the figures
    # above are their means); None for one seed.
    per_seed_s: list[float | None] | None = None

    @classmethod
    def mean_of(cls, settings: Settings, runs: list[Outcome]) -> Outcome:
        """One outcome of the same settings on several seeds: each figure the mean over them. A seed on
        which no batch was delivered (or that stopped) leaves no mean, so the settings rank last."""
        means = [r.batch_collection_s for r in runs]
        stopped = next((r.stopped for r in runs if r.stopped is not None), None)

        def mean(values: list[float | None]) -> float | None:
            known = [v for v in values if v is not None]
            return round(statistics.fmean(known), 6) if len(known) == len(values) else None

        # the seeds that played attempts (a seed that stopped has no share: it would turn off the guard
        # against advice that cuts more attempts short, `_cuts_more`)
        shares = [r.attempts_cut_short_share for r in runs if r.attempts_cut_short_share is not None]

        return cls(
            settings=settings,
            batch_collection_s=mean(list(means)),
            p90_s=mean([r.p90_s for r in runs]),
            trainer_idle_fraction=round(statistics.fmean(r.trainer_idle_fraction for r in runs), 6),
            wasted_trajectory_s=round(statistics.fmean(r.wasted_trajectory_s for r in runs), 3),
            lower_bound_s=round(statistics.fmean(r.lower_bound_s for r in runs), 6),
            attempts_cut_short_share=round(statistics.fmean(shares), 6) if shares else None,
            stopped=stopped,
            per_seed_s=list(means),
        )

    @classmethod
    def failed(cls, settings: Settings, exc: BaseException) -> Outcome:
        return cls(settings, None, None, 0.0, 0.0, 0.0, error=f"{type(exc).__name__}: {exc}")

    def mean_text(self) -> str:
        """`12.3 s`, that no batch was delivered (there is no mean), or why it could not be simulated."""
        mean = self.batch_collection_s
        if self.error is not None:
            return f"not simulated ({self.error})"
        if self.stopped is not None:
            return f"no batch delivered (stopped: {self.stopped})"
        return "no batch delivered" if mean is None else f"{mean:.1f} s"

    def as_dict(self) -> dict[str, Any]:
        return {
            "settings": self.settings.as_dict(),
            "batch_collection_s": self.batch_collection_s,
            "p90_s": self.p90_s,
            "trainer_idle_fraction": self.trainer_idle_fraction,
            "wasted_trajectory_s": self.wasted_trajectory_s,
            "lower_bound_s": self.lower_bound_s,
            "error": self.error,
            "stopped": self.stopped,
            "attempts_cut_short_share": self.attempts_cut_short_share,
            "per_seed_s": self.per_seed_s,
        }

    def cut_text(self) -> str:
        share = self.attempts_cut_short_share
        return "" if share is None else f", {share:.0%} of attempts cut short"


@dataclass
class Advice:
    current: Outcome
    recommended: Outcome
    evaluated: list[Outcome] = field(default_factory=list)
    complete: bool = True  # False: the search was interrupted; the best of what it simulated
    seeds: int = 1  # each outcome's figures are the means over this many seeds

    @property
    def beats_current(self) -> bool:
        return self.recommended.settings != self.current.settings

    @property
    def failed(self) -> list[Outcome]:
        """The candidates that could not be simulated (each with its `error`)."""
        return [o for o in self.evaluated if o.error is not None]

    @property
    def passed_over(self) -> list[Outcome]:
        """Faster candidates not advised: they cut short more attempts than the current settings."""
        best = _rank(self.recommended)
        return [o for o in self.evaluated if _rank(o) < best and _cuts_more(o, self.current)]

    @property
    def candidates(self) -> int:
        """Settings simulated besides the current ones."""
        return sum(1 for o in self.evaluated if o.settings != self.current.settings)

    def verdict(self) -> str:
        if not self.candidates:  # interrupted after the current settings: nothing to compare them with
            return (
                "no candidate was simulated, so there is no advice "
                "(search interrupted after the current settings)"
            )
        if not self.complete:
            return self._verdict() + f" (search interrupted after {len(self.evaluated)} settings)"
        return self._verdict()

    def _verdict(self) -> str:
        if self.recommended.batch_collection_s is None:  # no settings simulated delivered a batch
            why = self.current.stopped  # the current settings cannot have failed: that ends the search
            every = f" on every one of the {self.seeds} seeds" if self.seeds > 1 else ""
            return f"none of the {len(self.evaluated)} settings simulated delivered a batch{every}" + (
                f"; the current ones stopped: {why}" if why else ""
            )
        if not self.beats_current:
            return (
                "the advice matches the current config: no candidate beat it by more than "
                f"{TIE_FRACTION:.0%} in mean batch collection time"
            )
        current, advised = self.current.batch_collection_s, self.recommended.batch_collection_s
        if current is None or advised is None:  # the advised settings are the current ones otherwise
            return "the advised settings deliver batches where the current ones delivered none"
        ratio = current / max(advised, 1e-9)
        return f"the advised settings cut mean batch collection time {ratio:.2f}× against the current ones"

    def as_dict(self) -> dict[str, Any]:
        return {
            "current": self.current.as_dict(),
            "recommended": self.recommended.as_dict(),
            "beats_current": self.beats_current,
            "complete": self.complete,
            "seeds": self.seeds,
            "verdict": self.verdict(),
            "passed_over_for_cut_attempts": len(self.passed_over),
            "evaluated": [o.as_dict() for o in self.evaluated],
        }


def current_settings(workload: Workload) -> Settings:
    gate, admission = workload.policy.agent_gate, workload.policy.admission
    # a whole percent is a knob's value; another gate (0.333) stays the workload's own, not a percent
    percent = None if gate is None or abs(gate * 100 - round(gate * 100)) > 1e-9 else round(gate * 100)
    return Settings(
        surplus_groups=workload.policy.surplus_groups,
        max_staleness=workload.policy.max_staleness,
        max_updating_engines=workload.policy.max_updating_engines,
        lane_slots=tuple(workload.lanes.slots().items()),
        serving_cores=workload.cpus.serving,
        borrow_serving_cpus=workload.lanes.borrow_serving_cpus,
        attempts_admission=admission is AdmissionMode.ATTEMPTS,
        agent_gate_percent=percent,
        own_admission=None if admission in (None, AdmissionMode.ATTEMPTS) else admission.value,
        own_gate=gate if percent is None else None,
    )


def serving_grid(workload: Workload, current: int) -> list[int]:
    """Serving cores to try: the engines' CPU demand (`engines.count × cpus.engine_demand`) × ¾, 1, 1¼
    and 1½, and the current split, within what leaves the four lanes a core each. A serving set below
    its engines' demand slows every model turn; one above it leaves cores idle that sandboxes queue
    for, since the boundary is hard (random workloads, docs/simulator.md)."""
    demand = workload.serving_demand
    most = workload.cpus.total - 4
    values = {current} | {math.ceil(demand * f) for f in (0.75, 1.0, 1.25, 1.5)}
    return sorted(v for v in values if 1 <= v <= most)


def knob_grid(workload: Workload, best: Settings, pinned: bool = True) -> dict[str, list[int | None]]:
    """The values tried for each knob around `best` (always including its current value); the serving
    cores and borrowing only where lanes are pinned (`pinned`), since shared CPUs have no boundary to
    move, and borrowing only with work-conserving lanes."""
    b = workload.batch.groups
    engines = workload.engines.count
    surplus = {0, b // 4, b // 2, b, 2 * b, 3 * b, best.surplus_groups}
    staleness = {1, 2, 3, 4, 6, 8, best.max_staleness}
    updating = {n for n in (1, 2, engines // 4, engines // 2) if 1 <= n <= engines}
    # The current value first; None is the policy's own default (the hand-written config's).
    own = best.max_updating_engines
    attempts = int(best.attempts_admission)
    grid: dict[str, list[int | None]] = {
        # First: what B + S caps changes what every other knob does (S above all).
        "attempts_admission": [attempts, 1 - attempts],
        "surplus_groups": list(sorted(surplus)),
        "max_staleness": list(sorted(staleness)),
        "max_updating_engines": [own, *sorted(updating - {own} if own is not None else updating)],
    }
    for lane, slots in best.lane_slots:
        grid[lane] = list(sorted({max(1, slots // 2), slots, min(MAX_LANE_SLOTS, slots * 2)}))
    # The agent-phase gate after the exec lane's slots, which its limit follows: off, half, double (and
    # 1.0 where the current value is not the policy's own, which is 1.0 for full).
    gate = best.agent_gate_percent
    grid["agent_gate_percent"] = [
        gate,
        # 1.0 is what None runs unless the workload sets a gate of its own
        *(
            v
            for v in (0, 50, 100, 200)
            if v != gate and (v != 100 or gate is not None or best.own_gate is not None)
        ),
    ]
    if pinned:
        grid["serving_cores"] = list(serving_grid(workload, best.serving_cores or workload.cpus.serving))
        if workload.lanes.sharing is LaneSharing.WORK_CONSERVING:
            own = int(bool(best.borrow_serving_cpus))
            grid["borrow_serving_cpus"] = [own, 1 - own]  # the current value first
    return grid


def _workload_with(workload: Workload, settings: Settings) -> Workload:
    data = workload.model_dump(by_alias=True)
    data["lanes"] = {**data["lanes"], **dict(settings.lane_slots)}
    own = workload.policy.admission
    data["policy"] = {
        **data["policy"],
        "surplus_groups": settings.surplus_groups,
        "max_staleness": settings.max_staleness,
        "max_updating_engines": settings.max_updating_engines,
        # not by attempts: the workload's own admission, or the rung's where the workload's is attempts
        "admission": AdmissionMode.ATTEMPTS
        if settings.attempts_admission
        else (None if own is AdmissionMode.ATTEMPTS else own),
    }
    if settings.agent_gate_percent is not None:  # else the workload's own gate, or the rung's
        data["policy"]["agent_gate"] = settings.agent_gate_percent / 100
    if settings.serving_cores is not None:
        data["cpus"] = {**data["cpus"], "serving": settings.serving_cores}
    if settings.borrow_serving_cpus is not None:
        data["lanes"]["borrow_serving_cpus"] = settings.borrow_serving_cpus
    if workload.trace is not None:
        data["trace"] = workload.trace  # already resolved; keep the object, not a relative path
    return Workload.model_validate(data)


def advised_workload(workload: Workload, settings: Settings) -> dict[str, Any]:
    """`workload` with `settings`, as data that `corral sim --workload` reads back into the same
    workload (JSON's types; a trace by its absolute path), so that it simulates what was evaluated."""
    data = _workload_with(workload, settings).model_dump(mode="json", by_alias=True)
    if data.get("trace") is not None:  # as loaded: next to a workload given by a relative path, relative
        data["trace"]["path"] = os.path.abspath(data["trace"]["path"])
    return data


APPLIED_SECTIONS = ("policy", "lanes", "cpus")  # the workload's sections a setting lives in


def workload_changes(workload: Workload, current: Settings, advised: Settings) -> dict[str, dict[str, Any]]:
    """What `advised` changes of `workload` (whose own settings are `current`): by section, the keys
    whose values differ, in the workload's own names, so that a user can apply them by hand."""
    before, after = advised_workload(workload, current), advised_workload(workload, advised)
    changes = {}
    for section in APPLIED_SECTIONS:
        diff = {k: v for k, v in after[section].items() if before[section].get(k) != v}
        if diff:
            changes[section] = diff
    return changes


def evaluate(workload: Workload, settings: Settings, policy_name: str = "full", seeds: int = 1) -> Outcome:
    """Simulate one candidate (module-level so that worker processes can run it); with `seeds` above 1,
    on the workload's seed and the `seeds - 1` after it, each figure the mean over them."""
    candidate = _workload_with(workload, settings)  # all of its settings, as `corral sim` runs them
    if seeds == 1:
        return _evaluate_once(candidate, settings, policy_name)
    data = candidate.model_dump(by_alias=True)
    runs = [
        _evaluate_once(Workload.model_validate({**data, "seed": candidate.seed + i}), settings, policy_name)
        for i in range(seeds)
    ]
    return Outcome.mean_of(settings, runs)


def _evaluate_once(candidate: Workload, settings: Settings, policy_name: str) -> Outcome:
    policy = policy_for(candidate, policy_name)
    # A run that can fill no batch is an outcome, not an error: the current settings stopping so ended
    # the whole search, where another candidate may deliver batches.
    report = simulate_unless_stopped(candidate, policy, policy_name)
    if not isinstance(report, dict):
        return Outcome(settings, None, None, 1.0, 0.0, 0.0, stopped=str(report))
    return Outcome(
        settings=settings,
        batch_collection_s=report["batch_collection_s"]["mean"],
        p90_s=report["batch_collection_s"]["p90"],
        # a simulated run always collects (its clock starts with it): a share, never null
        trainer_idle_fraction=report["trainer_idle_fraction"] or 0.0,
        wasted_trajectory_s=round(sum(report["wasted_trajectory_s"].values()), 3),
        lower_bound_s=report["lower_bound_s"],
        attempts_cut_short_share=cut_short_share(report),
    )


def _cuts_more(outcome: Outcome, current: Outcome) -> bool:
    """Whether `outcome` cuts short more of its attempts than the current settings, past
    `app.sim.family.CUT_SHORT_SLACK`: faster batches of failed attempts are not advice (on `default`
    the fastest candidates cut 30-40% where the hand-written settings cut 12%)."""
    return cuts_more(outcome.attempts_cut_short_share, current.attempts_cut_short_share)


def _rank(outcome: Outcome) -> tuple[float, float]:
    mean = outcome.batch_collection_s
    return (math.inf if mean is None else mean, outcome.wasted_trajectory_s)


class AdviceInterrupted(Exception):
    """Ctrl-C (or a worker lost to it), or a worker that died otherwise (`lost`, which says how), stopped
    the search. `partial` is the advice from the settings simulated so far, or None when not even the
    current settings were."""

    def __init__(self, partial: Advice | None, lost: str | None = None) -> None:
        super().__init__(lost or "the search was interrupted")
        self.partial = partial
        self.lost = lost


def _choose(start: Settings, seen: dict[Settings, Outcome], complete: bool, seeds: int = 1) -> Advice:
    current = seen[start]
    top = min((o for o in seen.values() if not _cuts_more(o, current)), key=_rank)
    best, now = top.batch_collection_s, current.batch_collection_s
    if best is None or (now is not None and best >= now * (1 - TIE_FRACTION)):
        top = current
    return Advice(current, top, sorted(seen.values(), key=_rank), complete, seeds)


def default_workers() -> int:
    """One simulation per CPU this process may use (its affinity: `taskset`, a cpuset), at most
    `MAX_DEFAULT_WORKERS`; `os.cpu_count()` would count the machine's."""
    return max(1, min(len(os.sched_getaffinity(0)), MAX_DEFAULT_WORKERS))


def advise(
    workload: Workload,
    policy_name: str = "full",
    passes: int = 2,
    workers: int | None = None,
    on_run: OnRun | None = None,
    knobs: Iterable[str] | None = None,
    seeds: int = 1,
) -> Advice:
    """Coordinate descent over the knobs; `on_run(done, planned)` reports progress. A Ctrl-C raises
    `AdviceInterrupted` with the advice from what was simulated so far. With `seeds` above 1 each
    candidate is judged by its means over that many seeds (`evaluate`): one seed's draws can favour
    settings that another's do not."""
    workers = workers or default_workers()
    start = current_settings(workload)
    seen: dict[Settings, Outcome] = {}
    try:
        _search(workload, policy_name, passes, workers, on_run, knobs, start, seen, seeds)
    except (KeyboardInterrupt, BrokenProcessPool, WorkerLost) as exc:
        partial = _choose(start, seen, complete=False, seeds=seeds) if start in seen else None
        raise AdviceInterrupted(partial, str(exc) if isinstance(exc, WorkerLost) else None) from None
    return _choose(start, seen, complete=True, seeds=seeds)


def candidate_outcome(candidate: Settings, fut: Future[Outcome], start: Settings) -> Outcome:
    """A candidate's outcome. One that raised is kept as failed, with its error, and the search goes on:
    it ended the whole search, losing what was simulated. The current settings raising still ends it
    (there is nothing to advise against), as a lost worker does (an interrupt, `BrokenProcessPool`)."""
    try:
        return fut.result()
    except BrokenProcessPool:
        raise
    except Exception as exc:
        if candidate == start:
            raise
        return Outcome.failed(candidate, exc)


def _search(
    workload: Workload,
    policy_name: str,
    passes: int,
    workers: int,
    on_run: OnRun | None,
    knobs: Iterable[str] | None,
    start: Settings,
    seen: dict[Settings, Outcome],
    seeds: int,
) -> None:
    """The coordinate descent of `advise`, recording every outcome in `seen` as it arrives. `planned`,
    the total it reports, is the whole search's from the start: what is simulated, plus this knob's new
    candidates, plus every later round's grid less the value it already holds, counted again at each
    knob. A round never has more new candidates than its grid less the best's own value, so it comes
    down as candidates of a later pass turn out simulated already; the last report is the count run.
    It was each round's own, so the bar filled at every round and a log read `advise: 24/24
    simulations` with 23 to go."""
    pinned = policy_for(workload, policy_name).pinned_lanes

    def rounds(grid: dict[str, list[int | None]], order: list[str]) -> int:
        return sum(len(set(grid[knob])) - 1 for knob in order)

    grid = knob_grid(workload, start, pinned)
    planned = 1 + passes * rounds(grid, list(knobs or grid))
    reported = (-1, -1)

    def report() -> None:
        nonlocal reported
        if on_run is not None and reported != (len(seen), planned):
            reported = (len(seen), planned)
            on_run(*reported)

    with stopping_pool(workers) as pool:

        def run_all(candidates: list[Settings]) -> None:
            todo = [c for c in dict.fromkeys(candidates) if c not in seen]
            futures = [pool.submit(evaluate, workload, c, policy_name, seeds) for c in todo]
            if todo:
                report()  # the round's count, before its first result
            for candidate, fut in zip(todo, futures, strict=True):
                outcome = candidate_outcome(candidate, fut, start)
                seen[outcome.settings] = outcome
                report()

        run_all([start])
        best = start
        for done_passes in range(passes):
            grid = knob_grid(workload, best, pinned)
            order = list(knobs or grid)
            for i, knob in enumerate(order):
                values = grid[knob]
                new = {best.with_knob(knob, v) for v in values} - seen.keys()
                later = rounds(grid, order[i + 1 :]) + (passes - done_passes - 1) * rounds(grid, order)
                planned = len(seen) + len(new) + later
                run_all([best.with_knob(knob, v) for v in values])
                # the next knob is tried around the best that cuts short no more attempts than the
                # current settings allow (`_cuts_more`), as the advice itself is chosen
                tried = [seen[best], *(seen[best.with_knob(knob, v)] for v in values)]
                best = min((o for o in tried if not _cuts_more(o, seen[start])), key=_rank).settings
    planned = len(seen)
    report()


def plot_advice(advice: Advice, path: str) -> None:
    """Current against advised settings, and every candidate's time against the lower bound."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig = advice_figure(advice)
    save_figure(fig, path, dpi=110)
    plt.close(fig)


def advice_figure(advice: Advice) -> Figure:
    """The figure of `plot_advice`. With no candidate simulated (interrupted after the current
    settings) the left panel shows the current settings alone and the right one says so, instead of a
    line of one point on a degenerate axis."""
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(12, 4.5))
    names = ["current", "advised"] if advice.candidates else ["current"]
    pair = [advice.current, advice.recommended][: len(names)]
    means = [drawn_s(o.batch_collection_s) for o in pair]
    bars = left.bar(names, means, color=["#999999", "#2b7bba"][: len(names)])
    for bar, outcome in zip(bars, pair, strict=True):
        mean = outcome.batch_collection_s
        # why a run delivered nothing is in the verdict above: under a bar it ran into the next one's
        said = f"{mean:.1f} s" if mean is not None else "no batch"
        said = "not simulated" if outcome.error is not None else said
        left.annotate(
            f"{said}\nidle {outcome.trainer_idle_fraction:.0%}\n"
            f"wasted {outcome.wasted_trajectory_s:,.0f} traj-s",
            (bar.get_x() + bar.get_width() / 2, 0.0 if math.isnan(bar.get_height()) else bar.get_height()),
            ha="center",
            va="bottom",
            fontsize=8,
        )
    # Each bar's own bound: the advised S is another B + S, with another bound (one line at the current
    # settings' bound ran across the advised bar as if it were that bar's).
    left.hlines(
        [o.lower_bound_s for o in pair],
        [bar.get_x() for bar in bars],
        [bar.get_x() + bar.get_width() for bar in bars],
        color="k",
        ls="--",
        lw=1,
        label="lower bound (its own B+S)",
    )
    left.set_ylabel("mean batch collection time (s)")
    left.set_ylim(0, 1.3 * max([m for m in means if not math.isnan(m)] or [1.0]))
    # a long verdict (why no batch came) is wrapped, not cut at the figure's edges
    fig.suptitle(textwrap.shorten(advice.verdict(), 330, placeholder=" …"), fontsize=10, wrap=True)
    left.legend(fontsize=8)
    if advice.candidates and all(o.batch_collection_s is None for o in advice.evaluated):
        right.set_axis_off()
        right.text(0.5, 0.5, "no setting simulated delivered a batch", ha="center", va="center")
    elif advice.candidates:
        xs = range(len(advice.evaluated))
        candidates = [drawn_s(o.batch_collection_s) for o in advice.evaluated]
        right.plot(xs, candidates, "o-", ms=3, label="candidate")
        right.plot(xs, [o.lower_bound_s for o in advice.evaluated], "k--", lw=1, label="its lower bound")
        # the faster ones not advised, and the advised one, marked: the curve's first point was a setting
        # passed over for cutting more attempts short, with nothing to say so
        passed = {id(o) for o in advice.passed_over}
        marked = [(x, y) for x, o, y in zip(xs, advice.evaluated, candidates, strict=True) if id(o) in passed]
        if marked:
            right.plot(*zip(*marked, strict=True), "x", color="#b00020", ms=7, mew=1.5,
                       label="faster, not advised: cuts more attempts short")  # fmt: skip
        at = next(x for x, o in zip(xs, advice.evaluated, strict=True) if o is advice.recommended)
        right.plot([at], [candidates[at]], "o", ms=9, mfc="none", mec="#2b7bba", mew=2, label="advised")
        right.set_xlabel("simulated settings, best first")
        right.xaxis.get_major_locator().set_params(integer=True)
        right.set_ylabel("mean batch collection time (s)")
        right.legend(fontsize=8)
    else:
        right.set_axis_off()
        right.text(0.5, 0.5, "no candidate simulated:\nthe search was interrupted", ha="center", va="center")
    fig.tight_layout()
    return fig
