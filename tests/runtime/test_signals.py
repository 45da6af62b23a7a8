"""Stopping always leaves a report.

First the stop race, deterministically on virtual time: a stop (or the duration deadline) that lands
in the same instant as the completion of the B-th group must end the run cleanly, not with "the
scheduler delivered a batch nobody asked for". Then Ctrl-C for real: SIGINT to the whole process group
of a real `corral run`, at ten different moments; every time the run exits 0 with a valid report and
leaves no process behind.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import pytest
from corral_proc import BATCH_LINE, FAST_CONFIG, CorralRun
from runtime_fakes import FakeEngine, FakeSandbox, accounted, make_runtime
from sandbox_owner import alive_with_token, start_owner

from app.engines.base import TurnRequest
from app.runtime.context import AttemptContext, AttemptOutcome
from app.runtime.driver import Runtime
from app.sandboxes import leftovers
from app.sandboxes.cpuset import CGROUP_ROOT
from app.sandboxes.leftovers import MARKERS
from app.sandboxes.limits import pids_parent
from app.sim.clock import run_virtual

# -- the stop race ------------------------------------------------------------------------------------

GateKey = tuple[int, int]


@dataclass
class GatedAgent:
    """One turn, then waits for its gate: the test decides when each attempt finishes."""

    source: GatedSource
    key: GateKey

    async def run(self, ctx: AttemptContext) -> AttemptOutcome:
        await ctx.generate(TurnRequest(prompt="p"))
        gate = self.source.gates.setdefault(self.key, asyncio.get_running_loop().create_future())
        if len(self.source.gates) == 2:
            self.source.both_waiting.set()
        await gate
        return AttemptOutcome(reward=float(self.key[1]), turns=1)


@dataclass
class GatedSource:
    gates: dict[GateKey, asyncio.Future[None]] = field(default_factory=dict)
    both_waiting: asyncio.Event = field(default_factory=asyncio.Event)

    def make_attempt(self, group_id: int, task_index: int, attempt: int) -> tuple[Any, None, Any]:
        return GatedAgent(self, (group_id, attempt)), None, FakeSandbox()

    def stopping(self) -> None:
        pass


def make_gated_runtime(source: GatedSource) -> Runtime:
    """B = 1 group of G = 2, no surplus: group 0 is the one the first batch waits for."""
    engine = FakeEngine("a", turn_s=0.1)
    return make_runtime([engine], source=source, groups_per_batch=1, group_size=2, surplus_groups=0)


def test_stop_in_the_same_step_as_the_last_group_completing_ends_cleanly() -> None:
    source = GatedSource()
    runtime = make_gated_runtime(source)

    async def scenario() -> None:
        async with asyncio.TaskGroup() as tg:
            tg.create_task(runtime.run(batches=3))
            await source.both_waiting.wait()
            source.gates[0, 0].set_result(None)
            await asyncio.sleep(0.01)
            # The B-th group completes and the operator stops, in the same step: the attempt task
            # runs before the trainer loop resumes.
            source.gates[0, 1].set_result(None)
            runtime.request_stop()

    run_virtual(scenario())
    assert runtime.state.batches == []
    accounted(runtime)
    assert runtime.scheduler.counters.discarded["cancelled"] >= 1  # group 0: ready, never delivered


def test_deadline_in_the_same_instant_as_the_last_group_completing_ends_cleanly() -> None:
    source = GatedSource()
    runtime = make_gated_runtime(source)
    deadline = 5.0
    # Closer to the deadline than the loop's clock resolution: asyncio runs both timers in the same
    # iteration, the gates first, so the attempts finish before the trainer loop sees the deadline.
    release_at = deadline - time.get_clock_info("monotonic").resolution / 2

    def release() -> None:
        source.gates[0, 0].set_result(None)
        source.gates[0, 1].set_result(None)

    async def scenario() -> None:
        async with asyncio.TaskGroup() as tg:
            tg.create_task(runtime.run(duration_s=deadline))
            await source.both_waiting.wait()
            asyncio.get_running_loop().call_at(release_at, release)

    run_virtual(scenario())
    assert runtime.state.batches == []
    accounted(runtime)
    assert runtime.scheduler.counters.discarded["cancelled"] >= 1


# -- Ctrl-C to the process group of a real `corral run`, at ten moments ---------------------------------


def after_engines_appear(run: CorralRun) -> None:
    run.engine_pids()


def while_torch_loads(run: CorralRun) -> None:
    run.engine_pids()
    time.sleep(1.0)


def once_engines_answer(run: CorralRun) -> None:
    run.wait_engines_ready()


def mid_first_batch(run: CorralRun) -> None:
    run.wait_engines_ready()
    time.sleep(0.7)


def during_trainer_step(run: CorralRun) -> None:
    run.wait_line(BATCH_LINE)


def mid_later_batch(run: CorralRun) -> None:
    run.wait_line(BATCH_LINE, count=2)
    time.sleep(0.3)


def during_weight_update(run: CorralRun) -> None:
    _, second = run.wait_engines_ready()
    url = f"http://127.0.0.1:{run.engine_port(second)}/debug/fault"
    httpx.post(url, json={"update": "hang"}, timeout=5)
    run.wait_line(r"engine-0.*version'?:? 1\b")  # engine-0 is done; engine-1 now hangs for 10 s
    time.sleep(0.2)


def during_engine_restart(run: CorralRun) -> None:
    victim, _ = run.wait_engines_ready()
    run.wait_line(BATCH_LINE)
    os.kill(victim, signal.SIGKILL)
    run.wait_line("restarting")


def twice_mid_batch(run: CorralRun) -> None:
    """The second Ctrl-C comes once the first is taken, while the run still finishes its step. (The run
    has batches to spare: with 4 it could end by itself between the two, and the second found nothing
    left to force; `make test` saw that once.)"""
    run.wait_line(BATCH_LINE)
    time.sleep(0.7)
    run.ctrl_c()
    run.wait_line("stopping: finishing the current step")


def during_shutdown(run: CorralRun) -> None:
    run.wait_line(BATCH_LINE, count=2)  # the last batch: cleanup and engine shutdown follow


@dataclass(frozen=True)
class Moment:
    name: str
    args: tuple[str, ...]
    before: Callable[[CorralRun], None]
    startup: bool = False
    env: tuple[tuple[str, str], ...] = ()
    config: str = FAST_CONFIG


MOMENTS = [
    Moment("engines-appear", ("--batches", "3"), after_engines_appear, startup=True),
    Moment("torch-loading", ("--batches", "3"), while_torch_loads, startup=True),
    Moment("engines-answer", ("--batches", "3"), once_engines_answer),
    Moment("mid-first-batch", ("--batches", "3"), mid_first_batch),
    Moment("trainer-step", ("--batches", "3"), during_trainer_step),
    Moment("mid-later-batch", ("--batches", "4"), mid_later_batch),
    Moment(
        "weight-update",
        ("--batches", "3"),
        during_weight_update,
        env=(("CORRAL_ENGINE_DEBUG", "1"),),
        # engine-1's update hangs until this timeout. It may begin beside engine-0's, so its clock can
        # run while engine-0 updates: 3 s, then 10 s, left too little slack on a loaded machine between
        # the line the test waits for and the Ctrl-C (each failed once, engine-1's update already over;
        # at 10 s the report named engine-0 once). A stop abandons an update
        # under way after 5 s, so the longer timeout costs the test nothing.
        config=FAST_CONFIG.replace("update_timeout_s: 3", "update_timeout_s: 30"),
    ),
    Moment("engine-restart", ("--batches", "3"), during_engine_restart),
    Moment("twice", ("--batches", "50"), twice_mid_batch),
    Moment("shutdown", ("--batches", "2"), during_shutdown),
]


def ctrl_c_once(run: CorralRun, before: Callable[[CorralRun], None], timeout_s: float) -> tuple[dict, float]:
    """`before(run)`, then one Ctrl-C to the run's process group: its report, and the seconds from the
    signal to its exit (which leaves no process behind); the run is killed whatever happens."""
    try:
        before(run)
        signalled = time.monotonic()
        run.ctrl_c()
        report = run.finish(timeout_s=timeout_s)
        took = time.monotonic() - signalled
        assert run.leftovers() == []
    finally:
        run.kill()
    return report, took


@pytest.mark.slow
@pytest.mark.parametrize("moment", MOMENTS, ids=[m.name for m in MOMENTS])
def test_ctrl_c_to_the_process_group_always_leaves_a_report(tmp_path: Path, moment: Moment) -> None:
    run = CorralRun(tmp_path, list(moment.args), env=dict(moment.env), config=moment.config)
    report, took = ctrl_c_once(run, moment.before, timeout_s=60)
    assert report["stopped_early"] is True
    assert report["stop"]["signals"] >= 1
    if moment.startup:
        assert report["stop"]["phase"] == "startup"
        assert report["batches"] == 0
        assert took < 15, took  # prompt: start-up is abandoned, not waited out
    if moment.name == "weight-update":
        assert report["stop"]["engines_updating"] == ["engine-1"]
    if moment.name == "twice":
        assert report["stop"]["forced"] is True
    if moment.name == "shutdown":
        assert report["batches"] == 2


@pytest.mark.slow
def test_ctrl_c_held_down_as_the_run_exits_still_ends_it_cleanly(tmp_path: Path) -> None:
    """Ctrl-C pressed again and again from the last batch until the process is gone: the first stops
    the run, the rest land while it shuts its engines down, writes its report and exits. It still
    exits 0 with the report whole. A press landing after the report was written used to end the exiting
    interpreter, killed by SIGINT (a shell says 130)."""
    run = CorralRun(tmp_path, ["--batches", "2"])
    try:
        run.wait_line(BATCH_LINE, count=2)
        sent = 0
        assert run.proc is not None
        while run.proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                run.ctrl_c()
                sent += 1
            time.sleep(0.002)
        report = run.finish(timeout_s=5)
        assert run.leftovers() == []
    finally:
        run.kill()
    assert sent > 10, sent  # presses kept coming until the very end
    assert report["batches"] == 2
    assert report["stop"]["signals"] >= 1


@pytest.mark.slow
def test_a_hung_weight_update_does_not_hold_a_ctrl_c_for_its_timeout(tmp_path: Path) -> None:
    """engine-1's update hangs, with the default two-minute update timeout; one Ctrl-C. The run waited
    for that timeout before it ended (123 s, measured by a user); a stopping run now gives updates
    under way a few seconds, then abandons them, and says so."""
    config = FAST_CONFIG.replace("update_timeout_s: 3", "update_timeout_s: 120")
    run = CorralRun(tmp_path, ["--batches", "3"], env={"CORRAL_ENGINE_DEBUG": "1"}, config=config)
    report, took = ctrl_c_once(run, during_weight_update, timeout_s=150)
    assert report["stop"]["engines_updating"] == ["engine-1"]
    assert took < 60, took  # the grace, the trainer step and the shutdown; not the 120 s timeout
    assert "engine-1's weight update abandoned" in run.text()


@pytest.mark.slow
def test_kill_9_of_the_run_still_takes_its_engines_down(tmp_path: Path) -> None:
    """Engines run in their own sessions, so only PR_SET_PDEATHSIG ties them to the run: a run killed
    with SIGKILL (no cleanup at all) must still leave no engine, nor an engine's child, behind."""
    run = CorralRun(tmp_path, ["--batches", "50"], env={"CORRAL_ENGINE_DEBUG": "1"})
    try:
        engines = run.wait_engines_ready()
        run.scan()
        assert len(run.seen) >= 2 * len(engines)  # each engine and its engine-core stand-in
        os.kill(run.pid, signal.SIGKILL)
        assert run.proc is not None
        run.proc.wait(timeout=30)
        assert run.leftovers(timeout_s=30) == []
    finally:
        run.kill()


