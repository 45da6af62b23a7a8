"""Write examples/tb-trace.jsonl: a small synthetic terminal-bench-style trace for the trace-replay
workload of the bench family.

It is NOT recorded from real trials: each of 40 tasks gets 6 attempts whose phases are drawn from
lognormals matched to docs/design.md's terminal-bench-core 0.1.1 quantiles (setup median 7 s and p90 76 s;
agent phase median 270 s and p90 660 s, capped at 660 s like most harness timeouts; tests median 5 s,
p90 55 s, capped at 120 s; cleanup median 13 s, p90 17 s, capped at 38 s), with a per-task difficulty
(log-sd 0.6 across tasks) shared by the task's attempts and its setup. A few setups are stretched into
a long tail (beyond an hour) as a held-out trace showed. Seeded, so the file is reproducible:
`.venv/bin/python -m benchmarks.make_trace [--out PATH]` (default: examples/tb-trace.jsonl).
"""

from __future__ import annotations

import json
import math
import random
from pathlib import Path

Z90 = 1.2815515655446004
OUT = Path(__file__).resolve().parents[1] / "examples" / "tb-trace.jsonl"


def lognormal(rng: random.Random, median: float, p90: float, scale: float = 1.0) -> float:
    return median * scale * math.exp(rng.gauss(0.0, math.log(p90 / median) / Z90))


def main(argv: list[str] | None = None) -> None:
    from benchmarks import ScriptParser, check_outputs  # as a script (-m), the package is importable

    parser = ScriptParser(description="Write a small, seeded, synthetic terminal-bench-style trace.")
    parser.add_argument("--out", type=Path, default=OUT, help="write the trace here (default: %(default)s)")
    args = parser.parse_args(argv)
    check_outputs(out=args.out)
    rng = random.Random(20261129)
    lines = []
    for t in range(40):
        difficulty = math.exp(rng.gauss(0.0, 0.6))
        setup = min(lognormal(rng, 7, 76), 860.0)
        if rng.random() < 0.05:
            setup = rng.uniform(3600, 5400)  # the long tail: an image pull or dataset build past an hour
        for _ in range(6):
            agent = min(lognormal(rng, 270, 660, difficulty**0.5) * math.exp(rng.gauss(0.0, 0.15)), 660.0)
            lines.append(
                {
                    "task": f"tb-{t:02d}",
                    "reset_s": round(setup * math.exp(rng.gauss(0.0, 0.1)), 2),
                    "agent_s": round(agent, 2),
                    "validate_s": round(min(lognormal(rng, 5, 55), 120.0), 2),
                    "cleanup_s": round(min(lognormal(rng, 13, 17), 38.0), 2),
                    "reward": 1.0 if rng.random() < 0.5**difficulty else 0.0,
                }
            )
    args.out.write_text("".join(json.dumps(line) + "\n" for line in lines))
    print(f"wrote {len(lines)} attempts of 40 tasks to {args.out}")


if __name__ == "__main__":
    from benchmarks import run_script

    run_script(main)
