"""`water_fill` gives the same bits in every process: its sums run in the demand's order, not in a set's,
whose order follows string hashing (PYTHONHASHSEED), so a float sum could differ in its last bit from one
process to the next (a cpu-scarce simulation's event times moved by one ulp between runs)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
# Weights whose sum depends on the order of addition: (0.1 + 0.2) + 0.3 != 0.1 + (0.2 + 0.3).
PROGRAM = """
from app.sim.cpu import water_fill
demand = {"reset": 5.0, "exec": 5.0, "validate": 5.0, "cleanup": 0.05}
weights = {"reset": 0.1, "exec": 0.2, "validate": 0.3, "cleanup": 0.4}
print(sorted((name, cores.hex()) for name, cores in water_fill(demand, weights, 3.0).items()))
"""


def test_water_fill_gives_the_same_bits_whatever_the_string_hashing() -> None:
    answers = set()
    for seed in range(12):
        env = {**os.environ, "PYTHONHASHSEED": str(seed), "PYTHONPATH": str(ROOT)}
        done = subprocess.run(
            [sys.executable, "-c", PROGRAM], env=env, capture_output=True, text=True, check=True, cwd=ROOT
        )
        answers.add(done.stdout)
    assert len(answers) == 1, answers
