"""A second Ctrl-C to `corral serve` stops it at once, open requests included: uvicorn waited for them
for the rest of its `STOP_WAIT_S` (10 s), and a client that sends its body slowly kept one open. The
request cut off is said in one line, without uvicorn's "Exception in ASGI application" traceback, and
its client is answered 503 with `Retry-After`, not uvicorn's plain-text 500."""

from __future__ import annotations

import json
import signal
import socket
import time
from collections.abc import Callable
from pathlib import Path

import httpx
import pytest
from api_support import TOKEN, free_port, serve_env, wait_for
from test_serve_restart import corral_serve

from app.api.graceful import STOP_WAIT_S


def _answers(url: str) -> bool:
    try:
        return httpx.get(f"{url}/healthz", timeout=2).status_code in (200, 503)
    except httpx.TransportError:
        return False


CUT_OFF_DETAIL = (
    "corral serve is stopping: this request was cut off by a second stop signal; send it again once "
    "it is back"
)


def _json_detail(body: str) -> None:
    assert json.loads(body) == {"detail": CUT_OFF_DETAIL}


def _page(body: str) -> None:
    """The dashboard's message page (a sign-in form cut off showed the API's JSON)."""
    assert "<title>Corral — corral serve is stopping" in body, body
    assert f'role="alert">{CUT_OFF_DETAIL}</p>' in body, body


@pytest.mark.parametrize(
    ("path", "content_type", "check"),
    [
        ("/api/runs", "application/json", _json_detail),
        ("/login", "application/x-www-form-urlencoded", _page),  # a dashboard form: read before all else
    ],
    ids=["api", "dashboard"],
)
def test_a_second_ctrl_c_cuts_off_a_request_whose_body_never_comes(
    tmp_path: Path, path: str, content_type: str, check: Callable[[str], None]
) -> None:
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    log = tmp_path / "serve.log"
    with corral_serve(serve_env(tmp_path, f"sqlite:///{tmp_path / 'corral.db'}", port), log) as proc:
        wait_for(lambda: _answers(url), 60, what=f"corral serve to start; log: {log}")
        slow = socket.create_connection(("127.0.0.1", port), timeout=30)
        try:
            head = (
                f"POST {path} HTTP/1.1\r\nHost: 127.0.0.1\r\n"
                f"Authorization: Bearer {TOKEN}\r\nContent-Type: {content_type}\r\n"
                "Content-Length: 1000\r\n\r\n{"
            )
            slow.sendall(head.encode())  # and the other 999 bytes never come
            time.sleep(0.5)
            proc.send_signal(signal.SIGINT)
            time.sleep(1.0)
            second = time.monotonic()
            proc.send_signal(signal.SIGINT)
            code = proc.wait(timeout=STOP_WAIT_S + 30)
            took = time.monotonic() - second
            answer = b"".join(iter(lambda: slow.recv(65536), b""))  # up to the close
        finally:
            slow.close()
    out = log.read_text()
    assert code == 0, out
    # uvicorn alone would have waited out the rest of STOP_WAIT_S (9 s here) for the open request
    assert took < STOP_WAIT_S - 4, (took, out)
    print(f"out {took:.2f} s after the second Ctrl-C")
    assert "1 open request(s) cut off" in out, out
    assert "Traceback" not in out, out
    assert "Exception in ASGI application" not in out, out
    head, _, body = answer.decode().partition("\r\n\r\n")
    assert head.startswith("HTTP/1.1 503 "), answer
    assert "retry-after: 5" in head.lower().split("\r\n"), answer
    check(body)
