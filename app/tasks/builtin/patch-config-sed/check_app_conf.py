"""Validation for patch-config-sed: app.conf matches the expected text exactly."""

import sys

WANT = """\
# Example settings. Keep this comment as is: port = 8080, debug = true
[server]
port = 9090
host = 127.0.0.1
# port = 8080 was the old default
debug = false

[cache]
enabled = true
ttl = 300
"""

with open("app.conf") as f:
    got = f.read()
if got != WANT:
    for n, (g, w) in enumerate(zip(got.splitlines(), WANT.splitlines(), strict=False), start=1):
        if g != w:
            sys.exit(f"FAIL: line {n} is {g!r}, want {w!r}")
    sys.exit("FAIL: app.conf has the wrong number of lines")
print("ok")
