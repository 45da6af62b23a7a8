"""Child processes that do not outlive their parent.

Invariant: a process that calls `die_with_parent` gets SIGTERM when the thread that started it ends,
however that happens (SIGKILL included), so an engine, a fault helper or a simulation worker is never
left orphaned. Linux only (prctl PR_SET_PDEATHSIG); elsewhere it does nothing.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import signal
import sys
from collections.abc import Callable, Hashable, Iterable, Iterator
from typing import TYPE_CHECKING, Any, TypeVar

if TYPE_CHECKING:
    from concurrent.futures import ProcessPoolExecutor

K = TypeVar("K", bound=Hashable)
R = TypeVar("R")

_PR_SET_PDEATHSIG = 1


def die_with_parent() -> None:
    """In the child (before exec, or in a worker's initializer): SIGTERM when the parent thread ends.
    Call it from a child whose parent is a long-lived thread: the signal follows the forking thread, not
    the parent process."""
    if sys.platform.startswith("linux"):
        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)


def quiet_worker(ignored: Iterable[int] = ()) -> None:
    """A simulation worker's initializer (`ProcessPoolExecutor(initializer=quiet_worker)`): Ctrl-C, or
    the terminal hanging up (SIGHUP), both sent to the whole process group, end the worker at once and
    quietly, where each worker used to print its own KeyboardInterrupt traceback; the parent gets the
    same signal and says what happened. The worker also ends with its parent (`die_with_parent`): a
    SIGTERM or SIGKILL to the parent alone used to leave the workers running for minutes.

    `ignored`: the signals of those two that the caller ignores (`nohup`; a background job of a script
    ignores SIGINT), which the worker ignores too. It used to end on them, and the command, its workers
    lost, ended as interrupted where it was meant to go on."""
    for sig in _STOPS:
        signal.signal(sig, signal.SIG_IGN if sig in ignored else lambda *_: os._exit(130))
    signal.pthread_sigmask(signal.SIG_UNBLOCK, _STOPS)  # blocked in its fork server (`_start_helpers`)
    die_with_parent()
    _let_the_fork_server_go()


_STOPS = (signal.SIGINT, signal.SIGHUP)  # sent to the whole process group: Ctrl-C, a terminal hanging up


def _start_helpers() -> None:
    """Start multiprocessing's fork server with Ctrl-C and SIGHUP blocked, so that it inherits the
    block: a Ctrl-C in the first second of `corral advise`, while the fork server imported the simulator
    (or was still in the interpreter's start-up), printed its KeyboardInterrupt traceback, or "Fatal
    Python error: init_import_site", after the command's one line. It ignores SIGINT for good once
    started; the workers unblock both (`quiet_worker`). Blocked in this thread only, a signal that comes
    meanwhile is not lost: it waits, or another thread takes it. The resource tracker first: it blocks
    SIGINT itself while it starts, and unblocks it after, whatever the mask was (`_start_tracker`)."""
    from multiprocessing import forkserver

    _start_tracker()
    blocked = signal.pthread_sigmask(signal.SIG_BLOCK, _STOPS)
    try:
        forkserver.ensure_running()
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, blocked)


# The tracker's notice that it removes the pool's semaphores itself (when the command was killed by
# SIGKILL) and its notice of one it could not remove; its -W options are taken from `sys.warnoptions`.
_QUIET_TRACKER = "ignore::UserWarning:multiprocessing.resource_tracker"


def _start_tracker() -> None:
    """Start multiprocessing's resource tracker (which removes the pool's named semaphores when the
    command cannot: a SIGKILL) with SIGHUP blocked and its warnings off.

    SIGHUP: the tracker ignores SIGINT and SIGTERM but not SIGHUP, so a terminal hanging up (or any
    SIGHUP to the process group) killed it mid-search. The command then found it gone as it removed
    the pool's semaphores, printed "resource_tracker: process died unexpectedly, relaunching" and the
    new tracker one KeyError traceback per semaphore. Blocked in this thread while it starts, SIGHUP
    stays blocked in the tracker for good (it unblocks only SIGINT and SIGTERM); it ends, as before,
    when the last process holding its pipe has ended.

    Warnings: after a SIGKILL to the command the tracker removes its five semaphores, which is its
    job, and said so in a two-line UserWarning about "5 leaked semaphore objects" after the shell's
    "Killed": nothing is left in /dev/shm, and there is nothing for the user to do."""
    from multiprocessing import resource_tracker

    quiet = _QUIET_TRACKER not in sys.warnoptions
    if quiet:
        sys.warnoptions.append(_QUIET_TRACKER)
    blocked = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGHUP})
    try:
        resource_tracker.ensure_running()
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, blocked)
        if quiet:
            sys.warnoptions.remove(_QUIET_TRACKER)


def _let_the_fork_server_go() -> None:
    """Close this worker's copy of the fork server's keep-alive pipe. The fork server ends when every
    holder of that pipe's write end is gone, and it hands a copy to each worker it forks (so that a
    worker could ask it for processes of its own, which ours never do). With the copy kept, a caller
    killed by SIGKILL left a deadlock: the server waited for its workers to end, and the workers, which
    end with the server (`die_with_parent`), ran on. Python keeps the descriptor in a private field;
    where it is missing there is nothing to close."""
    from multiprocessing import forkserver

    server = getattr(forkserver, "_forkserver", None)
    fd = getattr(server, "_forkserver_alive_fd", None)
    if isinstance(fd, int):
        os.close(fd)
        server._forkserver_alive_fd = None  # type: ignore[union-attr]


def fork_server_pid() -> int | None:
    """The fork server's process id, or None when this process has not started one. Python keeps it in
    a private field; where it is missing this says None."""
    from multiprocessing import forkserver

    pid = getattr(getattr(forkserver, "_forkserver", None), "_forkserver_pid", None)
    return pid if isinstance(pid, int) else None


def stop_fork_server() -> None:
    """End the fork server at once (SIGTERM, which it takes even while it still imports the simulator
    with Ctrl-C held back) and forget it, so that it forks no worker for a pool that is gone: one it
    forked after a Ctrl-C found the pool's semaphores removed and printed a FileNotFoundError traceback.
    The next pool starts a new one."""
    from multiprocessing import forkserver

    pid = fork_server_pid()
    if pid is None:
        return
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, signal.SIGTERM)
    forkserver._forkserver._stop()  # type: ignore[attr-defined]  # closes its pipe, reaps it


def worker_pool(processes: int) -> ProcessPoolExecutor:
    """A pool of `processes` simulation workers (`quiet_worker`s), started from a fork server.

    Not forked from the caller: a process with other threads (a test session, a command with a progress
    bar, a server) can be forked while one of them holds a lock (logging's, the import lock, a stream's),
    and the worker then waits on that lock for ever, and the caller on the worker. CI saw a run hang that
    way. The fork server is a single-threaded child started once per process; it preloads the simulator,
    so a worker starts in milliseconds. A worker's parent is the fork server, which ends when its own
    parent does (it reads end-of-file on its pipe), so `die_with_parent` still ends the workers with the
    caller (`_let_the_fork_server_go`)."""
    import multiprocessing
    from concurrent.futures import ProcessPoolExecutor

    context = multiprocessing.get_context("forkserver")
    # The caller's main script too (`corral`, or the test runner's), so that each worker does not
    # import it again as it starts.
    context.set_forkserver_preload(["__main__", "app.children", "app.sim.advise", "app.sim.family"])
    _start_helpers()
    ignored = tuple(int(sig) for sig in _STOPS if signal.getsignal(sig) is signal.SIG_IGN)
    return ProcessPoolExecutor(processes, mp_context=context, initializer=quiet_worker, initargs=(ignored,))


class WorkerLost(RuntimeError):
    """A simulation worker died of something other than a stop signal to the whole group (the kernel's
    OOM killer, a `kill -9`, a crash): the pool is broken and its work lost. Not an interrupt: nobody
    pressed Ctrl-C, and the command says what happened and exits 1 where it said "interrupted", 130."""


def _lost_worker(pool: ProcessPoolExecutor) -> str | None:
    """How a worker of a pool that broke ended, where it was not by a stop signal: "SIGKILL", "exit
    status 3"; None when every worker ended as a stop ends it (Ctrl-C or SIGHUP: `quiet_worker`'s 130;
    SIGTERM, which the pool also sends the others as it breaks) or is still running. Python keeps the
    pool's processes in a private field; where it is missing this says None (an interrupt, as before)."""
    processes = getattr(pool, "_processes", None) or {}
    codes = [process.exitcode for process in list(processes.values())]
    lost = [code for code in codes if code is not None and code not in (0, 130, -signal.SIGTERM)]
    if not lost:
        return None
    # A signal first: the fork server says 255 of a worker whose status it could not pass on, and CI saw
    # "exit status 255" named for a pool whose other worker had been killed (SIGKILL).
    code = min(lost, key=lambda code: (code >= 0, code == 255))
    return signal_name(code) if code < 0 else f"exit status {code}"


