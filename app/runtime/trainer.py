"""The built-in sentinel trainer: publishes a new sentinel-weights version after every step."""

from __future__ import annotations

import asyncio
from pathlib import Path

from app.engines.embedded.weights import save_sentinel
from app.runtime.ports import TrainingBatch


class SentinelTrainer:
    """Publishes a new sentinel-weights directory each step (the write-up's rollout-mechanism test)."""

    def __init__(self, step_s: float, weights_dir: Path) -> None:
        self.step_s = step_s
        self.weights_dir = weights_dir
        self.rewards: list[float] = []

    async def step(self, batch: TrainingBatch, version: int) -> str | None:
        self.rewards.extend(r for g in batch.batch.groups for r in g.rewards)
        await asyncio.sleep(self.step_s)
        path = self.weights_dir / f"v{version}"
        await asyncio.to_thread(save_sentinel, path, float(version))
        return str(path)
