"""Stop signals held while `corral` loads (app/early_signals.py), in this process: held, taken or
released, and a signal the process was started ignoring stays ignored."""

from __future__ import annotations

import os
import signal

from app import early_signals


def test_a_held_signal_is_remembered_then_taken_and_the_handlers_come_back() -> None:
    before = signal.getsignal(signal.SIGINT)
    early_signals.hold()
    try:
        os.kill(os.getpid(), signal.SIGINT)  # no KeyboardInterrupt: held
        assert early_signals.take() == [signal.SIGINT]
        assert early_signals.take() == []
        os.kill(os.getpid(), signal.SIGINT)
    finally:
        assert early_signals.release() == [signal.SIGINT]
    assert signal.getsignal(signal.SIGINT) is before


def test_a_signal_the_process_ignores_stays_ignored() -> None:
    previous = signal.signal(signal.SIGTERM, signal.SIG_IGN)
    try:
        early_signals.hold()
        assert signal.getsignal(signal.SIGTERM) is signal.SIG_IGN
        os.kill(os.getpid(), signal.SIGTERM)
        assert early_signals.release() == []
        assert signal.getsignal(signal.SIGTERM) is signal.SIG_IGN
    finally:
        signal.signal(signal.SIGTERM, previous)
