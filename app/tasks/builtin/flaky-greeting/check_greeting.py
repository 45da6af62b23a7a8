"""Validation for flaky-greeting: correct content, then a simulated transient failure.

A correct greeting.txt still fails with probability CORRAL_FLAKY_P (default 0.3), drawn from an RNG
seeded by CORRAL_FLAKY_SEED or, by default, the current time: the kind of flaky test that makes a
group's rewards noisy. A wrong greeting.txt always fails.
"""

import os
import random
import sys
import time

try:
    with open("greeting.txt") as f:
        content = f.read()
except FileNotFoundError:
    sys.exit("FAIL: greeting.txt is missing")
if content != "hello, corral\n":
    sys.exit(f"FAIL: greeting.txt holds {content!r}")
seed = int(os.environ.get("CORRAL_FLAKY_SEED", time.time_ns()))
rate = float(os.environ.get("CORRAL_FLAKY_P", "0.3"))
if random.Random(seed).random() < rate:
    sys.exit(f"FAIL: transient failure (simulated flaky test, seed {seed})")
print("ok")
