"""`VLLMEngine`: the HTTP client for a `vllm serve` process and for Corral's embedded engine.

The route set and bodies follow vLLM's docs (docs/training/async_rl.md, docs/training/weight_transfer/
README.md and disk.md) and, where those are silent, vLLM's route handlers
(vllm/entrypoints/serve/dev/rlhf/api_router.py). docs/engines.md is the contract; keep the two in step.

Invariants:
- Every failure is raised as one `app.engines.errors.EngineError` subclass naming the URL and route;
  nothing is retried here (the runtime owns fault tolerance). `health()` is the one exception: it
  answers False instead of raising for an unreachable or failing engine.
- `generate` reports the weight version the client knew when it sent the request, or the version the
  engine reports for the turn if that is smaller, so staleness is never under-counted.
- The known version changes only after a publication has fully succeeded (`finish_weight_update`).
- At most one weight publication per client runs at a time; vLLM answers 409 to overlapping sessions.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Mapping, Sequence
from typing import Any, Self

import httpx

from app.engines.base import PauseMode, TurnRequest, TurnResult
from app.engines.errors import (
    EngineError,
    EngineProtocolError,
    EngineRequestError,
    EngineServerError,
    EngineTimeout,
    EngineUnavailable,
    TurnAborted,
)
from app.validation import parse_int

# The disk backend takes no init info; vLLM still requires the key (400 without it).
DISK_INIT_INFO: dict[str, Any] = {}


# Idle connections are dropped before the server's own keep-alive timeout (5 s in uvicorn, so in the
# embedded engine and in vLLM) would close them under a request: with both at 5 s, a request sent on a
# connection the server was closing got "Server disconnected without sending a response", and the
# runtime took a healthy engine for dead and restarted it (seen in `make run`'s demo).
KEEPALIVE_EXPIRY_S = 2.0
# httpcore's words for a connection closed before any byte of the answer: the request was not read.
_NOT_ANSWERED = "without sending a response"


class HTTPTransport:
    """One engine's HTTP connection pool, translating transport and status failures to `EngineError`.

    A request whose kept-alive connection the server closed before answering is sent once more, on a
    new connection; any other transport failure is the engine's (`EngineUnavailable`)."""

    def __init__(self, base_url: str, timeout_s: float, api_key: str | None = None) -> None:
        self.base_url = base_url.rstrip("/")
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self._client = httpx.AsyncClient(
            base_url=self.base_url,
            timeout=timeout_s,
            headers=headers,
            limits=httpx.Limits(keepalive_expiry=KEEPALIVE_EXPIRY_S),
        )

    async def request(
        self,
        method: str,
        route: str,
        *,
        json: Any = None,
        params: Mapping[str, str] | None = None,
        timeout_s: float | None = None,
    ) -> httpx.Response:
        """Send one request; return the response only when its status is 2xx."""
        extra: dict[str, Any] = {} if timeout_s is None else {"timeout": timeout_s}
        try:
            try:
                response = await self._client.request(method, route, json=json, params=params, **extra)
            except httpx.RemoteProtocolError as exc:
                if _NOT_ANSWERED not in str(exc):
                    raise
                response = await self._client.request(method, route, json=json, params=params, **extra)
        except httpx.TimeoutException as exc:
            raise EngineTimeout(self.base_url, route, f"timed out ({type(exc).__name__})") from exc
        except httpx.TransportError as exc:
            # ConnectError (refused, DNS), RemoteProtocolError (dropped mid-answer), ReadError, ...
            raise EngineUnavailable(
                self.base_url, route, f"unreachable ({type(exc).__name__}: {exc})"
            ) from exc
        if 400 <= response.status_code < 500:
            raise EngineRequestError(self.base_url, route, response.status_code, response.text)
        if response.status_code >= 500:
            raise EngineServerError(self.base_url, route, response.status_code, response.text)
        return response

    async def request_json(
        self,
        method: str,
        route: str,
        *,
        json: Any = None,
        params: Mapping[str, str] | None = None,
        timeout_s: float | None = None,
    ) -> dict[str, Any]:
        """Send one request and return its body, which must be a JSON object."""
        response = await self.request(method, route, json=json, params=params, timeout_s=timeout_s)
        try:
            body = response.json()
        except ValueError as exc:
            raise EngineProtocolError(
                self.base_url, route, f"response is not JSON: {response.text[:200]!r}"
            ) from exc
        if not isinstance(body, dict):
            raise EngineProtocolError(self.base_url, route, f"expected a JSON object, got {body!r:.200}")
        return body

    async def healthy(self) -> bool:
        """`GET /health` answered 2xx; any failure to get that answer is reported as unhealthy."""
        try:
            await self.request("GET", "/health")
        except EngineError:
            return False
        return True

    async def read_version(self, route: str, known: int) -> int:
        """The engine's committed version from `{"weight_version": ...}` at `route`; `known` when null."""
        answer = await self.request_json("GET", route)
        if "weight_version" not in answer:
            raise self.protocol_error(route, f"missing field 'weight_version' in {answer!r:.300}")
        version = parse_version(self, route, answer["weight_version"])
        return known if version is None else version

    def protocol_error(self, route: str, detail: str) -> EngineProtocolError:
        return EngineProtocolError(self.base_url, route, detail)

    async def aclose(self) -> None:
        await self._client.aclose()


