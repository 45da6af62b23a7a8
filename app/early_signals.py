"""Stop signals (SIGINT, SIGTERM) that arrive before a command is ready to act on them.

`corral`'s entry point calls `hold` before its heavy imports (when it runs as the command, not when a
test runner imports it: `is_command_process`), so a Ctrl-C in the first second is
remembered instead of raising `KeyboardInterrupt` in the middle of an import. Then exactly one of:
- `take`: the command handles the remembered signals itself (`corral run` stops its start-up and still
  writes its report);
- `release`: the default handlers come back and the caller learns what was held (every other command
  then ends as if interrupted: exit 130).

This module must be cheap enough to run first: until `hold` runs, a Ctrl-C is Python's own traceback.
Importing it loads no module the interpreter has not loaded already at start-up (`_signal`, `sys`, `os`;
tests/test_early_signals.py checks): not `signal` (its enums), `threading`, `contextlib` nor `typing`,
which took about 2.5 ms of the ~18 ms between exec and `hold` (README: a Ctrl-C in the first second of
`corral run`); most of the rest is Python's own start-up, before any of Corral's code runs.
"""

from __future__ import annotations

import _signal
import _thread
import os
import sys

TYPE_CHECKING = False  # typing.TYPE_CHECKING without importing typing
if TYPE_CHECKING:
    from collections.abc import Callable
    from types import FrameType, TracebackType
    from typing import Any

STOP_SIGNALS = (_signal.SIGINT, _signal.SIGTERM)

_held: list[int] = []
_previous: dict[int, Any] = {}


def _remember(signum: int, frame: FrameType | None) -> None:
    _held.append(signum)


def is_command_process() -> bool:
    """Is this process the `corral` command itself (its console script, or `python -c`), rather than
    a program that imports it (a test runner): only then does it take over process-wide things."""
    if _started_by_multiprocessing():
        return False
    main = sys.modules.get("__main__")
    path = getattr(main, "__file__", None)
    return path is None or os.path.splitext(os.path.basename(path))[0] == "corral"


def _started_by_multiprocessing() -> bool:
    """A simulation worker, or the fork server that starts them (`app.children.worker_pool`). Both are
    `python -c`, and both import the command's own script (as `__mp_main__`), so they looked like the
    command: a worker held SIGTERM for a caller it is not, and outlived a `corral advise` that was
    killed, since the SIGTERM meant to end it with its parent was only remembered."""
    process = sys.modules.get("multiprocessing.process")
    if process is None:
        return False
    inheriting = getattr(process.current_process(), "_inheriting", False)  # importing the caller's script
    return process.parent_process() is not None or bool(inheriting)


# The signals a terminal or a user sends to a whole process group (Ctrl-C, `kill -- -PGID`, a hang-up).
GROUP_SIGNALS = (_signal.SIGINT, _signal.SIGTERM, _signal.SIGHUP)
_masks_before_fork: dict[int, Any] = {}  # the forking thread's signal mask, by thread
_forks_guarded: list[bool] = []


def _hold_group_signals() -> None:
    _masks_before_fork[_thread.get_ident()] = _signal.pthread_sigmask(_signal.SIG_BLOCK, GROUP_SIGNALS)


def _mask_back() -> None:
    mask = _masks_before_fork.pop(_thread.get_ident(), None)
    if mask is not None:
        _signal.pthread_sigmask(_signal.SIG_SETMASK, mask)


def _child_forgets_wakeup_fd() -> None:
    _signal.set_wakeup_fd(-1)  # after fork the forking thread is the child's main thread
    _mask_back()


