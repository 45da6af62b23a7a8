"""Which lanes a run gets: in-process lanes (the embedded default, no broker) or Celery lanes.

One function so that every composition root (`corral serve`'s run ports, `corral run`) decides the
same way from the same settings: `CORRAL_BROKER_URL` unset means in-process lanes with the run's own
slots and CPU sets; set, the run's sandbox ops go to the lane workers of `CORRAL_LANE_HOSTS`, whose
pool sizes and CPU sets are the workers' (`corral worker --lane L --cpus C --concurrency N`).
"""

from __future__ import annotations

from app.core.config import LanesConfig
from app.lanes.base import Lanes
from app.lanes.inprocess import InProcessLanes
from app.lanes.ops import LaneOpError


def choose_lanes(
    config: LanesConfig,
    pinned: bool,
    broker_url: str | None = None,
    result_backend: str | None = None,
    lane_hosts: str | None = None,
    start_timeout_s: float | None = 900.0,
) -> Lanes:
    """In-process lanes from `config` without a broker; otherwise `CeleryLanes` on `lane_hosts`
    (comma-separated), results in `result_backend` (default: the broker, when it is Redis)."""
    if broker_url is None:
        return InProcessLanes.from_config(config, pinned)
    from app.lanes.celery import CeleryLanes, broker_urls, parse_lane_hosts

    broker, backend = broker_urls(broker_url, result_backend)
    if not lane_hosts:
        raise LaneOpError("CORRAL_LANE_HOSTS is not set: name the hosts whose lane workers run sandboxes")
    return CeleryLanes.connect(broker, backend, parse_lane_hosts(lane_hosts), start_timeout_s=start_timeout_s)
