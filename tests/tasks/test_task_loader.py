"""The loader refuses bad task directories with a message naming the directory and the field."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest
import yaml

from app.tasks.loader import TaskError, builtin_suite_path, load_suite, load_task


def make_task(root: Path, name: str = "t", contents: dict[str, str] | None = None, **fields: Any) -> Path:
    """A task directory whose task.yaml is a valid minimal task updated with `fields`."""
    task_dir = root / name
    task_dir.mkdir(parents=True)
    spec: dict[str, Any] = {"instruction": "do it", "validation": {"command": "test -f out"}}
    spec.update(fields)
    spec = {k: v for k, v in spec.items() if v is not None}
    (task_dir / "task.yaml").write_text(yaml.safe_dump(spec))
    for rel, text in (contents or {}).items():
        (task_dir / rel).parent.mkdir(parents=True, exist_ok=True)
        (task_dir / rel).write_text(text)
    return task_dir


def refusal(task_dir: Path) -> str:
    with pytest.raises(TaskError) as info:
        load_task(task_dir)
    message = str(info.value)
    assert str(task_dir) in message
    return message


def test_minimal_task_loads_with_defaults(tmp_path: Path) -> None:
    task_dir = make_task(tmp_path, contents={"a.txt": "x", "sub/b.py": "y"})
    task = load_task(task_dir)
    assert task.name == "t"
    assert task.instruction == "do it"
    assert task.validation == "test -f out"
    assert task.files == ("a.txt", "sub/b.py")
    assert task.root == task_dir.resolve()
    assert task.candidate_actions == ()
    assert (task.setup_timeout_s, task.agent_timeout_s, task.validation_timeout_s) == (60.0, 120.0, 60.0)
    assert task.max_turns == 8


def test_all_corral_fields_map(tmp_path: Path) -> None:
    task_dir = make_task(
        tmp_path,
        contents={"a.txt": "x", "b.txt": "y"},
        setup="echo hi > a.txt",
        timeouts={"setup_s": 5, "agent_s": 6.5, "validation_s": 7},
        max_turns=3,
        candidate_actions=["ls", "# done"],
        tags=["x", "y"],
        files=["b.txt"],
    )
    task = load_task(task_dir)
    assert task.setup == "echo hi > a.txt"
    assert (task.setup_timeout_s, task.agent_timeout_s, task.validation_timeout_s) == (5, 6.5, 7)
    assert task.max_turns == 3
    assert task.candidate_actions == ("ls", "# done")
    assert task.files == ("b.txt",)
    assert task.tags == ("x", "y")


def test_missing_task_yaml(tmp_path: Path) -> None:
    (tmp_path / "empty").mkdir()
    assert "missing task.yaml" in refusal(tmp_path / "empty")


def test_missing_directory(tmp_path: Path) -> None:
    with pytest.raises(TaskError, match="no such directory"):
        load_task(tmp_path / "nope")


def test_invalid_yaml(tmp_path: Path) -> None:
    task_dir = make_task(tmp_path)
    (task_dir / "task.yaml").write_text("instruction: [unclosed\n")
    assert "not valid YAML" in refusal(task_dir)


def test_yaml_that_is_not_a_mapping(tmp_path: Path) -> None:
    task_dir = make_task(tmp_path)
    (task_dir / "task.yaml").write_text("- just\n- a list\n")
    assert "must be a mapping" in refusal(task_dir)


def test_unknown_field(tmp_path: Path) -> None:
    assert "unknown field 'colour'" in refusal(make_task(tmp_path, colour="red"))


def test_unknown_nested_field(tmp_path: Path) -> None:
    message = refusal(make_task(tmp_path, timeouts={"agent_s": 5, "agent_sec": 6}))
    assert "unknown field 'timeouts.agent_sec'" in message


def test_missing_validation(tmp_path: Path) -> None:
    message = refusal(make_task(tmp_path, validation=None))
    assert "field 'validation'" in message
    assert "required" in message


def test_validation_without_command(tmp_path: Path) -> None:
    assert "field 'validation.command'" in refusal(make_task(tmp_path, validation={}))


def test_blank_validation_command(tmp_path: Path) -> None:
    assert "field 'validation.command'" in refusal(make_task(tmp_path, validation={"command": "  "}))


def test_missing_instruction(tmp_path: Path) -> None:
    assert "field 'instruction'" in refusal(make_task(tmp_path, instruction=None))


@pytest.mark.parametrize(
    ("fields", "named"),
    [
        ({"timeouts": {"agent_s": 0}}, "timeouts.agent_s"),
        ({"timeouts": {"setup_s": -1}}, "timeouts.setup_s"),
        ({"timeouts": {"validation_s": 0}}, "timeouts.validation_s"),
        ({"max_agent_timeout_sec": -5}, "max_agent_timeout_sec"),
        ({"max_test_timeout_sec": 0}, "max_test_timeout_sec"),
        ({"max_turns": 0}, "max_turns"),
    ],
)
def test_non_positive_limits(tmp_path: Path, fields: dict[str, Any], named: str) -> None:
    message = refusal(make_task(tmp_path, **fields))
    assert f"field '{named}'" in message
    assert "greater than" in message


@pytest.mark.parametrize(
    "fields",
    [
        {"timeouts": {"agent_s": 1e-300}},
        {"timeouts": {"setup_s": 0.05}},
        {"timeouts": {"validation_s": 5e-324}},
        {"max_agent_timeout_sec": 1e-9},
        {"max_test_timeout_sec": 0.0999},
    ],
)
def test_a_timeout_under_a_tenth_of_a_second_is_refused(tmp_path: Path, fields: dict[str, Any]) -> None:
    message = refusal(make_task(tmp_path, **fields))
    named = next(iter(fields["timeouts"])) if "timeouts" in fields else next(iter(fields))
    assert len(message.splitlines()) == 1, message
    assert f"field '{'timeouts.' if 'timeouts' in fields else ''}{named}'" in message
    assert "greater than or equal to 0.1" in message


def test_a_tenth_of_a_second_is_the_shortest_timeout(tmp_path: Path) -> None:
    task = load_task(make_task(tmp_path, timeouts={"setup_s": 0.1, "agent_s": 0.1, "validation_s": 0.1}))
    assert (task.setup_timeout_s, task.agent_timeout_s, task.validation_timeout_s) == (0.1, 0.1, 0.1)


def test_timeout_given_twice(tmp_path: Path) -> None:
    message = refusal(make_task(tmp_path, timeouts={"agent_s": 5}, max_agent_timeout_sec=6))
    assert "field 'timeouts.agent_s'" in message


def test_empty_candidate_list(tmp_path: Path) -> None:
    assert "field 'candidate_actions'" in refusal(make_task(tmp_path, candidate_actions=[]))


def test_blank_candidate(tmp_path: Path) -> None:
    assert "field 'candidate_actions.1'" in refusal(make_task(tmp_path, candidate_actions=["ls", " "]))


def test_path_traversal(tmp_path: Path) -> None:
    message = refusal(make_task(tmp_path, files=["../secret"]))
    assert "field 'files.0'" in message
    assert "traversal" in message


def test_absolute_path(tmp_path: Path) -> None:
    message = refusal(make_task(tmp_path, files=["/etc/passwd"]))
    assert "field 'files.0'" in message
    assert "absolute" in message


def test_listed_file_missing(tmp_path: Path) -> None:
    message = refusal(make_task(tmp_path, contents={"a.txt": "x"}, files=["a.txt", "b.txt"]))
    assert "field 'files.1'" in message
    assert "'b.txt' does not exist" in message


def test_listed_symlink_escaping(tmp_path: Path) -> None:
    (tmp_path / "outside.txt").write_text("secret")
    task_dir = make_task(tmp_path, files=["link.txt"])
    os.symlink(tmp_path / "outside.txt", task_dir / "link.txt")
    message = refusal(task_dir)
    assert "field 'files.0'" in message
    assert "outside the task directory" in message


def test_default_files_refuse_escaping_symlink(tmp_path: Path) -> None:
    (tmp_path / "outside").mkdir()
    task_dir = make_task(tmp_path)
    os.symlink(tmp_path / "outside", task_dir / "linkdir")
    message = refusal(task_dir)
    assert "field 'files'" in message
    assert "'linkdir' escapes" in message


def test_symlink_inside_the_task_is_fine(tmp_path: Path) -> None:
    task_dir = make_task(tmp_path, contents={"real.txt": "x"})
    os.symlink(task_dir / "real.txt", task_dir / "alias.txt")
    assert load_task(task_dir).files == ("alias.txt", "real.txt")


def test_every_problem_is_reported_on_its_own_line(tmp_path: Path) -> None:
    message = refusal(make_task(tmp_path, colour="red", timeouts={"agent_s": 0}, validation=None))
    lines = message.splitlines()
    assert len(lines) == 2, message  # pydantic's pass stops before the semantic checks
    assert any("unknown field 'colour'" in line for line in lines)
    assert any("timeouts.agent_s" in line for line in lines)


def test_terminal_bench_task_maps(tmp_path: Path) -> None:
    task_dir = make_task(
        tmp_path,
        contents={"run-tests.sh": "exit 0\n", "tests/test_outputs.py": "", "solution.sh": "echo answer\n"},
        instruction=None,
        validation=None,
        descriptions=[
            {"key": "base", "description": "Sort the file.\n"},
            {"key": "hard", "description": "x"},
        ],
        author_name="Someone",
        author_email="someone@example.com",
        difficulty="hard",
        category="file-operations",
        tags=["sorting"],
        parser_name="pytest",
        max_agent_timeout_sec=360,
        max_test_timeout_sec=30,
        run_tests_in_same_shell=False,
        disable_asciinema=True,
        estimated_duration_sec=100,
        expert_time_estimate_min=5,
        junior_time_estimate_min=20,
        test_scripts=["setup-uv-pytest.sh", "run-uv-pytest.sh"],
    )
    task = load_task(task_dir)
    assert task.instruction == "Sort the file."
    assert task.agent_timeout_s == 360
    assert task.validation_timeout_s == 30
    assert task.validation == 'TEST_DIR="$PWD/tests" bash run-tests.sh'
    assert task.tags == ("sorting", "difficulty:hard", "category:file-operations")
    assert "solution.sh" not in task.files  # the oracle never reaches the agent
    assert task.files == ("run-tests.sh", "tests/test_outputs.py")


def test_terminal_bench_bad_difficulty(tmp_path: Path) -> None:
    assert "field 'difficulty'" in refusal(make_task(tmp_path, difficulty="impossible"))


def test_instruction_and_descriptions_together(tmp_path: Path) -> None:
    message = refusal(make_task(tmp_path, descriptions=[{"key": "base", "description": "x"}]))
    assert "field 'descriptions'" in message


def test_descriptions_without_base(tmp_path: Path) -> None:
    message = refusal(
        make_task(tmp_path, instruction=None, descriptions=[{"key": "other", "description": "x"}])
    )
    assert "no entry with key 'base'" in message


def test_load_suite_reports_every_bad_task(tmp_path: Path) -> None:
    make_task(tmp_path, name="good")
    bad_a = make_task(tmp_path, name="bad-a", colour="red")
    bad_b = tmp_path / "bad-b"
    bad_b.mkdir()
    with pytest.raises(TaskError) as info:
        load_suite(tmp_path)
    assert f"{bad_a}: unknown field 'colour'" in str(info.value)
    assert f"{bad_b}: missing task.yaml" in str(info.value)


def test_load_suite_sorted_and_skips_plain_files(tmp_path: Path) -> None:
    make_task(tmp_path, name="b")
    make_task(tmp_path, name="a")
    (tmp_path / "README.md").write_text("not a task")
    assert [t.name for t in load_suite(tmp_path)] == ["a", "b"]


def test_load_suite_refuses_empty_and_missing(tmp_path: Path) -> None:
    with pytest.raises(TaskError, match="holds no task directories"):
        load_suite(tmp_path)
    with pytest.raises(TaskError, match="no such directory"):
        load_suite(tmp_path / "nope")


def test_builtin_suite_loads() -> None:
    tasks = load_suite(builtin_suite_path())
    assert len(tasks) >= 8
    for task in tasks:
        assert 3 <= len(task.candidate_actions) <= 6, task.name
        assert task.files, task.name
        for rel in task.files:
            assert (task.root / rel).is_file(), (task.name, rel)