def guard_forks() -> None:
    """A group signal that reaches a child between its fork and its exec (or its `setsid`) is the
    child's, not one more for this process. Without this guard it counted twice here: the child still
    runs this process's C signal handler, which writes the signal to asyncio's wake-up fd, a socket the
    child shares with this process, and the loop here took that byte for a second Ctrl-C (`corral run`
    then "stopped at once", in 2 of 3 tries of `make run`'s demo). So the forking thread holds the group
    signals across the fork (`os.register_at_fork`, which runs for `os.fork` and for every `subprocess`
    child with a `preexec_fn`, as the sandboxes' and engines' are; children without one are made by
    `vfork`, where Python blocks every signal and resets the handlers itself), and the child drops the
    wake-up fd before it takes them. Once per process."""
    if not _forks_guarded:
        _forks_guarded.append(True)
        os.register_at_fork(
            before=_hold_group_signals, after_in_parent=_mask_back, after_in_child=_child_forgets_wakeup_fd
        )


def keep_ctrl_c_out_of_finalizers() -> None:
    """A Ctrl-C whose KeyboardInterrupt is raised inside a finalizer (an object's `__del__`, which the
    cyclic collector runs at any allocation) is printed as "Exception ignored in ..." and lost: `corral
    bench --family` went on to its next simulation, the press gone (CI, 2026-12-03: the press landed
    in the collection each simulation ends with). From here on such a KeyboardInterrupt is raised again
    where the main thread next runs code of its own, and nothing is printed; SIGINT's handler is then
    put back as it was (an `interruptible_once` that took the press ignores the next ones). Once per
    process.

    Raised again from a one-shot SIGINT handler that another thread trips (`_thread.interrupt_main`):
    tripped from the hook itself, the handler ran inside the hook, where its exception was lost too.
    One that still runs inside the hook trips itself again instead of raising."""
    previous = sys.unraisablehook
    if getattr(previous, "_corral_ctrl_c", False):
        return
    main_thread = _thread.get_ident()
    in_hook: list[bool] = []

    def trip_soon() -> None:
        _thread.start_new_thread(_thread.interrupt_main, (_signal.SIGINT,))

    def raise_again(then: Any) -> None:
        def once(signum: int, frame: FrameType | None) -> None:
            if in_hook:
                trip_soon()
                return
            if _signal.getsignal(_signal.SIGINT) is once:
                _signal.signal(_signal.SIGINT, then)
            raise KeyboardInterrupt

        once._corral_once = True  # type: ignore[attr-defined]
        _signal.signal(_signal.SIGINT, once)
        trip_soon()

    def hook(unraisable: Any) -> None:
        if not (
            isinstance(unraisable.exc_type, type)
            and issubclass(unraisable.exc_type, KeyboardInterrupt)
            and _thread.get_ident() == main_thread
            and not sys.is_finalizing()
        ):
            previous(unraisable)
            return
        in_hook.append(True)
        try:
            current = _signal.getsignal(_signal.SIGINT)
            if not getattr(current, "_corral_once", False):  # else already on its way
                raise_again(current)
        finally:
            in_hook.pop()

    hook._corral_ctrl_c = True  # type: ignore[attr-defined]
    sys.unraisablehook = hook


def hold() -> None:
    """Remember stop signals from now on instead of acting on them. A signal this process was started
    ignoring (a shell's background job ignores SIGINT) stays ignored. Forks are guarded from here on
    (`guard_forks`)."""
    guard_forks()
    for sig in STOP_SIGNALS:
        current = _signal.getsignal(sig)
        if current in (_signal.SIG_IGN, _remember):
            continue
        _previous[sig] = _signal.signal(sig, _remember)


def take() -> list[int]:
    """The signals held so far (forgotten here: the caller now owns them); holding goes on."""
    taken = list(_held)
    _held.clear()
    return taken


def release() -> list[int]:
    """Put the handlers back as they were before `hold`; return the signals held meanwhile."""
    for sig, handler in _previous.items():
        if _signal.getsignal(sig) is _remember:
            _signal.signal(sig, handler)
    _previous.clear()
    return take()


