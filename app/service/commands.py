"""An operator's commands on a live run (pause, resume, publish, policy, drain and serve an engine) and its
live figures (`metrics`): one code path wherever the run executes. The API's routes and the dashboard
call these on a run executing in their process; an orchestrator worker calls `apply` on the run it
drives, with a command that came through the command channel (app.service.channel), so a
celery-orchestrated run answers as one executing in `corral serve` would.

Invariants:
- every command runs on the run's loop through the handle's own commands (`RunHandle.call`); nothing
  here touches the runtime (`metrics` reads what `RunHandle.live` reads, safe from any thread);
- a refusal is a `CommandRefused` carrying the API's answer: 404 (no such engine), 409 (the run's state
  does not allow it, or it has ended), 422 (a value the run cannot take), with the words the API says;
- a publication and a policy change answer once their events are in the store (`RunHandle.stored`), or
  503 when the store has not got them in time; the same publication or change sent again is safe;
- one refused as the run has ended for its trainer says the state the run ends in, 409 "has ended
  (<state>)": on a run whose trainer loop is over and which drains its work, once the drain is over (up
  to `DRAIN_WAIT_S`, then a 503 to ask again), since a drain that fails ends the run `failed`;
- every command carried out answers its id (`command_id`: the command channel's for a celery run's, else
  a new one), and every event it published carries the same id, so a client finds what it did in the
  run's events (pause and resume change the run's state and publish none).
"""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any, TypeVar

from pydantic import ValidationError

from app.service.handle import IllegalRunStateError, RunHandle, RunNotLiveError
from app.service.schemas import PolicyPatch, WeightsPublish
from app.store.models import TERMINAL_RUN_STATES
from app.validation import problems

T = TypeVar("T")

# The commands `apply` takes, by name; `args` is each one's JSON body
COMMANDS = ("pause", "resume", "publish", "publish_next", "policy", "drain", "serve", "metrics")

# The trainer's figures are measured where the trainer is, on the wall clock, whatever clock the run
# runs on (a simulated run's page counts simulated seconds and says so).
TRAINER_CLOCK = "wall"

# How long a command refused by a run whose trainer loop is over waits for its drain to end, to say
# how the run ended; past it, a 503 (ask again in a few seconds)
DRAIN_WAIT_S = 10.0


class CommandRefused(Exception):
    """A command the run did not carry out: `status` is the API's answer, `detail` its words."""

    def __init__(self, status: int, detail: str) -> None:
        super().__init__(detail)
        self.status = status
        self.detail = detail


async def on_run(handle: RunHandle, fn: Callable[..., T], *args: Any) -> T:
    """`fn(*args)` on the run's loop; its refusals (an ended run, a state that does not allow it) are
    409s. A run resumed after a restart and still starting answers 503: a trainer takes a 409 for the
    run's end, and its step (a publication, say) waits for the run instead."""
    if handle.restarting:
        raise CommandRefused(
            503, f"run {handle.run_id!r} is being resumed after a restart; try again in a few seconds"
        )
    try:
        return await handle.call(fn, *args)
    except (RunNotLiveError, IllegalRunStateError) as exc:
        raise CommandRefused(409, str(exc)) from None


def new_command_id(given: str = "") -> str:
    """`given`, the id a command came with (through the command channel), or a new one."""
    return given or uuid.uuid4().hex


async def act(handle: RunHandle, action: str, actor: str, command_id: str = "") -> dict[str, Any]:
    """Pause or resume the run (`action`)."""
    if action not in ("pause", "resume"):
        raise ValueError(f"no action {action!r}")
    await on_run(handle, getattr(handle, action))
    command_id = new_command_id(command_id)
    return {"id": handle.run_id, "state": handle.state.value, "actor": actor, "command_id": command_id}


