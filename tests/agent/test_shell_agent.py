"""ShellAgent against a scripted AttemptContext that runs commands for real in a temp dir.

The context's clock is the real monotonic clock plus a virtual offset that each model turn advances
by `generate_cost_s`, so time caps are hit deterministically without waiting.
"""

from __future__ import annotations

import asyncio
import dataclasses
import os
import shutil
import signal
import time
from pathlib import Path

import pytest

from app.agent import AgentError, ShellAgent, ShellAgentConfig
from app.agent.loop import _Step, build_prompt
from app.engines.base import TurnRequest, TurnResult
from app.runtime.context import AttemptContext
from app.sandboxes.base import ExecResult
from app.tasks.loader import builtin_suite_path, load_task
from app.tasks.spec import TaskSpec


class EngineDown(RuntimeError):
    pass


class ScriptedContext:
    """An AttemptContext whose model turns are scripted and whose shell is a real bash in `workdir`."""

    def __init__(
        self, task: TaskSpec, workdir: Path, turns: list[TurnResult], generate_cost_s: float = 0.0
    ) -> None:
        self.attempt_id = "attempt-1"
        self.task: TaskSpec | None = task
        self.workdir = workdir
        self.turns = list(turns)
        self.generate_cost_s = generate_cost_s
        self.requests: list[TurnRequest] = []
        self.execs: list[tuple[str, float]] = []
        self.resets = 0
        self.validations = 0
        self._offset = 0.0

    def now(self) -> float:
        return time.monotonic() + self._offset

    async def generate(self, request: TurnRequest) -> TurnResult:
        self.requests.append(request)
        self._offset += self.generate_cost_s
        if not self.turns:
            raise EngineDown("script exhausted")
        return self.turns.pop(0)

    async def reset(self) -> ExecResult:
        assert self.task is not None
        self.resets += 1
        self.workdir.mkdir(parents=True, exist_ok=True)
        for rel in self.task.files:
            (self.workdir / rel).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy(self.task.root / rel, self.workdir / rel)
        return await self._shell(self.task.setup or "true", self.task.setup_timeout_s)

    async def exec(self, command: str, timeout_s: float) -> ExecResult:
        self.execs.append((command, timeout_s))
        return await self._shell(command, timeout_s)

    async def validate(self) -> float:
        assert self.task is not None
        self.validations += 1
        result = await self._shell(self.task.validation, self.task.validation_timeout_s)
        return 1.0 if result.exit_code == 0 else 0.0

    async def _shell(self, command: str, timeout_s: float) -> ExecResult:
        started = time.monotonic()
        proc = await asyncio.create_subprocess_exec(
            "bash",
            "-c",
            command,
            cwd=self.workdir,
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.STDOUT,
            start_new_session=True,
        )
        try:
            out, _ = await asyncio.wait_for(proc.communicate(), timeout_s)
        except TimeoutError:
            os.killpg(proc.pid, signal.SIGKILL)
            out, _ = await proc.communicate()
            return ExecResult(None, out.decode(), timed_out=True, duration_s=time.monotonic() - started)
        return ExecResult(proc.returncode, out.decode(), duration_s=time.monotonic() - started)


def make_task(tmp_path: Path, **overrides: object) -> TaskSpec:
    root = tmp_path / "task"
    root.mkdir(exist_ok=True)
    fields: dict[str, object] = {
        "name": "write-file",
        "instruction": "Create out.txt containing ok.",
        "root": root,
        "validation": "grep -qx ok out.txt",
        "max_turns": 5,
        "agent_timeout_s": 30.0,
    }
    fields.update(overrides)
    return TaskSpec(**fields)  # type: ignore[arg-type]


def text(body: str, version: int = 3) -> TurnResult:
    return TurnResult(text=body, weight_version=version, tokens=len(body.split()))


def pick(choice: int, version: int = 3, logprob: float = -0.5) -> TurnResult:
    return TurnResult(text="", weight_version=version, tokens=1, choice=choice, logprob=logprob)


def _conforms(ctx: AttemptContext) -> AttemptContext:
    return ctx


