"""The lane task: one `LaneOp` carried out by a lane worker, on its host, on its CPU set.

A lane worker (`corral worker --lane L --cpus C --host H`) consumes the queue `lane.H.L`. `configure`
sets what this worker is before Celery starts; the pool processes it forks inherit it, and each pins
itself to the lane's CPUs again in `worker_process_init`, so the CPU set holds in every pool process
whatever the pool does (restarts included).

Invariants:
- an op runs only on the worker of its lane and host (a misrouted op is refused, never run);
- the op id is the task id; a delivery of an op whose result is already stored returns that result
  without running the op again (idempotent under at-least-once delivery);
- an op its client revoked (`app.lanes.celery.cancelled_key`) is not run, whenever it is delivered: it is
  marked REVOKED and its message acked, so its attempt's end is final;
- an op on a sandbox of an older incarnation of its run than the newest seen on this host (the run was
  started again since: workers.sandboxes) is not run, marked REVOKED the same way; a reset that such a
  start overtook removes what it made;
- the op runs through `app.lanes.ops.execute_op`, as in-process lanes run it.
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from celery import Task, shared_task, states
from celery.exceptions import Ignore
from celery.signals import worker_process_init

from app.engines.embedded.cpus import pin_cpus
from app.lanes.base import LaneName
from app.lanes.ops import LaneOp, LaneOpError, encode_result, execute_op
from workers.celery_app import LANE_OP_TASK, LANE_SWEEP_TASK, cancelled_key
from workers.sandboxes import HostSandboxes, OlderIncarnation

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class LaneWorker:
    """What this worker process is: a lane of a host, on a CPU set, with the host's sandboxes."""

    lane: LaneName
    host: str
    cpus: tuple[int, ...]
    sandboxes: HostSandboxes


_worker: LaneWorker | None = None


def configure(lane: LaneName, host: str, cpus: Sequence[int], sandboxes: HostSandboxes) -> LaneWorker:
    """Make this process a lane worker and pin it (pool processes forked later inherit both)."""
    global _worker
    pin_cpus(list(cpus))
    _worker = LaneWorker(lane, host, tuple(cpus), sandboxes)
    return _worker


@worker_process_init.connect  # type: ignore[untyped-decorator]
def _pin_pool_process(**_: Any) -> None:
    if _worker is not None:
        pin_cpus(list(_worker.cpus))


@shared_task(name=LANE_OP_TASK, bind=True)  # type: ignore[untyped-decorator]
def lane_op(self: Task, data: dict[str, Any]) -> dict[str, Any]:
    if _worker is None:
        raise LaneOpError("this worker is not a lane worker (start it with `corral worker --lane`)")
    op = LaneOp.from_dict(data)
    if op.lane is not _worker.lane or op.host != _worker.host:
        raise LaneOpError(
            f"op {op.op_id} for lane {op.lane.value} on {op.host!r} reached the {_worker.lane.value} "
            f"worker of {_worker.host!r}"
        )
    if self.request.id != op.op_id:
        raise LaneOpError(f"op {op.op_id} sent as task {self.request.id}: the task id must be the op id")
    stored = self.backend.get_task_meta(op.op_id, cache=False)
    if stored.get("status") == states.SUCCESS and isinstance(stored.get("result"), dict):
        # The backend keeps the first result (it never overwrites a success), which is what we return.
        log.warning("op %s (%s) delivered again: returning its stored result", op.op_id, op.name.value)
        return {**stored["result"], "replayed": True}
    if self.backend.client.exists(cancelled_key(op.op_id)):
        # Celery's own revoke did not stop it: this worker was not up when it was sent, or has restarted
        # since (a host back, a killed worker's replacement given its unacked message after the visibility
        # timeout).
        log.warning("op %s (%s) was revoked by its client: not run", op.op_id, op.name.value)
        self.backend.mark_as_revoked(op.op_id, "revoked by its client", request=self.request)
        raise Ignore  # acked, its REVOKED state kept
    started = time.time()
    sandbox = _worker.sandboxes.resolve(op.handle)
    try:
        _worker.sandboxes.check_incarnation(op)
    except OlderIncarnation as exc:  # its run was started again since: whoever sent it is gone
        log.warning("op %s (%s): %s", op.op_id, op.name.value, exc)
        self.backend.mark_as_revoked(op.op_id, str(exc), request=self.request)
        raise Ignore from None
    try:
        result = asyncio.run(execute_op(op, sandbox, _worker.cpus))
        _worker.sandboxes.after(op, sandbox)
    finally:
        _worker.sandboxes.keep_uid_holder(op, sandbox)
        reaped = _worker.sandboxes.reap_if_older(op, sandbox)
    if reaped:
        why = f"sandbox {op.handle.id!r}: its run was started again while it was reset; removed"
        log.warning("op %s (%s): %s", op.op_id, op.name.value, why)
        self.backend.mark_as_revoked(op.op_id, why, request=self.request)
        raise Ignore
    return {
        "result": encode_result(op.name, result),
        "host": _worker.host,
        "lane": _worker.lane.value,
        "pid": os.getpid(),
        "affinity": sorted(os.sched_getaffinity(0)),
        "started_at": started,
        "ended_at": time.time(),
        "replayed": False,
    }


@shared_task(name=LANE_SWEEP_TASK)  # type: ignore[untyped-decorator]
def lane_sweep(data: dict[str, Any]) -> dict[str, int]:
    """A run's start asks this host's cleanup worker to remove what its older incarnations left: in its
    sandbox directory (`root`), or its docker containers (`run`) (`CeleryLanes.begin_incarnation`,
    workers.sandboxes)."""
    if _worker is None or _worker.lane is not LaneName.CLEANUP:
        raise LaneOpError("a sweep runs on a cleanup lane worker (`corral worker --lane cleanup`)")
    root, run, incarnation = data.get("root"), data.get("run"), data.get("incarnation")
    if not isinstance(incarnation, int) or isinstance(incarnation, bool) or incarnation <= 0:
        raise LaneOpError(f"sweep.incarnation: expected a positive integer, got {incarnation!r}")
    if run is not None:  # a run of docker sandboxes: its containers, by its label
        if not isinstance(run, str) or root is not None:
            raise LaneOpError(f"sweep.run: expected a run id (and no root), got {run!r}")
        return dict(vars(_worker.sandboxes.sweep_docker(run, incarnation)))
    if not isinstance(root, str) or not os.path.isabs(root):
        raise LaneOpError(f"sweep.root: expected an absolute path, got {root!r}")
    return dict(vars(_worker.sandboxes.sweep(Path(root), incarnation)))
