"""The dashboard's live backend: `ManagerRuns` adapts the service's run manager (app.service.manager)
to `RunsBackend`.

- Events come from the run's recorder (`recent.since`) while it executes here, else from the store
  (`store.timeline(run_id, since, limit)`), fetched incrementally and folded into one
  `RunViewBuilder` per run (its open groups and its latest ended ones, at most `KEEP_GROUPS`
  holding at most `KEEP_SPANS` spans, and the run's figures), so a page shows the same account as
  the API and the view of an ended or resumed run is the same as a live one.
- What the stream does not carry comes from the run's handle when it executes here: its state and
  knobs, its clock now, each engine's in-flight turns and the plan's updating engines, and each lane's
  busy slots, queue depth, slots and CPU set.
- A lane's CPU set is worked out as its run starts and is in no event: the service stores each lane's
  CPU set and configured slots as the run starts executing in this server (`described_lanes`), and a
  run not executing here (ended before a restart) shows what was stored ("not recorded" where
  nothing was: a run executed by a worker).
- Actions go through app.service.commands, as the API's do: on the run's loop (`handle.call`) when it
  executes here, through the command channel to its orchestrator worker (app.service.channel) when a
  celery worker drives it, which carries them out with the same code. Refusals (`RunNotLiveError`,
  `IllegalRunStateError`, a bad value) come back as `ActionRefused`/`ValueError` with the run's
  message; a worker not reached or not answering in time as `ActionRefused` with its 503/504. A policy
  change answers once the event sink has stored it (the sink writes the run's policy, in the order the
  changes were made; nothing here writes it).

Views are cached per (run, last sequence number, live snapshot) for `VIEW_TTL_S`, so many open pages
cost one build; a run not executing here is re-read from the store at most every `ELSEWHERE_REFETCH_S`
while it has not ended (a celery worker drives it), and every `IDLE_REFETCH_S` once it has.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections import OrderedDict
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass, field, replace
from typing import Any

from app.core.events import envelope_from_dict
from app.service.gateway import TrainerGateway
from app.service.manager import RunLimitError, ServerStoppingError, described_lanes
from app.service.schemas import SYNC_SURPLUS
from app.service.store import TrainerFigures
from app.store.repos import LaneRepo
from app.validation import parse_decimal, parse_int, problems
from app.web.backend import ActionRefused
from app.web.readmodel import ASKING, BATCHES_KEPT, OUTCOMES, RunMeta, RunSummary, RunView, RunViewBuilder

FETCH_LIMIT = 2000  # events read and folded at a time
# A request folds a run's unread events for about this long at most (a page's first load of a run of
# 350,000 events took 53 s); the next request, or the page's live stream, reads on from there.
CATCH_UP_S = 0.5
KEEP_GROUPS = 500  # ended groups whose rows a live view keeps (the timeline shows the latest)
KEEP_SPANS = 20_000  # and at most about this many of their spans
VIEW_TTL_S = 0.4  # a live run's view is rebuilt at most this often, however many pages watch it
IDLE_REFETCH_S = 5.0  # an ended run not executing here is re-read from the store at most this often
# A run another process drives (a celery orchestrator worker) and not ended yet is re-read this often:
# the read is keyed on the last sequence number folded, so a page follows its worker within about a
# second where it lagged by up to IDLE_REFETCH_S.
ELSEWHERE_REFETCH_S = 1.0
# The views kept of runs not executing here (ended, deleted, or run elsewhere), the least recently read
# let go first: each holds up to KEEP_SPANS spans (several MB on a long run), and a server browsed for
# months would otherwise keep one per run ever opened. A run executing here keeps its view.
KEEP_IDLE_VIEWS = 16
LAUNCH_INTS = ("groups_per_batch", "group_size", "surplus_groups", "max_staleness", "batches")
NOT_RECORDED = "not recorded"  # the CPU set of a lane whose run's start nothing recorded


@dataclass
class _RunCache:
    builder: RunViewBuilder
    last_seq: int = -1
    key: object = None
    view: RunView | None = None
    built_at: float = float("-inf")
    fetched_at: float = float("-inf")
    lock: threading.Lock = field(default_factory=threading.Lock)
    stored_cpus: dict[str, str] | None = None  # the lane CPU sets the store holds, once read
    behind: int | None = None  # while catching up with a long stream: the newest event there is to read
    stored_state: str | None = None  # a run not executing here: its state as last read from the store


def refetch_s(state: str | None) -> float:
    """How often a run not executing here is re-read from the store: often while another process may
    still add to it, seldom once it has ended (`None`: not read yet)."""
    return IDLE_REFETCH_S if state in OUTCOMES else ELSEWHERE_REFETCH_S


class ManagerRuns:
    """`RunsBackend` over a RunManager, found through `get_manager` (the app builds it at start-up)."""

    def __init__(
        self,
        get_manager: Callable[[], Any],
        launch_defaults: Mapping[str, Any] | None = None,
        catch_up_s: float = CATCH_UP_S,
        fetch_limit: int = FETCH_LIMIT,
        channel: Any = None,
    ) -> None:
        self._get_manager = get_manager
        self.catch_up_s = catch_up_s
        self.fetch_limit = fetch_limit
        self._cache: OrderedDict[str, _RunCache] = OrderedDict()  # least recently read first
        self._lock = threading.Lock()
        # A stored run's trainer figures for the runs list: (read at, its state then, the figures)
        self._figures: dict[str, tuple[float, str, TrainerFigures]] = {}
        self.launch_defaults = dict(launch_defaults or {"kind": "sim", "trainer": "sentinel"})
        self._placeholders: dict[str, str] | None = None
        self.channel = channel  # to the orchestrator workers of celery runs (app.service.channel)

    @property
    def manager(self) -> Any:
        return self._get_manager()

    # -- reading --------------------------------------------------------------------------------

    def run_ids(self) -> list[str]:
        return [str(row["id"]) for row in self.manager.list()]

    def summaries(self) -> list[RunSummary]:
        """Every run's row: a run executing here from its recorder's counters (no query), any other
        from the store's run and batch rows (`trainer_figures`, re-read at most every `refetch_s(state)`
        while its state stays the same)."""
        manager = self.manager
        rows = []
        records = manager.list()
        with self._lock:  # a deleted run's figures: kept for the server's life, one per run ever listed
            listed = {str(record["id"]) for record in records}
            for gone in self._figures.keys() - listed:
                del self._figures[gone]
        for record in records:
            run_id = str(record["id"])
            state = str(record.get("state", "unknown"))
            policy = dict(record.get("policy") or {})
            handle = manager.get(run_id)
            if handle is not None:
                live = handle.recorder.view
                policy.update(handle.knobs)
                now = handle.loop.time() if handle.runtime is not None else live.last_t
                figures = TrainerFigures(
                    live.batches, live.trainer_wait_s, live.requested_at, live.first_t, live.last_t
                )
                end = max(now, live.last_t)
            else:
                figures = self._stored_figures(run_id, state)
                end = figures.last_t if figures.last_t is not None else 0.0
            start = figures.first_t if figures.first_t is not None else end
            # as the run page counts it: the open request's wait while the run may still answer it, an
            # ended run's unanswered one to its end
            waiting = 0.0
            if figures.requested_at is not None and state in (*ASKING, *OUTCOMES):
                waiting = max(end - figures.requested_at, 0.0)
            rows.append(
                RunSummary(
                    run_id,
                    "live",
                    state,
                    policy,
                    str(record.get("name", "")),
                    record.get("started_at"),
                    figures.batches,
                    figures.trainer_wait_s,
                    waiting,
                    end - start,
                    resume_short(record.get("replay")) if record.get("resuming") else None,
                )
            )
        return rows

    def _stored_figures(self, run_id: str, state: str) -> TrainerFigures:
        with self._lock:
            cached = self._figures.get(run_id)
        if cached is not None and cached[1] == state and time.monotonic() - cached[0] < refetch_s(state):
            return cached[2]
        figures: TrainerFigures = self.manager.store.trainer_figures(run_id)
        with self._lock:
            self._figures[run_id] = (time.monotonic(), state, figures)
        return figures

    def version(self, run_id: str) -> int:
        entry = self._entry(run_id)
        if entry.behind is not None:  # catching up: each call reads on, and the page follows
            return hash(("catching up", self._fetch(run_id)))
        handle = self.manager.get(run_id)
        if handle is not None:
            newest = handle.recorder.view.last_seq
            if entry.last_seq < newest and time.monotonic() - entry.fetched_at >= VIEW_TTL_S:
                # Events the view has not folded yet, as of a fetch within its TTL: without a fetch here
                # a run that then went quiet (paused) kept the stale view, and a second live S stayed
                # "Now: S = 40" on its page, the store and the API at 400. The version changes again
                # once they are folded, and the page gets the view with them.
                self._fetch(run_id)
            return hash((newest, entry.last_seq, str(handle.state), _live_key(handle)))
        if (replay := self.manager.replay_progress(run_id)) is not None:  # the page follows the replay
            return hash(("resuming", entry.last_seq, repr(replay)))
        if time.monotonic() - entry.fetched_at >= refetch_s(entry.stored_state):
            self._fetch(run_id)
            # A run a celery worker drives can change state with no event (a simulated run's pause):
            # its page swaps Pause for Resume all the same
            record = self.manager.store.get_run(run_id)
            entry.stored_state = None if record is None else record.state
        return hash((entry.last_seq, entry.stored_state))

    def _entry(self, run_id: str) -> _RunCache:
        with self._lock:
            entry = self._cache.get(run_id)
            if entry is None:
                builder = RunViewBuilder(run_id, "live", KEEP_GROUPS, KEEP_SPANS, BATCHES_KEPT)
                entry = self._cache[run_id] = _RunCache(builder)
                self._let_go_idle_views()
            else:
                self._cache.move_to_end(run_id)
            return entry

    def _let_go_idle_views(self) -> None:
        """Past `KEEP_IDLE_VIEWS` views of runs not executing here, drop the least recently read (a
        request still using one keeps it until done; the next read builds it again)."""
        manager = self.manager
        idle = [run_id for run_id in self._cache if manager.get(run_id) is None]
        for run_id in idle[: max(0, len(idle) - KEEP_IDLE_VIEWS)]:
            del self._cache[run_id]

    def _fetch(self, run_id: str) -> int:
        """Fold the events after the last one folded, for about `catch_up_s` at most; the last sequence
        number folded. A run executing here is read from its recorder's recent events (no query, no sink
        lag), else from the store. Still behind when the time is up, the entry notes the newest event
        there is (`behind`), and the next call goes on from there."""
        entry = self._entry(run_id)
        handle = self.manager.get(run_id)
        recorder = getattr(handle, "recorder", None)
        recent = getattr(recorder, "recent", None)
        limit = self.fetch_limit
        with entry.lock:
            started = entry.fetched_at = time.monotonic()
            while True:
                rows = recent.since(entry.last_seq, limit) if recent is not None else None
                if rows is not None:
                    envs = [envelope_from_dict({"run_id": run_id, **row}) for row in rows]
                else:  # not executing here, or older events than it holds
                    envs = self.manager.store.envelopes(run_id, entry.last_seq, limit)
                for env in envs:
                    entry.builder.on_envelope(env)
                    entry.last_seq = env.seq
                if len(envs) < limit:
                    entry.behind = None
                    return entry.last_seq
                if time.monotonic() - started >= self.catch_up_s:
                    newest = recorder.view.last_seq if recorder is not None else None
                    if newest is None or newest < 0:
                        newest = self.manager.store.last_seq(run_id)
                    entry.behind = newest if newest is not None and newest > entry.last_seq else None
                    return entry.last_seq

    def view(self, run_id: str) -> RunView | None:
        manager = self.manager
        record = manager.view(run_id)
        if record is None:
            return None
        entry = self._entry(run_id)
        handle = manager.get(run_id)
        ttl = VIEW_TTL_S if handle is not None else refetch_s(str(record.get("state", "")))
        if entry.behind is not None or time.monotonic() - entry.fetched_at >= ttl:
            self._fetch(run_id)
        meta = self._meta(record, handle, entry)
        if entry.behind is not None:
            # The figures cover the stream read so far: the run as it was at its last event read.
            meta = replace(meta, now=None, catch_up_note=catch_up_note(entry.last_seq, entry.behind))
        notes = (meta.trainer_note, meta.store_note)
        snapshot = (repr(meta.engines), repr(meta.lanes), repr(meta.policy), *notes)
        key = (entry.last_seq, meta.state, meta.resume_note, *snapshot)
        with entry.lock:
            fresh = handle is None or time.monotonic() - entry.built_at < VIEW_TTL_S
            if entry.view is not None and entry.key == key and fresh:
                return entry.view
            view = entry.builder.view(meta)
            entry.key, entry.view, entry.built_at = key, view, time.monotonic()
            return view

    def _meta(self, record: Mapping[str, Any], handle: Any, entry: _RunCache) -> RunMeta:
        state = str(record.get("state", "unknown"))
        policy = dict(record.get("policy") or {})
        policy.setdefault("name", (record.get("config") or {}).get("policy", ""))
        config = record.get("config") or {}
        about = RunMeta(  # what the run's record says, live or not
            state=state,
            label=str(record.get("name", "")),
            started_at=record.get("started_at"),
            error=record.get("error") or None,
            clock_note=clock_note(config, _pace(handle)),
            resume_note=resume_note(record.get("replay")) if record.get("resuming") else None,
        )
        if handle is None:
            if entry.stored_cpus is None:
                entry.stored_cpus = self._stored_cpus(str(record.get("id", entry.builder.run_id)))
            return replace(about, policy=policy, lanes=_stored_lanes(config, entry.stored_cpus))
        runtime = handle.runtime
        engines: list[dict[str, Any]] = []
        lanes: list[dict[str, Any]] = []
        now = None
        if runtime is not None:
            now = handle.loop.time()
            updating = dict(getattr(runtime.plan, "updating", {}))
            active = dict(getattr(runtime.pool, "active", {}))
            down = set(getattr(runtime.plan, "down", ()))
            for name, version in dict(runtime.plan.versions).items():
                engines.append(
                    {
                        "name": name,
                        "version": version,
                        "in_flight": active.get(name),
                        "state": "unhealthy" if name in down else None,
                        "updating": name in updating,
                        "target_version": updating.get(name),
                    }
                )
            lane_config = _lanes_config(runtime.lanes)
            for name, stats in runtime.lanes.stats().items():
                lane = lane_config.get(name, {})
                lanes.append(
                    {
                        "name": name,
                        "busy": stats.busy,
                        "queue_depth": stats.queue_depth,
                        "slots": lane.get("slots"),
                        "configured_slots": lane.get("configured"),
                        "cpus": lane.get("cpus", ""),
                        "order": lane.get("order"),
                    }
                )
        return replace(
            about,
            policy={**policy, **dict(handle.knobs)},
            engines=engines,
            lanes=lanes,
            now=now,
            trainer_note=trainer_note(handle.gateway) if state in ("running", "paused") else None,
            store_note=store_note(handle),
        )

    def _stored_cpus(self, run_id: str) -> dict[str, str]:
        with self.manager.store.session() as session:
            return {lane.name: lane.cpus for lane in LaneRepo(session).list(run_id)}

    # -- acting ---------------------------------------------------------------------------------

    def _handle(self, run_id: str, starting_ok: bool = False) -> Any:
        """The run executing in this server; with `starting_ok`, also one whose engines are starting."""
        handle = self.manager.get(run_id)
        if handle is None or (handle.runtime is None and not starting_ok):
            raise ActionRefused(f"run {run_id} is not executing in this server")
        return handle

    async def _command(
        self,
        run_id: str,
        command: tuple[str, dict[str, Any], str],
        here: Callable[[Any], Awaitable[Any]],
        starting_ok: bool = False,
    ) -> None:
        """`here` on the run's handle when it executes in this server; the same `command` (its name,
        JSON arguments and actor) sent to its orchestrator worker when a celery worker drives it. Its
        refusals as the dashboard answers them: 409 `ActionRefused`, 404 and 422 `ValueError`, 503 and
        504 (the worker not reached, or not answering) `ActionRefused` with that status."""
        from app.service.channel import command_elsewhere
        from app.service.commands import CommandRefused

        try:
            record = await self._elsewhere(run_id)
            if record is not None:
                await command_elsewhere(self.channel, self.manager.store, record, *command)
            else:
                await here(self._handle(run_id, starting_ok))
        except CommandRefused as exc:
            if exc.status in (404, 422):
                raise ValueError(exc.detail) from None
            raise ActionRefused(exc.detail, exc.status) from None

    async def _elsewhere(self, run_id: str) -> Any:
        """The stored run, when an orchestrator worker drives it (or will: still queued); else None."""
        from app.service.channel import driven_elsewhere

        if self.manager.get(run_id) is not None:
            return None
        record = await asyncio.to_thread(self.manager.store.get_run, run_id)
        return record if driven_elsewhere(record) else None

    async def launch(self, form: Mapping[str, str], actor: str) -> str:
        from pydantic import ValidationError

        from app.service.schemas import RunCreate

        data: dict[str, Any] = dict(self.launch_defaults)
        if form.get("policy"):
            data["policy"] = form["policy"]
        if form.get("name"):
            data["name"] = form["name"]
        if form.get("admission"):
            data["admission"] = form["admission"]
        for name in LAUNCH_INTS:
            raw = form.get(name, "").strip()
            if raw:
                try:
                    data[name] = parse_int(raw)
                except ValueError:
                    raise ValueError(f"{name}: expected a whole number, got {raw!r}") from None
        if raw := form.get("agent_gate", "").strip():
            try:
                data["agent_gate"] = parse_decimal(raw)
            except ValueError:
                raise ValueError(f"agent_gate: expected a number, got {raw!r}") from None
        if data.get("policy") == "sync" and data.get("surplus_groups", 0) != 0:
            # The sync rung has no surplus (app.core.config.PolicyConfig.ladder sets S = 0): the run
            # would start with S = 0 and the page show it, whatever was asked.
            raise ValueError(
                SYNC_SURPLUS.format(data["surplus_groups"]) + "; leave S empty, or choose "
                "completion, lanes or full"
            )
        try:
            spec = RunCreate.model_validate(data)
        except ValidationError as exc:
            raise ValueError(problems(exc)) from None
        try:
            return str(await asyncio.to_thread(self.manager.create, spec))
        except RunLimitError as exc:
            raise ActionRefused(str(exc), 429) from None
        except ServerStoppingError as exc:
            raise ActionRefused(str(exc), 503) from None

    def capacity(self) -> dict[str, int]:
        """The runs executing here that count towards the server's limit, and the limit, for the launch
        form to show."""
        return {"executing": len(self.manager.executing()), "limit": self.manager.max_runs}

    def launch_placeholders(self) -> dict[str, str]:
        """What each empty launch field takes, for the form to show: the default run's B, G, S, K and
        agent gate (policy full; sync's S is 0 whatever the default, and the other rungs have no gate)."""
        if self._placeholders is None:
            from app.service.ports import run_policy
            from app.service.schemas import RunCreate

            policy = run_policy(RunCreate.model_validate(self.launch_defaults))
            self._placeholders = {
                "groups_per_batch": f"default {policy.groups_per_batch}",
                "group_size": f"default {policy.group_size}",
                "surplus_groups": f"default {policy.surplus_groups} (sync: 0)",
                "max_staleness": f"default {policy.max_staleness}",
                "agent_gate": (
                    "default off" if policy.agent_gate is None else f"default {policy.agent_gate:g} (full)"
                ),
            }
        return self._placeholders

    async def publish(self, run_id: str, actor: str) -> None:
        from app.service import commands

        await self._command(run_id, ("publish_next", {}, actor), lambda h: commands.publish_next(h, actor))

    async def set_policy(
        self, run_id: str, changes: Mapping[str, float], actor: str, large: bool = False
    ) -> None:
        from pydantic import ValidationError

        from app.service import commands
        from app.service.schemas import PolicyPatch

        try:
            patch = PolicyPatch(**changes, confirm_large_change=large or None)
        except ValidationError as exc:
            raise ValueError(problems(exc)) from None
        command = ("policy", patch.model_dump(mode="json", exclude_none=True), actor)
        await self._command(run_id, command, lambda h: commands.set_policy(h, patch, actor))

    async def pause(self, run_id: str, actor: str) -> None:
        from app.service import commands

        await self._command(run_id, ("pause", {}, actor), lambda h: commands.act(h, "pause", actor))

    async def resume(self, run_id: str, actor: str) -> None:
        from app.service import commands

        await self._command(run_id, ("resume", {}, actor), lambda h: commands.act(h, "resume", actor))

    async def stop(self, run_id: str, actor: str) -> None:
        from app.service.channel import reachable
        from app.service.commands import CommandRefused, on_run

        record = await self._elsewhere(run_id)
        if record is None:
            handle = self._handle(run_id, starting_ok=True)
            try:
                await on_run(handle, handle.stop)
            except CommandRefused as exc:
                raise ActionRefused(exc.detail) from None
        elif record.state != "stopping":  # a second stop asks for what is under way
            try:
                await asyncio.to_thread(reachable(self.channel, run_id).stop, run_id, actor)
            except CommandRefused as exc:
                raise ActionRefused(exc.detail, exc.status) from None

    async def rotate(self, run_id: str, engine: str, into: bool, actor: str) -> None:
        from app.service import commands

        command = ("serve" if into else "drain", {"engine": engine}, actor)
        await self._command(run_id, command, lambda h: commands.rotate(h, engine, into, actor))


def catch_up_note(last_seq: int, newest: int) -> str:
    """What a page says while its run's view is still catching up with the run's stream."""
    read, total = last_seq + 1, newest + 1
    return (
        f"Catching up with this run's stream: {read:,} of {total:,} events read ({read / total:.0%}). "
        "Every figure on this page covers the run up to its last event read (the run time shown), and "
        "the page fills in as the rest is read."
    )


def resume_note(replay: Mapping[str, Any] | None) -> str:
    """What a run's page says while the run is being resumed after a restart (`RunManager.resuming`):
    how far the replay of its stored stream has got (`RunManager.replay_progress`)."""
    said = "Being resumed after the control plane restarted: "
    events = (replay or {}).get("events")
    done = int((replay or {}).get("events_replayed") or 0)
    if events is None:
        said += "its stored stream is about to be replayed."
    elif done < events:
        said += f"{done:,} of {events:,} stored events replayed ({done / events:.0%})."
    else:
        return said + f"all {events:,} stored events replayed; it executes again in a moment."
    return said + " It executes again, and takes commands, once its stored stream is replayed."


def resume_short(replay: Mapping[str, Any] | None) -> str:
    """The runs page's word for a run being resumed, with how far its replay has got."""
    events = (replay or {}).get("events")
    done = int((replay or {}).get("events_replayed") or 0)
    if not events:
        return "resuming"
    return f"resuming: {done:,} of {events:,} events replayed ({min(done / events, 1.0):.0%})"


def _live_key(handle: Any) -> object:
    runtime = handle.runtime
    if runtime is None:
        return None
    return (
        tuple(sorted(dict(runtime.plan.versions).items())),
        tuple(sorted(dict(runtime.plan.updating).items())),
        tuple(sorted(dict(getattr(runtime.pool, "active", {})).items())),
        tuple(sorted(handle.knobs.items())),
        trainer_note(handle.gateway),
        handle.held_for_store,
    )


def store_note(handle: Any) -> str | None:
    """Why a live run starts no turn although running: its events can be kept nowhere (`RunHandle`'s
    hold for the store); None otherwise."""
    if not handle.held_for_store:
        return None
    return (
        f"Held: {handle.recorder.bus.backlog():,} events wait to be stored, and neither the database nor "
        "the spill on local disk takes them (full or read-only). No turn starts until they do; nothing "
        "is lost meanwhile."
    )


def _stored_lanes(config: Mapping[str, Any], cpus: Mapping[str, str]) -> list[dict[str, Any]]:
    """The lanes of a run not executing here, from its stored config: each lane's configured slots (a
    sim run's workload, a local run's config; its slots unless adaptive lanes resized it) and the CPU
    set recorded as it ran (`cpus`; worked out at start, so not in the config)."""
    spec = (config.get("workload") or {}).get("lanes") or (config.get("config") or {}).get("lanes")
    if not isinstance(spec, Mapping):
        spec = {}
    lanes = []
    for name in ("reset", "exec", "validate", "cleanup"):
        slots = spec.get(name, spec.get(f"{name}_"))
        if isinstance(slots, int):
            lanes.append({"name": name, "configured_slots": slots, "cpus": cpus.get(name, NOT_RECORDED)})
        elif name in cpus:
            lanes.append({"name": name, "cpus": cpus[name]})
    return lanes


def _lanes_config(lanes: Any) -> dict[str, dict[str, Any]]:
    """Each lane's slots now, configured slots and CPU set (as the service stores them:
    `described_lanes`), when the run's lanes describe themselves (in-process lanes do)."""
    described = described_lanes(lanes)
    if not described:
        return {}
    now = lanes.describe()
    return {
        name: {
            "slots": now[name]["slots"],
            "configured": configured,
            "cpus": cpus,
            "order": lane_order_text(now[name].get("order"), bool(now[name].get("cpu_priority"))),
        }
        for name, (cpus, configured) in described.items()
    }


def lane_order_text(order: object, cpu_priority: bool) -> str | None:
    """Whom a lane serves first, for the run page: `lanes.order` and whether CPU priority is on."""
    if order == "oldest_group":
        how = "its queued work and, by niceness, CPU time" if cpu_priority else "its queued work only"
        return f"oldest group first ({how})"
    if order == "fifo":
        return "first come, first served"
    return None


# A run waiting this long (wall seconds) on its trainer says so on its page; a trainer that takes, trains
# on and acks a batch in less is working as it should.
TRAINER_NOTE_AFTER_S = 10.0


def trainer_note(gateway: TrainerGateway, after_s: float = TRAINER_NOTE_AFTER_S) -> str | None:
    """What the run has been waiting on its trainer for, once it has waited `after_s`: the page showed
    such a run as running, batches delivered, its clock stopped, with nothing saying it was held."""
    held = gateway.holding()
    if held is None or held[2] < after_s:
        return None
    what, offer, waited_s = held
    waited = wall_duration(waited_s)
    if what == "take":
        return (
            f"Batch {offer.index} has been ready for {waited} and the trainer has not taken it: the run "
            "collects its next batch once the trainer takes and acks this one."
        )
    if what == "ack":
        return (
            f"The trainer took batch {offer.index} {waited} ago and has not acked it: the run collects its "
            "next batch after the ack."
        )
    version = offer.payload.get("publish_version")
    return (
        f"Batch {offer.index} was acked {waited} ago; the run waits for the trainer to publish version "
        f"{version} before it collects its next batch."
    )


def wall_duration(seconds: float) -> str:
    """`42 s`, `9 min`, `2 h 5 min`: a wait as a person reads it, and coarse enough that the page showing
    it changes once a minute after the first."""
    whole = int(seconds)
    if whole < 60:
        return f"{whole} s"
    if whole < 3600:
        return f"{whole // 60} min"
    return f"{whole // 3600} h {whole % 3600 // 60} min"


PACE_SAID_AFTER_S = 10.0


def _pace(handle: Any) -> Mapping[str, float] | None:
    """A simulated run's pace so far (`PacedLoop.pace`), when it executes here."""
    pace = getattr(getattr(handle, "loop", None), "pace", None)
    return pace() if callable(pace) else None


def clock_note(config: Mapping[str, Any], reached: Mapping[str, float] | None = None) -> str | None:
    """A simulated run's page counts its own clock's seconds, which run `speed` times as fast as the
    wall clock; the API's trainer figures (`/metrics`: idle, batch wait) count the wall clock's.
    `reached`: a live run's `PacedLoop.pace()`, said where the run fell short of its speed by a tenth
    over its first `PACE_SAID_AFTER_S` wall seconds or more (its start, engines coming up, is noisy)."""
    if config.get("kind") != "sim":
        return None
    speed = config.get("speed")
    pace = f" (this run goes {speed:g}× as fast as the wall clock)" if isinstance(speed, int | float) else ""
    if (
        reached is not None
        and reached["wall_s"] >= PACE_SAID_AFTER_S
        and reached["effective_speed"] < 0.9 * reached["speed"]
    ):
        pace = (
            f" (this run asks for {reached['speed']:g}× the wall clock's speed and has reached "
            f"{reached['effective_speed']:.3g}×: it stood still {reached['held_s']:.0f} s while its events "
            f"waited to be stored, and lost {reached['lag_s']:.1f} s to a busy server)"
        )
    return (
        f"Times on this page are simulated seconds{pace}; the API's trainer figures (GET …/metrics) are "
        "wall-clock seconds."
    )