@pytest.mark.slow
@pytest.mark.parametrize("after_s", [0.1, 0.3, 0.6])
def test_ctrl_c_while_corral_is_still_loading_leaves_a_report(tmp_path: Path, after_s: float) -> None:
    """The first second goes to imports and argument parsing, before the run's own handlers exist: a
    Ctrl-C then is held from the first line of the entry point and stops the start-up all the same.
    `after_s` counts from that first line: before it, the interpreter is still starting (about 18 ms on a
    quiet machine, well over 0.1 s under load), where a Ctrl-C is Python's fatal error, not Corral's."""
    run = CorralRun(tmp_path, ["--batches", "3"])
    try:
        holding = run.wait_holding()
        time.sleep(max(0.0, after_s - (time.monotonic() - holding)))
        run.ctrl_c()
        report = run.finish(timeout_s=60)
        assert run.leftovers() == []
    finally:
        run.kill()
    assert report["batches"] == 0
    assert report["stop"]["phase"] == "startup"
    assert report["stop"]["signals"] == 1
    assert report["stopped_early"] is True


def test_ctrl_c_while_loading_interrupts_any_other_command(tmp_path: Path) -> None:
    """Only `corral run` takes a Ctrl-C held during loading; any other command ends at once, exit 130,
    without a traceback."""
    script = (
        "import os, signal\n"
        "from app import early_signals\n"
        "early_signals.hold()\n"
        "os.kill(os.getpid(), signal.SIGINT)\n"  # lands while corral loads
        "from app.cli import main\n"
        "main()\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", script, "sim", "--json", str(tmp_path / "r.json")],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert out.returncode == 130, out.stderr
    assert "Traceback" not in out.stderr
    assert out.stderr.strip().endswith("interrupted")
    assert not (tmp_path / "r.json").exists()