def signal_name(code: int) -> str:
    """The signal a negative exit code (a `Popen.returncode`, a `Process.exitcode`) stands for: "SIGKILL"
    for -9, "signal 99" for one this system does not name."""
    return signal.Signals(-code).name if -code in signal.valid_signals() else f"signal {-code}"


@contextlib.contextmanager
def stopping_pool(workers: int) -> Iterator[ProcessPoolExecutor]:
    """A pool of `workers` simulation processes (`worker_pool`). An exception out of the block (an
    interrupt) drops the queued work and ends the running workers, whose results are lost anyway: the
    pool's own exit waited for all of it (a SIGTERM to the command alone, which its workers do not get,
    took 15-60 s to act). A pool broken by a worker that died of something else raises `WorkerLost`.

    The pool's thread is joined before the exception goes on. `shutdown(wait=False)` used to come
    first, and it forgets that thread, so the thread was still closing its wake-up pipe as the
    interpreter exited, and the exit hook of `concurrent.futures` could write to the closed pipe:
    "Exception ignored in: <module 'threading'> ... OSError: [Errno 9] Bad file descriptor" after
    the command's one line (CI saw it once). The ended workers break the pool, so the join is short.
    The fork server is stopped too when this pool started it: still starting, it may have a worker to
    fork, which found the pool's semaphores gone and printed a FileNotFoundError traceback after the
    command's "interrupted"."""
    import multiprocessing
    from concurrent.futures.process import BrokenProcessPool

    before = set(multiprocessing.active_children())  # not the pool's to end
    server_before = fork_server_pid()
    with worker_pool(workers) as pool:
        try:
            yield pool
        except BaseException as exc:
            lost = _lost_worker(pool) if isinstance(exc, BrokenProcessPool) else None
            for child in set(multiprocessing.active_children()) - before:
                child.terminate()
            if server_before is None:  # the pool's own: still starting, it may have a worker to fork
                stop_fork_server()
            pool.shutdown(wait=True, cancel_futures=True)
            if lost is not None:
                raise WorkerLost(f"a simulation worker died ({lost}); its work is lost") from exc
            raise


def map_in_workers(
    fn: Callable[..., R],
    tasks: Iterable[tuple[K, tuple[Any, ...]]],
    processes: int,
    on_done: Callable[[K, int, int], None] | None = None,
) -> dict[K, R]:
    """`fn(*args)` for each (key, args) of `tasks` in `processes` worker processes (`quiet_worker`s),
    by key; `on_done(key, done, total)` after each, in the order they finish. A Ctrl-C stops the
    workers at once (`stopping_pool`); a worker that died otherwise raises `WorkerLost`."""
    from concurrent.futures import as_completed

    from app import early_signals

    todo = list(tasks)
    results: dict[K, R] = {}
    # A second Ctrl-C is ignored while the pool unwinds: landing inside `as_completed`'s locks it gave
    # "RuntimeError: release unlocked lock" (2 of 10 double presses), or left a lock held that the
    # pool's shutdown then waited on for ever (1 of 35).
    with early_signals.interruptible_once(), stopping_pool(processes) as pool:
        futures = {pool.submit(fn, *args): key for key, args in todo}
        for done, future in enumerate(as_completed(futures)):
            results[futures[future]] = future.result()
            if on_done is not None:
                on_done(futures[future], done + 1, len(todo))
    return results
