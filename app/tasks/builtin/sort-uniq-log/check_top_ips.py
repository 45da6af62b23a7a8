"""Validation for sort-uniq-log: top_ips.txt holds the 5 busiest IPs as "COUNT IP", busiest first."""

import sys
from collections import Counter

with open("access.log") as f:
    want = [(n, ip) for ip, n in Counter(line.split()[0] for line in f if line.strip()).most_common(5)]
try:
    with open("top_ips.txt") as f:
        rows = [line.split() for line in f if line.strip()]
except FileNotFoundError:
    sys.exit("FAIL: top_ips.txt is missing")
got = [(int(r[0]), r[1]) if len(r) == 2 and r[0].isdigit() else (-1, " ".join(r)) for r in rows]
if got != want:
    sys.exit(f"FAIL: got {got}, want {want}")
print("ok")
