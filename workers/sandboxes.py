"""A host's sandboxes, as a lane worker sees them: rebuilt from a `SandboxHandle` for each op.

A worker's ops run in several pool processes, and a sandbox's ops may land in any of them (or in a
restarted one). So a sandbox's state lives on the host, not in a process: its work directory, and a
small state file beside it written after `reset` (the task, the uid claim, the pids cgroup) and removed
after `cleanup`. Every op rebuilds the `LocalSandbox` from the handle and that file.

Invariants:
- an op for a sandbox whose handle names another host, or another kind than `local`, is refused;
- the work directory of the rebuilt sandbox is exactly the handle's `work_dir`;
- state is written atomically (a reader never sees half a file);
- a sandbox's uid claim is held by the worker's main process, which outlives any pool process.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Literal

from app.lanes.base import LaneName
from app.lanes.ops import LaneOp, LaneOpError, SandboxHandle, task_from_dict
from app.sandboxes.limits import PidsGroup
from app.sandboxes.local import LocalSandbox, LocalSandboxFactory

STATE_DIR = ".corral-state"


class HostSandboxes:
    """Local sandboxes of this host, one factory per base directory (a handle's work dir's parent)."""

    def __init__(
        self,
        host: str,
        isolation: Literal["auto", "bwrap", "none"] = "auto",
        owner_pid: int | None = None,
        **factory_options: Any,
    ) -> None:
        self.host = host
        # Sandbox uid claims name this process (the worker's main process), not the pool process
        # that ran the reset: a claim lapses when its holder dies, and pool processes may be replaced.
        self.owner_pid = owner_pid if owner_pid is not None else os.getpid()
        self.isolation = isolation
        self.factory_options = factory_options
        self._factories: dict[Path, LocalSandboxFactory] = {}

    def resolve(self, handle: SandboxHandle) -> LocalSandbox:
        if handle.host != self.host:
            raise LaneOpError(
                f"handle.host: sandbox {handle.id!r} lives on {handle.host!r}, not {self.host!r}"
            )
        if handle.kind != "local":
            raise LaneOpError(f"handle.kind: {handle.kind!r} sandboxes do not run on lane workers yet")
        if not handle.work_dir:
            raise LaneOpError(f"handle.work_dir: sandbox {handle.id!r} has no work directory")
        work_dir = Path(handle.work_dir)
        sandbox = self._factory(work_dir.parent).create(handle.id)
        if sandbox.work_dir != work_dir:
            raise LaneOpError(f"handle.work_dir: {work_dir} is not where sandbox {handle.id!r} lives")
        state = _state_path(sandbox)
        if state.exists():
            data = json.loads(state.read_text())
            group = data["pids_group"]
            sandbox.adopt(
                task_from_dict(data["task"]),
                data["uid"],
                None if group is None else PidsGroup(Path(group["path"]), group["version"]),
            )
        return sandbox

    def after(self, op: LaneOp[Any], sandbox: LocalSandbox) -> None:
        """Keep what the next op of this sandbox needs: state after `reset`, nothing after `cleanup`."""
        state = _state_path(sandbox)
        if op.name is LaneName.CLEANUP:
            state.unlink(missing_ok=True)
        elif op.name is LaneName.RESET:
            uids = sandbox.factory.uids
            if sandbox.uid is not None and uids is not None:
                uids.hand_over(sandbox.uid, self.owner_pid)
            group = sandbox.pids_group
            pids = None if group is None else {"path": str(group.path), "version": group.version}
            _write_atomic(state, {"task": op.args["task"], "uid": sandbox.uid, "pids_group": pids})

    def _factory(self, base_dir: Path) -> LocalSandboxFactory:
        factory = self._factories.get(base_dir)
        if factory is None:
            factory = LocalSandboxFactory(base_dir, isolation=self.isolation, **self.factory_options)
            self._factories[base_dir] = factory
        return factory


def _state_path(sandbox: LocalSandbox) -> Path:
    return sandbox.factory.base_dir / STATE_DIR / f"{sandbox.name}.json"


def _write_atomic(path: Path, data: Mapping[str, Any]) -> None:
    path.parent.mkdir(mode=0o700, exist_ok=True)
    tmp = path.with_name(f"{path.name}.{os.getpid()}.tmp")
    tmp.write_text(json.dumps(data))
    tmp.replace(path)
