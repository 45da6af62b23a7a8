"""Typed failures of an HTTP serving engine.

Invariant: every failure of an engine call surfaces as exactly one `EngineError` subclass whose message
names the engine URL and the route, so a log line alone says which engine failed where. The clients
never retry; the runtime decides (retry, route elsewhere, mark the engine down).
"""

from __future__ import annotations

import json

BODY_EXCERPT_CHARS = 500


class EngineError(Exception):
    """Base of every engine failure. `url` is the engine's base URL, `route` the path called."""

    def __init__(self, url: str, route: str, detail: str) -> None:
        self.url = url
        self.route = route
        self.detail = detail
        super().__init__(f"engine {url} {route}: {detail}")


class _EngineHTTPStatusError(EngineError):
    """An HTTP error status; `status` is the code and `body` the first characters of the response."""

    kind = "HTTP error"

    def __init__(self, url: str, route: str, status: int, body: str) -> None:
        self.status = status
        self.body = body[:BODY_EXCERPT_CHARS]
        super().__init__(url, route, f"{self.kind} {status}: {self.body!r}")


class EngineRequestError(_EngineHTTPStatusError):
    """HTTP 4xx: the engine rejected the request (bad body, wrong phase (409), route not mounted (404))."""

    kind = "request rejected with HTTP"

    @property
    def summary(self) -> str:
        """The rejection for a reader: the status, the route and the engine's own message, when the body
        is JSON with one (an `error` or `detail` string); else the whole message."""
        try:
            said = json.loads(self.body)
        except (ValueError, RecursionError):
            return str(self)
        message = next((said[k] for k in ("error", "detail") if isinstance(said, dict) and k in said), None)
        if not isinstance(message, str):
            return str(self)
        return f"HTTP {self.status} from {self.route}: {message}"


class EngineServerError(_EngineHTTPStatusError):
    """HTTP 5xx: the engine failed while handling the request."""

    kind = "server error HTTP"


class EngineTimeout(EngineError):
    """No complete answer within the client's timeout."""


class EngineUnavailable(EngineError):
    """The engine could not be reached: connection refused, DNS failure, connection dropped."""


class EngineProtocolError(EngineError):
    """A 2xx answer that is not JSON or lacks a field the client needs."""


class TurnAborted(EngineError):
    """The engine aborted the request before it finished (paused with `mode=abort` for a weight update):
    vLLM answers such a request 200 with `finish_reason: "abort"` and the text generated so far, which
    is not a turn. The runtime sends the turn again, to an engine that is not updating."""
