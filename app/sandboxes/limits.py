"""Resource limits for local sandbox processes: rlimits, a pids cgroup, and a dedicated uid.

Invariants:
- `ResourceLimits.apply_rlimits` only calls setrlimit, so it is safe in a preexec_fn; a limit of None
  leaves the inherited value.
- The process-count limit holds only where something enforces it: a per-sandbox pids cgroup
  (`PidsGroup`, cgroup v1 `pids` hierarchy or v2 `pids.max`), or RLIMIT_NPROC on a uid that no one
  else uses (`UidPool`). RLIMIT_NPROC is ignored for root, so as root the sandbox drops to its uid.
- A uid is claimed by exactly one live sandbox on the host at a time (an O_EXCL claim file naming the
  owner pid, in the host's one claims directory, `uid_claims_dir()`, whatever the sandbox's own
  directory); a claim whose owner is dead may be taken over. Killing "every process of the uid"
  therefore only hits that sandbox, never one of another run that named its sandbox alike.
- Every process of a uid is killed only while its claim names the holder the caller's sandbox gave it
  (`kill_uid_if_claimed`): a claim lapses with its holder (a lane worker restarted) and another sandbox
  may have taken the uid since. Claiming, handing over, releasing and that check-and-kill hold the
  claims directory's lock, so no claim changes hands between the check and the kill.
- A command runs as a sandbox's uid only while the claim names the sandbox's holder (`hold_claim`): a
  claim that lapsed and went to another sandbox (or went away) refuses it; one that lapsed and stayed
  free (it still names the dead holder, so nobody took the uid since) is taken over by a live holder.
  The check and the command's start hold the claims lock shared (LocalSandbox._run): starts overlap,
  and every claim, hand-over, release and check-and-kill (exclusive) waits for those under way.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import os
import resource
import shutil
import signal
import stat
import subprocess
import tempfile
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path

from app.sandboxes.cpuset import CGROUP_ROOT, GROUP_PREFIX, enable_controller


class SandboxLimitError(RuntimeError):
    """A limit was asked for but cannot be set up on this host."""


@dataclass(frozen=True)
class ResourceLimits:
    cpu_time_s: int | None = 600  # RLIMIT_CPU, per process; SIGXCPU at the limit, SIGKILL 1 s later
    memory_bytes: int | None = 4 << 30  # RLIMIT_AS, per process (virtual address space)
    max_procs: int | None = 512  # pids cgroup pids.max and RLIMIT_NPROC of the sandbox uid
    file_size_bytes: int | None = 1 << 30  # RLIMIT_FSIZE; SIGXFSZ / EFBIG beyond it
    open_files: int | None = 4096  # RLIMIT_NOFILE

    def apply_rlimits(self, *, nproc: bool) -> None:
        """Set the rlimits on the calling process (meant for a preexec_fn)."""
        if self.cpu_time_s is not None:
            resource.setrlimit(resource.RLIMIT_CPU, (self.cpu_time_s, self.cpu_time_s + 1))
        if self.memory_bytes is not None:
            resource.setrlimit(resource.RLIMIT_AS, (self.memory_bytes, self.memory_bytes))
        if self.file_size_bytes is not None:
            resource.setrlimit(resource.RLIMIT_FSIZE, (self.file_size_bytes, self.file_size_bytes))
        if self.open_files is not None:
            resource.setrlimit(resource.RLIMIT_NOFILE, (self.open_files, self.open_files))
        if nproc and self.max_procs is not None:
            resource.setrlimit(resource.RLIMIT_NPROC, (self.max_procs, self.max_procs))


def pids_parent(root: Path) -> tuple[Path, str] | None:
    """The writable place for per-sandbox pids groups, or None when there is none."""
    v1 = root / "pids"
    if os.access(v1 / "cgroup.procs", os.W_OK):
        return v1 / GROUP_PREFIX, "cgroup1"
    top = root / "cgroup.controllers"
    controllers = top.read_text().split() if top.exists() else []
    if "pids" in controllers and os.access(root / "cgroup.subtree_control", os.W_OK):
        return root / GROUP_PREFIX, "cgroup2"
    return None


class PidsGroup:
    """One sandbox's pids cgroup: caps its process count and finds every process it ever started.

    Children of the group are per-exec groups, so a timed-out exec can be killed with all its
    descendants (even those that called setsid) without touching the sandbox's other processes.
    """

    def __init__(self, path: Path, version: str) -> None:
        self.path = path
        self.version = version

    @classmethod
    def create(cls, name: str, max_procs: int | None, root: Path = CGROUP_ROOT) -> PidsGroup | None:
        """Make the group, or return None when no pids cgroup is writable here."""
        found = pids_parent(root)
        if found is None:
            return None
        parent, version = found
        try:
            if version == "cgroup2":
                enable_controller(root, "pids")
                parent.mkdir(exist_ok=True)
                enable_controller(parent, "pids")
            else:
                parent.mkdir(exist_ok=True)
            path = parent / name
            path.mkdir(exist_ok=True)
            if version == "cgroup2":
                enable_controller(path, "pids")
            if max_procs is not None:
                (path / "pids.max").write_text(str(max_procs))
        except OSError:
            # e.g. a v2 container root that holds processes and so cannot enable controllers.
            return None
        return cls(path, version)

    def child(self, name: str) -> Path:
        """A per-exec leaf group (created now); the limit of `self` still applies to it."""
        leaf = self.path / name
        leaf.mkdir(exist_ok=True)
        return leaf

    @staticmethod
    def join(leaf: Path, pid: int) -> None:
        """Only syscalls: usable in a preexec_fn."""
        fd = os.open(leaf / "cgroup.procs", os.O_WRONLY)
        try:
            os.write(fd, str(pid).encode())
        finally:
            os.close(fd)

    def pids(self, group: Path | None = None) -> list[int]:
        return listed_ids(group or self.path, "cgroup.procs", FileNotFoundError)

    def kill_all(self, group: Path | None = None) -> int:
        """SIGKILL every process in the group (and its children groups); returns how many were sent."""
        target = group or self.path
        kill_file = target / "cgroup.kill"
        if kill_file.exists():
            kill_file.write_text("1")
            return -1
        return kill_until_gone(lambda: self.pids(target))

    @staticmethod
    def remove_leaf(leaf: Path) -> None:
        with contextlib.suppress(FileNotFoundError):
            leaf.rmdir()

    def remove(self) -> None:
        """Remove the per-exec leaves and the group; they must be empty (call `kill_all` first)."""
        if not self.path.exists():
            return
        for leaf in sorted((p for p in self.path.iterdir() if p.is_dir()), reverse=True):
            _rmdir_retry(leaf)
        _rmdir_retry(self.path)


def listed_ids(group: Path, name: str, ignore: type[OSError] = OSError) -> list[int]:
    """The ids listed in every `name` file (`cgroup.procs`, `tasks`, `cgroup.threads`) of a cgroup and
    the groups below it; a file that raises `ignore` while read (a group removed meanwhile) is skipped."""
    found: list[int] = []
    for listing in group.rglob(name):
        with contextlib.suppress(ignore):
            found.extend(int(line) for line in listing.read_text().split())
    return found


def after_comm(stat: str) -> str:
    """The fields of a `/proc/<pid>/stat` text after the command name, which may hold spaces and
    parentheses: state, ppid, pgrp, session, ... (`proc(5)` numbering less 3)."""
    return stat[stat.rindex(")") + 2 :]


def kill_until_gone(find: Callable[[], list[int]], rounds: int = 20, pause_s: float = 0.0) -> int:
    """SIGKILL the processes `find` returns until it returns none, looking at most `rounds` times (a
    process may fork between a look and the kill); returns how many signals were sent."""
    sent = 0
    for _ in range(rounds):
        pids = find()
        if not pids:
            break
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
                sent += 1
        time.sleep(pause_s)
    return sent


# A killed process leaves its group only once it has run its exit, and a process of a lane starved of
# CPU (a low weight on a busy host) waits for a CPU to do that: seconds, in a real run on a loaded host.
RMDIR_PATIENCE_S = 15.0


def _rmdir_retry(path: Path) -> None:
    deadline = time.monotonic() + RMDIR_PATIENCE_S
    pause = 0.01
    while True:
        try:
            path.rmdir()
            return
        except FileNotFoundError:
            return
        except OSError as exc:
            if exc.errno != errno.EBUSY:
                raise
        if time.monotonic() >= deadline:
            raise SandboxLimitError(
                f"cgroup {path} still busy {RMDIR_PATIENCE_S:g} s after its processes were killed"
            )
        time.sleep(pause)
        pause = min(0.2, pause * 2)


ENV_UID_CLAIMS = "CORRAL_UID_CLAIMS_DIR"


def uid_claims_dir() -> Path:
    """Where every Corral process on this host claims sandbox uids (`$CORRAL_UID_CLAIMS_DIR`, by default
    `<tmp>/corral-uids`). One directory for the host, because the uid range is the host's: two runs with
    their own sandbox directories would otherwise claim the same uid for their sandboxes of the same
    name, and each sandbox's reset and cleanup kill every process of its uid."""
    return Path(os.environ.get(ENV_UID_CLAIMS) or Path(tempfile.gettempdir()) / "corral-uids")


