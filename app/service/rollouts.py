"""Weight rollouts as `GET /api/runs/{id}/rollouts/{version}` shows them: one answer, whether the run
executes here (from memory) or has ended (from the store).

`RolloutLog` keeps, from a run's event stream, what the store's sink projects into `weight_rollouts`
and `rollout_steps` (app.store.sink), by the same rules; `rollout_answer` renders one rollout from
either source. A resumed run's log is first fed the stored stream, so it knows every version its
predecessors published.

Invariants:
- a version is known only once a `VersionPublished` for it is in the stream: never published, no rollout;
- a rollout is `running` until every engine in rotation has ended its step (`completed`, or `failed`
  when a step failed), or `superseded` when a newer version is published first, or `cancelled` when the
  run ends first (no rollout outlives its run as `running`);
- once the run has ended, no engine of any rollout is `pending` or `updating`: each that had not loaded
  the version is `cancelled` with the error `run ended` (a superseded rollout's too);
- the log keeps at most `KEEP_ROLLOUTS` finished rollouts (the newest; every running one besides), so
  its memory does not grow with the run's length: an older version is answered from the store
  (`forgot`), which the run's store sink has long written it to;
- both sources answer with the same keys (`ROLLOUT_KEYS`, `ENGINE_KEYS`); times are on the run's
  clock (`started_at`, `ended_at`) and in seconds from the run's first event (`began_s`, `ended_s`).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from app.core.events import (
    EngineStateChanged,
    EngineUpdateBegin,
    EngineUpdateEnd,
    Envelope,
    RunEnded,
    RunStarted,
    VersionPublished,
)
from app.store.sink import OUT_OF_ROTATION, RUN_ENDED  # the live answer words them as the store does

ROLLOUT_KEYS = (
    "rollout_id", "version", "path", "actor", "state", "superseded", "started_at", "ended_at",
    "max_updating_engines", "pause_mode", "engines",
)  # fmt: skip
# Finished rollouts a live run's log keeps in memory, the newest (a version published per trainer step).
KEEP_ROLLOUTS = 256
ENGINE_KEYS = ("engine", "state", "version", "began_s", "ended_s", "started_at", "ended_at", "error")


@dataclass
class RolloutRow:
    version: int
    path: str | None
    actor: str
    state: str  # running, completed, failed, superseded, cancelled
    started_at: float | None
    ended_at: float | None = None


@dataclass
class StepRow:
    """One engine's update to one version."""

    version: int
    engine: str
    state: str  # updating, done, failed, cancelled
    started_at: float | None
    ended_at: float | None = None
    error: str | None = None


class RolloutLog:
    """A run's rollouts kept from its event stream (a bus subscriber, on the run's loop)."""

    def __init__(self, keep: int = KEEP_ROLLOUTS) -> None:
        self.keep = keep
        self.kept_from = 0  # versions below this were forgotten (`forgot`)
        self.rollouts: dict[int, RolloutRow] = {}
        self.steps: dict[int, dict[str, StepRow]] = {}  # version -> engine -> its update to it
        self.engines: dict[str, str] = {}  # name -> state
        self.first_t: float | None = None
        self.ended = False  # the run has ended (until a resumed run starts again)
        self._running: set[int] = set()

    @property
    def newest(self) -> int:
        return max(self.rollouts, default=0)

    def forgot(self, version: int) -> bool:
        """Whether `version`'s rollout was dropped from this log (ask the store)."""
        return version < self.kept_from and version not in self.rollouts

    def steps_from(self, version: int) -> list[StepRow]:
        """The engines' updates to `version` or a newer one."""
        return [step for v, by_engine in self.steps.items() if v >= version for step in by_engine.values()]

    def on_envelope(self, env: Envelope) -> None:
        if self.first_t is None:
            self.first_t = env.t
        ev, t = env.event, env.t
        if isinstance(ev, VersionPublished):
            self._rollout(ev.version, t, ev.path, ev.actor)  # a version published again keeps its row
            for version in [v for v in self._running if v < ev.version]:
                row = self.rollouts[version]
                row.state, row.ended_at = "superseded", t
                self._running.discard(version)
            self._forget_old()
        elif isinstance(ev, EngineUpdateBegin | EngineUpdateEnd) and ev.version < self.kept_from:
            pass  # an update to a version forgotten here (the store has it)
        elif isinstance(ev, EngineUpdateBegin):
            self._rollout(ev.version, t)
            step = self.steps.setdefault(ev.version, {}).get(ev.engine)
            if step is None:
                self.steps[ev.version][ev.engine] = StepRow(ev.version, ev.engine, "updating", t)
            elif step.state != "done":  # done: a resumed run reloads it; the step keeps its own times
                step.state, step.started_at = "updating", t
        elif isinstance(ev, EngineUpdateEnd):
            self._rollout(ev.version, t)
            state, error = ("done", None) if ev.ok else ("failed", ev.error or None)
            step = self.steps.setdefault(ev.version, {}).get(ev.engine)
            if step is None:
                self.steps[ev.version][ev.engine] = StepRow(ev.version, ev.engine, state, t, t, error)
            elif step.state != "done":
                step.state, step.ended_at, step.error = state, t, error
            if ev.ok:
                self.engines.setdefault(ev.engine, "serving")
            self._maybe_finish(ev.version, t)
        elif isinstance(ev, RunStarted):
            self.ended = False
            for name in ev.engines:
                self.engines.setdefault(name, "serving")
        elif isinstance(ev, EngineStateChanged):
            self.engines[ev.engine] = ev.state
            if ev.state in OUT_OF_ROTATION:  # a rollout may have waited only on that engine
                for version in sorted(self._running):
                    self._maybe_finish(version, t)
        elif isinstance(ev, RunEnded):  # no engine will load anything more
            self.ended = True
            for by_engine in self.steps.values():
                for step in by_engine.values():
                    if step.state == "updating":
                        step.state, step.ended_at, step.error = "cancelled", t, RUN_ENDED
            for version in self._running:
                row = self.rollouts[version]
                row.state, row.ended_at = "cancelled", t
            self._running.clear()

    def _forget_old(self) -> None:
        """Past twice `keep` finished rollouts, drop the oldest finished ones down to `keep`."""
        finished = [v for v in self.rollouts if v not in self._running]
        if len(finished) <= 2 * self.keep:
            return
        for version in sorted(finished)[: len(finished) - self.keep]:
            del self.rollouts[version]
            self.steps.pop(version, None)
            self.kept_from = max(self.kept_from, version + 1)

    def _rollout(self, version: int, t: float, path: str | None = None, actor: str = "trainer") -> None:
        if version not in self.rollouts:
            self.rollouts[version] = RolloutRow(version, path, actor, "running", t)
            self._running.add(version)

    def _maybe_finish(self, version: int, t: float) -> None:
        if version not in self._running:
            return
        steps = self.steps.get(version, {})
        if any(s.state == "updating" for s in steps.values()):
            return
        in_rotation = {name for name, state in self.engines.items() if state not in OUT_OF_ROTATION}
        if not in_rotation <= steps.keys():
            return
        row = self.rollouts[version]
        row.state = "failed" if any(s.state == "failed" for s in steps.values()) else "completed"
        row.ended_at = t
        self._running.discard(version)