@pytest.mark.slow
@pytest.mark.parametrize("where", ["default", "config"])
def test_what_a_run_killed_mid_batch_left_is_removed_by_the_next_start(
    tmp_path: Path, base_dir: Path, where: str
) -> None:
    """`kill -9` of a run mid-batch leaves its sandboxes (work directories, pids cgroups) and its
    temporary directory; the next `corral run` removes them and says so. A process left running in
    one of the sandboxes (here a `sleep` started in its work directory once the run is dead, standing in
    for what a tool call detached) is killed too. Its sandboxes are where the run put them: in its
    temporary directory ("default") or in the config's `sandbox.base_dir` ("config"), which another live
    process also keeps a sandbox in (with a detached process of its own): that one is left alone."""
    owners = tmp_path / "owners"
    env = {"CORRAL_OWNERS_DIR": str(owners)}
    config = FAST_CONFIG + (f"sandbox: {{base_dir: {base_dir}}}\n" if where == "config" else "")
    (tmp_path / "first").mkdir()
    (tmp_path / "second").mkdir()
    token = f"{os.getpid() % 1000}.4343"
    live, live_work, _ = start_owner(tmp_path, base_dir, token)
    first = CorralRun(tmp_path / "first", ["--batches", "50"], config=config, env=env)
    orphan: subprocess.Popen[bytes] | None = None
    try:
        first.wait_engines_ready()
        registration = owners / f"{first.pid}.json"
        deadline = time.monotonic() + 60
        while True:  # mid-batch: sandboxes exist. The run is stopped while we look, so none it
            # is about to remove disappears between looking and killing.
            os.kill(first.pid, signal.SIGSTOP)
            data = json.loads(registration.read_text())
            roots = [Path(r) for r in data["roots"]]
            marked = [m for r in roots for m in (r / MARKERS).iterdir() if m.name != live_work.name]
            left = sorted(p for r in roots for p in r.iterdir() if p.name[0] != "." and p != live_work)
            if (marked and left) or time.monotonic() > deadline:
                break
            os.kill(first.pid, signal.SIGCONT)
            time.sleep(0.05)
        os.kill(first.pid, signal.SIGKILL)
        assert first.proc is not None
        first.proc.wait(timeout=30)
        assert roots == [base_dir if where == "config" else Path(data["dirs"][0]) / "sandboxes"]
        assert marked, first.text()
        assert left, "no sandbox left to clean up"
        (run_dir,) = (Path(d) for d in data["dirs"])
        orphan = subprocess.Popen(["sleep", "600"], cwd=left[0], start_new_session=True)
        cgroups = pids_parent(CGROUP_ROOT)
        assert run_dir.is_dir()

        second = CorralRun(tmp_path / "second", ["--batches", "1"], config=config, env=env)
        try:
            report = second.finish(timeout_s=120)
            assert second.leftovers() == []
        finally:
            second.kill()
        assert orphan.wait(timeout=10) == -signal.SIGKILL
        # The live owner's sandbox, in the same directory: its work directory, marker and process stay.
        assert live.poll() is None
        assert live_work.is_dir()
        assert (base_dir / MARKERS / live_work.name).is_file()
        assert alive_with_token(token) != []
    finally:
        first.kill()
        if orphan is not None and orphan.poll() is None:
            orphan.kill()
            orphan.wait()
        live.kill()
        live.wait()
        assert live.stdout is not None
        live.stdout.close()
        leftovers.sweep(owners)  # what the live owner, now killed, left
    assert report["batches"] == 1
    said = rf"removed what dead corral process {first.pid} left behind: (\d+) sandbox"
    swept = re.search(said, second.text())
    assert swept is not None, second.text()
    assert int(swept.group(1)) >= len(marked)
    assert [p for p in left if p.exists()] == []
    assert not run_dir.exists()
    if cgroups is not None:
        assert [g.name for g in cgroups[0].iterdir() if g.name.endswith(f"-{first.pid}")] == []
    assert alive_with_token(token) == []
    assert list(owners.iterdir()) == []  # the second run ended cleanly: no registration is left


