"""Validation for json-transform: active_adults.json lists the lower-cased, sorted e-mails of adults."""

import json
import sys

with open("users.json") as f:
    users = json.load(f)
want = sorted(u["email"].lower() for u in users if u["active"] and u["age"] >= 18)
try:
    with open("active_adults.json") as f:
        got = json.load(f)
except FileNotFoundError:
    sys.exit("FAIL: active_adults.json is missing")
except json.JSONDecodeError as exc:
    sys.exit(f"FAIL: active_adults.json is not JSON: {exc}")
if got != want:
    sys.exit(f"FAIL: got {got}, want {want}")
print(f"ok: {len(want)} addresses")
