"""uvicorn's server as `corral serve` runs it: a stop signal, however often it comes, stops the runs cleanly.

uvicorn takes a second Ctrl-C as "force quit": it stops waiting for open requests and skips the
application's shutdown. Corral's application stops its runs and flushes their events in that shutdown,
so the runs were then stopped only by the cancellation of every task as the event loop closed, under
uvicorn's lifespan traceback, and open requests were cut off mid-answer. Two Ctrl-Cs within uvicorn's
0.1 s tick were enough. And uvicorn, once stopped, raised each captured signal again.

Here:
- the first stop signal sets `should_exit` (uvicorn stops accepting and waits for open requests) and
  calls `on_stop`, which tells the requests that wait on the run to end now: a trainer's long-poll
  answers 503 (app.api.runs), and a page's live stream ends (sse-starlette sees `should_exit`);
- open requests get `STOP_WAIT_S` to end before uvicorn cancels them, then the application's shutdown
  runs, bounded by its own limits (app.service.manager's `SHUTDOWN_BOUND_S`);
- a second one calls `on_force`: the application's shutdown stops waiting (for the runs to stop, their
  last events, the store writer's last writes) and returns at once; the runs not yet stopped are left
  as the store has them and are resumed at the next start. The requests still open are cut off (their
  tasks cancelled, each said in one line, not uvicorn's traceback): uvicorn went on waiting for them
  for the rest of `STOP_WAIT_S` (a client sending its body slowly held the exit for the whole 10 s).
  The application's shutdown still runs (it keeps the offer files of batches handed out): it is not
  uvicorn's "force quit";
- a request cut off, at the end of `STOP_WAIT_S` or by a second stop signal, before its answer began is
  answered 503 with `Retry-After` and a JSON `detail`, as the API's other refusals are (`AnswerCutOff`),
  not uvicorn's plain-text 500; its task's cancellation goes on;
- the captured signals are not raised again: `corral serve` says what became of its runs, exit 0.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal
import threading
from typing import TYPE_CHECKING, Any

import uvicorn
from starlette.responses import Response

from app.api.body_limit import Message, Receive, Scope, Send, send_problem
from app.cli.common import say

if TYPE_CHECKING:
    from collections.abc import Callable, Iterator
    from types import FrameType

STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM)
STOP_WAIT_S = 10  # how long open requests may take to end once the server stops
CUT_OFF = "cut off by a second stop signal"  # the cancel message of a request cut off
CUT_OFF_AFTER_S = 1.0  # after a second stop signal, the requests still open this much later are cut off


# The cancel message of the requests uvicorn cuts off once `STOP_WAIT_S` is over (it says so in one
# line of its own, "Cancel N running task(s), timeout graceful shutdown exceeded")
GRACE_OVER = "Task cancelled, timeout graceful shutdown exceeded"


class _QuietCutOff(logging.Filter):
    """uvicorn logs a request task's cancellation as "Exception in ASGI application" with a traceback;
    one this server cut off (`CUT_OFF`), or uvicorn at the end of the requests' grace (`GRACE_OVER`),
    was said in one line already."""

    def filter(self, record: logging.LogRecord) -> bool:
        exc = record.exc_info[1] if record.exc_info else None
        return not (isinstance(exc, asyncio.CancelledError) and {CUT_OFF, GRACE_OVER} & set(exc.args))


_QUIET_CUT_OFF = _QuietCutOff()

_WHY_CUT_OFF = {
    GRACE_OVER: f"cut off at the end of the {STOP_WAIT_S} s open requests get",
    CUT_OFF: "cut off by a second stop signal",
}


class AnswerCutOff:
    """ASGI middleware: a request whose task is cut off (`GRACE_OVER`, `CUT_OFF`) before its answer began
    gets a 503 with `Retry-After`, as a create refused once the server is stopping does; uvicorn sent
    its plain-text 500, "Internal Server Error", which a client read as a fault of the server (a cut-off
    create stores its run stopped, never started: app.service.manager). The cancellation is raised on;
    uvicorn closes the connection once the answer is written. A dashboard page's request gets a page
    saying the same (`page`, given the request's scope and the detail; None for the API's): a launch from
    the dashboard cut off showed the JSON."""

    def __init__(
        self, app: Callable[..., Any], page: Callable[[Scope, str], Response | None] | None = None
    ) -> None:
        self.app = app
        self.page = page

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        started = False

        async def sending(message: Message) -> None:
            nonlocal started
            started = started or message["type"] == "http.response.start"
            await send(message)

        try:
            await self.app(scope, receive, sending)
        except asyncio.CancelledError as exc:
            why = next((_WHY_CUT_OFF[arg] for arg in exc.args if arg in _WHY_CUT_OFF), None)
            if why is not None and not started:
                detail = f"corral serve is stopping: this request was {why}; send it again once it is back"
                page = None if self.page is None else self.page(scope, detail)
                if page is None:
                    await send_problem(send, 503, detail, {"retry-after": "5"})
                else:
                    page.headers["retry-after"] = "5"
                    await page(scope, receive, send)  # type: ignore[arg-type]  # ASGI's Send, typed apart
            raise


@contextlib.contextmanager
def held_stops() -> Iterator[list[int]]:
    """Hold the stop signals that come in the block, in the list it yields, for a `GracefulServer` to act
    on once it runs (`early`). `corral serve` builds its application (and its demo run) before the
    server starts: a Ctrl-C meanwhile was a KeyboardInterrupt there, "interrupted", exit 130, at times
    with a "coroutine 'Server.serve' was never awaited" warning, where a moment later it was a clean
    stop. SIGHUP reaches the holder through SIGINT's handler (`app.cli.common.sigterm_as_ctrl_c`)."""
    held: list[int] = []

    def hold(signum: int, frame: FrameType | None) -> None:
        held.append(signum)

    previous = {sig: signal.signal(sig, hold) for sig in STOP_SIGNALS}
    try:
        yield held
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