def private_dir(path: Path, what: str, hint: str) -> None:
    """Create `path` (mode 0700) or check that it is a real directory of ours that only we can write
    (a shared place like /tmp: no other user may plant a link or a file there); `hint` says how to
    choose another."""
    with contextlib.suppress(FileExistsError):
        path.mkdir(mode=0o700, parents=True)
    info = path.lstat()
    if not stat.S_ISDIR(info.st_mode) or info.st_uid != os.geteuid() or info.st_mode & 0o022:
        raise SandboxLimitError(
            f"{what} {path} must be a directory owned by uid {os.geteuid()} that no one else can write; "
            + hint
        )


class UidPool:
    """Hands out uids from [base, base + span), one per live sandbox on the host, through claim files in
    `claims` (the host's `uid_claims_dir()` unless told otherwise)."""

    def __init__(self, base: int, span: int, claims: Path | None = None) -> None:
        if base <= 0 or span <= 0:
            raise SandboxLimitError(f"uid range must be positive, got base={base} span={span}")
        self.base = base
        self.span = span
        self.claims = claims if claims is not None else uid_claims_dir()
        # Claim files decide whose processes get killed: no other user may plant one.
        private_dir(self.claims, "uid claims directory", f"set {ENV_UID_CLAIMS} to another path")

    def claim(self, hint: int) -> int:
        with claims_locked(self.claims):
            for i in range(self.span):
                uid = self.base + (hint + i) % self.span
                path = self.claims / str(uid)
                try:
                    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
                except FileExistsError:
                    if owner_alive(path):
                        continue
                    with contextlib.suppress(FileNotFoundError):
                        path.unlink()
                    try:
                        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
                    except FileExistsError:
                        continue
                with os.fdopen(fd, "w") as f:
                    f.write(str(os.getpid()))
                return uid
        raise SandboxLimitError(f"all {self.span} sandbox uids from {self.base} are claimed ({self.claims})")

    def release(self, uid: int, holder: int) -> bool:
        """Drop `uid`'s claim if it still names `holder` (not one that another sandbox took since); whether
        it did."""
        with claims_locked(self.claims):
            if not claim_names(self.claims, uid, holder):
                return False
            with contextlib.suppress(FileNotFoundError):
                (self.claims / str(uid)).unlink()
            return True

    def hand_over(self, uid: int, owner_pid: int) -> None:
        """Make `owner_pid` the holder of `uid`'s claim: a claim lapses when its holder dies, so a
        claim made by a short-lived process for a long-lived sandbox names the process that outlives it
        (a Celery worker's main process, not the pool process that ran the reset)."""
        with claims_locked(self.claims):
            _write_claim(self.claims, uid, owner_pid)


