"""Set-up for checksum-files: deterministic binary and text files under data/ (about 6 MB)."""

import os
import random

rng = random.Random(99)
os.makedirs("data", exist_ok=True)
for i, size in enumerate([1_000, 70_000, 2_000_000, 3_500_000]):
    with open(f"data/blob{i}.bin", "wb") as f:
        f.write(rng.randbytes(size))
for name in ["notes.txt", "readme.txt"]:
    with open(f"data/{name}", "w") as f:
        f.writelines(f"{name} line {n} {rng.random():.6f}\n" for n in range(5_000))
