"""A process that forks all the time, as `corral run` does (sandboxes in their own session, made with a
`preexec_fn`), and counts the SIGINTs its asyncio loop takes: `python tests/fork_signals_proc.py
guard|noguard`. It prints `ready` once it forks, then `count N` three seconds later. Every child's time
between its fork and its `setsid` is stretched to 20 ms, so a group signal nearly always finds a child
there. Run by tests/test_fork_guard.py."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import time

from app import early_signals

if sys.argv[1] == "guard":
    early_signals.guard_forks()
os.register_at_fork(after_in_child=lambda: time.sleep(0.02))  # after the guard's: the window, stretched

count = 0


def on_sigint() -> None:
    global count
    count += 1


async def fork_forever() -> None:
    while True:
        child = await asyncio.to_thread(
            subprocess.Popen, ["true"], start_new_session=True, preexec_fn=lambda: None
        )
        await asyncio.to_thread(child.wait)


async def main() -> None:
    asyncio.get_running_loop().add_signal_handler(signal.SIGINT, on_sigint)
    forks = [asyncio.create_task(fork_forever()) for _ in range(4)]
    print("ready", flush=True)
    await asyncio.sleep(3.0)
    print("count", count, flush=True)
    del forks
    os._exit(0)  # the forking threads do not end by themselves


asyncio.run(main())
