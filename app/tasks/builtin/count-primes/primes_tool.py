"""Count and sum the primes below N, in pure Python (deliberately CPU-bound).

usage: python3 primes_tool.py {sieve,trial} N    prints "COUNT SUM"
`sieve` is Eratosthenes with an explicit inner loop (seconds for N ~ 6e7); `trial` divides every
candidate by the primes found so far (hours for the same N).
"""

import argparse


def sieve(n: int) -> tuple[int, int]:
    marks = bytearray([1]) * max(n, 2)
    marks[0] = marks[1] = 0
    i = 2
    while i * i < n:
        if marks[i]:
            for j in range(i * i, n, i):
                marks[j] = 0
        i += 1
    count = total = 0
    for k in range(n):
        if marks[k]:
            count += 1
            total += k
    return count, total


def trial(n: int) -> tuple[int, int]:
    primes: list[int] = []
    for k in range(2, n):
        if all(k % p for p in primes if p * p <= k):
            primes.append(k)
    return len(primes), sum(primes)


def main() -> None:
    parser = argparse.ArgumentParser(description="Count and sum the primes below N.")
    parser.add_argument("method", choices=["sieve", "trial"])
    parser.add_argument("n", type=int)
    args = parser.parse_args()
    count, total = sieve(args.n) if args.method == "sieve" else trial(args.n)
    print(count, total)


if __name__ == "__main__":
    main()
