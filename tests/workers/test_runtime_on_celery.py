"""The production Runtime drives a small job whose sandbox ops all go through real Celery lane workers
(two logical hosts) to real LocalSandboxes; the engine and the agent are small fakes (no model here)."""

from __future__ import annotations

from pathlib import Path

from celery_cluster import REDIS_URL, LaneCluster
from factories import make_echo_task

from app.core.config import PolicyConfig
from app.engines.base import PauseMode, TurnRequest, TurnResult
from app.lanes.celery import CeleryLanes, OpRecord
from app.runtime.context import AttemptContext, AttemptOutcome
from app.runtime.driver import Runtime
from app.runtime.ports import TrainingBatch
from app.runtime.task_source import TaskSource
from app.sandboxes.local import LocalSandboxFactory


class EchoEngine:
    """Answers every turn with a shell command at once, at its current policy version."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.version = 0

    async def generate(self, request: TurnRequest) -> TurnResult:
        return TurnResult(text="echo hello again > greeting.txt", weight_version=self.version, tokens=5)

    async def pause(self, mode: PauseMode) -> None:
        return None

    async def resume(self) -> None:
        return None

    async def publish_weights(self, version: int, path: str | None) -> None:
        self.version = version

    async def weight_version(self) -> int:
        return self.version

    async def health(self) -> bool:
        return True

    async def aclose(self) -> None:
        return None


class OneTurnAgent:
    """Reset, one model turn, run its command on even attempts only (so rewards vary), validate."""

    async def run(self, ctx: AttemptContext) -> AttemptOutcome:
        await ctx.reset()
        turn = await ctx.generate(TurnRequest(prompt="fix greeting.txt"))
        even = int(ctx.attempt_id.split("a")[1].split("-")[0]) % 2 == 0
        await ctx.exec(turn.text if even else "true", 10)
        return AttemptOutcome(reward=await ctx.validate(), turns=1)


class InstantTrainer:
    def __init__(self) -> None:
        self.batches: list[TrainingBatch] = []

    async def step(self, batch: TrainingBatch, version: int) -> str | None:
        self.batches.append(batch)
        return None


def leftovers(base_dir: Path) -> list[str]:
    """What sandboxes left under `base_dir`: work dirs, state files (the bookkeeping directory itself
    may stay)."""
    keep = {base_dir / ".corral-state"}
    return sorted(str(p.relative_to(base_dir)) for p in base_dir.rglob("*") if p not in keep)


async def test_the_runtime_collects_batches_through_celery_lane_workers(
    lane_cluster: LaneCluster, base_dir: Path, task_root: Path
) -> None:
    records: list[OpRecord] = []
    # Connected as the service connects: its own client app, from the URLs alone.
    lanes = CeleryLanes.connect(REDIS_URL, REDIS_URL, lane_cluster.hosts, on_done=records.append)
    task = make_echo_task(task_root, validation="grep -q again greeting.txt")
    trainer = InstantTrainer()
    policy = PolicyConfig(groups_per_batch=2, group_size=2, surplus_groups=1, max_staleness=2)
    runtime = Runtime(
        policy=policy,
        engines=[EchoEngine("e0")],
        engine_slots=4,
        lanes=lanes,
        source=TaskSource([task], LocalSandboxFactory(base_dir), OneTurnAgent(), seed=1),
        trainer=trainer,
    )
    try:
        state = await runtime.run(batches=2)
    finally:
        lanes.close()

    assert len(state.batches) == len(trainer.batches) == 2
    for training in trainer.batches:
        for group in training.batch.groups:
            assert sorted(group.rewards) == [0.0, 1.0]  # attempt 0 ran the command, attempt 1 did not
    # Every op of a sandbox ran on the one host it was placed on; both hosts took sandboxes.
    hosts: dict[str, set[str]] = {}
    lanes_of: dict[str, list[str]] = {}
    for record in records:
        hosts.setdefault(record.op.handle.id, set()).add(record.host)
        lanes_of.setdefault(record.op.handle.id, []).append(record.op.lane.value)
    assert all(len(h) == 1 for h in hosts.values())
    assert {h for hs in hosts.values() for h in hs} == set(lane_cluster.hosts)
    assert all(r.affinity == (1,) for r in records)
    # Every sandbox was cleaned up, last; finished attempts ran the four lanes in order.
    assert all(ops[-1] == "cleanup" and ops.count("cleanup") == 1 for ops in lanes_of.values())
    assert sum(ops == ["reset", "exec", "validate", "cleanup"] for ops in lanes_of.values()) >= 8
    assert leftovers(base_dir) == []
    assert lanes.stats()["cleanup"].completed == len(hosts)
