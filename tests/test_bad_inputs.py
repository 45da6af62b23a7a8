"""Every bad input a user would try, refused: exit code 2, one line on stderr naming the field or flag
as the user typed it, never a traceback; and refused before any work (no engine starts, no file left).

The table runs the real `corral` entry point (`app.cli.main`) in-process, as typer's CliRunner would,
so it stays fast; `test_refusals_from_the_installed_script` runs a sample through the console script.
"""

from __future__ import annotations

import importlib.util
import json
import math
import os
import re
import shutil
import socket
import stat
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
from factories import make_workload_data
from pydantic import BaseModel

from app.cpulist import CpuListError, parse_cpu_list
from app.runtime.config import LocalRunConfig
from app.sim.workload import Workload
from app.validation import DISTRIBUTIONS, limit_rows

CORRAL = Path(sys.executable).with_name("corral")
VLLM_PRESENT = shutil.which("vllm") is not None or importlib.util.find_spec("vllm") is not None

GOOD_TRACE_LINE = {"task": "a", "reset_s": 1, "agent_s": 5, "validate_s": 1, "cleanup_s": 1, "reward": 1}
LONG = "x" * 300  # a file name the OS refuses to look up (over 255 bytes)
GOOD_TASK = "instruction: say hi\nvalidation: {command: 'true'}\n"


@dataclass
class Case:
    """One bad input: files to write (name → text or bytes), the argv, what the message must name."""

    args: list[str]
    needles: list[str]
    files: dict[str, str | bytes] = field(default_factory=dict)
    absent: list[str] = field(default_factory=list)  # must not appear in the message


def workload(**overrides: Any) -> str:
    return json.dumps(make_workload_data(**overrides))


def run_config(extra: str = "") -> str:
    return (
        "batch: {groups: 1, group_size: 2}\nengines: {count: 1, cpus: [0]}\nlanes: {cpus: [1]}\n"
        "tasks: {suite: suite}\n" + extra
    )


SUITE = {"suite/hello/task.yaml": GOOD_TASK}