async def publish(
    handle: RunHandle, body: WeightsPublish, actor: str, command_id: str = ""
) -> dict[str, Any]:
    """Start a rolling update to `body.version` (its weights in `body.path`, or a sentinel's written
    where the run's engines read them); the rollout's progress, with `already_published`.

    A repeat of the newest publication (the same version, the same weights: what a trainer sends again
    after a 503 or after no answer) publishes nothing: it is answered as the first was, once the store
    holds it. A 503 while the store has not got it, so a kill before then cannot forget a publication
    the trainer was told of."""
    command_id = new_command_id(command_id)
    if body.path is not None and not await _is_dir(body.path):
        raise CommandRefused(422, f"path: {body.path!r} is not a directory on the server")
    path = body.path
    await _refuse_if_ending(handle)
    repeat = await _on_live_run(handle, handle.published_again, body.version, body.path, body.sentinel)
    if repeat is not None:
        rollout, seq = repeat
        await _stored(handle, seq, body.version)
        return {**rollout, "command_id": command_id, "already_published": True}
    if body.sentinel:
        if (problem := handle.sentinel_problem()) is not None:
            raise CommandRefused(422, f"sentinel: {problem}")
        if handle.runtime is not None and body.version <= handle.runtime.version:
            raise CommandRefused(422, f"version: {body.version} is not newer than the published version "
                                      f"{handle.runtime.version}")  # fmt: skip
        path = await _sentinel_weights(handle, body.version)
    try:
        published = await _on_live_run(handle, handle.publish_marked, body.version, path, actor, command_id)
    except ValueError as exc:
        raise CommandRefused(422, f"version: {str(exc).removeprefix('version ')}") from None
    rollout, seq = published
    await _stored(handle, seq, body.version)
    return {**rollout, "command_id": command_id, "already_published": False}


async def _refuse_if_ending(handle: RunHandle, refused: str = "") -> None:
    """A run stopping or ended: its trainer is told the run's end, as `batches/next` tells it (a stopping
    run's 409 "is stopping" was no end to the client, and the README's trainer loop died of it), and
    `refused`. A run whose trainer loop is over and whose work is draining says it once the drain is
    over, in the state the run ends in: told "completed" at once, a trainer heard it from a run whose
    drain then failed it. A drain not over within `DRAIN_WAIT_S` is a 503: ask again."""
    gateway = handle.gateway
    if handle.state in TERMINAL_RUN_STATES:
        ended: str | None = gateway.closed or handle.state.value
    elif gateway.ending:
        ended = gateway.closed or await gateway.until_closed(DRAIN_WAIT_S)
    else:
        return
    if ended is None:
        raise CommandRefused(
            503, f"run {handle.run_id!r} is ending: its trainer loop is over and it drains its work; ask "
                 "again in a few seconds to learn how it ended"
        )  # fmt: skip
    raise CommandRefused(409, f"run {handle.run_id!r} has ended ({ended}){refused}")


async def _on_live_run(handle: RunHandle, fn: Callable[..., T], *args: Any) -> T:
    """`on_run` for a publication: a stop that came between the check above and this call's turn on the
    run's loop (its loop closing, or `publish` finding the stop asked) is the run's end too, in the same
    words, not the loop's "is stopping, not executing"."""
    try:
        return await on_run(handle, fn, *args)
    except CommandRefused:
        await _refuse_if_ending(handle)
        raise


async def _is_dir(path: str) -> bool:
    """Whether `path` is a directory on the server; a lookup the OS refuses (a directory on the way
    that cannot be searched) is a 422 naming why, not a 500."""
    try:
        return await asyncio.to_thread(Path(path).is_dir)
    except OSError as exc:
        detail = f"path: {path!r} cannot be looked up on the server: {exc.strerror}"
        raise CommandRefused(422, detail) from None


async def _stored(handle: RunHandle, seq: int, version: int, again: str = "") -> None:
    """Wait for the publication of `version` (its event `seq`) to be stored; a 503 saying how to ask
    again (`again`: the words for a caller whose repeat is not the same request) when it is not."""
    if not await handle.stored(seq, f"version {version} published"):
        again = (
            again or f"publish version {version} again in a few seconds (a repeat publishes nothing twice)"
        )
        raise CommandRefused(
            503, f"version {version} is published, but the database has not stored it yet (it is slow "
                 f"or away); {again}"
        )  # fmt: skip


async def _sentinel_weights(handle: RunHandle, version: int) -> str | None:
    """`handle.sentinel_weights(version)`, off the loop; a disk that refuses the files (full,
    read-only) is a 503 saying so, as a database away is, where it was a 500 and a traceback."""
    try:
        return await asyncio.to_thread(handle.sentinel_weights, version)
    except OSError as exc:
        raise CommandRefused(
            503,
            f"the sentinel weights of version {version} cannot be written ({exc}); try again once the "
            "disk has room",
        ) from None


