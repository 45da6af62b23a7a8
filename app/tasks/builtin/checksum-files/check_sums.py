"""Validation for checksum-files: SHA256SUMS lists a correct SHA-256 for every file under data/."""

import hashlib
import os
import sys

want = {}
for name in sorted(os.listdir("data")):
    with open(os.path.join("data", name), "rb") as f:
        want[f"data/{name}"] = hashlib.sha256(f.read()).hexdigest()
try:
    with open("SHA256SUMS") as f:
        lines = [line.rstrip("\n") for line in f if line.strip()]
except FileNotFoundError:
    sys.exit("FAIL: SHA256SUMS is missing")
got = {}
for line in lines:
    digest, sep, path = line.partition("  ")
    if not sep:
        sys.exit(f"FAIL: not in sha256sum format: {line!r}")
    got[path.lstrip("*")] = digest
if got != want:
    missing = sorted(set(want) - set(got))
    wrong = sorted(p for p in want if p in got and got[p] != want[p])
    sys.exit(f"FAIL: missing {missing}, wrong digest {wrong}, extra {sorted(set(got) - set(want))}")
print(f"ok: {len(want)} files")
