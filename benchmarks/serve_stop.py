"""How long a served simulated run with a large surplus takes to stop, and where the time goes.

`python -m benchmarks.serve_stop --surplus 100000 --run-s 10` builds the run manager `corral serve`
builds (SQLite in a temporary directory), creates a sim run (the small workload, sentinel trainer,
speed 1) with S = `--surplus`, lets it run `--run-s` wall seconds, stops it, and prints: when the stop
was taken on the run's loop, when the loop ended, when its last event was stored, and the events
stored. With `--sample`, every thread's stack is sampled every 10 ms and the commonest innermost
`app/` frames are printed for the run phase and the stop phase (py-spy is not installed here).
"""

from __future__ import annotations

import argparse
import collections
import sys
import tempfile
import threading
import time
import traceback
from pathlib import Path

from app.service.compose import manager_for, store_for
from app.service.schemas import RunCreate
from app.settings import Settings

ENDED = ("stopped", "failed", "completed")


class Sampler(threading.Thread):
    """Counts each thread's innermost `app/` frames every `every_s`, under the phase set in `phase`."""

    def __init__(self, every_s: float = 0.01) -> None:
        super().__init__(name="sampler", daemon=True)
        self.every_s = every_s
        self.phase = "run"
        self.counts: dict[str, collections.Counter[str]] = collections.defaultdict(collections.Counter)
        self.done = threading.Event()

    def run(self) -> None:
        while not self.done.wait(self.every_s):
            names = {t.ident: t.name for t in threading.enumerate()}
            for ident, frame in sys._current_frames().items():
                if ident == self.ident:
                    continue
                frames = [f for f in traceback.extract_stack(frame) if "/app/" in f.filename][-3:]
                where = " <- ".join(f"{Path(f.filename).name}:{f.name}:{f.lineno}" for f in reversed(frames))
                self.counts[self.phase][f"{names.get(ident, '?').split('-')[0]} | {where}"] += 1


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--surplus", type=int, default=100_000)
    parser.add_argument("--run-s", type=float, default=10.0)
    parser.add_argument("--sample", action="store_true")
    args = parser.parse_args()
    tmp = Path(tempfile.mkdtemp(prefix="serve-stop-"))
    settings = Settings(
        database_url=f"sqlite:///{tmp / 'c.db'}", operator_token="x" * 10, data_dir=tmp / "data"
    )
    store = store_for(settings)
    manager = manager_for(settings, store)
    sampler = Sampler()
    if args.sample:
        sampler.start()
    spec = {"name": "big", "kind": "sim", "speed": 1.0, "trainer": "sentinel", "surplus_groups": args.surplus}
    run_id = manager.create(RunCreate.model_validate(spec))
    handle = manager.get(run_id)
    assert handle is not None
    time.sleep(args.run_s)
    live = handle.live()
    admitted, events = live["groups_admitted"], live["events"]
    print(f"at the stop: {live['state']}, {admitted:,} groups admitted, {events:,} events")
    sampler.phase = "stop"
    t0 = time.monotonic()
    handle.submit(handle.stop).result(3600)
    print(f"stop taken on the run's loop after {time.monotonic() - t0:.2f} s")
    handle.flushing.wait(3600)
    live = handle.live()
    print(f"loop ended after {time.monotonic() - t0:.2f} s: {live['events']:,} events, "
          f"{live['events_unwritten']:,} not yet stored")  # fmt: skip
    handle.join(3600)
    print(f"{handle.state.value} (its events stored) after {time.monotonic() - t0:.2f} s")
    sampler.done.set()
    manager.shutdown()
    print(f"events stored: {(store.last_seq(run_id) or 0) + 1:,}")
    store.close()
    for phase, counts in sampler.counts.items():
        print(f"== {phase}: {sum(counts.values())} samples")
        for where, n in counts.most_common(15):
            print(f"{n:6d} {where}")


if __name__ == "__main__":
    from benchmarks import run_script

    run_script(main)
