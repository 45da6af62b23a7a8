"""Prometheus multiprocess mode in Celery workers: a pool process's live gauges stop counting when it
is gone (app.metrics sums `livesum` gauges over live processes only).

A pool process that exits normally marks itself dead on its way out (`worker_process_shutdown` runs in
the exiting process); one that is killed (`kill -9`, the OOM killer) runs nothing, so every new pool
process first sweeps the files of processes of this host that no longer exist (Celery starts a
replacement for a killed one at once). The worker's main process holds the directory
(`hold_multiprocess_dir`) from its start, so a `corral serve` starting meanwhile does not empty it. No-op
unless `PROMETHEUS_MULTIPROC_DIR` is set.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

from celery.signals import worker_init, worker_process_init, worker_process_shutdown

from app.metrics import hold_multiprocess_dir, mark_process_dead, multiprocess_dir

_LIVE_FILE = re.compile(r"^gauge_live\w*_(\d+)\.db$")


def sweep_dead(path: Path) -> list[int]:
    """Mark dead every process with live-gauge files in `path` that no longer runs; returns their pids."""
    dead = []
    for entry in path.iterdir():
        found = _LIVE_FILE.match(entry.name)
        if found is None:
            continue
        pid = int(found.group(1))
        if pid not in dead and not Path(f"/proc/{pid}").exists():
            mark_process_dead(pid)
            dead.append(pid)
    return dead


@worker_init.connect  # type: ignore[untyped-decorator]
def _hold_on_start(**_: Any) -> None:
    hold_multiprocess_dir()


@worker_process_init.connect  # type: ignore[untyped-decorator]
def _sweep_on_start(**_: Any) -> None:
    path = multiprocess_dir()
    if path is not None and Path(path).is_dir():
        sweep_dead(Path(path))


@worker_process_shutdown.connect  # type: ignore[untyped-decorator]
def _mark_on_exit(pid: int, **_: Any) -> None:
    mark_process_dead(pid)
