"""Validation for gzip-max-compression: server.log.gz is small enough and decompresses to server.log."""

import gzip
import os
import sys

LIMIT = 11_450_000

for name in ["server.log", "server.log.gz"]:
    if not os.path.isfile(name):
        sys.exit(f"FAIL: {name} is missing")
size = os.path.getsize("server.log.gz")
if size > LIMIT:
    sys.exit(f"FAIL: server.log.gz is {size} bytes, limit {LIMIT}")
with gzip.open("server.log.gz", "rb") as packed, open("server.log", "rb") as plain:
    while True:
        a, b = packed.read(1 << 20), plain.read(1 << 20)
        if a != b:
            sys.exit("FAIL: server.log.gz does not decompress to server.log")
        if not a:
            break
print(f"ok: {size} bytes")