def completion_body(model: str, request: TurnRequest) -> dict[str, Any]:
    """The OpenAI `/v1/completions` body both vLLM and SGLang take for one turn."""
    return {
        "model": model,
        "prompt": request.prompt,
        "max_tokens": request.max_tokens,
        "temperature": request.temperature,
    }


def get_field(
    transport: HTTPTransport, route: str, obj: Mapping[str, Any], key: str, kind: type | tuple[type, ...]
) -> Any:
    """`obj[key]`, which must be of `kind` (bool is never accepted as a number)."""
    if key not in obj:
        raise transport.protocol_error(route, f"missing field {key!r} in {dict(obj)!r:.300}")
    value = obj[key]
    kinds = kind if isinstance(kind, tuple) else (kind,)
    if not isinstance(value, kinds) or (isinstance(value, bool) and bool not in kinds):
        raise transport.protocol_error(route, f"field {key!r} has unexpected value {value!r:.200}")
    return value


def first_choice(transport: HTTPTransport, route: str, body: Mapping[str, Any]) -> dict[str, Any]:
    choices = get_field(transport, route, body, "choices", list)
    if not choices or not isinstance(choices[0], dict):
        raise transport.protocol_error(
            route, f"'choices' is empty or not a list of objects: {choices!r:.200}"
        )
    return choices[0]


def finished_choice(
    transport: HTTPTransport, route: str, body: Mapping[str, Any]
) -> tuple[dict[str, Any], int]:
    """A completion's first choice and its token count, once it is known to be a whole turn: a choice
    the engine cut short by an abort (`finish_reason` "abort", or SGLang's `{"type": "abort"}`) raises
    `TurnAborted`, since its text is the part generated before the pause, not a turn."""
    choice = first_choice(transport, route, body)
    tokens = completion_tokens(transport, route, body)
    reason = choice.get("finish_reason")
    if isinstance(reason, Mapping):
        reason = reason.get("type")
    if reason == "abort":
        raise TurnAborted(
            transport.base_url,
            route,
            f"aborted after {tokens} tokens (the engine was paused to load weights)",
        )
    return choice, tokens


def completion_tokens(transport: HTTPTransport, route: str, body: Mapping[str, Any]) -> int:
    usage = get_field(transport, route, body, "usage", dict)
    tokens: int = get_field(transport, route, usage, "completion_tokens", int)
    return tokens


