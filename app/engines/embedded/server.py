"""The embedded engine's HTTP server: vLLM's surface (docs/engines.md) over a `BatchEngine`.

Invariants:
- The routes, bodies and status codes are those of docs/engines.md; anything extra (`candidates`,
  the `corral` choice field, `GET /stats`) is ignorable by a client written for vLLM.
- Weight updates are transactional: `/update_weights` validates the whole directory and only stages
  it; `/finish_weight_update` swaps the staged tensors and the version together on the worker thread,
  between decode steps. A refused directory (4xx) ends the update session and leaves the engine on its
  old weights and old version.
- The process is pinned to `cpus` and runs torch with `len(cpus)` threads before it serves anything.
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
import uuid
from collections.abc import AsyncIterator, Sequence
from contextlib import asynccontextmanager
from dataclasses import asdict, dataclass
from types import FrameType
from typing import Any

import torch
import uvicorn
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from pydantic import BaseModel, ConfigDict, Field

from app.engines.embedded.batching import (
    BatchEngine,
    EngineStopped,
    GenerationRequest,
    GenerationResult,
    PauseMode,
)
from app.engines.embedded.cpus import format_cpu_list, pin_cpus
from app.engines.embedded.faults import ENV_FLAG as FAULTS_FLAG
from app.engines.embedded.faults import install_faults
from app.engines.embedded.model import SENTINEL, PolicyConfig, PolicyModel
from app.engines.embedded.weights import WeightsError, load_checkpoint
from app.validation import MAX_SEED, parse_int

log = logging.getLogger(__name__)

DEFAULT_MODEL_NAME = "corral-embedded"


@dataclass(frozen=True)
class EmbeddedConfig:
    """Everything the embedded engine process is started with."""

    layers: int = 2
    hidden: int = 64
    seed: int = 0
    sentinel: bool = False
    weights_dir: str | None = None
    # The version the initial weights are reported as.
    weight_version: int = 0
    max_batch: int = 64
    max_tokens_limit: int = 16384
    max_prompt_tokens: int = 2048
    model_name: str = DEFAULT_MODEL_NAME
    cpus: tuple[int, ...] | None = None


class CompletionBody(BaseModel):
    model_config = ConfigDict(extra="allow")

    model: str | None = None
    prompt: str | list[str]
    max_tokens: int = Field(16, ge=0)
    temperature: float = Field(1.0, ge=0.0, allow_inf_nan=False)
    n: int = 1
    stream: bool = False
    candidates: list[str] | None = None


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow")

    role: str
    content: str


class ChatBody(BaseModel):
    model_config = ConfigDict(extra="allow")

    model: str | None = None
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int = Field(16, ge=0)
    temperature: float = Field(1.0, ge=0.0, allow_inf_nan=False)
    n: int = 1
    stream: bool = False


class BadRequest(Exception):
    """A request this engine refuses; rendered as `{"error": ...}` with `status`."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status
        self.message = message


@dataclass
class WeightTransfer:
    """The disk-backend session (event-loop owned): start → update → finish."""

    initialized: bool = False
    updating: bool = False
    staged: dict[str, torch.Tensor] | None = None
    last_refusal: str | None = None


def build_model(config: EmbeddedConfig) -> PolicyModel:
    model = PolicyModel(
        PolicyConfig(
            layers=config.layers,
            hidden=config.hidden,
            seed=config.seed,
            max_prompt_tokens=config.max_prompt_tokens,
        )
    )
    model.eval()
    if config.weights_dir is not None:
        loaded = load_checkpoint(os.path.abspath(config.weights_dir), model.state_dict())
        model.load_state_dict(loaded, strict=True)
    return model


def _openai_error(status: int, message: str) -> JSONResponse:
    kind = "NotFoundError" if status == 404 else "BadRequestError" if status < 500 else "InternalServerError"
    return JSONResponse({"error": {"message": message, "type": kind, "code": status}}, status_code=status)


def _error(status: int, message: str, path: str) -> JSONResponse:
    if path.startswith("/v1/"):
        return _openai_error(status, message)
    return JSONResponse({"error": message}, status_code=status)


