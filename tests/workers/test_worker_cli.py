"""`corral worker` refuses bad input in one line naming the flag or variable, exit code 2, before any
Celery worker starts."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

REDIS = "redis://127.0.0.1:6379/0"
GOOD = ["worker", "--lane", "exec", "--cpus", "1"]

CASES: dict[str, tuple[list[str], dict[str, str | None], str]] = {
    "no broker": (GOOD, {"CORRAL_BROKER_URL": None}, "CORRAL_BROKER_URL is not set"),
    "http broker": (GOOD, {"CORRAL_BROKER_URL": "http://x"}, "CORRAL_BROKER_URL must be"),
    "amqp without a backend": (
        GOOD,
        {"CORRAL_BROKER_URL": "amqp://guest:guest@127.0.0.1:5672//"},
        "CORRAL_RESULT_BACKEND is not set",
    ),
    "rpc backend": (GOOD, {"CORRAL_RESULT_BACKEND": "rpc://"}, "CORRAL_RESULT_BACKEND must be"),
    "empty cpus": (["worker", "--lane", "exec", "--cpus", ""], {}, "--cpus"),
    "word cpus": (["worker", "--lane", "exec", "--cpus", "two"], {}, "--cpus"),
    "backwards cpus": (["worker", "--lane", "exec", "--cpus", "1-0"], {}, "--cpus"),
    "cpu not here": (["worker", "--lane", "exec", "--cpus", "4095"], {}, "--cpus: CPUs 4095"),
    "unknown lane": (["worker", "--lane", "exek", "--cpus", "1"], {}, "--lane"),
    "no cpus": (["worker", "--lane", "exec"], {}, "--lane and --cpus are required"),
    "bad host": ([*GOOD, "--host", "a b!"], {}, "--host"),
    "zero concurrency": ([*GOOD, "--concurrency", "0"], {}, "--concurrency"),
    "huge concurrency": ([*GOOD, "--concurrency", "100000"], {}, "--concurrency"),
    "nan concurrency": ([*GOOD, "--concurrency", "nan"], {}, "--concurrency"),
    "bad isolation": ([*GOOD, "--isolation", "chroot"], {}, "--isolation"),
    "bad loglevel": ([*GOOD, "--loglevel", "loud"], {}, "--loglevel"),
    "orchestrator with a lane": (["worker", "--orchestrator", "--lane", "exec"], {}, "--orchestrator"),
    "entry without a colon": (["worker", "--orchestrator", "--entry", "runner"], {}, "--entry"),
    "entry for a lane worker": ([*GOOD, "--entry", "a:b"], {}, "--entry: only with --orchestrator"),
    "blank docker image": ([*GOOD, "--docker-image", " "], {}, "--docker-image"),
    # found only by each run the worker took (a local run failed with a traceback in the log)
    "orchestrator with an unwritable data dir": (
        ["worker", "--orchestrator"],
        {"CORRAL_DATA_DIR": "/proc/corral-data"},
        "CORRAL_DATA_DIR: cannot create files in /proc/corral-data",
    ),
    "unwritable state dir": (
        [*GOOD, "--docker-image", "img", "--state-dir", "/proc/corral-state"],
        {},
        "--state-dir: /proc/corral-state",
    ),
}


@pytest.mark.parametrize("name", list(CASES))
def test_bad_worker_input_is_refused_in_one_line(
    name: str, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    from app.cli import main

    args, env, needle = CASES[name]
    monkeypatch.setenv("CORRAL_BROKER_URL", REDIS)
    monkeypatch.delenv("CORRAL_RESULT_BACKEND", raising=False)
    for key, value in env.items():
        if value is None:
            monkeypatch.delenv(key, raising=False)
        else:
            monkeypatch.setenv(key, value)
    monkeypatch.setattr(sys, "argv", ["corral", *args])
    with pytest.raises(SystemExit) as exited:
        main()
    out = capsys.readouterr()
    lines = [line for line in out.err.splitlines() if line.strip()]
    assert exited.value.code == 2, out.err
    assert "Traceback" not in out.out + out.err
    assert len(lines) == 1, out.err
    assert lines[0].startswith("error: "), out.err
    assert needle in lines[0], out.err


@pytest.mark.parametrize(
    ("args", "env", "needle"),
    [
        (GOOD, {"CORRAL_BROKER_URL": "redis://127.0.0.1:1/0"}, "CORRAL_BROKER_URL redis://127.0.0.1:1/0"),
        (
            GOOD,
            {"CORRAL_BROKER_URL": "amqp://guest:secret@127.0.0.1:1//", "CORRAL_RESULT_BACKEND": REDIS},
            "CORRAL_BROKER_URL amqp://guest:***@127.0.0.1:1//",
        ),
        (
            GOOD,
            {"CORRAL_RESULT_BACKEND": "redis://127.0.0.1:1/0"},
            "CORRAL_RESULT_BACKEND redis://127.0.0.1:1/0",
        ),
        (
            ["worker", "--orchestrator"],
            {"CORRAL_BROKER_URL": "redis://127.0.0.1:1/0"},
            "CORRAL_BROKER_URL redis://127.0.0.1:1/0",
        ),
    ],
    ids=["redis broker", "amqp broker", "redis backend", "orchestrator"],
)
def test_an_unreachable_broker_is_refused_at_once_in_one_line(
    args: list[str], env: dict[str, str], needle: str, tmp_path: Path
) -> None:
    """Celery retried an unreachable broker 100 times over many minutes, several warning lines a try.
    The worker now tries once, for a few seconds, and refuses in one line, exit code 2."""
    full = {k: v for k, v in os.environ.items() if k not in ("CORRAL_RESULT_BACKEND",)}
    full.update({"CORRAL_BROKER_URL": REDIS, "CORRAL_DATABASE_URL": f"sqlite:///{tmp_path / 'c.db'}", **env})
    started = time.monotonic()
    proc = subprocess.run(
        [sys.executable, "-c", "from app.cli import main; main()", *args],
        env=full,
        capture_output=True,
        text=True,
        timeout=60,
        cwd=tmp_path,
    )
    assert proc.returncode == 2, proc.stderr
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert len(lines) == 1, proc.stderr
    assert lines[0].startswith(f"error: {needle}: cannot connect ("), lines[0]
    assert "secret" not in proc.stdout + proc.stderr
    assert time.monotonic() - started < 30
    assert not (tmp_path / "c.db").exists()  # the orchestrator's refusal made the database first
