"""The dashboard: plain view functions over `RunView`s, one template per page, and named blocks of
those templates rendered alone for htmx requests and for the live stream (SSE).

Routes (all HTML; the JSON API lives under /api and is not this module's):
  GET  /                         runs page                    GET /runs/{id}         run page
  GET  /runs/{id}/block/{name}   one named block of the run page (timeline takes ?zoom=, 1–64, ?width= and
                                 ?window=, its last so many seconds, 10–31,536,000)
  GET  /stream, /runs/{id}/stream   server-sent events: named blocks, re-rendered when the run changes
  GET  /login                    the sign-in page (?next= a path on this site to return to)
  POST /login, /logout           set or clear the token cookie
  POST /runs                     launch a run          POST /replays           load a report as a replay
  POST /runs/{id}/publish        publish weights       POST /runs/{id}/policy  change K and S
  POST /runs/{id}/pause, resume  pause or resume the run   POST /runs/{id}/stop    stop the run

Every POST checks the CSRF double-submit token; every action needs the operator token (403 with the
reason otherwise). Forms work without JavaScript (303 back to the page); with htmx the answer is the
re-rendered block, errors included.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import Counter
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass, field
from html import escape
from pathlib import Path
from typing import Annotated, Any, Protocol
from urllib.parse import quote

import anyio
from fastapi import APIRouter, FastAPI, Query, Request
from fastapi.responses import HTMLResponse, RedirectResponse, Response
from jinja2 import Environment, FileSystemLoader, select_autoescape
from sse_starlette.sse import EventSourceResponse
from starlette.staticfiles import StaticFiles

from app.core.attribution import PHASE_LABELS
from app.core.config import MAX_AGENT_GATE
from app.validation import MAX_RUN_STALENESS, MAX_SURPLUS, large_surplus_change, parse_decimal, parse_int
from app.web import charts
from app.web.backend import MAX_REPORT_BYTES, ActionRefused, ReplayStore, RunsBackend
from app.web.readmodel import BatchRow, ReportError, RunSummary, RunView, trend_of
from app.web.security import (
    CSRF_FIELD,
    AccessConfig,
    can_view,
    csrf_ok,
    csrf_token,
    is_operator,
    set_csrf_cookie,
    set_token_cookie,
)
from app.web.series import IDLE_WINDOW_BATCHES, BatchTrend, Bucket, idle_percent
from app.web.timeline import (
    BASE_WIDTH,
    MAX_WIDTH,
    MAX_WINDOW_S,
    MAX_ZOOM,
    MIN_WIDTH,
    MIN_WINDOW_S,
    PHASE_STYLE,
    discard_legend_html,
    legend_html,
    render_timeline,
)

ROOT = Path(__file__).resolve().parents[2]
TEMPLATES = ROOT / "templates"
STATIC = Path(__file__).resolve().parent / "static"
NODE_MODULES = ROOT / "node_modules"
PHASE_NAMES = {phase: style[0] for phase, style in PHASE_STYLE.items()}  # as the timeline's legend says
log = logging.getLogger(__name__)

VENDOR = {  # served path -> file installed by `npm ci` (package.json)
    "htmx.min.js": NODE_MODULES / "htmx.org" / "dist" / "htmx.min.js",
    "sse.js": NODE_MODULES / "htmx-ext-sse" / "sse.js",
}
LIVE_BLOCKS = ("summary", "wait", "trainer", "engines", "lanes", "policy")
# The actions a live run offers (stop, publish, the policy form) and Pause's and Resume's answers, sent
# only when the run starts stopping or ends: a swap on every change would clear what an operator is
# typing, or the answer to a pause as the run's state turns paused.
CONTROL_BLOCKS = ("stop_control", "publish_control", "policy_control", "pause_answer")
# Pause or Resume, whichever the run's state offers: sent whenever that state changes (no typed input).
PAUSE_BLOCK = "pause_control"
RUN_BLOCKS = ("timeline", *LIVE_BLOCKS, *CONTROL_BLOCKS, PAUSE_BLOCK)
POLICY_FIELDS = {"max_staleness": "K", "surplus_groups": "S", "agent_gate": "agent gate"}
# As the API takes them; K and S are whole numbers, the agent gate's factor any number in its range
POLICY_MAX = {"max_staleness": MAX_RUN_STALENESS, "surplus_groups": MAX_SURPLUS, "agent_gate": MAX_AGENT_GATE}
POLICY_DECIMALS = ("agent_gate",)
# Paths whose errors stay the API's JSON (or plain text), not a dashboard page.
NOT_PAGES = ("/api/", "/healthz", "/metrics", "/docs", "/openapi.json")
FAVICON = STATIC / "favicon.svg"
Action = Callable[["RunsBackend", dict[str, str]], Awaitable[str]]
# The zoom links go from 1 to 64 in 2× steps; anything else (NaN, inf, 0, negative, over 64) is a 422.
Zoom = Annotated[float, Query(ge=1.0, le=MAX_ZOOM, allow_inf_nan=False)]
# The timeline's width at zoom 1, in pixels: the page sends its box's width, so that the plot fills it.
Width = Annotated[int, Query(ge=MIN_WIDTH, le=MAX_WIDTH)]
# The timeline's window: its last so many seconds (the page offers TIMELINE_WINDOWS); absent, the run.
Window = Annotated[float | None, Query(ge=MIN_WINDOW_S, le=MAX_WINDOW_S, allow_inf_nan=False)]
TIMELINE_WINDOWS = ((None, "whole run"), (300, "last 5 min"), (900, "last 15 min"), (3600, "last hour"))


def make_env() -> Environment:
    env = Environment(loader=FileSystemLoader(TEMPLATES), autoescape=select_autoescape(["html"]))
    env.globals["phase_label"] = PHASE_LABELS.get
    env.filters["secs"] = lambda v: "—" if v is None else f"{v:.1f} s"
    env.filters["pct"] = lambda v: "—" if v is None else f"{v:.0%}"
    env.filters["gate"] = lambda v: "off" if v is None else "0 (open)" if v == 0 else f"{v:g}"
    env.filters["utc"] = lambda v: "—" if v is None else time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime(v))
    return env


@dataclass
class Dashboard:
    access: AccessConfig
    live: RunsBackend | None = None
    replays: ReplayStore = field(default_factory=ReplayStore)
    env: Environment = field(default_factory=make_env)
    stream_interval_s: float = 0.5
    timeline_interval_s: float = 2.0
    default_launch: Mapping[str, Any] = field(default_factory=dict)

    def backends(self) -> list[RunsBackend]:
        return [b for b in (self.live, self.replays) if b is not None]

    def find(self, run_id: str) -> tuple[RunsBackend, RunView] | None:
        """The backend that knows the run, and its view (built once: a build may read the run's stream)."""
        for b in self.backends():
            if (view := b.view(run_id)) is not None:
                return b, view
        return None

    def summaries(self) -> list[RunSummary]:
        """The runs page's rows: counters, never a replay of a run's stream."""
        return [s for b in self.backends() for s in b.summaries()]

    # -- rendering --------------------------------------------------------------------------------

    def render(self, template: str, ctx: dict[str, Any], block: str | None = None) -> str:
        tmpl = self.env.get_template(template)
        if block is None:
            return tmpl.render(ctx)
        return "".join(tmpl.blocks[block](tmpl.new_context(ctx)))

    def page(
        self,
        request: Request,
        template: str,
        ctx: dict[str, Any],
        block: str | None = None,
        status: int = 200,
    ) -> HTMLResponse:
        token = csrf_token(request)
        full = {
            **ctx,
            "csrf": token,
            "csrf_field": CSRF_FIELD,
            "operator": is_operator(request, self.access),
            "view_protected": self.access.view_token is not None,
            # where the header's sign-in form returns to: the page itself, or the page a refusal or
            # a sign-in page names (a POST's own URL is no page to return to)
            "here": _local_path(ctx.get("next") or ctx.get("back") or _here(request)),
        }
        response = HTMLResponse(self.render(template, full, block), status_code=status)
        set_csrf_cookie(response, request, token)
        return response


# -- contexts ---------------------------------------------------------------------------------------


class Lazy:
    """HTML computed only if a template renders it: a block rendered alone skips the others' SVG."""

    def __init__(self, fn: Callable[[], str]) -> None:
        self._fn = fn

    def __html__(self) -> str:
        return self._fn()

    def __str__(self) -> str:
        return self._fn()


def runs_context(dash: Dashboard) -> dict[str, Any]:
    placeholders = getattr(dash.live, "launch_placeholders", None)
    capacity = getattr(dash.live, "capacity", None)
    return {
        "runs": dash.summaries(),
        "launch": dash.default_launch,
        "placeholders": placeholders() if placeholders is not None else {},
        "capacity": capacity() if capacity is not None else None,
        "launch_kind": (getattr(dash.live, "launch_defaults", None) or {}).get("kind"),
    }


def rolling_idle(batches: Sequence[BatchRow], n: int = IDLE_WINDOW_BATCHES) -> list[tuple[float, float]]:
    """At each batch's delivery, the percentage of the time since the `n`-th last batch was asked for
    that the trainer spent waiting for batches (the summary's idle is the whole run's: after S and K
    were cut, batches took twice as long and it moved from 56% to 59%). A view's `trend.idle` holds the
    same points, folded as its batches come."""
    points = []
    for i, x in enumerate(batches):
        window = [(b.requested, b.delivered, b.wait_s) for b in batches[max(0, i - n + 1) : i + 1]]
        if (pct := idle_percent(window)) is not None:
            points.append((x.delivered, pct))
    return points


def duration_chart(view: RunView, empty: str) -> str:
    """How long groups took from admission to completion, in whole seconds, binned: the spread and the
    tail that S has to cover, at a glance (the timeline shows each group, but not how many ran long).
    Groups discarded before they completed are not in it; a long live run's are its latest kept."""
    counts = Counter(
        int(g.ready - g.admitted) for g in view.groups if g.ready is not None and g.admitted is not None
    )
    kept = " (the latest groups kept)" if view.dropped_groups else ""
    return charts.histogram(
        "group time, admission to completion" + kept,
        counts,
        x_label="whole seconds (bar height: groups)",
        empty=empty,
        from_zero=False,
    )


def reward_chart(batches: Sequence[BatchRow] | BatchTrend, empty: str) -> str:
    """Each step's mean reward, its hover with the share of the batch's groups with a learning signal
    (rewards not all equal): a run whose reward climbs towards 1 while that share falls is running out
    of groups to learn from. Steps without rewards (a report from before they were kept) are left out.
    `batches`: the rows, or a view's trend of them."""
    trend = batches if isinstance(batches, BatchTrend) else trend_of(batches)

    def said(bar: Bucket) -> str:
        reward, share = bar.stats
        if bar.n == 1:
            signal = "" if share.mean is None else f"; {share.mean:.0%} of its groups with a learning signal"
            return f"step {bar.first}: mean reward {reward.mean:.3g}{signal}"
        # A bar of several steps: their mean share with a learning signal and the lowest (past 100
        # steps the bars said only their rewards, and the share, the point of the chart, was gone).
        if share.mean is None:
            return ""
        lowest = f"(the lowest step {share.least:.0%})"
        return f"; {share.mean:.0%} of their groups with a learning signal {lowest}"

    return charts.bar_chart(
        "mean reward per step", trend.reward, x_label="trainer step", empty=empty, hover=said
    )


def group_context(view: RunView, group_id: int) -> dict[str, Any] | None:
    """What the group page shows of group `group_id`: its own facts and, attempt by attempt, its
    reward, its time by phase and every span in order (turns with their engine, version and tokens;
    sandbox operations with their lane), when its clean-up ended if after it finished, and for one
    still running, for how long as of the view. None when the view does not hold the group."""
    group = next((g for g in view.groups if g.group_id == group_id), None)
    if group is None:
        return None
    attempts = []
    for _, traj in sorted((key, t) for key, t in view.trajectories.items() if key[0] == group_id):
        spans = sorted(traj.spans, key=lambda x: (x.start, x.end))
        phases: dict[str, float] = {}
        for x in spans:
            phases[x.phase] = phases.get(x.phase, 0.0) + (x.end - x.start)
        started = traj.started if traj.started is not None else min((x.start for x in spans), default=None)
        last = max((x.end for x in spans), default=None)
        attempts.append(
            {
                "traj": traj,
                "started": started,
                "took": None if started is None or traj.finished is None else traj.finished - started,
                # its sandbox's clean-up runs on after it finished: "took" stops at the finish
                "cleaned_up": last
                if traj.finished is not None and last is not None and last > traj.finished
                else None,
                # still running: for how long, as of the view's clock (the page is a snapshot)
                "running_s": None
                if traj.finished is not None or traj.error or started is None
                else view.now - started,
                "turns": sum(1 for x in spans if x.phase == "model_turn"),
                "versions": [v for _, v in traj.versions],
                "phases": sorted(phases.items(), key=lambda kv: -kv[1]),
                "spans": spans,
            }
        )
    return {"view": view, "group": group, "attempts": attempts, "phase_names": PHASE_NAMES}


def run_context(
    view: RunView, zoom: float = 1.0, width: int = BASE_WIDTH, window: float | None = None
) -> dict[str, Any]:
    trend = view.trend
    attribution = view.attribution
    engines_versions = [e.version for e in view.engines]
    # a drained engine loads no version until it is returned: the progress counts the others
    in_rotation = [e for e in view.engines if e.state != "draining"]
    # the newest version published, or loaded (a replay without its event log knows only the latter)
    target = max([e.target_version or 0 for e in view.engines] + engines_versions + [view.newest_version])
    refused_by = view.refused
    # an ended run or a replay brings no more data: what is missing is not "yet" to come
    ended = view.outcome is not None or view.source == "replay"
    empty = "not in this report" if view.source == "replay" else "no data" if ended else "no data yet"
    return {
        "view": view,
        "ended": ended,
        "zoom": zoom,
        "window": window,
        "windows": TIMELINE_WINDOWS,
        "timeline": Lazy(lambda: render_timeline(view, zoom, width, window_s=window)),
        "legend": Lazy(lambda: legend_html(None if view.detailed else ("group_running", "group_ready"))),
        "discard_legend": Lazy(lambda: discard_legend_html([g.outcome for g in view.groups if g.discarded])),
        "collection_chart": Lazy(
            lambda: charts.bar_chart(
                "batch collection time per step",
                trend.collection,
                unit=" s",
                reference=view.lower_bound_s,
                reference_label=f"lower bound {view.lower_bound_s:.1f} s"
                if view.lower_bound_s is not None
                else "",
                x_label="trainer step",
                empty=empty,
            )
        ),
        "tokens_chart": Lazy(
            lambda: charts.bar_chart("tokens/s per step", trend.tokens, x_label="trainer step", empty=empty)
        ),
        "idle_chart": Lazy(
            lambda: charts.line_chart(
                f"trainer idle fraction, last {IDLE_WINDOW_BATCHES} batches",
                trend.idle,
                "%",
                top=100.0,
                x_label="run time at each batch",
                empty=empty,
                items="batches",
            )
        ),
        "reward_chart": Lazy(lambda: reward_chart(trend, empty)),
        "duration_chart": Lazy(lambda: duration_chart(view, empty)),
        "staleness_chart": Lazy(
            lambda: charts.histogram(
                "staleness of delivered groups",
                view.staleness,
                x_label="versions behind (bar height: groups)",
                empty=empty,
            )
        ),
        "wait_bar": Lazy(lambda: charts.phase_bar(attribution.phases) if attribution else ""),
        "wait_ranked": attribution.ranked() if attribution else [],
        "wait_total": attribution.total_s if attribution else 0.0,
        "wait_summary": attribution.summary() if attribution else "",
        "wait_batches": list(attribution.batches)[-12:][::-1] if attribution else [],
        "publish_target": target,
        "in_rotation": in_rotation,
        "drained": [e.name for e in view.engines if e.state == "draining"],
        "engines_done": sum(1 for e in in_rotation if e.version >= target),
        "engines_refused": sum(1 for e in in_rotation if e.version < target <= refused_by.get(e.name, -1)),
        "refused_by": refused_by,
        "policy_fields": POLICY_FIELDS,
    }


# -- the router -----------------------------------------------------------------------------------------


def _note(message: str, status: int) -> HTMLResponse:
    """An action's answer to htmx: one line for the form's message area (errors as alerts)."""
    level, role = ("error", "alert") if status >= 400 else ("info", "status")
    return HTMLResponse(f'<p class="flash {level}" role="{role}">{escape(message)}</p>', status_code=status)


def _error(
    dash: Dashboard, request: Request, message: str, status: int, back: str | None = None
) -> HTMLResponse:
    """A refusal: a line for htmx, else a page linking `back` to the run it is about (or the runs)."""
    if _is_htmx(request):
        return _note(message, status)
    ctx = {"message": message, "level": "error", "back": back}
    return dash.page(request, "message.html", ctx, status=status)


def _forbidden(dash: Dashboard, request: Request, why: str, back: str | None = None) -> HTMLResponse:
    return _error(dash, request, why, 403, back)


def _shown(text: str) -> str:
    """`text` as a page may show it: control characters (a NUL typed into a URL) as Python escapes."""
    return "".join(c if c.isprintable() else repr(c)[1:-1] for c in text)


def _is_htmx(request: Request) -> bool:
    return request.headers.get("hx-request") == "true"


async def _form(request: Request) -> dict[str, str]:
    async with request.form() as form:
        return {k: v for k, v in form.items() if isinstance(v, str)}


def make_router(dash: Dashboard) -> APIRouter:
    router = APIRouter(include_in_schema=False)

    def guard_view(request: Request) -> HTMLResponse | None:
        if can_view(request, dash.access):
            return None
        return dash.page(request, "login.html", {"next": _here(request)}, status=401)

    async def guard_act(
        request: Request, back: str | None = None
    ) -> tuple[dict[str, str], HTMLResponse | None]:
        form = await _form(request)
        if not csrf_ok(request, form.get(CSRF_FIELD)):
            why = "refused: the form's CSRF token is missing or wrong"
            return form, _forbidden(dash, request, why, back)
        if not is_operator(request, dash.access):
            return form, _forbidden(dash, request, "refused: acting needs the operator token (sign in)", back)
        return form, None

    Found = tuple[RunsBackend, RunView] | HTMLResponse

    def run_or_404(request: Request, run_id: str) -> Found:
        found = dash.find(run_id)
        if found is None:
            return _error(dash, request, f"no run {_shown(run_id)}", 404)
        return found

    async def run_or_404_off_loop(request: Request, run_id: str) -> Found:
        """`run_or_404` for an `async` route, in a worker thread: building a run's view folds its new
        events and may read the store (which, on SQLite, waits for another process's write lock), and on
        the event loop every other request waited with it."""
        return await asyncio.to_thread(run_or_404, request, run_id)

    # The pages are plain `def`s: FastAPI runs them in its threadpool, so building and rendering a
    # large run's view never holds up the event loop (the backends are thread-safe).
    @router.get("/", response_class=HTMLResponse)
    def runs_page(request: Request) -> Response:
        if (denied := guard_view(request)) is not None:
            return denied
        block = "runs" if _is_htmx(request) else None
        return dash.page(request, "runs.html", runs_context(dash), block)

    @router.get("/runs/{run_id}", response_class=HTMLResponse)
    def run_page(
        request: Request, run_id: str, zoom: Zoom = 1.0, width: Width = BASE_WIDTH, window: Window = None
    ) -> Response:
        if (denied := guard_view(request)) is not None:
            return denied
        found = run_or_404(request, run_id)
        if isinstance(found, HTMLResponse):
            return found
        return dash.page(request, "run.html", run_context(found[1], zoom, width, window))

    @router.get("/runs/{run_id}/groups/{group_id}", response_class=HTMLResponse)
    def group_page(request: Request, run_id: str, group_id: str) -> Response:
        """One group, attempt by attempt: every turn and sandbox operation in order, with its times."""
        if (denied := guard_view(request)) is not None:
            return denied
        found = run_or_404(request, run_id)
        if isinstance(found, HTMLResponse):
            return found
        view, back = found[1], f"/runs/{quote(run_id, safe='')}"
        gid: int | None = None
        try:
            gid = parse_int(group_id, signed=False)
        except ValueError:
            # a whole number of more digits than Python converts is no group either, not a bad number
            if not (group_id.isascii() and group_id.isdigit()):
                return _error(
                    dash, request, f"no group {_shown(group_id)}: a group is a whole number", 404, back
                )
        ctx = group_context(view, gid) if gid is not None else None
        if ctx is None:
            why = f"run {_shown(run_id)} has no group {group_id}"
            if view.dropped_groups:
                why += (
                    f" on this page, which keeps the latest ended groups (groups no longer kept: "
                    f"{view.dropped_groups:,}); GET /api/runs/{_shown(run_id)}/timeline has every event"
                )
            return _error(dash, request, why, 404, back)
        return dash.page(request, "group.html", ctx)

    @router.get("/runs/{run_id}/block/{name}", response_class=HTMLResponse)
    def run_block(
        request: Request,
        run_id: str,
        name: str,
        zoom: Zoom = 1.0,
        width: Width = BASE_WIDTH,
        window: Window = None,
    ) -> Response:
        if (denied := guard_view(request)) is not None:
            return denied
        if name not in RUN_BLOCKS:
            return _error(dash, request, f"no block {_shown(name)}", 404)
        found = run_or_404(request, run_id)
        if isinstance(found, HTMLResponse):
            return found
        return dash.page(request, "run.html", run_context(found[1], zoom, width, window), name)

    @router.get("/runs/{run_id}/stream")
    async def run_stream(request: Request, run_id: str) -> Response:
        if (denied := guard_view(request)) is not None:
            return denied
        found = await run_or_404_off_loop(request, run_id)
        if isinstance(found, HTMLResponse):
            return found
        backend = found[0]
        # The outcome, whether it was stopping and whether it was being resumed (no controls until it
        # executes) that the page's controls were last rendered for, and the state its Pause / Resume
        # control was
        shown: list[tuple[str | None, bool, bool]] = [(None, False, False)]
        paused_shown: list[tuple[str | None, str, bool] | None] = [None]

        def blocks() -> list[tuple[str, str]]:
            view = backend.view(run_id)
            if view is None:  # deleted while its page is open: it read "completed" with no word of it
                return [("summary", RUN_GONE.format(escape(run_id)))]
            ctx = {**run_context(view), "csrf": csrf_token(request), "csrf_field": CSRF_FIELD}
            ctx["operator"] = is_operator(request, dash.access)
            names: tuple[str, ...] = LIVE_BLOCKS
            resuming = view.resume_note is not None
            controls = (view.outcome, view.state == "stopping", resuming)
            if controls != shown[0]:
                shown[0] = controls
                names = (*names, *CONTROL_BLOCKS)
            if (view.outcome, view.state, resuming) != paused_shown[0]:
                paused_shown[0] = (view.outcome, view.state, resuming)
                names = (*names, PAUSE_BLOCK)
            return [(b, dash.render("run.html", ctx, b)) for b in names]

        def version() -> object:
            return backend.version(run_id)

        feeds = [
            Feed(version, blocks),
            # A trigger only: the page fetches the timeline at its own zoom. The timeline is the
            # heaviest block, so it follows the run at most every `timeline_interval_s`.
            Feed(version, lambda: [("timeline", "")], dash.timeline_interval_s),
        ]
        return _live_stream(request, feeds, dash.stream_interval_s)

    @router.get("/stream")
    async def runs_stream(request: Request) -> Response:
        if (denied := guard_view(request)) is not None:
            return denied

        # The rows the list shows are its key: a run's `version` would catch its view up with its stream.
        def key() -> str:
            return repr(dash.summaries())

        def blocks() -> list[tuple[str, str]]:
            ctx = {**runs_context(dash), "csrf": csrf_token(request), "csrf_field": CSRF_FIELD}
            return [("runs", dash.render("runs.html", ctx, "runs"))]

        return _live_stream(request, [Feed(key, blocks)], dash.stream_interval_s)

    @router.get("/login", response_class=HTMLResponse)
    def login_page(request: Request) -> Response:
        # Open to anyone, as the page a closed dashboard shows: it is where a typed-in URL signs in.
        return dash.page(request, "login.html", {"next": _local_path(request.query_params.get("next"))})

    @router.post("/login")
    async def login(request: Request) -> Response:
        form = await _form(request)
        if not csrf_ok(request, form.get(CSRF_FIELD)):
            return _forbidden(dash, request, "refused: the form's CSRF token is missing or wrong")
        token = form.get("token", "")
        known = [t for t in (dash.access.operator_token, dash.access.view_token) if t]
        if not any(_eq(token, t) for t in known):
            ctx = {"next": _local_path(form.get("next")), "error": "unknown token"}
            return dash.page(request, "login.html", ctx, status=403)
        response = RedirectResponse(_local_path(form.get("next")), 303)
        set_token_cookie(response, request, token)
        return response

    @router.post("/logout")
    async def logout(request: Request) -> Response:
        form = await _form(request)
        if not csrf_ok(request, form.get(CSRF_FIELD)):
            return _forbidden(dash, request, "refused: the form's CSRF token is missing or wrong")
        response = RedirectResponse("/", 303)
        response.delete_cookie("corral_token")
        return response

    @router.post("/runs")
    async def launch(request: Request) -> Response:
        form, denied = await guard_act(request)
        if denied is not None:
            return denied
        if dash.live is None:
            return _forbidden(dash, request, "this server has no run manager; only replays can be browsed")
        try:
            run_id = await dash.live.launch(form, actor="operator")
        except (ValueError, ActionRefused) as exc:
            # 422 for a field; an ActionRefused's own status (429: the server executes its limit of runs)
            status = exc.status if isinstance(exc, ActionRefused) else 422
            ctx = {**runs_context(dash), "launch_error": str(exc), "launch": form}
            page = "launch" if _is_htmx(request) else None
            return dash.page(request, "runs.html", ctx, page, status=status)
        if _is_htmx(request):
            response = Response(status_code=204)
            response.headers["HX-Redirect"] = f"/runs/{run_id}"
            return response
        return RedirectResponse(f"/runs/{run_id}", 303)

    @router.post("/replays")
    async def load_replay(request: Request) -> Response:
        async with request.form(max_part_size=MAX_REPORT_BYTES) as form:
            submitted = form.get(CSRF_FIELD)
            if not csrf_ok(request, submitted if isinstance(submitted, str) else None):
                return _forbidden(dash, request, "refused: the form's CSRF token is missing or wrong")
            if not is_operator(request, dash.access):
                return _forbidden(
                    dash, request, "refused: loading a replay needs the operator token (sign in)"
                )
            upload = form.get("report")
            if upload is None or isinstance(upload, str):
                return _error(dash, request, "report: choose a JSON file", 422)
            data = await upload.read(MAX_REPORT_BYTES + 1)
            name = upload.filename or "report.json"
        try:
            run_id = dash.replays.add_json(data, name)
        except ReportError as exc:
            return _error(dash, request, str(exc), 422)
        return RedirectResponse(f"/runs/{run_id}", 303)

    async def act(request: Request, run_id: str, do: Action) -> Response:
        run_page = f"/runs/{quote(run_id, safe='')}"
        form, denied = await guard_act(request, run_page)
        if denied is not None:
            return denied
        found = await run_or_404_off_loop(request, run_id)
        if isinstance(found, HTMLResponse):
            return found
        backend = found[0]
        status = 200
        try:
            message = await do(backend, form)
        except ActionRefused as exc:
            message, status = (f"refused: {exc}" if exc.status == 409 else str(exc)), exc.status
        except ValueError as exc:
            message, status = str(exc), 422
        if not _is_htmx(request):
            if status != 200:
                return _error(dash, request, message, status, run_page)
            return RedirectResponse(run_page, 303)
        return _note(message, status)

    # The run controls that take no form field: the route's last segment, the backend's call, and what
    # the page says once it is done.
    Call = Callable[[RunsBackend, str], Awaitable[None]]
    controls: dict[str, tuple[Call, str]] = {
        "publish": (
            lambda backend, run_id: backend.publish(run_id, "operator"),
            "Publishing new weights: a rolling update, a few engines at a time (the Engines table shows "
            "each one's version).",
        ),
        "pause": (
            lambda backend, run_id: backend.pause(run_id, "operator"),
            "Paused: no turn starts and no update begins until it is resumed.",
        ),
        "resume": (lambda backend, run_id: backend.resume(run_id, "operator"), "Resumed."),
        "stop": (
            lambda backend, run_id: backend.stop(run_id, "operator"),
            "Stopping after the current trainer step.",
        ),
    }

    def control(call: Call, said: str) -> Callable[[Request, str], Awaitable[Response]]:
        async def route(request: Request, run_id: str) -> Response:
            async def do(backend: RunsBackend, form: dict[str, str]) -> str:
                await call(backend, run_id)
                return said

            return await act(request, run_id, do)

        return route

    for name, (call, said) in controls.items():
        router.add_api_route(f"/runs/{{run_id}}/{name}", control(call, said), methods=["POST"], name=name)

    @router.post("/runs/{run_id}/engines/{engine}/{move}")
    async def rotation(request: Request, run_id: str, engine: str, move: str) -> Response:
        """Take an engine out of rotation (`drain`: no new turn or update on it; its turns in flight
        finish) or put it back (`serve`: a rolling update brings it to the newest version)."""
        if move not in ("drain", "serve"):
            return _error(dash, request, f"no action {move!r} on an engine; drain or serve", 404)

        async def do(backend: RunsBackend, form: dict[str, str]) -> str:
            await backend.rotate(run_id, engine, move == "serve", "operator")
            if move == "serve":
                return f"{engine} is back in rotation; a rolling update brings it to the newest version."
            return f"{engine} is out of rotation: no new turn or update on it; its turns in flight finish."

        return await act(request, run_id, do)

    @router.post("/runs/{run_id}/policy")
    async def policy(request: Request, run_id: str) -> Response:
        async def change(backend: RunsBackend, form: dict[str, str]) -> str:
            changes = parse_policy_form(form)
            found = await run_or_404_off_loop(request, run_id)
            large = form.get("large") == "1"
            if not large and not isinstance(found, HTMLResponse):
                why = large_change(found[1].policy, changes)
                if why is not None:
                    raise ValueError(why)
            await backend.set_policy(run_id, changes, "operator", large)
            return "Applied " + ", ".join(f"{POLICY_FIELDS[k]} = {v:g}" for k, v in changes.items()) + "."

        return await act(request, run_id, change)

    return router


def _local_path(target: str | None) -> str:
    """`target` when it is a path on this site, else "/": a sign-in never redirects off site (browsers
    drop tabs and newlines from a URL: "/", a tab, "/evil.example" would be "//evil.example")."""
    if not target or not target.startswith("/") or not target.isprintable():
        return "/"
    return "/" if "//" in target or "\\" in target else target


def _here(request: Request) -> str:
    """The page a GET request shows, query included; "/" for any other request."""
    if request.method != "GET":
        return "/"
    query = request.url.query
    return request.url.path + (f"?{query}" if query else "")


def _eq(a: str, b: str) -> bool:
    import hmac

    return hmac.compare_digest(a.encode(), b.encode())


# What a run's page shows in place of its figures once the run is deleted while the page is open
RUN_GONE = (
    '<p class="flash error" id="run-gone" role="alert">Run {} was deleted: it is no longer in this '
    'server\'s database, and this page no longer follows it. <a href="/">All runs</a></p>'
)


def large_change(policy: Mapping[str, Any], changes: Mapping[str, float]) -> str | None:
    """Why a live change of S needs the form's "a large change" ticked (`large_surplus_change`); None
    for any other change, and on a run whose B, G and S the page does not know."""
    b, g, s = (policy.get(k) for k in ("groups_per_batch", "group_size", "surplus_groups"))
    wanted = changes.get("surplus_groups")
    if wanted is None or not (isinstance(b, int) and isinstance(g, int) and isinstance(s, int)):
        return None
    return large_surplus_change(b, g, s, int(wanted), "tick \u201ca large change\u201d and apply again")


def parse_policy_form(form: Mapping[str, str]) -> dict[str, float]:
    """K and S (whole numbers ≥ 0) and the agent gate's factor (a number ≥ 0) from the policy form;
    empty fields are left unchanged, and so is a field still showing what the page showed in it
    (`<name>_shown`): the form is filled in with the policy as the page loaded, and sent whole it set
    K, S and the gate back to those values, undoing a change made since (the API's, another page's)."""
    changes: dict[str, float] = {}
    for name, short in POLICY_FIELDS.items():
        raw = form.get(name, "").strip()
        if not raw or raw == form.get(f"{name}_shown", "").strip():
            continue
        decimal = name in POLICY_DECIMALS
        try:
            value = parse_decimal(raw) if decimal else parse_int(raw)
        except ValueError:
            expected = "a number" if decimal else "a whole number"
            raise ValueError(f"{name} ({short}): expected {expected}, got {raw!r}") from None
        if not 0 <= value <= POLICY_MAX[name]:
            got = raw if decimal else f"{value:,}"
            raise ValueError(f"{name} ({short}): must be between 0 and {POLICY_MAX[name]:,}, got {got}")
        changes[name] = value + 0  # -0.0 becomes 0.0: it was applied and shown as "-0"
    if not changes:
        raise ValueError("policy: set K, S or the agent gate (a field left as it shows is no change)")
    return changes


@dataclass
class Feed:
    """Named blocks sent when `key()` has changed, at most every `min_interval_s` (the last change is
    always sent: a change held back by the interval goes out once the interval has passed)."""

    key: Callable[[], object]
    blocks: Callable[[], list[tuple[str, str]]]
    min_interval_s: float = 0.0
    last: object = None
    sent_at: float = float("-inf")


class _Client(Protocol):
    async def is_disconnected(self) -> bool: ...


# How long a live stream may take to end on its own once the server stops, before it is cut off. Cut off,
# it ends without its last message and uvicorn logs "ASGI callable returned without completing response".
STREAM_STOP_GRACE_S = 5.0


def _live_stream(request: _Client, feeds: list[Feed], interval_s: float) -> Response:
    """A page's live stream, which ends cleanly when the server stops (sse-starlette sets `stopping`)."""
    stopping = anyio.Event()
    changes = _changes(request, feeds, interval_s, stopping)
    return EventSourceResponse(changes, shutdown_event=stopping, shutdown_grace_period=STREAM_STOP_GRACE_S)


async def _changes(
    request: _Client, feeds: list[Feed], interval_s: float, stopping: anyio.Event | None = None
) -> AsyncIterator[dict[str, str]]:
    """The live stream: every `interval_s`, each feed's blocks if due; until the client goes or the
    server stops. Keys and blocks are computed in a worker thread, off the event loop."""
    loop = asyncio.get_running_loop()
    if stopping is None:
        stopping = anyio.Event()
    away = False  # the database was away at the last look
    while not stopping.is_set() and not await request.is_disconnected():
        for feed in feeds:
            try:
                current = await asyncio.to_thread(feed.key)
                if current == feed.last or loop.time() - feed.sent_at < feed.min_interval_s:
                    continue
                blocks = await asyncio.to_thread(feed.blocks)
            except Exception as exc:
                # A database away or locked ended the stream with a traceback (an "Exception in ASGI
                # application" at each of the page's reconnections): it is looked at again next time.
                from app.store.db import is_outage, outage_kind, outage_reason  # a replay needs no store

                if not is_outage(exc):
                    raise
                if not away:
                    log.warning("a page's live stream: the database is %s (%s); it goes on once the "
                                "database answers", outage_kind(exc), outage_reason(exc))  # fmt: skip
                away = True
                break
            away = False
            feed.last, feed.sent_at = current, loop.time()
            for name, html in blocks:
                yield {"event": name, "data": html}
        with anyio.move_on_after(interval_s):
            await stopping.wait()


def dashboard_for(settings: Any, get_manager: Callable[[], Any], channel: Any = None) -> Dashboard:
    """The dashboard of `corral serve`: the settings' tokens, live runs from the run manager, and the
    celery runs' orchestrator workers reached through `channel` (app.service.channel; None: no broker)."""
    from app.web.live import ManagerRuns

    access = AccessConfig(settings.operator_token, settings.view_token)
    return Dashboard(access, live=ManagerRuns(get_manager, channel=channel))


def mount_dashboard(app: FastAPI, dash: Dashboard) -> None:
    """Add the dashboard's routes, its static files and the npm-installed vendor scripts to `app`."""
    app.include_router(make_router(dash))
    app.state.dashboard = dash  # its pages' own error answers are pages too (app.api.app)
    app.mount("/static", StaticFiles(directory=STATIC), name="dashboard-static")

    @app.get("/favicon.ico", include_in_schema=False)
    async def favicon() -> Response:
        # The pages link their icon; this answers a client that asks for it by the old name.
        headers = {"Cache-Control": "max-age=86400"}
        return Response(FAVICON.read_bytes(), media_type="image/svg+xml", headers=headers)

    @app.get("/vendor/{name}", include_in_schema=False)
    async def vendor(name: str) -> Response:
        path = VENDOR.get(name)
        if path is None or not path.is_file():
            missing = "run `npm ci` (make install does) to install htmx" if path is not None else "unknown"
            return Response(f"{name}: {missing}", status_code=404, media_type="text/plain")
        headers = {"Cache-Control": "max-age=3600"}
        return Response(path.read_bytes(), media_type="text/javascript", headers=headers)


def error_page(request: Request, message: str, status: int) -> HTMLResponse | None:
    """A dashboard page's refusal as a page (a bad `?zoom=` typed into the address bar showed raw
    JSON), or None for a request that is not a dashboard page's: the API's, and anything without a
    dashboard mounted."""
    dash = getattr(request.app.state, "dashboard", None)
    if not isinstance(dash, Dashboard) or request.url.path.startswith(NOT_PAGES):
        return None
    return _error(dash, request, _shown(message), status)
