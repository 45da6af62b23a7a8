"""The FastAPI app factory: `create_app(settings)` is the composition root of `corral serve`.

Settings are built by the caller (or here, from the environment) and injected; nothing is read at
import time. At start-up the database is migrated to head, rollouts that outlived their ended run are
closed as `cancelled`, the run manager is built and the runs the previous server left unfinished are
resumed, in the background: the server answers meanwhile, `/healthz` listing them under `resuming`; at
shutdown every run is stopped and its events flushed, within a bound (app.service.manager).

Routes: the run and trainer API (app.api.runs), `GET /healthz`, `GET /metrics` (Prometheus), and the
OpenAPI docs at `/docs` (Swagger UI served by this server, app.api.docs). With a broker, `/healthz` also
asks whether every lane queue of `CORRAL_LANE_HOSTS` and the `orchestrator` queue have a live worker, at
most once per `LANE_CHECK_S` (one broadcast for all requests and all queues).
Bad input is a 4xx with a one-line message naming the field, never a 500.
"""

from __future__ import annotations

import asyncio
import html
import logging
import re
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from typing import Any
from urllib.parse import urlsplit

from fastapi import Depends, FastAPI, Request, Response
from fastapi.exception_handlers import http_exception_handler
from fastapi.exceptions import RequestValidationError
from fastapi.responses import HTMLResponse, JSONResponse
from sqlalchemy.exc import DBAPIError, SQLAlchemyError
from sqlalchemy.exc import TimeoutError as PoolTimeout
from starlette.exceptions import HTTPException
from starlette.middleware.gzip import GZipMiddleware

from app.api.body_limit import BodyLimit
from app.api.deps import require_viewer
from app.api.docs import mount_docs
from app.api.graceful import AnswerCutOff
from app.api.runs import router as runs_router
from app.metrics import CorralMetrics
from app.service.channel import RunChannel
from app.service.compose import manager_for, store_for
from app.service.manager import DispatchError, RunManager
from app.service.queued import LostRuns, StartTimeout
from app.service.schemas import Problem, RunCreate, ValidationProblem
from app.service.store import ServiceStore
from app.settings import Settings, load_settings
from app.store.db import DatabaseHold, is_outage, outage_kind, outage_reason
from app.web.views import dashboard_for, error_page, mount_dashboard

GZIP_MIN_BYTES = 1024  # smaller answers go as they are: compressing them saves less than it costs
GZIP_LEVEL = 5
# What a read behind the view token may answer besides, as the OpenAPI documents it
READ_ANSWERS: dict[int | str, dict[str, Any]] = {
    401: {
        "model": Problem,
        "description": "a view token is set, and the request has neither it nor the operator's",
    },
    422: {"model": ValidationProblem, "description": "an Authorization header that is not valid UTF-8"},
}

log = logging.getLogger(__name__)


