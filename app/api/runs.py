"""The run and trainer API. These paths are a contract:

- `GET /api/runs`, `POST /api/runs` (create and start), `GET /api/runs/{id}`;
- `POST /api/runs/{id}/pause|resume|stop`;
- `GET /api/runs/{id}/batches/next?timeout=S` (long-poll; 204 when no batch came in time),
  `POST /api/runs/{id}/batches/{batch_id}/ack` (idempotent: a repeated ack is a 200 with
  `already_acked: true`), `POST /api/runs/{id}/batches/{batch_id}/release` `{delivery}` (a batch handed
  back untrained is handed out again at once, not after `ack_timeout_s`),
  `POST /api/runs/{id}/batches/{batch_id}/renew` `{delivery}` (its lease extended to `ack_timeout_s`
  from now, for a step longer than the lease; `lease_s` says how long it has left);
- `POST /api/runs/{id}/weights` `{version, path | sentinel}` (202, starts a rolling update; the newest
  version again with the same weights is a repeat, 202 with `already_published: true`),
  `GET /api/runs/{id}/rollouts/{rid}` (progress engine by engine; `rid` is the version);
- `PATCH /api/runs/{id}/policy` `{max_staleness, surplus_groups, max_updating_engines, pause_mode,
  agent_gate, confirm_large_change}` (answered once the changes are in the store, so a crash right after
  still resumes with them; an S letting over 4× the trajectories run needs `confirm_large_change`);
  a publication or a policy change the store has not got within 5 s is a 503 with a Retry-After: the
  trainer sends it again, which is safe;
- `GET /api/runs/{id}/timeline?since=<seq>`, `GET /api/runs/{id}/metrics`;
- `GET /api/runs/{id}/commands/{command_id}` (a celery run's command's outcome, kept a day);
- `DELETE /api/runs/{id}` (operator: an ended run and everything stored for it; 409 for one that has
  not ended).

Answers: 422 for input that fails validation (the message names the field), 404 for an unknown run,
batch or rollout (a version never published), 409 for a change the run's state does not allow,
401/403 for a missing or wrong token. Never a 500 for bad input. A run that ended before this server
started answers as an ended run: 409 "has ended (<state>)", a repeated ack 200, its metrics from the
store.

A run a celery orchestrator worker drives takes the same commands (pause, resume, stop, weights, policy,
engines' drain and serve): a stop through its stop key (202), the others through its command channel
(app.service.channel), carried out by its worker with the code that carries them out here
(app.service.commands) and answered as here; 504 when the worker does not answer within
`CORRAL_COMMAND_TIMEOUT_S` (saying whether it took the command, and naming the route that keeps its
outcome), 503 when Redis does not answer. Its metrics are asked of its worker the same way.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Coroutine
from typing import Annotated, Any, TypeVar

from fastapi import APIRouter, Body, HTTPException, Query, Request, Response, status
from fastapi import Path as PathParam
from fastapi.concurrency import run_in_threadpool
from fastapi.responses import JSONResponse

from app.api.deps import Manager, Operator, Viewer, live_handle, not_executing, refuse_while_resuming
from app.core.config import MAX_POLICY_VERSION
from app.service import commands
from app.service.channel import RunChannel, command_elsewhere, driven_elsewhere, reachable
from app.service.commands import TRAINER_CLOCK, CommandRefused
from app.service.gateway import (
    AlreadyAckedError,
    NotTakenError,
    Offer,
    RunClosedError,
    RunDeletedError,
    TrainerGateway,
    UnknownBatchError,
)
from app.service.handle import IllegalRunStateError, RolloutForgottenError, RunHandle, RunNotLiveError
from app.service.manager import (
    ENDED_STATES,
    DispatchError,
    RunLimitError,
    RunLiveError,
    RunManager,
    ServerStoppingError,
)
from app.service.retention import MarkError
from app.service.schemas import (
    AckResult,
    BatchRelease,
    BatchRenew,
    PolicyPatch,
    Problem,
    ReleaseResult,
    RenewResult,
    RunCreate,
    ValidationProblem,
    WeightsPublish,
)
from app.store.models import TERMINAL_RUN_STATES, RunState

# The refusals every route may give, as the OpenAPI documents them: the bodies the API answers with
# (app.api.app's handlers), not FastAPI's default list of validation errors.
ERROR_ANSWERS: dict[int | str, dict[str, Any]] = {
    401: {"model": Problem, "description": "an action without the operator token"},
    403: {"model": Problem, "description": "an action with a token that is not the operator token"},
    404: {"model": Problem, "description": "no such run (or batch, rollout, engine of it)"},
    409: {
        "model": Problem,
        "description": "not allowed in the run's state (ended, stopping, not executing here)",
    },
    422: {"model": ValidationProblem, "description": "refused input, naming the field"},
    503: {
        "model": Problem,
        "description": "the database (or, sending a run or a command to its orchestrator, the broker) is not "
        "answering; try again after Retry-After",
    },
}
# A command's answers besides: one to a run a celery orchestrator worker drives can go unanswered
COMMAND_ANSWERS: dict[int | str, dict[str, Any]] = {
    504: {"model": Problem, "description": "the run's orchestrator worker did not answer in time"},
}

T = TypeVar("T")

router = APIRouter(prefix="/api/runs", tags=["runs"], responses=ERROR_ANSWERS)

NO_MORE_BATCHES = "; no more batches"
ENDING_WAIT_S = 30.0  # a stop that finds the run ending waits this long to say how it ended

RunId = Annotated[str, PathParam(min_length=1, max_length=64, pattern=r"^[A-Za-z0-9_-]+$")]
CommandId = RunId  # a command's id has the same shape (uuid4 hex, in practice)


async def _command(
    request: Request,
    manager: RunManager,
    run_id: str,
    command: tuple[str, dict[str, Any], str],
    here: Callable[[RunHandle], Awaitable[dict[str, Any]]],
) -> dict[str, Any]:
    """Carry out an operator's `command` (its name, JSON arguments and actor): `here` on a run executing
    in this server; on a celery run not ended, the same command sent to its orchestrator worker
    (app.service.channel), which answers as `here` would. Refusals become their HTTP answers."""
    try:
        if manager.get(run_id) is None:
            record = await run_in_threadpool(manager.store.get_run, run_id)
            if driven_elsewhere(record):
                channel = request.app.state.channel
                return await command_elsewhere(channel, manager.store, record, *command)
        return await here(live_handle(manager, run_id))
    except CommandRefused as exc:
        raise _refused(exc) from None


def _refused(exc: CommandRefused) -> HTTPException:
    """A refusal's HTTP answer: 503s with a Retry-After."""
    headers = {"Retry-After": "5"} if exc.status == status.HTTP_503_SERVICE_UNAVAILABLE else None
    return HTTPException(exc.status, exc.detail, headers=headers)


