"""A local run inside the service supervises its engine processes as `corral run` does: an engine killed
with SIGKILL is restarted on a fresh port and caught up to the newest weights, batches keep coming,
and no group is lost; in a paused run the restarted engine comes back paused. Real engine processes, a
real signal, the store on SQLite."""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import httpx
import pytest
from factories import wait_for
from proc_children import children

from app.service.handle import RunHandle
from app.service.manager import RunManager
from app.service.schemas import RunCreate
from app.service.store import ServiceStore
from app.store.models import RunState


def make_config() -> dict[str, Any]:
    """Small and fast: 2 engines probed every second, B = 2 groups of G = 2, quick built-in tasks."""
    cpus = sorted(os.sched_getaffinity(0))
    serving, lanes = (cpus[:1], cpus[1:2]) if len(cpus) > 1 else (cpus, cpus)
    return {
        "seed": 3,
        "batch": {"groups": 2, "group_size": 2},
        "policy": {"surplus_groups": 2, "max_staleness": 2},
        "engines": {
            "count": 2,
            "cpus": serving,
            "slots": 4,
            "layers": 1,
            "hidden": 16,
            "max_tokens": 16,
            "update_timeout_s": 10,
            "restart_backoff_s": 0.5,
            "restart_backoff_max_s": 4,
            "health_interval_s": 1,
        },
        "lanes": {"cpus": lanes, "reset": 2, "exec": 2, "validate": 1, "cleanup": 1},
        "tasks": {"include": ["fix-off-by-one", "json-transform", "patch-config-sed", "sort-uniq-log"]},
    }


def embedded_engines(parent: int) -> set[int]:
    """Embedded engine processes whose parent is `parent` (the run executes in this test process)."""
    return children(parent, b"app.engines.embedded")


class RunEngines:
    """The engine processes of the run under test: this process's embedded engines that were not
    there before the run (in a whole-suite run, an earlier test's engines may still be stopping)."""

    def __init__(self) -> None:
        self.before = embedded_engines(os.getpid())

    def __call__(self) -> set[int]:
        return embedded_engines(os.getpid()) - self.before


# Each run's store: an ended run's recent events are let go, and its timeline is read from there.
STORES: dict[str, ServiceStore] = {}


def rows_of(handle: RunHandle, kind: str) -> list[dict[str, Any]]:
    rows = handle.recorder.recent.since(-1, 1_000_000)
    if rows is None:
        rows = STORES[handle.run_id].timeline(handle.run_id, -1, 1_000_000)
    return [r for r in rows if r["kind"] == kind]


def engine_rows(handle: RunHandle) -> list[dict[str, Any]]:
    return rows_of(handle, "engine_state")


def batches_after(handle: RunHandle, t: float) -> list[dict[str, Any]]:
    return [r for r in rows_of(handle, "batch_delivered") if r["t"] > t]


def back_at(handle: RunHandle) -> dict[str, Any] | None:
    return next((r for r in engine_rows(handle) if r["detail"].startswith("back at version")), None)


@contextmanager
def local_run(
    tmp_path: Path, trainer: str = "sentinel", **config: Any
) -> Iterator[tuple[RunHandle, ServiceStore, RunEngines]]:
    """A local run with the sentinel trainer (or `trainer`), executing in this process until the block
    stops it."""
    engines = RunEngines()
    store = ServiceStore(f"sqlite:///{tmp_path / 'corral.db'}")
    manager = RunManager(store, tmp_path / "data", ack_timeout_s=30.0)
    spec = {"name": "supervised", "kind": "local", "config": {**make_config(), **config},
            "trainer": trainer, "sentinel_step_s": 0.2}  # fmt: skip
    try:
        handle = manager.get(manager.create(RunCreate.model_validate(spec)))
        assert handle is not None
        STORES[handle.run_id] = store
        yield handle, store, engines
    finally:
        manager.shutdown()
        store.close()


def stop(handle: RunHandle) -> None:
    handle.submit(handle.stop).result(timeout=10)
    assert handle.join(60), "the run did not end after stop"
    assert handle.state is RunState.STOPPED, handle.error


