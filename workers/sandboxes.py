"""A host's sandboxes, as a lane worker sees them: rebuilt from a `SandboxHandle` for each op.

A worker's ops run in several pool processes, and a sandbox's ops may land in any of them (or in a
restarted one). So a sandbox's state lives on the host, not in a process: its work directory or
container, and a small state file written after `reset` and removed after `cleanup` — beside the work
dirs for local sandboxes (`<base dir>/.corral-state/`: the task, the uid claim, the pids cgroup), in the
worker's state directory for docker sandboxes (the task, the container id). Every op rebuilds the
sandbox from the handle and that file.

A run on Celery lanes numbers each of its starts (its incarnation, growing from one start to the next:
`CeleryLanes.begin_incarnation`), and its sandbox ids end with that number. A killed incarnation's
sandboxes have no process left to clean them up, and no owner on this host that a sweep at start could
find (leftovers.py): so each start sends every lane host a sweep of the run's sandbox directory
(`sweep`), which its cleanup worker carries out. A sandbox of an incarnation older than the newest one
seen on this host, in that directory (`<base dir>/.corral-state/incarnation`), is dead: the sweep removes
it (its processes, work directory, cgroup, state file, and its uid claim if it still holds it), and a
reset, exec or validate of it is refused from then on; a reset already running when the newer
incarnation showed up removes what it made once it ends.

Invariants:
- an op for a sandbox whose handle names another host, or a kind this worker does not run, is refused;
- the rebuilt sandbox is exactly the one the handle names (same work dir, or same container name);
- state is written atomically (a reader never sees half a file);
- a sandbox's uid claim is held by the worker's main process, which outlives any pool process; an op
  that took over a claim that lapsed (`LocalSandbox._own_uid`: a worker restarted, nobody took the uid)
  leaves the new holder, this worker's main process, in the sandbox's state;
- a sweep touches only sandboxes of older incarnations than the newest one seen in their directory
  (never one of the incarnation driving the run, nor one without an incarnation), is idempotent, and
  kills a uid's processes only while the uid's claim still names the holder the sandbox's reset gave it
  (a worker restarted since lost its claims, and another sandbox may hold that uid now).
"""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import json
import logging
import os
import re
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

from app.lanes.base import LaneName
from app.lanes.ops import (
    LaneOp,
    LaneOpError,
    SandboxHandle,
    incarnation_of,
    is_attempt_sandbox,
    task_from_dict,
)
from app.sandboxes import leftovers
from app.sandboxes.cpuset import CGROUP_ROOT
from app.sandboxes.leftovers import Found
from app.sandboxes.limits import PidsGroup, claim_names, pids_parent
from app.sandboxes.local import LocalSandbox, LocalSandboxFactory

if TYPE_CHECKING:
    from app.sandboxes.docker import DockerSandbox, DockerSandboxFactory

log = logging.getLogger(__name__)

STATE_DIR = ".corral-state"
INCARNATION_FILE = "incarnation"  # in STATE_DIR: the newest incarnation of the run seen on this host
_RUN_ID = re.compile(
    r"^[A-Za-z0-9_-][A-Za-z0-9_.-]{0,99}$"
)  # a docker sandbox's run, as `corral.run` names it


class OlderIncarnation(LaneOpError):
    """An op on a sandbox of an incarnation of its run older than the one now driving it: not run."""