@pytest.mark.slow
def test_closing_the_terminal_window_stops_the_run_and_still_leaves_a_report(tmp_path: Path) -> None:
    """A terminal window closed, or an ssh session dropped, mid-run: the kernel sends SIGHUP to the
    run's process group, and every later write to the terminal fails with EIO. The run stops as on a
    Ctrl-C, writes its report, and leaves no engine nor sandbox process behind."""
    run = CorralRun(tmp_path, ["--batches", "50"], terminal=True)
    try:
        run.wait_line(BATCH_LINE)
        run.hang_up()
        report = run.finish(timeout_s=90)
        assert run.leftovers() == []
    finally:
        run.kill()
    assert report["stopped_early"] is True
    assert report["stop"]["hung_up"] is True
    assert report["stop"]["signals"] >= 1
    assert 1 <= report["batches"] < 50


def test_a_ctrl_c_while_corral_loads_is_not_followed_by_a_starting_line(tmp_path: Path) -> None:
    """A Ctrl-C held while `corral run` was still loading: it said "start-up abandoned, stopping the
    engines", then "starting 2 embedded engines", as if the stop had been missed."""
    config = tmp_path / "run.yaml"
    config.write_text(FAST_CONFIG)
    code = (
        "import os, signal; from app import early_signals; early_signals.hold(); "
        "os.kill(os.getpid(), signal.SIGINT); from app.cli import main; main()"
    )
    done = subprocess.run(
        [sys.executable, "-c", code, "run", "--config", str(config), "--json", str(tmp_path / "r.json")],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert "start-up abandoned" in done.stderr
    assert "starting" not in done.stderr.split("start-up abandoned", 1)[1], done.stderr
    report = json.loads((tmp_path / "r.json").read_text())
    assert report["batches"] == 0
    assert report["stop"]["phase"] == "startup"
    # It never collected: no share of its time idle (it read 0%, and a run stopped while collecting
    # its first batch 100%)
    assert report["trainer_idle_fraction"] is None
    assert "no batch delivered" in done.stderr
    assert "stopped before collecting" in done.stderr


def test_a_second_stop_signal_during_start_up_is_acknowledged_not_announced_again() -> None:
    """Two Ctrl-Cs while `corral run` started: "stopping: start-up abandoned ..." was said twice. The
    second is acknowledged as the later ones of a run already stopping are."""
    from app.runtime.local import _StopSignals

    said: list[str] = []
    stops = _StopSignals(said.append)
    stops.fire()
    stops.fire()
    assert said == [
        "stopping: start-up abandoned, stopping the engines, writing the report",
        "already stopping; the report is on its way",
    ]
    assert stops.report() == {
        "signals": 2,
        "phase": "startup",
        "engines_updating": [],
        "forced": True,
        "hung_up": False,
    }