def port_of(pid: int) -> int:
    argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
    return int(argv[argv.index(b"--port") + 1])


def is_paused(port: int) -> bool:
    return bool(httpx.get(f"http://127.0.0.1:{port}/is_paused", timeout=5).json()["is_paused"])


@pytest.mark.slow
def test_an_engine_killed_with_sigkill_during_a_service_run_is_restarted_and_nothing_is_lost(
    tmp_path: Path,
) -> None:
    with local_run(tmp_path) as (handle, store, run_engines):
        view = handle.recorder.view
        wait_for(lambda: view.batches >= 2, 120, "two batches")
        first = run_engines()
        assert len(first) == 2
        victim = min(first)
        os.kill(victim, signal.SIGKILL)
        batches_at_kill = view.batches
        back = wait_for(lambda: back_at(handle), 60, "the killed engine to serve again")
        restarted = wait_for(lambda: run_engines() - first, 5, "a new engine process")
        wait_for(lambda: batches_after(handle, back["t"]), 60, "a batch after the restart")
        stop(handle)
        ledger, _ = store.ledger(handle.run_id)
        account = store.group_account(handle.run_id)

    assert victim not in run_engines()
    assert len(restarted) == 1
    name = back["engine"]
    states = [r["state"] for r in engine_rows(handle) if r["engine"] == name]
    assert states[:3] == ["unhealthy", "restarting", "serving"]
    assert "restarting" not in [r["state"] for r in engine_rows(handle) if r["engine"] != name]
    # It came back at the version then published, not at the version it started with.
    assert int(back["detail"].removeprefix("back at version ")) >= batches_at_kill - 1 >= 1
    assert view.batches > batches_at_kill
    assert ledger.lost == 0
    assert account["open"] == 0
    # Every engine process of the run, the restarted one too, was stopped with it.
    wait_for(lambda: not run_engines(), 30, "the engine processes to stop")


@pytest.mark.slow
def test_an_engine_that_dies_while_the_run_is_paused_does_not_fail_the_run(tmp_path: Path) -> None:
    """The resume reaches a dead engine (its restart is under way): the run goes on, it does not fail."""
    with local_run(tmp_path) as (handle, store, run_engines):
        wait_for(lambda: handle.recorder.view.batches >= 1, 120, "a first batch")
        first = run_engines()
        handle.submit(handle.pause).result(timeout=10)
        wait_for(lambda: all(is_paused(port_of(pid)) for pid in first), 10, "every engine to be paused")
        os.kill(min(first), signal.SIGKILL)
        handle.submit(handle.resume).result(timeout=10)
        back = wait_for(lambda: back_at(handle), 60, "the killed engine to serve again")
        wait_for(lambda: batches_after(handle, back["t"]), 60, "a batch after the restart")
        stop(handle)
        ledger, _ = store.ledger(handle.run_id)
    assert ledger.lost == 0


@pytest.mark.slow
def test_a_publication_without_weights_is_refused_and_the_run_goes_on(tmp_path: Path) -> None:
    """The run's engines load weights from disk: a publication without a path (no API or dashboard
    sends one now, but the runtime takes it) went out to the engines, whose client raised a ValueError
    that failed the whole run. The runtime now refuses it to the caller; the run goes on."""
    with local_run(tmp_path) as (handle, store, _):
        view = handle.recorder.view
        wait_for(lambda: view.batches >= 1, 120, "a first batch")

        def publish_next() -> tuple[int, BaseException | None]:
            # in one call on the run's loop: between two, the run's trainer may publish that version
            version = handle._runtime().version + 1
            try:
                handle.publish(version, None, "tester")
            except ValueError as exc:
                return version, exc
            return version, None

        version, refused = handle.submit(publish_next).result(timeout=10)
        last = rows_of(handle, "batch_delivered")[-1]["t"]
        wait_for(lambda: batches_after(handle, last) or handle.done.is_set(), 60, "a batch after it")
        assert handle.state is RunState.RUNNING, handle.error
        stop(handle)
        ledger, _ = store.ledger(handle.run_id)
    assert isinstance(refused, ValueError)
    assert str(refused) == (
        f"version {version} has no weights path, and this run's engines load their weights from disk"
    )
    assert not any(r["path"] is None for r in rows_of(handle, "version_published"))
    assert ledger.lost == 0


