"""The bench's workload family: built-in named workloads, each a stress the techniques must survive.

- `default`: the calibrated terminal-bench-style workload (`Workload()`). Its agent cap (420 s), task
  spread (0.3), reset and validate tails and engine slots were chosen so that `sync` lands at the
  write-up's 591.8 s; see docs/simulator.md.
- `design`: DESIGN.md's terminal-bench-core figures taken as they are, with no calibration: setup
  median 7 s / p90 76 s (uncapped), agent cap 660 s, 18 turns median / 36 p90, tests 5 / 55 s capped at
  120 s, cleanup 13 / 17 s capped at 38 s, task log-sd 0.6, attempt log-sd 0.15 (within-group max/mean
  ≈ 1.24). DESIGN.md gives no split of a turn into engine and tool time: engine time per turn is
  median 10 s / p90 20 s and tool time the default 2.5 / 10 s, so 18 turns make about the 270 s median
  agent phase. Resources are the default's.
- `cpu-scarce`: the held-out case: 32 sandbox cores for 384 live trajectories, resets that need half
  a core with a tail beyond an hour (median 20 s, p90 300 s, cap 5,400 s), and a static proportional
  split that gives the reset lane 4 cores for its 64 slots.
- `ample-cpu`: the default with 2,048 cores and 1,024 slots a lane: CPUs never limit anything.
- `trace`: replays examples/tb-trace.jsonl (240 attempts of 40 tasks; synthetic, drawn to DESIGN.md's
  quantiles with a few setups beyond an hour, see benchmarks/make_trace.py), 8 batches.

`builtin_workload(name)` builds one; `load_workload` accepts these names in place of a file.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from app.sim.workload import Workload

TRACE_PATH = Path(__file__).resolve().parents[2] / "examples" / "tb-trace.jsonl"


def _ln(median: float, p90: float, cap: float | None = None) -> dict[str, Any]:
    spec: dict[str, Any] = {"median": median, "p90": p90}
    if cap is not None:
        spec["max"] = cap
    return {"lognormal": spec}


FAMILY: dict[str, dict[str, Any]] = {
    "default": {},
    "design": {
        "trajectory": {
            "reset_s": _ln(7, 76),
            "turns": _ln(18, 36),
            "llm_s": _ln(10, 20),
            "tool_s": _ln(2.5, 10),
            "validate_s": _ln(5, 55, 120),
            "cleanup_s": _ln(13, 17, 38),
            "timeout_s": 660.0,
            "task_spread": 0.6,
            "attempt_spread": 0.15,
        },
    },
    "cpu-scarce": {
        "batches": 8,
        "batch": {"groups": 16, "group_size": 8},
        "policy": {"surplus_groups": 32, "max_staleness": 4},
        "engines": {"count": 4, "slots": 96},
        "cpus": {
            "total": 40,
            "serving": 8,
            "sandbox_demand": {"reset": 0.5, "exec": 1.0, "validate": 0.5, "cleanup": 0.5},
        },
        "lanes": {"reset": 64, "exec": 192, "validate": 16, "cleanup": 32},
        "trajectory": {"reset_s": _ln(20, 300, 5400)},
    },
    "ample-cpu": {
        "cpus": {"total": 2048, "serving": 64},
        "lanes": {"reset": 1024, "exec": 1024, "validate": 1024, "cleanup": 1024},
    },
    "trace": {
        "batches": 8,
        "trajectory": {"timeout_s": 660.0},
        "trace": {"path": str(TRACE_PATH), "llm_fraction": 0.6},
    },
}


def builtin_workload(name: str, **overrides: Any) -> Workload:
    """The named workload of the family, with top-level sections merged from `overrides`."""
    if name not in FAMILY:
        raise KeyError(f"no built-in workload {name!r}; choose one of {', '.join(FAMILY)}")
    data = {key: dict(value) if isinstance(value, dict) else value for key, value in FAMILY[name].items()}
    for key, value in overrides.items():
        data[key] = {**data.get(key, {}), **value} if isinstance(value, dict) else value
    return Workload.model_validate(data)
