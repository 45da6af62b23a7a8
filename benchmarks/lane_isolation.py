"""Lane isolation: the embedded engine's turn latency while sandbox lanes run CPU-heavy work.

Three configurations are measured in every round, in a rotating order so that drift in the machine's
background load falls on all of them alike:

- `idle`: the engine pinned to the serving CPUs, no sandbox load (the baseline);
- `pinned`: the same engine, sandbox commands run through `InProcessLanes(pinned=True)` whose exec lane
  has the lane CPUs, disjoint from the serving CPUs;
- `unpinned`: a second engine on every CPU, sandbox commands through `InProcessLanes(pinned=False)`
  (no CPU set, the ablation baseline).

Invariants:
- Both loaded configurations run the same sandbox load: `load_workers` commands in flight at all times,
  each a fixed amount of hashing, issued through `LocalSandbox.exec` in the exec lane. A command that
  fails or times out is an error (`LoadError`), never a silently lighter load.
- The measuring thread plays the control plane: it runs on the serving CPUs in `idle` and `pinned`
  and on every CPU in `unpinned`. The sandbox load runs in its own thread (affinity is per thread),
  on the lane CPUs when pinned, so the commands it forks start on the lane CPUs.
- Every engine process this module starts is killed (by PID) before `run_benchmark` returns or raises.
- Inflation of a configuration is p99 under load / p99 idle, taken per round (so a round's loaded
  figure is compared with the idle figure of the same round) and summarised by the median over rounds.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Literal

import numpy as np

from app.engines.base import TurnRequest
from app.engines.vllm import VLLMEngine
from app.lanes.base import LaneName
from app.lanes.inprocess import InProcessLanes
from app.sandboxes.limits import ResourceLimits
from app.sandboxes.local import LocalSandbox, LocalSandboxFactory
from app.tasks.spec import TaskSpec

CONFIGS = ("idle", "pinned", "unpinned")
LOADED = ("pinned", "unpinned")
TARGET_PINNED_INFLATION = 1.15
MODEL_NAME = "corral-embedded"
# ~300 bytes: long enough that prefill is a real part of a turn, fixed so every turn costs the same.
PROMPT = (
    "You are in a repository with a failing test. Read the traceback, find the function it names, "
    "and fix the off-by-one error in the loop bound. Then run the test suite again and report which "
    "tests pass. Answer with the shell command to run next, nothing else.\n$ "
)

OnTurn = Callable[[str, int], None]


class LaneIsolationError(RuntimeError):
    """The benchmark could not run as configured (bad CPU sets, engine did not start)."""


class LoadError(LaneIsolationError):
    """A sandbox load command failed or timed out, so the load was not what the benchmark claims."""


@dataclass(frozen=True)
class BenchConfig:
    rounds: int = 4  # rounds; each measures every configuration once
    turns: int = 80  # measured turns per configuration per round
    warmup_turns: int = 4  # unmeasured turns per configuration per round, once the load is running
    in_flight: int = 2  # concurrent turns
    layers: int = 2  # engine GRU layers
    hidden: int = 128  # engine hidden width (2 x 128 with 64 tokens is ~70 ms per turn here)
    max_tokens: int = 64  # tokens per turn (the embedded engine always generates exactly this many)
    load_workers: int = 4  # sandbox commands in flight (= the exec lane's concurrency)
    load_mib: int = 128  # MiB of /dev/zero hashed by one sandbox command (~0.5 s of one core)
    exec_timeout_s: float = 60.0  # a sandbox command taking longer is a LoadError
    serving_cpus: tuple[int, ...] = (0,)
    lane_cpus: tuple[int, ...] = (1,)
    isolation: Literal["none", "bwrap", "auto"] = "none"  # LocalSandbox isolation
    engine_start_timeout_s: float = 60.0

    def validate(self) -> None:
        if self.rounds < 1 or self.turns < 1 or self.in_flight < 1 or self.load_workers < 1:
            raise LaneIsolationError(
                f"rounds, turns, in_flight and load_workers must be >= 1, got {self.rounds}, "
                f"{self.turns}, {self.in_flight}, {self.load_workers}"
            )
        if not self.serving_cpus or not self.lane_cpus:
            raise LaneIsolationError("serving_cpus and lane_cpus must not be empty")
        overlap = set(self.serving_cpus) & set(self.lane_cpus)
        if overlap:
            raise LaneIsolationError(f"serving and lane CPU sets overlap on {sorted(overlap)}")
        allowed = os.sched_getaffinity(0)
        missing = (set(self.serving_cpus) | set(self.lane_cpus)) - allowed
        if missing:
            raise LaneIsolationError(
                f"CPUs {sorted(missing)} are not available to this process (allowed: {sorted(allowed)})"
            )
        if self.isolation not in ("none", "bwrap", "auto"):
            raise LaneIsolationError(f"isolation must be none, bwrap or auto, got {self.isolation!r}")

    @property
    def all_cpus(self) -> tuple[int, ...]:
        return tuple(sorted(set(self.serving_cpus) | set(self.lane_cpus)))


@dataclass
class ConfigRound:
    latencies_s: list[float]
    execs: int = 0
    duration_s: float = 0.0

    def summary(self) -> dict[str, float | int]:
        ms = np.asarray(self.latencies_s) * 1000.0
        return {
            "turns": len(self.latencies_s),
            "p50_ms": float(np.percentile(ms, 50)),
            "p99_ms": float(np.percentile(ms, 99)),
            "mean_ms": float(ms.mean()),
            "max_ms": float(ms.max()),
            "duration_s": self.duration_s,
            "sandbox_execs": self.execs,
            "sandbox_execs_per_s": self.execs / self.duration_s if self.duration_s > 0 else 0.0,
        }


@dataclass
class _Engine:
    name: str
    cpus: tuple[int, ...]
    port: int
    proc: subprocess.Popen[bytes]
    log_path: Path

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}"


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


def _start_engine(name: str, cpus: Sequence[int], cfg: BenchConfig, log_dir: Path) -> _Engine:
    port = _free_port()
    log_path = log_dir / f"engine-{name}.log"
    cmd = [
        sys.executable,
        "-m",
        "app.engines.embedded",
        "--port",
        str(port),
        "--cpus",
        ",".join(map(str, cpus)),
        "--layers",
        str(cfg.layers),
        "--hidden",
        str(cfg.hidden),
        "--model-name",
        MODEL_NAME,
    ]
    with log_path.open("wb") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    return _Engine(name, tuple(cpus), port, proc, log_path)


def _stop_engine(engine: _Engine) -> None:
    if engine.proc.poll() is None:
        engine.proc.terminate()
        try:
            engine.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            engine.proc.kill()
            engine.proc.wait()


async def _wait_healthy(engine: _Engine, timeout_s: float) -> None:
    client = VLLMEngine(engine.name, engine.base_url, MODEL_NAME, timeout_s=5.0)
    try:
        deadline = time.monotonic() + timeout_s
        while not await client.health():
            if engine.proc.poll() is not None:
                tail = engine.log_path.read_text(errors="replace")[-1500:]
                raise LaneIsolationError(
                    f"engine {engine.name} exited with {engine.proc.returncode} before answering; "
                    f"log tail:\n{tail}"
                )
            if time.monotonic() > deadline:
                raise LaneIsolationError(
                    f"engine {engine.name} on port {engine.port} not healthy after {timeout_s:.0f} s"
                )
            await asyncio.sleep(0.1)
    finally:
        await client.aclose()


async def _turns(
    client: VLLMEngine, count: int, cfg: BenchConfig, on_turn: Callable[[], None] | None
) -> list[float]:
    """Run `count` identical turns, `cfg.in_flight` at a time; return each turn's latency in seconds."""
    request = TurnRequest(prompt=PROMPT, max_tokens=cfg.max_tokens, temperature=0.0)
    latencies: list[float] = []
    remaining = count

    async def worker() -> None:
        nonlocal remaining
        while remaining > 0:
            remaining -= 1
            started = time.perf_counter()
            result = await client.generate(request)
            latencies.append(time.perf_counter() - started)
            if result.tokens != cfg.max_tokens:
                raise LaneIsolationError(
                    f"engine {client.name} produced {result.tokens} tokens, expected {cfg.max_tokens}"
                )
            if on_turn is not None:
                on_turn()

    async with asyncio.TaskGroup() as tg:
        for _ in range(min(cfg.in_flight, count)):
            tg.create_task(worker())
    return latencies


