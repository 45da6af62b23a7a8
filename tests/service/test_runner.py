"""The orchestrator entry point drives a stored run to its end in this process, and a redelivery
after the end changes nothing."""

from __future__ import annotations

from pathlib import Path

import pytest

from app.service.runner import run_orchestrator
from app.service.store import ServiceStore
from app.settings import Settings


def make_settings(tmp_path: Path) -> Settings:
    return Settings(
        database_url=f"sqlite:///{tmp_path / 'corral.db'}",
        operator_token="test-operator-token",
        data_dir=tmp_path / "data",
    )


def test_run_orchestrator_drives_a_stored_run_to_its_end(tmp_path: Path) -> None:
    settings = make_settings(tmp_path)
    store = ServiceStore(settings.database_url)
    spec = {"name": "orch", "kind": "sim", "speed": 10.0, "batches": 2, "trainer": "sentinel",
            "sentinel_step_s": 0.0, "orchestrator": "celery"}  # fmt: skip
    store.create_run("r1", "orch", spec, {})
    try:
        done = run_orchestrator("r1", settings)
        assert done == {"run_id": "r1", "state": "completed", "batches": 2, "handed_off": False}
        ledger, _ = store.ledger("r1")
        assert ledger.lost == 0
        assert ledger.delivered_count == 4
        assert store.get_run("r1").state == "completed"  # type: ignore[union-attr]
        again = run_orchestrator("r1", settings)  # a redelivered task finds the run ended
        assert again["state"] == "completed"
        assert store.ledger("r1")[0].delivered_count == 4
    finally:
        store.close()


def test_a_policy_change_is_written_over_the_stored_policy_keeping_its_shape(tmp_path: Path) -> None:
    store = ServiceStore(f"sqlite:///{tmp_path / 'corral.db'}")
    created = {"groups_per_batch": 4, "surplus_groups": 2, "max_staleness": 2, "admission": "in_flight"}
    store.create_run("r1", "shape", {"name": "shape", "kind": "sim"}, created)
    try:
        store.set_policy("r1", {"surplus_groups": 5, "max_staleness": 3})
        store.set_policy("r1", {"max_staleness": 1})
        stored = store.get_run("r1")
        assert stored is not None
        assert stored.policy == {**created, "surplus_groups": 5, "max_staleness": 1}
    finally:
        store.close()


def test_a_command_line_stops_when_its_worker_hands_the_run_off_and_leaves_its_commands() -> None:
    """A second Ctrl-C hands a run to another worker, with the run going on: its command lines took
    commands on (they stop once the run ends, which it had not), so the worker logged twice 'still
    carrying out None after it was cancelled; left behind, as the run has ended' and took 7 s to exit."""
    import json
    import time

    import redis
    from factories import redis_answers

    from app.service.channel import commands_key
    from app.service.runner import STOP_CHECK_S, CommandLine

    if not redis_answers():
        pytest.skip("no Redis answering on 127.0.0.1:6379")
    url = "redis://127.0.0.1:6379/14"

    class GoesOn:  # a run that does not end here: handed off, not stopped
        run_id = f"handoff-{time.monotonic_ns()}"

        def join(self, timeout: float | None = None) -> bool:
            return False

    handle = GoesOn()
    line = CommandLine(handle, url, commands_key)  # type: ignore[arg-type]
    client = redis.Redis.from_url(url)
    try:
        line.start()
        time.sleep(0.2)  # in its wait for commands
        line.stop()
        line.join(STOP_CHECK_S + 2.0)
        assert not line.is_alive()
        assert line.busy is None
        # a command sent now stays on the run's list for the worker that resumes it
        client.rpush(commands_key(handle.run_id), json.dumps({"id": "c1", "op": "pause", "args": {}}))
        time.sleep(STOP_CHECK_S)
        assert client.llen(commands_key(handle.run_id)) == 1
    finally:
        client.delete(commands_key(handle.run_id))
        client.close()
