"""Set-up for gzip-max-compression: a deterministic 45 MB server.log.

Sizes with GNU gzip 1.12: -1 15.2 MB, -6 (default) 11.60 MB, -9 11.31 MB; the task's 11.45 MB bound
therefore needs -9.
"""

import random

rng = random.Random(11)
words = ["alpha", "beta", "gamma", "delta", "error", "warn", "info", "request"]
words += ["served", "cache", "miss", "hit", "user", "session", "timeout", "retry"]
with open("server.log", "w") as f:
    for _ in range(600_000):
        stamp = f"2024-02-{rng.randrange(1, 29):02d}T{rng.randrange(24):02d}:{rng.randrange(60):02d}"
        stamp += f":{rng.randrange(60):02d}"
        text = " ".join(rng.choice(words) for _ in range(6))
        f.write(f"{stamp} {rng.choice(words)} {text} id={rng.randrange(10**9)}\n")