def _write_claim(claims: Path, uid: int, holder: int) -> None:
    """Make `holder` whom `uid`'s claim names, atomically; the caller holds the claims lock."""
    path = claims / str(uid)
    tmp = path.with_name(f".{uid}.{os.getpid()}.tmp")
    tmp.write_text(str(holder))
    tmp.replace(path)


# Beside the claims: an flock that whoever waits for the claims lock exclusively holds, so that commands'
# starts, which take that lock shared, cannot keep it from a claim by overlapping one another.
CLAIMS_GATE = ".gate"


@contextlib.contextmanager
def claims_locked(claims: Path) -> Iterator[None]:
    """Hold the lock of the host's claims directory `claims` (an flock on the directory itself)
    exclusively, taken through its gate."""
    gate = os.open(claims / CLAIMS_GATE, os.O_RDWR | os.O_CREAT, 0o600)
    try:
        fcntl.flock(gate, fcntl.LOCK_EX)
        fd = os.open(claims, os.O_RDONLY | os.O_DIRECTORY)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
            yield
        finally:
            os.close(fd)
    finally:
        os.close(gate)


def try_claims_shared(claims: Path) -> int | None:
    """The lock of the claims directory `claims` taken shared, unless it or its gate is held exclusively
    now (None): the descriptor that holds it, let go when closed. Never blocks."""
    gate = os.open(claims / CLAIMS_GATE, os.O_RDWR | os.O_CREAT, 0o600)
    try:
        fcntl.flock(gate, fcntl.LOCK_SH | fcntl.LOCK_NB)
        fd = os.open(claims, os.O_RDONLY | os.O_DIRECTORY)
        try:
            fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
        except BaseException:
            os.close(fd)
            raise
        return fd
    except BlockingIOError:
        return None
    finally:
        os.close(gate)


