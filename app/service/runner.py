"""The run manager's entry point for a Celery orchestrator worker (`workers.orchestrator` calls it).

`run_orchestrator(run_id, settings)` drives one stored run in this process until it ends: from its
start, or resumed (a redelivered task after a worker died: the groups its predecessor left open are
discarded as `orphaned`, see app.service.manager). The worker's task holds the run's lease meanwhile,
so no two processes drive one run.
"""

from __future__ import annotations

from typing import Any

from app.metrics import CorralMetrics
from app.service.manager import RunManager
from app.service.ports import lanes_for
from app.service.store import ServiceStore
from app.settings import Settings
from app.store.models import TERMINAL_RUN_STATES, RunState


def run_orchestrator(run_id: str, settings: Settings) -> dict[str, Any]:
    store = ServiceStore(settings.database_url)
    try:
        record = store.get_run(run_id)
        if record is None:
            raise LookupError(f"no run {run_id!r} in {settings.database_url}")
        if RunState(record.state) in TERMINAL_RUN_STATES:
            return {"run_id": run_id, "state": record.state, "batches": None}  # a redelivery after its end
        manager = RunManager(
            store, settings.data_dir, settings.ack_timeout_s, CorralMetrics(), lanes_for(settings)
        )
        handle = manager.adopt(run_id)
        handle.join()
        manager.shutdown()
        return {"run_id": run_id, "state": handle.state.value, "batches": handle.recorder.view.batches}
    finally:
        store.close()
