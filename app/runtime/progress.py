"""What `corral run` prints while it works, so a newcomer sees the run from its first second.

One line per step, each stamped with the seconds since the run started: the engines starting, each
engine answering /health (with its URL), the lanes and their CPUs, then one line per delivered batch
and per engine update or discarded group. Figures are rounded; no raw dicts. Lines are plain text
(never read as rich markup), so a path or a task name holding `[` prints as it is.

Invariant: printing never changes the run. The engine watcher only reads /health and is cancelled as
soon as the run's own start-up check returns.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Mapping, Sequence
from typing import Protocol

import httpx
from rich.console import Console
from rich.text import Text

from app.core.config import LaneOrder
from app.core.events import (
    AttemptFinished,
    BatchDelivered,
    EngineStateChanged,
    EngineUpdateEnd,
    Envelope,
    GroupDiscarded,
    GroupReady,
    LaneResized,
    PolicyChanged,
    SandboxOp,
    TurnDone,
)
from app.cpulist import format_cpu_list
from app.runtime.config import LocalRunConfig

# Between lines, a status line at most this often while work goes on (turns, attempts, groups ready).
STATUS_EVERY_S = 15.0

# Events that are frequent and dull; the per-batch line sums them up.


class _Engine(Protocol):
    @property
    def port(self) -> int: ...


class _Engines(Protocol):
    @property
    def engines(self) -> Mapping[str, _Engine]: ...

    def wait_healthy(self) -> Awaitable[None]: ...

    @property
    def exited_at_start(self) -> Mapping[str, str]: ...


def _count(n: int, noun: str) -> str:
    return f"{n} {noun}{'' if n == 1 else 's'}"


def _round(value: object) -> object:
    if isinstance(value, float):
        return round(value, 1)
    if isinstance(value, list | tuple) and len(value) > 6:
        return f"{len(value)} items"
    return value


class RunProgress:
    """Prints a run's progress to `console` (nothing when it is None)."""

    def __init__(self, console: Console | None, batches: int | None = None) -> None:
        self.console = console
        self.batches = batches
        self.started = time.perf_counter()
        self.last_line = self.started
        self.discarded = 0
        self.groups_per_batch: int | None = None
        self.delivered = 0
        self.ready: set[int] = set()
        self.attempts = 0
        self.turns = 0
        self.sandbox_ops = 0

    def line(self, text: str) -> None:
        self.last_line = time.perf_counter()
        if self.console is not None:
            stamp = f"[{self.last_line - self.started:6.1f}s] "
            self.console.print(Text(stamp + text), highlight=False, soft_wrap=True)

    def on_envelope(self, envelope: Envelope) -> None:
        """A subscriber of the run's event bus: a line for each delivered batch, engine update or state
        change, discarded group and live policy change; counts turns, sandbox operations, attempts and
        ready groups, and says where the next batch stands when nothing was printed for
        `STATUS_EVERY_S`."""
        event = envelope.event
        if isinstance(event, TurnDone):
            self.turns += 1
        elif isinstance(event, SandboxOp):
            self.sandbox_ops += 1
        elif isinstance(event, AttemptFinished):
            self.attempts += 1
        elif isinstance(event, GroupReady):
            self.ready.add(event.group_id)
        else:
            said = self._say(envelope)
            if said is not None:
                self.line(said)
        if time.perf_counter() - self.last_line >= STATUS_EVERY_S:
            of = f" of {self.groups_per_batch}" if self.groups_per_batch else ""
            self.line(
                f"collecting batch {self.delivered + 1}: {len(self.ready)}{of} groups ready, "
                f"{_count(self.attempts, 'attempt')} finished, {_count(self.turns, 'turn')} and "
                f"{_count(self.sandbox_ops, 'sandbox operation')} so far"
            )

    def starting(
        self,
        config: LocalRunConfig,
        serving_cpus: Sequence[int],
        *,
        pinned_lanes: bool,
        cpu_priority: bool = False,
    ) -> None:
        """Where things run: the engines on the serving CPUs, the lanes on theirs (or shared), and in
        which order the lanes serve groups."""
        count = config.engines.count
        self.groups_per_batch = config.batch.groups
        self.line(
            f"starting {count} embedded engine{'s' if count != 1 else ''} on CPUs "
            f"{format_cpu_list(serving_cpus)} ({config.engines.slots} turns each at once; "
            "torch start-up takes a while on a small machine)"
        )
        lanes = config.lanes
        slots = f"reset {lanes.reset}, exec {lanes.exec}, validate {lanes.validate_}, cleanup {lanes.cleanup}"
        where = f"on CPUs {format_cpu_list(lanes.cpus)}" if pinned_lanes else "sharing every CPU with serving"
        borrowed = sorted(set(lanes.cpus) & set(serving_cpus))
        if pinned_lanes and lanes.borrow_serving_cpus and borrowed:
            where += f" (on serving CPUs {format_cpu_list(borrowed)} only with what serving leaves idle)"
        if pinned_lanes and lanes.order is LaneOrder.OLDEST_GROUP:
            where += ", oldest group first" + (
                " (its queued work, and CPU time by niceness)"
                if cpu_priority
                else " (its queued work; no CPU priority: lowering a niceness again needs root)"
            )
        self.line(f"sandbox lanes (slots: {slots}) {where}")

    async def wait_for_engines(self, engines: _Engines, every_s: float = 0.5) -> None:
        """`engines.wait_healthy()`, printing each engine as it first answers /health."""
        urls = {name: f"http://127.0.0.1:{engine.port}" for name, engine in engines.engines.items()}
        failure: list[Exception] = []
        waiting = dict(urls)
        async with asyncio.TaskGroup() as tg:
            watcher = tg.create_task(self._watch(waiting, every_s))
            try:
                await engines.wait_healthy()
            except Exception as exc:  # re-raised below, outside the group, as itself
                failure.append(exc)
            watcher.cancel()
        if failure:
            raise failure[0]
        exited = engines.exited_at_start
        for name, url in waiting.items():  # healthy before the watcher's next look, or dead
            if name not in exited:
                self.line(f"{name} ready on {url}")
        ready = len(urls) - len(exited)
        self.line(f"all {len(urls)} engines ready" if not exited else f"{ready} of {len(urls)} engines ready")

    async def _watch(self, waiting: dict[str, str], every_s: float) -> None:
        """Report each engine of `waiting` as it first answers /health, removing it from `waiting`."""
        last_note = time.perf_counter()
        async with httpx.AsyncClient(timeout=1.0) as client:
            while waiting:
                for name, url in list(waiting.items()):
                    try:
                        ok = (await client.get(f"{url}/health")).status_code == 200
                    except httpx.TransportError:
                        ok = False
                    if ok:
                        del waiting[name]
                        self.line(f"{name} ready on {url}")
                if waiting and time.perf_counter() - last_note > 10:
                    last_note = time.perf_counter()
                    self.line(f"still starting: {', '.join(waiting)}")
                await asyncio.sleep(every_s)

    def _say(self, envelope: Envelope) -> str | None:
        """One readable line for the events worth a line, else None."""
        event = envelope.event
        if isinstance(event, BatchDelivered):
            return self._batch(event, envelope.t - event.requested_at)
        if isinstance(event, EngineUpdateEnd):
            if event.ok:
                return f"{event.engine} now serves policy version {event.version}"
            failed = f"{event.engine} failed to load policy version {event.version}"
            if event.refused:
                return f"{failed}, refused by the engine, which serves on at its version: {event.error}"
            return f"{failed} and left rotation: {event.error}"
        if isinstance(event, GroupDiscarded):
            self.ready.discard(event.group_id)
            if event.reason == "cancelled":
                return None  # the live groups a finished run leaves behind; the report counts them
            self.discarded += 1
            return f"group {event.group_id} discarded ({event.reason}); {self.discarded} so far"
        if isinstance(event, EngineStateChanged):
            if event.engine == "*":  # the state of the whole pool, e.g. every engine down
                return event.detail or event.state
            state = event.state.replace("_", " ")  # given_up
            return f"{event.engine} is {state}" + (f": {event.detail}" if event.detail else "")
        if isinstance(event, LaneResized):
            slots = f"{event.old} → {event.new} slots (configured {event.configured}"
            return f"lane {event.lane}: {slots}; {event.why})"
        if isinstance(event, PolicyChanged):
            return f"{event.field} changed from {_round(event.old)} to {_round(event.new)} by {event.actor}"
        return None

    def _batch(self, event: BatchDelivered, wait_s: float) -> str:
        index = event.batch_index + 1
        of = f"/{self.batches}" if self.batches else ""
        worst = max(event.staleness, default=0)
        self.delivered = index
        self.ready.difference_update(event.group_ids)
        return (
            f"batch {index}{of} delivered: {len(event.group_ids)} groups after {wait_s:.1f} s, "
            f"staleness ≤ {worst}"
        )