@pytest.mark.slow
def test_weights_the_engines_refuse_fail_the_rollout_not_the_engines(tmp_path: Path) -> None:
    """Engines of real weights (`sentinel: false`) sent sentinel weights (the dashboard's publish) each
    answered 400, were marked down and restarted; each restart loaded the same weights and was refused
    again, until after `max_restarts` every engine was given up and the run stopped. Now the rollout
    fails with each engine's reason, the engines serve on at their version, never restarted, and a
    version they can load reaches them. (The dashboard's publish and the API's `sentinel: true` are
    now refused up front for such engines; a checkpoint of the sentinel tensor alone given by path, as
    an external trainer may, still reaches them.)"""
    from app.engines.embedded.server import EmbeddedConfig, build_model
    from app.engines.embedded.weights import save_sentinel, save_weights

    engines_config = {**make_config()["engines"], "sentinel": False, "max_restarts": 2}
    with local_run(tmp_path, trainer="external", engines=engines_config) as (handle, _, engines):
        wait_for(lambda: handle.state is RunState.RUNNING and len(engines()) == 2, 120, "the engines")
        pids = engines()

        def rollout(version: int) -> dict[str, Any]:
            return handle.submit(handle.rollout, version).result(timeout=10)

        def settled(version: int) -> dict[str, Any] | None:
            answer = rollout(version)
            return None if answer["state"] == "running" else answer

        version = handle.submit(lambda: handle.runtime.version + 1).result(timeout=10)
        with pytest.raises(ValueError, match=r"config\.engines\.sentinel: false"):
            handle.sentinel_weights(version)  # the dashboard's publish: refused, nothing written
        assert not (handle.work_dir / "weights" / f"v{version}").exists()
        sentinel = tmp_path / "sentinel"
        save_sentinel(sentinel, float(version))
        handle.submit(handle.publish, version, str(sentinel), "tester").result(timeout=10)
        refused = wait_for(lambda: settled(version), 60, f"the rollout of version {version}")
        assert refused["state"] == "failed"
        assert [e["state"] for e in refused["engines"]] == ["failed", "failed"]
        for engine in refused["engines"]:
            assert engine["version"] == version - 1
            assert "HTTP 400" in engine["error"]
            assert "lacks" in engine["error"]

        full = tmp_path / "full"
        save_weights(build_model(EmbeddedConfig(layers=1, hidden=16)), full)
        handle.submit(handle.publish, version + 1, str(full), "tester").result(timeout=10)
        loaded = wait_for(lambda: settled(version + 1), 60, f"the rollout of version {version + 1}")
        assert loaded["state"] == "completed", loaded
        assert [e["version"] for e in loaded["engines"]] == [version + 1, version + 1]
        assert engine_rows(handle) == []  # never unhealthy, never restarted
        assert engines() == pids
        assert handle.state is RunState.RUNNING, handle.error
        stop(handle)


@pytest.mark.slow
def test_a_paused_local_run_starts_no_turn_and_no_update_until_it_is_resumed(tmp_path: Path) -> None:
    """Paused: groups that finish may still be delivered and the trainer may publish, but no turn starts
    on any engine (a restarted one included) and no weight update begins; resumed, both go on."""
    with local_run(tmp_path) as (handle, store, run_engines):
        wait_for(lambda: handle.recorder.view.batches >= 1, 120, "a first batch")
        first = run_engines()
        handle.submit(handle.pause).result(timeout=10)
        paused_at = handle.submit(handle.loop.time).result(timeout=10)
        wait_for(lambda: all(is_paused(port_of(pid)) for pid in first), 10, "every engine to be paused")
        time.sleep(4)  # 20 sentinel steps; turns of these tasks take well under a second
        os.kill(min(first), signal.SIGKILL)  # the restarted engine comes back unpaused: still no turn
        wait_for(lambda: back_at(handle), 60, "the killed engine to serve again")
        time.sleep(2)
        resumed_at = handle.submit(handle.loop.time).result(timeout=10)
        handle.submit(handle.resume).result(timeout=10)
        wait_for(lambda: batches_after(handle, resumed_at), 60, "a batch after the resume")
        stop(handle)
        ledger, _ = store.ledger(handle.run_id)

    turns = rows_of(handle, "turn")
    assert [r for r in turns if r["start"] < paused_at], "no turn before the pause: the test saw nothing"
    assert [r for r in turns if paused_at < r["start"] < resumed_at] == []
    assert [r for r in turns if r["start"] > resumed_at]
    updates = rows_of(handle, "engine_update_begin")
    assert [r for r in updates if paused_at < r["t"] < resumed_at] == []
    assert ledger.lost == 0


