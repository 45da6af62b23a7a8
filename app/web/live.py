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
- Actions call the handle's commands on the run's loop (`handle.call`), as the API does; refusals
  (`RunNotLiveError`, `IllegalRunStateError`, a bad value) come back as `ActionRefused`/`ValueError`
  with the handle's message. A policy change answers once the event sink has stored it (the sink
  writes the run's policy, in the order the changes were made; nothing here writes it).

Views are cached per (run, last sequence number, live snapshot) for `VIEW_TTL_S`, so many open pages
cost one build; a run not executing here is re-read from the store at most every `IDLE_REFETCH_S`.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, replace
from typing import Any

from app.core.events import envelope_from_dict
from app.service.gateway import TrainerGateway
from app.service.manager import described_lanes
from app.service.schemas import SYNC_SURPLUS
from app.store.repos import LaneRepo
from app.validation import parse_int, problems
from app.web.backend import ActionRefused
from app.web.readmodel import RunMeta, RunView, RunViewBuilder

FETCH_LIMIT = 5000
KEEP_GROUPS = 500  # ended groups whose rows a live view keeps (the timeline shows the latest)
KEEP_SPANS = 20_000  # and at most about this many of their spans
VIEW_TTL_S = 0.4  # a live run's view is rebuilt at most this often, however many pages watch it
IDLE_REFETCH_S = 5.0  # a run not executing here is re-read from the store at most this often
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