@router.get("")
def list_runs(manager: Manager, _: Viewer) -> list[dict[str, Any]]:
    return manager.list()


# A create past `CORRAL_MAX_RUNS`: the server is busy, not the request wrong; nothing is stored
CREATE_ANSWERS: dict[int | str, dict[str, Any]] = {
    429: {"model": Problem, "description": "this server executes CORRAL_MAX_RUNS runs already"},
}


@router.post("", status_code=status.HTTP_201_CREATED, responses=CREATE_ANSWERS)
def create_run(
    spec: RunCreate, request: Request, manager: Manager, actor: Operator, response: Response
) -> dict[str, Any]:
    try:
        run_id = manager.create(spec, request.app.state.dispatch)
    except ValueError as exc:
        raise HTTPException(422, f"orchestrator: {exc}") from None
    except RunLimitError as exc:
        raise HTTPException(status.HTTP_429_TOO_MANY_REQUESTS, str(exc)) from None
    except (DispatchError, ServerStoppingError) as exc:
        detail = f"{exc}; try again once the broker answers" if isinstance(exc, DispatchError) else str(exc)
        raise HTTPException(
            status.HTTP_503_SERVICE_UNAVAILABLE, detail, headers={"Retry-After": "5"}
        ) from None
    response.headers["Location"] = f"/api/runs/{run_id}"
    view = manager.view(run_id)
    assert view is not None
    return view