def create_app(
    settings: Settings | None = None,
    metrics: CorralMetrics | None = None,
    demo: RunCreate | None = None,
    hold: DatabaseHold | None = None,
) -> FastAPI:
    """The app. `demo`: a run to create at start-up when no run is executing (`corral serve --demo`);
    `hold`: `corral serve`'s hold on the database, which `/healthz` reports."""
    settings = settings or load_settings()

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        store = await asyncio.to_thread(store_for, settings)
        closed = await asyncio.to_thread(store.close_ended_rollouts)
        if closed:
            log.warning("closed the rollouts left running by ended runs %s", ", ".join(closed))
        manager = manager_for(settings, store, app.state.metrics)
        app.state.manager = manager
        if settings.resume_runs:
            # In the background: the server answers (/healthz says `resuming`) while stored streams replay
            resuming = await asyncio.to_thread(manager.start_resuming)
            if resuming:
                log.warning("resuming runs %s", ", ".join(resuming))
        if demo is not None and not manager.handles and not manager.resuming:
            app.state.demo_run = await asyncio.to_thread(manager.create, demo)
        start_timeout = start_timeout_for(settings, store, app.state.queue_workers, app.state.dispatch)
        if start_timeout is not None:
            start_timeout.start()
        try:
            yield
        finally:
            if start_timeout is not None:
                await asyncio.to_thread(start_timeout.stop)
            if settings.keeps_runs:
                await asyncio.to_thread(manager.leave_for_next_start)
            else:
                await asyncio.to_thread(manager.shutdown)
            store.close()
            if app.state.queue_workers is not None:
                app.state.queue_workers.close()

    app = FastAPI(
        title="Corral",
        summary="Control plane for agentic RL rollout collection: runs, trainer API, metrics",
        lifespan=lifespan,
        docs_url=None,  # FastAPI's loads Swagger UI from a CDN: mount_docs serves it from here
        redoc_url=None,
    )
    app.state.settings = settings
    app.state.hold = hold
    app.state.stopping = asyncio.Event()  # set when the server starts to stop (app.api.graceful)
    app.state.metrics = metrics or CorralMetrics()
    app.state.dispatch = celery_dispatch(settings) if settings.broker_url is not None else None
    app.state.queue_workers = QueueWorkers.of(settings) if settings.broker_url is not None else None
    app.state.channel = run_channel(settings)
    app.add_middleware(BodyLimit)  # before any route reads a body: a huge one is a 413, not memory
    # A live run's timeline is re-sent whole on each change (1.1 MB of SVG for 9,151 spans), and SVG
    # and JSON shrink about eightfold; level 5 gets 8.1× in 12.5 ms there where 9 takes 39 ms (more
    # than the render) for 8.8×. The live stream (text/event-stream) is left alone: Starlette's default
    # exclude_content_types (pyproject asks for a Starlette that has it).
    app.add_middleware(GZipMiddleware, minimum_size=GZIP_MIN_BYTES, compresslevel=GZIP_LEVEL)
    app.add_middleware(AnswerCutOff, page=_cut_off_page)  # outermost: whatever the request was in
    app.add_exception_handler(RequestValidationError, _validation_error)  # type: ignore[arg-type]
    app.add_exception_handler(HTTPException, _http_error)  # type: ignore[arg-type]
    app.add_exception_handler(DBAPIError, _database_error)  # type: ignore[arg-type]
    app.add_exception_handler(PoolTimeout, _database_error)  # type: ignore[arg-type]
    app.include_router(runs_router)
    # the HTML dashboard at /
    mount_dashboard(app, dashboard_for(settings, lambda: app.state.manager, app.state.channel))
    app.add_api_route(
        "/healthz",
        healthz,
        methods=["GET"],
        tags=["ops"],
        responses={
            503: {
                "description": "the database, the broker or an executing run's engine is down, the "
                "server's hold on the database is lost, or a lane queue or the orchestrator queue has no "
                "live worker"
            }
        },
    )
    # Its figures are labelled with run ids: a read like the API's, behind the view token when one is set
    # (Prometheus sends it: `authorization: {credentials: TOKEN}` in the scrape config)
    app.add_api_route(
        "/metrics",
        prometheus_metrics,
        methods=["GET"],
        tags=["ops"],
        dependencies=[Depends(require_viewer)],
        responses=READ_ANSWERS,
    )
    mount_docs(app)
    return app


# A run's dispatch is tried for about this long while the broker does not answer, then refused (503):
# Celery's publish retries (a minute) would hold the request that long.
DISPATCH_RETRIES = 3


def celery_dispatch(settings: Settings) -> Callable[[str], None]:
    """Send a run to the `orchestrator` queue, where a `corral worker --orchestrator` drives it. Nobody
    waits for the task's result (the run's account is in the database), so none is kept: subscribing to
    it made a send with the result backend away fail, and left the app's result consumer broken."""
    from app.lanes.celery import ORCHESTRATOR_TASK, broker_urls, make_celery
    from app.lanes.lost_ops import BROKER_ERRORS

    broker, backend = broker_urls(settings.broker_url, settings.result_backend)
    celery = make_celery(broker, backend)
    retry = {"max_retries": DISPATCH_RETRIES, "interval_start": 0, "interval_step": 0.5, "interval_max": 1.0}

    def dispatch(run_id: str) -> None:
        try:
            celery.send_task(ORCHESTRATOR_TASK, args=[run_id], ignore_result=True, retry_policy=retry)
        except BROKER_ERRORS as exc:
            reason = " ".join(str(exc).split()) or type(exc).__name__
            raise DispatchError(f"the broker did not answer ({reason})") from None

    return dispatch