async def test_text_mode_runs_commands_until_done(tmp_path: Path) -> None:
    task = make_task(tmp_path)
    turns = [
        text("Let me look.\n```bash\nls\n```", version=3),
        text("$ echo ok > out.txt", version=4),
        text("All set.\nDONE", version=4),
    ]
    ctx = ScriptedContext(task, tmp_path / "work", turns)
    outcome = await ShellAgent().run(_conforms(ctx))
    assert outcome.reward == 1.0
    assert outcome.turns == 3
    assert not outcome.timed_out
    assert outcome.error is None
    assert [c for c, _ in ctx.execs] == ["ls", "echo ok > out.txt"]
    assert (ctx.resets, ctx.validations) == (1, 1)
    entries = outcome.transcript
    assert [e["turn"] for e in entries] == [1, 2, 3]
    assert [e["weight_version"] for e in entries] == [3, 4, 4]
    assert [e["command"] for e in entries] == ["ls", "echo ok > out.txt", None]
    assert [e["exit_code"] for e in entries] == [0, 0, None]
    assert entries[2]["done"] is True
    for entry in entries:
        assert {"turn", "command", "exit_code", "weight_version", "choice", "logprob", "duration"} <= set(
            entry
        )
    # The second prompt shows the first command and its output.
    assert "$ ls\n" in ctx.requests[1].prompt
    assert "Create out.txt containing ok." in ctx.requests[0].prompt
    assert ctx.requests[0].candidates == ()


async def test_text_without_command_is_observed_and_counts_as_a_turn(tmp_path: Path) -> None:
    task = make_task(tmp_path)
    turns = [text("Hmm, thinking."), text("<cmd>echo ok > out.txt</cmd>"), text("<done/>")]
    ctx = ScriptedContext(task, tmp_path / "work", turns)
    outcome = await ShellAgent().run(ctx)
    assert outcome.turns == 3
    assert outcome.reward == 1.0
    assert "no command found" in ctx.requests[1].prompt
    assert [c for c, _ in ctx.execs] == ["echo ok > out.txt"]


async def test_command_with_done_marker_runs_then_stops(tmp_path: Path) -> None:
    task = make_task(tmp_path)
    ctx = ScriptedContext(task, tmp_path / "work", [text("```bash\necho ok > out.txt\n```\nDONE")])
    outcome = await ShellAgent().run(ctx)
    assert (outcome.turns, outcome.reward) == (1, 1.0)
    assert len(ctx.execs) == 1


async def test_candidate_mode_takes_the_engine_choice_and_stops_on_done(tmp_path: Path) -> None:
    task = make_task(tmp_path, candidate_actions=("echo no > out.txt", "echo ok > out.txt", "# done"))
    ctx = ScriptedContext(task, tmp_path / "work", [pick(0), pick(1, logprob=-0.1), pick(2, version=5)])
    outcome = await ShellAgent().run(ctx)
    assert outcome.reward == 1.0
    assert outcome.turns == 3
    assert [c for c, _ in ctx.execs] == ["echo no > out.txt", "echo ok > out.txt"]
    assert all(r.candidates == task.candidate_actions for r in ctx.requests)
    assert [e["choice"] for e in outcome.transcript] == [0, 1, 2]
    assert [e["logprob"] for e in outcome.transcript] == [-0.5, -0.1, -0.5]
    assert outcome.transcript[-1]["weight_version"] == 5


async def test_turn_cap(tmp_path: Path) -> None:
    task = make_task(tmp_path, max_turns=3)
    ctx = ScriptedContext(task, tmp_path / "work", [text("$ echo again") for _ in range(10)])
    outcome = await ShellAgent().run(ctx)
    assert outcome.turns == 3
    assert len(ctx.requests) == 3
    assert not outcome.timed_out
    assert outcome.reward == 0.0
    assert ctx.validations == 1


async def test_time_cap_from_model_turns(tmp_path: Path) -> None:
    # Each model turn costs 4 virtual seconds of a 10 s agent phase: the third turn ends past the cap,
    # so its command is never started.
    task = make_task(tmp_path, agent_timeout_s=10.0, max_turns=10)
    ctx = ScriptedContext(task, tmp_path / "work", [text("$ true") for _ in range(10)], generate_cost_s=4.0)
    outcome = await ShellAgent().run(ctx)
    assert outcome.timed_out
    assert outcome.turns == 3
    assert len(ctx.execs) == 2
    assert ctx.execs[0][1] == pytest.approx(6.0, abs=0.5)  # each command gets only the time left
    assert ctx.execs[1][1] == pytest.approx(2.0, abs=0.5)
    assert ctx.validations == 1


