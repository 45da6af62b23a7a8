"""LocalSandbox: an attempt's work directory on this host, its commands run under bubblewrap and limits.

Invariants:
- Each sandbox owns one work directory `base_dir/<attempt id>`; `reset` rebuilds it from the task
  (copy, then the set-up script), `cleanup` kills every process the sandbox started and removes it.
- Every command runs as `bash -c <command>` in its own session (process group) with the rlimits of
  `ResourceLimits`, on the lane's CPUs (`cpuset.prepare`, applied before exec), as the sandbox's own
  uid when we are root (so RLIMIT_NPROC holds), and in a per-exec pids cgroup where one is writable.
- A timeout SIGKILLs the whole process group and the exec's pids cgroup (so grandchildren that
  called setsid die too); under bwrap the pid namespace dies with its first process as well. The
  result then has `timed_out=True`, `exit_code=None` and a notice at the end of its output saying which
  limit fired. Set-up and validation limits count *given* time, wall time minus the time the command
  waited for a CPU, with a wall-clock backstop; tool calls count wall time (app/sandboxes/timelimits.py).
- Output (stdout and stderr merged) is read as it comes and at most `output_limit` bytes are kept;
  the rest is counted, dropped, and reported by a visible notice and `truncated=True`.
- Isolation is "bwrap" only when bubblewrap really created its namespaces in a probe on this host;
  otherwise "none", with a logged warning. Under bwrap: no network (only a private loopback), a
  read-only view of the system directories, the work dir writable at `/work`, a private /tmp, /proc
  and /dev, no view of other sandboxes, /root, /home or the repository.
- A command runs as the sandbox's uid only while that uid's claim names the sandbox's holder
  (`uid_holder`), or after the sandbox took over a claim that lapsed with its holder and that nobody
  took since; else it is refused (`SandboxError`): after a lane worker restart the uid may be another
  sandbox's. The check holds the host's claims lock (shared) until the command runs as the uid (or has
  ended), so a sandbox that takes the uid later kills the command with its reset, never shares the uid
  with it.
- Nothing here blocks the event loop: processes through asyncio, file work through `to_thread`.
- In a process that declared itself the owner of its sandboxes (`corral run`, `corral serve`), each
  sandbox is marked from its reset to the end of its cleanup, so that what a killed owner left is
  removed by the next start (app/sandboxes/leftovers.py).
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import os
import re
import shutil
import signal
import stat
import subprocess
import tempfile
import threading
import zlib
from collections.abc import AsyncIterator, Callable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import TYPE_CHECKING, Literal, TypeVar

from app.sandboxes import cpuset, cpushare, leftovers
from app.sandboxes.base import ExecResult
from app.sandboxes.commands import CommandSandbox
from app.sandboxes.leftovers import rmtree
from app.sandboxes.limits import (
    PidsGroup,
    ResourceLimits,
    SandboxLimitError,
    UidPool,
    hold_claim,
    kill_uid_if_claimed,
    private_dir,
    running_as,
    try_claims_shared,
)
from app.sandboxes.timelimits import GivenClock, TimeLimits, leaf_threads, session_threads

if TYPE_CHECKING:
    from app.tasks.spec import TaskSpec

log = logging.getLogger(__name__)

DEFAULT_OUTPUT_LIMIT = 64 * 1024
SANDBOX_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
BWRAP_WORK_DIR = "/work"
SYSTEM_DIRS = ("/usr", "/bin", "/sbin", "/lib", "/lib32", "/lib64", "/libx32", "/etc", "/opt")
# After the main process exits, background processes may keep the output pipe open; read this much
# longer, then stop (they keep running until cleanup, or die with the pid namespace under bwrap).
DRAIN_AFTER_EXIT_S = 0.2
# How long a command's start may hold the host's uid claims lock while it has not switched to the
# sandbox's uid yet (setpriv, after bwrap set up its namespaces: milliseconds).
START_AS_UID_S = 5.0
# How often a command's start looks again whether it may take the claims lock, or runs as the uid yet:
# polled from the event loop, so a start holding the lock never waits for a thread that waits for it
# (claims take the lock in a thread of their own: `in_claims_thread`). The pause doubles from the first
# to the last: a start that is slow (a loaded machine) is not looked at every half millisecond, each look
# a read of /proc.
UID_POLL_S = 0.0005
UID_POLL_MAX_S = 0.02

_T = TypeVar("_T")

# The thread where a process's claims, releases and kills of a uid wait for the claims lock, exclusively:
# in the default executor, its six threads (on 2 cores) waiting for it starved a command's start that held
# the lock shared and, cancelled, needed one of them to kill what it had started: a `corral run` of `sync`
# hung for good (2026-12-07). One thread: the lock is exclusive, a second would only wait beside it.
_claims_thread: tuple[int, ThreadPoolExecutor] | None = None
_claims_thread_made = threading.Lock()


def in_claims_thread(fn: Callable[..., _T], *args: object) -> asyncio.Future[_T]:
    """`fn(*args)` run in this process's claims thread (one per process: a forked one, a Celery pool's,
    makes its own, as the parent's thread is not in it)."""
    global _claims_thread
    with _claims_thread_made:
        if _claims_thread is None or _claims_thread[0] != os.getpid():
            _claims_thread = (os.getpid(), ThreadPoolExecutor(1, thread_name_prefix="corral-uid-claims"))
        executor = _claims_thread[1]
    return asyncio.get_running_loop().run_in_executor(executor, functools.partial(fn, *args))