def run_channel(settings: Settings) -> RunChannel | None:
    """The command channel to the orchestrator workers of celery runs (with a broker)."""
    if settings.broker_url is None:
        return None
    from app.lanes.celery import broker_urls

    _, backend = broker_urls(settings.broker_url, settings.result_backend)
    return RunChannel(backend, settings.command_timeout_s)


def start_timeout_for(
    settings: Settings,
    store: ServiceStore,
    queue_workers: QueueWorkers | None,
    dispatch: Callable[[str], None] | None = None,
) -> StartTimeout | None:
    """The watch that ends the celery runs no orchestrator worker took (with a broker)."""
    if settings.broker_url is None or queue_workers is None:
        return None
    from app.lanes.celery import broker_urls
    from app.lanes.redis_client import RECLAIM_TIMEOUT_S, redis_client

    broker, backend = broker_urls(settings.broker_url, settings.result_backend)
    leases = redis_client(backend, RECLAIM_TIMEOUT_S)  # a hung Redis waits for the watch's next period
    lost = None
    if dispatch is not None and urlsplit(broker).scheme in ("redis", "rediss"):  # RabbitMQ keeps its queues
        from app.lanes.celery import lease_key, runs_in_broker
        from app.lanes.lost_ops import BrokerEpoch

        celery = queue_workers.celery
        epoch = BrokerEpoch(celery)  # its own client of the broker's Redis
        broker_redis = epoch.client
        assert broker_redis is not None  # a redis:// broker
        lost = LostRuns(
            epoch.now,
            lambda: runs_in_broker(celery, broker_redis),
            lambda run_id: bool(leases.exists(lease_key(run_id))),
            dispatch,
            epoch.close,
        )
    return StartTimeout(store, leases, lambda: queue_workers.count()[1], settings.start_timeout_s, lost=lost)


LANE_CHECK_S = 5.0  # /healthz asks the workers at most this often


class QueueWorkers:
    """How many live workers consume each lane queue (`lane.<host>.<lane>` for every host of
    `CORRAL_LANE_HOSTS` and every lane) and the `orchestrator` queue, through the lane client's own ping
    (`LiveWorkers`): one broadcast answers for every queue."""

    def __init__(self, celery: Any, lane_queues: list[str]) -> None:
        from app.lanes.lost_ops import LiveWorkers

        self.celery = celery
        self.lane_queues = lane_queues
        self._live = LiveWorkers(celery, check_s=LANE_CHECK_S)

    @classmethod
    def of(cls, settings: Settings) -> QueueWorkers:
        from app.lanes.base import LaneName
        from app.lanes.celery import broker_urls, lane_queue, make_celery, parse_lane_hosts

        broker, backend = broker_urls(settings.broker_url, settings.result_backend)
        hosts = parse_lane_hosts(settings.lane_hosts or "")
        return cls(make_celery(broker, backend), [lane_queue(h, lane) for h in hosts for lane in LaneName])

    def count(self) -> tuple[dict[str, int], int]:
        """The live workers of each lane queue, and of the orchestrator queue."""
        from app.lanes.celery import ORCHESTRATOR_QUEUE

        workers = self._live.consumers([*self.lane_queues, ORCHESTRATOR_QUEUE])
        return {q: workers[q] for q in self.lane_queues}, workers[ORCHESTRATOR_QUEUE]

    def close(self) -> None:
        self.celery.close()


NAMES_ITS_FIELD = re.compile(r"[A-Za-z_][\w.]*(, [A-Za-z_][\w.]*)*: ")  # "surplus_groups: ...", "a, b: ..."


def _cut_off_page(scope: dict[str, Any], detail: str) -> Response | None:
    """A dashboard page's request cut off as the server stops (`AnswerCutOff`): a page saying so."""
    return error_page(Request(scope), detail, 503)