CASES: dict[str, Case] = {
    # -- non-finite numbers ---------------------------------------------------------------------------
    "workload step_s .inf": Case(
        ["sim", "--workload", "w.yaml"], ["trainer.step_s", "finite"], {"w.yaml": "trainer: {step_s: .inf}\n"}
    ),
    "workload NaN in a distribution": Case(
        ["sim", "--workload", "w.json"],
        ["trajectory.llm_s", "finite"],
        {"w.json": workload(trajectory={"llm_s": {"uniform": [0, "NaN"]}}).replace('"NaN"', "NaN")},
    ),
    "workload turns 0": Case(
        ["sim", "--workload", "w.yaml"],
        ["turns: every draw is below one turn (at most 0)"],
        {"w.yaml": "trajectory: {turns: 0}\n"},
    ),
    "workload turns all below one": Case(
        ["sim", "--workload", "w.yaml"],
        ["turns: every draw is below one turn (at most 0.5)"],
        {"w.yaml": "trajectory: {turns: {uniform: [0, 0.5]}}\n"},
    ),
    "workload turns 1e9": Case(
        ["sim", "--workload", "w.yaml"],
        ["trajectory.turns: Input should be less than or equal to 1000000, not 1000000000.0"],
        {"w.yaml": "trajectory: {turns: 1e9}\n"},
        absent=["constant"],  # the key as typed, not the field a bare number becomes
    ),
    "workload NaN count": Case(
        ["sim", "--workload", "w.yaml"], ["batch.groups"], {"w.yaml": "batch: {groups: .nan}\n"}
    ),
    "trace reward NaN": Case(
        ["sim", "--workload", "w.json"],
        ["line 1", "reward", "finite"],
        {
            "w.json": workload(trace="t.jsonl"),
            "t.jsonl": json.dumps({**GOOD_TRACE_LINE, "reward": math.nan}) + "\n",
        },
    ),
    "trace reward 7": Case(
        ["sim", "--workload", "w.json"],
        ["line 1", "reward", "less than or equal to 1, not 7"],
        {"w.json": workload(trace="t.jsonl"), "t.jsonl": json.dumps({**GOOD_TRACE_LINE, "reward": 7}) + "\n"},
    ),
    "trace agent_s Infinity": Case(
        ["sim", "--workload", "w.json"],
        ["line 1", "agent_s", "finite"],
        {
            "w.json": workload(trace="t.jsonl"),
            "t.jsonl": json.dumps({**GOOD_TRACE_LINE, "agent_s": math.inf}) + "\n",
        },
    ),
    # The simulator's virtual time never moved on past a decision every 1e-300 s: corral sim hung.
    "adaptive lanes interval 1e-300": Case(
        ["sim", "--workload", "w.yaml"],
        ["lanes.adaptive.interval_s", "0.25", "1e-300"],
        {"w.yaml": "lanes: {adaptive: {interval_s: 1.0e-300}}\n"},
    ),
    "trace turns over agent_s": Case(
        ["sim", "--workload", "w.json"],
        ["line 1", "turns add up to 7 s", "agent_s of 5 s"],
        {
            "w.json": workload(trace="t.jsonl"),
            "t.jsonl": json.dumps({**GOOD_TRACE_LINE, "turns": [{"llm_s": 4, "tool_s": 3}]}) + "\n",
        },
    ),
    "run config step_s .nan": Case(
        ["run", "--config", "c.yaml", "--json", "o.json"],
        ["trainer.step_s", "finite"],
        {"c.yaml": run_config("trainer: {step_s: .nan}\n"), **SUITE},
    ),
    "task timeout .inf": Case(
        ["run", "--config", "c.yaml", "--json", "o.json"],
        ["timeouts.agent_s", "finite"],
        {"c.yaml": run_config(), "suite/hello/task.yaml": GOOD_TASK + "timeouts: {agent_s: .inf}\n"},
    ),
    # A denormal timeout was taken: every attempt's agent phase timed out before its first command.
    "task timeout 1e-300": Case(
        ["run", "--config", "c.yaml", "--json", "o.json"],
        ["timeouts.agent_s", "0.1"],
        {"c.yaml": run_config(), "suite/hello/task.yaml": GOOD_TASK + "timeouts: {agent_s: 1.0e-300}\n"},
    ),
    "--duration nan": Case(["run", "--duration", "nan", "--json", "o.json"], ["--duration", "finite"]),
    "--duration inf": Case(["run", "--duration", "inf", "--json", "o.json"], ["--duration", "finite"]),
    # a range's bound was what the refusal said ("should be less than or equal to 1000, not 'nan'")
    "sim --agent-gate nan": Case(
        ["sim", "--workload", "default", "--agent-gate", "nan"],
        ["--agent-gate", "'nan' is not a finite number"],
    ),
    "sim --agent-gate=-inf": Case(
        ["sim", "--workload", "default", "--agent-gate=-inf"],
        ["--agent-gate", "'-inf' is not a finite number"],
    ),
    "--duration -1": Case(["run", "--duration", "-1", "--json", "o.json"], ["--duration"]),
    # A denormal or sub-second duration was taken: the run started its engines and stopped at once, no batch.
    "--duration 1e-320": Case(
        ["run", "--duration", "1e-320", "--json", "o.json"], ["--duration", "1e-320", "≥ 1"]
    ),
    "--duration 0.5": Case(["run", "--duration", "0.5", "--json", "o.json"], ["--duration", "0.5", "≥ 1"]),
    "--duration 1_0": Case(
        ["run", "--duration", "1_0", "--json", "o.json"], ["--duration", "'1_0'", "not a number"]
    ),
    "--duration ' 5'": Case(
        ["run", "--duration", " 5", "--json", "o.json"], ["--duration", "' 5'", "not a number"]
    ),
    "--duration 1e400": Case(
        ["run", "--duration", "1e400", "--json", "o.json"], ["--duration", "'1e400'", "out of range"]
    ),
    # -- sizes ----------------------------------------------------------------------------------------
    "run engines.count 1e9": Case(
        ["run", "--config", "c.yaml", "--json", "o.json"],
        ["engines.count", "memory", "limit is 64"],
        {
            "c.yaml": run_config("engines: {count: 1000000000, cpus: [0]}\n").replace(
                "engines: {count: 1, cpus: [0]}\n", ""
            ),
            **SUITE,
        },
    ),
    "workload engines.count 1e9": Case(
        ["sim", "--workload", "w.json"],
        ["engines.count", "10000"],
        {"w.json": workload(engines={"count": 10**9})},
    ),
    "workload in flight beyond the limit": Case(
        ["sim", "--workload", "w.json"],
        ["trajectories in flight", "memory"],
        {"w.json": workload(batch={"groups": 2, "group_size": 1000}, policy={"surplus_groups": 5000})},
    ),
    "workload turns with a huge tail": Case(
        ["sim", "--workload", "w.json"],
        ["trajectory.turns"],
        {"w.json": workload(trajectory={"turns": {"lognormal": {"median": 18, "p90": 5000}}})},
    ),
    "--surplus 1e8": Case(
        ["sim", "--workload", "w.json", "--surplus", "1e8"], ["--surplus"], {"w.json": workload()}
    ),
    "--surplus 100000000": Case(
        ["sim", "--workload", "w.json", "--surplus", "100000000"],
        ["--surplus", "100000"],
        {"w.json": workload()},
    ),
    # the rung has no surplus: the flag was dropped without a word, the report the plain sync run's
    "sim --policy sync --surplus 5": Case(
        ["sim", "--workload", "w.json", "--policy", "sync", "--surplus", "5"],
        ["--surplus: policy sync runs without surplus (S = 0), got 5"],
        {"w.json": workload()},
    ),
    "--surplus within range, too many in flight": Case(
        ["sim", "--workload", "w.json", "--surplus", "100000"],
        ["--surplus", "trajectories in flight", "memory"],
        {"w.json": workload(batch={"groups": 2, "group_size": 1000})},
    ),
    "sweep of 1e8": Case(
        ["bench", "--workload", "w.json", "--json", "b.json", "--surplus-sweep", "0,100000000"],
        ["--surplus-sweep", "100000000"],
        {"w.json": workload()},
    ),
    "engine --cpus 0-99999999999": Case(["engine", "--cpus", "0-99999999999"], ["--cpus", "8191"]),
    "engine --layers 1e9": Case(["engine", "--layers", "1000000000"], ["--layers"]),
    # -- tracebacks before --------------------------------------------------------------------------
    "sim --plot x.foo": Case(
        ["sim", "--workload", "w.json", "--plot", "x.foo"], ["--plot", "x.foo", "png"], {"w.json": workload()}
    ),
    "bench --plot without an extension": Case(
        ["bench", "--json", "b.json", "--plot", "ladder"], ["--plot", "ladder", "has no image extension"]
    ),
    # both said "no extension is not an image format"
    "sim --plot a directory": Case(
        ["sim", "--workload", "default", "--plot", "d"], ["--plot d: is a directory"], {"d/f": "x"}
    ),
    "sim --plot -": Case(["sim", "--workload", "default", "--plot", "-"], ["not written to standard output"]),
    # PGF needs a LaTeX program (none on this machine): the plot failed after the work, a traceback
    **(
        {}
        if shutil.which("xelatex")
        else {
            "sim --plot x.pgf": Case(
                ["sim", "--workload", "default", "--plot", "x.pgf"],
                ["--plot x.pgf", "which is not installed", "png"],
            )
        }
    ),
    "run --plot x.foo": Case(["run", "--json", "o.json", "--plot", "x.foo"], ["--plot", "x.foo"]),
    # advise's simulations run in worker processes: a bad trace line was a worker's traceback
    "advise --trace with a bad line": Case(
        ["advise", "--workload", "w.json", "--trace", "t.jsonl", "--workers", "1"],
        ["t.jsonl", "line 2", "not JSON"],
        {"w.json": workload(), "t.jsonl": json.dumps(GOOD_TRACE_LINE) + "\n{oops\n"},
    ),
    "advise --trace that does not exist": Case(
        ["advise", "--workload", "w.json", "--trace", "nope.jsonl", "--workers", "1"],
        ["--trace nope.jsonl: cannot read", "No such file"],
        {"w.json": workload()},
        ["trace.path", "/nope.jsonl"],  # named as typed, not as the workload field with an absolute path
    ),
    "advise --trace with a bad field": Case(
        ["advise", "--workload", "w.json", "--trace", "t.jsonl", "--workers", "1"],
        ["--trace t.jsonl, line 1", "reward"],
        {"w.json": workload(), "t.jsonl": json.dumps({"task": "a"}) + "\n"},
        ["/t.jsonl"],
    ),
    "advise on a workload whose trace has a bad line": Case(
        ["advise", "--workload", "w.json", "--workers", "1"],
        ["t.jsonl", "line 1", "reward"],
        {"w.json": workload(trace="t.jsonl"), "t.jsonl": json.dumps({"task": "a"}) + "\n"},
    ),
    # --family ran without its sweeps and without a word, after minutes of simulation
    "bench --family --surplus-sweep": Case(
        ["bench", "--family", "--json", "f.json", "--surplus-sweep", "0,1"],
        ["--family", "no sweep", "--surplus-sweep"],
    ),
    "bench --family --staleness-sweep": Case(
        ["bench", "--family", "--json", "f.json", "--staleness-sweep", "3"],
        ["--family", "no sweep", "--staleness-sweep"],
    ),
    # a name near a built-in one said only "No such file or directory"
    "sim --workload cpu_scarce": Case(
        ["sim", "--workload", "cpu_scarce"],
        ["cannot read workload cpu_scarce", "the built-in workloads are default, design, cpu-scarce"],
    ),
    "workload path with [": Case(["sim", "--workload", "d[red]/w.yaml"], ["d[red]/w.yaml"]),
    "config path with [ and a bad field": Case(
        ["run", "--config", "c[bold].yaml", "--json", "o.json"],
        ["c[bold].yaml", "bogus"],
        {"c[bold].yaml": run_config("bogus: 1\n"), **SUITE},
    ),
    "run config not UTF-8": Case(
        ["run", "--config", "c.yaml", "--json", "o.json"],
        ["c.yaml", "UTF-8"],
        {"c.yaml": b"seed: 1\n\xff\xfe\n"},
    ),
    "workload not UTF-8": Case(
        ["sim", "--workload", "w.yaml"], ["w.yaml", "UTF-8"], {"w.yaml": b"seed: 1\n\xff\n"}
    ),
    "task.yaml not UTF-8": Case(
        ["run", "--config", "c.yaml", "--json", "o.json"],
        ["task.yaml", "UTF-8"],
        {"c.yaml": run_config(), "suite/hello/task.yaml": b"instruction: \xff\n"},
    ),
    "unwritable sandbox.base_dir": Case(
        ["run", "--config", "c.yaml", "--json", "o.json"],
        ["sandbox.base_dir", "/proc/corral-nope"],
        {"c.yaml": run_config("sandbox: {base_dir: /proc/corral-nope}\n"), **SUITE},
    ),
    "sandbox.base_dir is a file": Case(
        ["run", "--config", "c.yaml", "--json", "o.json"],
        ["sandbox.base_dir", "not a directory"],
        {"c.yaml": run_config("sandbox: {base_dir: afile}\n"), "afile": "", **SUITE},
    ),
    "a sandbox.base_dir made for its check is not left behind by a later refusal": Case(
        ["run", "--config", "c.yaml", "--json", "o.json"],
        ["tasks.include", "nope"],
        {
            "c.yaml": run_config("sandbox: {base_dir: bd/x}\n").replace(
                "suite: suite", "suite: suite, include: [nope]"
            ),
            **SUITE,
        },
    ),
    "engines that do not fit in memory": Case(
        ["run", "--config", "c.yaml", "--json", "o.json"],
        ["engines", "64 layers × 8192 hidden", "this machine has"],
        {"c.yaml": run_config().replace("count: 1,", "count: 2, layers: 64, hidden: 8192,"), **SUITE},
    ),
    "engine --layers 64 --hidden 8192": Case(
        ["engine", "--port", "1", "--", "--layers", "64", "--hidden", "8192"],
        ["--layers 64 --hidden 8192", "memory"],
    ),
    "restart_backoff_max_s below restart_backoff_s": Case(
        ["run", "--config", "c.yaml", "--json", "o.json"],
        ["restart_backoff_max_s 1", "below restart_backoff_s 100"],
        {
            "c.yaml": run_config().replace(
                "count: 1,", "count: 1, restart_backoff_s: 100, restart_backoff_max_s: 1,"
            ),
            **SUITE,
        },
    ),
    # A denormal timeout or wait was taken: every update "timed out after 1e-300s" and the engines
    # restarted in a loop. Each seconds field has a least real value.
    **{
        f"run engines.{name} {value}": Case(
            ["run", "--config", "c.yaml", "--json", "o.json"],
            [f"engines.{name}", *needles],
            {"c.yaml": run_config().replace("count: 1,", f"count: 1, {name}: {value},"), **SUITE},
        )
        for name, value, needles in [
            ("update_timeout_s", "1.0e-300", ["greater than or equal to 1"]),
            ("update_timeout_s", "0.5", ["greater than or equal to 1"]),
            ("health_timeout_s", "1.0e-300", ["greater than or equal to 0.1"]),
            ("health_timeout_s", ".nan", ["finite"]),
            ("health_interval_s", ".inf", ["finite"]),
            ("restart_backoff_s", "1.0e-300", ["greater than or equal to 0.1"]),
            ("restart_backoff_max_s", "0.01", ["greater than or equal to 0.1"]),
            ("startup_timeout_s", "1.0e-300", ["greater than or equal to 1"]),
            ("update_timeout_s", "-.inf", ["finite"]),
        ]
    },
    "run engines.sentinel false with the sentinel trainer": Case(
        ["run", "--config", "c.yaml", "--json", "o.json"],
        ["engines.sentinel: false loads real weights", "sentinel weights", "set engines.sentinel: true"],
        {"c.yaml": run_config().replace("cpus: [0]}", "cpus: [0], sentinel: false}"), **SUITE},
    ),
    "empty run config": Case(
        ["run", "--config", "c.yaml", "--json", "o.json"],
        ["run config c.yaml is empty", "{}"],
        {"c.yaml": ""},
    ),
    "tasks.suite that does not exist": Case(
        ["run", "--config", "c.yaml", "--json", "o.json"],
        ["tasks.suite nowhere", "not a suite directory"],
        {"c.yaml": run_config().replace("suite: suite", "suite: nowhere")},
    ),
    "engine --cpus 0_1": Case(["engine", "--port", "1", "--cpus", "0_1"], ["--cpus", "'0_1'"]),
    "engine --weights-dir that does not exist": Case(
        ["engine", "--port", "1", "--", "--weights-dir", "nowhere"],
        ["--weights-dir nowhere", "not a directory"],
    ),
    "engine --port 70000": Case(["engine", "--port", "70000"], ["--port", "65535"]),
    "engine --port 0": Case(["engine", "--port", "0"], ["--port"]),
    "engine port in use": Case(["engine", "--port", "{busy_port}"], ["--port", "already in use"]),
    # options that only mean something beside another, ignored without it
    "serve --demo-kind sim without --demo": Case(
        ["serve", "--demo-kind", "sim"], ["--demo-kind sim", "--demo"]
    ),
    "worker --state-dir without --docker-image": Case(
        ["worker", "--lane", "exec", "--cpus", "0", "--state-dir", "st"], ["--state-dir", "--docker-image"]
    ),
    # passed through, it overrode corral engine's own: served on one port, said it stopped on the other
    "engine -- --port": Case(["engine", "--port", "8198", "--", "--port=8197"], ["--port after `--`"]),
    "engine -- --po (a prefix)": Case(["engine", "--", "--po", "8197"], ["--port after `--`"]),
    # an empty label fails the name's IDNA encoding (UnicodeError), not the resolver: it was a traceback
    "engine --host a..b": Case(
        ["engine", "--host", "a..b", "--port", "1"], ["--host a..b", "not a host name"]
    ),
    "engine --host of a 64-character label": Case(
        ["engine", "--host", "x" * 64, "--port", "1"], ["--host", "not a host name"]
    ),
    "vllm port in use": Case(
        ["engine", "--backend", "vllm", "--model", "m", "--port", "{busy_port}"], ["--port", "already in use"]
    ),
    # -- output paths, before the work -------------------------------------------------------------
    "sim --json /proc/x.json": Case(
        ["sim", "--workload", "w.json", "--json", "/proc/x.json"],
        ["--json", "/proc/x.json"],
        {"w.json": workload()},
    ),
    "bench --json /proc/x.json": Case(["bench", "--json", "/proc/x.json"], ["--json", "/proc/x.json"]),
    "run --json /proc/x.json": Case(["run", "--json", "/proc/x.json"], ["--json", "/proc/x.json"]),
    "run --plot /proc/x.png": Case(
        ["run", "--json", "o.json", "--plot", "/proc/x.png"], ["--plot", "/proc/x.png"]
    ),
    "sim --plot /proc/x.png": Case(
        ["sim", "--workload", "w.json", "--plot", "/proc/x.png"],
        ["--plot", "/proc/x.png"],
        {"w.json": workload()},
    ),
    "--json is a directory": Case(
        ["sim", "--workload", "w.json", "--json", "."], ["--json", "is a directory"], {"w.json": workload()}
    ),
    # -- a trailing '/' names a directory, which Path() would drop and then write a file by that name ----
    "sim --json dir/ that does not exist": Case(
        ["sim", "--workload", "w.json", "--json", "new/"],
        ["--json", "new/", "names a directory"],
        {"w.json": workload()},
    ),
    "run --plot dir/": Case(
        ["run", "--json", "o.json", "--plot", "pics/"], ["--plot", "pics/", "names a directory"]
    ),
    "bench --json dir/": Case(["bench", "--json", "out/"], ["--json", "out/", "names a directory"]),
    "advise --plot dir/": Case(
        ["advise", "--workload", "w.json", "--plot", "p/"],
        ["--plot", "names a directory"],
        {"w.json": workload()},
    ),
    "advise --advised-workload dir/": Case(
        ["advise", "--workload", "w.json", "--advised-workload", "a/"],
        ["--advised-workload", "names a directory"],
        {"w.json": workload()},
    ),
    "advise --advised-workload - beside --json -": Case(
        ["advise", "--workload", "w.json", "--json", "-", "--advised-workload", "-"],
        ["--advised-workload -", "--json is standard output already"],
        {"w.json": workload()},
    ),
    "advise --advised-workload the workload itself": Case(
        ["advise", "--workload", "w.json", "--advised-workload", "w.json"],
        ["--advised-workload w.json", "writing it would destroy that file"],
        {"w.json": workload()},
    ),
    "advise --seeds beyond the seeds a workload has": Case(
        ["advise", "--workload", "w.json", "--seeds", "3"],
        ["--seeds 3", "leaves room for 1"],
        {"w.json": workload(seed=2**63 - 1)},
    ),
    "trace import --out dir/": Case(
        ["trace", "import", "--format", "corral-run", "r.json", "--out", "t/"], ["--out", "names a directory"]
    ),
    # -- a name over 255 bytes: Python 3.11's Path.exists raises instead of answering --------------------
    "run --json with a name too long": Case(["run", "--json", LONG + ".json"], ["--json", "too long"]),
    "run --config with a name too long": Case(
        ["run", "--config", LONG + ".yaml", "--json", "o.json"], ["--config", "too long"]
    ),
    "run --json under a folder name too long": Case(
        ["run", "--json", LONG + "/o.json"], ["--json", "too long"]
    ),
    "sim --workload with a name too long": Case(
        ["sim", "--workload", LONG + ".yaml", "--json", "o.json"], ["too long"]
    ),
    "bench --plot with a name too long": Case(
        ["bench", "--json", "b.json", "--plot", LONG + ".png"], ["--plot", "too long"]
    ),
    # they said "nonexist: not a directory" and "not a JSON report (Expecting value: line 1 column 1 ...)"
    "trace import of a directory that does not exist": Case(
        ["trace", "import", "--format", "terminal-bench", "nonexist", "--out", "t.jsonl"],
        ["nonexist: no such directory"],
    ),
    "trace import of an empty report": Case(
        ["trace", "import", "--format", "corral-run", "r.json", "--out", "t.jsonl"],
        ["r.json: not a JSON report (the file is empty)"],
        {"r.json": ""},
    ),
    "trace import of a name too long": Case(
        ["trace", "import", "--format", "corral-run", LONG + ".json", "--out", "t.jsonl"], ["too long"]
    ),
    # -- a directory where a file belongs: it was refused as if the output were inside an input --------
    "run --config the current directory": Case(
        ["run", "--config", ".", "--json", "o.json"], ["--config .", "is a directory"], absent=["inside"]
    ),
    "trace import --format corral-run of a directory": Case(
        ["trace", "import", "--format", "corral-run", "tb", "--out", "t.jsonl"],
        ["SOURCE tb", "is a directory", "--format terminal-bench"],
        {"tb/run/t1/results.json": "{}"},
        absent=["inside"],
    ),
    "trace import --format terminal-bench of a file": Case(
        ["trace", "import", "--format", "terminal-bench", "r.json", "--out", "t.jsonl"],
        ["r.json", "not a directory", "--format corral-run"],
        {"r.json": "{}"},
    ),
    # -- nonsense -------------------------------------------------------------------------------------
    'engine --cpus ""': Case(["engine", "--cpus", ""], ["--cpus", "empty"]),
    "empty surplus sweep": Case(
        ["bench", "--json", "b.json", "--surplus-sweep", ""], ["--surplus-sweep", "empty"]
    ),
    "empty staleness sweep": Case(
        ["bench", "--json", "b.json", "--staleness-sweep", ","], ["--staleness-sweep", "empty"]
    ),
    "workload groups: true": Case(
        ["sim", "--workload", "w.yaml"], ["batch.groups", "integer"], {"w.yaml": "batch: {groups: true}\n"}
    ),
    "workload group_size: 2.0": Case(
        ["sim", "--workload", "w.yaml"],
        ["batch.group_size", "integer"],
        {"w.yaml": "batch: {group_size: 2.0}\n"},
    ),
    "run config groups: true": Case(
        ["run", "--config", "c.yaml", "--json", "o.json"],
        ["batch.groups", "integer"],
        {"c.yaml": run_config().replace("groups: 1", "groups: true"), **SUITE},
    ),
    "run config group_size: 2.0": Case(
        ["run", "--config", "c.yaml", "--json", "o.json"],
        ["batch.group_size", "integer"],
        {"c.yaml": run_config().replace("group_size: 2", "group_size: 2.0"), **SUITE},
    ),
    "task max_turns: true": Case(
        ["run", "--config", "c.yaml", "--json", "o.json"],
        ["max_turns", "integer"],
        {"c.yaml": run_config(), "suite/hello/task.yaml": GOOD_TASK + "max_turns: true\n"},
    ),
    # -- messages name what the user typed ------------------------------------------------------
    "--surplus -1 names the flag": Case(
        ["sim", "--workload", "w.json", "--surplus", "-1"],
        ["--surplus", "greater than or equal to 0, not '-1'"],  # the value typed, as files' refusals say
        {"w.json": workload()},
        ["surplus_groups"],
    ),
    "--max-staleness=abc names the flag and the value": Case(
        ["sim", "--workload", "w.json", "--max-staleness=abc"],
        ["--max-staleness", "not 'abc'"],
        {"w.json": workload()},
    ),
    "engine refusals say corral engine": Case(
        ["engine", "--cpus", "0-x"], ["corral engine", "--cpus"], absent=["python -m", "app.engines"]
    ),
    "model-level config errors have no pydantic prefixes": Case(
        ["run", "--config", "c.yaml", "--json", "o.json"],
        ["lanes.cpus", "shares CPUs"],
        {"c.yaml": run_config().replace("lanes: {cpus: [1]}", "lanes: {cpus: [0]}"), **SUITE},
        ["Value error", "(top)"],
    ),
    "a lane weight out of range names it": Case(
        ["run", "--config", "c.yaml", "--json", "o.json"],
        ["lanes.weights.reset", "less than or equal to 10000"],
        {"c.yaml": run_config().replace("{cpus: [1]}", "{cpus: [1], weights: {reset: 20000}}"), **SUITE},
    ),
    "an unknown lane weight names it": Case(
        ["run", "--config", "c.yaml", "--json", "o.json"],
        ["lanes.weights.sandbox"],
        {"c.yaml": run_config().replace("{cpus: [1]}", "{cpus: [1], weights: {sandbox: 3}}"), **SUITE},
    ),
    "workload model-level error has no prefix": Case(
        ["sim", "--workload", "w.json"],
        ["serving", "4 cores"],
        {"w.json": workload(cpus={"total": 4, "serving": 2})},
        ["Value error", "(top)"],
    ),
    "workload file with comments only": Case(
        ["sim", "--workload", "w.yaml"], ["workload w.yaml is empty", "{}"], {"w.yaml": "# nothing yet\n"}
    ),
    # -- values the parsers take but Python cannot hold, nesting too deep: tracebacks before ----------
    "workload JSON nested too deeply": Case(
        ["sim", "--workload", "w.json"], ["w.json", "nested too deeply"], {"w.json": "[" * 100_000}
    ),
    "workload YAML nested too deeply": Case(
        ["sim", "--workload", "w.yaml"], ["w.yaml", "nested too deeply"], {"w.yaml": "a: " + "[" * 100_000}
    ),
    "workload JSON integer of 5,000 digits": Case(
        ["sim", "--workload", "w.json"],
        ["w.json", "4300 digits"],
        {"w.json": '{"seed": 1' + "0" * 5000 + "}"},
    ),
    "workload YAML integer of 5,000 digits": Case(
        ["sim", "--workload", "w.yaml"],
        ["w.yaml", "line 2", "4300 digits"],
        {"w.yaml": "batches: 1\nseed: 1" + "0" * 5000},
    ),
    "workload YAML date 2025-13-45": Case(
        ["sim", "--workload", "w.yaml"],
        ["w.yaml", "line 1", "'2025-13-45' is not a valid timestamp", "month"],
        {"w.yaml": "seed: 2025-13-45\n"},
    ),
    "workload YAML !!timestamp x": Case(
        ["sim", "--workload", "w.yaml"],
        ["w.yaml", "'x' is not a valid timestamp"],
        {"w.yaml": "seed: !!timestamp x\n"},
    ),
    "workload YAML !!float x": Case(
        ["sim", "--workload", "w.yaml"],
        ["w.yaml", "'x' is not a valid float"],
        {"w.yaml": "seed: !!float x\n"},
    ),
    "run config nested too deeply": Case(
        ["run", "--config", "c.yaml", "--json", "o.json"],
        ["c.yaml", "nested too deeply"],
        {"c.yaml": "trainer: " + "{a: " * 5000 + "1" + "}" * 5000},
    ),
    "trace line nested too deeply": Case(
        ["sim", "--workload", "w.json"],
        ["t.jsonl", "line 2", "nested too deeply"],
        {"w.json": workload(trace="t.jsonl"), "t.jsonl": json.dumps(GOOD_TRACE_LINE) + "\n" + "[" * 100_000},
    ),
    "trace line integer of 5,000 digits": Case(
        ["sim", "--workload", "w.json"],
        ["t.jsonl", "line 2", "too many digits"],
        {
            "w.json": workload(trace="t.jsonl"),
            "t.jsonl": json.dumps(GOOD_TRACE_LINE)
            + "\n"
            + json.dumps(GOOD_TRACE_LINE).replace(": 5,", ": 5" + "0" * 5000 + ","),
        },
    ),
    # -- an empty argument: an empty path read as '.', the current directory ---------------------------
    "an empty workload path": Case(["sim", "--workload", ""], ["error: --workload: empty"]),
    "an empty report path": Case(
        ["sim", "--workload", "default", "--json", ""], ["error: --json: empty"], absent=["directory"]
    ),
    "an empty --flag= value": Case(["bench", "--workload="], ["error: --workload: empty"]),
    # it imported from the current directory
    "an empty trace directory": Case(
        ["trace", "import", "--format", "terminal-bench", "", "--out", "t.jsonl"],
        ["error: argument 5: empty"],
    ),
    # -- a key given twice: PyYAML and json kept the last one silently -----------------------------
    "workload YAML with a key twice": Case(
        ["sim", "--workload", "w.yaml"],
        ["w.yaml", "'slots' is given twice", "line 4"],
        {"w.yaml": "batches: 1\nengines:\n  slots: 4\n  slots: 8\n"},
    ),
    "workload JSON with a key twice": Case(
        ["sim", "--workload", "w.json"],
        ["w.json", "'batches' is given twice"],
        {"w.json": '{"batches": 1, "batches": 2}'},
    ),
    "run config with a key twice": Case(
        ["run", "--config", "c.yaml", "--json", "o.json"],
        ["c.yaml", "'lanes' is given twice"],
        {"c.yaml": run_config() + "lanes: {cpus: [1]}\n", **SUITE},
    ),
    # -- a workload that can never fill a batch ---------------------------------------------------
    "workload p_infra_error 1": Case(
        ["sim", "--workload", "w.json"],
        ["trajectory.p_infra_error", "less than 1"],
        {"w.json": workload(trajectory={"p_infra_error": 1.0})},
    ),
    "workload p_infra_error 0.999 ends the simulation": Case(
        ["sim", "--workload", "w.json"],
        ["simulated run stopped", "groups in a row failed", "SimInfraError"],
        {"w.json": workload(trajectory={"p_infra_error": 0.999})},
    ),
    # -- an output must not destroy an input or another output ----------------------------------
    "sim --json is the workload": Case(
        ["sim", "--workload", "w.json", "--json", "w.json"],
        ["--json w.json", "--workload", "destroy"],
        {"w.json": workload()},
    ),
    "sim --json is the workload's trace": Case(
        ["sim", "--workload", "w.json", "--json", "t.jsonl"],
        ["--json t.jsonl", "the workload's trace"],
        {"w.json": workload(trace="t.jsonl"), "t.jsonl": json.dumps(GOOD_TRACE_LINE) + "\n"},
    ),
    "sim --plot is --json": Case(
        ["sim", "--workload", "w.json", "--json", "p.png", "--plot", "p.png"],
        ["--plot p.png", "is also --json"],
        {"w.json": workload()},
    ),
    "bench --json is the workload": Case(
        ["bench", "--workload", "w.json", "--json", "./w.json"],
        ["--json", "--workload"],
        {"w.json": workload()},
    ),
    "advise --json is --trace": Case(
        ["advise", "--workload", "w.json", "--trace", "t.jsonl", "--json", "t.jsonl", "--workers", "1"],
        ["--json t.jsonl", "--trace"],
        {"w.json": workload(), "t.jsonl": json.dumps(GOOD_TRACE_LINE) + "\n"},
    ),
    "run --json is the config": Case(
        ["run", "--config", "c.yaml", "--json", "c.yaml"],
        ["--json c.yaml", "--config"],
        {"c.yaml": run_config(), **SUITE},
    ),
    "trace import --out inside the run directory": Case(
        ["trace", "import", "--format", "terminal-bench", "tb", "--out", "tb/run/t1/results.json"],
        ["--out", "inside SOURCE"],
        {"tb/run/t1/results.json": "{}"},
    ),
    "bench --family with --workload": Case(
        ["bench", "--family", "--workload", "w.json", "--json", "b.json"],
        ["--family", "--workload"],
        {"w.json": workload()},
    ),
    "--surplus-sweep with a value twice": Case(
        ["bench", "--json", "b.json", "--surplus-sweep", "4,4"], ["--surplus-sweep", "4", "twice"]
    ),
    "--surplus-sweep 1_000": Case(
        ["bench", "--json", "b.json", "--surplus-sweep", "1_000"], ["'1_000'", "not an integer"]
    ),
    "--surplus-sweep in Arabic-Indic digits": Case(
        ["bench", "--json", "b.json", "--staleness-sweep", "\u0663"],
        ["--staleness-sweep", "not an integer", "e.g. 1,2,4"],  # values of K, not the S sweep's 0,16,32
    ),
}
if not VLLM_PRESENT:
    CASES["vllm hint"] = Case(["engine", "--backend", "vllm", "--model", "m"], ["pip install 'corral[vllm]'"])


