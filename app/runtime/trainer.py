"""The built-in sentinel trainer: publishes a new sentinel-weights version after every step."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from pathlib import Path

from app.engines.embedded.weights import save_sentinel
from app.outputs import until_written
from app.runtime.ports import TrainingBatch


def _never() -> bool:
    return False


class SentinelTrainer:
    """Publishes a new sentinel-weights directory each step (the write-up's rollout-mechanism test).
    Weights the disk refuses (full, read-only) are written once it takes them, the step lasting until
    then; `stopping()` true meanwhile ends the step with nothing to publish (a stopping run publishes
    nothing)."""

    def __init__(self, step_s: float, weights_dir: Path, stopping: Callable[[], bool] = _never) -> None:
        self.step_s = step_s
        self.weights_dir = weights_dir
        self.stopping = stopping
        self.rewards: list[float] = []

    async def step(self, batch: TrainingBatch, version: int) -> str | None:
        self.rewards.extend(r for g in batch.batch.groups for r in g.rewards)
        await asyncio.sleep(self.step_s)
        path = self.weights_dir / f"v{version}"

        async def save() -> str:
            await asyncio.to_thread(save_sentinel, path, float(version))
            return str(path)

        return await until_written(save, f"trainer: weights v{version}", self.stopping, asyncio.sleep)