async def _load_worker(
    lanes: InProcessLanes, sandbox: LocalSandbox, cfg: BenchConfig, done: list[int], stop: threading.Event
) -> None:
    """Keep one sandbox command running through the exec lane until `stop` is set."""
    command = f"head -c {cfg.load_mib * 1024 * 1024} /dev/zero | sha256sum"
    while not stop.is_set():
        result = await lanes.run(
            LaneName.EXEC, lambda slot: sandbox.exec(command, cfg.exec_timeout_s, cpus=slot.cpus)
        )
        if result.timed_out or result.exit_code != 0:
            raise LoadError(
                f"sandbox load command {command!r} in {sandbox.attempt_id} failed: exit "
                f"{result.exit_code}, timed out {result.timed_out}, output {result.output[-300:]!r}"
            )
        done[0] += 1


class _LoadThread(threading.Thread):
    """The sandbox lanes' work, in its own thread and event loop.

    Affinity is per thread on Linux: this thread (which forks the sandbox commands) runs on the lane
    CPUs when pinned, while the measuring thread stays on the serving CPUs, as a lane worker and the
    control plane would in a deployment.
    """

    def __init__(
        self, name: str, cfg: BenchConfig, factory: LocalSandboxFactory, task: TaskSpec, round_index: int
    ) -> None:
        super().__init__(name=f"lane-load-{name}", daemon=True)
        self.pinned = name == "pinned"
        self.cfg = cfg
        self.factory = factory
        self.task = task
        self.round_index = round_index
        self.execs = [0]
        self.started_load = threading.Event()
        self.stop = threading.Event()
        self.error: BaseException | None = None

    def run(self) -> None:
        os.sched_setaffinity(0, self.cfg.lane_cpus if self.pinned else self.cfg.all_cpus)
        try:
            asyncio.run(self._main())
        except BaseException as exc:  # reported by the measuring thread, which owns the run
            self.error = exc
        finally:
            self.started_load.set()

    async def _main(self) -> None:
        cfg = self.cfg
        lane_cpus = cfg.lane_cpus if self.pinned else None
        lanes = InProcessLanes(
            concurrency=dict.fromkeys(LaneName, cfg.load_workers),
            cpus=dict.fromkeys(LaneName, lane_cpus),
            pinned=self.pinned,
        )
        name = "pinned" if self.pinned else "unpinned"
        sandboxes = [
            self.factory.create(f"lanebench-{os.getpid()}-r{self.round_index}-{name}-{i}")
            for i in range(cfg.load_workers)
        ]
        try:
            for sandbox in sandboxes:
                await sandbox.reset(self.task, cpus=lane_cpus)
            async with asyncio.TaskGroup() as tg:
                for sandbox in sandboxes:
                    tg.create_task(_load_worker(lanes, sandbox, cfg, self.execs, self.stop))
                await asyncio.sleep(0.3)  # every load command under way before the first turn
                self.started_load.set()
        finally:
            for sandbox in sandboxes:
                await sandbox.cleanup()


