"""Validation for slow-setup-dataset: answer.txt holds the sum of value over group 7."""

import csv
import sys

with open("dataset.csv") as f:
    rows = list(csv.DictReader(f))
if len(rows) != 200_000:
    sys.exit(f"FAIL: dataset.csv has {len(rows)} rows, want 200000 (was it modified?)")
want = sum(int(r["value"]) for r in rows if r["group"] == "7")
try:
    with open("answer.txt") as f:
        got = f.read().strip()
except FileNotFoundError:
    sys.exit("FAIL: answer.txt is missing")
if got != str(want):
    sys.exit(f"FAIL: answer.txt holds {got!r}, want {want}")
print("ok")
