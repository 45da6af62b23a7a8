"""Process settings for `corral serve` (and workers): one pydantic-settings object, environment prefix
`CORRAL_`, built in the app factory and injected — never read at import time.

Run policy (B, G, S, K, lanes) is not here: it belongs to each run's config (`app.service.schemas`).

Each default has one source: a field whose default is also the default of the code it is passed to
takes that code's constant (`OUTAGE_S`, `SQLITE_BUSY_TIMEOUT_S` of app.store.db, `RETRY_MAX_S` of
app.runtime.events), or that code imports the constant from here (`STORE_BUFFER`, `SPILL_MAX_BYTES`,
for the run manager, which this module cannot import: it imports this one).
"""

from __future__ import annotations

import re
import secrets
from pathlib import Path
from typing import Literal

from pydantic import Field, ValidationInfo, field_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

from app.runtime.events import RETRY_MAX_S
from app.store.db import OUTAGE_S, SQLITE_BUSY_TIMEOUT_S, in_memory_sqlite
from app.validation import hide_password

# The database drivers installed with Corral: SQLite's own and psycopg 3 (`postgresql://` means it).
_WHOLE = re.compile(r"[+-]?[0-9]+")
DATABASE_SCHEMES = ("sqlite", "sqlite+pysqlite", "postgresql", "postgresql+psycopg")


MIN_ACK_TIMEOUT_S = 0.1
# The store sink's longest pause between tries of a batch the database refused: 1e-300 was taken, and a
# sink tried its batch 11,000 times a second, a warning each, while the database was away.
MIN_SINK_RETRY_S = 0.1
MIN_SPILL_BYTES = 1024**2
# The defaults of `CORRAL_STORE_BUFFER` and `CORRAL_SPILL_MAX_BYTES`, and of the run manager's
# `store_buffer` and `spill_max_bytes`: a run's store sink holds this many events in memory; past them
# they go to the run's spill on local disk, at most this many bytes, then are dropped, counted
STORE_BUFFER = 100_000
SPILL_MAX_BYTES = 4 * 1024**3
# The default of `CORRAL_MAX_RUNS` and of the run manager's `max_runs`: the runs `corral serve` executes
# at once. Each is a thread and an event loop in the server's one process (and a local run's engine
# processes and sandboxes beside it); nothing bounded them, and every `POST /api/runs` started one more.
MAX_RUNS = 8


def _default_database_url() -> str:
    return f"sqlite:///{Path.cwd() / 'corral.db'}"


