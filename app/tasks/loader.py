"""Load task directories into `TaskSpec`s, refusing bad ones at load time.

A task is a directory holding `task.yaml` and the files an attempt starts from. Invariants of a
returned `TaskSpec`:

- `instruction` and `validation` are non-empty; every timeout is at least 0.1 s; `max_turns` >= 1;
  `candidate_actions`, when given, is non-empty and holds no empty command.
- every entry of `files` is a relative POSIX path naming a regular file inside `root`, with no `..`
  component, no absolute path, and no symlink (at any level) resolving outside `root`.
- every number is finite and bounded: timeouts in [MIN_TASK_TIMEOUT_S, MAX_SECONDS], `max_turns` in
  1..MAX_TURNS, and a count is a real integer (`true` or `2.0` is refused, not coerced).
- `task.yaml` holds only known fields. Corral's own fields are parsed; terminal-bench's fields map onto
  them where they mean the same thing (`descriptions`, `max_agent_timeout_sec`, `max_test_timeout_sec`,
  `difficulty`, `category`, `run-tests.sh`); terminal-bench's purely descriptive fields are accepted and
  ignored (`TERMINAL_BENCH_IGNORED`); any other field is refused.

Every refusal is a `TaskError` whose message names the task directory and the field (one line per
problem), so a bad suite is fixed in one pass rather than one error at a time.
"""

from __future__ import annotations

import functools
import os
from pathlib import Path, PurePosixPath
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from app.documents import DocumentError, read_document
from app.tasks.spec import TaskSpec
from app.validation import MAX_SECONDS, MAX_TURNS, MIN_TASK_TIMEOUT_S, describe

TASK_FILE = "task.yaml"

# terminal-bench fields that describe a task but change nothing about how Corral runs it.
TERMINAL_BENCH_IGNORED: frozenset[str] = frozenset(
    {
        "author_name",
        "author_email",
        "parser_name",
        "run_tests_in_same_shell",
        "disable_asciinema",
        "estimated_duration_sec",
        "expert_time_estimate_min",
        "junior_time_estimate_min",
        "test_scripts",
    }
)

# Never copied into the work directory by default: the spec itself, and terminal-bench's oracle
# solutions, which would hand the agent the answer.
_DEFAULT_EXCLUDED = frozenset({TASK_FILE, "solution.sh", "solution.yaml"})
_SKIPPED_DIRS = frozenset({"__pycache__", ".git"})


class TaskError(ValueError):
    """A task directory or suite that cannot be loaded; the message says where and why."""


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True, allow_inf_nan=False)


class _Validation(_Strict):
    command: str = Field(min_length=1)


def _timeout() -> Any:
    return Field(default=None, ge=MIN_TASK_TIMEOUT_S, le=MAX_SECONDS, strict=True)


class _Timeouts(_Strict):
    setup_s: float | None = _timeout()
    agent_s: float | None = _timeout()
    validation_s: float | None = _timeout()


class _Description(_Strict):
    key: str = "base"
    description: str = Field(min_length=1)


class _TaskFile(_Strict):
    """The schema of `task.yaml`: Corral's fields first, then terminal-bench's."""

    instruction: str | None = Field(default=None, min_length=1)
    setup: str = ""
    validation: _Validation | None = None
    timeouts: _Timeouts = _Timeouts()
    max_turns: int | None = Field(default=None, ge=1, le=MAX_TURNS, strict=True)
    candidate_actions: list[str] | None = Field(default=None, min_length=1)
    files: list[str] | None = None
    tags: list[str] = []

    # terminal-bench fields that map onto Corral's.
    descriptions: list[_Description] | None = Field(default=None, min_length=1)
    max_agent_timeout_sec: float | None = _timeout()
    max_test_timeout_sec: float | None = _timeout()
    difficulty: Literal["easy", "medium", "hard", "unknown"] | None = None
    category: str | None = None

    # terminal-bench's descriptive fields: accepted, ignored (see TERMINAL_BENCH_IGNORED).
    author_name: Any = None
    author_email: Any = None
    parser_name: Any = None
    run_tests_in_same_shell: Any = None
    disable_asciinema: Any = None
    estimated_duration_sec: Any = None
    expert_time_estimate_min: Any = None
    junior_time_estimate_min: Any = None
    test_scripts: Any = None