def _parse_version(value: object) -> int:
    """A committed version: a non-negative int, or a string of ASCII digits (`str.isdigit` also takes
    '٣' as 3, and '³', which `int` then refuses: a 500), at most `MAX_SEED`, the bound of the initial
    `--weight-version` (it took 10**23, which no int64 holds)."""
    refusal = BadRequest(
        400,
        f"weight_version must be a non-negative integer or a string of ASCII digits, at most {MAX_SEED}, "
        f"got {value!r:.100} (the embedded engine reports integer versions)",
    )
    if isinstance(value, int) and not isinstance(value, bool):
        version = value
    elif isinstance(value, str):
        try:
            version = parse_int(value, signed=False)
        except ValueError:  # not ASCII digits, or more digits than Python converts
            raise refusal from None
    else:
        raise refusal
    if not 0 <= version <= MAX_SEED:
        raise refusal
    return version


async def _json_object(request: Request) -> dict[str, Any]:
    raw = await request.body()
    if not raw.strip():
        return {}
    try:
        body = await request.json()
    except ValueError as exc:
        raise BadRequest(400, f"request body is not valid JSON: {exc}") from exc
    if not isinstance(body, dict):
        raise BadRequest(400, f"request body must be a JSON object, got {type(body).__name__}")
    return body


