"""uvicorn's server as `corral serve` runs it: a stop signal, however often it comes, stops the runs cleanly.

uvicorn takes a second Ctrl-C as "force quit": it stops waiting for open requests and skips the
application's shutdown. Corral's application stops its runs and flushes their events in that shutdown,
so the runs were then stopped only by the cancellation of every task as the event loop closed, under
uvicorn's lifespan traceback, and open requests were cut off mid-answer. Two Ctrl-Cs within uvicorn's
0.1 s tick were enough. And uvicorn, once stopped, raised each captured signal again.

Here every stop signal means the same graceful stop:
- the first sets `should_exit` (uvicorn stops accepting and waits for open requests) and calls
  `on_stop`, which tells the requests that wait on the run to end now: a trainer's long-poll answers
  503 (app.api.runs), and a page's live stream ends (sse-starlette sees `should_exit`);
- a later one only says the server is already stopping;
- open requests get `STOP_WAIT_S` to end before uvicorn cancels them, then the application's shutdown
  runs, bounded by its own limits;
- the captured signals are not raised again: `corral serve` says what became of its runs, exit 0.
"""

from __future__ import annotations

import asyncio
import contextlib
import signal
import threading
from typing import TYPE_CHECKING, Any

import uvicorn

from app.cli.common import say

if TYPE_CHECKING:
    from collections.abc import Callable, Iterator
    from types import FrameType

STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM)
STOP_WAIT_S = 10  # how long open requests may take to end once the server stops


class GracefulServer(uvicorn.Server):
    def __init__(self, app: Any, on_stop: Callable[[], None] | None = None, **config: Any) -> None:
        super().__init__(uvicorn.Config(app, timeout_graceful_shutdown=STOP_WAIT_S, **config))
        self.on_stop = on_stop
        self._loop: asyncio.AbstractEventLoop | None = None

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        first = not self.should_exit
        self.should_exit = True
        if self._loop is None:
            return
        # Not printed here: a signal handler may interrupt a write to the same stream.
        if first:
            self._loop.call_soon_threadsafe(self._stopping)
        else:
            self._loop.call_soon_threadsafe(say, "corral serve: already stopping; each run is being stopped")

    def _stopping(self) -> None:
        say("corral serve: stopping: open requests end, then each run is stopped and its events flushed")
        if self.on_stop is not None:
            self.on_stop()

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        if threading.current_thread() is not threading.main_thread():
            yield
            return
        self._loop = asyncio.get_running_loop()
        # A bound method of the server on SIGTERM: sse-starlette finds the server there and ends its
        # streams once `should_exit` is set.
        previous = {sig: signal.signal(sig, self.handle_exit) for sig in STOP_SIGNALS}
        try:
            yield
        finally:
            for sig, handler in previous.items():
                signal.signal(sig, handler)