async def _measure_config(
    name: str,
    engine: _Engine,
    cfg: BenchConfig,
    factory: LocalSandboxFactory,
    task: TaskSpec,
    round_index: int,
    on_turn: OnTurn | None,
) -> ConfigRound:
    client = VLLMEngine(engine.name, engine.base_url, MODEL_NAME, timeout_s=120.0)
    tick = None if on_turn is None else (lambda: on_turn(name, round_index))
    load = _LoadThread(name, cfg, factory, task, round_index) if name in LOADED else None
    # The measuring thread plays the control plane: on the serving CPUs unless nothing is pinned.
    os.sched_setaffinity(0, cfg.all_cpus if name == "unpinned" else cfg.serving_cpus)
    try:
        if load is not None:
            load.start()
            await asyncio.to_thread(load.started_load.wait)
            if load.error is not None:
                raise LoadError(f"sandbox load did not start: {load.error!r}")
        await _turns(client, cfg.warmup_turns, cfg, None)
        executed_before = load.execs[0] if load is not None else 0
        started = time.perf_counter()
        latencies = await _turns(client, cfg.turns, cfg, tick)
        duration = time.perf_counter() - started
        executed = (load.execs[0] if load is not None else 0) - executed_before
        return ConfigRound(latencies, executed, duration)
    finally:
        os.sched_setaffinity(0, cfg.all_cpus)
        if load is not None:
            load.stop.set()
            await asyncio.to_thread(load.join, cfg.exec_timeout_s + 30)
            if load.error is not None and not isinstance(load.error, LoadError | asyncio.CancelledError):
                raise LoadError(f"sandbox load failed: {load.error!r}")
        await client.aclose()


