"""The orchestrator entry point drives a stored run to its end in this process, and a redelivery
after the end changes nothing."""

from __future__ import annotations

from pathlib import Path

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
        assert done == {"run_id": "r1", "state": "completed", "batches": 2}
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
