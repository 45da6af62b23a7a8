from __future__ import annotations

import asyncio
import os
import shutil
import socket
from pathlib import Path
from typing import Any

import pytest
from factories import make_echo_task as make_task
from sandbox_owner import alive_with_token

from app.sandboxes.cpuset import read_cpus_allowed
from app.sandboxes.cpushare import share_method
from app.sandboxes.limits import ResourceLimits
from app.sandboxes.local import LocalSandboxFactory, SandboxError, closed_parent, probe_bwrap, scratch_base

BWRAP_FLAGS, BWRAP_WHY = probe_bwrap()
ALLOWED = sorted(os.sched_getaffinity(0))
ISOLATIONS = [
    "none",
    pytest.param(
        "bwrap", marks=pytest.mark.skipif(BWRAP_FLAGS is None, reason=f"bubblewrap unusable: {BWRAP_WHY}")
    ),
]
HAS_PYTHON = shutil.which("python3", path="/usr/local/bin:/usr/bin:/bin") is not None


def make_factory(base_dir: Path, **overrides: Any) -> LocalSandboxFactory:
    return LocalSandboxFactory(base_dir, **overrides)


def pid_alive(pid: int) -> bool:
    try:
        status = Path(f"/proc/{pid}/status").read_text()
    except FileNotFoundError:
        return False
    return "Z (zombie)" not in status


@pytest.fixture(params=ISOLATIONS)
def isolation(request: pytest.FixtureRequest) -> str:
    return str(request.param)


async def test_happy_path(base_dir: Path, task_root: Path, isolation: str) -> None:
    sb = make_factory(base_dir, isolation=isolation).create("pytest-happy")
    assert sb.isolation == isolation
    reset = await sb.reset(make_task(task_root, setup="echo setting up; echo ran > setup.log"))
    assert reset.exit_code == 0
    assert "setting up" in reset.output
    result = await sb.exec("cat greeting.txt lib/helper.sh setup.log", timeout_s=10)
    assert result.exit_code == 0
    assert result.output == "hello world\necho helper\nran\n"
    assert not result.timed_out
    assert not result.truncated
    assert await sb.validate() == 1.0
    failed = await sb.exec("echo bye > greeting.txt; echo oops >&2; exit 3", timeout_s=10)
    assert failed.exit_code == 3
    assert failed.output == "oops\n"
    assert await sb.validate() == 0.0
    work_dir = sb.work_dir
    await sb.cleanup()
    assert not work_dir.exists()
    with pytest.raises(SandboxError, match="before reset"):
        await sb.exec("true", timeout_s=1)


async def test_reset_starts_from_a_clean_copy(base_dir: Path, task_root: Path, isolation: str) -> None:
    sb = make_factory(base_dir, isolation=isolation).create("pytest-reset")
    task = make_task(task_root, setup="")
    await sb.reset(task)
    await sb.exec("echo junk > extra.txt; echo changed > greeting.txt", timeout_s=10)
    await sb.reset(task)
    result = await sb.exec("ls; cat greeting.txt", timeout_s=10)
    assert result.output == "greeting.txt\nlib\nhello world\n"
    await sb.cleanup()


async def test_failing_setup_is_reported(base_dir: Path, task_root: Path) -> None:
    sb = make_factory(base_dir).create("pytest-setup-fails")
    result = await sb.reset(make_task(task_root, setup="echo broken; exit 7"))
    assert result.exit_code == 7
    assert result.output == "broken\n"
    await sb.cleanup()


async def test_task_file_outside_root_is_refused(base_dir: Path, task_root: Path) -> None:
    sb = make_factory(base_dir).create("pytest-escape")
    with pytest.raises(SandboxError, match="outside the task root"):
        await sb.reset(make_task(task_root, files=("../../etc/passwd",)))
    await sb.cleanup()


async def test_timeout_kills_children_and_grandchildren(
    base_dir: Path, task_root: Path, isolation: str
) -> None:
    token = f"{os.getpid() % 1000}.4242"
    sb = make_factory(base_dir, isolation=isolation).create("pytest-timeout")
    await sb.reset(make_task(task_root, setup=""))
    # One grandchild stays in the process group, one escapes it with setsid.
    command = (
        f"bash -c 'echo $$ > gc.pid; exec sleep {token}' & "
        f"setsid bash -c 'echo $$ > escaped.pid; exec sleep {token}1' & "
        "sleep 600"
    )
    loop = asyncio.get_running_loop()
    started = loop.time()
    result = await sb.exec(command, timeout_s=1.0)
    assert result.timed_out
    assert result.exit_code is None
    assert loop.time() - started < 5
    await asyncio.sleep(0.2)
    assert alive_with_token(token) == []
    if isolation == "none":
        # Host pids: the pid files name real processes, which must be gone (or unreaped zombies).
        for name in ("gc.pid", "escaped.pid"):
            pid = int((sb.work_dir / name).read_text())
            assert not pid_alive(pid)
    await sb.cleanup()