@router.get("/{run_id}")
async def get_run(run_id: RunId, manager: Manager, _: Viewer) -> Any:
    # A run executing here is answered from memory, on the event loop: no query, no thread hop.
    view = manager.live_view(run_id) or await run_in_threadpool(manager.view, run_id)
    if view is None:
        raise HTTPException(status.HTTP_404_NOT_FOUND, f"no run {run_id!r}")
    return JSONResponse(view)


@router.delete("/{run_id}")
def delete_run(run_id: RunId, manager: Manager, actor: Operator) -> dict[str, Any]:
    """Delete an ended run (stopped, completed or failed) and everything stored for it: its events,
    groups, batches, rollouts and other rows, and its data directory. A run that has not ended is
    refused (409) and nothing of it is touched; stop it and wait for its end first."""
    try:
        deleted = manager.delete(run_id)
    except RunLiveError as exc:
        raise HTTPException(status.HTTP_409_CONFLICT, str(exc)) from None
    except MarkError as exc:  # a read-only or full disk (503), or another database's mark (409)
        code = status.HTTP_409_CONFLICT if exc.foreign else status.HTTP_503_SERVICE_UNAVAILABLE
        raise HTTPException(code, f"run {run_id!r} was not deleted: {exc}") from None
    if not deleted:
        raise HTTPException(status.HTTP_404_NOT_FOUND, f"no run {run_id!r}")
    return {"id": run_id, "deleted": True, "actor": actor}


@router.post("/{run_id}/pause", responses=COMMAND_ANSWERS)
async def pause_run(run_id: RunId, request: Request, manager: Manager, actor: Operator) -> dict[str, Any]:
    """Pause a running run: a simulated run's clock stops; a local run's engines hold their turns."""
    return await _command(
        request, manager, run_id, ("pause", {}, actor), lambda handle: commands.act(handle, "pause", actor)
    )


@router.post("/{run_id}/resume", responses=COMMAND_ANSWERS)
async def resume_run(run_id: RunId, request: Request, manager: Manager, actor: Operator) -> dict[str, Any]:
    return await _command(
        request, manager, run_id, ("resume", {}, actor), lambda handle: commands.act(handle, "resume", actor)
    )


@router.post("/{run_id}/stop", responses={202: {"description": "sent to the run's orchestrator worker"}})
async def stop_run(run_id: RunId, request: Request, manager: Manager, actor: Operator) -> Any:
    """End the run after the current step: live groups are discarded as cancelled, sandboxes cleaned.
    A run already stopping or stopped answers 200 with `already_stopped` (a retried or repeated stop
    asks for what is under way); one that completed or failed answers 409. A run a crash left unfinished
    that this server did not resume (CORRAL_RESUME_RUNS=false) is ended `stopped` in the store (200;
    `already_stopped` when it was stopping), so it can then be deleted. A run a celery orchestrator
    worker drives is sent the stop (202): the worker stops it within a second or so, or the next worker
    to take it, if it is still queued."""
    # Off the loop: on SQLite a read waits for a writer of another process (a prune) to let go
    record = await run_in_threadpool(manager.store.get_run, run_id) if manager.get(run_id) is None else None
    if record is not None and record.state == RunState.STOPPED.value:  # stopped before a restart
        return {"id": run_id, "state": record.state, "actor": actor, "already_stopped": True}
    if driven_elsewhere(record):
        return await _stop_elsewhere(request, run_id, record.state, actor)
    if record is not None and record.state not in ENDED_STATES and run_id not in manager.resuming:
        # Left unfinished by a crash and not resumed here (CORRAL_RESUME_RUNS=false): ended in the store
        left = await run_in_threadpool(manager.stop_left, run_id, actor)
        if left is not None:
            ended, stopped = left
            return {"id": run_id, "state": ended.state, "actor": actor, "already_stopped": not stopped}
    handle = live_handle(manager, run_id)
    try:
        stopped = await handle.call(handle.stop)
    except (RunNotLiveError, IllegalRunStateError) as exc:
        # The run's loop closed before this call's turn: it is ending. A run stopping keeps that state
        # until its last events are in the store (seconds, after a fast stop): a second stop in that
        # window asks for what is under way. One ending otherwise is waited for, to say how it ended.
        if handle.state not in (RunState.STOPPING, RunState.STOPPED, *TERMINAL_RUN_STATES):
            await asyncio.to_thread(handle.join, ENDING_WAIT_S)
        if handle.state in TERMINAL_RUN_STATES and handle.state is not RunState.STOPPED:
            detail = f"run {run_id!r} has ended ({handle.state.value})"  # completed or failed: too late
            raise HTTPException(status.HTTP_409_CONFLICT, detail) from None
        if handle.state not in (RunState.STOPPING, RunState.STOPPED):  # still ending after the wait
            raise HTTPException(status.HTTP_409_CONFLICT, str(exc)) from None
        stopped = False  # it was stopped, before this call or while it waited for the run's loop
    return {"id": run_id, "state": handle.state.value, "actor": actor, "already_stopped": not stopped}


