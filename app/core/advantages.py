"""GRPO advantages: each reward normalised by its own group's mean and standard deviation.

A group whose rewards are all equal has zero advantages (and carries no learning signal).
"""

from __future__ import annotations

import math
from collections.abc import Sequence


def no_learning_signal(rewards: Sequence[float]) -> bool:
    """Whether a finished group's rewards are all equal (and there is at least one): its advantages
    are all zero. The scheduler discards such a group under `filter_zero_variance`; the run report
    counts those delivered."""
    return len(set(rewards)) == 1


def grpo_advantages(rewards: Sequence[float], eps: float = 1e-6) -> tuple[float, ...]:
    if not rewards:
        return ()
    mean = sum(rewards) / len(rewards)
    var = sum((r - mean) ** 2 for r in rewards) / len(rewards)
    std = math.sqrt(var)
    return tuple((r - mean) / (std + eps) for r in rewards)
