"""A host's sandboxes, as a lane worker sees them: rebuilt from a `SandboxHandle` for each op.

A worker's ops run in several pool processes, and a sandbox's ops may land in any of them (or in a
restarted one). So a sandbox's state lives on the host, not in a process: its work directory or
container, and a small state file written after `reset` and removed after `cleanup` — beside the work
dirs for local sandboxes (`<base dir>/.corral-state/`: the task, the uid claim, the pids cgroup), in the
worker's state directory for docker sandboxes (the task, the container id). Every op rebuilds the
sandbox from the handle and that file.

Invariants:
- an op for a sandbox whose handle names another host, or a kind this worker does not run, is refused;
- the rebuilt sandbox is exactly the one the handle names (same work dir, or same container name);
- state is written atomically (a reader never sees half a file);
- a sandbox's uid claim is held by the worker's main process, which outlives any pool process.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

from app.lanes.base import LaneName
from app.lanes.ops import LaneOp, LaneOpError, SandboxHandle, task_from_dict
from app.sandboxes.limits import PidsGroup
from app.sandboxes.local import LocalSandbox, LocalSandboxFactory

if TYPE_CHECKING:
    from app.sandboxes.docker import DockerSandbox, DockerSandboxFactory

STATE_DIR = ".corral-state"


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
        if isinstance(sandbox, LocalSandbox):
            state = _local_state(sandbox)
        else:
            assert self.state_dir is not None
            state = self.state_dir / f"{sandbox.container_name}.json"
        if op.name is LaneName.CLEANUP:
            state.unlink(missing_ok=True)
        elif op.name is LaneName.RESET:
            if isinstance(sandbox, LocalSandbox) and sandbox.uid is not None and sandbox.factory.uids:
                sandbox.factory.uids.hand_over(sandbox.uid, self.owner_pid)
            _write_atomic(state, {"task": op.args["task"], **_state_of(sandbox)})

    # -- internals ----------------------------------------------------------------------------------

    def _local(self, handle: SandboxHandle) -> LocalSandbox:
        if not handle.work_dir:
            raise LaneOpError(f"handle.work_dir: sandbox {handle.id!r} has no work directory")
        work_dir = Path(handle.work_dir)
        sandbox = self._factory(work_dir.parent).create(handle.id)
        if sandbox.work_dir != work_dir:
            raise LaneOpError(f"handle.work_dir: {work_dir} is not where sandbox {handle.id!r} lives")
        state = _local_state(sandbox)
        if state.exists():
            data = json.loads(state.read_text())
            group = data["pids_group"]
            sandbox.adopt(
                task_from_dict(data["task"]),
                data["uid"],
                None if group is None else PidsGroup(Path(group["path"]), group["version"]),
            )
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
        state = self.state_dir / f"{sandbox.container_name}.json"
        if state.exists():
            data = json.loads(state.read_text())
            sandbox.adopt(task_from_dict(data["task"]), data["container_id"])
        return sandbox

    def _factory(self, base_dir: Path) -> LocalSandboxFactory:
        factory = self._factories.get(base_dir)
        if factory is None:
            factory = LocalSandboxFactory(base_dir, isolation=self.isolation, **self.factory_options)
            self._factories[base_dir] = factory
        return factory


def _state_of(sandbox: LocalSandbox | DockerSandbox) -> dict[str, Any]:
    if not isinstance(sandbox, LocalSandbox):
        return {"container_id": sandbox.container_id}
    group = sandbox.pids_group
    pids = None if group is None else {"path": str(group.path), "version": group.version}
    return {"uid": sandbox.uid, "pids_group": pids}


def _local_state(sandbox: LocalSandbox) -> Path:
    return sandbox.factory.base_dir / STATE_DIR / f"{sandbox.name}.json"


def _write_atomic(path: Path, data: Mapping[str, Any]) -> None:
    path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
    tmp = path.with_name(f"{path.name}.{os.getpid()}.tmp")
    tmp.write_text(json.dumps(data))
    tmp.replace(path)
