"""What a trainer receives: every delivered group with its G attempt outcomes, rewards in agreement."""

from __future__ import annotations

import asyncio

from factories import make_workload_data

from app.runtime.ports import TrainingBatch
from app.sim.run import policy_for, simulate
from app.sim.workload import Workload


class RecordingTrainer:
    def __init__(self) -> None:
        self.batches: list[TrainingBatch] = []

    async def step(self, batch: TrainingBatch, version: int) -> str | None:
        self.batches.append(batch)
        await asyncio.sleep(1.0)
        return None


def test_trainer_gets_each_groups_attempts_with_matching_rewards() -> None:
    workload = Workload.model_validate(make_workload_data(batches=4, batch={"groups": 3, "group_size": 3}))
    trainer = RecordingTrainer()
    report = simulate(workload, policy_for(workload, "full"), "full", trainer=trainer)
    assert len(trainer.batches) == report["batches"] == 4
    for training in trainer.batches:
        assert len(training.batch.groups) == 3
        for group in training.batch.groups:
            outcomes = training.attempts[group.group_id]
            assert len(outcomes) == 3
            assert tuple(o.reward for o in outcomes) == group.rewards
            assert all(o.error is None for o in outcomes)
