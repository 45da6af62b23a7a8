"""What `corral serve` holds for a run does not grow with the run's stream, nor with the runs it ran:
a rollout log capped at the newest finished rollouts, simulated draws not cached, and an ended run's
recent events let go once the store has them. (The gateway's acked batches: test_gateway.py.)"""

from __future__ import annotations

from pathlib import Path

import pytest
from prometheus_client import CollectorRegistry

import app.service.handle
from app.core.events import EngineUpdateBegin, EngineUpdateEnd, Envelope, RunStarted, VersionPublished
from app.metrics import CorralMetrics
from app.service.manager import RunManager
from app.service.ports import open_ports, run_policy
from app.service.rollouts import RolloutLog
from app.service.schemas import RunCreate
from app.service.store import ServiceStore


def test_the_rollout_log_keeps_a_bounded_number_of_finished_rollouts() -> None:
    # Every version of the run was kept, with each engine's step: a sentinel run publishes one a step.
    log = RolloutLog(keep=8)
    seq = 0

    def feed(t: float, event: object) -> None:
        nonlocal seq
        log.on_envelope(Envelope("r", seq, t, event))  # type: ignore[arg-type]
        seq += 1

    feed(0.0, RunStarted(engines=("e0",)))
    for version in range(1, 101):
        feed(version, VersionPublished(version, None, "trainer"))
        feed(version + 0.1, EngineUpdateBegin("e0", version))
        feed(version + 0.2, EngineUpdateEnd("e0", version))
    assert len(log.rollouts) <= 2 * 8 + 1
    assert len(log.steps) <= 2 * 8 + 1
    assert log.newest == 100
    assert log.rollouts[100].state == "completed"
    assert log.forgot(1)
    assert not log.forgot(100)
    assert not log.forgot(101)  # never published: a 404, not the store's
    feed(200.0, EngineUpdateEnd("e0", 1))  # a late word on a forgotten version brings nothing back
    assert 1 not in log.rollouts


async def test_a_simulated_run_of_the_service_keeps_no_draw(tmp_path: Path) -> None:
    spec = RunCreate.model_validate({"kind": "sim"})
    async with open_ports(spec, run_policy(spec), tmp_path) as ports:
        trajectories = ports.source.trajectories  # type: ignore[attr-defined]
        first = [trajectories.trajectory(group, 0) for group in range(500)]
        assert trajectories._cache == {}
        assert [trajectories.trajectory(group, 0) for group in range(500)] == first  # seeded: the same


def test_an_ended_run_lets_go_of_its_recent_events_and_the_store_answers(tmp_path: Path) -> None:
    # Each ended run kept up to 40,000 timeline rows (about 12 MB) for the server's life.
    store = ServiceStore(f"sqlite:///{tmp_path / 'corral.db'}")
    manager = RunManager(store, tmp_path / "data", 30.0, CorralMetrics(CollectorRegistry()))
    try:
        spec = {"kind": "sim", "speed": 1000.0, "trainer": "sentinel", "batches": 3}
        run_id = manager.create(RunCreate.model_validate(spec))
        handle = manager.handles[run_id]
        assert handle.join(60), "the run did not end"
        assert handle.recorder.recent.since(-1, 10) is None
        assert handle.recorder.recent._rows == []
        events = handle.recorder.view.events
        stored = store.timeline(run_id, -1, 100_000)
        assert len(stored) == events > 0
    finally:
        manager.shutdown(10)
        store.close()


def test_a_service_run_keeps_a_bounded_runtime_history_and_folds_no_report(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The runtime kept every batch, update and engine event, and folded the run's report (a few
    # hundred bytes a batch) that `corral serve` never builds: 2.5 MB after 61,000 events, growing.
    monkeypatch.setattr(app.service.handle, "RUNTIME_HISTORY", 3)
    store = ServiceStore(f"sqlite:///{tmp_path / 'corral.db'}")
    manager = RunManager(store, tmp_path / "data", 30.0)
    try:
        spec = {"kind": "sim", "speed": 1000.0, "trainer": "sentinel", "batches": 20}
        handle = manager.handles[manager.create(RunCreate.model_validate(spec))]
        assert handle.join(60), "the run did not end"
        runtime = handle.runtime
        assert runtime is not None
        assert handle.recorder.view.batches == 20
        assert 3 <= len(runtime.state.batches) <= 6
        assert all(len(e.versions) <= 6 for e in runtime.state.engines.values())
        assert len(runtime.state.update_log) <= 6
        assert runtime.report_acc.batches == []
    finally:
        manager.shutdown(10)
        store.close()


def test_the_server_lets_go_of_the_handles_of_runs_ended_before_the_latest(tmp_path: Path) -> None:
    # Every ended run kept its whole handle (gateway, recorder, runtime: about 0.6 MB) for the server's
    # life. Past the latest KEEP_ENDED_HANDLES, an ended run answers from the store, as after a restart.
    from app.service.manager import KEEP_ENDED_HANDLES
    from app.web.live import ManagerRuns

    store = ServiceStore(f"sqlite:///{tmp_path / 'corral.db'}")
    manager = RunManager(store, tmp_path / "data", 30.0, CorralMetrics(CollectorRegistry()))
    try:
        spec = RunCreate.model_validate({"kind": "sim", "speed": 1000.0, "trainer": "sentinel", "batches": 1})
        runs = []
        for _ in range(KEEP_ENDED_HANDLES + 2):
            runs.append(manager.create(spec))
            assert manager.handles[runs[-1]].join(60), "the run did not end"
        assert manager.wait_written()
        assert sorted(manager.handles) == sorted(runs[2:])  # the latest ended, no more
        for run_id in runs[:2]:
            view = manager.view(run_id)
            assert view is not None
            assert (view["state"], view["live"]) == ("completed", None)  # from the store
            assert view["groups"]["delivered"] == run_policy(spec).groups_per_batch
            page = ManagerRuns(lambda: manager).view(run_id)
            assert page is not None
            assert (page.state, len(page.batches)) == ("completed", 1)
        assert [r["state"] for r in manager.list()] == ["completed"] * len(runs)
        assert manager.view(runs[-1])["live"]["batches"] == 1  # type: ignore[index]
    finally:
        manager.shutdown(10)
        store.close()
