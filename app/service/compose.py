"""What `corral serve` and an orchestrator worker build from their settings: the store and the run
manager, with the store's waits for a database that is away (`CORRAL_STORE_OUTAGE_S`,
`CORRAL_SQLITE_BUSY_TIMEOUT_S`) and the store sink's buffer and retries (`CORRAL_STORE_BUFFER`,
`CORRAL_SINK_RETRY_MAX_S`) passed in, never read from module constants."""

from __future__ import annotations

from app.metrics import CorralMetrics
from app.service.manager import RunManager
from app.service.ports import lanes_for
from app.service.store import ServiceStore
from app.settings import Settings


def store_for(settings: Settings, migrate: bool = True) -> ServiceStore:
    return ServiceStore(
        settings.database_url,
        migrate=migrate,
        outage_s=settings.store_outage_s,
        busy_timeout_s=settings.sqlite_busy_timeout_s,
    )


def manager_for(settings: Settings, store: ServiceStore, metrics: CorralMetrics | None = None) -> RunManager:
    return RunManager(
        store,
        settings.data_dir,
        settings.ack_timeout_s,
        metrics,
        lanes_for(settings),
        spill_dir=settings.spill_dir,
        spill_max_bytes=settings.spill_max_bytes,
        store_buffer=settings.store_buffer,
        sink_retry_max_s=settings.sink_retry_max_s,
        max_runs=settings.max_runs,
    )