async def publish_next(handle: RunHandle, actor: str, command_id: str = "") -> dict[str, Any]:
    """The dashboard's Publish: a sentinel version one above the published one."""
    command_id = new_command_id(command_id)

    def next_version() -> int:
        if handle.runtime is None:
            raise RunNotLiveError(f"run {handle.run_id} has not started")
        return handle.runtime.version + 1

    version = await _on_live_run(handle, next_version)
    try:
        # A sentinel version, as the API's `sentinel: true`: engines that load weights from disk (a
        # local run's) need its files; without a path they refuse the update.
        path = await _sentinel_weights(handle, version)
        rollout, seq = await _on_live_run(handle, handle.publish_marked, version, path, actor, command_id)
    except ValueError as exc:
        raise CommandRefused(422, str(exc)) from None
    # Its repeat is no Publish again, which publishes the next version
    await _stored(handle, seq, version, "a server stopped before then forgets it")
    return {**rollout, "command_id": command_id, "already_published": False}


async def set_policy(
    handle: RunHandle, patch: PolicyPatch, actor: str, command_id: str = ""
) -> dict[str, Any]:
    """Change K, S, the rollout's pace, its pause mode or the agent-phase gate's factor live; answered
    once the changes are stored."""
    await _refuse_if_ending(handle)
    if (problem := handle.patch_problem(patch)) is not None:
        raise CommandRefused(422, problem)
    command_id = new_command_id(command_id)
    try:
        knobs, seq = await on_run(handle, handle.set_policy_marked, patch, actor, command_id)
    except CommandRefused:
        if handle.gateway.ending:  # the trainer loop ended before the change's turn on the run's loop
            await _refuse_if_ending(handle, "; its policy is fixed")
        raise
    if not await handle.stored(seq, "policy changed"):
        # A repeat changes nothing twice (a knob that has its value publishes no change), and is
        # answered once the store holds this one
        raise CommandRefused(
            503, "the policy is changed, but the database has not stored the change yet (it is slow or "
                 "away); send the same change again in a few seconds (a repeat changes nothing twice)"
        )  # fmt: skip
    return {"id": handle.run_id, "policy": knobs, "actor": actor, "command_id": command_id}


async def rotate(
    handle: RunHandle, engine: str, into: bool, actor: str, command_id: str = ""
) -> dict[str, Any]:
    """Put `engine` back into rotation (`into`), or drain it."""
    command_id = new_command_id(command_id)
    turn = handle.serve_engine if into else handle.drain_engine
    try:
        return {**await on_run(handle, turn, engine, actor, command_id), "command_id": command_id}
    except KeyError:
        raise CommandRefused(404, f"run {handle.run_id!r} has no engine {engine!r}") from None


def metrics(handle: RunHandle) -> dict[str, Any]:
    """The run's live figures, as `GET /api/runs/{id}/metrics` answers them (safe from any thread)."""
    live = handle.live()
    stats = handle.gateway.stats
    wait_mean = stats.collection_s_mean
    return {
        "id": handle.run_id,
        "state": live["state"],
        "batches": live["batches"],
        "groups_admitted": live["groups_admitted"],
        "groups_delivered": live["groups_delivered"],
        "groups_discarded": live["groups_discarded"],
        "groups_live": live.get("groups_live"),
        "trainer_version": live.get("trainer_version"),
        "engine_versions": live.get("engine_versions"),
        "lanes": live.get("lanes"),
        "trainer": {
            "offered": stats.offered,
            "redelivered": stats.redelivered,
            "acked": stats.acked,
            "idle_s": round(stats.trainer_idle_s, 6),
            "batch_wait_s_mean": None if wait_mean is None else round(wait_mean, 6),
            "clock": TRAINER_CLOCK,
        },
        "event_sinks": handle.recorder.bus.stats(),
    }


async def apply(
    handle: RunHandle, op: str, args: Mapping[str, Any], actor: str, command_id: str = ""
) -> tuple[int, dict[str, Any]]:
    """Carry out the command `op` with its JSON `args` (and its id, `command_id`, where it came with
    one): (200, the API's body), or (the refusal's status, `{"detail": …}`)."""
    try:
        if op in ("pause", "resume"):
            return 200, await act(handle, op, actor, command_id)
        if op == "publish":
            return 200, await publish(handle, WeightsPublish.model_validate(args), actor, command_id)
        if op == "publish_next":
            return 200, await publish_next(handle, actor, command_id)
        if op == "policy":
            return 200, await set_policy(handle, PolicyPatch.model_validate(args), actor, command_id)
        if op in ("drain", "serve"):
            engine = str(args.get("engine", ""))
            return 200, await rotate(handle, engine, op == "serve", actor, command_id)
        if op == "metrics":
            return 200, metrics(handle)
    except CommandRefused as exc:
        return exc.status, {"detail": exc.detail}
    except ValidationError as exc:
        return 422, {"detail": problems(exc)}
    return 422, {"detail": f"command: no command {op!r}; one of {', '.join(COMMANDS)}"}