async def _stop_elsewhere(request: Request, run_id: str, state: str, actor: str) -> JSONResponse:
    """Ask the orchestrator worker of `run_id` to stop it (app.service.runner watches for the ask)."""
    if state == RunState.STOPPING.value:
        return JSONResponse({"id": run_id, "state": state, "actor": actor, "already_stopped": True})
    try:
        channel = reachable(request.app.state.channel, run_id)
        await asyncio.to_thread(channel.stop, run_id, actor)
    except CommandRefused as exc:
        raise _refused(exc) from None
    body = {"id": run_id, "state": state, "actor": actor, "already_stopped": False}
    return JSONResponse(body, status_code=status.HTTP_202_ACCEPTED)


# -- the trainer API ---------------------------------------------------------------------------------


@router.get("/{run_id}/batches/next", responses={204: {"description": "no batch within the timeout"}})
async def next_batch(
    request: Request,
    run_id: RunId,
    manager: Manager,
    _: Viewer,
    timeout: Annotated[  # noqa: ASYNC109 - the API's contract names the long-poll's wait `timeout`
        float, Query(ge=0, le=300, allow_inf_nan=False, description="seconds to wait")
    ] = 30.0,
) -> Any:
    # A run not executing here costs a query: off the event loop. One that ended before a restart
    # answers as it did when it ended: its batches never acked first, then "has ended".
    handle = manager.get(run_id)
    if handle is not None:
        gateway = handle.gateway
    else:
        gateway = await run_in_threadpool(_ended_gateway, manager, run_id)
    try:
        offer = await _unless_stopping(gateway.next_batch(timeout), request.app.state.stopping)
    except RunDeletedError:
        raise HTTPException(status.HTTP_404_NOT_FOUND, f"no run {run_id!r} (deleted)") from None
    except RunClosedError as exc:
        raise HTTPException(
            status.HTTP_409_CONFLICT, f"run {run_id!r} has ended ({exc}){NO_MORE_BATCHES}"
        ) from None
    if offer is None:
        return Response(status_code=status.HTTP_204_NO_CONTENT)
    return {**offer.payload, "delivery": offer.deliveries, "ack_timeout_s": gateway.ack_timeout_s}


async def _unless_stopping(
    waiting: Coroutine[Any, Any, Offer | None], stopping: asyncio.Event
) -> Offer | None:
    """The long-poll's answer, or 503 as soon as the server starts to stop: the server waits for open
    requests before it stops the runs, and a trainer asks again once it is back. A batch taken as
    the stop came is handed out, not dropped."""
    poll = asyncio.ensure_future(waiting)
    stop = asyncio.ensure_future(stopping.wait())
    try:
        await asyncio.wait([poll, stop], return_when=asyncio.FIRST_COMPLETED)
    finally:
        for task in (poll, stop):
            task.cancel()  # nothing for a task already done; the gateway hands out nothing while it waits
        await asyncio.gather(poll, stop, return_exceptions=True)  # neither outlives the request
    if not poll.cancelled():
        return poll.result()  # a batch, None, or the gateway's error (the run has ended)
    raise HTTPException(
        status.HTTP_503_SERVICE_UNAVAILABLE,
        "the server is stopping; ask for the next batch again once it is back",
        headers={"Retry-After": "5"},
    )


def _ended_gateway(manager: RunManager, run_id: str) -> TrainerGateway:
    """The gateway of a run not executing here: its kept batches if it has ended; else 404 for an
    unknown run, 409 for one that has ended with nothing kept or executes elsewhere."""
    refuse_while_resuming(manager, run_id)
    record = manager.store.get_run(run_id)
    if record is None:
        raise HTTPException(status.HTTP_404_NOT_FOUND, f"no run {run_id!r}")
    gateway = manager.ended_gateway(record)
    if gateway is None:
        raise HTTPException(status.HTTP_409_CONFLICT, not_executing(run_id, record.state, NO_MORE_BATCHES))
    return gateway