def ignore_until_exit() -> None:
    """The command has done its work and written its output: a stop signal from now on has nothing left
    to stop, so it is ignored while the process exits. (Left to `release`, a Ctrl-C landing as `corral
    run` exited killed the process, after a complete report: the shell said 130. A Python handler would
    not do either: finalization puts the default one back.) Only in the command process, and only for
    the signals being held."""
    if not is_command_process():
        return
    for sig in _previous:
        if _signal.getsignal(sig) is _remember:
            _signal.signal(sig, _signal.SIG_IGN)
    _previous.clear()
    _held.clear()


def stopping() -> None:
    """A stop signal has ended the command's work, and it is on its way out (its one line said, or about
    to be): the group's stop signals are ignored from here on, at the OS level, so that the exit
    completes. Left to Python's default handler, a second Ctrl-C a few milliseconds after the first
    landed while the process unwound or finalized, and the process died by the signal: a script or a
    `subprocess` caller saw -2, not the 130 it was told, in 3 of 3 double presses on `corral bench`.
    Only in the command process (a test runner keeps its own Ctrl-C)."""
    if is_command_process():
        ignore_stops()


def ignore_stops() -> None:
    """`stopping`'s work, for a caller that knows it owns the process (a benchmark run as a script)."""
    for sig in GROUP_SIGNALS:
        if _signal.getsignal(sig) is not _signal.SIG_IGN:
            _signal.signal(sig, _signal.SIG_IGN)
    _previous.clear()
    _held.clear()


def _ignore(signum: int, frame: FrameType | None) -> None:
    """A Ctrl-C that has nothing left to do. A handler rather than SIG_IGN: SIGTERM standing in for
    Ctrl-C (`app.cli.common.sigterm_as_ctrl_c`) finds it and does nothing too."""


# What a Ctrl-C does while SIGINT is ignored (a background job of a non-interactive shell) and SIGTERM
# stands in for it (`app.cli.common.sigterm_as_ctrl_c`): Python's default, or an `interruptible_once`'s
# handler. SIGINT itself stays ignored.
_stand_in: list[Callable[[int, FrameType | None], Any]] = [_signal.default_int_handler]


def ctrl_c_handler() -> Any:
    """The handler a Ctrl-C reaches: SIGINT's, or the stand-in's while SIGINT is ignored."""
    handler = _signal.getsignal(_signal.SIGINT)
    return _stand_in[0] if handler is _signal.SIG_IGN else handler


class interruptible_once:  # a context manager, not `contextlib.contextmanager`: see the module's note
    """Ctrl-C acts once; further presses (users press it twice) are ignored until the block ends, so
    that what the block does after the first (unwinding a simulation, writing what was computed so
    far) is not broken half-way. The first press raises KeyboardInterrupt, or calls `on_first` instead
    (to stop at a safe point of the caller's choosing). Only where Ctrl-C would raise
    KeyboardInterrupt anyway: in the main thread (only it gets signals), under Python's default handler
    (not under a handler of the caller's own). While SIGINT is ignored, the same holds for what stands
    in for it (`ctrl_c_handler`)."""

    def __init__(self, on_first: Callable[[], None] | None = None) -> None:
        self._on_first = on_first
        self._installed = False
        self._stand_in = False

    def __enter__(self) -> None:
        import threading

        if (
            threading.current_thread() is not threading.main_thread()
            or ctrl_c_handler() is not _signal.default_int_handler
        ):
            return
        self._stand_in = _signal.getsignal(_signal.SIGINT) is _signal.SIG_IGN
        self._set(self._first)
        self._installed = True

    def _set(self, handler: Callable[[int, FrameType | None], Any]) -> None:
        if self._stand_in:
            _stand_in[0] = handler
        else:
            _signal.signal(_signal.SIGINT, handler)

    def _first(self, signum: int, frame: FrameType | None) -> None:
        self._set(_ignore)
        if self._on_first is None:
            raise KeyboardInterrupt
        self._on_first()

    def __exit__(
        self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        if self._installed:
            self._installed = False
            self._set(_signal.default_int_handler)