class ManagerRuns:
    """`RunsBackend` over a RunManager, found through `get_manager` (the app builds it at start-up)."""

    def __init__(
        self, get_manager: Callable[[], Any], launch_defaults: Mapping[str, Any] | None = None
    ) -> None:
        self._get_manager = get_manager
        self._cache: dict[str, _RunCache] = {}
        self._lock = threading.Lock()
        self.launch_defaults = dict(launch_defaults or {"kind": "sim", "trainer": "sentinel"})
        self._placeholders: dict[str, str] | None = None

    @property
    def manager(self) -> Any:
        return self._get_manager()

    # -- reading --------------------------------------------------------------------------------

    def run_ids(self) -> list[str]:
        return [str(row["id"]) for row in self.manager.list()]

    def version(self, run_id: str) -> int:
        handle = self.manager.get(run_id)
        if handle is not None:
            return hash((handle.recorder.view.last_seq, str(handle.state), _live_key(handle)))
        entry = self._entry(run_id)
        if time.monotonic() - entry.fetched_at < IDLE_REFETCH_S:
            return entry.last_seq
        return self._fetch(run_id)

    def _entry(self, run_id: str) -> _RunCache:
        with self._lock:
            if run_id not in self._cache:
                builder = RunViewBuilder(run_id, "live", KEEP_GROUPS, KEEP_SPANS)
                self._cache[run_id] = _RunCache(builder)
            return self._cache[run_id]

    def _fetch(self, run_id: str) -> int:
        """Fold the events after the last one folded; the last sequence number. A run executing here
        is read from its recorder's recent events (no query, no sink lag), else from the store."""
        entry = self._entry(run_id)
        handle = self.manager.get(run_id)
        recent = getattr(getattr(handle, "recorder", None), "recent", None)
        with entry.lock:
            entry.fetched_at = time.monotonic()
            while True:
                rows = recent.since(entry.last_seq, FETCH_LIMIT) if recent is not None else None
                if rows is None:  # not executing here, or older events than it holds
                    rows = self.manager.store.timeline(run_id, entry.last_seq, FETCH_LIMIT)
                for row in rows:
                    env = envelope_from_dict({"run_id": run_id, **row})
                    entry.builder.on_envelope(env)
                    entry.last_seq = env.seq
                if len(rows) < FETCH_LIMIT:
                    return entry.last_seq

    def view(self, run_id: str) -> RunView | None:
        manager = self.manager
        record = manager.view(run_id)
        if record is None:
            return None
        entry = self._entry(run_id)
        handle = manager.get(run_id)
        if time.monotonic() - entry.fetched_at >= (VIEW_TTL_S if handle is not None else IDLE_REFETCH_S):
            self._fetch(run_id)
        meta = self._meta(record, handle, entry)
        snapshot = (repr(meta.engines), repr(meta.lanes), repr(meta.policy), meta.trainer_note)
        key = (entry.last_seq, meta.state, *snapshot)
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
            clock_note=clock_note(config),
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
                    }
                )
        return replace(
            about,
            policy={**policy, **dict(handle.knobs)},
            engines=engines,
            lanes=lanes,
            now=now,
            trainer_note=trainer_note(handle.gateway) if state in ("running", "paused") else None,
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

    async def _call(self, handle: Any, fn: Callable[..., Any], *args: Any) -> Any:
        from app.service.handle import IllegalRunStateError, RunNotLiveError

        try:
            return await handle.call(fn, *args)
        except (RunNotLiveError, IllegalRunStateError) as exc:
            raise ActionRefused(str(exc)) from None

    async def launch(self, form: Mapping[str, str], actor: str) -> str:
        from pydantic import ValidationError

        from app.service.schemas import RunCreate

        data: dict[str, Any] = dict(self.launch_defaults)
        if form.get("policy"):
            data["policy"] = form["policy"]
        if form.get("name"):
            data["name"] = form["name"]
        for name in LAUNCH_INTS:
            raw = form.get(name, "").strip()
            if raw:
                try:
                    data[name] = parse_int(raw)
                except ValueError:
                    raise ValueError(f"{name}: expected a whole number, got {raw!r}") from None
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
        return str(await asyncio.to_thread(self.manager.create, spec))

    def launch_placeholders(self) -> dict[str, str]:
        """What each empty launch field takes, for the form to show: the default run's B, G, S, K
        (policy full; sync's S is 0 whatever the default)."""
        if self._placeholders is None:
            from app.service.ports import run_policy
            from app.service.schemas import RunCreate

            policy = run_policy(RunCreate.model_validate(self.launch_defaults))
            self._placeholders = {
                "groups_per_batch": f"default {policy.groups_per_batch}",
                "group_size": f"default {policy.group_size}",
                "surplus_groups": f"default {policy.surplus_groups} (sync: 0)",
                "max_staleness": f"default {policy.max_staleness}",
            }
        return self._placeholders

    async def publish(self, run_id: str, actor: str) -> None:
        handle = self._handle(run_id)

        def next_version() -> int:
            return int(handle.runtime.version) + 1

        version = await self._call(handle, next_version)
        # A sentinel version, as the API's `sentinel: true`: engines that load weights from disk (a
        # local run's) need its files; without a path they refuse the update.
        path = await asyncio.to_thread(handle.sentinel_weights, version)
        _, seq = await self._call(handle, handle.publish_marked, version, path, actor)
        await handle.stored(seq, f"version {version} published")

    async def set_policy(self, run_id: str, changes: Mapping[str, int], actor: str) -> None:
        from pydantic import ValidationError

        from app.service.schemas import PolicyPatch

        handle = self._handle(run_id)
        try:
            patch = PolicyPatch(**changes)
        except ValidationError as exc:
            raise ValueError(problems(exc)) from None
        if (problem := handle.patch_problem(patch)) is not None:
            raise ValueError(problem)
        _, seq = await self._call(handle, handle.set_policy_marked, patch, actor)
        await handle.stored(seq, "policy changed")  # answered once the changes are in the store

    async def pause(self, run_id: str, actor: str) -> None:
        handle = self._handle(run_id)
        await self._call(handle, handle.pause)

    async def resume(self, run_id: str, actor: str) -> None:
        handle = self._handle(run_id)
        await self._call(handle, handle.resume)

    async def stop(self, run_id: str, actor: str) -> None:
        handle = self._handle(run_id, starting_ok=True)
        await self._call(handle, handle.stop)

    async def rotate(self, run_id: str, engine: str, into: bool, actor: str) -> None:
        handle = self._handle(run_id)
        try:
            await self._call(handle, handle.serve_engine if into else handle.drain_engine, engine, actor)
        except KeyError:
            raise ValueError(f"the run has no engine {engine!r}") from None


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
        name: {"slots": now[name]["slots"], "configured": configured, "cpus": cpus}
        for name, (cpus, configured) in described.items()
    }


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


def clock_note(config: Mapping[str, Any]) -> str | None:
    """A simulated run's page counts its own clock's seconds, which run `speed` times as fast as the
    wall clock; the API's trainer figures (`/metrics`: idle, batch wait) count the wall clock's."""
    if config.get("kind") != "sim":
        return None
    speed = config.get("speed")
    pace = f" (this run goes {speed:g}× as fast as the wall clock)" if isinstance(speed, int | float) else ""
    return (
        f"Times on this page are simulated seconds{pace}; the API's trainer figures (GET …/metrics) are "
        "wall-clock seconds."
    )