@pytest.fixture
def busy_port() -> Iterator[int]:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        sock.listen()
        yield int(sock.getsockname()[1])


def write_files(root: Path, files: dict[str, str | bytes]) -> None:
    for name, content in files.items():
        path = root / name
        path.parent.mkdir(parents=True, exist_ok=True)
        if isinstance(content, bytes):
            path.write_bytes(content)
        else:
            path.write_text(content)


def listing(root: Path) -> set[str]:
    return {str(p.relative_to(root)) for p in root.rglob("*")}


def corral_in_process(
    args: list[str], cwd: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> tuple[int, str, str]:
    from app.cli import main

    monkeypatch.chdir(cwd)
    monkeypatch.setattr(sys, "argv", ["corral", *args])
    with pytest.raises(SystemExit) as exited:
        main()
    out = capsys.readouterr()
    code = exited.value.code
    return (code if isinstance(code, int) else 1), out.out, out.err


def assert_one_line_refusal(code: int, stdout: str, stderr: str, case: Case) -> None:
    lines = [line for line in stderr.splitlines() if line.strip()]
    assert code == 2, stderr
    assert "Traceback" not in stdout + stderr
    assert len(lines) == 1, stderr
    assert lines[0].startswith("error: "), stderr
    for needle in case.needles:
        assert needle in lines[0], (needle, stderr)
    for word in case.absent:
        assert word not in lines[0], (word, stderr)
    assert "starting" not in stdout + stderr  # refused before any engine was started


@pytest.mark.parametrize("name", list(CASES))
def test_bad_input_is_refused_in_one_line_naming_the_field(
    name: str,
    tmp_path: Path,
    busy_port: int,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    case = CASES[name]
    write_files(tmp_path, case.files)
    before = listing(tmp_path)
    args = [a.replace("{busy_port}", str(busy_port)) for a in case.args]
    code, out, err = corral_in_process(args, tmp_path, monkeypatch, capsys)
    assert_one_line_refusal(code, out, err, case)
    assert listing(tmp_path) == before  # no report, no probe file, no directory left behind


@pytest.mark.parametrize(
    "name",
    [
        "workload step_s .inf",
        "--duration nan",
        "--duration 1e-320",
        "engine --port 70000",
        "--surplus 1e8",
        "sim --plot x.foo",
        "advise --trace with a bad line",
    ],
)
def test_refusals_from_the_installed_script(name: str, tmp_path: Path) -> None:
    case = CASES[name]
    write_files(tmp_path, case.files)
    proc = subprocess.run(
        [str(CORRAL), *case.args], capture_output=True, text=True, timeout=60, cwd=tmp_path, check=False
    )
    assert_one_line_refusal(proc.returncode, proc.stdout, proc.stderr, case)


# -- regression tests, one per mechanism --------------------------------------------------------------


def test_plots_and_traces_go_into_directories_that_do_not_exist_yet(tmp_path: Path) -> None:
    """The output check accepts a path whose parents it can create; the writers must create them too
    (a plot used to fail after the whole simulation, a traceback in `corral advise`)."""
    write_files(tmp_path, {"w.json": workload(batches=1, batch={"groups": 1, "group_size": 2})})
    sim = subprocess.run(
        [str(CORRAL), "sim", "--workload", "w.json", "--json", "a/r.json", "--plot", "b/c/timeline.png"],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=tmp_path,
        check=False,
    )
    assert sim.returncode == 0, sim.stderr
    assert (tmp_path / "b/c/timeline.png").read_bytes().startswith(b"\x89PNG")
    report = json.loads((tmp_path / "a/r.json").read_text())
    attempts = [
        {
            "task": f"g{g}a{a}",
            "reset_s": 1.0,
            "agent_s": 2.0,
            "validate_s": 1.0,
            "cleanup_s": 1.0,
            "reward": 1.0,
        }
        for g in range(2)
        for a in range(2)
    ]
    assert report["batches"] == 1
    trace = tmp_path / "d/e/trace.jsonl"
    from app.sim.traces import write_trace

    assert write_trace(attempts, trace) == 4
    assert [json.loads(line) for line in trace.read_text().splitlines()] == attempts


def test_cpu_list_bound_refuses_before_building_a_set() -> None:
    with pytest.raises(CpuListError, match="8191"):
        parse_cpu_list("0-99999999999")  # would be 10^11 integers; refused from the numbers alone
    assert parse_cpu_list("8190-8191") == [8190, 8191]


def test_report_json_is_strict(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from app.cli.common import write_json

    out = tmp_path / "r.json"
    write_json(out, {"a": 1.5, "b": [1, 2]})
    assert json.loads(out.read_text(), parse_constant=lambda c: pytest.fail(f"non-strict {c}")) == {
        "a": 1.5,
        "b": [1, 2],
    }
    write_json(tmp_path / "nan.json", {"x": {"y": [1.0, math.nan]}, "z": math.inf})
    assert json.loads((tmp_path / "nan.json").read_text(), parse_constant=pytest.fail) == {
        "x": {"y": [1.0, None]},
        "z": None,
    }
    warning = capsys.readouterr().err
    assert "warning:" in warning
    assert "x.y[1], z" in warning


def test_output_that_is_not_a_regular_file_is_refused(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """A pipe (or a device) given as --json was replaced by a regular file: the report is written to a
    temporary file and renamed over the target."""
    write_files(tmp_path, {"w.json": workload()})
    os.mkfifo(tmp_path / "pipe.json")
    code, out, err = corral_in_process(
        ["sim", "--workload", "w.json", "--json", "pipe.json"], tmp_path, monkeypatch, capsys
    )
    assert_one_line_refusal(code, out, err, Case([], ["pipe.json", "not a regular file"]))
    assert stat.S_ISFIFO((tmp_path / "pipe.json").lstat().st_mode)


def test_a_report_is_written_through_a_symbolic_link(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """--json naming a link writes the file it points to, and the link stays a link."""
    write_files(tmp_path, {"w.json": workload(), "reports/keep.txt": ""})
    (tmp_path / "latest.json").symlink_to(tmp_path / "reports" / "r.json")
    code, _, err = corral_in_process(
        ["sim", "--workload", "w.json", "--json", "latest.json"], tmp_path, monkeypatch, capsys
    )
    assert code == 0, err
    assert (tmp_path / "latest.json").is_symlink()
    assert json.loads((tmp_path / "reports" / "r.json").read_text())["batches"] == 2


def test_an_output_under_a_dangling_link_says_so(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """A folder of the --json path that is a link to nothing: the check tried to create it, and blamed
    'out/r.json.tmp is in the way; remove it', a file that does not exist."""
    write_files(tmp_path, {"w.json": workload()})
    (tmp_path / "out").symlink_to(tmp_path / "gone" / "dir")
    code, out, err = corral_in_process(
        ["sim", "--workload", "w.json", "--json", "out/r.json"], tmp_path, monkeypatch, capsys
    )
    case = Case(
        [], ["--json out/r.json", "out is a link to", "gone/dir", "does not exist"], absent=["in the way"]
    )
    assert_one_line_refusal(code, out, err, case)
    assert listing(tmp_path) == {"w.json", "out"}


def test_yaml_merge_keys_may_still_be_overridden(tmp_path: Path) -> None:
    """A key brought in by `<<: *anchor` and given again in the mapping is an override, not a key given
    twice; the same text as an integer and as a string are two keys."""
    from app.documents import read_document

    path = tmp_path / "w.yaml"
    path.write_text("base: &b {slots: 4, count: 2}\nengines:\n  <<: *b\n  slots: 8\nodd: {1: a, '1': b}\n")
    assert read_document(path, "w") == {
        "base": {"slots": 4, "count": 2},
        "engines": {"slots": 8, "count": 2},
        "odd": {1: "a", "1": "b"},
    }


def test_output_check_leaves_nothing_behind(tmp_path: Path) -> None:
    from app.cli.common import check_output

    check_output(tmp_path / "new" / "deeper" / "r.json", "--json")
    assert listing(tmp_path) == set()
    (tmp_path / "kept.json").write_text("old")
    check_output(tmp_path / "kept.json", "--json")
    assert (tmp_path / "kept.json").read_text() == "old"
    assert listing(tmp_path) == {"kept.json"}


def test_an_output_that_cannot_be_replaced_is_refused_before_the_work(tmp_path: Path) -> None:
    """An existing --json that its directory lets us write beside but not replace (immutable here; for a
    user, another user's file in a sticky /tmp alike) passed the check, which only created a file beside
    it: the whole simulation ran, then 'cannot write r.json: Operation not permitted'."""
    write_files(tmp_path, {"w.json": workload(), "r.json": "old"})
    if subprocess.run(["chattr", "+i", str(tmp_path / "r.json")], capture_output=True).returncode:
        pytest.skip("no chattr +i on this file system")
    try:
        proc = subprocess.run(
            [str(CORRAL), "sim", "--workload", "w.json", "--json", "r.json"],
            capture_output=True, text=True, timeout=120, cwd=tmp_path, check=False,
        )  # fmt: skip
    finally:
        subprocess.run(["chattr", "-i", str(tmp_path / "r.json")], check=True)
    case = Case([], ["--json r.json", "cannot replace it", "Operation not permitted"])
    assert_one_line_refusal(proc.returncode, proc.stdout, proc.stderr, case)
    assert (tmp_path / "r.json").read_text() == "old"
    assert listing(tmp_path) == {"w.json", "r.json"}


def test_run_summary_without_batches_says_so() -> None:
    from app.cli.common import summary_line

    report = {
        "policy": "full",
        "batches": 0,
        "batch_collection_s": {"mean": None, "p90": None},
        "trainer_idle_fraction": 1.0,
    }
    line = summary_line(report, Path("r.json"), "0 restarted trajectories")
    assert "no batch delivered" in line
    assert "mean" not in line
    report.update(batches=2, batch_collection_s={"mean": 12.345, "p90": 20.0})
    assert "2 batches, collection mean 12.3 s (p90 20.0 s)" in summary_line(report, Path("r.json"), "x")


def test_default_run_config_is_the_packaged_one_from_any_directory(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from app.runtime.config import default_config_path, load_config

    monkeypatch.chdir(tmp_path)
    path = default_config_path()
    assert path.is_absolute()
    assert path.is_file()
    assert load_config(path).engines.count >= 1


def test_help_explains_s_and_k_and_lists_every_option(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    code, out, _ = corral_in_process(["--help"], tmp_path, monkeypatch, capsys)
    assert code == 0
    assert "surplus" in out
    assert "staleness bound" in out
    assert "<bool>" not in out
    code, out, _ = corral_in_process(["run", "--help"], tmp_path, monkeypatch, capsys)
    for option in ("--config", "--json", "--policy", "--duration", "--batches", "--plot", "--help"):
        assert option in out
    assert "<bool>" not in out
    code, out, _ = corral_in_process(["sim", "--help"], tmp_path, monkeypatch, capsys)
    assert "S, the surplus" in out
    assert "K, the staleness bound" in out
    code, out, _ = corral_in_process(["--version"], tmp_path, monkeypatch, capsys)
    assert code == 0
    assert out.startswith("corral ")


def help_text(command: str, cwd: Path) -> str:
    """`corral COMMAND --help` from the console script, one space between words (and none where a line
    broke after a hyphen)."""
    proc = subprocess.run(
        [str(CORRAL), *command.split(), "--help"],
        capture_output=True, text=True, timeout=60, cwd=cwd, check=True,
    )  # fmt: skip
    return " ".join(re.sub(r"-\n\s+", "-", proc.stdout).split())


@pytest.mark.parametrize("command", ["sim", "bench", "advise"])
def test_workload_help_names_the_built_in_workloads_it_takes(command: str, tmp_path: Path) -> None:
    """`--workload design` runs the built-in workload of that name (README: `--workload FILE|NAME`);
    --help said only 'workload spec, YAML or JSON'."""
    from app.sim.family import FAMILY

    assert f"built-in one by name: {', '.join(FAMILY)}" in help_text(command, tmp_path)
    out = tmp_path / "o.json"
    proc = subprocess.run(
        [str(CORRAL), "sim", "--workload", "design", "--json", str(out)],
        capture_output=True, text=True, timeout=300, cwd=tmp_path, check=False,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    assert json.loads(out.read_text())["batches"] > 0


def test_worker_help_says_the_orchestrator_default_concurrency(tmp_path: Path) -> None:
    """`--orchestrator` takes no --cpus and runs one pool process unless told (workers/main.py's
    `-c`); --help gave only 'default: one per CPU of --cpus'."""
    assert "default: one per CPU of --cpus; 1 with --orchestrator" in help_text("worker", tmp_path)


def test_progress_lines_are_rounded_and_plain(tmp_path: Path) -> None:
    from rich.console import Console

    from app.core.events import (
        BatchDelivered,
        EngineStateChanged,
        EngineUpdateEnd,
        Envelope,
        GroupAdmitted,
        GroupDiscarded,
        PolicyChanged,
    )
    from app.runtime.progress import RunProgress

    console = Console(record=True, width=200)
    progress = RunProgress(console, batches=3)
    for seq, (t, event) in enumerate(
        [
            (12.345678, BatchDelivered(0, (4, 7), 1, 0.0, 12.0, staleness=(0, 1))),
            (13.0, GroupAdmitted(1, 0, 2)),
            (14.0, EngineUpdateEnd("engine-0", 2)),
            (15.0, EngineStateChanged("engine-[1]", "restarted", "after 3.1 s")),
            (16.0, GroupDiscarded(5, "cancelled")),
            (17.0, GroupDiscarded(6, "stale")),
            (18.0, EngineStateChanged("engine-1", "down", "exited with -9")),
            (19.0, EngineStateChanged("*", "all_down", "every engine is down")),
            (20.0, PolicyChanged("max_staleness", 2, 3, "operator")),
            (21.0, EngineUpdateEnd("engine-1", 3, ok=False, error="timed out after 120s")),
        ]
    ):
        progress.on_envelope(Envelope("run", seq, t, event))
    text = console.export_text()
    assert "batch 1/3 delivered: 2 groups after 12.3 s, staleness ≤ 1" in text
    assert "group_admitted" not in text
    assert "group admitted" not in text
    assert "engine-0 now serves policy version 2" in text
    assert "engine-[1] is restarted: after 3.1 s" in text  # brackets stay as typed, not rich markup
    assert "group 5" not in text  # cancelled at the end of a run: counted in the report, not printed
    assert "group 6 discarded (stale); 1 so far" in text
    assert "engine-1 is down: exited with -9" in text
    assert "] every engine is down" in text
    assert "max_staleness changed from 2 to 3 by operator" in text
    assert "engine-1 failed to load policy version 3 and left rotation: timed out after 120s" in text
    assert "{" not in text


# -- every size bounded, and documented -----------------------------------------------------------------

# Bounded by a validator instead of the schema: the distributions by their largest draw (Dist.upper),
# engines.count with a memory estimate.
BOUNDED_BY_VALIDATORS = (*DISTRIBUTIONS, "engines.count")


def unbounded_numbers(schema: dict[str, Any]) -> list[str]:
    defs = schema.get("$defs", {})
    found: list[str] = []

    def walk(node: dict[str, Any], prefix: str) -> None:
        for name, prop in node.get("properties", {}).items():
            key = prefix + name
            if key.startswith(BOUNDED_BY_VALIDATORS):
                continue
            options = prop.get("anyOf", [prop])
            ref = next((o["$ref"] for o in options if "$ref" in o), None)
            if ref is not None:
                walk(defs[ref.split("/")[-1]], key + ".")
                continue
            for option in options:
                items = [option, option.get("items", {}), *option.get("prefixItems", [])]
                numbers = [i for i in items if i.get("type") in ("integer", "number")]
                if any("maximum" not in i and "exclusiveMaximum" not in i for i in numbers):
                    found.append(key)

    walk(schema, "")
    return found


@pytest.mark.parametrize("model", [Workload, LocalRunConfig])
def test_every_number_has_an_upper_bound_and_a_row_in_docs_limits(model: type[BaseModel]) -> None:
    schema = model.model_json_schema()
    assert unbounded_numbers(schema) == []
    doc = (Path(__file__).parent.parent / "docs" / "limits.md").read_text()
    missing = [row for row in limit_rows(schema, DISTRIBUTIONS) if row not in doc]
    assert missing == [], "docs/limits.md lacks these rows (`python -m app.validation` prints them)"


def _limit_memory() -> None:
    """In the child: at most 3 GB of address space, so reading an endless input fails fast."""
    import resource

    resource.setrlimit(resource.RLIMIT_AS, (3 * 2**30, 3 * 2**30))


@pytest.mark.parametrize(
    ("trace", "needles"),
    [
        ("/dev/zero", ["trace /dev/zero", "is a device, not a file"]),
        ("big.jsonl", ["trace big.jsonl", "larger than 256 MB"]),
    ],
    ids=["device", "a file of 256 MB + 1 byte"],
)
def test_a_workload_trace_that_would_fill_memory_is_refused(
    tmp_path: Path, trace: str, needles: list[str]
) -> None:
    """load_trace read a trace whole: `trace: /dev/zero` grew until a MemoryError traceback (or the OOM
    killer), a multi-GB file given by mistake too. A device is now refused before any reading, a file
    of more than 256 MB from its size, in one line."""
    (tmp_path / "w.json").write_text(workload(trace=trace))
    with (tmp_path / "big.jsonl").open("wb") as f:  # sparse: no disk used
        f.truncate(256_000_001)
    proc = subprocess.run(
        [str(CORRAL), "sim", "--workload", "w.json", "--json", "o.json"],
        capture_output=True, text=True, timeout=120, cwd=tmp_path, check=False, preexec_fn=_limit_memory,
    )  # fmt: skip
    assert proc.returncode == 2, proc.stderr
    assert len(proc.stderr.splitlines()) == 1, proc.stderr
    assert proc.stderr.startswith("error: ")
    assert all(n in proc.stderr for n in needles), proc.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == ["big.jsonl", "w.json"]


def test_a_trace_of_good_lines_is_still_read_line_by_line(tmp_path: Path) -> None:
    """Reading a trace a line at a time keeps what the whole-file read gave: blank lines skipped, a
    bad line named by its number, a bad byte by its offset."""
    from app.sim.workload import WorkloadError, load_trace

    good = json.dumps(GOOD_TRACE_LINE)
    path = tmp_path / "t.jsonl"
    path.write_text(f"{good}\n\n{json.dumps({**GOOD_TRACE_LINE, 'task': 'b'})}")  # no final newline
    assert sorted((k, len(v)) for k, v in load_trace(path).items()) == [("a", 1), ("b", 1)]
    path.write_text(f"{good}\n{{bad\n")
    with pytest.raises(WorkloadError, match=r"trace .*t\.jsonl, line 2: not JSON"):
        load_trace(path)
    path.write_bytes(f"{good}\n".encode() + b"\xff\n")
    with pytest.raises(WorkloadError, match=rf"not UTF-8 text \(byte {len(good) + 1}\)"):
        load_trace(path)


def test_a_run_config_that_is_a_pipe_is_refused_instead_of_read(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """`corral run --config FIFO` blocked in the read, with Ctrl-C and SIGTERM held for the run to take:
    only SIGKILL ended it. Nobody writes the FIFO here, so a read would hang the test."""
    os.mkfifo(tmp_path / "fifo.yaml")
    code, out, err = corral_in_process(
        ["run", "--config", "fifo.yaml", "--json", "r.json"], tmp_path, monkeypatch, capsys
    )
    case = Case([], ["--config fifo.yaml", "not a regular file", "give a file"])
    assert_one_line_refusal(code, out, err, case)