_MAX_VERSION_DIGITS = 18  # a version past 10^18 was not counted by a trainer


def parse_version(transport: HTTPTransport, route: str, value: object) -> int | None:
    """A weight version as Corral counts it: an int, or a string of ASCII digits; None stays None.

    vLLM types the version as an opaque string; Corral only ever writes `str(int)`. Anything else was
    written by someone outside Corral and cannot be ordered, so it is an error, not a guess.
    """
    if value is None:
        return None
    if isinstance(value, int) and not isinstance(value, bool):
        return value
    text = value.strip() if isinstance(value, str) else ""
    if len(text) <= _MAX_VERSION_DIGITS:
        with contextlib.suppress(ValueError):
            return parse_int(text, signed=False)
    raise transport.protocol_error(route, f"weight version {value!r:.100} is not an integer")


def min_reported_version(transport: HTTPTransport, route: str, answer: Mapping[str, Any], known: int) -> int:
    """`known`, or the smaller version the engine reports for the whole turn in a top-level
    `{"corral": {"weight_version": ...}}` (Corral's embedded engine sends it; vLLM does not)."""
    extension = answer.get("corral")
    if extension is None:
        return known
    if not isinstance(extension, dict):
        raise transport.protocol_error(route, f"top-level 'corral' is not an object: {extension!r:.200}")
    reported = parse_version(transport, route, extension.get("weight_version"))
    return known if reported is None else min(known, reported)


class HTTPEngineClient:
    """What the vLLM and SGLang clients share: the transport, the known version, lifecycle."""

    def __init__(
        self,
        name: str,
        base_url: str,
        model: str,
        timeout_s: float = 60.0,
        api_key: str | None = None,
        *,
        control_timeout_s: float | None = None,
        initial_version: int = 0,
    ) -> None:
        """`timeout_s` bounds each turn and query; `control_timeout_s` (default: `timeout_s`) bounds
        pause and weight-transfer calls, which may wait for in-flight turns or a checkpoint load."""
        self.name = name
        self.model = model
        self._http = HTTPTransport(base_url, timeout_s, api_key)
        self._control_timeout_s = timeout_s if control_timeout_s is None else control_timeout_s
        self._known_version = initial_version

    @property
    def base_url(self) -> str:
        return self._http.base_url

    @property
    def known_version(self) -> int:
        """The version of the last publication that succeeded through this client."""
        return self._known_version

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.aclose()

    async def health(self) -> bool:
        return await self._http.healthy()

    async def aclose(self) -> None:
        await self._http.aclose()