async def _validation_error(request: Request, exc: RequestValidationError) -> Response:
    """422 with one line per problem, each naming its field (`body.workload.batch.groups: ...`)."""
    problems = []
    for error in exc.errors():
        if error.get("type") == "json_invalid":  # its loc is ("body", character offset), not a field
            where = error.get("loc", ())[-1]
            why = (error.get("ctx") or {}).get("error", "")
            problems.append(f"body: not valid JSON at character {where}" + (f" ({why})" if why else ""))
            continue
        where = error.get("loc", ())
        if where[:1] in (("query",), ("path",)):  # a query or path parameter: its name alone
            where = where[1:]
        loc = ".".join(str(p) for p in where if p != "body") or "body"
        message = str(error.get("msg", "invalid")).removeprefix("Value error, ")  # pydantic's wording
        if error.get("type") == "extra_forbidden":
            message = "unknown field"
        if loc == "body" and NAMES_ITS_FIELD.match(message):
            problems.append(message)  # a check across fields names the one it refuses: not "body"
        elif loc == "body" and not _json_content(request):
            # FastAPI reads no JSON without a JSON Content-Type: "should be a valid dictionary" (curl -d
            # sends application/x-www-form-urlencoded) hid what was wrong.
            given = request.headers.get("content-type") or "none"
            problems.append(f"body: send it as JSON, with Content-Type: application/json (not {given})")
        else:
            problems.append(f"{loc}: {message}")
    detail = "; ".join(problems)
    if (page := error_page(request, detail, 422)) is not None:
        return page
    return JSONResponse(
        status_code=422,
        content={"detail": detail, "errors": [{"field": p.split(":")[0], "problem": p} for p in problems]},
    )


def _json_content(request: Request) -> bool:
    """Whether the request says its body is JSON, as FastAPI reads it (application/json or a +json type)."""
    kind = (request.headers.get("content-type") or "").split(";", 1)[0].strip().lower()
    return kind == "application/json" or (kind.startswith("application/") and kind.endswith("+json"))


async def _http_error(request: Request, exc: HTTPException) -> Response:
    """FastAPI's own answers, but a JSON body too deeply nested to parse or not in UTF-8 (FastAPI says
    400, "There was an error parsing the body") is bad input like any malformed body: a 422 saying so."""
    cause = exc.__cause__
    if exc.status_code == 400 and isinstance(cause, RecursionError | UnicodeDecodeError):
        why = "nested too deeply" if isinstance(cause, RecursionError) else "not UTF-8"
        problem = f"body: not valid JSON ({why})"
        errors = [{"field": "body", "problem": problem}]
        return JSONResponse(status_code=422, content={"detail": problem, "errors": errors})
    if exc.status_code in PAGE_ERRORS:  # a browser's mistyped or stale address: a page, not JSON
        said = f"{PAGE_ERRORS[exc.status_code]}: {request.method} {request.url.path}"
        if (page := error_page(request, said, exc.status_code)) is not None:
            page.headers.update(exc.headers or {})  # 405's Allow
            return page
    return await http_exception_handler(request, exc)


PAGE_ERRORS = {404: "no such page", 405: "this page does not take that method"}


DATABASE_RETRY_AFTER_S = 5


async def _database_error(request: Request, exc: SQLAlchemyError) -> Response:
    """A database that is away (Postgres restarting) or busy (SQLite locked, every pooled connection in
    use) answers 503 with one line and a Retry-After, not a 500 and a traceback per request; any other
    database error is the bug it is."""
    if not is_outage(exc):
        raise exc
    reason = outage_reason(exc)
    kind = outage_kind(exc)
    log.warning("%s %s: the database is %s (%s)", request.method, request.url.path, kind, reason)
    detail = f"the database is {kind} ({reason}); try again in a few seconds"
    headers = {"Retry-After": str(DATABASE_RETRY_AFTER_S)}
    if "text/html" in request.headers.get("accept", ""):  # a page in a browser
        body = f"<!doctype html><title>Corral: database unavailable</title><p>{html.escape(detail)}</p>"
        return HTMLResponse(body, status_code=503, headers=headers)
    return JSONResponse(status_code=503, content={"detail": detail}, headers=headers)


