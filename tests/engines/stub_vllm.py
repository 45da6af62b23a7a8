"""A stateful stand-in for `VLLM_SERVER_DEV_MODE=1 vllm serve`, for contract tests of the clients.

It follows, route by route, the shapes in vLLM's docs/training/async_rl.md,
docs/training/weight_transfer/README.md and docs/training/weight_transfer/disk.md, and where those are
silent, vllm/entrypoints/serve/dev/rlhf/api_router.py and rl_state_machine.py (409 on start while
updating, on update or finish while not updating). It also speaks SGLang's `/pause_generation`,
`/continue_generation`, `/update_weights_from_disk` and `/get_weight_version` (sglang
srt/entrypoints/http_server.py, managers/io_struct.py) so one stub serves both adapters.

Invariants:
- Requests arriving while paused wait for `/resume`. In-flight requests: `keep` freezes them until
  `/resume`, `wait` lets them finish before `/pause` returns, `abort` ends them at once with
  `finish_reason: "abort"` and their partial text.
- The weight version changes only in a successful `/finish_weight_update` that names one.
- A failed `/update_weights` ends the update session (disk.md: "the update session is cleaned up").
- Injected faults (`StubState.fail_next`, `delay_next`) apply to the next matching request only.

Not vLLM: generation is a fixed echo that takes `gen_delay_s`; with `corral_extension` on, a request with
`candidates` gets the `corral` field that Corral's embedded engine answers with (docs/engines.md).
"""

from __future__ import annotations

import asyncio
import json
import socket
import threading
import time
from collections.abc import Awaitable, Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import uvicorn
from fastapi import FastAPI, Request, Response
from fastapi.responses import JSONResponse

TICK_S = 0.01


@dataclass
class Fault:
    """What to do to the next request on a route: delay it, then answer `status`/`body` if given."""

    status: int | None = None
    body: str = '{"error": "injected"}'
    delay_s: float = 0.0


@dataclass
class StubState:
    model: str = "stub-model"
    gen_delay_s: float = 0.0
    corral_extension: bool = False
    healthy: bool = True
    paused: bool = False
    pause_mode: str | None = None
    weight_version: str | None = None
    transfer_initialized: bool = False
    updating: bool = False
    loaded_paths: list[str] = field(default_factory=list)
    prefix_cache_resets: int = 0
    calls: list[str] = field(default_factory=list)
    inflight: int = 0
    abort_epoch: int = 0
    # Set (from the server thread) whenever a generation starts running; tests wait on it.
    generation_started: threading.Event = field(default_factory=threading.Event)
    _faults: dict[str, list[Fault]] = field(default_factory=dict)
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def fail_next(self, route: str, status: int, body: str = '{"error": "injected"}') -> None:
        """Answer the next request on `route` with `status` and the raw `body` (need not be JSON)."""
        with self._lock:
            self._faults.setdefault(route, []).append(Fault(status=status, body=body))

    def delay_next(self, route: str, seconds: float) -> None:
        """Hold the next request on `route` for `seconds` before handling it normally."""
        with self._lock:
            self._faults.setdefault(route, []).append(Fault(delay_s=seconds))

    def take_fault(self, route: str) -> Fault | None:
        with self._lock:
            queue = self._faults.get(route)
            return queue.pop(0) if queue else None


def _error(status: int, message: str) -> JSONResponse:
    # vLLM's OpenAI routes answer ErrorResponse {"error": {...}}; its dev routes {"detail"} or {"error"}.
    return JSONResponse({"error": {"message": message, "type": "BadRequestError", "code": status}}, status)


def has_safetensors(path: Path) -> bool:
    return path.is_dir() and any(path.glob("*.safetensors"))


def _version_int(version: str | None) -> int:
    return int(version) if version is not None and version.isdecimal() else 0


