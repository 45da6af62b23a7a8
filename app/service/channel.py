"""The command channel between `corral serve` and the orchestrator worker of a celery-orchestrated run,
through the result backend's Redis (where the run's lease and its stop key live).

- A command is a JSON object `{id, op, args, actor, deadline}` pushed onto the run's list
  `corral:commands:<run id>` (a read, `READS`, onto `corral:reads:<run id>`: a command that hangs holds
  up no read); the worker driving the run takes it (`RunInbox.take`, on a thread of the worker's for each
  list, app.service.runner.CommandLine), carries it out through app.service.commands (the code path of a
  run executing in `corral serve`) and pushes its answer `{status, body}` onto `corral:reply:<id>`,
  kept `REPLY_TTL_S`.
- The API waits for the answer at most `timeout_s` (`CORRAL_COMMAND_TIMEOUT_S`). Unanswered, it takes
  the command back from the list: one still there was never taken, so nothing was done (504, saying
  so); one taken and not answered in time may still be carried out (504, saying that). A worker never
  carries out a command past its deadline (the API that sent it may have died before taking it back).
- Every command that changes the run keeps its outcome under `corral:command:<id>` for `OUTCOME_TTL_S`
  (`GET /api/runs/{id}/commands/{command id}`, which a 504 names): the worker's answer, or that it was
  not carried out (past its deadline), written by the worker; "taken", or "not carried out" (taken back),
  written by the API as it gives up, the first only where the worker has not answered yet. A read
  (`metrics`) keeps none: it changes nothing, and a dashboard polling it would fill Redis.
- Redis not answering is a 503 with words, never a traceback.
- Stop keeps its own key (`app.lanes.celery.run_stop_key`): it must reach a run still queued, which
  no worker drives yet, and it is kept a week for that.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
import uuid
from collections.abc import Mapping
from typing import Any, TypeGuard

import redis
import redis.asyncio

from app.service.commands import CommandRefused
from app.service.manager import ENDED_STATES
from app.service.schemas import OrchestratorKind
from app.service.store import RunRecord, ServiceStore
from app.store.models import RunState

log = logging.getLogger(__name__)

REPLY_TTL_S = 300  # an answer nobody took (its API gave up) goes after this
OUTCOME_TTL_S = 86400  # a command's outcome, for an operator whose API gave up on it (a 504)
READS = frozenset({"metrics"})  # commands that change nothing: no outcome is kept
COMMANDS_TTL_S = 3600  # a run's list of commands, after its last push: none outlives its deadline anyway
CONNECT_TIMEOUT_S = 2.0


def commands_key(run_id: str) -> str:
    return f"corral:commands:{run_id}"


def reads_key(run_id: str) -> str:
    return f"corral:reads:{run_id}"


def list_key(run_id: str, op: str) -> str:
    """The list of the run's that takes `op`: its reads', or its commands'."""
    return reads_key(run_id) if op in READS else commands_key(run_id)


def reply_key(command_id: str) -> str:
    return f"corral:reply:{command_id}"


def outcome_key(command_id: str) -> str:
    return f"corral:command:{command_id}"


def outcome_route(run_id: str, command_id: str) -> str:
    return f"GET /api/runs/{run_id}/commands/{command_id}"


def outcome(
    command: Mapping[str, Any],
    run_id: str,
    state: str,
    detail: str | None,
    answer: tuple[int, Any] | None = None,
) -> str:
    """The outcome record of `command` (as sent) of run `run_id`, as JSON: `state` is "answered" (with the
    worker's `answer`, its status and body), "taken" (not answered yet) or "not carried out"; `detail`
    says why it has no answer."""
    status, body = answer if answer is not None else (None, None)
    record = {"id": command["id"], "run_id": run_id, "op": command.get("op"),
              "actor": command.get("actor"), "state": state, "status": status, "body": body,
              "detail": detail, "at": time.time()}  # fmt: skip
    return json.dumps(record)


