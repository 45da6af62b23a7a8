"""Weight publication plans: rolling (one engine at a time) or stop-the-world.

Invariants:
- rolling: at most `max_updating` engines are updating at once; an updating engine takes no new turns
  and its in-flight turns are kept (or drained), never restarted. With a `may_join` predicate (the
  runtime's free-slot pacing), a second and further engine begins only when the predicate allows it;
  the first never waits on it, so an update always makes progress;
- stop-the-world: every engine updates together and the runtime restarts the in-flight trajectories;
- an engine always moves to the newest published version; versions it never served are skipped;
- an engine that is down (died, or its update failed or timed out) takes no turns and no updates; an
  update it was running is abandoned and the rolling update goes on to the other engines. It comes back
  (`on_engine_up`) only at a version the runtime has brought it to.
- with a staleness bound K (`max_staleness`), an engine more than K versions behind the newest takes
  no turns: every turn it served would make its group too stale at once ("cannot meet K"), so a turn
  waits for a fresher engine instead. Such an engine goes first in a rolling update and joins it
  without waiting on `may_join` (still within `max_updating`): it serves nothing useful meanwhile;
- while held (an operator paused the run), no engine takes turns and no update begins; updates due
  meanwhile begin when the hold ends;
- a drained engine (an operator took it out of rotation) takes no turns and no update, down or up,
  restarted or not, until it is put back; then the rolling update brings it to the newest version.
- an engine that refused a version (it answered that it cannot load those weights) keeps serving the
  version it had and is not offered the refused one again, by either plan: a newer publication is
  offered to it as usual. Too stale for K on its old version, it takes no turns until then.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass


@dataclass(frozen=True)
class BeginUpdate:
    engine: str
    version: int


@dataclass(frozen=True)
class RestartInFlight:
    """Stop-the-world: every in-flight trajectory starts over."""


UpdateAction = BeginUpdate | RestartInFlight

# (engine, engines already updating) -> may `engine` begin updating beside them?
MayJoin = Callable[[str, tuple[str, ...]], bool]


def too_stale(version: int, newest: int, max_staleness: int | None) -> bool:
    """An engine at `version` is too stale to serve while `newest` is published: every turn it served
    would make its group more than K versions behind at once. Never without a K."""
    return max_staleness is not None and newest - version > max_staleness


class UpdatePlan:
    def __init__(
        self,
        engines: list[str],
        rolling: bool,
        max_updating: int = 1,
        version: int = 0,
        may_join: MayJoin | None = None,
        max_staleness: int | None = None,
    ) -> None:
        if not engines:
            raise ValueError("an update plan needs at least one engine")
        if max_updating < 1:
            raise ValueError(f"max_updating must be ≥ 1, got {max_updating}")
        self.rolling = rolling
        self.max_updating = max_updating
        self.may_join = may_join
        self.target = version
        self.versions = dict.fromkeys(engines, version)
        # some engine serves an older version than the newest (a rolling update is under way); kept
        # up to date where versions or the target change, since the router asks it on every turn
        self.lagging = False
        self._oldest = version  # the oldest version any engine serves
        self.updating: dict[str, int] = {}
        self.down: set[str] = set()
        self.max_staleness = max_staleness
        self.too_stale: set[str] = set()  # serving, but more than K versions behind the newest
        self.held = False
        self.drained: set[str] = set()
        self.refused: dict[str, int] = {}  # engine -> the newest version it refused to load
        self.max_seen_updating = 0
        self.updates_done = 0

    def routable(self, engine: str) -> bool:
        return (
            engine not in self.updating
            and engine not in self.down
            and engine not in self.too_stale
            and not self.held
            and engine not in self.drained
        )

    def set_drained(self, engine: str, drained: bool) -> list[UpdateAction]:
        """Take `engine` out of rotation (an update under way on it finishes), or put it back."""
        if engine not in self.versions:
            raise ValueError(f"unknown engine {engine!r}")
        if drained:
            self.drained.add(engine)
            return []
        self.drained.discard(engine)
        return self._proceed()

    def up(self, engine: str) -> bool:
        """Neither down nor updating: the engine should answer (routable or not: held, too stale)."""
        return engine not in self.updating and engine not in self.down

    def set_held(self, held: bool) -> list[UpdateAction]:
        """Hold (an operator paused the run) or release: released, the updates due meanwhile begin."""
        self.held = held
        if held:
            return []
        return self._proceed()

    def _relag(self) -> None:
        self._oldest = min(self.versions.values())
        self.lagging = self._oldest < self.target

    def fresh_for(self, oldest: int | None) -> Callable[[str], bool] | None:
        """The engines a turn should prefer so that its group gets no older: those at or above
        `oldest`, the group's oldest turn version (None: no turn yet, so the newest version). None when
        every engine qualifies."""
        floor = self.target if oldest is None else oldest
        if self._oldest >= floor:
            return None
        versions = self.versions
        return lambda engine: versions[engine] >= floor

    def set_max_staleness(self, max_staleness: int | None) -> list[UpdateAction]:
        """K changed live: engines may become too stale to serve (or fit again)."""
        self.max_staleness = max_staleness
        return self._next() if self.rolling else []

    def _mark_too_stale(self) -> None:
        k = self.max_staleness
        self.too_stale = {
            e for e, v in self.versions.items() if too_stale(v, self.target, k) and e not in self.updating
        }

    @property
    def all_down(self) -> bool:
        return len(self.down) == len(self.versions)

    def on_engine_down(self, engine: str) -> list[UpdateAction]:
        """`engine` left rotation; an update it was running is abandoned and the next engine goes."""
        if engine not in self.versions:
            raise ValueError(f"unknown engine {engine!r}")
        self.down.add(engine)
        self.updating.pop(engine, None)
        return self._proceed()

    def on_engine_up(self, engine: str, version: int) -> list[UpdateAction]:
        """`engine` serves again, at `version` (the runtime brings it to the newest version first)."""
        if engine not in self.down:
            raise ValueError(f"engine {engine!r} is not down")
        self.down.discard(engine)
        self.versions[engine] = version
        self._relag()
        return self._proceed()

    def on_refused(self, engine: str, version: int) -> list[UpdateAction]:
        """`engine` refused to load `version` (in an update, or while it was brought back after a
        restart): it serves on at the version it had, and the update goes on to the other engines."""
        if engine not in self.versions:
            raise ValueError(f"unknown engine {engine!r}")
        self.updating.pop(engine, None)
        self.refused[engine] = max(version, self.refused.get(engine, -1))
        return self._proceed()

    def refuses(self, engine: str, version: int) -> bool:
        """`engine` refused `version` or a newer one: it is not offered `version` again."""
        return self.refused.get(engine, -1) >= version

    def _behind(self, engine: str) -> bool:
        return self.versions[engine] < self.target and not self.refuses(engine, self.target)

    def on_publish(self, version: int) -> list[UpdateAction]:
        if version <= self.target:
            return []
        self.target = version
        self._relag()
        if self.rolling:
            return self._next()
        # A stop-the-world update still running moves the engines on to `version` when it ends.
        return [] if self.updating or self.held else self._stop_world()

    def on_updated(self, engine: str) -> list[UpdateAction]:
        version = self.updating.pop(engine)
        self.versions[engine] = version
        self._relag()
        self.updates_done += 1
        return self._proceed()

    def _proceed(self) -> list[UpdateAction]:
        """After a change of engines' state: the next updates due, rolling or stop-the-world."""
        return self._next() if self.rolling else self._stop_world_if_behind()

    def _stop_world_if_behind(self) -> list[UpdateAction]:
        if self.updating or self.held:
            return []
        out = self.down | self.drained
        if not any(self._behind(e) for e in self.versions if e not in out):
            return []
        return self._stop_world()

    def _stop_world(self) -> list[UpdateAction]:
        # In-flight work starts over even when no engine is up to update: engines come back at the
        # newest version, and the trajectories must not mix in turns of the old one.
        actions: list[UpdateAction] = [RestartInFlight()]
        up = [
            e
            for e in self.versions
            if e not in self.down and e not in self.drained and not self.refuses(e, self.target)
        ]
        for engine in up:
            self.updating[engine] = self.target
            actions.append(BeginUpdate(engine, self.target))
        self.max_seen_updating = max(self.max_seen_updating, len(self.updating))
        return actions

    def _next(self) -> list[UpdateAction]:
        actions: list[UpdateAction] = []
        if self.held:
            return actions
        may_join = self.may_join
        self._mark_too_stale()
        out = self.down | self.drained
        behind = [e for e in self.versions if e not in out and self._behind(e)]
        # Engines too stale to serve first (a stable sort: otherwise in engine order), without pacing.
        behind.sort(key=lambda e: e not in self.too_stale)
        for engine in behind:
            if len(self.updating) >= self.max_updating:
                break
            if engine in self.updating:
                continue
            # Beyond the first engine, free-slot pacing decides (the first never waits on it).
            paced = self.updating and engine not in self.too_stale
            if paced and may_join is not None and not may_join(engine, tuple(self.updating)):
                break
            self.updating[engine] = self.target
            self.too_stale.discard(engine)
            actions.append(BeginUpdate(engine, self.target))
        self.max_seen_updating = max(self.max_seen_updating, len(self.updating))
        return actions