def hold_claim(claims: Path, uid: int, holder: int, successor: int) -> int | None:
    """Whom `uid`'s claim names now for a sandbox that got it from `holder`, the caller holding the claims
    lock, shared at least (then no other sandbox's op changes this uid's claim): `holder` while it is
    alive; `successor`, a live process, once it took over a claim that lapsed with `holder` and that
    nobody took since (it still names `holder`); None when the claim names another or nobody (another
    sandbox took the uid, or took and released it: the uid is not the sandbox's)."""
    path = claims / str(uid)
    if not claim_names(claims, uid, holder):
        return None
    if owner_alive(path):
        return holder
    _write_claim(claims, uid, successor)
    return successor


def claim_names(claims: Path, uid: int, holder: int) -> bool:
    """Whether `uid`'s claim in `claims` names `holder`."""
    try:
        return (claims / str(uid)).read_text().strip() == str(holder)
    except OSError:
        return False


def uid_kill_argv(setpriv: str, uid: int) -> list[str]:
    """kill(-1) as the sandbox uid: reaches every process of that uid, however it detached."""
    return [setpriv, f"--reuid={uid}", f"--regid={uid}", "--clear-groups", "kill", "-KILL", "-1"]


def kill_uid_if_claimed(claims: Path, uid: int, holder: int, release: bool = False) -> bool:
    """Kill every process of `uid` if its claim in `claims` still names `holder`, the process the
    caller's sandbox got it from, and with `release` drop the claim; whether it did. Under the claims
    lock: a claim that lapsed (its holder died) is taken over only under it, so the uid cannot pass to
    another sandbox, which would start processes as it, between the check and the kill."""
    with claims_locked(claims):
        if not claim_names(claims, uid, holder):
            return False
        setpriv = shutil.which("setpriv")
        if setpriv is not None:
            subprocess.run(uid_kill_argv(setpriv, uid), capture_output=True, check=False, timeout=30)
        if release:
            (claims / str(uid)).unlink(missing_ok=True)
        return True


def owner_alive(path: Path) -> bool:
    try:
        owner = int(path.read_text().strip() or "0")
    except (OSError, ValueError):
        return True  # being written right now, or unreadable: leave it alone
    if owner <= 0:
        return True
    try:
        os.kill(owner, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def real_uid(pid: int) -> int | None:
    """The real uid process `pid` runs as, or None once it has exited (gone, or a zombie)."""
    try:
        status = Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return None
    fields = dict(line.split(":", 1) for line in status.splitlines() if ":" in line)
    if fields.get("State", "").split()[:1] == ["Z"]:
        return None
    return int(fields["Uid"].split()[0])


def running_as(uid: int, lead: int, members: Iterable[int]) -> bool:
    """Whether a command has switched to `uid`: one of `members` (its processes, `lead` the first) runs
    as `uid`, or `lead` has exited. The switch is the command's own (setpriv): from then on whatever it
    starts runs as `uid`, since it can never become root again."""
    return real_uid(lead) in (None, uid) or any(real_uid(pid) == uid for pid in members)