class VLLMEngine(HTTPEngineClient):
    """An `Engine` behind vLLM's OpenAI and RL control routes (see docs/engines.md)."""

    _transfer_initialized = False
    _publish_lock: asyncio.Lock | None = None  # one per client, made on first publication

    # --- generation -----------------------------------------------------------------------------

    async def generate(self, request: TurnRequest) -> TurnResult:
        route = "/v1/completions"
        sent_version = self._known_version
        body = completion_body(self.model, request)
        if request.candidates:
            body["candidates"] = list(request.candidates)
        answer = await self._http.request_json("POST", route, json=body)
        choice0, tokens = finished_choice(self._http, route, answer)
        text: str = get_field(self._http, route, choice0, "text", str)
        version = min_reported_version(self._http, route, answer, sent_version)
        chosen: int | None = None
        logprob: float | None = None
        extension = choice0.get("corral")
        if extension is not None:
            if not isinstance(extension, dict):
                raise self._http.protocol_error(route, f"'corral' is not an object: {extension!r:.200}")
            chosen = get_field(self._http, route, extension, "choice", int)
            logprob = float(get_field(self._http, route, extension, "logprob", (int, float)))
            reported = parse_version(
                self._http, route, get_field(self._http, route, extension, "weight_version", (int, str))
            )
            if reported is not None:
                version = min(version, reported)
            if request.candidates and not 0 <= chosen < len(request.candidates):
                raise self._http.protocol_error(
                    route, f"corral.choice {chosen} is outside the {len(request.candidates)} candidates"
                )
        elif request.candidates:
            # Plain vLLM ignores `candidates`; the best we can say is which candidate it reproduced.
            stripped = text.strip()
            chosen = next((i for i, c in enumerate(request.candidates) if c.strip() == stripped), None)
        return TurnResult(text=text, weight_version=version, tokens=tokens, choice=chosen, logprob=logprob)

    async def chat(
        self, messages: Sequence[Mapping[str, str]], *, max_tokens: int = 64, temperature: float = 1.0
    ) -> TurnResult:
        """One turn through `/v1/chat/completions`; version accounting as in `generate`."""
        route = "/v1/chat/completions"
        sent_version = self._known_version
        body = {
            "model": self.model,
            "messages": [dict(m) for m in messages],
            "max_tokens": max_tokens,
            "temperature": temperature,
        }
        answer = await self._http.request_json("POST", route, json=body)
        choice0, tokens = finished_choice(self._http, route, answer)
        message = get_field(self._http, route, choice0, "message", dict)
        # The OpenAI schema allows null content (e.g. a pure tool call); Corral needs text.
        text: str = get_field(self._http, route, message, "content", str)
        return TurnResult(
            text=text,
            weight_version=min_reported_version(self._http, route, answer, sent_version),
            tokens=tokens,
        )

    # --- pause / resume -------------------------------------------------------------------------

    async def pause(self, mode: PauseMode) -> None:
        await self._http.request(
            "POST", "/pause", params={"mode": PauseMode(mode).value}, timeout_s=self._control_timeout_s
        )

    async def resume(self) -> None:
        await self._http.request("POST", "/resume", timeout_s=self._control_timeout_s)

    async def is_paused(self) -> bool:
        route = "/is_paused"
        answer = await self._http.request_json("GET", route)
        paused: bool = get_field(self._http, route, answer, "is_paused", bool)
        return paused

    # --- weights --------------------------------------------------------------------------------

    async def publish_weights(self, version: int, path: str | None) -> None:
        """Load the safetensors directory `path` (absolute, as the engine host sees it) as `version`.

        Runs vLLM's disk-backend session; does not pause or resume (the rolling-update plan does).
        """
        if path is None:
            raise ValueError(
                f"engine {self.name} ({self.base_url}): the disk backend needs a checkpoint path"
            )
        if not path.startswith("/"):
            raise ValueError(
                f"engine {self.name} ({self.base_url}): checkpoint path {path!r} is not absolute"
            )
        timeout = self._control_timeout_s
        if self._publish_lock is None:
            self._publish_lock = asyncio.Lock()
        async with self._publish_lock:
            if not self._transfer_initialized:
                await self._http.request(
                    "POST",
                    "/init_weight_transfer_engine",
                    json={"init_info": DISK_INIT_INFO},
                    timeout_s=timeout,
                )
                self._transfer_initialized = True
            await self._http.request("POST", "/start_weight_update", json={}, timeout_s=timeout)
            await self._http.request(
                "POST", "/update_weights", json={"update_info": {"path": path}}, timeout_s=timeout
            )
            # vLLM declares weight_version as a string; an int body is rejected with 422.
            await self._http.request(
                "POST", "/finish_weight_update", json={"weight_version": str(version)}, timeout_s=timeout
            )
            self._known_version = version

    async def weight_version(self) -> int:
        """The engine's committed version (`GET /weight_info`).

        `{"weight_version": null}` (no publication has named a version yet) is the one answer that
        carries nothing usable; then the client's known version is returned.
        """
        return await self._http.read_version("/weight_info", self._known_version)

    async def reset_prefix_cache(self) -> None:
        await self._http.request("POST", "/reset_prefix_cache", timeout_s=self._control_timeout_s)