def builtin_suite_path() -> Path:
    """The directory of Corral's built-in offline task suite."""
    return Path(__file__).resolve().parent / "builtin"


@functools.cache
def builtin_task_names() -> frozenset[str]:
    """The names of the built-in suite's tasks (it ships with the package and does not change)."""
    return frozenset(task.name for task in load_suite(builtin_suite_path()))


def load_task(path: str | os.PathLike[str]) -> TaskSpec:
    """Load one task directory; raise `TaskError` naming the directory and every bad field."""
    root = Path(path)
    if not root.is_dir():
        raise TaskError(f"{root}: not a task directory (no such directory)")
    spec_path = root / TASK_FILE
    if not spec_path.is_file():
        raise TaskError(f"{root}: missing {TASK_FILE}")
    try:
        raw = read_document(spec_path, f"{root}: {TASK_FILE}")
    except DocumentError as exc:
        raise TaskError(str(exc)) from None
    if not isinstance(raw, dict):
        raise TaskError(f"{root}: {TASK_FILE} must be a mapping of fields, got {type(raw).__name__}")
    try:
        parsed = _TaskFile.model_validate(raw)
    except ValidationError as exc:
        raise TaskError("\n".join(_describe(root, err) for err in exc.errors())) from None
    return _to_spec(root, parsed)


def load_suite(path: str | os.PathLike[str]) -> list[TaskSpec]:
    """Load every task directory directly under `path`, sorted by name.

    All tasks are tried before failing, so the error lists every bad task at once.
    """
    suite = Path(path)
    if not suite.is_dir():
        raise TaskError(f"{suite}: not a suite directory (no such directory)")
    tasks: list[TaskSpec] = []
    problems: list[str] = []
    try:
        children = sorted(suite.iterdir())
    except OSError as exc:
        raise TaskError(f"{suite}: cannot list the suite: {exc.strerror or exc}") from None
    for child in children:
        if not child.is_dir() or child.name.startswith(".") or child.name in _SKIPPED_DIRS:
            continue
        try:
            tasks.append(load_task(child))
        except TaskError as exc:
            problems.append(str(exc))
    if problems:
        raise TaskError("\n".join(problems))
    if not tasks:
        raise TaskError(f"{suite}: suite holds no task directories")
    return tasks


def _describe(root: Path, err: Any) -> str:
    loc = ".".join(str(part) for part in err["loc"]) or "<root>"
    if err["type"] == "extra_forbidden":
        return f"{root}: unknown field '{loc}' in {TASK_FILE}"
    return f"{root}: field '{loc}': {describe(err)}"


