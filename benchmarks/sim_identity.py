"""Simulation identity: the reports (minus wall-clock fields) and a digest of the event stream of a set
of simulations, written to JSON so that two versions of the simulator can be diffed.

A change that only makes the simulator faster must leave every figure here bit-identical: same seeds,
same reports, same events in the same order at the same virtual times. Run it before and after, then
compare:

    .venv/bin/python -m benchmarks.sim_identity --out /tmp/before.json
    ... change the code ...
    .venv/bin/python -m benchmarks.sim_identity --out /tmp/after.json --compare /tmp/before.json

Cases: the built-in family (default, design, ample-cpu and trace, with fewer batches for speed;
cpu-scarce with 2) under rungs of the ladder (sync, completion, lanes, full), three peer rungs (slime:
stop-the-world restarts; areal: in-flight admission with a ready surplus; prime-rl: start order),
partitioned lanes, a live retune and two small `benchmarks.scale` runs (short and realistic). Each
case records the report and a SHA-256 over every envelope (seq, time as a float's hex, kind, fields),
so a reordering that leaves the report alone still shows.
`--quick` runs a subset. Exit 1 when a comparison differs.
"""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import json
import time
from collections.abc import Callable
from typing import Any

from app.core.config import PolicyConfig
from app.core.events import Envelope
from app.sim.family import builtin_workload
from app.sim.peers import peer_policy
from app.sim.run import policy_for, simulate
from app.sim.workload import Workload

WALL_FIELDS = {"wall_s"}


def _fmt(value: Any) -> str:
    if isinstance(value, float):
        return value.hex()
    if isinstance(value, tuple | list):
        return "[" + ",".join(_fmt(v) for v in value) + "]"
    if isinstance(value, dict):
        return "{" + ",".join(f"{k}:{_fmt(v)}" for k, v in sorted(value.items(), key=str)) + "}"
    return repr(value)


def _strip(report: Any) -> Any:
    if isinstance(report, dict):
        return {k: _strip(v) for k, v in report.items() if k not in WALL_FIELDS}
    if isinstance(report, list):
        return [_strip(v) for v in report]
    return report


Changes = list[tuple[float, str, int]]
Build = Callable[[], tuple[Workload, PolicyConfig, str, Changes]]
Case = tuple[str, Build]


def _family(name: str, rung: str, batches: int, **overrides: Any) -> Case:
    def build() -> tuple[Workload, PolicyConfig, str, Changes]:
        workload = builtin_workload(name, batches=batches, **overrides)
        if rung.startswith("peer:"):
            policy = peer_policy(workload, rung.removeprefix("peer:"))
        else:
            policy = policy_for(workload, rung)
        return workload, policy, rung, []

    suffix = f" {overrides}" if overrides else ""
    return f"{name}/{rung}/b{batches}{suffix}", build


def _retune() -> tuple[Workload, PolicyConfig, str, Changes]:
    workload = builtin_workload("default", batches=4)
    return (
        workload,
        policy_for(workload, "full"),
        "full",
        [(300.0, "surplus_groups", 8), (900.0, "max_staleness", 1)],
    )


def _scale() -> tuple[Workload, PolicyConfig, str, Changes]:
    from benchmarks.scale import scale_workload

    workload = scale_workload(groups=25, group_size=8, surplus=100, batches=3)
    return workload, policy_for(workload, "full"), "full", []


def _scale_realistic() -> tuple[Workload, PolicyConfig, str, Changes]:
    from benchmarks.scale import scale_workload

    workload = scale_workload(groups=10, group_size=8, surplus=40, batches=2, shape="realistic")
    return workload, policy_for(workload, "full"), "full", []


def cases(quick: bool) -> list[Case]:
    out: list[Case] = []
    for rung in ("sync", "completion", "lanes", "full"):
        out.append(_family("default", rung, 4))
    out += [
        _family("default", "peer:slime", 4),
        _family("default", "peer:areal", 4),
        _family("default", "full", 4, lanes={"sharing": "partitioned"}),
        ("default/full/retune", _retune),
        ("scale/short", _scale),
    ]
    if quick:
        return out
    for name in ("design", "ample-cpu", "trace"):
        for rung in ("sync", "full"):
            out.append(_family(name, rung, 3))
    out += [
        _family("design", "completion", 3),
        _family("trace", "peer:prime-rl", 3),
        _family("cpu-scarce", "full", 2),
        _family("cpu-scarce", "lanes", 2),
        ("scale/realistic", _scale_realistic),
    ]
    return out


def run_case(build: Build) -> dict[str, Any]:
    workload, policy, name, changes = build()
    digest = hashlib.sha256()
    count = 0

    def on_envelope(env: Envelope) -> None:
        nonlocal count
        count += 1
        fields = {f.name: getattr(env.event, f.name) for f in dataclasses.fields(env.event)}
        digest.update(f"{env.seq}|{env.t.hex()}|{env.event.kind}|{_fmt(fields)}\n".encode())

    report = simulate(workload, policy, name, changes=changes, events=on_envelope)
    # The same run without an extra subscriber: a bus that builds payloads lazily must not differ.
    plain = simulate(workload, policy, name, changes=changes)
    same = _strip(plain) == _strip(report)
    return {"report": _strip(report), "events": count, "digest": digest.hexdigest(), "plain_same": same}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--out", required=True, help="write the results here (JSON)")
    parser.add_argument("--compare", help="a JSON written before: report every case that differs")
    parser.add_argument("--quick", action="store_true", help="a subset of the cases")
    args = parser.parse_args(argv)
    from benchmarks import check_outputs  # as a script (-m), the package is importable

    check_outputs(out=args.out)
    results: dict[str, Any] = {}
    for name, build in cases(args.quick):
        t0 = time.perf_counter()
        results[name] = run_case(build)
        print(f"{name}: {results[name]['events']} events, {time.perf_counter() - t0:.1f} s", flush=True)
    with open(args.out, "w") as fh:
        json.dump(results, fh, indent=1, sort_keys=True)
    bad = [name for name, r in results.items() if not r["plain_same"]]
    for name in bad:
        print(f"DIFFERS with and without an event subscriber: {name}")
    if args.compare:
        with open(args.compare) as fh:
            before = json.load(fh)
        for name, r in results.items():
            if name not in before:
                print(f"not in {args.compare}: {name}")
            elif json.loads(json.dumps(r, sort_keys=True)) != before[name]:
                old = before[name]
                what = [k for k in r if json.loads(json.dumps(r[k])) != old.get(k)]
                print(f"DIFFERS: {name} ({', '.join(what)})")
                bad.append(name)
        if not bad:
            print(f"identical: {len(results)} cases")
    return 1 if bad else 0


if __name__ == "__main__":
    from benchmarks import run_script

    run_script(main)