async def test_cleanup_kills_leftover_background_processes(base_dir: Path, task_root: Path) -> None:
    token = f"{os.getpid() % 1000}.777"
    sb = make_factory(base_dir, isolation="none").create("pytest-leftover")
    await sb.reset(make_task(task_root, setup=""))
    result = await sb.exec(f"setsid sleep {token} > /dev/null 2>&1 & echo started", timeout_s=5)
    assert result.output == "started\n"
    assert alive_with_token(token) != []
    await sb.cleanup()
    await asyncio.sleep(0.1)
    assert alive_with_token(token) == []


@pytest.mark.skipif(BWRAP_FLAGS is None, reason=f"bubblewrap unusable: {BWRAP_WHY}")
async def test_no_network_inside_bwrap(base_dir: Path, task_root: Path) -> None:
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen(8)
    port = server.getsockname()[1]
    probe = f"echo ping > /dev/tcp/127.0.0.1/{port} && echo connected"
    try:
        plain = make_factory(base_dir, isolation="none").create("pytest-net-plain")
        await plain.reset(make_task(task_root, setup=""))
        control = await plain.exec(probe, timeout_s=10)
        assert control.output.strip() == "connected", "the probe must work without isolation"
        await plain.cleanup()

        boxed = make_factory(base_dir, isolation="bwrap").create("pytest-net-bwrap")
        await boxed.reset(make_task(task_root, setup=""))
        result = await boxed.exec(probe, timeout_s=10)
        assert result.exit_code != 0
        assert "connected" not in result.output
        interfaces = await boxed.exec("ls /sys/class/net 2>/dev/null || cat /proc/net/dev", timeout_s=10)
        assert "eth" not in interfaces.output
        await boxed.cleanup()
    finally:
        server.close()


@pytest.mark.skipif(BWRAP_FLAGS is None, reason=f"bubblewrap unusable: {BWRAP_WHY}")
async def test_bwrap_filesystem_view(base_dir: Path, task_root: Path) -> None:
    sb = make_factory(base_dir, isolation="bwrap").create("pytest-fs")
    await sb.reset(make_task(task_root, setup=""))
    result = await sb.exec(
        "pwd; touch /usr/x 2>/dev/null && echo usr-writable; touch /tmp/ok && echo tmp-ok; "
        f"ls {base_dir} 2>/dev/null && echo sees-base; ls /root 2>/dev/null && echo sees-root; true",
        timeout_s=10,
    )
    assert result.output == "/work\ntmp-ok\n"
    await sb.cleanup()


@pytest.mark.skipif(not HAS_PYTHON, reason="python3 not installed in the system dirs")
async def test_memory_limit_holds(base_dir: Path, task_root: Path, isolation: str) -> None:
    limits = ResourceLimits(memory_bytes=256 << 20)
    sb = make_factory(base_dir, isolation=isolation, limits=limits).create("pytest-mem")
    await sb.reset(make_task(task_root, setup=""))
    small = await sb.exec("python3 -c 'b = bytearray(32 << 20); print(len(b))'", timeout_s=20)
    assert small.output.strip() == str(32 << 20)
    big = await sb.exec("python3 -c 'b = bytearray(512 << 20); print(len(b))'", timeout_s=20)
    assert big.exit_code != 0
    assert "MemoryError" in big.output
    await sb.cleanup()


async def test_cpu_time_limit_kills_a_busy_loop(base_dir: Path, task_root: Path, isolation: str) -> None:
    sb = make_factory(base_dir, isolation=isolation, limits=ResourceLimits(cpu_time_s=1)).create("pytest-cpu")
    await sb.reset(make_task(task_root, setup=""))
    result = await sb.exec("while :; do :; done", timeout_s=15)
    assert not result.timed_out
    assert result.exit_code in {128 + 24, 128 + 9}  # SIGXCPU at the soft limit, SIGKILL at the hard one
    assert result.duration_s < 10
    await sb.cleanup()