class RunChannel:
    """The API's side: `ask` sends a command to the worker driving a run and waits for its answer, on
    the event loop (no thread is held while it waits); `stop` asks for its stop
    (`app.lanes.celery.request_run_stop`; blocking, briefly: call it in a thread)."""

    def __init__(self, result_backend: str, timeout_s: float) -> None:
        self.result_backend = result_backend
        self.timeout_s = timeout_s

    async def ask(self, run_id: str, op: str, args: Mapping[str, Any], actor: str) -> dict[str, Any]:
        """The worker's answer's body (a 200); `CommandRefused` with its status and words otherwise: the
        run's refusal (404, 409, 422), 504 for no answer in time, 503 for a result backend that does
        not answer."""
        command_id = uuid.uuid4().hex
        deadline = time.time() + self.timeout_s
        sent = {"id": command_id, "op": op, "args": dict(args), "actor": actor, "deadline": deadline}
        command = json.dumps(sent)
        key = list_key(run_id, op)
        client = self._connect(self.timeout_s + CONNECT_TIMEOUT_S)  # past the BLPOP's own wait
        try:
            async with client.pipeline() as pipe:
                pipe.rpush(key, command)
                pipe.expire(key, COMMANDS_TTL_S)
                await pipe.execute()
            got = await client.blpop([reply_key(command_id)], timeout=self.timeout_s)
            if got is None:
                taken = await client.lrem(key, 1, command) == 0
                if op not in READS:
                    await self._keep_unanswered(client, run_id, sent, taken)
                raise CommandRefused(504, self._unanswered(run_id, sent, taken))
        except redis.RedisError as exc:
            raise CommandRefused(
                503,
                f"the {op} could not be sent to run {run_id!r}'s orchestrator worker: the result backend "
                f"did not answer ({type(exc).__name__}); try again in a few seconds",
            ) from None
        finally:
            await client.aclose()
        reply = json.loads(got[1])
        status, body = int(reply["status"]), reply["body"]
        if status != 200:
            raise CommandRefused(status, str(body.get("detail", body)))
        return dict(body)

    async def _keep_unanswered(
        self, client: redis.asyncio.Redis, run_id: str, sent: Mapping[str, Any], taken: bool
    ) -> None:
        """Keep the outcome of a command given up on: "taken" only where the worker has kept none yet (it
        may answer as this is written), "not carried out" for one taken back (no worker has it)."""
        waited = f"{self.timeout_s:g} s"
        if taken:
            state, detail = "taken", f"not answered within {waited}; it may still be carried out"
        else:
            state, detail = "not carried out", f"no worker took it within {waited}; it was taken back"
        record = outcome(sent, run_id, state, detail)
        await client.set(outcome_key(sent["id"]), record, ex=OUTCOME_TTL_S, nx=taken)

    def _connect(self, socket_timeout: float) -> redis.asyncio.Redis:
        """A client of the result backend, for one request: its replies wait at most `socket_timeout`."""
        return redis.asyncio.Redis.from_url(
            self.result_backend, socket_timeout=socket_timeout, socket_connect_timeout=CONNECT_TIMEOUT_S
        )

    def _unanswered(self, run_id: str, sent: Mapping[str, Any], taken: bool) -> str:
        waited, op = f"{self.timeout_s:g} s", sent["op"]
        kept = "" if op in READS else f"; its outcome is kept a day: {outcome_route(run_id, sent['id'])}"
        if taken:
            return (
                f"run {run_id!r}'s orchestrator worker took the {op} but did not answer within {waited}; "
                f"it may still carry it out: see GET /api/runs/{run_id}{kept}"
            )
        return (
            f"no orchestrator worker took the {op} for run {run_id!r} within {waited}, so nothing was "
            "done: is the worker driving it alive (GET /healthz, `orchestrator`), and not still busy "
            f"with an earlier command? Try again{kept}"
        )

    async def outcome(self, run_id: str, command_id: str) -> dict[str, Any] | None:
        """The kept outcome of command `command_id` of run `run_id`; None when none is kept (unknown,
        expired, a read, or another run's). `CommandRefused` (503) when the result backend does not
        answer."""
        client = self._connect(CONNECT_TIMEOUT_S)
        try:
            raw = await client.get(outcome_key(command_id))
        except redis.RedisError as exc:
            raise CommandRefused(
                503,
                f"command {command_id!r} of run {run_id!r} could not be looked up: the result backend did "
                f"not answer ({type(exc).__name__}); try again in a few seconds",
            ) from None
        finally:
            await client.aclose()
        record = None if raw is None else json.loads(raw)
        return record if isinstance(record, dict) and record.get("run_id") == run_id else None

    def stop(self, run_id: str, actor: str) -> None:
        """Ask for the run's stop; `CommandRefused` (503) when the result backend does not answer."""
        from app.lanes.celery import request_run_stop

        try:
            request_run_stop(self.result_backend, run_id, actor)
        except redis.RedisError as exc:
            raise CommandRefused(
                503,
                f"the stop could not be sent to run {run_id!r}'s orchestrator worker: the result backend "
                f"did not answer ({type(exc).__name__}); try again in a few seconds",
            ) from None