def create_app(config: EmbeddedConfig) -> FastAPI:
    """Build the app; the model is built now, the worker thread starts with the app's lifespan."""
    model = build_model(config)
    engine = BatchEngine(
        model, seed=config.seed, max_batch=config.max_batch, weight_version=config.weight_version
    )
    expected = {name: t.detach().clone() for name, t in model.state_dict().items()}
    transfer = WeightTransfer()
    created = int(time.time())

    @asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        engine.start()
        try:
            yield
        finally:
            await asyncio.to_thread(engine.stop)

    app = FastAPI(title="corral embedded engine", lifespan=lifespan)
    if os.environ.get(FAULTS_FLAG) == "1":  # test-only fault injection: app/engines/embedded/faults.py
        install_faults(app)
    app.state.engine = engine
    app.state.config = config

    @app.exception_handler(BadRequest)
    async def bad_request(request: Request, exc: BadRequest) -> JSONResponse:
        return _error(exc.status, exc.message, request.url.path)

    @app.exception_handler(RequestValidationError)
    async def invalid(request: Request, exc: RequestValidationError) -> JSONResponse:
        problems = "; ".join(
            f"{'.'.join(str(p) for p in e.get('loc', ()))}: {e.get('msg', '')}" for e in exc.errors()
        )
        return _error(400, f"invalid request: {problems}", request.url.path)

    @app.exception_handler(EngineStopped)
    async def stopped(request: Request, exc: EngineStopped) -> JSONResponse:
        return _error(503, str(exc), request.url.path)

    def check_model(name: str | None) -> None:
        if name is not None and name != config.model_name:
            raise BadRequest(
                404, f"The model `{name}` does not exist (this engine serves `{config.model_name}`)."
            )

    def check_request(model: str | None, stream: bool, n: int) -> None:
        """What both generation routes refuse: another model, streaming, more than one choice."""
        check_model(model)
        if stream:
            raise BadRequest(400, "stream=true is not supported by the embedded engine")
        if n != 1:
            raise BadRequest(400, f"n={n} is not supported by the embedded engine (only n=1)")

    async def run_turn(request: GenerationRequest) -> GenerationResult:
        if request.max_tokens > config.max_tokens_limit:
            raise BadRequest(
                400, f"max_tokens {request.max_tokens} exceeds this engine's limit {config.max_tokens_limit}"
            )
        return await asyncio.wrap_future(engine.submit(request))

    def usage(result: GenerationResult) -> dict[str, int]:
        return {
            "prompt_tokens": result.prompt_tokens,
            "completion_tokens": result.completion_tokens,
            "total_tokens": result.prompt_tokens + result.completion_tokens,
        }

    # --- OpenAI routes --------------------------------------------------------------------------

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        return {
            "object": "list",
            "data": [
                {
                    "id": config.model_name,
                    "object": "model",
                    "created": created,
                    "owned_by": "corral",
                    "root": config.model_name,
                    "max_model_len": config.max_prompt_tokens + config.max_tokens_limit,
                }
            ],
        }

    @app.post("/v1/completions")
    async def completions(body: CompletionBody) -> dict[str, Any]:
        check_request(body.model, body.stream, body.n)
        if isinstance(body.prompt, list):
            if len(body.prompt) != 1:
                raise BadRequest(400, f"prompt lists must hold exactly one prompt, got {len(body.prompt)}")
            prompt = body.prompt[0]
        else:
            prompt = body.prompt
        if body.candidates is not None and not body.candidates:
            raise BadRequest(400, "candidates, when given, must hold at least one string")
        result = await run_turn(
            GenerationRequest(
                prompt=prompt,
                max_tokens=body.max_tokens,
                temperature=body.temperature,
                candidates=tuple(body.candidates or ()),
            )
        )
        choice: dict[str, Any] = {
            "index": 0,
            "text": result.text,
            "logprobs": None,
            "finish_reason": result.finish_reason,
        }
        if body.candidates and result.choice is not None:
            choice["corral"] = {
                "choice": result.choice,
                "logprob": result.logprob,
                "weight_version": result.weight_version,
                "choice_logprob": result.choice_logprob,
            }
        return {
            "id": f"cmpl-{uuid.uuid4().hex}",
            "object": "text_completion",
            "created": int(time.time()),
            "model": config.model_name,
            "choices": [choice],
            "usage": usage(result),
            # Ignorable by OpenAI clients; lets any caller see the version of a plain turn.
            "corral": {"weight_version": result.weight_version},
        }

    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatBody) -> dict[str, Any]:
        check_request(body.model, body.stream, body.n)
        prompt = "".join(f"{m.role}: {m.content}\n" for m in body.messages) + "assistant: "
        result = await run_turn(
            GenerationRequest(prompt=prompt, max_tokens=body.max_tokens, temperature=body.temperature)
        )
        return {
            "id": f"chatcmpl-{uuid.uuid4().hex}",
            "object": "chat.completion",
            "created": int(time.time()),
            "model": config.model_name,
            "choices": [
                {
                    "index": 0,
                    "message": {"role": "assistant", "content": result.text},
                    "logprobs": None,
                    "finish_reason": result.finish_reason,
                }
            ],
            "usage": usage(result),
            "corral": {"weight_version": result.weight_version},
        }

    # --- health, pause / resume -----------------------------------------------------------------

    @app.get("/health")
    async def health() -> Response:
        if not engine.alive:
            return JSONResponse(
                {"error": "the embedded engine's worker thread is not running"}, status_code=503
            )
        return Response(status_code=200)

    @app.post("/pause")
    async def pause(mode: str = "abort") -> dict[str, str]:
        try:
            pause_mode = PauseMode(mode)
        except ValueError:
            raise BadRequest(400, f"invalid pause mode {mode!r}; expected one of abort, wait, keep") from None
        await asyncio.wrap_future(engine.pause(pause_mode))
        return {"status": "paused"}

    @app.post("/resume")
    async def resume() -> dict[str, str]:
        engine.resume()
        return {"status": "resumed"}

    @app.get("/is_paused")
    async def is_paused() -> dict[str, bool]:
        return {"is_paused": engine.paused}

    # --- weight transfer (disk backend) ---------------------------------------------------------

    @app.post("/init_weight_transfer_engine")
    async def init_weight_transfer_engine(request: Request) -> dict[str, str]:
        body = await _json_object(request)
        init_info = body.get("init_info")
        if not isinstance(init_info, dict):
            raise BadRequest(400, "init_weight_transfer_engine needs an object field 'init_info'")
        transfer.initialized = True
        return {"message": "Weight transfer initialized"}

    @app.post("/start_weight_update")
    async def start_weight_update(request: Request) -> dict[str, str]:
        await _json_object(request)
        if transfer.updating:
            raise BadRequest(409, "a weight update is already in progress; call /finish_weight_update first")
        transfer.updating = True
        transfer.staged = None
        transfer.last_refusal = None
        return {"message": "Weight update started"}

    @app.post("/update_weights")
    async def update_weights(request: Request) -> dict[str, str]:
        body = await _json_object(request)
        update_info = body.get("update_info")
        if not isinstance(update_info, dict):
            raise BadRequest(
                400, "update_weights needs an object field 'update_info', e.g. {'path': '/abs/dir'}"
            )
        if not transfer.updating:
            raise BadRequest(409, "no weight update in progress; call /start_weight_update first")
        path = update_info.get("path")
        if path is None and config.sentinel:
            transfer.staged = None
            return {"message": "Weights updated"}
        if not isinstance(path, str):
            raise BadRequest(400, f"update_info.path must be an absolute directory path, got {path!r:.100}")
        only = {SENTINEL} if config.sentinel else None
        try:
            staged = await asyncio.to_thread(load_checkpoint, path, expected, only=only)
        except WeightsError as exc:
            # Ending the session keeps a half-failed publication from being finished by mistake.
            transfer.updating = False
            transfer.staged = None
            transfer.last_refusal = str(exc)
            log.warning("embedded engine refused weights: %s", exc)
            raise BadRequest(
                400, f"refused weights (still serving version {engine.weight_version}): {exc}"
            ) from exc
        transfer.staged = staged
        return {"message": "Weights updated"}

    @app.post("/finish_weight_update")
    async def finish_weight_update(request: Request) -> dict[str, str]:
        body = await _json_object(request)
        if not transfer.updating:
            detail = (
                f" (the last update_weights was refused: {transfer.last_refusal})"
                if transfer.last_refusal
                else ""
            )
            raise BadRequest(409, f"no weight update in progress; call /start_weight_update first{detail}")
        version = _parse_version(body.get("weight_version"))
        staged = transfer.staged

        def commit(model: PolicyModel) -> None:
            if staged is not None:
                model.load_state_dict(staged, strict=not config.sentinel)
            elif config.sentinel:
                model.corral_sentinel.fill_(float(version))
            engine.set_weight_version(version)

        await asyncio.wrap_future(engine.run_on_worker(commit))
        transfer.updating = False
        transfer.staged = None
        return {"message": "Weight update finished"}

    @app.get("/weight_info")
    async def weight_info() -> dict[str, Any]:
        return {
            "weight_version": str(engine.weight_version),
            "updating": transfer.updating,
            "sentinel": config.sentinel,
            "sentinel_value": float(model.corral_sentinel),
        }

    @app.post("/reset_prefix_cache")
    async def reset_prefix_cache() -> Response:
        # A GRU keeps no prefix cache; the route exists so clients written for vLLM work unchanged.
        return Response(status_code=200)

    # --- Corral extras --------------------------------------------------------------------------

    @app.get("/stats")
    async def stats() -> dict[str, Any]:
        return {
            **engine.stats(),
            "config": {k: v for k, v in asdict(config).items() if k != "cpus"},
            "cpus": None if config.cpus is None else format_cpu_list(config.cpus),
            "torch_threads": torch.get_num_threads(),
        }

    return app


