"""What the dashboard needs from whoever owns the runs, as a Protocol, plus the replay store.

`RunsBackend` is implemented over the live run manager (app.web.live) and by `ReplayStore`, which
holds loaded `corral sim` / `corral run` reports. The dashboard asks both; replay ids start with
`replay-`, and replays refuse every action (they are read-only).
"""

from __future__ import annotations

import json
import math
import sys
import threading
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Protocol

from app.web.readmodel import ReportError, RunSummary, RunView, view_from_report

MAX_REPORT_BYTES = 64 * 1024 * 1024


class ActionRefused(Exception):
    """An action that cannot be done on this run (a replay, an ended run); the message says why.
    `status`: 409, or 503/504 for a run whose orchestrator worker could not be reached or did not
    answer in time."""

    def __init__(self, message: str, status: int = 409) -> None:
        super().__init__(message)
        self.status = status


class RunsBackend(Protocol):
    def run_ids(self) -> list[str]: ...

    def view(self, run_id: str) -> RunView | None:
        """The run's current view, or None when this backend does not know the run."""
        ...

    def summaries(self) -> list[RunSummary]:
        """A runs-page row for every run, from counters: it must not replay any run's stream."""
        ...

    def version(self, run_id: str) -> int:
        """Changes whenever the run's view would: the live stream re-renders only then."""
        ...

    async def launch(self, form: Mapping[str, str], actor: str) -> str:
        """Start a run from the launch form's fields; ValueError names a bad field."""
        ...

    async def publish(self, run_id: str, actor: str) -> None: ...

    async def set_policy(
        self, run_id: str, changes: Mapping[str, float], actor: str, large: bool = False
    ) -> None:
        """Change the run's policy live; `large`: the operator confirmed an S that lets many times the
        trajectories run (the server refuses one unconfirmed)."""
        ...

    async def pause(self, run_id: str, actor: str) -> None: ...

    async def resume(self, run_id: str, actor: str) -> None: ...

    async def stop(self, run_id: str, actor: str) -> None: ...

    async def rotate(self, run_id: str, engine: str, into: bool, actor: str) -> None:
        """Put `engine` back into rotation (`into`), or take it out (a drain)."""
        ...


def _not_a_number(name: str) -> float:
    raise ReportError(f"report: {name} is not a number (a report is strict JSON)")


# No figure of a run comes near it (1e15 seconds is 30 million years; tokens, counts and ids stay far
# below), and sums of up to millions of such numbers stay finite: two 1e308 batch times overflowed the
# page's mean (a 500), and a timeline width came out NaN.
MAX_REPORT_NUMBER = 1e15


def _finite(text: str) -> float:
    value = float(text)
    if not math.isfinite(value):
        raise ReportError(f"report: {text} is out of range for a number")
    _check_bound(value, text)
    return value


def _whole(text: str) -> int:
    value = int(text)  # a ValueError past Python's digit limit is answered by `add_json`
    _check_bound(value, text)
    return value


def _check_bound(value: float, text: str) -> None:
    if abs(value) > MAX_REPORT_NUMBER:
        raise ReportError(f"report: {text} is beyond any run's figures (at most {MAX_REPORT_NUMBER:g})")


class ReplayStore:
    """Loaded reports, browsed like runs. Thread-safe; views are built once per report."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._views: dict[str, RunView] = {}
        self._next = 1

    def add(self, report: Mapping[str, Any], label: str) -> str:
        with self._lock:
            run_id = f"replay-{self._next}"
            self._next += 1
        view = view_from_report(run_id, report, label=label)
        with self._lock:
            self._views[run_id] = view
        return run_id

    def add_json(self, data: bytes, label: str) -> str:
        if len(data) > MAX_REPORT_BYTES:
            raise ReportError(f"report: larger than {MAX_REPORT_BYTES // (1024 * 1024)} MiB")
        try:
            report = json.loads(data, parse_constant=_not_a_number, parse_float=_finite, parse_int=_whole)
        except (UnicodeDecodeError, json.JSONDecodeError) as exc:
            raise ReportError(f"report: not JSON ({exc})") from exc
        except RecursionError:
            raise ReportError("report: not a report (JSON nested too deeply)") from None
        except ReportError:
            raise
        except ValueError:  # an integer longer than Python reads: the upload was a 500
            digits = sys.get_int_max_str_digits()
            raise ReportError(f"report: a number has more than {digits} digits") from None
        return self.add(report, label)

    def add_file(self, path: Path) -> str:
        return self.add_json(path.read_bytes(), path.name)

    def run_ids(self) -> list[str]:
        with self._lock:
            return list(self._views)

    def view(self, run_id: str) -> RunView | None:
        with self._lock:
            return self._views.get(run_id)

    def summaries(self) -> list[RunSummary]:
        with self._lock:
            views = list(self._views.values())
        return [v.summary() for v in views]

    def version(self, run_id: str) -> int:
        return 0

    async def launch(self, form: Mapping[str, str], actor: str) -> str:
        raise ActionRefused("replays cannot launch runs")

    async def publish(self, run_id: str, actor: str) -> None:
        raise ActionRefused("a replay is read-only")

    async def set_policy(
        self, run_id: str, changes: Mapping[str, float], actor: str, large: bool = False
    ) -> None:
        raise ActionRefused("a replay is read-only")

    async def pause(self, run_id: str, actor: str) -> None:
        raise ActionRefused("a replay is read-only")

    async def resume(self, run_id: str, actor: str) -> None:
        raise ActionRefused("a replay is read-only")

    async def stop(self, run_id: str, actor: str) -> None:
        raise ActionRefused("a replay is read-only")

    async def rotate(self, run_id: str, engine: str, into: bool, actor: str) -> None:
        raise ActionRefused("a replay is read-only")
