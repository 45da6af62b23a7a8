"""The host's uid claims lock and the threads that wait for it, with real sandboxes as root: a claim, a
release or a kill of a uid's processes waits for the lock exclusively in a thread, while a command's
start holds it shared on the event loop and may need a thread itself (to kill what it started, when it
is cancelled). With those waits in the default executor, enough of them took every thread, and the
start that held the lock could never end: a `corral run` of `sync` (16 resets at once) hung for good."""

from __future__ import annotations

import asyncio
import os
import shutil
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
from factories import make_echo_task as make_task

from app.sandboxes.limits import ENV_UID_CLAIMS, try_claims_shared
from app.sandboxes.local import LocalSandboxFactory

pytestmark = pytest.mark.skipif(
    os.geteuid() != 0 or shutil.which("setpriv") is None, reason="sandbox uids are claimed only as root"
)


async def test_claims_waiting_for_the_lock_leave_the_default_threads_to_its_shared_holder(
    tmp_path: Path, base_dir: Path, task_root: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Four resets claim uids while the lock is held shared (as a command's start holds it), with a
    default executor of two threads (six on this 2-core machine: a sync run's 16 resets took them all).
    The holder must still get a thread. Before, both threads waited for the lock and the holder's
    work never ran (a timeout here); the claims now wait in a thread of their own."""
    monkeypatch.setenv(ENV_UID_CLAIMS, str(tmp_path / "claims"))
    factory = LocalSandboxFactory(base_dir, isolation="none")
    assert factory.uids is not None
    asyncio.get_running_loop().set_default_executor(ThreadPoolExecutor(2))
    sandboxes = [factory.create(f"g{i}a0") for i in range(4)]
    shared = try_claims_shared(factory.uids.claims)
    assert shared is not None
    try:
        resets = [asyncio.ensure_future(sb.reset(make_task(task_root, setup=""))) for sb in sandboxes]
        await asyncio.sleep(0.5)
        assert not any(reset.done() for reset in resets)  # their claims wait for the lock
        answered = await asyncio.wait_for(asyncio.to_thread(lambda: "a thread"), 10)
        assert answered == "a thread"
    finally:
        os.close(shared)  # lets go of the lock: the claims go on
    done = await asyncio.wait_for(asyncio.gather(*resets), 30)
    assert all(reset.exit_code == 0 for reset in done)
    assert len({sb.uid for sb in sandboxes}) == 4
    for sb in sandboxes:
        result = await sb.exec("id -u", timeout_s=10)
        assert result.output == f"{sb.uid}\n"
        await sb.cleanup()
    assert sorted(p.name for p in (tmp_path / "claims").iterdir() if p.name.isdigit()) == []