def make_stub_app(state: StubState) -> FastAPI:
    app = FastAPI()
    # Both only touched on the server's loop: `running` is set while not paused, `idle` while nothing runs.
    running = asyncio.Event()
    running.set()
    idle = asyncio.Event()
    idle.set()

    @app.middleware("http")
    async def inject_faults(
        request: Request, call_next: Callable[[Request], Awaitable[Response]]
    ) -> Response:
        state.calls.append(request.url.path)
        fault = state.take_fault(request.url.path)
        if fault is not None:
            if fault.delay_s:
                await asyncio.sleep(fault.delay_s)
            if fault.status is not None:
                return Response(fault.body, status_code=fault.status, media_type="application/json")
        return await call_next(request)

    async def body_json(request: Request) -> dict[str, Any] | JSONResponse:
        try:
            body = json.loads(await request.body() or b"{}")
        except json.JSONDecodeError:
            return JSONResponse({"detail": "Invalid JSON format"}, 400)
        if not isinstance(body, dict):
            return JSONResponse({"detail": "Request body must be a JSON object"}, 400)
        return body

    async def run_generation(prompt: str, max_tokens: int, candidates: list[str]) -> dict[str, Any]:
        await running.wait()
        version_at_start = _version_int(state.weight_version)
        epoch = state.abort_epoch
        state.inflight += 1
        idle.clear()
        state.generation_started.set()
        finish_reason = "length"
        try:
            remaining = state.gen_delay_s
            while remaining > 0:
                if state.abort_epoch != epoch:
                    finish_reason = "abort"
                    break
                if state.pause_mode == "keep":
                    await running.wait()
                await asyncio.sleep(TICK_S)
                remaining -= TICK_S
        finally:
            state.inflight -= 1
            if state.inflight == 0:
                idle.set()
        tokens = min(max_tokens, 4)
        choice: dict[str, Any] = {"index": 0, "finish_reason": finish_reason, "logprobs": None}
        if candidates:
            pick = len(prompt) % len(candidates)
            choice["text"] = candidates[pick]
            if state.corral_extension:
                choice["corral"] = {"choice": pick, "logprob": -0.5, "weight_version": version_at_start}
        else:
            words = (prompt.split() or ["<empty>"])[:tokens]
            tokens = len(words)
            choice["text"] = "" if finish_reason == "abort" else " ".join(words)
        if finish_reason == "abort":
            tokens = 0
        return {
            "choice": choice,
            "usage": {
                "prompt_tokens": len(prompt.split()),
                "completion_tokens": tokens,
                "total_tokens": len(prompt.split()) + tokens,
            },
        }

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        body = await body_json(request)
        if isinstance(body, JSONResponse):
            return body
        if body.get("model") != state.model:
            return _error(404, f"The model `{body.get('model')}` does not exist.")
        prompt = body.get("prompt")
        if not isinstance(prompt, str):
            return _error(400, "prompt must be a string")
        out = await run_generation(
            prompt, int(body.get("max_tokens", 16)), list(body.get("candidates") or [])
        )
        return JSONResponse(
            {
                "id": "cmpl-stub",
                "object": "text_completion",
                "created": int(time.time()),
                "model": state.model,
                "choices": [out["choice"]],
                "usage": out["usage"],
            }
        )

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        body = await body_json(request)
        if isinstance(body, JSONResponse):
            return body
        if body.get("model") != state.model:
            return _error(404, f"The model `{body.get('model')}` does not exist.")
        messages = body.get("messages") or []
        last = messages[-1].get("content", "") if messages else ""
        out = await run_generation(str(last), int(body.get("max_tokens", 16)), [])
        choice = out["choice"]
        message = {"role": "assistant", "content": choice.pop("text")}
        return JSONResponse(
            {
                "id": "chatcmpl-stub",
                "object": "chat.completion",
                "created": int(time.time()),
                "model": state.model,
                "choices": [{**choice, "message": message}],
                "usage": out["usage"],
            }
        )

    async def do_pause(mode: str) -> None:
        state.paused = True
        state.pause_mode = mode
        running.clear()
        if mode == "abort":
            state.abort_epoch += 1
        if mode in ("wait", "abort"):
            await idle.wait()

    def do_resume() -> None:
        state.paused = False
        state.pause_mode = None
        running.set()

    @app.post("/pause")
    async def pause(mode: str = "abort") -> Response:
        if mode not in ("abort", "wait", "keep"):
            return JSONResponse({"error": f"Invalid pause mode: {mode!r}"}, 400)
        await do_pause(mode)
        return JSONResponse({"status": "paused"})

    @app.post("/resume")
    async def resume() -> Response:
        do_resume()
        return JSONResponse({"status": "resumed"})

    @app.get("/is_paused")
    async def is_paused() -> Response:
        return JSONResponse({"is_paused": state.paused})

    @app.post("/init_weight_transfer_engine")
    async def init_weight_transfer_engine(request: Request) -> Response:
        body = await body_json(request)
        if isinstance(body, JSONResponse):
            return body
        if body.get("init_info") is None:
            return JSONResponse({"detail": "Missing 'init_info' in request body"}, 400)
        state.transfer_initialized = True
        return JSONResponse({"message": "Weight transfer initialized"})

    @app.post("/start_weight_update")
    async def start_weight_update() -> Response:
        if state.updating:
            return JSONResponse(
                {"detail": "start_weight_update called while a weight update is already in progress."}, 409
            )
        if not state.transfer_initialized:
            # Not in the docs: vLLM fails inside the engine here; a 409 is the plausible, typed answer.
            return JSONResponse({"detail": "init_weight_transfer_engine has not been called."}, 409)
        state.updating = True
        return JSONResponse({"message": "Weight update started"})

    @app.post("/update_weights")
    async def update_weights(request: Request) -> Response:
        body = await body_json(request)
        if isinstance(body, JSONResponse):
            return body
        info = body.get("update_info")
        if info is None:
            return JSONResponse({"detail": "Missing 'update_info' in request body"}, 400)
        if not state.updating:
            return JSONResponse({"detail": "update_weights requires a preceding start_weight_update."}, 409)
        path = Path(str(info.get("path", "")))
        problem = None
        if not path.is_absolute():
            problem = f"path {str(path)!r} is not absolute"
        elif not await asyncio.to_thread(has_safetensors, path):
            problem = f"no safetensors files in {str(path)!r}"
        if problem is not None:
            state.updating = False
            return JSONResponse({"error": f"Weight update failed: {problem}"}, 500)
        state.loaded_paths.append(str(path))
        return JSONResponse({"message": "Weights updated"})

    @app.post("/finish_weight_update")
    async def finish_weight_update(request: Request) -> Response:
        body = await body_json(request)
        if isinstance(body, JSONResponse):
            return body
        version = body.get("weight_version")
        if version is not None and not isinstance(version, str):
            # vLLM's handler declares `weight_version: str | None` (Body(embed=True)): ints are 422.
            return JSONResponse({"detail": [{"type": "string_type", "loc": ["body", "weight_version"]}]}, 422)
        if not state.updating:
            return JSONResponse(
                {"detail": "finish_weight_update called without a preceding start_weight_update."}, 409
            )
        state.updating = False
        if version is not None:
            state.weight_version = version
        return JSONResponse({"message": "Weight update finished"})

    @app.get("/weight_info")
    async def weight_info() -> Response:
        return JSONResponse({"weight_version": state.weight_version})

    @app.post("/reset_prefix_cache")
    async def reset_prefix_cache() -> Response:
        state.prefix_cache_resets += 1
        return Response(status_code=200)

    @app.get("/health")
    async def health() -> Response:
        return Response(status_code=200 if state.healthy else 503)

    # --- SGLang's equivalents ---

    @app.post("/pause_generation")
    async def pause_generation(request: Request) -> Response:
        body = await body_json(request)
        if isinstance(body, JSONResponse):
            return body
        sglang_mode = body.get("mode", "abort")
        modes = {"abort": "abort", "in_place": "keep", "retract": "keep"}
        if sglang_mode not in modes:
            return JSONResponse({"detail": f"Invalid mode: {sglang_mode!r}"}, 400)
        await do_pause(modes[sglang_mode])
        return JSONResponse({"message": "Generation paused successfully.", "status": "ok"})

    @app.post("/continue_generation")
    async def continue_generation() -> Response:
        do_resume()
        return JSONResponse({"message": "Generation continued successfully.", "status": "ok"})

    @app.post("/update_weights_from_disk")
    async def update_weights_from_disk(request: Request) -> Response:
        body = await body_json(request)
        if isinstance(body, JSONResponse):
            return body
        path = Path(str(body.get("model_path", "")))
        if not await asyncio.to_thread(has_safetensors, path):
            return JSONResponse({"success": False, "message": f"no safetensors files in {str(path)!r}"}, 400)
        state.loaded_paths.append(str(path))
        if body.get("weight_version") is not None:
            state.weight_version = str(body["weight_version"])
        return JSONResponse(
            {"success": True, "message": "Succeeded to update model weights.", "num_paused_requests": 0}
        )

    @app.get("/get_weight_version")
    async def get_weight_version() -> Response:
        return JSONResponse({"weight_version": state.weight_version})

    @app.api_route("/flush_cache", methods=["GET", "POST"])
    async def flush_cache() -> Response:
        state.prefix_cache_resets += 1
        return Response("Cache flushed.\n", status_code=200)

    return app


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


@dataclass
class RunningStub:
    url: str
    state: StubState


@contextmanager
def serve_stub(state: StubState | None = None) -> Iterator[RunningStub]:
    """Run the stub with uvicorn on 127.0.0.1 on a free port in a thread, for the block's duration."""
    state = state or StubState()
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    config = uvicorn.Config(
        make_stub_app(state), log_level="warning", lifespan="off", ws="none", timeout_graceful_shutdown=1
    )
    server = uvicorn.Server(config)
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + 10
    while not server.started:
        if time.monotonic() > deadline or not thread.is_alive():
            raise RuntimeError(f"stub vLLM server did not start on port {port}")
        time.sleep(0.01)
    try:
        yield RunningStub(url=f"http://127.0.0.1:{port}", state=state)
    finally:
        server.should_exit = True
        thread.join(timeout=10)
        sock.close()
