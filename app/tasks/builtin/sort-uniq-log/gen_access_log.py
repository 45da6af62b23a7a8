"""Set-up for sort-uniq-log: write a deterministic access.log (about 45k lines).

The six busiest IPs have fixed, distinct counts so the top five are unambiguous.
"""

import random

rng = random.Random(20240611)
ips = sorted({f"10.{rng.randrange(256)}.{rng.randrange(256)}.{rng.randrange(1, 255)}" for _ in range(60)})
busy = rng.sample(ips, 6)
counts = dict(zip(busy, [5100, 4300, 3650, 3120, 2710, 2290], strict=True))
for ip in ips:
    counts.setdefault(ip, rng.randrange(100, 2000))
paths = ["/", "/login", "/api/items", "/api/items/7", "/static/app.js", "/health"]
lines = []
for ip, n in counts.items():
    for _ in range(n):
        day = rng.randrange(1, 29)
        path = rng.choice(paths)
        status = rng.choice([200, 200, 200, 304, 404, 500])
        size = rng.randrange(50, 9000)
        lines.append(f'{ip} - - [{day:02d}/Feb/2024] "GET {path} HTTP/1.1" {status} {size}')
rng.shuffle(lines)
with open("access.log", "w") as f:
    f.write("\n".join(lines) + "\n")
