"""Validation for fix-off-by-one: exit 0 only when every case passes."""

import sys

from window_sum import window_sums

CASES: list[tuple[list[int], int, list[int]]] = [
    ([1, 2, 3, 4], 2, [3, 5, 7]),
    ([5], 1, [5]),
    ([1, 2, 3], 3, [6]),
    ([4, -1, 2, 0, 7], 1, [4, -1, 2, 0, 7]),
    ([1, 2], 3, []),
]

failures = 0
for values, k, want in CASES:
    got = window_sums(values, k)
    if got != want:
        failures += 1
        print(f"FAIL window_sums({values}, {k}) = {got}, want {want}")
print(f"{len(CASES) - failures}/{len(CASES)} passed")
sys.exit(1 if failures else 0)