FORK_BOMB = """python3 - <<'PY'
import os, time
n = 0
try:
    for _ in range(200):
        if os.fork() == 0:
            time.sleep(2)
            os._exit(0)
        n += 1
except OSError as exc:
    print("fork failed:", exc.errno)
print("forked", n)
PY"""


@pytest.mark.skipif(not HAS_PYTHON, reason="python3 not installed in the system dirs")
@pytest.mark.parametrize("use_cgroups", [True, False], ids=["pids-cgroup", "nproc-uid"])
async def test_process_limit_stops_a_fork_bomb(
    base_dir: Path, task_root: Path, isolation: str, use_cgroups: bool
) -> None:
    if not use_cgroups and os.geteuid() == 0 and shutil.which("setpriv") is None:
        pytest.skip("as root without setpriv RLIMIT_NPROC is not enforced")
    if not use_cgroups and os.geteuid() != 0:
        pytest.skip("not root: no dedicated uid, so RLIMIT_NPROC would count the caller's processes")
    limits = ResourceLimits(max_procs=20)
    sb = make_factory(base_dir, isolation=isolation, limits=limits, use_cgroups=use_cgroups).create(
        "pytest-fork"
    )
    await sb.reset(make_task(task_root, setup=""))
    if use_cgroups and sb.pids_group is None:
        await sb.cleanup()
        pytest.skip("no writable pids cgroup here")
    result = await sb.exec(FORK_BOMB, timeout_s=20)
    assert "fork failed: 11" in result.output  # EAGAIN
    forked = int(result.output.rsplit("forked", 1)[1])
    assert forked < 20
    await sb.cleanup()


async def test_file_size_limit(base_dir: Path, task_root: Path, isolation: str) -> None:
    limits = ResourceLimits(file_size_bytes=1 << 20)
    sb = make_factory(base_dir, isolation=isolation, limits=limits).create("pytest-fsize")
    await sb.reset(make_task(task_root, setup=""))
    result = await sb.exec("head -c 3000000 /dev/zero > big.bin", timeout_s=10)
    assert result.exit_code != 0
    assert (sb.work_dir / "big.bin").stat().st_size <= 1 << 20
    await sb.cleanup()


async def test_output_is_capped_with_a_notice(base_dir: Path, task_root: Path, isolation: str) -> None:
    sb = make_factory(base_dir, isolation=isolation, output_limit=1000).create("pytest-trunc")
    await sb.reset(make_task(task_root, setup=""))
    result = await sb.exec("head -c 5000 /dev/zero | tr '\\0' x", timeout_s=10)
    assert result.truncated
    assert result.output == "x" * 1000 + "\n[corral: output truncated, 4000 bytes dropped]"
    # Far more output than the cap: read and dropped as it comes, not held in memory.
    flood = await sb.exec("head -c 50000000 /dev/zero", timeout_s=20)
    assert flood.exit_code == 0
    assert flood.output.endswith("[corral: output truncated, 49999000 bytes dropped]")
    exact = await sb.exec("head -c 1000 /dev/zero | tr '\\0' y", timeout_s=10)
    assert not exact.truncated
    assert exact.output == "y" * 1000
    await sb.cleanup()


async def test_cpu_pinning_per_exec(base_dir: Path, task_root: Path, isolation: str) -> None:
    sb = make_factory(base_dir, isolation=isolation).create("pytest-pin")
    await sb.reset(make_task(task_root, setup=""), cpus=[ALLOWED[-1]])
    for cpu in (ALLOWED[0], ALLOWED[-1]):
        result = await sb.exec("grep Cpus_allowed_list /proc/self/status", timeout_s=10, cpus=[cpu])
        assert result.output.split(":")[1].strip() == str(cpu)
        assert sb.last_pin_method in {"cgroup1", "cgroup2", "affinity"}
    await sb.cleanup()


async def test_cpu_pinning_read_back_from_the_host(base_dir: Path, task_root: Path, isolation: str) -> None:
    sb = make_factory(base_dir, isolation=isolation).create("pytest-pin-host")
    await sb.reset(make_task(task_root, setup=""))
    token = f"{os.getpid() % 1000}.9191"
    async with asyncio.TaskGroup() as tg:
        running = tg.create_task(sb.exec(f"sleep {token}", timeout_s=0.8, cpus=[ALLOWED[-1]]))
        pids: list[int] = []
        for _ in range(50):
            pids = alive_with_token(token)
            if pids:
                break
            await asyncio.sleep(0.02)
        assert pids, "the sandboxed sleep never showed up"
        assert {read_cpus_allowed(pid) for pid in pids} == {(ALLOWED[-1],)}
    assert running.result().timed_out
    await sb.cleanup()