Isolation = Literal["bwrap", "none"]


class SandboxError(RuntimeError):
    """A sandbox operation could not be carried out (not: the command failed, that is an ExecResult)."""


@functools.cache
def probe_bwrap(bwrap: str = "bwrap") -> tuple[tuple[str, ...] | None, str]:
    """Which namespace flags bubblewrap can use here: (flags, why) with flags None when it cannot run.

    Cached per binary: one probe (a few ms) per process.
    """
    path = shutil.which(bwrap)
    if path is None:
        return None, f"{bwrap} not found on PATH"
    attempts = (
        ("--unshare-net", "--unshare-pid", "--unshare-ipc", "--unshare-uts"),
        ("--unshare-net", "--unshare-ipc", "--unshare-uts"),
        ("--unshare-net",),
    )
    last = ""
    for flags in attempts:
        cmd = [path, *flags, "--die-with-parent", "--ro-bind", "/", "/", "--proc", "/proc", "true"]
        try:
            done = subprocess.run(cmd, capture_output=True, text=True, timeout=10, check=False)
        except (OSError, subprocess.TimeoutExpired) as exc:
            return None, f"{path} failed to start: {exc}"
        if done.returncode == 0:
            return flags, "ok"
        last = done.stderr.strip() or f"exit {done.returncode}"
    return None, f"{path} cannot create namespaces here: {last}"


def renice_session(leader: int, nice: int) -> None:
    """Give the processes of the session and process group led by `leader` (0: this process, which
    must lead its own) niceness `nice`, and their autogroup too: where the kernel groups each session
    for the CPU (`sched_autogroup_enabled`) and the session sits in the root cpu cgroup, sessions share
    the CPU by their autogroups' niceness, and a process's own only counts inside its session. Only
    syscalls, so usable between fork and exec. Best effort: a process that is gone, or a niceness this
    process may not lower, is left as it is."""
    with contextlib.suppress(OSError):
        os.setpriority(os.PRIO_PGRP, leader, nice)
    try:
        fd = os.open(f"/proc/{leader or 'self'}/autogroup", os.O_WRONLY)
    except OSError:  # no autogroups here, or the leader has exited
        return
    try:
        with contextlib.suppress(OSError):
            os.write(fd, str(nice).encode())
    finally:
        os.close(fd)


