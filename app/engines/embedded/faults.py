"""Test-only fault injection for the embedded engine, mounted only when `CORRAL_ENGINE_DEBUG=1`.

`POST /debug/fault` with a JSON object sets what the engine does from then on:
- `{"update": "hang"}`: the next `/update_weights` never answers (until the process is killed);
- `{"update": "error"}`: the next `/update_weights` answers 500;
- `{"dead": true}`: every generation answers 500 and `/health` 503, as vLLM's API server does when its
  engine-core process has died.

With the flag set, the engine also starts one helper child process, a stand-in for vLLM's engine-core
process: when it dies (e.g. `kill -9` of the engine's child), the engine turns dead as above. The child
is in the engine's process group, so it goes when the engine's group is stopped, and it gets SIGTERM if
the engine dies (PR_SET_PDEATHSIG). `GET /debug/fault` shows the state and the child's pid.

Without the flag nothing here is mounted and the engine behaves exactly as documented.
"""

from __future__ import annotations

import asyncio
import subprocess
import sys
import threading
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response

from app.children import die_with_parent

ENV_FLAG = "CORRAL_ENGINE_DEBUG"
_GENERATION = ("/v1/completions", "/v1/chat/completions")
_CHILD = "import time\nwhile True: time.sleep(3600)  # corral engine-core stand-in"


@dataclass
class EngineFaults:
    update: str | None = None  # "hang" or "error" for the next /update_weights
    dead: bool = False
    child: subprocess.Popen[bytes] | None = None
    stopping: bool = False

    def start_child(self) -> None:
        self.child = subprocess.Popen(
            [sys.executable, "-c", _CHILD],
            stdin=subprocess.DEVNULL,
            preexec_fn=die_with_parent,
        )
        threading.Thread(target=self._watch_child, name="engine-core-watch", daemon=True).start()

    def _watch_child(self) -> None:
        assert self.child is not None
        code = self.child.wait()
        if not self.stopping:
            self.dead = True
            print(f"engine-core stand-in exited with {code}: engine is dead", file=sys.stderr, flush=True)

    def stop_child(self) -> None:
        self.stopping = True
        if self.child is not None and self.child.poll() is None:
            self.child.kill()
            self.child.wait()


def install_faults(app: FastAPI) -> EngineFaults:
    """Mount `/debug/fault` and the fault middleware on `app`; start the engine-core stand-in."""
    faults = EngineFaults()

    @app.middleware("http")
    async def inject(request: Request, call_next: Callable[[Request], Awaitable[Response]]) -> Response:
        path = request.url.path
        if faults.dead and path in _GENERATION:
            return JSONResponse({"error": {"message": "EngineDeadError: engine core died"}}, status_code=500)
        if faults.dead and path == "/health":
            return JSONResponse({"error": "engine core died"}, status_code=503)
        if path == "/update_weights" and faults.update is not None:
            kind, faults.update = faults.update, None
            if kind == "hang":
                await asyncio.Event().wait()  # never set: the request hangs until the process dies
            return JSONResponse({"error": "injected update failure"}, status_code=500)
        return await call_next(request)

    @app.post("/debug/fault")
    async def set_fault(request: Request) -> dict[str, object]:
        body = await request.json()
        if not isinstance(body, dict):
            return {"error": "expected a JSON object"}
        update = body.get("update")
        if update in ("hang", "error"):
            faults.update = update
        if body.get("dead") is True:
            faults.dead = True
        return await state()

    @app.get("/debug/fault")
    async def state() -> dict[str, object]:
        child = None if faults.child is None else faults.child.pid
        return {"update": faults.update, "dead": faults.dead, "child_pid": child}

    faults.start_child()
    return faults
