"""What a store sink's spill costs the publisher: `turn_done` events published past a sink held shut
(a database away), first into the buffer, then past it into the spill on local disk, then the sink let
go and drained. Prints the cost of a publish in each phase (below half full; from half full, while the
buffer is copied to disk on a thread of its own; into the spill), the one publish that started the
spill (which waits for the rest of the copy), how much of the copy was on disk as the spill began, and
the disk the spill took.

    python -m benchmarks.spill_cost [--buffer 100000] [--spilled 100000]
"""

from __future__ import annotations

import argparse
import tempfile
import threading
import time
from collections.abc import Sequence
from pathlib import Path

from app.core.events import Envelope, TurnDone
from app.runtime.events import EventBus
from app.runtime.spill import SpillFile


class HeldSink:
    def __init__(self) -> None:
        self.gate = threading.Event()

    def write_batch(self, envelopes: Sequence[Envelope]) -> None:
        self.gate.wait(600)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--buffer", type=int, default=100_000, help="the sink's buffer (envelopes)")
    parser.add_argument("--spilled", type=int, default=100_000, help="envelopes published past it")
    args = parser.parse_args()
    if not 500 <= args.buffer <= 10_000_000 or not 1 <= args.spilled <= 10_000_000:
        parser.error("--buffer takes 500 to 10,000,000, --spilled 1 to 10,000,000")
    with tempfile.TemporaryDirectory() as tmp:
        clock = iter(range(10**9))
        bus = EventBus("bench", clock=lambda: float(next(clock)))
        sink = HeldSink()
        spill = SpillFile(Path(tmp) / "spill", max_bytes=2**40)
        bus.add_sink(sink, name="store", capacity=args.buffer, spill=spill)
        event = TurnDone(1, 0, "engine-0", 3, 0.0, 0.5, 1.0, 128)
        half = args.buffer // 2
        started = time.perf_counter()
        for _ in range(half):
            bus.publish(event)
        below_half = (time.perf_counter() - started) / half
        above_half = []  # each publish from half full to the one that started the spill
        while bus.stats()["store"]["spilled"] == 0:
            started = time.perf_counter()
            bus.publish(event)
            above_half.append(time.perf_counter() - started)
        first = above_half.pop()
        copied_then = spill.backup_bytes  # the buffer's copy on disk as the spill began
        started = time.perf_counter()
        while not spill.backup_bytes:
            time.sleep(0.001)
        copied_after = time.perf_counter() - started
        started = time.perf_counter()
        for _ in range(args.spilled - 1):
            bus.publish(event)
        into_spill = time.perf_counter() - started
        time.sleep(1.0)  # the copy of the buffer is written
        held = bus.stats()["store"]
        sink.gate.set()
        started = time.perf_counter()
        stats = bus.close(600)["store"]
        drain = time.perf_counter() - started
    above_half.sort()
    print(f"publish into the buffer, below half: {below_half * 1e6:.2f} µs each ({half:,})")
    print(f"publish into the buffer, half to full: median {above_half[len(above_half) // 2] * 1e6:.2f} µs, "
          f"mean {sum(above_half) / len(above_half) * 1e6:.2f} µs, max {above_half[-1] * 1e3:.1f} ms "
          f"({len(above_half):,})")  # fmt: skip
    print(f"the publish that started the spill: {first * 1e3:.1f} ms")
    print(f"the buffer's copy on disk as the spill began: {copied_then:,} bytes; "
          f"any copy on disk {copied_after * 1e3:.0f} ms later")  # fmt: skip
    print(f"publish into the spill: {into_spill / max(1, args.spilled - 1) * 1e6:.2f} µs each")
    print(f"on disk: {held['spill_bytes']:,} bytes (spill and buffer copy) for {held['spilled']:,} spilled")
    print(f"drained in {drain:.1f} s: written {stats['written']:,}, recovered {stats['recovered']:,}, "
          f"dropped {stats['dropped']}")  # fmt: skip


if __name__ == "__main__":
    from benchmarks import run_script

    run_script(main)