def _median(values: Sequence[float]) -> float:
    return float(statistics.median(values))


def _summarise(cfg: BenchConfig, rounds: list[dict[str, ConfigRound]]) -> dict[str, Any]:
    per_round = [{name: data.summary() for name, data in r.items()} for r in rounds]
    summary: dict[str, dict[str, float | int]] = {}
    for name in CONFIGS:
        pooled = np.asarray([x for r in rounds for x in r[name].latencies_s]) * 1000.0
        summary[name] = {
            "turns": int(pooled.size),
            "p50_ms": _median([float(r[name]["p50_ms"]) for r in per_round]),
            "p99_ms": _median([float(r[name]["p99_ms"]) for r in per_round]),
            "pooled_p50_ms": float(np.percentile(pooled, 50)),
            "pooled_p99_ms": float(np.percentile(pooled, 99)),
            "sandbox_execs_per_s": _median([float(r[name]["sandbox_execs_per_s"]) for r in per_round]),
        }
    for name in LOADED:
        summary[name]["p99_inflation"] = _median(
            [float(r[name]["p99_ms"]) / float(r["idle"]["p99_ms"]) for r in per_round]
        )
        summary[name]["p50_inflation"] = _median(
            [float(r[name]["p50_ms"]) / float(r["idle"]["p50_ms"]) for r in per_round]
        )
        summary[name]["pooled_p99_inflation"] = float(summary[name]["pooled_p99_ms"]) / float(
            summary["idle"]["pooled_p99_ms"]
        )
    pinned_inflation = float(summary["pinned"]["p99_inflation"])
    unpinned_inflation = float(summary["unpinned"]["p99_inflation"])
    return {
        "settings": {
            **{k: list(v) if isinstance(v, tuple) else v for k, v in asdict(cfg).items()},
            "prompt_bytes": len(PROMPT.encode()),
        },
        "machine": {"cpus_online": os.cpu_count(), "affinity": sorted(os.sched_getaffinity(0))},
        "summary": summary,
        # How much worse the p99 inflation is without pinning than with it.
        "inflation_ratio": unpinned_inflation / pinned_inflation,
        "target": {
            "pinned_p99_inflation_max": TARGET_PINNED_INFLATION,
            "pinned_p99_inflation": pinned_inflation,
            "met": pinned_inflation <= TARGET_PINNED_INFLATION,
        },
        "rounds": per_round,
        "latencies_ms": {
            name: [[x * 1000.0 for x in r[name].latencies_s] for r in rounds] for name in CONFIGS
        },
    }


def run_benchmark(cfg: BenchConfig, on_turn: OnTurn | None = None) -> dict[str, Any]:
    """Start both engines, measure every configuration in every round, stop the engines; the figures.

    `on_turn(config, round)` is called after each measured turn (for a progress display).
    """
    cfg.validate()
    work = Path(tempfile.mkdtemp(prefix="corral-lanebench-", dir="/tmp"))
    # Sandbox uids (when we are root) must reach their work directories below this one.
    work.chmod(0o711)
    task_root = work / "task"
    task_root.mkdir()
    task = TaskSpec(name="lane-load", instruction="hash zeros", root=task_root, validation="true")
    engines: dict[str, _Engine] = {}
    started = time.perf_counter()
    load_before = os.getloadavg()
    try:
        engines["serving"] = _start_engine("serving", cfg.serving_cpus, cfg, work)
        engines["shared"] = _start_engine("shared", cfg.all_cpus, cfg, work)
        for engine in engines.values():
            asyncio.run(_wait_healthy(engine, cfg.engine_start_timeout_s))
        factory = LocalSandboxFactory(work / "sandboxes", isolation=cfg.isolation, limits=ResourceLimits())
        rounds: list[dict[str, ConfigRound]] = []
        for round_index in range(cfg.rounds):
            # Rotate the order so no configuration always follows another (drift and after-effects).
            shift = round_index % len(CONFIGS)
            order = CONFIGS[shift:] + CONFIGS[:shift]
            results: dict[str, ConfigRound] = {}
            for name in order:
                engine = engines["shared" if name == "unpinned" else "serving"]
                results[name] = asyncio.run(
                    _measure_config(name, engine, cfg, factory, task, round_index, on_turn)
                )
                if engine.proc.poll() is not None:
                    raise LaneIsolationError(
                        f"engine {engine.name} exited with {engine.proc.returncode} during {name}"
                    )
            rounds.append(results)
        report = _summarise(cfg, rounds)
        report["machine"]["loadavg_before"] = list(load_before)
        report["machine"]["loadavg_after"] = list(os.getloadavg())
        report["wall_s"] = time.perf_counter() - started
        report["engines"] = {
            e.name: {"pid": e.proc.pid, "port": e.port, "cpus": list(e.cpus)} for e in engines.values()
        }
        return report
    finally:
        for engine in engines.values():
            _stop_engine(engine)
        shutil.rmtree(work, ignore_errors=True)


