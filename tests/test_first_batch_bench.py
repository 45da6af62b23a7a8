"""benchmarks/first_batch.py: the first batch beside the B-th fastest group admitted at t = 0 and of all."""

from __future__ import annotations

from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


def test_the_first_batch_is_no_faster_than_its_admissions_allow(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.syspath_prepend(str(REPO))  # benchmarks/ is imported from the checkout
    from benchmarks.first_batch import first_batch

    row = first_batch("ample-cpu")
    assert row["admitted_at_start"] >= row["groups_per_batch"]
    # B groups done take at least the B-th smallest duration of all admitted groups (each runs at least
    # its own from its admission, at t >= 0), and every group admitted includes those at t = 0.
    assert row["first_batch_s"] >= row["bth_fastest_of_all_s"] - 1e-6
    assert row["bth_fastest_of_all_s"] <= row["bth_fastest_at_start_s"]
    assert row["admitted"] > row["admitted_at_start"]
