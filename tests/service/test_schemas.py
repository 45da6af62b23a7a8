"""A run is refused at creation, before any engine starts, when its trainer and engines cannot work
together."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from pydantic import ValidationError

from app.core.config import AdmissionMode
from app.runtime.config import default_config_path, load_config
from app.service.handle import NO_GATE, RunHandle, resumed_policy
from app.service.ports import run_policy
from app.service.schemas import PolicyPatch, RunCreate


def make_local_run(*, trainer: str, sentinel: bool, **overrides: Any) -> dict[str, Any]:
    return {"kind": "local", "trainer": trainer, "config": {"engines": {"sentinel": sentinel}}, **overrides}


def test_the_sentinel_trainer_with_engines_of_real_weights_is_refused_naming_both() -> None:
    # Every version it publishes would be refused, and the run would stall once K versions behind.
    with pytest.raises(ValidationError) as raised:
        RunCreate.model_validate(make_local_run(trainer="sentinel", sentinel=False))
    message = raised.value.errors()[0]["msg"]
    assert "config.engines.sentinel: false loads real weights" in message
    assert "trainer 'sentinel' publishes sentinel weights the engines refuse" in message
    assert "set config.engines.sentinel: true, or trainer 'external'" in message
    assert "\n" not in message


@pytest.mark.parametrize(
    ("trainer", "sentinel"),
    [
        ("sentinel", True),  # sentinel engines load the sentinel tensor
        ("external", False),  # an external trainer may publish full checkpoints
        ("external", True),  # sentinel engines take the sentinel tensor of a full checkpoint
    ],
)
def test_trainers_whose_versions_the_engines_can_load_are_accepted(trainer: str, sentinel: bool) -> None:
    spec = RunCreate.model_validate(make_local_run(trainer=trainer, sentinel=sentinel))
    assert spec.config is not None
    assert spec.config.engines.sentinel is sentinel


@pytest.mark.parametrize("body", [{"kind": "local"}, {"kind": "local", "config": None}])
def test_a_local_run_without_a_config_takes_the_shipped_one(body: dict[str, Any]) -> None:
    # Its config stayed None and creating the run failed an assertion: a 500 from POST /api/runs.
    spec = RunCreate.model_validate(body)
    assert spec.config == load_config(default_config_path())
    assert run_policy(spec).groups_per_batch == spec.config.batch.groups
    assert RunCreate.model_validate(spec.model_dump(mode="json")) == spec  # stored, then resumed


def test_a_run_config_takes_cpu_lists_as_the_kernel_writes_them() -> None:
    # `--cpus 0-1` was taken, `lanes.cpus: '0-1'` in the config refused as "Input should be a valid list".
    spec = RunCreate.model_validate(
        {
            "kind": "local",
            "config": {"engines": {"cpus": "0"}, "lanes": {"cpus": "0-1", "borrow_serving_cpus": True}},
        }
    )
    assert spec.config is not None
    assert (spec.config.engines.cpus, spec.config.lanes.cpus) == ([0], [0, 1])
    with pytest.raises(ValidationError, match="'0-x' in CPU list '0-x' is not a CPU number"):
        RunCreate.model_validate({"kind": "local", "config": {"engines": {"cpus": "0-x"}}})


def test_a_stored_run_config_spells_its_fields_as_the_input_does(tmp_path: Path) -> None:
    # The API echoed `lanes.validate_` and `sandbox_demand.validate_` back, where the input says `validate`.
    from app.service.manager import RunManager
    from app.service.store import ServiceStore

    manager = RunManager(ServiceStore(f"sqlite:///{tmp_path / 'c.db'}"), tmp_path / "data", 30.0)
    try:
        run_id = manager.create(RunCreate.model_validate({"kind": "sim", "batches": 1, "speed": 100.0}))
        config = manager.view(run_id)["config"]
        assert "validate" in config["workload"]["lanes"]
        assert "validate" in config["workload"]["cpus"]["sandbox_demand"]
        assert "'validate_'" not in str(config)
        assert RunCreate.model_validate(config).workload == RunCreate.model_validate({"kind": "sim"}).workload
    finally:
        manager.shutdown()


@pytest.mark.parametrize(
    ("body", "inner"),
    [
        ({"kind": "sim", "workload": {"batches": 12}}, "workload"),
        ({"kind": "local", "config": {"batches": 3}}, "config"),
    ],
)
@pytest.mark.parametrize("batches", [None, 2])
def test_a_stored_run_config_echoes_only_the_batches_that_govern(
    tmp_path: Path, body: dict[str, Any], inner: str, batches: int | None
) -> None:
    # The request's `batches` ends the run (null: until stopped); the echo also showed the workload's
    # `batches: 12`, which a run created through the API never follows.
    from app.service.manager import RunManager
    from app.service.store import ServiceStore

    manager = RunManager(ServiceStore(f"sqlite:///{tmp_path / 'c.db'}"), tmp_path / "data", 30.0)
    spec = RunCreate.model_validate(
        {**body, "batches": batches, "trainer": "sentinel", "orchestrator": "celery"}
    )
    try:
        run_id = manager.create(spec, dispatch=lambda _: None)  # stored, not started
        config = manager.view(run_id)["config"]
        assert config["batches"] == batches
        assert "batches" not in config[inner]
        assert RunCreate.model_validate(config) == spec  # resumed as it was created
    finally:
        manager.shutdown()


@pytest.mark.parametrize("admission", ["attempts", "live"])
def test_ready_surplus_with_a_config_that_keeps_no_ready_room_apart_is_refused(admission: str) -> None:
    # It was accepted and then dropped without a word: the run took the config's admission, which has
    # no room for ready groups beyond B + S (attempts admission caps them at (K + 1)·B, live admission
    # counts them in B + S).
    body = {"kind": "local", "config": {"policy": {"admission": admission}}, "ready_surplus": 4}
    with pytest.raises(ValidationError) as raised:
        RunCreate.model_validate(body)
    message = raised.value.errors()[0]["msg"]
    assert f"ready_surplus: config.policy.admission is {admission}" in message
    assert "in_flight" in message


def test_ready_surplus_with_in_flight_admission_is_taken() -> None:
    body = {"kind": "local", "config": {"policy": {"admission": "in_flight"}}, "ready_surplus": 4}
    assert run_policy(RunCreate.model_validate(body)).ready_surplus == 4
    # An explicit null (no cap of its own) asks nothing of the admission, so any admission takes it.
    body = {"kind": "local", "config": {"policy": {"admission": "attempts"}}, "ready_surplus": None}
    assert run_policy(RunCreate.model_validate(body)).ready_surplus is None


def test_a_run_may_ask_for_attempts_admission_over_its_rung_s_and_config_s() -> None:
    sim = run_policy(RunCreate.model_validate({"kind": "sim", "admission": "attempts"}))
    assert sim.admission is AdmissionMode.ATTEMPTS
    # An external trainer's default room for ready groups is in_flight admission's; attempts admission
    # caps them at (K + 1)·B itself.
    assert sim.ready_surplus is None
    local = {"kind": "local", "config": {"policy": {"admission": "attempts"}}}
    assert run_policy(RunCreate.model_validate(local)).admission is AdmissionMode.ATTEMPTS
    # The run's own field overrides its config's, as B, G, S and K do; then ready_surplus applies.
    spec = RunCreate.model_validate({**local, "admission": "in_flight", "ready_surplus": 3})
    assert run_policy(spec).admission is AdmissionMode.IN_FLIGHT
    assert run_policy(spec).ready_surplus == 3
    with pytest.raises(ValidationError) as raised:
        RunCreate.model_validate({"kind": "sim", "admission": "attempts", "ready_surplus": 3})
    assert "ready_surplus: admission is attempts" in raised.value.errors()[0]["msg"]
    with pytest.raises(ValidationError) as raised:
        RunCreate.model_validate({"kind": "sim", "admission": "tokens"})
    assert raised.value.errors()[0]["loc"] == ("admission",)


@pytest.mark.parametrize(
    ("body", "gate"),
    [
        ({"kind": "sim"}, 1.0),  # full's own
        ({"kind": "sim", "agent_gate": 2.5}, 2.5),
        ({"kind": "sim", "agent_gate": 0}, None),  # 0: no gate
        ({"kind": "sim", "policy": "sync"}, None),  # the other rungs have none
        ({"kind": "sim", "policy": "sync", "agent_gate": 0.5}, 0.5),  # as `corral sim --agent-gate` gives one
        ({"kind": "local"}, 1.0),
        ({"kind": "local", "config": {"policy": {"agent_gate": 3}}}, 3.0),
        ({"kind": "local", "config": {"policy": {"agent_gate": 3}}, "agent_gate": 0.25}, 0.25),  # overrides
        ({"kind": "local", "config": {"policy": {"agent_gate": 3}}, "agent_gate": 0}, None),
    ],
)
def test_a_run_s_agent_gate_at_launch_overrides_its_rung_s_and_config_s(
    body: dict[str, Any], gate: float | None
) -> None:
    assert run_policy(RunCreate.model_validate(body)).agent_gate == gate


@pytest.mark.parametrize("value", [-1, -0.5, 1e9, 1000.5, "1", "abc", True, float("nan"), float("inf")])
def test_an_agent_gate_that_is_not_a_number_from_0_to_1000_is_refused(value: object) -> None:
    for model, body in ((RunCreate, {"kind": "sim"}), (PolicyPatch, {})):
        with pytest.raises(ValidationError) as raised:
            model.model_validate({**body, "agent_gate": value})
        assert raised.value.errors()[0]["loc"] == ("agent_gate",)


def test_a_patch_of_the_agent_gate_alone_is_a_change() -> None:
    assert PolicyPatch.model_validate({"agent_gate": 0}).agent_gate == 0
    with pytest.raises(ValidationError, match="max_updating_engines, pause_mode, agent_gate"):
        PolicyPatch.model_validate({})


@pytest.mark.parametrize("stored", [0.0, 2.5])
def test_a_resumed_run_keeps_the_agent_gate_set_live(stored: float) -> None:
    """0 (opened live) too: the restarted run has its gate, open, so it can be closed again."""
    policy = run_policy(RunCreate.model_validate({"kind": "sim"}))
    stored_policy = {**policy.model_dump(mode="json"), "agent_gate": stored}
    assert resumed_policy(policy, stored_policy).agent_gate == stored
    assert resumed_policy(policy, policy.model_dump(mode="json")) == policy


class _RuntimeWithoutGate:
    gate = None  # as `Runtime` has it on Celery lanes (`AgentGate.for_lanes`)


@pytest.fixture
def make_handle(tmp_path: Path) -> Iterator[Callable[..., RunHandle]]:
    """Handles of simulated runs (`spec`'s fields over `kind: sim`), never started: their loop and
    recorder are closed afterwards."""
    made: list[RunHandle] = []

    def make(**spec: Any) -> RunHandle:
        made.append(RunHandle("r1", RunCreate.model_validate({"kind": "sim", **spec}), tmp_path, 30.0, print))
        return made[-1]

    yield make
    for handle in made:
        handle.loop.close()
        handle.recorder.close()


def test_a_live_agent_gate_is_refused_where_the_run_has_no_gate(
    make_handle: Callable[..., RunHandle],
) -> None:
    patch = PolicyPatch(agent_gate=2)
    assert make_handle().patch_problem(patch) is None  # full: a gate
    assert make_handle(policy="sync").patch_problem(patch) == NO_GATE.format("r1")
    assert make_handle(agent_gate=0).patch_problem(patch) == NO_GATE.format("r1")
    on_celery_lanes = make_handle()
    on_celery_lanes.runtime = _RuntimeWithoutGate()  # type: ignore[assignment]
    assert on_celery_lanes.patch_problem(patch) == NO_GATE.format("r1")
    assert on_celery_lanes.patch_problem(PolicyPatch(max_staleness=3)) is None