class HostSandboxes:
    """This host's local sandboxes (one factory per base directory, a handle's work dir's parent) and,
    when a docker factory is given, its docker sandboxes."""

    def __init__(
        self,
        host: str,
        isolation: Literal["auto", "bwrap", "none"] = "auto",
        owner_pid: int | None = None,
        docker: DockerSandboxFactory | None = None,
        state_dir: Path | None = None,
        **factory_options: Any,
    ) -> None:
        if docker is not None and state_dir is None:
            raise LaneOpError("state_dir: docker sandboxes need a directory for their state")
        self.host = host
        self.isolation = isolation
        # Sandbox uid claims name this process (the worker's main process), not the pool process
        # that ran the reset: a claim lapses when its holder dies, and pool processes may be replaced.
        self.owner_pid = owner_pid if owner_pid is not None else os.getpid()
        self.docker = docker
        self.state_dir = state_dir
        self.factory_options = factory_options
        self._factories: dict[Path, LocalSandboxFactory] = {}

    def resolve(self, handle: SandboxHandle) -> LocalSandbox | DockerSandbox:
        if handle.host != self.host:
            raise LaneOpError(
                f"handle.host: sandbox {handle.id!r} lives on {handle.host!r}, not {self.host!r}"
            )
        if handle.kind == "local":
            return self._local(handle)
        if handle.kind == "docker":
            return self._docker(handle)
        raise LaneOpError(f"handle.kind: {handle.kind!r} sandboxes do not run on lane workers")

    def after(self, op: LaneOp[Any], sandbox: LocalSandbox | DockerSandbox) -> None:
        """Keep what the next op of this sandbox needs: state after `reset`, nothing after `cleanup`."""
        state = self._state_file(sandbox)
        if op.name is LaneName.CLEANUP:
            state.unlink(missing_ok=True)
        elif op.name is LaneName.RESET:
            if isinstance(sandbox, LocalSandbox) and sandbox.uid is not None and sandbox.factory.uids:
                sandbox.factory.uids.hand_over(sandbox.uid, self.owner_pid)
                sandbox.uid_holder = self.owner_pid
            holder = {"uid_holder": self.owner_pid}  # whose claim a sweep may take the uid's for
            _write_atomic(state, {"task": op.args["task"], **_state_of(sandbox), **holder})

    def keep_uid_holder(self, op: LaneOp[Any], sandbox: LocalSandbox | DockerSandbox) -> None:
        """After an exec or validate (done or failed): if it took over the sandbox's lapsed uid claim, the
        state names the new holder, whom its later ops and its cleanup check the claim against."""
        if op.name in (LaneName.RESET, LaneName.CLEANUP) or not isinstance(sandbox, LocalSandbox):
            return
        state = self._state_file(sandbox)
        try:
            data = json.loads(state.read_text())
        except (FileNotFoundError, ValueError):
            return
        if sandbox.uid_holder is not None and data.get("uid_holder") != sandbox.uid_holder:
            _write_atomic(state, {**data, "uid_holder": sandbox.uid_holder})

    def check_incarnation(self, op: LaneOp[Any]) -> None:
        """Refuse (`OlderIncarnation`) an op other than a cleanup on a sandbox of an incarnation older than
        the newest one of its run seen on this host; a reset makes its own incarnation the newest seen."""
        incarnation = incarnation_of(op.handle.id)
        newest_file = self._newest_file(op.handle)
        if op.name is LaneName.CLEANUP or incarnation is None or newest_file is None:
            return
        if op.name is LaneName.RESET:
            newest = _raise_incarnation(newest_file, incarnation)
        else:
            newest = _incarnation(newest_file)
        if incarnation < newest:
            raise OlderIncarnation(
                f"sandbox {op.handle.id!r} is of an older incarnation of its run ({incarnation}) than the "
                f"one now driving it ({newest}): not run"
            )

    def reap_if_older(self, op: LaneOp[Any], sandbox: LocalSandbox | DockerSandbox) -> bool:
        """After a reset (done or failed): if a newer incarnation of the sandbox's run showed up while it
        ran, remove what it made (a sweep that ran meanwhile may have missed it). Whether it did."""
        incarnation = incarnation_of(op.handle.id)
        newest_file = self._newest_file(op.handle)
        if incarnation is None or newest_file is None or op.name is not LaneName.RESET:
            return False
        if incarnation >= _incarnation(newest_file):
            return False
        asyncio.run(sandbox.cleanup())
        self._state_file(sandbox).unlink(missing_ok=True)
        return True

    def sweep(self, root: Path, incarnation: int) -> Found:
        """Remove, from the run's sandbox directory `root` on this host, every sandbox of an incarnation
        older than the newest one seen there (`incarnation` at least); logged in one line when anything
        was found. Only entries named as an attempt's sandbox are looked at (`is_attempt_sandbox`)."""
        found = Found()
        factory = self._factory(root.resolve())
        root = factory.base_dir
        newest = _raise_incarnation(root / STATE_DIR / INCARNATION_FILE, incarnation)
        states = root / STATE_DIR
        dead = sorted(
            entry
            for entry in {p.name for p in root.iterdir() if not p.name.startswith(".")}
            | {p.name.split(".json", 1)[0] for p in states.glob("*.json*")}
            if is_attempt_sandbox(entry) and (incarnation_of(entry) or 0) < newest
        )
        for name in dead:
            self._remove_dead(factory, name, found)
        if found.sandboxes:
            log.warning(
                "removed what older incarnations of the run left in %s on %s: %s", root, self.host, found
            )
        return found

    def sweep_docker(self, run: str, incarnation: int) -> Found:
        """Remove this host's docker sandboxes of run `run` of an incarnation older than the newest one of
        the run seen here (`incarnation` at least): their containers, listed by the run's label alone (so
        never another run's), and their state files; logged in one line when any went."""
        if self.docker is None or self.state_dir is None:
            raise LaneOpError(
                f"sweep.run: run {run!r} has docker sandboxes; start this worker with --docker-image"
            )
        newest = _raise_incarnation(self._run_file(run), incarnation)

        def older(attempt: object) -> bool:
            return (
                isinstance(attempt, str)
                and is_attempt_sandbox(attempt)
                and (incarnation_of(attempt) or 0) < newest
            )

        removed = self.docker.remove_run_containers(run, older)
        dead = set(removed)
        for state in self.state_dir.glob("*.json"):  # also a state whose container went another way
            with contextlib.suppress(OSError, ValueError, AttributeError):
                data = json.loads(state.read_text())
                if data.get("run") == run and older(data.get("attempt")):
                    dead.add(data["attempt"])
        for attempt in dead:
            name = self.docker.create(attempt).container_name
            for stale in self.state_dir.glob(f"{name}.json*"):
                stale.unlink(missing_ok=True)
        found = Found(sandboxes=len(dead), containers=len(removed))
        if found:
            log.warning("removed what older incarnations of run %s left on %s: %s", run, self.host, found)
        return found

    # -- internals ----------------------------------------------------------------------------------

    def _remove_dead(self, factory: LocalSandboxFactory, name: str, found: Found) -> None:
        """One dead sandbox: its processes, cgroups, uid claim (if still its own), work dir and state."""
        sandbox = factory.create(name)
        state = _local_state(sandbox)
        with contextlib.suppress(ValueError, KeyError, TypeError):  # half a state: what is on disk goes
            _adopt_state(sandbox, state, with_task=False)
        # Its uid's processes are killed, and the claim dropped, only while the claim names the holder
        # its reset gave it (`LocalSandbox.cleanup`): a worker restarted since lost its claims, and
        # another sandbox may hold that uid now.
        uids, uid, holder = factory.uids, sandbox.uid, sandbox.uid_holder
        if (
            uids is not None
            and uid is not None
            and holder is not None
            and claim_names(uids.claims, uid, holder)
        ):
            found.uid_claims += 1
        groups = [] if sandbox.pids_group is None else [sandbox.pids_group]
        parent = pids_parent(CGROUP_ROOT)
        if parent is not None:  # a reset killed before it wrote the state: its group by name
            tag = leftovers.sandbox_group_name(name, factory.base_dir, 0).rsplit("-", 1)[0]
            groups += [PidsGroup(p, parent[1]) for p in parent[0].glob(f"{tag}-*")
                       if sandbox.pids_group is None or p != sandbox.pids_group.path]  # fmt: skip
        for group in groups:
            if group.path.exists():
                found.processes += len(group.pids())
                group.kill_all()
                group.remove()
                found.cgroups += 1
        sandbox.pids_group = None
        found.processes += leftovers.kill_in(sandbox.work_dir)
        asyncio.run(sandbox.cleanup())
        for stale in state.parent.glob(f"{state.name}*"):
            stale.unlink(missing_ok=True)
        found.sandboxes += 1

    def _local(self, handle: SandboxHandle) -> LocalSandbox:
        if not handle.work_dir:
            raise LaneOpError(f"handle.work_dir: sandbox {handle.id!r} has no work directory")
        work_dir = Path(handle.work_dir)
        sandbox = self._factory(work_dir.parent).create(handle.id)
        if sandbox.work_dir != work_dir:
            raise LaneOpError(f"handle.work_dir: {work_dir} is not where sandbox {handle.id!r} lives")
        _adopt_state(sandbox, _local_state(sandbox))
        return sandbox

    def _docker(self, handle: SandboxHandle) -> DockerSandbox:
        if self.docker is None or self.state_dir is None:
            raise LaneOpError(
                f"handle.kind: sandbox {handle.id!r} is a docker sandbox; this worker runs local ones "
                "(start it with --docker-image)"
            )
        sandbox = self.docker.create(handle.id)
        if sandbox.container_name != handle.container:
            raise LaneOpError(f"handle.container: {handle.container!r} is not sandbox {handle.id!r}'s")
        if handle.run is not None:
            self._run_file(handle.run)  # refuses a run id that is no file name
        sandbox.run = handle.run
        state = self.state_dir / f"{sandbox.container_name}.json"
        if state.exists():
            data = json.loads(state.read_text())
            sandbox.adopt(task_from_dict(data["task"]), data["container_id"])
        return sandbox

    def _newest_file(self, handle: SandboxHandle) -> Path | None:
        """Where the newest incarnation of the handle's run seen on this host is kept: beside a local
        sandbox's work dir, in the state dir for a docker sandbox's run; None when it has no such run."""
        if handle.kind == "local" and handle.work_dir:
            return Path(handle.work_dir).parent / STATE_DIR / INCARNATION_FILE
        if handle.kind == "docker" and handle.run is not None and self.state_dir is not None:
            return self._run_file(handle.run)
        return None

    def _run_file(self, run: str) -> Path:
        """The newest incarnation of docker run `run` seen on this host."""
        assert self.state_dir is not None
        if not _RUN_ID.match(run):
            raise LaneOpError(f"run {run!r}: a run id is letters, digits, '_', '-' and '.' (at most 100)")
        return self.state_dir / f"run-{run}.{INCARNATION_FILE}"

    def _state_file(self, sandbox: LocalSandbox | DockerSandbox) -> Path:
        if isinstance(sandbox, LocalSandbox):
            return _local_state(sandbox)
        assert self.state_dir is not None
        return self.state_dir / f"{sandbox.container_name}.json"

    def _factory(self, base_dir: Path) -> LocalSandboxFactory:
        factory = self._factories.get(base_dir)
        if factory is None:
            factory = LocalSandboxFactory(
                base_dir, isolation=self.isolation, claims_holder=self.owner_pid, **self.factory_options
            )
            self._factories[base_dir] = factory
        return factory


