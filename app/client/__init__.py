"""Python client for Corral's trainer and run API (`corral serve`), sync and async, over httpx.

A trainer loop::

    from app.client import CorralClient

    with CorralClient("http://127.0.0.1:8000", token=TOKEN) as corral:
        while (batch := corral.next_batch(run_id, timeout=30)) is not None or corral.live(run_id):
            if batch is None:
                continue
            ...train on batch.groups...
            corral.publish(run_id, batch.publish_version, sentinel=True)
            corral.ack(run_id, batch.batch_id)

Errors: an answer that is not a success raises `CorralError` with the status and the server's one-line
`detail`. `next_batch` returns None when no batch arrived within the timeout (204), and raises
`RunEnded` once the run has ended and has nothing left to hand out (`publish` raises it too, for a run
stopping or ended). A server that is stopping, or whose database has not stored an ack, a publication
or a policy change in time, answers 503 (`ServerUnavailable`); one that cannot be reached or dropped the
connection (killed, restarting) raises `ServerUnreachable`, a `ServerUnavailable` with status 0: a
trainer asks again after `retry_after_s` either way. A trainer stopping while it holds a batch it has
not trained on hands it back with `release` (the next trainer takes it at once; unreleased, it is handed
out again only once its lease, `ack_timeout_s`, ends); one whose step takes longer than the lease renews
it with `renew` (every third of `batch.ack_timeout_s`, say), so it is not handed out again meanwhile.
Asking again is safe: an ack is idempotent, the
same publication again is answered `already_published` (nothing is published twice), the same policy
change again changes nothing twice, and a restarted server hands out the batch it had not seen acked
again.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

import httpx

__all__ = [
    "AsyncCorralClient",
    "Batch",
    "CorralClient",
    "CorralError",
    "RunEnded",
    "ServerUnavailable",
    "ServerUnreachable",
]

TERMINAL_STATES = frozenset({"stopped", "failed", "completed"})


class CorralError(RuntimeError):
    def __init__(self, status: int, detail: str) -> None:
        super().__init__(f"{status}: {detail}")
        self.status = status
        self.detail = detail


class RunEnded(CorralError):
    """The run ended and has no batch left to hand out."""


class ServerUnavailable(CorralError):
    """503: the server is stopping (a pending long-poll is answered so), or its database is away or has
    not stored an ack, a publication or a policy change yet. Ask again after `retry_after_s` (the same
    call: a repeat is safe); once the server has stopped, the next call fails to connect."""

    def __init__(self, status: int, detail: str, retry_after_s: float) -> None:
        super().__init__(status, detail)
        self.retry_after_s = retry_after_s


DEFAULT_RETRY_AFTER_S = 5.0


class ServerUnreachable(ServerUnavailable):
    """No answer at all: the connection was refused, dropped or timed out (the server was killed, or is
    restarting). `status` is 0 and `detail` says what the connection did."""

    def __init__(self, error: httpx.TransportError) -> None:
        said = f"no answer from the server: {type(error).__name__}: {error}"
        super().__init__(0, said, DEFAULT_RETRY_AFTER_S)


@dataclass(frozen=True)
class Batch:
    """A trainable batch: its groups, each with its trajectories (turns, reward, GRPO advantage, policy
    versions) and its staleness. Publish `publish_version` after training on it, then ack it."""

    batch_id: str
    index: int
    trainer_version: int
    publish_version: int
    groups: list[dict[str, Any]]
    delivery: int  # 1 the first time; more when it was offered again after a missed ack
    ack_timeout_s: float  # its lease: handed out again unless acked (or its lease renewed) within it

    @classmethod
    def of(cls, body: dict[str, Any]) -> Batch:
        return cls(
            batch_id=body["batch_id"],
            index=int(body["index"]),
            trainer_version=int(body["trainer_version"]),
            publish_version=int(body["publish_version"]),
            groups=list(body["groups"]),
            delivery=int(body.get("delivery", 1)),
            ack_timeout_s=float(body["ack_timeout_s"]),
        )

    @property
    def rewards(self) -> list[float]:
        return [t["reward"] for g in self.groups for t in g["trajectories"]]


def _headers(token: str | None, actor: str | None) -> dict[bytes, bytes]:
    # Bytes: the actor goes as UTF-8, as the server reads it (httpx would send a str as ASCII only).
    headers = {}
    if token:
        headers[b"Authorization"] = f"Bearer {token}".encode()
    if actor:
        headers[b"X-Corral-Actor"] = actor.encode()
    return headers


def _answer(response: httpx.Response) -> Any:
    if response.status_code == 204:
        return None
    if response.is_success:
        return response.json()
    try:
        detail = str(response.json().get("detail", response.text))
    except ValueError:
        detail = response.text
    if response.status_code == 409 and "has ended" in detail:
        raise RunEnded(409, detail)
    if response.status_code == 503:
        raise ServerUnavailable(503, detail, _retry_after_s(response.headers.get("Retry-After")))
    raise CorralError(response.status_code, detail)


def _retry_after_s(value: str | None) -> float:
    """Retry-After in seconds (the server sends a number of them); the default for anything else."""
    try:
        seconds = float(value) if value is not None else DEFAULT_RETRY_AFTER_S
    except ValueError:
        return DEFAULT_RETRY_AFTER_S
    return seconds if 0 <= seconds <= 3600 else DEFAULT_RETRY_AFTER_S


def _release_url(run_id: str, batch: Batch) -> str:
    return f"/api/runs/{run_id}/batches/{batch.batch_id}/release"


def _renew_url(run_id: str, batch: Batch) -> str:
    return f"/api/runs/{run_id}/batches/{batch.batch_id}/renew"


def _publish_body(version: int, path: str | None, sentinel: bool) -> dict[str, Any]:
    body: dict[str, Any] = {"version": version}
    if path is not None:
        body["path"] = path
    if sentinel:
        body["sentinel"] = True
    return body


def _check_body(body: Any) -> None:
    """A body JSON cannot carry (NaN, infinity) is refused here as the API refuses bad input, a 422 that
    names the problem: a NaN given to `set_policy` raised a bare ValueError from the JSON encoder."""
    if body is None:
        return
    try:
        json.dumps(body, allow_nan=False)
    except ValueError as exc:
        raise CorralError(422, f"not sent: its body is not valid JSON ({exc}); give finite numbers") from None


def _policy_body(knobs: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in knobs.items() if v is not None}


class CorralClient:
    """Blocking client. `token` is the operator token (needed to create runs, ack, publish, retune)."""

    def __init__(
        self,
        base_url: str = "http://127.0.0.1:8000",
        token: str | None = None,
        actor: str | None = None,
        timeout_s: float = 10.0,
    ) -> None:
        self._timeout_s = timeout_s
        self._http = httpx.Client(base_url=base_url, headers=_headers(token, actor), timeout=timeout_s)

    def __enter__(self) -> CorralClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        self._http.close()

    def _call(self, method: str, url: str, **kwargs: Any) -> Any:
        _check_body(kwargs.get("json"))
        try:
            response = self._http.request(method, url, **kwargs)
        except httpx.TransportError as exc:
            raise ServerUnreachable(exc) from exc
        return _answer(response)

    def runs(self) -> list[dict[str, Any]]:
        return list(self._call("GET", "/api/runs"))

    def run(self, run_id: str) -> dict[str, Any]:
        return dict(self._call("GET", f"/api/runs/{run_id}"))

    def live(self, run_id: str) -> bool:
        """Whether the run has not ended yet."""
        return self.run(run_id)["state"] not in TERMINAL_STATES

    def create_run(self, **spec: Any) -> dict[str, Any]:
        return dict(self._call("POST", "/api/runs", json=spec))

    def next_batch(self, run_id: str, timeout: float = 30.0) -> Batch | None:
        body = self._call(
            "GET",
            f"/api/runs/{run_id}/batches/next",
            params={"timeout": timeout},
            timeout=timeout + self._timeout_s,
        )
        return None if body is None else Batch.of(body)

    def ack(self, run_id: str, batch_id: str) -> dict[str, Any]:
        return dict(self._call("POST", f"/api/runs/{run_id}/batches/{batch_id}/ack"))

    def release(self, run_id: str, batch: Batch) -> dict[str, Any]:
        """Hand `batch` back untrained (the trainer is stopping): the next trainer takes it at once."""
        return dict(self._call("POST", _release_url(run_id, batch), json={"delivery": batch.delivery}))

    def renew(self, run_id: str, batch: Batch) -> dict[str, Any]:
        """Extend `batch`'s lease to `ack_timeout_s` from now (a step longer than the lease): it is not
        handed out again meanwhile. `renewed` is false, with why, once the trainer no longer holds it."""
        return dict(self._call("POST", _renew_url(run_id, batch), json={"delivery": batch.delivery}))

    def publish(
        self, run_id: str, version: int, path: str | None = None, sentinel: bool = False
    ) -> dict[str, Any]:
        body = _publish_body(version, path, sentinel)
        return dict(self._call("POST", f"/api/runs/{run_id}/weights", json=body))

    def rollout(self, run_id: str, version: int) -> dict[str, Any]:
        return dict(self._call("GET", f"/api/runs/{run_id}/rollouts/{version}"))

    def set_policy(
        self,
        run_id: str,
        max_staleness: int | None = None,
        surplus_groups: int | None = None,
        max_updating_engines: int | None = None,
        pause_mode: str | None = None,
        agent_gate: float | None = None,
        confirm_large_change: bool | None = None,
    ) -> dict[str, Any]:
        body = _policy_body(
            {"max_staleness": max_staleness, "surplus_groups": surplus_groups,
             "max_updating_engines": max_updating_engines, "pause_mode": pause_mode,
             "agent_gate": agent_gate, "confirm_large_change": confirm_large_change}
        )  # fmt: skip
        return dict(self._call("PATCH", f"/api/runs/{run_id}/policy", json=body))

    def timeline(self, run_id: str, since: int = -1, limit: int = 1000) -> dict[str, Any]:
        params = {"since": since, "limit": limit}
        return dict(self._call("GET", f"/api/runs/{run_id}/timeline", params=params))

    def metrics(self, run_id: str) -> dict[str, Any]:
        return dict(self._call("GET", f"/api/runs/{run_id}/metrics"))

    def command(self, run_id: str, command_id: str) -> dict[str, Any]:
        """The kept outcome of a command to a celery run's orchestrator worker (a 504 names its id)."""
        return dict(self._call("GET", f"/api/runs/{run_id}/commands/{command_id}"))

    def pause(self, run_id: str) -> dict[str, Any]:
        return dict(self._call("POST", f"/api/runs/{run_id}/pause"))

    def resume(self, run_id: str) -> dict[str, Any]:
        return dict(self._call("POST", f"/api/runs/{run_id}/resume"))

    def stop(self, run_id: str) -> dict[str, Any]:
        return dict(self._call("POST", f"/api/runs/{run_id}/stop"))