@router.post("/{run_id}/batches/{batch_id}/ack")
def ack_batch(
    run_id: RunId,
    batch_id: Annotated[str, PathParam(min_length=1, max_length=128)],
    manager: Manager,
    actor: Operator,
) -> AckResult:
    handle = manager.get(run_id)
    if handle is not None:
        gateway: TrainerGateway | None = handle.gateway
    else:
        refuse_while_resuming(manager, run_id)
        record = manager.store.get_run(run_id)
        if record is None:
            raise HTTPException(status.HTTP_404_NOT_FOUND, f"no run {run_id!r}")
        if record.state not in ENDED_STATES:
            raise HTTPException(status.HTTP_409_CONFLICT, not_executing(run_id, record.state))
        gateway = manager.ended_gateway(record)  # the batches it kept, if any
    if gateway is not None:
        try:
            _, already = gateway.ack(batch_id, actor)
        except UnknownBatchError:
            pass  # handed out before a restart (and acked then, maybe): the store knows
        except NotTakenError:
            detail = (
                f"batch {batch_id!r} has not been handed out yet, so no trainer has it to ack; take it "
                f"with GET /api/runs/{run_id}/batches/next, train on it, then ack it"
            )
            raise HTTPException(status.HTTP_409_CONFLICT, detail) from None
        else:
            # Answered once the store has the ack and the batch's kept offer is gone: a kill -9 before
            # that handed the acked batch out again after the restart. A store slower than that (locked,
            # away) is a 503: the trainer acks again rather than count on an ack a crash would lose.
            if not manager.wait_written(batch_id=batch_id):
                detail = (
                    f"batch {batch_id!r} is acked, but the database has not stored the ack yet (it is slow "
                    "or away); ack it again in a few seconds"
                )
                raise HTTPException(status.HTTP_503_SERVICE_UNAVAILABLE, detail, headers={"Retry-After": "5"})
            return AckResult(batch_id=batch_id, already_acked=already)
    stored = manager.ack_stored(run_id, batch_id)
    if stored is None:
        raise HTTPException(status.HTTP_404_NOT_FOUND, f"run {run_id!r} has no batch {batch_id!r}")
    return AckResult(batch_id=batch_id, already_acked=stored)


@router.post("/{run_id}/batches/{batch_id}/release")
def release_batch(
    run_id: RunId,
    batch_id: Annotated[str, PathParam(min_length=1, max_length=128)],
    body: BatchRelease,
    manager: Manager,
    _: Operator,
) -> ReleaseResult:
    """Hand a batch back untrained (a trainer stopping): the next `batches/next` takes it at once, as
    `delivery` + 1, instead of after `ack_timeout_s`. Only the lease of that delivery ends."""
    offer, unreleased = _on_lease(
        manager, run_id, batch_id, "release", lambda g: g.release(batch_id, body.delivery)
    )
    return ReleaseResult(
        batch_id=batch_id, released=unreleased is None, delivery=offer.deliveries, detail=unreleased
    )


@router.post("/{run_id}/batches/{batch_id}/renew")
def renew_batch(
    run_id: RunId,
    batch_id: Annotated[str, PathParam(min_length=1, max_length=128)],
    body: BatchRenew,
    manager: Manager,
    _: Operator,
) -> RenewResult:
    """Extend a batch's lease to `ack_timeout_s` from now (a step longer than the lease): it is not
    handed out again while its trainer trains on it. Only the delivery that holds the lease renews it."""
    offer, lease_s, unrenewed = _on_lease(
        manager, run_id, batch_id, "renew", lambda g: g.renew(batch_id, body.delivery)
    )
    return RenewResult(
        batch_id=batch_id,
        renewed=unrenewed is None,
        delivery=offer.deliveries,
        lease_s=lease_s,
        detail=unrenewed,
    )