def format_table(report: dict[str, Any]) -> Any:
    """A rich Table of the summary (medians over rounds)."""
    from rich.table import Table

    table = Table(title="Embedded engine turn latency under sandbox load (median over rounds)")
    for column in ("config", "p50 ms", "p99 ms", "p99 inflation vs idle", "sandbox execs/s", "turns"):
        table.add_column(column, justify="left" if column == "config" else "right")
    for name in CONFIGS:
        row = report["summary"][name]
        inflation = "—" if name == "idle" else f"{row['p99_inflation']:.2f}x"
        table.add_row(
            name,
            f"{row['p50_ms']:.1f}",
            f"{row['p99_ms']:.1f}",
            inflation,
            f"{row['sandbox_execs_per_s']:.2f}",
            str(row["turns"]),
        )
    return table


def plot(report: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    colors = {"idle": "tab:gray", "pinned": "tab:blue", "unpinned": "tab:red"}
    fig, (hist_ax, rounds_ax) = plt.subplots(1, 2, figsize=(12, 4.5))
    pooled = {name: [x for r in report["latencies_ms"][name] for x in r] for name in CONFIGS}
    low = max(1e-3, min(min(v) for v in pooled.values()))
    high = max(max(v) for v in pooled.values())
    bins = np.geomspace(low, high, 50)
    for name in CONFIGS:
        summary = report["summary"][name]
        hist_ax.hist(pooled[name], bins=bins, histtype="step", linewidth=1.6, color=colors[name], label=name)
        hist_ax.axvline(summary["pooled_p99_ms"], color=colors[name], linestyle="--", linewidth=1)
    hist_ax.set_xscale("log")
    hist_ax.set_xlabel("turn latency (ms, log); dashed: pooled p99")
    hist_ax.set_ylabel("turns")
    hist_ax.legend()
    hist_ax.set_title("latency distribution, all rounds")
    for offset, name in enumerate(CONFIGS):
        xs = [i + (offset - 1) * 0.2 for i in range(len(report["rounds"]))]
        rounds_ax.scatter(xs, [r[name]["p99_ms"] for r in report["rounds"]], color=colors[name], label=name)
        rounds_ax.scatter(
            xs, [r[name]["p50_ms"] for r in report["rounds"]], color=colors[name], marker="_", s=120
        )
    rounds_ax.set_xlabel("round")
    rounds_ax.set_ylabel("ms (dot: p99, bar: p50)")
    rounds_ax.set_xticks(range(len(report["rounds"])))
    rounds_ax.legend()
    target = report["target"]
    rounds_ax.set_title(
        f"pinned p99 inflation {target['pinned_p99_inflation']:.2f}x, "
        f"unpinned {report['summary']['unpinned']['p99_inflation']:.2f}x"
    )
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _cpu_tuple(text: str) -> tuple[int, ...]:
    from app.cpulist import parse_cpu_list

    try:
        return tuple(parse_cpu_list(text))
    except ValueError as exc:
        raise argparse.ArgumentTypeError(f"{text!r} is not a CPU list like '0' or '1-3': {exc}") from None


def build_parser() -> argparse.ArgumentParser:
    defaults = BenchConfig()
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks.lane_isolation",
        description="Embedded engine turn latency with sandbox lanes busy: pinned vs unpinned CPU sets.",
    )
    parser.add_argument("--rounds", type=int, default=defaults.rounds, help="rounds (each runs all configs)")
    parser.add_argument(
        "--turns", type=int, default=defaults.turns, help="measured turns per config per round"
    )
    parser.add_argument("--warmup-turns", type=int, default=defaults.warmup_turns)
    parser.add_argument("--in-flight", type=int, default=defaults.in_flight, help="concurrent turns")
    parser.add_argument("--layers", type=int, default=defaults.layers)
    parser.add_argument("--hidden", type=int, default=defaults.hidden)
    parser.add_argument("--max-tokens", type=int, default=defaults.max_tokens)
    parser.add_argument(
        "--load-workers", type=int, default=defaults.load_workers, help="sandbox commands in flight"
    )
    parser.add_argument("--load-mib", type=int, default=defaults.load_mib, help="MiB hashed per command")
    parser.add_argument("--serving-cpus", type=_cpu_tuple, default=defaults.serving_cpus)
    parser.add_argument("--lane-cpus", type=_cpu_tuple, default=defaults.lane_cpus)
    parser.add_argument("--isolation", choices=["none", "bwrap", "auto"], default=defaults.isolation)
    parser.add_argument("--json", type=Path, default=None, metavar="OUT", help="write the figures here")
    parser.add_argument("--plot", type=Path, default=None, metavar="OUT.png", help="draw the distributions")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    args = build_parser().parse_args(argv)
    from benchmarks import check_outputs, save_json, save_plot  # as a script (-m), the package is importable

    check_outputs(json=args.json, plot=args.plot)
    cfg = BenchConfig(
        rounds=args.rounds,
        turns=args.turns,
        warmup_turns=args.warmup_turns,
        in_flight=args.in_flight,
        layers=args.layers,
        hidden=args.hidden,
        max_tokens=args.max_tokens,
        load_workers=args.load_workers,
        load_mib=args.load_mib,
        serving_cpus=args.serving_cpus,
        lane_cpus=args.lane_cpus,
        isolation=args.isolation,
    )
    err = Console(stderr=True)
    progress = Progress(
        TextColumn("{task.description:>9}"),
        BarColumn(),
        MofNCompleteColumn(),
        TextColumn("round {task.fields[round]}"),
        TimeElapsedColumn(),
        console=err,
        # Refreshed by hand, at most 5 times a second, so the display stays a negligible load.
        auto_refresh=False,
    )
    task_ids = {name: progress.add_task(name, total=cfg.rounds * cfg.turns, round=0) for name in CONFIGS}
    last_refresh = [0.0]

    def on_turn(name: str, round_index: int) -> None:
        progress.update(task_ids[name], advance=1, round=round_index + 1)
        now = time.monotonic()
        if now - last_refresh[0] > 0.2:
            last_refresh[0] = now
            progress.refresh()

    try:
        with progress:
            report = run_benchmark(cfg, on_turn)
            progress.refresh()
    except LaneIsolationError as exc:
        err.print(f"[red]lane isolation benchmark failed:[/red] {exc}")
        return 1
    out = Console()
    out.print(format_table(report))
    target = report["target"]
    verdict = "met" if target["met"] else "MISSED"
    out.print(
        f"p99 inflation: pinned {target['pinned_p99_inflation']:.3f}x, "
        f"unpinned {report['summary']['unpinned']['p99_inflation']:.3f}x; "
        f"ratio unpinned/pinned {report['inflation_ratio']:.2f}"
    )
    out.print(
        f"target pinned p99 inflation <= {TARGET_PINNED_INFLATION:.2f}x: {verdict} "
        f"(load average {report['machine']['loadavg_before'][0]:.2f} before, "
        f"{report['machine']['loadavg_after'][0]:.2f} after; wall {report['wall_s']:.0f} s)"
    )
    if args.json is not None:
        save_json(args.json, report)
    save_plot(lambda path: plot(report, path), args.plot, written=args.json)
    return 0


if __name__ == "__main__":
    from benchmarks import run_script

    run_script(main)