class RunInbox:
    """The worker's side, for one run's list `key` (its commands', by default): `take` the next command,
    `answer` it."""

    def __init__(self, client: redis.Redis, run_id: str, key: str | None = None) -> None:
        self.client = client
        self.run_id = run_id
        self.key = commands_key(run_id) if key is None else key

    def take(self, wait_s: float) -> dict[str, Any] | None:
        """The next command, waiting at most `wait_s` for one; None when none came."""
        got = self.client.blpop([self.key], timeout=wait_s)
        return None if got is None else self._read(got[1])

    def left(self) -> list[dict[str, Any]]:
        """The commands still waiting, taken at once (the run has ended: they are answered so)."""
        commands = []
        while (raw := self.client.lpop(self.key)) is not None:
            if (command := self._read(raw)) is not None:
                commands.append(command)
        return commands

    def _read(self, raw: Any) -> dict[str, Any] | None:
        """A command as sent; None, logged, for one that cannot be read (its sender's wait ends in a
        504)."""
        try:
            command = json.loads(raw)
            if not isinstance(command, dict) or not isinstance(command.get("id"), str):
                raise ValueError("not a command object with an id")
        except ValueError as exc:
            log.error("run %s: dropped a command that cannot be read (%s): %r", self.run_id, exc, raw[:200])
            return None
        return command

    def answer(self, command: Mapping[str, Any], status: int, body: Mapping[str, Any]) -> None:
        """Answer `command` to its sender, and keep its outcome (`outcome_key`) unless it is a read."""
        key = reply_key(str(command["id"]))
        with self.client.pipeline() as pipe:
            pipe.rpush(key, json.dumps({"status": status, "body": dict(body)}))
            pipe.expire(key, REPLY_TTL_S)
            if command.get("op") not in READS:
                record = outcome(command, self.run_id, "answered", None, (status, dict(body)))
                pipe.set(outcome_key(str(command["id"])), record, ex=OUTCOME_TTL_S)
            pipe.execute()

    def not_carried_out(self, command: Mapping[str, Any], detail: str) -> None:
        """Keep the outcome of `command` that was not carried out (its sender has stopped waiting)."""
        if command.get("op") not in READS:
            record = outcome(command, self.run_id, "not carried out", detail)
            self.client.set(outcome_key(str(command["id"])), record, ex=OUTCOME_TTL_S)


# The states each command needs, as the run's own refusal says (RunHandle._require); the others need it
# running or paused
NEEDS = {"pause": "running", "resume": "paused", "metrics": "taken by one"}


def driven_elsewhere(record: RunRecord | None) -> TypeGuard[RunRecord]:
    """Whether the stored run is a celery run not ended: an orchestrator worker drives it, or will."""
    return (
        record is not None
        and record.state not in ENDED_STATES
        and record.config.get("orchestrator") == OrchestratorKind.CELERY.value
    )


def reachable(channel: RunChannel | None, run_id: str) -> RunChannel:
    """`channel`, or the 409 of a server without a broker, which cannot reach the run's worker."""
    if channel is None:
        raise CommandRefused(
            409,
            f"run {run_id!r} is driven by an orchestrator worker, and this server has no broker to reach "
            "it: set CORRAL_BROKER_URL (and CORRAL_RESULT_BACKEND) as the worker has them",
        )
    return channel


async def command_elsewhere(
    channel: RunChannel | None,
    store: ServiceStore,
    record: RunRecord,
    op: str,
    args: Mapping[str, Any],
    actor: str,
) -> dict[str, Any]:
    """`op` sent to the orchestrator worker of the stored run `record` (`driven_elsewhere`), its answer's
    body; `CommandRefused` otherwise. A run still queued takes none, as one whose engines are starting
    in `corral serve` refuses all but a stop; one that ended as the command waited answers as an ended
    run."""
    run_id = record.id
    if record.state == RunState.CREATED.value:
        raise CommandRefused(
            409,
            f"run {run_id} is created (waiting for an orchestrator worker to take it); this needs it "
            f"{NEEDS.get(op, 'running or paused')}",
        )
    try:
        return await reachable(channel, run_id).ask(run_id, op, args, actor)
    except CommandRefused as exc:
        if exc.status != 504:
            raise
        now = await asyncio.to_thread(store.get_run, run_id)
        if now is None or now.state not in ENDED_STATES:
            raise
        raise CommandRefused(409, f"run {run_id!r} has ended ({now.state})") from None


def expired(command: Mapping[str, Any], now: float) -> bool:
    """Past its deadline: its sender has stopped waiting (and answered 504), so it is not carried out."""
    deadline = command.get("deadline")
    return isinstance(deadline, int | float) and now > deadline


__all__ = [
    "CommandRefused",
    "RunChannel",
    "RunInbox",
    "command_elsewhere",
    "commands_key",
    "driven_elsewhere",
    "expired",
    "list_key",
    "outcome_key",
    "outcome_route",
    "reachable",
    "reads_key",
    "reply_key",
]
