"""Set-up for slow-setup-dataset: dataset.csv from a SHA-256 chain (deterministic, CPU-bound).

Each row stretches the chain by ROUNDS hashes, so the set-up costs real CPU time, not a sleep.
"""

import hashlib

ROWS = 200_000
ROUNDS = 128

h = b"corral-dataset"
with open("dataset.csv", "w") as f:
    f.write("id,group,value\n")
    for i in range(ROWS):
        for _ in range(ROUNDS):
            h = hashlib.sha256(h).digest()
        f.write(f"{i},{h[0] % 16},{int.from_bytes(h[1:4], 'big') % 10_000}\n")