class Settings(BaseSettings):
    """Where state lives, where lanes run, who may act, and where the API listens."""

    # Every number is finite: `nan` was refused as "less than or equal to 86400", `inf` by its bound.
    model_config = SettingsConfigDict(env_prefix="CORRAL_", extra="forbid", frozen=True, allow_inf_nan=False)

    database_url: str = Field(
        default_factory=_default_database_url,
        description="SQLAlchemy URL; a SQLite file is the embedded default, Postgres is for deployment",
    )
    broker_url: str | None = Field(
        None, description="Celery broker (redis:// or amqp://); unset (or empty) means in-process lanes"
    )
    result_backend: str | None = Field(
        None,
        validate_default=True,
        description="with a broker: where lane op results are kept (redis://); default: the broker, "
        "when it is Redis",
    )
    lane_hosts: str | None = Field(
        None,
        validate_default=True,
        description="with a broker: the hosts whose lane workers run sandboxes, comma-separated; "
        "default: this host's name (as `corral worker` names it)",
    )
    operator_token: str = Field(
        default_factory=lambda: secrets.token_urlsafe(24),
        min_length=8,
        description="bearer token for operator actions; generated (and printed) at start when unset",
    )
    operator_token_generated: bool = Field(False, description="set by `load_settings` when generated")
    view_token: str | None = Field(None, description="bearer token for reads; unset: reads are open")
    host: str = Field("127.0.0.1", description="address `corral serve` listens on")
    port: int = Field(8000, ge=1, le=65535)
    data_dir: Path = Field(
        default_factory=lambda: Path.cwd() / "corral-data",
        description="run work directories, weights and sandbox scratch",
    )
    # At least MIN_ACK_TIMEOUT_S: a trainer fetches and acks over HTTP, and 1e-320 offered every batch
    # again at once, forever.
    ack_timeout_s: float = Field(
        60.0,
        ge=MIN_ACK_TIMEOUT_S,
        le=86400,
        description="an offered batch not acked in this time is offered again",
    )
    command_timeout_s: float = Field(
        15.0,
        gt=0,
        le=600,
        description="with a broker: how long the API waits for the orchestrator worker of a celery run to "
        "answer an operator's command (pause, resume, weights, policy, engines) before it answers 504",
    )
    start_timeout_s: float = Field(
        600.0,
        gt=0,
        le=7 * 86400,
        description="with a broker: a celery run no orchestrator worker has taken this long after its "
        "creation, while none is live, is ended as failed, saying so",
    )
    max_runs: int = Field(
        MAX_RUNS,
        ge=1,
        le=1000,
        description="the most runs executing in this server at once (created, running, paused or stopping); "
        "a create past it is refused (429). Celery runs execute in orchestrator workers and do not count",
    )
    resume_runs: bool = Field(True, description="resume the runs that were live when the server stopped")
    runs_on_shutdown: Literal["stop", "resume"] = Field(
        "stop",
        description="what a clean stop of the server (Ctrl-C, SIGTERM) does to the runs it executes: "
        "stop each (its end recorded), or store every event each has published and leave it to the next "
        "start, which resumes it (a restart that keeps the runs)",
    )
    spill_dir: Path | None = Field(
        None,
        description="where a run's store sink keeps the events its buffer cannot hold while the database "
        "is away or slow, until it writes them (a directory on local disk); default: under each run's "
        "directory in data_dir",
    )
    spill_max_bytes: int = Field(
        SPILL_MAX_BYTES,
        ge=MIN_SPILL_BYTES,
        le=2**50,
        description="the most a run's spill holds on disk; past it, events are dropped (counted)",
    )

    # How long the store waits for a database that is away or busy; the tests shorten them here too
    store_outage_s: float = Field(
        OUTAGE_S,
        gt=0,
        le=86400,
        description="how long a run's writers wait out a database that is away or locked before a write "
        "counts as failed (the store sink tries its batch again later)",
    )
    sqlite_busy_timeout_s: float = Field(
        SQLITE_BUSY_TIMEOUT_S,
        gt=0,
        le=3600,
        description="how long one SQLite transaction waits for another writer's lock before it counts as "
        "an outage",
    )
    store_buffer: int = Field(
        STORE_BUFFER,
        ge=1,
        le=10_000_000,
        description="events a run's store sink holds in memory; past them, they go to its spill",
    )
    sink_retry_max_s: float = Field(
        RETRY_MAX_S,
        ge=MIN_SINK_RETRY_S,
        le=3600,
        description="the longest pause before the store sink tries a batch the database refused again "
        "(the pauses double from 0.5 s up to it)",
    )

    @field_validator("*", mode="before")
    @classmethod
    def _whole_numbers(cls, value: object, info: ValidationInfo) -> object:
        """A count given as text is a whole number as written: `2.0` was taken as 2 (pydantic's lax
        mode), where docs/limits.md says it is refused."""
        name = info.field_name
        annotation = cls.model_fields[name].annotation if name is not None else None
        if annotation in (int, "int") and isinstance(value, str) and not _WHOLE.fullmatch(value.strip()):
            raise ValueError(
                f"Input should be a valid integer, written without a point or exponent: {value!r}"
            )
        return value

    @field_validator("database_url")
    @classmethod
    def _known_scheme(cls, value: str) -> str:
        scheme, sep, _ = value.partition("://")
        if not sep or scheme.lower() not in DATABASE_SCHEMES:
            raise ValueError(
                f"{hide_password(value)!r}: use sqlite:///FILE or postgresql+psycopg://… (installed "
                f"drivers: {', '.join(DATABASE_SCHEMES)})"
            )
        if scheme.lower().startswith("sqlite") and in_memory_sqlite(value):
            raise ValueError(
                f"{value!r}: an in-memory database would lose every run when the server stops; "
                "give a file, e.g. sqlite:///corral.db"
            )
        return value

    @field_validator("spill_dir")
    @classmethod
    def _writable_spill_dir(cls, value: Path | None) -> Path | None:
        if value is None:
            return None
        import os

        existing = value
        while not existing.exists() and existing.parent != existing:
            existing = existing.parent
        if not existing.is_dir():
            raise ValueError(f"{str(value)!r}: {str(existing)!r} is not a directory")
        if not os.access(existing, os.W_OK | os.X_OK):
            raise ValueError(f"{str(value)!r}: {str(existing)!r} is not writable")
        return value

    @field_validator("host")
    @classmethod
    def _some_host(cls, value: str) -> str:
        if not value.strip():
            raise ValueError(
                "empty; give the address to listen on, e.g. 127.0.0.1 (0.0.0.0 listens on every interface)"
            )
        return value

    @field_validator("broker_url")
    @classmethod
    def _known_broker(cls, value: str | None) -> str | None:
        if value is None or not value.strip():
            return None
        from app.lanes.celery import broker_urls

        broker_urls(value, "redis://")  # the broker's own check; the backend's is on its field
        return value

    @field_validator("result_backend")
    @classmethod
    def _backend_for_broker(cls, value: str | None, info: ValidationInfo) -> str | None:
        broker = info.data.get("broker_url")
        if broker is None:
            return value  # in-process lanes: no results to keep
        from app.lanes.celery import broker_urls

        return broker_urls(broker, value or None)[1]

    @field_validator("lane_hosts")
    @classmethod
    def _hosts_for_broker(cls, value: str | None, info: ValidationInfo) -> str | None:
        if info.data.get("broker_url") is None:
            return value
        import socket

        from app.lanes.celery import parse_lane_hosts

        return ",".join(parse_lane_hosts(value or socket.gethostname()))

    @property
    def keeps_runs(self) -> bool:
        """Whether a clean stop of the server leaves its runs to the next start (`runs_on_shutdown`)."""
        return self.runs_on_shutdown == "resume"


def load_settings(**overrides: object) -> Settings:
    """Settings from the environment (and `overrides`), remembering whether the token was generated."""
    import os

    generated = "CORRAL_OPERATOR_TOKEN" not in os.environ and "operator_token" not in overrides
    return Settings(**overrides, operator_token_generated=generated)  # type: ignore[arg-type]
