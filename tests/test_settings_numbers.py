"""Numeric settings of `corral serve` (CORRAL_ACK_TIMEOUT_S, CORRAL_PORT): a value that is not a finite
number, or below its least real value, is refused in one line naming the variable, exit code 2."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest


def serve(tmp_path: Path, **env: str) -> subprocess.CompletedProcess[str]:
    full = {**os.environ, "CORRAL_DATABASE_URL": f"sqlite:///{tmp_path / 'c.db'}", **env}
    return subprocess.run(
        [sys.executable, "-c", "from app.cli import main; main()", "serve"],
        env=full,
        capture_output=True,
        text=True,
        timeout=60,
    )


@pytest.mark.parametrize(
    ("name", "value", "needle"),
    [
        ("CORRAL_ACK_TIMEOUT_S", "nan", "finite number"),
        ("CORRAL_ACK_TIMEOUT_S", "inf", "finite number"),
        ("CORRAL_ACK_TIMEOUT_S", "-inf", "finite number"),
        # A denormal was taken: every offered batch was offered again at once, forever.
        ("CORRAL_ACK_TIMEOUT_S", "1e-320", "greater than or equal to 0.1"),
        ("CORRAL_ACK_TIMEOUT_S", "0.01", "greater than or equal to 0.1"),
        ("CORRAL_ACK_TIMEOUT_S", "1e9", "less than or equal to 86400"),
        ("CORRAL_PORT", "nan", "integer"),
        ("CORRAL_PORT", "0", "greater than or equal to 1"),
        # The most a run's spill may hold on disk: at least 1 MiB, at most 1 PiB, an integer
        ("CORRAL_SPILL_MAX_BYTES", "0", "greater than or equal to 1048576"),
        ("CORRAL_SPILL_MAX_BYTES", "-5", "greater than or equal to 1048576"),
        ("CORRAL_SPILL_MAX_BYTES", "1e30", "integer"),
        ("CORRAL_SPILL_MAX_BYTES", "1267650600228229401496703205376", "less than or equal to"),
        ("CORRAL_SPILL_MAX_BYTES", "inf", "integer"),
        ("CORRAL_SPILL_MAX_BYTES", "lots", "integer"),
        # The store's waits and its sink's buffer: taken from here, not from module constants
        ("CORRAL_STORE_OUTAGE_S", "nan", "finite number"),
        ("CORRAL_STORE_OUTAGE_S", "0", "greater than 0"),
        ("CORRAL_STORE_OUTAGE_S", "1e9", "less than or equal to 86400"),
        ("CORRAL_SQLITE_BUSY_TIMEOUT_S", "-1", "greater than 0"),
        ("CORRAL_STORE_BUFFER", "0", "greater than or equal to 1"),
        ("CORRAL_STORE_BUFFER", "1e30", "integer"),
        ("CORRAL_SINK_RETRY_MAX_S", "inf", "finite number"),
        # A denormal was taken: a store sink tried its batch again 11,000 times a second (each with a
        # warning) while the database was away.
        ("CORRAL_SINK_RETRY_MAX_S", "1e-300", "greater than or equal to 0.1"),
        ("CORRAL_SINK_RETRY_MAX_S", "0.05", "greater than or equal to 0.1"),
        # The API's wait for a celery run's orchestrator worker to answer a command
        ("CORRAL_COMMAND_TIMEOUT_S", "nan", "finite number"),
        ("CORRAL_COMMAND_TIMEOUT_S", "0", "greater than 0"),
        ("CORRAL_COMMAND_TIMEOUT_S", "1e9", "less than or equal to 600"),
        # How long a celery run no orchestrator worker takes waits before it is ended as failed
        ("CORRAL_START_TIMEOUT_S", "inf", "finite number"),
        ("CORRAL_START_TIMEOUT_S", "-1", "greater than 0"),
        ("CORRAL_START_TIMEOUT_S", "1e9", "less than or equal to 604800"),
        # The most runs one server executes at once: a whole number, 1 to 1,000
        ("CORRAL_MAX_RUNS", "0", "greater than or equal to 1"),
        ("CORRAL_MAX_RUNS", "-3", "greater than or equal to 1"),
        ("CORRAL_MAX_RUNS", "2.5", "integer"),
        # docs/limits.md: a count is a real integer; 2.0 was taken as 2, and a port of 8000.0 as 8000
        ("CORRAL_MAX_RUNS", "2.0", "integer"),
        ("CORRAL_PORT", "8000.0", "integer"),
        ("CORRAL_SPILL_MAX_BYTES", "1048576.0", "integer"),
        ("CORRAL_MAX_RUNS", "nan", "integer"),
        ("CORRAL_MAX_RUNS", "many", "integer"),
        ("CORRAL_MAX_RUNS", "1000000", "less than or equal to 1000"),
    ],
)
def test_a_bad_number_is_refused_in_one_line_naming_the_variable(
    tmp_path: Path, name: str, value: str, needle: str
) -> None:
    proc = serve(tmp_path, **{name: value})
    assert proc.returncode == 2, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1, proc.stderr
    assert lines[0].startswith(f"error: {name}: "), lines[0]
    assert needle in lines[0]
    assert f"'{value}'" in lines[0]
    assert "Traceback" not in proc.stderr


@pytest.mark.parametrize("where", ["a-file", "a-file/spill"])
def test_a_spill_dir_that_cannot_be_written_is_refused_in_one_line(tmp_path: Path, where: str) -> None:
    (tmp_path / "a-file").write_text("")
    proc = serve(tmp_path, CORRAL_SPILL_DIR=str(tmp_path / where))
    assert proc.returncode == 2, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1, proc.stderr
    assert lines[0].startswith("error: CORRAL_SPILL_DIR: "), lines[0]
    assert "is not a directory" in lines[0]


@pytest.mark.parametrize(
    ("name", "where"),
    [
        ("CORRAL_DATA_DIR", "/proc/corral-data"),
        ("CORRAL_DATA_DIR", "{tmp}/a-file/data"),
        ("CORRAL_SPILL_DIR", "/proc/corral-spill"),  # root passed the permission check of it
        ("CORRAL_SPILL_DIR", "/sys/corral-spill"),
    ],
)
def test_a_run_directory_that_cannot_be_written_is_refused_before_the_server_starts(
    tmp_path: Path, name: str, where: str
) -> None:
    """An unwritable CORRAL_DATA_DIR was found only by each run: a local run failed at once (a traceback
    in the log) and a simulated one ran on, keeping no batch for a restart ("store mirror write
    failed"). Now `corral serve` refuses it in one line, before it makes its database."""
    (tmp_path / "a-file").write_text("")
    path = where.format(tmp=tmp_path)
    proc = serve(tmp_path, **{name: path})
    assert proc.returncode == 2, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1, proc.stderr
    assert lines[0].startswith(f"error: {name}: cannot create files in {path}: "), lines[0]
    assert "Traceback" not in proc.stderr
    assert not (tmp_path / "c.db").exists()