def _on_lease(
    manager: RunManager, run_id: str, batch_id: str, verb: str, act: Callable[[TrainerGateway], T]
) -> T:
    """`act` on the run's gateway (an ended run's too), its refusals as the API's answers: 404 for a batch
    the run never offered, 409 for one acked or never handed out (no trainer holds a lease to `verb`)."""
    handle = manager.get(run_id)
    gateway = handle.gateway if handle is not None else _ended_gateway(manager, run_id)
    try:
        return act(gateway)
    except UnknownBatchError:
        raise HTTPException(
            status.HTTP_404_NOT_FOUND, f"run {run_id!r} has no batch {batch_id!r} to {verb}"
        ) from None
    except AlreadyAckedError:
        detail = f"batch {batch_id!r} is acked: it was trained on, so it holds no lease to {verb}"
        raise HTTPException(status.HTTP_409_CONFLICT, detail) from None
    except NotTakenError:
        detail = f"batch {batch_id!r} has not been handed out yet, so no trainer holds a lease to {verb}"
        raise HTTPException(status.HTTP_409_CONFLICT, detail) from None


@router.post("/{run_id}/weights", status_code=status.HTTP_202_ACCEPTED, responses=COMMAND_ANSWERS)
async def publish_weights(
    run_id: RunId,
    body: WeightsPublish,
    request: Request,
    manager: Manager,
    actor: Operator,
    response: Response,
) -> dict[str, Any]:
    command = ("publish", body.model_dump(mode="json"), actor)
    rollout = await _command(request, manager, run_id, command, lambda h: commands.publish(h, body, actor))
    response.headers["Location"] = f"/api/runs/{run_id}/rollouts/{body.version}"
    return rollout


@router.get("/{run_id}/rollouts/{version}")
async def get_rollout(
    run_id: RunId,
    version: Annotated[int, PathParam(ge=1, le=MAX_POLICY_VERSION)],
    manager: Manager,
    _: Viewer,
) -> dict[str, Any]:
    handle = manager.get(run_id)
    none = HTTPException(status.HTTP_404_NOT_FOUND, f"run {run_id!r} has no rollout {version}")
    if handle is not None and handle.runtime is not None:
        try:
            return dict(await handle.call(handle.rollout, version))
        except KeyError:
            raise none from None
        except (RunNotLiveError, RolloutForgottenError):
            pass  # ended meanwhile, or a rollout old enough to be kept only in the store
    if await run_in_threadpool(manager.store.get_run, run_id) is None:
        raise HTTPException(status.HTTP_404_NOT_FOUND, f"no run {run_id!r}")
    stored = await run_in_threadpool(manager.store.rollout, run_id, version)
    if stored is None:
        raise none
    return stored


@router.patch("/{run_id}/policy", responses=COMMAND_ANSWERS)
async def patch_policy(
    run_id: RunId, patch: Annotated[PolicyPatch, Body()], request: Request, manager: Manager, actor: Operator
) -> dict[str, Any]:
    """Answered once the changes are in the store, so a crash right after still resumes with them."""
    command = ("policy", patch.model_dump(mode="json", exclude_none=True), actor)
    return await _command(request, manager, run_id, command, lambda h: commands.set_policy(h, patch, actor))


@router.post("/{run_id}/engines/{engine}/drain", responses=COMMAND_ANSWERS)
async def drain_engine(
    run_id: RunId,
    engine: Annotated[str, PathParam(max_length=64)],
    request: Request,
    manager: Manager,
    actor: Operator,
) -> dict[str, Any]:
    """Take an engine out of rotation: no new turns or updates; its turns in flight finish."""
    command = ("drain", {"engine": engine}, actor)
    return await _command(
        request, manager, run_id, command, lambda h: commands.rotate(h, engine, False, actor)
    )


@router.post("/{run_id}/engines/{engine}/serve", responses=COMMAND_ANSWERS)
async def serve_engine(
    run_id: RunId,
    engine: Annotated[str, PathParam(max_length=64)],
    request: Request,
    manager: Manager,
    actor: Operator,
) -> dict[str, Any]:
    """Put a drained engine back into rotation (it is brought to the newest version first)."""
    command = ("serve", {"engine": engine}, actor)
    return await _command(
        request, manager, run_id, command, lambda h: commands.rotate(h, engine, True, actor)
    )


