"""Child processes that do not outlive their parent.

Invariant: a process that calls `die_with_parent` gets SIGTERM when the thread that started it ends,
however that happens (SIGKILL included), so an engine, a fault helper or a simulation worker is never
left orphaned. Linux only (prctl PR_SET_PDEATHSIG); elsewhere it does nothing.
"""

from __future__ import annotations

import ctypes
import os
import signal
import sys
from collections.abc import Callable, Hashable, Iterable
from typing import Any, TypeVar

K = TypeVar("K", bound=Hashable)
R = TypeVar("R")

_PR_SET_PDEATHSIG = 1


def die_with_parent() -> None:
    """In the child (before exec, or in a worker's initializer): SIGTERM when the parent thread ends.
    Call it from a child whose parent is a long-lived thread: the signal follows the forking thread, not
    the parent process."""
    if sys.platform.startswith("linux"):
        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)


def quiet_worker() -> None:
    """A simulation worker's initializer (`ProcessPoolExecutor(initializer=quiet_worker)`): Ctrl-C, or
    the terminal hanging up (SIGHUP), both sent to the whole process group, end the worker at once and
    quietly, where each worker used to print its own KeyboardInterrupt traceback; the parent gets the
    same signal and says what happened. The worker also ends with its parent (`die_with_parent`): a
    SIGTERM or SIGKILL to the parent alone used to leave the workers running for minutes."""
    for sig in (signal.SIGINT, signal.SIGHUP):
        signal.signal(sig, lambda *_: os._exit(130))
    die_with_parent()


def map_in_workers(
    fn: Callable[..., R],
    tasks: Iterable[tuple[K, tuple[Any, ...]]],
    processes: int,
    on_done: Callable[[K, int, int], None] | None = None,
) -> dict[K, R]:
    """`fn(*args)` for each (key, args) of `tasks` in `processes` worker processes (`quiet_worker`s),
    by key; `on_done(key, done, total)` after each, in the order they finish."""
    from concurrent.futures import ProcessPoolExecutor, as_completed

    todo = list(tasks)
    results: dict[K, R] = {}
    with ProcessPoolExecutor(processes, initializer=quiet_worker) as pool:
        futures = {pool.submit(fn, *args): key for key, args in todo}
        for done, future in enumerate(as_completed(futures)):
            results[futures[future]] = future.result()
            if on_done is not None:
                on_done(futures[future], done + 1, len(todo))
    return results