def serve(
    port: int,
    cpus: Sequence[int] | None,
    host: str = "127.0.0.1",
    layers: int = 2,
    hidden: int = 64,
    seed: int = 0,
    sentinel: bool = False,
    weights_dir: str | None = None,
    *,
    weight_version: int = 0,
    max_batch: int = 64,
    model_name: str = DEFAULT_MODEL_NAME,
    log_level: str = "warning",
) -> None:
    """Pin to `cpus`, build the model and serve until interrupted.

    Raises `CpuListError` for CPUs this process may not use and `WeightsError` for a bad `weights_dir`.
    """
    if cpus is not None:
        pin_cpus(cpus)
        torch.set_num_threads(len(cpus))
    config = EmbeddedConfig(
        layers=layers,
        hidden=hidden,
        seed=seed,
        sentinel=sentinel,
        weights_dir=weights_dir,
        weight_version=weight_version,
        max_batch=max_batch,
        model_name=model_name,
        cpus=None if cpus is None else tuple(cpus),
    )
    app = create_app(config)
    _Server(uvicorn.Config(app, host=host, port=port, log_level=log_level, timeout_graceful_shutdown=2)).run()


class _Server(uvicorn.Server):
    """uvicorn's server, except for what more than one stop signal does. uvicorn raised each signal it
    caught again after its shutdown, to the handler it found (asyncio's runner's, while the loop still
    ran), and took a second Ctrl-C as "force quit", which skips the application's shutdown so that its
    lifespan task is cancelled as the loop closes. After two quick Ctrl-Cs `corral engine` printed a
    KeyboardInterrupt and a lifespan CancelledError traceback below its "stopped" line (3 of 4 double
    presses). Here a second signal changes nothing: the graceful stop is bounded anyway
    (`timeout_graceful_shutdown`, 2 s), and the caller (`corral engine`, the engine's own `main`)
    returns once `run` does, which is the stop it asked for. uvicorn raises again only the signals its
    own `handle_exit` recorded, and this one records none."""

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        self.should_exit = True