async def test_time_cap_kills_a_long_command(tmp_path: Path) -> None:
    task = make_task(tmp_path, agent_timeout_s=1.0, max_turns=10)
    ctx = ScriptedContext(task, tmp_path / "work", [text("$ sleep 30"), text("$ true")])
    started = time.monotonic()
    outcome = await ShellAgent().run(ctx)
    assert time.monotonic() - started < 10
    assert outcome.timed_out
    assert outcome.turns == 1
    assert outcome.transcript[0]["timed_out"] is True
    assert outcome.transcript[0]["exit_code"] is None


async def test_per_command_cap_leaves_the_episode_running(tmp_path: Path) -> None:
    task = make_task(tmp_path, agent_timeout_s=30.0)
    turns = [text("$ sleep 30"), text("$ echo ok > out.txt"), text("DONE")]
    ctx = ScriptedContext(task, tmp_path / "work", turns)
    outcome = await ShellAgent(ShellAgentConfig(command_timeout_s=0.5)).run(ctx)
    assert not outcome.timed_out
    assert outcome.reward == 1.0
    assert [t for _, t in ctx.execs] == [0.5, 0.5]
    assert "[timed out]" in ctx.requests[1].prompt


async def test_engine_error_propagates(tmp_path: Path) -> None:
    task = make_task(tmp_path)
    ctx = ScriptedContext(task, tmp_path / "work", [text("$ echo hi")])  # the second turn raises
    with pytest.raises(EngineDown, match="script exhausted"):
        await ShellAgent().run(ctx)
    assert ctx.validations == 0


async def test_choice_out_of_range_is_refused(tmp_path: Path) -> None:
    task = make_task(tmp_path, candidate_actions=("ls", "# done"))
    ctx = ScriptedContext(task, tmp_path / "work", [pick(7)])
    with pytest.raises(AgentError, match="engine chose 7 among 2 candidates"):
        await ShellAgent().run(ctx)


async def test_failed_setup_is_reported_without_turns(tmp_path: Path) -> None:
    task = make_task(tmp_path, setup="echo broken >&2; exit 3")
    ctx = ScriptedContext(task, tmp_path / "work", [text("$ true")])
    outcome = await ShellAgent().run(ctx)
    assert outcome.error is not None
    assert "set-up exited 3" in outcome.error
    assert "broken" in outcome.error
    assert (outcome.turns, ctx.validations, len(ctx.requests)) == (0, 0, 0)


async def test_missing_task_is_refused(tmp_path: Path) -> None:
    ctx = ScriptedContext(make_task(tmp_path), tmp_path / "work", [])
    ctx.task = None
    with pytest.raises(AgentError, match="needs a task"):
        await ShellAgent().run(ctx)


async def test_builtin_task_solved_through_its_candidates(tmp_path: Path) -> None:
    task = load_task(builtin_suite_path() / "fix-off-by-one")
    done = task.candidate_actions.index("# done")
    ctx = ScriptedContext(task, tmp_path / "work", [pick(3), pick(0), pick(done)])
    outcome = await ShellAgent().run(ctx)
    assert outcome.reward == 1.0
    assert outcome.turns == 3
    assert "def window_sums" in str(outcome.transcript[0]["output"])


async def test_builtin_task_in_text_mode(tmp_path: Path) -> None:
    task = dataclasses.replace(load_task(builtin_suite_path() / "patch-config-sed"), candidate_actions=())
    fix = "sed -i -e 's/^port = 8080$/port = 9090/' -e 's/^debug = true$/debug = false/' app.conf"
    ctx = ScriptedContext(task, tmp_path / "work", [text(f"```bash\n{fix}\n```"), text("DONE")])
    outcome = await ShellAgent().run(ctx)
    assert outcome.reward == 1.0


def test_prompt_keeps_the_newest_observations_within_budget(tmp_path: Path) -> None:
    task = make_task(tmp_path)
    steps = [_Step(f"echo {i}", ExecResult(0, f"out-{i}\n" + "x" * 5000)) for i in range(20)]
    config = ShellAgentConfig(observation_chars=300, history_chars=1000)
    prompt = build_prompt(task, steps, config)
    assert "$ echo 19\n" in prompt
    assert "$ echo 0\n" not in prompt
    assert "earlier steps omitted" in prompt
    assert len(prompt) < 1000 + 600  # history budget plus the fixed header
    assert "out-19" not in prompt  # only the tail of a long output is kept
