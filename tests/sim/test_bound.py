"""The lower bound's two capacity terms, on figures small enough to check by hand."""

from __future__ import annotations

import pytest

from app.sim.bound import lower_bound_s


def test_groups_capacity_and_attempt_capacity_on_a_worked_example() -> None:
    # Four groups of G = 2 attempts: durations (slowest attempt) 10 s, attempt-seconds 12 s each; B = 2,
    # S = 0, two batches, no trainer step.
    durations, work = [10.0] * 4, [12.0] * 4
    # In groups: 4 groups through B + S = 2 places take 20 s; mean over two batches ≥ 20 / 2.
    assert lower_bound_s(durations, 2, 2, 2, 0.0) == 10.0
    # In attempts: 48 attempt-seconds through (B + S)·G = 4 places take 12 s; the order statistic (10 s)
    # is smaller, so the second batch is at least 12 s away and the mean at least 6 s.
    assert lower_bound_s(durations, 2, 2, 2, 0.0, attempt_work=work, max_attempts=4) == 6.0


def test_attempt_capacity_needs_its_room_and_one_figure_per_group() -> None:
    with pytest.raises(ValueError, match="attempt_work"):
        lower_bound_s([1.0, 2.0], 1, 2, 2, 0.0, attempt_work=[1.0, 2.0])
    with pytest.raises(ValueError, match="attempt_work"):
        lower_bound_s([1.0, 2.0], 1, 2, 2, 0.0, attempt_work=[1.0], max_attempts=4)