def _state_of(sandbox: LocalSandbox | DockerSandbox) -> dict[str, Any]:
    if not isinstance(sandbox, LocalSandbox):  # its run and attempt: a sweep of its run finds it
        return {"container_id": sandbox.container_id, "run": sandbox.run, "attempt": sandbox.attempt_id}
    group = sandbox.pids_group
    pids = None if group is None else {"path": str(group.path), "version": group.version}
    return {"uid": sandbox.uid, "pids_group": pids}


def _local_state(sandbox: LocalSandbox) -> Path:
    return sandbox.factory.base_dir / STATE_DIR / f"{sandbox.name}.json"


def _adopt_state(sandbox: LocalSandbox, state: Path, with_task: bool = True) -> dict[str, Any]:
    """Give `sandbox` what its reset left in `state` (if there is such a file); returns that state."""
    try:
        data: dict[str, Any] = json.loads(state.read_text())
    except FileNotFoundError:
        return {}
    group = data["pids_group"]
    holder = data.get("uid_holder")
    sandbox.adopt(
        task_from_dict(data["task"]) if with_task else None,
        data["uid"],
        None if group is None else PidsGroup(Path(group["path"]), group["version"]),
        holder if isinstance(holder, int) else None,
    )
    return data


def _incarnation(path: Path) -> int:
    """The newest incarnation of a run seen on this host, as kept in `path` (0: none)."""
    try:
        return int(path.read_text() or 0)
    except (OSError, ValueError):
        return 0


def _raise_incarnation(path: Path, incarnation: int) -> int:
    """Make `incarnation` the newest seen in `path` unless a newer one was; returns the newest. Under a
    lock on the file: two processes raising it at once never lower it."""
    path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        text = os.pread(fd, 32, 0).decode().strip()
        newest = int(text) if text.isdigit() else 0
        if incarnation > newest:
            data = str(incarnation).encode()
            os.ftruncate(fd, 0)
            os.pwrite(fd, data, 0)
            newest = incarnation
        return newest
    finally:
        os.close(fd)


def _write_atomic(path: Path, data: Mapping[str, Any]) -> None:
    path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
    tmp = path.with_name(f"{path.name}.{os.getpid()}.tmp")
    tmp.write_text(json.dumps(data))
    tmp.replace(path)