@pytest.mark.slow
def test_an_engine_killed_during_start_up_is_restarted_and_the_run_goes_on(tmp_path: Path) -> None:
    """Killed before it first answers (torch still loading), the engine does not fail the run: the run
    starts without it and restarts it, as `corral run` does."""
    with local_run(tmp_path) as (handle, store, run_engines):
        first = wait_for(lambda: len(run_engines()) == 2 and run_engines(),
                         30, "two engine processes")  # fmt: skip
        victim = min(first)
        os.kill(victim, signal.SIGKILL)
        back = wait_for(lambda: back_at(handle), 120, "the engine killed at start-up to serve")
        wait_for(lambda: batches_after(handle, back["t"]), 60, "a batch after it is back")
        stop(handle)
        ledger, _ = store.ledger(handle.run_id)
    name = back["engine"]
    states = [r for r in engine_rows(handle) if r["engine"] == name]
    assert states[0]["state"] == "unhealthy"
    assert states[0]["detail"] == "exited with -9 during start-up"
    assert [r["state"] for r in states[:3]] == ["unhealthy", "restarting", "serving"]
    assert ledger.lost == 0


@pytest.mark.slow
@pytest.mark.parametrize("how", ["stop", "shutdown"])
def test_a_run_stopped_while_its_engines_start_ends_stopped_and_leaves_no_engine(
    tmp_path: Path, how: str
) -> None:
    """Stopped before its engines answer (the operator's stop, or the service shutting down): the run
    ends `stopped`, its store record says so, and none of its engine processes is left running."""
    with local_run(tmp_path) as (handle, store, run_engines):
        wait_for(lambda: len(run_engines()) == 2, 60, "the run's two engine processes")
        assert handle.state is RunState.CREATED  # torch start-up takes seconds: they do not answer yet
        if how == "stop":
            stop(handle)
    # With "shutdown", local_run's exit stopped it: the service's shutdown stops runs still starting.
    assert handle.join(0), "the run did not end"
    assert handle.state is RunState.STOPPED, handle.error
    record = store.get_run(handle.run_id) if how == "stop" else None
    assert record is None or record.state == RunState.STOPPED.value
    (ended,) = rows_of(handle, "run_ended")
    assert ended["reason"] == "stopped"
    wait_for(lambda: not run_engines(), 30, "the engine processes to stop")


@pytest.mark.skipif(os.geteuid() != 0, reason="sandbox uids are handed out only by root")
def test_a_run_whose_data_directory_sandbox_uids_cannot_reach_runs_its_sandboxes_in_tmp(
    tmp_path: Path,
) -> None:
    """pytest's tmp_path is 0700, like root's home: without bubblewrap (isolation none here) the
    sandbox uids cannot reach the data directory, so the run's sandboxes go to <tmp>/corral-sandboxes
    (every local run failed there before), and that directory goes when the run ends."""
    import tempfile

    with local_run(tmp_path, sandbox={"isolation": "none"}) as (handle, _, _):
        scratch = Path(tempfile.gettempdir()) / "corral-sandboxes" / handle.run_id
        wait_for(lambda: len(batches_after(handle, 0.0)) >= 2, 120, "two batches")
        assert scratch.is_dir()
        assert not (tmp_path / "data" / handle.run_id / "sandboxes").exists()
        stop(handle)
    assert not scratch.exists()