def _to_spec(root: Path, parsed: _TaskFile) -> TaskSpec:
    problems: list[str] = []

    def refuse(field: str, why: str) -> None:
        problems.append(f"{root}: field '{field}': {why}")

    instruction = parsed.instruction
    if parsed.descriptions is not None:
        if instruction is not None:
            refuse("descriptions", "give either 'instruction' or terminal-bench 'descriptions', not both")
        base = [d.description for d in parsed.descriptions if d.key == "base"]
        if base:
            instruction = base[0]
        else:
            refuse("descriptions", "no entry with key 'base'")
    if instruction is None and parsed.descriptions is None:
        refuse("instruction", "required (or terminal-bench 'descriptions')")

    validation = parsed.validation.command if parsed.validation is not None else None
    if validation is not None and not validation.strip():
        refuse("validation.command", "must not be blank")
    if validation is None:
        # terminal-bench runs `run-tests.sh` with $TEST_DIR pointing at the task's tests/.
        if (root / "run-tests.sh").is_file():
            validation = 'TEST_DIR="$PWD/tests" bash run-tests.sh'
        else:
            refuse("validation", "required: a mapping with 'command' (or a terminal-bench run-tests.sh)")

    agent_s = _either(parsed.timeouts.agent_s, parsed.max_agent_timeout_sec, "agent_s", refuse)
    validation_s = _either(parsed.timeouts.validation_s, parsed.max_test_timeout_sec, "validation_s", refuse)

    candidates: tuple[str, ...] = ()
    if parsed.candidate_actions is not None:
        for i, cmd in enumerate(parsed.candidate_actions):
            if not cmd.strip():
                refuse(f"candidate_actions.{i}", "empty command")
        candidates = tuple(parsed.candidate_actions)

    files = _resolve_files(root, parsed.files, refuse)

    tags = list(parsed.tags)
    if parsed.difficulty is not None:
        tags.append(f"difficulty:{parsed.difficulty}")
    if parsed.category is not None:
        tags.append(f"category:{parsed.category}")

    if problems or instruction is None or validation is None:
        raise TaskError("\n".join(problems))

    defaults = TaskSpec(name="", instruction="", root=root, validation="")
    return TaskSpec(
        name=root.name,
        instruction=instruction.strip(),
        root=root.resolve(),
        validation=validation.strip(),
        setup=parsed.setup,
        files=files,
        candidate_actions=candidates,
        setup_timeout_s=parsed.timeouts.setup_s or defaults.setup_timeout_s,
        agent_timeout_s=agent_s or defaults.agent_timeout_s,
        validation_timeout_s=validation_s or defaults.validation_timeout_s,
        max_turns=parsed.max_turns or defaults.max_turns,
        tags=tuple(dict.fromkeys(tags)),
    )


def _either(corral: float | None, terminal_bench: float | None, name: str, refuse: Any) -> float | None:
    if corral is not None and terminal_bench is not None:
        refuse(f"timeouts.{name}", "also given by its terminal-bench field; give one of them")
    return corral if corral is not None else terminal_bench


def _resolve_files(root: Path, listed: list[str] | None, refuse: Any) -> tuple[str, ...]:
    real_root = root.resolve()
    if listed is None:
        found: list[str] = []
        for dirpath, dirnames, filenames in os.walk(root, followlinks=False):
            dirnames[:] = sorted(d for d in dirnames if d not in _SKIPPED_DIRS)
            here = Path(dirpath)
            for link in (d for d in dirnames if (here / d).is_symlink()):
                if not _inside(real_root, here / link):
                    refuse("files", f"symlink '{(here / link).relative_to(root)}' escapes the task directory")
            for name in sorted(filenames):
                rel = (here / name).relative_to(root).as_posix()
                if rel in _DEFAULT_EXCLUDED or name.endswith(".pyc"):
                    continue
                if not _inside(real_root, here / name):
                    refuse("files", f"symlink '{rel}' escapes the task directory")
                    continue
                found.append(rel)
        return tuple(sorted(found))

    out: list[str] = []
    for i, entry in enumerate(listed):
        where = f"files.{i}"
        pure = PurePosixPath(entry)
        if not entry.strip():
            refuse(where, "empty file name")
        elif pure.is_absolute() or Path(entry).is_absolute():
            refuse(where, f"absolute path '{entry}' is not allowed; give a path relative to the task")
        elif ".." in pure.parts:
            refuse(where, f"path traversal in '{entry}' is not allowed")
        elif not _inside(real_root, root / entry):
            refuse(where, f"'{entry}' resolves outside the task directory (symlink)")
        elif not (root / entry).exists():
            refuse(where, f"listed file '{entry}' does not exist")
        elif not (root / entry).is_file():
            refuse(where, f"'{entry}' is not a regular file")
        else:
            out.append(pure.as_posix())
    return tuple(dict.fromkeys(out))


def _inside(real_root: Path, path: Path) -> bool:
    return real_root == path.resolve() or real_root in path.resolve().parents