async def test_commands_run_as_a_dedicated_uid_when_root(
    base_dir: Path, task_root: Path, isolation: str
) -> None:
    sb = make_factory(base_dir, isolation=isolation).create("pytest-uid")
    await sb.reset(make_task(task_root, setup=""))
    result = await sb.exec("id -u; touch mine.txt && echo wrote", timeout_s=10)
    if os.geteuid() == 0 and shutil.which("setpriv"):
        assert sb.uid is not None
        assert result.output == f"{sb.uid}\nwrote\n"
    else:
        assert result.output == f"{os.geteuid()}\nwrote\n"
    await sb.cleanup()


@pytest.mark.skipif(share_method() is None, reason="no writable cpu cgroup controller on this host")
async def test_lane_weights_put_each_operation_in_its_lane_group(base_dir: Path, task_root: Path) -> None:
    factory = make_factory(base_dir, lane_weights={"reset": 200, "exec": 400})
    sb = factory.create("pytest-lanes")
    task = make_task(task_root, setup="cat /proc/self/cgroup > setup-cgroup.txt")
    await sb.reset(task)
    result = await sb.exec("cat setup-cgroup.txt; echo ---; cat /proc/self/cgroup", timeout_s=10)
    setup_groups, exec_groups = result.output.split("---")
    assert "corral/lane-reset" in setup_groups
    assert "corral/lane-exec" in exec_groups
    assert "corral/lane-reset" not in exec_groups
    await sb.cleanup()


async def test_two_factories_never_share_a_sandbox_uid(base_dir: Path, task_root: Path) -> None:
    """Two runs on one host (each with its own sandbox directory) name their attempts alike, g0a0, ...
    A sandbox's uid is what its reset and cleanup kill everything of, so the second run's sandbox of
    the same name must get another uid: its reset must not kill the first run's tool call."""
    token = f"{os.getpid() % 1000}.778"
    first = make_factory(base_dir / "run-a", isolation="none").create("g6a1")
    second = make_factory(base_dir / "run-b", isolation="none").create("g6a1")
    await first.reset(make_task(task_root, setup=""))
    try:
        started = await first.exec(f"setsid sleep {token} > /dev/null 2>&1 & echo started", timeout_s=5)
        assert started.output == "started\n"
        await second.reset(make_task(task_root, setup=""))
        try:
            await asyncio.sleep(0.1)
            assert alive_with_token(token) != [], "the second run's reset killed the first run's process"
            if first.uid is not None:
                assert second.uid != first.uid
        finally:
            await second.cleanup()
        await asyncio.sleep(0.1)
        assert alive_with_token(token) != [], "the second run's cleanup killed the first run's process"
    finally:
        await first.cleanup()
    await asyncio.sleep(0.1)
    assert alive_with_token(token) == []


@pytest.mark.skipif(os.geteuid() != 0, reason="sandbox uids are handed out only by root")
async def test_a_data_directory_sandbox_uids_cannot_reach_moves_the_sandboxes_to_tmp(
    tmp_path: Path, base_dir: Path, task_root: Path
) -> None:
    """`corral serve` puts a run's sandboxes under its data directory. Under a 0700 home (root's), the
    sandbox uids could not reach them and the run failed without bubblewrap ("not reachable by sandbox
    uids"); now the sandboxes go to `<tmp>/corral-sandboxes/<run>`, where they can."""
    home = tmp_path / "home"
    home.mkdir(mode=0o700)
    preferred = home / "corral-data" / "run1" / "sandboxes"
    assert closed_parent(preferred) == home
    base = scratch_base(preferred, "run1")
    assert closed_parent(base) is None
    assert base.name == "run1"
    assert base.parent.stat().st_mode & 0o777 == 0o711
    sandbox = make_factory(base, isolation="none").create("g0a0")  # refused before, for `preferred`
    assert sandbox.factory.uids is not None
    await sandbox.reset(make_task(task_root, setup=""))
    try:
        result = await sandbox.exec("id -u; touch made-here && echo ok", timeout_s=5)
        assert result.output == f"{sandbox.uid}\nok\n"
    finally:
        await sandbox.cleanup()
        base.rmdir()
    assert scratch_base(base_dir / "sandboxes", "run2") == base_dir / "sandboxes"  # reachable: kept
    with pytest.raises(SandboxError, match="not reachable by sandbox uids"):
        make_factory(preferred, isolation="none")
