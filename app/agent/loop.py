"""The shell agent: prompt -> model turn -> shell command -> observation, until done or a cap.

Invariants:
- the work directory is reset exactly once, before the first turn; validation runs exactly once, after
  the last, also when a cap ended the episode (as terminal-bench scores timed-out trials);
- at most `task.max_turns` model turns are generated; no command is started once the agent phase
  (`task.agent_timeout_s`, measured with `ctx.now()` from the end of reset) is spent, and every command
  gets at most the time that remains;
- every model turn leaves one transcript entry, carrying the weight version that produced it;
- exceptions from the engine or sandbox layers are not caught: they are infrastructure errors and the
  runtime records them. A failed set-up script is reported as `AttemptOutcome.error` without running
  turns, since no reward earned on a broken work directory means anything.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from app.agent.parse import is_done, parse_command
from app.engines.base import TurnRequest
from app.runtime.context import AttemptOutcome

if TYPE_CHECKING:
    from app.runtime.context import AttemptContext
    from app.sandboxes.base import ExecResult
    from app.tasks.spec import TaskSpec


class AgentError(RuntimeError):
    """The agent was driven against its contract (no task, an engine choice out of range)."""


@dataclass(frozen=True)
class ShellAgentConfig:
    """How much the agent shows the model and how long one command may run."""

    max_tokens: int = 256  # per model turn, in text mode
    temperature: float = 1.0
    observation_chars: int = 1_500  # tail of one command's output kept in the prompt
    history_chars: int = 6_000  # all observations in one prompt, newest kept first
    command_timeout_s: float | None = None  # per-command cap below the agent phase's remaining time
    transcript_output_chars: int = 400  # tail of the output kept in each transcript entry


@dataclass(frozen=True)
class _Step:
    command: str
    result: ExecResult | None  # None: the model gave no command


class ShellAgent:
    """Implements the `Agent` protocol over any `AttemptContext`."""

    def __init__(self, config: ShellAgentConfig | None = None) -> None:
        self.config = config or ShellAgentConfig()

    async def run(self, ctx: AttemptContext) -> AttemptOutcome:
        task = ctx.task
        if task is None:
            raise AgentError(f"attempt {ctx.attempt_id}: ShellAgent needs a task on its context")
        setup = await ctx.reset()
        if setup.timed_out or setup.exit_code != 0:
            why = "timed out" if setup.timed_out else f"exited {setup.exit_code}"
            tail = setup.output[-self.config.observation_chars :]
            return AttemptOutcome(reward=0.0, turns=0, error=f"task {task.name}: set-up {why}: {tail}")

        started = ctx.now()
        steps: list[_Step] = []
        transcript: list[dict[str, object]] = []
        turns = 0
        timed_out = False
        while turns < task.max_turns:
            if task.agent_timeout_s - (ctx.now() - started) <= 0:
                timed_out = True
                break
            turn_start = ctx.now()
            request = TurnRequest(
                prompt=build_prompt(task, steps, self.config),
                max_tokens=self.config.max_tokens,
                temperature=self.config.temperature,
                candidates=task.candidate_actions,
            )
            result = await ctx.generate(request)
            turns += 1
            if task.candidate_actions:
                if result.choice is None or not 0 <= result.choice < len(task.candidate_actions):
                    raise AgentError(
                        f"attempt {ctx.attempt_id}: engine chose {result.choice!r} among "
                        f"{len(task.candidate_actions)} candidates"
                    )
                chosen = task.candidate_actions[result.choice]
                done = is_done(chosen)
                command = None if done else chosen
            else:
                command = parse_command(result.text)
                done = is_done(result.text)

            entry: dict[str, object] = {
                "turn": turns,
                "command": command,
                "exit_code": None,
                "weight_version": result.weight_version,
                "choice": result.choice,
                "logprob": result.logprob,
                "duration": 0.0,
                "done": done,
                "timed_out": False,
                "output": "",
            }
            transcript.append(entry)
            remaining = task.agent_timeout_s - (ctx.now() - started)
            if command is not None and remaining <= 0:
                # The model turn itself spent the agent phase; the command is never started.
                timed_out = True
                entry["duration"] = ctx.now() - turn_start
                break
            if command is not None:
                limit = remaining
                if self.config.command_timeout_s is not None:
                    limit = min(limit, self.config.command_timeout_s)
                observed = await ctx.exec(command, limit)
                steps.append(_Step(command, observed))
                entry["exit_code"] = observed.exit_code
                entry["timed_out"] = observed.timed_out
                entry["output"] = observed.output[-self.config.transcript_output_chars :]
            elif not done:
                steps.append(_Step(result.text.strip()[:200], None))
            entry["duration"] = ctx.now() - turn_start
            if done:
                break
            if task.agent_timeout_s - (ctx.now() - started) <= 0:
                timed_out = True
                break

        reward = await ctx.validate()
        return AttemptOutcome(reward=reward, turns=turns, timed_out=timed_out, transcript=transcript)


def build_prompt(task: TaskSpec, steps: list[_Step], config: ShellAgentConfig) -> str:
    """The instruction and the newest observations that fit `config.history_chars`."""
    head = (
        "You are working in a shell, in the task's work directory.\n"
        f"Task:\n{task.instruction}\n\n"
        "Answer with exactly one shell command in a ```bash block. "
        "When the task is complete, answer DONE.\n"
    )
    blocks: list[str] = []
    used = 0
    for step in reversed(steps):
        block = _render(step, config.observation_chars)
        if used + len(block) > config.history_chars:
            break
        blocks.append(block)
        used += len(block)
    omitted = len(steps) - len(blocks)
    history = "".join(reversed(blocks))
    note = f"[{omitted} earlier steps omitted]\n" if omitted else ""
    return f"{head}\n{note}{history}\nNext command:\n"


def _render(step: _Step, observation_chars: int) -> str:
    if step.result is None:
        return f"(no command found in your answer: {step.command!r})\n"
    output = step.result.output
    if len(output) > observation_chars:
        output = "[...]" + output[-observation_chars:]
    status = "timed out" if step.result.timed_out else f"exit {step.result.exit_code}"
    text = output if output.endswith("\n") or not output else output + "\n"
    return f"$ {step.command}\n{text}[{status}]\n"