class _CappedBuffer:
    """Keeps the first `limit` bytes fed to it and counts the rest."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.kept = bytearray()
        self.dropped = 0

    def feed(self, chunk: bytes) -> None:
        room = self.limit - len(self.kept)
        if room > 0:
            self.kept += chunk[:room]
        self.dropped += max(0, len(chunk) - max(room, 0))

    def text(self) -> str:
        out = self.kept.decode("utf-8", errors="replace")
        if self.dropped:
            out += f"\n[corral: output truncated, {self.dropped} bytes dropped]"
        return out


def _safe_name(attempt_id: str) -> str:
    name = re.sub(r"[^A-Za-z0-9_.-]", "_", attempt_id).strip(".")
    if not name:
        raise SandboxError(f"attempt id {attempt_id!r} gives an empty directory name")
    return name[:100]


def _shell_exit_code(returncode: int) -> int:
    # A signal death is reported as the shell would: 128 + signal number.
    return 128 - returncode if returncode < 0 else returncode


class LocalSandboxFactory:
    """Makes `LocalSandbox`es under `base_dir`; probes bwrap, cgroups and uid dropping once."""

    def __init__(
        self,
        base_dir: Path | str,
        *,
        limits: ResourceLimits | None = None,
        isolation: Literal["auto", "bwrap", "none"] = "auto",
        output_limit: int = DEFAULT_OUTPUT_LIMIT,
        uid_base: int | None = 200_000,
        uid_span: int = 10_000,
        use_cgroups: bool = True,
        extra_ro_binds: Sequence[str] = (),
        env: Mapping[str, str] | None = None,
        bwrap: str = "bwrap",
        pin_method: str | None = None,
        cgroup_root: Path = cpuset.CGROUP_ROOT,
        lane_weights: Mapping[str, int] | None = None,
        borrow_serving: bool = False,
        time_limits: TimeLimits | None = None,
        claims_holder: int | None = None,
    ) -> None:
        if output_limit <= 0:
            raise SandboxError(f"output_limit must be positive, got {output_limit}")
        self.base_dir = Path(base_dir).resolve()
        self.limits = limits or ResourceLimits()
        self.time_limits = time_limits or TimeLimits()
        self.output_limit = output_limit
        self.extra_ro_binds = tuple(extra_ro_binds)
        self.env = dict(env or {})
        self.pin_method = pin_method
        self.cgroup_root = cgroup_root
        self.use_cgroups = use_cgroups
        # The live process a sandbox's uid claim is made to name when the sandbox takes over a claim that
        # lapsed: this one, or a lane worker's main process (which outlives its pool processes).
        self.claims_holder = claims_holder if claims_holder is not None else os.getpid()
        # Work-conserving lanes: each lane's processes join a cpu-share group of that lane's weight.
        self.lane_shares: dict[str, cpushare.SharePlacement] = {}
        for lane, weight in (lane_weights or {}).items():
            placement = cpushare.prepare_share(lane, weight, root=cgroup_root)
            if placement is None:
                log.warning(
                    "lane %s: no writable cpu cgroup here, so its weight %d is not applied", lane, weight
                )
                break
            self.lane_shares[lane] = placement
        # Lanes on serving CPUs too: all lanes together yield to serving there (and are reset to the
        # default weight by a run that doesn't borrow, since the group outlives runs).
        self.lanes_weight = (
            cpushare.set_lanes_priority(borrow_serving, root=cgroup_root) if self.lane_shares else None
        )
        if borrow_serving and self.lanes_weight is None:
            log.warning("lanes borrow serving CPUs, but no cpu cgroup is writable: equals there")

        self.bwrap_flags: tuple[str, ...] = ()
        self.bwrap_path: str | None = None
        if isolation == "none":
            self.isolation: Isolation = "none"
        else:
            flags, why = probe_bwrap(bwrap)
            if flags is None:
                if isolation == "bwrap":
                    raise SandboxError(f"isolation='bwrap' requested but {why}")
                log.warning("LocalSandbox runs without isolation (no network or fs separation): %s", why)
                self.isolation = "none"
            else:
                self.isolation = "bwrap"
                self.bwrap_flags = flags
                self.bwrap_path = shutil.which(bwrap)
        self.pid_namespace = "--unshare-pid" in self.bwrap_flags

        self.setpriv = shutil.which("setpriv")
        self.uids: UidPool | None = None
        if uid_base is not None and os.geteuid() == 0:
            if self.setpriv is None:
                log.warning("sandboxes run as root: setpriv (util-linux) is missing, RLIMIT_NPROC won't hold")
            else:
                self.uids = UidPool(uid_base, uid_span)
        self.base_dir.mkdir(parents=True, exist_ok=True)
        # A process that owns its sandboxes marks each one, so that what it leaves if it dies is found
        # and removed by the next start (app/sandboxes/leftovers.py).
        self.owner = leftovers.current()
        if self.owner is not None:
            self.owner.add_root(self.base_dir)
        if self.uids is not None:
            # Sandbox uids must reach their own directory without listing the others.
            self.base_dir.chmod(0o711)
            if self.isolation == "none":
                self._check_reachable(self.base_dir)

    @staticmethod
    def _check_reachable(base_dir: Path) -> None:
        closed = closed_parent(base_dir)
        if closed is not None:
            raise SandboxError(
                f"base_dir {base_dir} is not reachable by sandbox uids: {closed} lacks o+x; "
                "pick a base dir under /tmp or /var/lib, or pass uid_base=None"
            )

    def create(self, attempt_id: str) -> LocalSandbox:
        return LocalSandbox(self, attempt_id)

    def close(self) -> None:
        """Nothing held: beside `DockerSandboxFactory.close`, so a run closes whichever it made."""

    def stopping(self) -> None:
        """Local sandboxes wait on nothing that can go away."""


def closed_parent(path: Path) -> Path | None:
    """The first parent of `path` that other users cannot traverse (no o+x), or None: sandbox uids
    cannot reach a directory below it."""
    for parent in path.parents:
        try:
            mode = parent.stat().st_mode
        except FileNotFoundError:
            continue  # made later, by a mkdir that leaves o+x
        if not mode & stat.S_IXOTH:
            return parent
    return None


def scratch_base(preferred: Path, name: str) -> Path:
    """Where a run's sandboxes go: `preferred`, unless this process hands out sandbox uids (root) and
    they cannot reach it (a data directory under a 0700 home): then `<tmp>/corral-sandboxes/<name>`,
    in a directory only this uid can write."""
    closed = closed_parent(preferred) if os.geteuid() == 0 else None
    if closed is None:
        return preferred
    shared = Path(tempfile.gettempdir()) / "corral-sandboxes"
    private_dir(shared, "sandbox scratch directory", "set sandbox.base_dir in the run config")
    shared.chmod(0o711)  # sandbox uids traverse it to their own directories, and list nothing
    log.info(
        "sandboxes go to %s: sandbox uids cannot reach %s (%s lacks o+x)", shared / name, preferred, closed
    )
    return shared / name


class LocalSandbox(CommandSandbox):
    def __init__(self, factory: LocalSandboxFactory, attempt_id: str) -> None:
        self.factory = factory
        self.attempt_id = attempt_id
        self.name = _safe_name(attempt_id)
        self.work_dir = factory.base_dir / self.name
        self.uid: int | None = None
        # Whom the uid's claim names for this sandbox (the claiming process, or whom it handed it over
        # to): a claim that names someone else went to another sandbox, whose processes run as that uid.
        self.uid_holder: int | None = None
        self.pids_group: PidsGroup | None = None
        self.last_pin_method: str | None = None
        self._task: TaskSpec | None = None
        self._exec_seq = 0
        self.nice = 0  # the CPU niceness its commands run at (`set_nice`)
        self._process_groups: set[int] = set()  # of its commands running now

    @property
    def isolation(self) -> Isolation:
        return self.factory.isolation

    def set_nice(self, nice: int) -> None:
        """Run this sandbox's commands, those running now and those it starts later, at CPU niceness
        `nice` (0..19): in-process lanes ordered oldest group first lower a younger group's priority
        against the older groups' on the same CPUs. Best effort: a process that exits, or that this
        process may not renice (lowering it needs CAP_SYS_NICE), keeps the niceness it has."""
        if nice == self.nice:
            return
        self.nice = nice
        for group in tuple(self._process_groups):
            renice_session(group, nice)

    # -- the port -----------------------------------------------------------------------------------

    async def reset(self, task: TaskSpec, cpus: Sequence[int] | None = None) -> ExecResult:
        if self.factory.uids is not None and self.uid is not None:
            await self._kill_everything()  # an earlier reset's uid: dropped if another sandbox took it since
        if self.factory.uids is not None and self.uid is None:
            self.uid = await in_claims_thread(self.factory.uids.claim, zlib.crc32(self.name.encode()))
            self.uid_holder = os.getpid()
        # Also kills what a crashed earlier owner of this uid or work dir left behind.
        await self._teardown()
        if self.factory.owner is not None:
            await asyncio.to_thread(self.factory.owner.mark, self.factory.base_dir, self.name)
        if self.factory.use_cgroups:
            self.pids_group = await asyncio.to_thread(
                PidsGroup.create,
                leftovers.sandbox_group_name(self.name, self.factory.base_dir, os.getpid()),
                self.factory.limits.max_procs,
                self.factory.cgroup_root,
            )
        await asyncio.to_thread(self._populate, task)
        return await self._set_up(task, cpus)

    async def cleanup(self, cpus: Sequence[int] | None = None) -> None:
        await self._teardown()
        if self.factory.owner is not None:
            await asyncio.to_thread(self.factory.owner.unmark, self.factory.base_dir, self.name)
        if self.uid is not None and self.factory.uids is not None and self.uid_holder is not None:
            await in_claims_thread(self.factory.uids.release, self.uid, self.uid_holder)
        self.uid = self.uid_holder = None
        self._task = None

    def adopt(
        self,
        task: TaskSpec | None,
        uid: int | None,
        pids_group: PidsGroup | None,
        uid_holder: int | None = None,
    ) -> None:
        """Take over this sandbox as `reset` left it in another process of this host (a Celery pool
        process): its task, its uid claim (and whom the claim names) and its pids cgroup. Per-exec
        cgroup leaves get names of this process, so two processes never share one."""
        self._task = task
        self.uid = uid
        self.uid_holder = uid_holder
        self.pids_group = pids_group
        self._exec_seq = os.getpid() * 1_000_000

    # -- internals ----------------------------------------------------------------------------------

    def _require_reset(self) -> TaskSpec:
        if self._task is None:
            raise SandboxError(f"sandbox {self.attempt_id!r} used before reset (or after cleanup)")
        return self._task

    def _populate(self, task: TaskSpec) -> None:
        root = task.root.resolve()
        self.work_dir.mkdir(mode=0o700)
        for rel in task.files:
            src = (root / rel).resolve()
            if not src.is_relative_to(root):
                raise SandboxError(f"task {task.name!r}: file {rel!r} is outside the task root {root}")
            dst = self.work_dir / rel
            dst.parent.mkdir(parents=True, exist_ok=True)
            if src.is_dir():
                shutil.copytree(src, dst, symlinks=True, dirs_exist_ok=True)
            elif src.exists():
                shutil.copy2(src, dst)
            else:
                raise SandboxError(f"task {task.name!r}: file {rel!r} not found under {root}")
        if self.uid is not None:
            uid = self.uid
            os.chown(self.work_dir, uid, uid)
            for dirpath, dirnames, filenames in os.walk(self.work_dir):
                for entry in (*dirnames, *filenames):
                    os.lchown(os.path.join(dirpath, entry), uid, uid)

    async def _teardown(self) -> None:
        """Kill every process of this sandbox and remove its directory and cgroup."""
        await self._kill_everything()
        if self.pids_group is not None:
            await asyncio.to_thread(self.pids_group.remove)
            self.pids_group = None
        await asyncio.to_thread(rmtree, self.work_dir)

    async def _kill_everything(self) -> None:
        if self.pids_group is not None:
            await asyncio.to_thread(self.pids_group.kill_all)
        uids, uid, holder = self.factory.uids, self.uid, self.uid_holder
        if uids is None or uid is None:
            return
        if holder is None or not await in_claims_thread(kill_uid_if_claimed, uids.claims, uid, holder):
            # Its claim lapsed and went to another sandbox (a lane worker restarted since its reset), or
            # a state of an older corral names no holder: the uid's processes may be another sandbox's.
            log.warning(
                "sandbox %s: uid %d is no longer claimed for it (%s): its processes of that uid are left",
                self.attempt_id,
                uid,
                "another sandbox took it" if holder is not None else "its holder is unknown",
            )
            self.uid = self.uid_holder = None  # nor is the claim released

    @contextlib.asynccontextmanager
    async def _own_uid(self) -> AsyncIterator[None]:
        """Hold the host's uid claims lock (shared: other starts may hold it too) while this sandbox's uid
        is its own, for a command's start; raise `SandboxError` if it is not (its claim lapsed and went
        to another sandbox, or went away). A claim that lapsed with its holder (a lane worker restarted)
        and that nobody took since is taken over for the factory's `claims_holder` first: no other
        sandbox has had that uid meanwhile."""
        uids, uid, holder = self.factory.uids, self.uid, self.uid_holder
        if uids is None or uid is None:
            yield
            return
        pause = UID_POLL_S
        while (fd := try_claims_shared(uids.claims)) is None:  # an flock: no event to wait on
            await asyncio.sleep(pause)
            pause = min(2 * pause, UID_POLL_MAX_S)
        try:
            now_holder = (
                None if holder is None else hold_claim(uids.claims, uid, holder, self.factory.claims_holder)
            )
            if now_holder is None:
                why = (
                    "its claim lapsed with a lane worker restart; another sandbox took it, or it was dropped"
                    if holder is not None
                    else "its state names no claim holder"
                )
                raise SandboxError(
                    f"sandbox {self.attempt_id!r}: uid {uid} is no longer claimed for it ({why}): not run"
                )
            if now_holder != holder:
                log.warning(
                    "sandbox %s: took over the claim of uid %d that lapsed with its holder %d (now %d)",
                    self.attempt_id,
                    uid,
                    holder,
                    now_holder,
                )
            self.uid_holder = now_holder
            yield
        finally:
            os.close(fd)  # lets go of the lock

    async def _until_running_as_uid(self, proc: asyncio.subprocess.Process, leaf: Path | None) -> None:
        """Wait until the command `proc` started runs as the sandbox's uid, or has ended (the caller holds
        the claims lock): from then on all it starts is of that uid, and a sandbox that takes the uid
        after a lapse kills it all with its reset, nothing of it still root and about to switch."""
        assert self.uid is not None
        group = self.pids_group

        def members() -> list[int]:
            if self.isolation == "none":
                return []  # setpriv is the lead itself
            if leaf is not None and group is not None:
                return group.pids(leaf)  # bwrap's processes, setpriv's among them
            return session_threads(proc.pid)

        deadline = asyncio.get_running_loop().time() + START_AS_UID_S
        pause = UID_POLL_S
        try:
            while not (switched := running_as(self.uid, proc.pid, members())):
                if asyncio.get_running_loop().time() >= deadline:
                    break
                await asyncio.sleep(pause)
                pause = min(2 * pause, UID_POLL_MAX_S)
        except BaseException:
            await self._kill_exec(proc.pid, leaf)
            raise
        if not switched:
            log.warning(
                "sandbox %s: its command did not switch to uid %d within %g s; the claims lock is let go",
                self.attempt_id,
                self.uid,
                START_AS_UID_S,
            )

    def _argv(self, command: str) -> list[str]:
        inner = ["bash", "-c", command]
        if self.uid is not None and self.factory.setpriv is not None:
            inner = [
                self.factory.setpriv,
                f"--reuid={self.uid}",
                f"--regid={self.uid}",
                "--clear-groups",
                "--no-new-privs",
                *inner,
            ]
        if self.isolation == "none":
            return inner
        assert self.factory.bwrap_path is not None
        argv = [self.factory.bwrap_path, *self.factory.bwrap_flags, "--die-with-parent"]
        for path in (*SYSTEM_DIRS, *self.factory.extra_ro_binds):
            if os.path.islink(path):
                argv += ["--symlink", os.readlink(path), path]
            elif os.path.isdir(path):
                argv += ["--ro-bind", path, path]
        argv += ["--proc", "/proc", "--dev", "/dev", "--perms", "1777", "--tmpfs", "/tmp"]
        argv += ["--bind", str(self.work_dir), BWRAP_WORK_DIR, "--chdir", BWRAP_WORK_DIR]
        return [*argv, "--", *inner]

    def _env(self) -> dict[str, str]:
        home = BWRAP_WORK_DIR if self.isolation == "bwrap" else str(self.work_dir)
        return {
            "PATH": SANDBOX_PATH,
            "HOME": home,
            "LANG": "C.UTF-8",
            "TMPDIR": "/tmp",
            "CORRAL_ATTEMPT": self.attempt_id,
            **self.factory.env,
        }

    async def _run(
        self, command: str, timeout_s: float, cpus: Sequence[int] | None, lane: str = "exec"
    ) -> ExecResult:
        if not self.work_dir.is_dir():
            raise SandboxError(f"sandbox {self.attempt_id!r}: work dir {self.work_dir} is missing")
        loop = asyncio.get_running_loop()
        started = loop.time()
        placement = None
        if cpus:
            placement = await asyncio.to_thread(
                cpuset.prepare, cpus, root=self.factory.cgroup_root, method=self.factory.pin_method
            )
            if (
                placement.method == cpuset.METHOD_CGROUP2
                and self.pids_group is not None
                and self.pids_group.version == "cgroup2"
            ):
                # On v2 a process sits in one group only: the pids leaf wins, CPUs go by affinity.
                placement = cpuset.Placement(placement.cpus, cpuset.METHOD_AFFINITY)
            self.last_pin_method = placement.method
        leaf: Path | None = None
        if self.pids_group is not None:
            self._exec_seq += 1
            leaf = await asyncio.to_thread(self.pids_group.child, f"exec-{self._exec_seq}")
        limits = self.factory.limits
        drop_uid = self.uid is not None
        # On v1 the cpu hierarchy is separate from cpuset and pids, so a process sits in all three; on
        # v2 it sits in one group only, and the pids leaf wins.
        on_v2 = self.pids_group is not None and self.pids_group.version == "cgroup2"
        share = None if on_v2 else self.factory.lane_shares.get(lane)
        nice = self.nice

        def preexec() -> None:
            # Runs in the child between fork and exec: only syscalls, nothing that takes a lock.
            pid = os.getpid()
            if nice:
                renice_session(0, nice)
            if leaf is not None:
                PidsGroup.join(leaf, pid)
            if placement is not None:
                placement.apply(pid)
            if share is not None:
                share.apply(pid)
            limits.apply_rlimits(nproc=drop_uid)

        read_fd, write_fd = os.pipe()
        try:
            async with self._own_uid():
                proc = await asyncio.create_subprocess_exec(
                    *self._argv(command),
                    stdin=asyncio.subprocess.DEVNULL,
                    stdout=write_fd,
                    stderr=write_fd,
                    cwd=self.work_dir,
                    env=self._env(),
                    start_new_session=True,
                    preexec_fn=preexec,
                )
                if drop_uid:
                    await self._until_running_as_uid(proc, leaf)
        except BaseException:
            os.close(read_fd)
            raise
        finally:
            os.close(write_fd)
        self._process_groups.add(proc.pid)  # its own session: the process group is its pid
        if self.nice != nice:  # `set_nice` ran while it started
            renice_session(proc.pid, self.nice)

        buffer = _CappedBuffer(self.factory.output_limit)
        reader = asyncio.StreamReader()
        transport, _ = await loop.connect_read_pipe(
            lambda: asyncio.StreamReaderProtocol(reader), os.fdopen(read_fd, "rb", buffering=0)
        )
        clock = None
        if self.factory.time_limits.counts_given(lane):
            clock = GivenClock(
                functools.partial(leaf_threads, leaf)
                if leaf is not None
                else functools.partial(session_threads, proc.pid)
            )
        killed: str | None = None
        try:
            async with asyncio.TaskGroup() as tg:
                pump = tg.create_task(self._pump(reader, buffer))
                killed = await self._wait_within(proc, timeout_s, clock)
                if killed is not None:
                    await self._kill_exec(proc.pid, leaf)
                    await proc.wait()
                with contextlib.suppress(TimeoutError):
                    async with asyncio.timeout(DRAIN_AFTER_EXIT_S):
                        await pump
        finally:
            transport.close()
            if proc.returncode is None:
                await self._kill_exec(proc.pid, leaf)
                await proc.wait()
            self._process_groups.discard(proc.pid)
            if leaf is not None:
                await asyncio.to_thread(self._remove_leaf_when_empty, leaf)

        returncode = proc.returncode
        assert returncode is not None
        output = buffer.text()
        if killed is not None:
            output += ("" if not output or output.endswith("\n") else "\n") + f"[corral: {killed}]"
        return ExecResult(
            exit_code=None if killed else _shell_exit_code(returncode),
            output=output,
            timed_out=killed is not None,
            truncated=buffer.dropped > 0,
            duration_s=loop.time() - started,
        )

    async def _wait_within(
        self, proc: asyncio.subprocess.Process, timeout_s: float, clock: GivenClock | None
    ) -> str | None:
        """Wait for `proc` to exit within its limit: None if it did, else why it must be killed."""
        # asyncio.timeout, not wait_for: 3.11's wait_for can swallow a cancellation that arrives as
        # the process exits, and the runtime cancels attempts of discarded groups.
        if clock is None:
            try:
                async with asyncio.timeout(timeout_s):
                    await proc.wait()
            except TimeoutError:
                return f"killed at its {timeout_s:g} s wall-clock limit"
            return None
        limits = self.factory.time_limits
        loop = asyncio.get_running_loop()
        backstop_at = loop.time() + timeout_s * limits.backstop
        while True:
            # Given time never runs ahead of wall time, so waiting what is left of the limit never
            # overshoots it; sampling every `sample_s` keeps the threads that exit early counted.
            left = min(timeout_s - clock.given_s, limits.sample_s, backstop_at - loop.time())
            if clock.given_s >= timeout_s:
                return (
                    f"killed after its {timeout_s:g} s limit of given time "
                    "(wall time less the waits for a CPU)"
                )
            if left <= 0:
                return (
                    f"killed at the wall-clock backstop, {limits.backstop:g}x its {timeout_s:g} s "
                    "limit of given time"
                )
            try:
                async with asyncio.timeout(left):
                    await proc.wait()
                return None
            except TimeoutError:
                await asyncio.to_thread(clock.sample)

    @staticmethod
    async def _pump(reader: asyncio.StreamReader, buffer: _CappedBuffer) -> None:
        while chunk := await reader.read(65536):
            buffer.feed(chunk)

    async def _kill_exec(self, pgid: int, leaf: Path | None) -> None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(pgid, signal.SIGKILL)
        if leaf is not None and self.pids_group is not None:
            await asyncio.to_thread(self.pids_group.kill_all, leaf)

    def _remove_leaf_when_empty(self, leaf: Path) -> None:
        assert self.pids_group is not None
        if not self.pids_group.pids(leaf):
            with contextlib.suppress(OSError):
                leaf.rmdir()


__all__ = ["LocalSandbox", "LocalSandboxFactory", "ResourceLimits", "SandboxError", "SandboxLimitError"]
