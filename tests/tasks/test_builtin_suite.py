"""Every built-in task is solvable by one of its candidates and not by another, for real.

Each case copies the task's files into a fresh temp dir, runs the set-up, one candidate and the
validation with subprocess, as a sandbox would, without one.
"""

from __future__ import annotations

import os
import random
import shutil
import subprocess
from pathlib import Path

import pytest

from app.tasks.loader import builtin_suite_path, load_suite, load_task
from app.tasks.spec import TaskSpec

# task -> (a candidate that solves it, a candidate that does not)
CASES: dict[str, tuple[int, int]] = {
    "checksum-files": (0, 2),
    "count-primes": (0, 1),
    "fix-off-by-one": (0, 1),
    "flaky-greeting": (0, 1),
    "gzip-max-compression": (0, 1),
    "json-transform": (0, 1),
    "patch-config-sed": (0, 1),
    "slow-setup-dataset": (1, 2),
    "sort-uniq-log": (0, 1),
    "sqlite-top-customer": (0, 2),
}
SLOW = {"count-primes", "gzip-max-compression", "slow-setup-dataset"}
# The flaky task's validation is forced to pass when the content is right, so the test is stable.
ENV = {**os.environ, "CORRAL_FLAKY_P": "0"}


def run(command: str, cwd: Path, timeout_s: float) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        ["bash", "-c", command],
        cwd=cwd,
        env=ENV,
        capture_output=True,
        text=True,
        timeout=timeout_s,
        check=False,
    )


def prepare(task: TaskSpec, workdir: Path) -> None:
    for rel in task.files:
        (workdir / rel).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(task.root / rel, workdir / rel)
    if task.setup:
        done = run(task.setup, workdir, task.setup_timeout_s)
        assert done.returncode == 0, f"{task.name} set-up failed: {done.stdout}{done.stderr}"


def test_cases_cover_the_suite() -> None:
    assert {t.name for t in load_suite(builtin_suite_path())} == set(CASES)


@pytest.mark.parametrize(
    "name", [pytest.param(n, marks=pytest.mark.slow) if n in SLOW else n for n in sorted(CASES)]
)
def test_solving_and_non_solving_candidates(name: str, tmp_path: Path) -> None:
    task = load_task(builtin_suite_path() / name)
    solving, failing = CASES[name]
    prepare(task, tmp_path / "base")
    for index, want_pass in [(solving, True), (failing, False)]:
        workdir = tmp_path / f"cand{index}"
        shutil.copytree(tmp_path / "base", workdir)
        action = run(task.candidate_actions[index], workdir, task.agent_timeout_s)
        check = run(task.validation, workdir, task.validation_timeout_s)
        detail = f"{name} candidate {index}: {action.stderr}{check.stdout}{check.stderr}"
        assert (check.returncode == 0) is want_pass, detail


def test_flaky_validation_fails_about_30_percent_even_when_correct(tmp_path: Path) -> None:
    task = load_task(builtin_suite_path() / "flaky-greeting")
    prepare(task, tmp_path)
    assert run(task.candidate_actions[0], tmp_path, 10).returncode == 0
    seeds = range(20)
    failed = set()
    for seed in seeds:
        env = {**os.environ, "CORRAL_FLAKY_SEED": str(seed)}
        done = subprocess.run(
            ["bash", "-c", task.validation],
            cwd=tmp_path,
            env=env,
            capture_output=True,
            text=True,
            check=False,
        )
        if done.returncode != 0:
            assert "transient failure" in done.stderr
            failed.add(seed)
    assert failed == {s for s in seeds if random.Random(s).random() < 0.3}
    assert 1 <= len(failed) <= 12
