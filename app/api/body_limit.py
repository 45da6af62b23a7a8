"""A cap on request bodies: a body past it is answered 413 before the app reads it into memory.

Nothing else bounded a body: an 80 MB POST to /api/runs was read whole and parsed (201 in 0.66 s, the
server at about 330 MB after). JSON bodies get the cap files have (`MAX_DOCUMENT_BYTES`, 4 MB: a run's
workload or config is a few KB); the dashboard's report upload, `/replays`, gets the report's cap
plus room for the form around it.

Invariants: a declared `Content-Length` over the cap is refused before any of the body is read; a body
sent without one (chunked) is counted as it arrives and refused once it passes the cap, before the app
has seen any of it (it is held here until complete, at most the cap's size); either way the answer is
413 with a JSON `detail` naming the cap, as the API's other errors are.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping
from typing import Any

from app.validation import MAX_DOCUMENT_BYTES, human_bytes
from app.web.backend import MAX_REPORT_BYTES

Scope = dict[str, Any]
Message = dict[str, Any]
Receive = Callable[[], Any]
Send = Callable[[Message], Any]

FORM_ROOM_BYTES = 64 * 1024  # a multipart form's boundaries, headers and CSRF field around the file
LIMITS: Mapping[str, int] = {"/replays": MAX_REPORT_BYTES + FORM_ROOM_BYTES}


def limit_for(path: str) -> int:
    return LIMITS.get(path, MAX_DOCUMENT_BYTES)


class BodyLimit:
    def __init__(self, app: Callable[..., Any]) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["method"] in ("GET", "HEAD", "OPTIONS"):
            await self.app(scope, receive, send)
            return
        limit = limit_for(scope["path"])
        declared = _content_length(scope)
        if declared is not None and declared > limit:
            await _too_large(send, limit)
            return
        if declared is not None:  # the server stops reading at Content-Length: the cap holds
            await self.app(scope, receive, send)
            return
        held: list[Message] = []
        size = 0
        while True:
            message = await receive()
            held.append(message)
            if message["type"] != "http.request":
                break  # the client went away: the app sees it as it would have
            size += len(message.get("body", b""))
            if size > limit:
                await _too_large(send, limit)
                return
            if not message.get("more_body", False):
                break

        async def replay() -> Message:
            return held.pop(0) if held else await receive()

        await self.app(scope, replay, send)


def _content_length(scope: Scope) -> int | None:
    for name, value in scope["headers"]:
        if name == b"content-length":
            try:
                return int(value)
            except ValueError:
                return None  # the server refuses a malformed one itself
    return None


async def _too_large(send: Send, limit: int) -> None:
    await send_problem(send, 413, f"request body: larger than {human_bytes(limit)}")


async def send_problem(
    send: Send, status: int, detail: str, headers: Mapping[str, str] | None = None
) -> None:
    """Answer `status` with the JSON `detail` the API's errors have, from ASGI middleware."""
    body = json.dumps({"detail": detail}).encode()
    fields = {"content-type": "application/json", "content-length": str(len(body)), **(headers or {})}
    start = [(name.encode(), value.encode()) for name, value in fields.items()]
    await send({"type": "http.response.start", "status": status, "headers": start})
    await send({"type": "http.response.body", "body": body})