async def healthz(request: Request) -> JSONResponse:
    """Whether the database, the broker, a live worker on every lane queue and on the orchestrator
    queue (with a broker) and the engines of the executing runs are reachable, and whether `corral
    serve` holds the database (`database.held`); `resuming`: the runs still being resumed after a
    restart."""
    settings: Settings = request.app.state.settings
    manager: RunManager = request.app.state.manager
    database = await asyncio.to_thread(manager.store.ping)
    hold: DatabaseHold | None = request.app.state.hold
    held = hold is None or hold.held  # false while a lost hold is not yet taken again (app.api.serve)
    broker: dict[str, Any] = {"mode": "in-process", "ok": True}
    workers: dict[str, dict[str, Any]] = {}
    if settings.broker_url is not None:
        broker = {"mode": "celery", "ok": await asyncio.to_thread(_broker_reachable, settings.broker_url)}
        workers = await _workers_healthy(request.app.state.queue_workers, broker["ok"])
    engines: dict[str, dict[str, bool]] = {}
    for run_id, handle in list(manager.handles.items()):
        if handle.loop is None or handle.ports is None or handle.done.is_set():
            continue
        engines[run_id] = await _engines_healthy(handle)
    ok = database and held and broker["ok"] and all(all(e.values()) for e in engines.values())
    body = {"ok": ok, "database": {"ok": database, "held": held}, "broker": broker, "engines": engines}
    # Runs of the previous server still being resumed (their stored streams replayed): not unhealthy
    body["resuming"] = sorted(manager.resuming)
    if workers:  # "lanes" and "orchestrator"
        ok = ok and all(w["ok"] is True for w in workers.values())
        body.update(ok=ok, **workers)
    return JSONResponse(body, status_code=200 if ok else 503)


async def _workers_healthy(queue_workers: QueueWorkers, broker_ok: bool) -> dict[str, dict[str, Any]]:
    """`lanes`: `ok`, the live workers of each lane queue and the queues without one; `orchestrator`:
    `ok` and its live workers (a run whose orchestrator is celery waits for one). Not asked (`ok` None)
    while the broker does not answer (a broadcast would wait on it, and the broker's own check already
    fails)."""
    if not broker_ok:
        return {
            "lanes": {"ok": None, "workers": None, "without_workers": None},
            "orchestrator": {"ok": None, "workers": None},
        }
    from app.lanes.lost_ops import BROKER_ERRORS

    try:
        lanes, orchestrators = await asyncio.to_thread(queue_workers.count)
    except BROKER_ERRORS as exc:  # the broker went away since its check: no answer is no worker known
        log.warning("workers not asked: the broker did not answer (%r)", exc)
        return {
            "lanes": {"ok": False, "workers": None, "without_workers": None},
            "orchestrator": {"ok": False, "workers": None},
        }
    without = [queue for queue, n in lanes.items() if n == 0]
    return {
        "lanes": {"ok": not without, "workers": lanes, "without_workers": without},
        "orchestrator": {"ok": orchestrators > 0, "workers": orchestrators},
    }


async def _engines_healthy(handle: Any) -> dict[str, bool]:
    loop = handle.loop
    out: dict[str, bool] = {}
    for engine in handle.engines():  # a restarted engine's current client, not the one it started with
        try:
            future = asyncio.run_coroutine_threadsafe(engine.health(), loop)
            out[engine.name] = bool(await asyncio.wait_for(asyncio.wrap_future(future), timeout=2.0))
        except (TimeoutError, RuntimeError, OSError) as exc:  # unreachable or the run just ended
            log.info("engine %s health check failed: %r", engine.name, exc)
            out[engine.name] = False
    return out


def _broker_reachable(url: str) -> bool:
    if url.startswith(("redis://", "rediss://")):
        import redis

        from app.lanes.redis_client import HEALTH_TIMEOUT_S, redis_client

        try:
            client = redis_client(url, HEALTH_TIMEOUT_S)
            try:
                return bool(client.ping())
            finally:
                client.close()
        except redis.RedisError:
            return False
    import socket
    from urllib.parse import urlparse

    parsed = urlparse(url)
    try:
        with socket.create_connection((parsed.hostname or "localhost", parsed.port or 5672), timeout=1.0):
            return True
    except OSError:
        return False


async def prometheus_metrics(request: Request) -> Response:
    manager: RunManager = request.app.state.manager
    metrics: CorralMetrics = request.app.state.metrics
    manager.sample_metrics()
    body, content_type = metrics.exposition()
    return Response(content=body, media_type=content_type)