class GracefulServer(uvicorn.Server):
    def __init__(
        self,
        app: Any,
        on_stop: Callable[[], None] | None = None,
        on_force: Callable[[], None] | None = None,
        early: list[int] | None = None,
        keep_runs: bool = False,
        **config: Any,
    ) -> None:
        super().__init__(uvicorn.Config(app, timeout_graceful_shutdown=STOP_WAIT_S, **config))
        logging.getLogger("uvicorn.error").addFilter(_QUIET_CUT_OFF)  # once, however many servers
        self.on_stop = on_stop
        self.on_force = on_force
        self.keep_runs = keep_runs  # CORRAL_RUNS_ON_SHUTDOWN=resume: the runs are left to the next start
        self.forced = False  # a second stop signal came: the shutdown stops waiting
        self._loop: asyncio.AbstractEventLoop | None = None
        self._early = early if early is not None else []  # stop signals held before it ran (`held_stops`)

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        first = not self.should_exit
        self.should_exit = True
        if self._loop is None:
            return
        # Not printed here: a signal handler may interrupt a write to the same stream.
        if first:
            self._loop.call_soon_threadsafe(self._stopping)
        elif not self.forced:
            self.forced = True
            self._loop.call_soon_threadsafe(self._forcing)

    def _stopping(self) -> None:
        then = (
            "each run's events are stored and it is left to the next start, which resumes it"
            if self.keep_runs
            else "each run is stopped and its events flushed"
        )
        say(f"corral serve: stopping: open requests end, then {then} (Ctrl-C again to stop at once)")
        if self.on_stop is not None:
            self.on_stop()

    def _forcing(self) -> None:
        say(
            "corral serve: stopping at once: runs not yet stopped are left as stored, and resumed at the "
            "next start"
        )
        if self.on_force is not None:
            self.on_force()
        # Live streams end by themselves once the server stops (sse-starlette sees `should_exit`): given
        # a moment, they close cleanly rather than cut off mid-message
        asyncio.get_running_loop().call_later(CUT_OFF_AFTER_S, self._cut_off)

    def _cut_off(self) -> None:
        open_requests = [t for t in self.server_state.tasks if not t.done()]
        if open_requests:
            say(f"corral serve: {len(open_requests)} open request(s) cut off")
            for task in open_requests:
                task.cancel(msg=CUT_OFF)

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        if threading.current_thread() is not threading.main_thread():
            yield
            return
        self._loop = asyncio.get_running_loop()
        # A bound method of the server on SIGTERM: sse-starlette finds the server there and ends its
        # streams once `should_exit` is set.
        previous = {sig: signal.signal(sig, self.handle_exit) for sig in STOP_SIGNALS}
        # Held as the application was built: one of them acts as if it came now. Only one: a second,
        # taken as "stop at once", found no runs' manager yet to abandon, and since the server counts
        # one force only, no later press could cut the graceful stop short.
        if self._early:
            self.handle_exit(self._early[0], None)
        self._early.clear()
        try:
            yield
        finally:
            for sig, handler in previous.items():
                signal.signal(sig, handler)
