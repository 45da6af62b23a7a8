"""Validation for count-primes: primes.txt holds "COUNT SUM" for the primes below 60,000,000."""

import sys

# pi(6e7) and the sum of those primes, computed once with primes_tool.py's sieve.
WANT = "3562115 103468900363400"

try:
    with open("primes.txt") as f:
        got = " ".join(f.read().split())
except FileNotFoundError:
    sys.exit("FAIL: primes.txt is missing")
if got != WANT:
    sys.exit(f"FAIL: primes.txt holds {got!r}, want {WANT!r}")
print("ok")