class AsyncCorralClient:
    """The same calls as `CorralClient`, awaitable."""

    def __init__(
        self,
        base_url: str = "http://127.0.0.1:8000",
        token: str | None = None,
        actor: str | None = None,
        timeout_s: float = 10.0,
    ) -> None:
        self._timeout_s = timeout_s
        self._http = httpx.AsyncClient(base_url=base_url, headers=_headers(token, actor), timeout=timeout_s)

    async def __aenter__(self) -> AsyncCorralClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    async def aclose(self) -> None:
        await self._http.aclose()

    async def _call(self, method: str, url: str, **kwargs: Any) -> Any:
        _check_body(kwargs.get("json"))
        try:
            response = await self._http.request(method, url, **kwargs)
        except httpx.TransportError as exc:
            raise ServerUnreachable(exc) from exc
        return _answer(response)

    async def runs(self) -> list[dict[str, Any]]:
        return list(await self._call("GET", "/api/runs"))

    async def run(self, run_id: str) -> dict[str, Any]:
        return dict(await self._call("GET", f"/api/runs/{run_id}"))

    async def live(self, run_id: str) -> bool:
        return (await self.run(run_id))["state"] not in TERMINAL_STATES

    async def create_run(self, **spec: Any) -> dict[str, Any]:
        return dict(await self._call("POST", "/api/runs", json=spec))

    async def next_batch(self, run_id: str, timeout: float = 30.0) -> Batch | None:  # noqa: ASYNC109
        body = await self._call(
            "GET",
            f"/api/runs/{run_id}/batches/next",
            params={"timeout": timeout},
            timeout=timeout + self._timeout_s,
        )
        return None if body is None else Batch.of(body)

    async def ack(self, run_id: str, batch_id: str) -> dict[str, Any]:
        return dict(await self._call("POST", f"/api/runs/{run_id}/batches/{batch_id}/ack"))

    async def release(self, run_id: str, batch: Batch) -> dict[str, Any]:
        """Hand `batch` back untrained (the trainer is stopping): the next trainer takes it at once."""
        return dict(await self._call("POST", _release_url(run_id, batch), json={"delivery": batch.delivery}))

    async def renew(self, run_id: str, batch: Batch) -> dict[str, Any]:
        """Extend `batch`'s lease to `ack_timeout_s` from now (a step longer than the lease): it is not
        handed out again meanwhile. `renewed` is false, with why, once the trainer no longer holds it."""
        return dict(await self._call("POST", _renew_url(run_id, batch), json={"delivery": batch.delivery}))

    async def publish(
        self, run_id: str, version: int, path: str | None = None, sentinel: bool = False
    ) -> dict[str, Any]:
        body = _publish_body(version, path, sentinel)
        return dict(await self._call("POST", f"/api/runs/{run_id}/weights", json=body))

    async def rollout(self, run_id: str, version: int) -> dict[str, Any]:
        return dict(await self._call("GET", f"/api/runs/{run_id}/rollouts/{version}"))

    async def set_policy(
        self,
        run_id: str,
        max_staleness: int | None = None,
        surplus_groups: int | None = None,
        max_updating_engines: int | None = None,
        pause_mode: str | None = None,
        agent_gate: float | None = None,
        confirm_large_change: bool | None = None,
    ) -> dict[str, Any]:
        body = _policy_body(
            {"max_staleness": max_staleness, "surplus_groups": surplus_groups,
             "max_updating_engines": max_updating_engines, "pause_mode": pause_mode,
             "agent_gate": agent_gate, "confirm_large_change": confirm_large_change}
        )  # fmt: skip
        return dict(await self._call("PATCH", f"/api/runs/{run_id}/policy", json=body))

    async def timeline(self, run_id: str, since: int = -1, limit: int = 1000) -> dict[str, Any]:
        params = {"since": since, "limit": limit}
        return dict(await self._call("GET", f"/api/runs/{run_id}/timeline", params=params))

    async def metrics(self, run_id: str) -> dict[str, Any]:
        return dict(await self._call("GET", f"/api/runs/{run_id}/metrics"))

    async def command(self, run_id: str, command_id: str) -> dict[str, Any]:
        """The kept outcome of a command to a celery run's orchestrator worker (a 504 names its id)."""
        return dict(await self._call("GET", f"/api/runs/{run_id}/commands/{command_id}"))

    async def pause(self, run_id: str) -> dict[str, Any]:
        return dict(await self._call("POST", f"/api/runs/{run_id}/pause"))

    async def resume(self, run_id: str) -> dict[str, Any]:
        return dict(await self._call("POST", f"/api/runs/{run_id}/resume"))

    async def stop(self, run_id: str) -> dict[str, Any]:
        return dict(await self._call("POST", f"/api/runs/{run_id}/stop"))