@router.get("/{run_id}/commands/{command_id}")
async def get_command(
    run_id: RunId, command_id: CommandId, request: Request, manager: Manager, _: Viewer
) -> dict[str, Any]:
    """The outcome of a command sent to the orchestrator worker of a celery run, kept a day (a 504 for a
    command not answered in time names this route): `state` "answered", with the `status` and `body` the
    command's route would have answered; "taken", not answered yet (it may still be carried out); or "not
    carried out", `detail` saying why. Reads (metrics) keep none."""
    if await run_in_threadpool(manager.store.get_run, run_id) is None:
        raise HTTPException(status.HTTP_404_NOT_FOUND, f"no run {run_id!r}")
    channel: RunChannel | None = request.app.state.channel
    kept = None
    if channel is not None:  # without a broker, no command went to a worker
        try:
            kept = await channel.outcome(run_id, command_id)
        except CommandRefused as exc:
            raise _refused(exc) from None
    if kept is None:
        raise HTTPException(
            status.HTTP_404_NOT_FOUND,
            f"run {run_id!r} has no command {command_id!r} kept: the outcome of a command sent to a run's "
            "orchestrator worker is kept a day; reads (metrics), and commands to a run executing in this "
            "server, keep none",
        )
    return kept


@router.get("/{run_id}/timeline")
async def timeline(
    run_id: RunId,
    manager: Manager,
    _: Viewer,
    since: Annotated[int, Query(ge=-1, le=2**62, description="return events with seq > since")] = -1,
    limit: Annotated[int, Query(ge=1, le=10_000)] = 1000,
) -> Any:
    """A run's events with seq > `since`, oldest first; `next` is the `since` of the following page."""
    handle = manager.get(run_id)
    events = handle.recorder.recent.since(since, limit) if handle is not None else None
    if events is None:
        if handle is None and await run_in_threadpool(manager.store.get_run, run_id) is None:
            raise HTTPException(status.HTTP_404_NOT_FOUND, f"no run {run_id!r}")
        events = await run_in_threadpool(manager.store.timeline, run_id, since, limit)
    body = {"id": run_id, "since": since, "events": events, "next": events[-1]["seq"] if events else since}
    return JSONResponse(body)


@router.get("/{run_id}/metrics", responses=COMMAND_ANSWERS)
async def run_metrics(run_id: RunId, request: Request, manager: Manager, _: Viewer) -> dict[str, Any]:
    """The run's figures: live from a run executing here, or from the orchestrator worker driving a
    celery run (asked through its command channel); an ended run's from the store."""
    handle = manager.get(run_id)
    if handle is not None:
        return await asyncio.to_thread(commands.metrics, handle)
    record = await run_in_threadpool(manager.store.get_run, run_id)
    if record is None:
        raise HTTPException(status.HTTP_404_NOT_FOUND, f"no run {run_id!r}")
    if driven_elsewhere(record):
        channel = request.app.state.channel
        try:
            return await command_elsewhere(channel, manager.store, record, "metrics", {}, "viewer")
        except CommandRefused as exc:
            # one that ended as it was asked answers with its figures from the store
            record = await run_in_threadpool(manager.store.get_run, run_id)
            if record is None or record.state not in ENDED_STATES:
                raise _refused(exc) from None
    if record.state not in ENDED_STATES:
        raise HTTPException(status.HTTP_409_CONFLICT, not_executing(run_id, record.state))
    figures = await run_in_threadpool(manager.store.figures, run_id)
    return _stored_metrics(run_id, record.state, figures)


def _stored_metrics(run_id: str, state: str, figures: dict[str, Any]) -> dict[str, Any]:
    """An ended run's figures from the store (a later server than the one that ran it): the same keys
    as an executing run's; what only memory held (idle time, lanes, sink health) is None."""
    return {
        "id": run_id,
        "state": state,
        **{k: figures[k] for k in ("batches", "groups_admitted", "groups_delivered", "groups_discarded",
                                   "groups_live", "trainer_version", "engine_versions")},
        "lanes": None,
        "trainer": {
            "offered": figures["offered"],
            "redelivered": figures["redelivered"],
            "acked": figures["acked"],
            "idle_s": None,
            "batch_wait_s_mean": None,
            "clock": TRAINER_CLOCK,
        },
        "event_sinks": None,
    }  # fmt: skip
