"""The Celery app: lane work on per-lane, per-host queues, and run orchestrators on one queue.

Queues: `lane.<host>.<lane>` (e.g. `lane.host-a.exec`) for sandbox operations, `orchestrator` for the
run orchestrator. A sandbox lives on one host, so every op of it goes to that host's queue of the op's
lane; a worker consumes exactly one lane of one host.

Delivery: late acks, a prefetch of 1 and redelivery when a pool process dies mid-task, so a lost worker
never loses an op; tasks are idempotent by op id (the op id is the Celery task id, and a redelivered op
whose result is already stored returns that result). On Redis a message not acked within the
visibility timeout is delivered again, so the timeout is set above the longest op. A revoked op is
recorded in the result backend, and refused by whatever worker it is delivered to afterwards.

The app is built by `make_celery` from explicit URLs, in each entry point, with the configuration
clients use too (`app.lanes.celery.make_celery`); nothing reads the environment at import time.
"""

from __future__ import annotations

from celery import Celery
from pydantic import Field
from pydantic_settings import BaseSettings, SettingsConfigDict

from app.lanes.base import LaneName
from app.lanes.celery import (
    LANE_OP_TASK,
    LANE_SWEEP_TASK,
    ORCHESTRATOR_QUEUE,
    ORCHESTRATOR_TASK,
    broker_urls,
    cancelled_key,
    check_lane_host,
    lane_queue,
)
from app.lanes.celery import make_celery as make_client
from app.lanes.ops import LaneOpError

__all__ = [
    "LANE_OP_TASK",
    "LANE_SWEEP_TASK",
    "ORCHESTRATOR_QUEUE",
    "ORCHESTRATOR_TASK",
    "BrokerError",
    "BrokerSettings",
    "cancelled_key",
    "check_host",
    "make_celery",
    "queue_name",
    "reach_problem",
]


class BrokerError(ValueError):
    """Broker settings that cannot work; the message names the variable."""


class BrokerSettings(BaseSettings):
    """Where Celery messages and results go (environment prefix `CORRAL_`)."""

    model_config = SettingsConfigDict(env_prefix="CORRAL_", extra="ignore", frozen=True)

    broker_url: str | None = Field(None, description="redis:// or amqp://; unset means in-process lanes")
    result_backend: str | None = Field(
        None, description="where op results are kept; defaults to the broker when it is Redis"
    )

    def urls(self) -> tuple[str, str]:
        """(broker, result backend); raises `BrokerError` naming the variable at fault."""
        try:
            return broker_urls(self.broker_url, self.result_backend)
        except LaneOpError as exc:
            raise BrokerError(str(exc)) from None


# How long `corral worker` waits for the broker (and a Redis result backend) to answer before it refuses
# to start: Celery itself would retry 100 times over many minutes, a multi-line warning each time.
REACH_TIMEOUT_S = 5.0


def reach_problem(url: str, variable: str, timeout_s: float = REACH_TIMEOUT_S) -> str | None:
    """Why the broker or result backend at `url` cannot be reached now (one line naming `variable`, the
    password hidden), or None. One connection attempt, no retries."""
    from kombu.connection import Connection

    from app.validation import hide_password

    try:
        with Connection(url, connect_timeout=timeout_s) as conn:  # type: ignore[no-untyped-call]
            conn.ensure_connection(max_retries=0, timeout=timeout_s)
    except Exception as exc:  # kombu and its transports raise their own kinds
        reason = " ".join(str(exc).split()) or type(exc).__name__
        return f"{variable} {hide_password(url)}: cannot connect ({reason})"
    return None


def queue_name(host: str, lane: LaneName | str) -> str:
    """The queue of one lane on one host."""
    return lane_queue(check_host(host), LaneName(lane))


def check_host(host: str) -> str:
    try:
        return check_lane_host(host)
    except LaneOpError as exc:
        raise BrokerError(str(exc)) from None


def make_celery(broker_url: str, result_backend: str) -> Celery:
    """The workers' app: the clients' configuration plus the task modules."""
    return make_client(
        broker_url,
        result_backend,
        include=["workers.lane_tasks", "workers.orchestrator", "workers.metrics_hooks"],
    )