def rollout_answer(
    row: RolloutRow,
    *,
    newest: int,
    engines: Sequence[str],
    served: Mapping[str, int],
    steps: Iterable[StepRow],
    updating: Mapping[str, int],
    t0: float | None,
    knobs: Mapping[str, Any],
    run_ended: bool = False,
) -> dict[str, Any]:
    """One rollout, engine by engine. `served`: each engine's version now (or when the run ended);
    `steps`: the engines' updates (those to this version or a newer one count); `updating`: engine ->
    version it is loading; `t0`: the run's first event; `knobs`: the run's policy in force;
    `run_ended`: the run has ended, so an engine that never began this version never will."""
    version = row.version
    mine: dict[str, list[StepRow]] = {}
    newer = [s for s in steps if s.version >= version]
    for step in sorted(newer, key=lambda s: (s.started_at is None, s.started_at or 0.0, s.version)):
        mine.setdefault(step.engine, []).append(step)
    names = list(engines) + sorted(set(mine) - set(engines))
    out = []
    for name in names:
        own = mine.get(name, [])
        began = next((s.started_at for s in own if s.started_at is not None), None)
        ended = next((s.ended_at for s in own if s.state == "done" and s.ended_at is not None), None)
        failed = next((s for s in own if s.state == "failed"), None)
        cancelled = next((s for s in own if s.state == "cancelled"), None)
        error = None
        if served.get(name, 0) >= version or any(s.state == "done" for s in own):
            state = "done"
        elif cancelled is not None:  # the run ended under it, whatever the plan left behind
            state, error = "cancelled", cancelled.error
        elif not run_ended and (updating.get(name, -1) >= version or any(s.state == "updating" for s in own)):
            state = "updating"
        elif failed is not None:
            state, error = "failed", failed.error
        elif row.state == "cancelled" or run_ended:  # it never began before the run ended
            state, error = "cancelled", RUN_ENDED
        else:
            state = "pending"
        out.append(
            {
                "engine": name,
                "state": state,
                "version": served.get(name, 0),
                "began_s": _since(began, t0),
                "ended_s": _since(ended, t0),
                "started_at": began,
                "ended_at": ended,
                "error": error,
            }
        )
    return {
        "rollout_id": version,
        "version": version,
        "path": row.path,
        "actor": row.actor,
        "state": row.state,
        "superseded": newest > version,
        "started_at": row.started_at,
        "ended_at": row.ended_at,
        "max_updating_engines": knobs.get("max_updating_engines"),
        "pause_mode": knobs.get("pause_mode"),
        "engines": out,
    }


def _since(t: float | None, t0: float | None) -> float | None:
    return None if t is None or t0 is None else t - t0
