"""`corral serve` as a user starts it: bad settings refused in one line, and `--demo` serving a run
whose batches show up in GET /api/runs/{id}."""

from __future__ import annotations

import os
from pathlib import Path

import httpx
import pytest
from api_support import free_port, wait_for
from test_serve_restart import corral_serve


@pytest.mark.parametrize(
    ("env", "args", "names"),
    [
        ({"CORRAL_DATABASE_URL": "mysql://x/y"}, [], "CORRAL_DATABASE_URL"),
        ({"CORRAL_PORT": "99999"}, [], "CORRAL_PORT"),
        ({"CORRAL_ACK_TIMEOUT_S": "nan"}, [], "CORRAL_ACK_TIMEOUT_S"),
        ({"CORRAL_OPERATOR_TOKEN": "short"}, [], "CORRAL_OPERATOR_TOKEN"),
        ({}, ["--demo-kind", "gpu"], "--demo-kind"),
        ({}, ["--port", "0"], "--port"),
        # a database that cannot be opened: was the server's 150-line start-up traceback
        (
            {"CORRAL_DATABASE_URL": "postgresql+psycopg://postgres:s3cret@127.0.0.1:1/x"},
            [],
            "postgres:***@127.0.0.1:1/x: cannot open the database: connection failed",
        ),
        (
            {"CORRAL_DATABASE_URL": "postgresql+psycopg://postgres@127.0.0.1:5432/no_such_db"},
            [],
            'database "no_such_db" does not exist',
        ),
        ({"CORRAL_DATABASE_URL": "sqlite:////proc/corral.db"}, [], "cannot open the database"),
        # the password stays hidden in every refusal of a URL, and no driver or URL parser leaks a traceback
        ({"CORRAL_DATABASE_URL": "postgres://u:s3cret@h/db"}, [], "'postgres://u:***@h/db': use sqlite"),
        ({"CORRAL_DATABASE_URL": "postgresql+psycopg2://u:s3cret@127.0.0.1:1/db"}, [], "installed drivers"),
        ({"CORRAL_DATABASE_URL": "postgresql://u:s3cret@127.0.0.1:abc/db"}, [], "not a database URL"),
        ({"CORRAL_DATABASE_URL": "sqlite:///:memory:"}, [], "would lose every run"),
        # a `file:` URI in memory: it used to migrate one connection's database and fail with a traceback
        # ("no such table: runs") on the next, which was empty
        ({"CORRAL_DATABASE_URL": "sqlite:///file:mem?mode=memory&uri=true"}, [], "would lose every run"),
        ({"CORRAL_DATABASE_URL": "sqlite://"}, [], "would lose every run"),
        ({"CORRAL_BROKER_URL": "http://u:s3cret@x"}, [], "CORRAL_BROKER_URL must be redis:// or amqp://"),
        # an empty host would listen on every interface
        ({}, ["--host", ""], "--host: empty"),
        ({}, ["--host", "no-such-host.invalid", "--port", "18602"], "--host no-such-host.invalid"),
    ],
)
def test_bad_settings_are_one_line_and_exit_2(
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
    env: dict[str, str],
    args: list[str],
    names: str,
) -> None:
    from app.cli import main

    monkeypatch.setenv("CORRAL_DATA_DIR", str(tmp_path))
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    monkeypatch.setattr("sys.argv", ["corral", "serve", *args])
    with pytest.raises(SystemExit) as exited:
        main()
    assert exited.value.code == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1, lines
    assert names in lines[0]
    assert "Traceback" not in lines[0]
    assert "s3cret" not in lines[0]
    assert "Value error" not in lines[0]
    assert "CORRAL_BROKER_URL: CORRAL_BROKER_URL" not in lines[0]


@pytest.mark.parametrize("given_by", ["--port", "CORRAL_PORT"])
def test_a_port_in_use_is_refused_before_the_database_and_the_demo_run(tmp_path: Path, given_by: str) -> None:
    """uvicorn found it only after the database was made and the demo run's engines had started. The
    refusal names where the port came from (it said --port for a CORRAL_PORT)."""
    import socket
    import subprocess
    import sys

    database = tmp_path / "corral.db"
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        env = {**os.environ, "CORRAL_DATABASE_URL": f"sqlite:///{database}", "CORRAL_DATA_DIR": str(tmp_path)}
        env.pop("CORRAL_PORT", None)
        flag = ["--port", str(port)] if given_by == "--port" else []
        if given_by == "CORRAL_PORT":
            env["CORRAL_PORT"] = str(port)
        proc = subprocess.run(
            [str(Path(sys.executable).with_name("corral")), "serve", "--demo", *flag],
            env=env,
            capture_output=True,
            text=True,
            timeout=60,
            check=False,
        )
    assert proc.returncode == 2, proc.stderr
    in_use = f"127.0.0.1:{port} is already in use; pick another port"
    assert proc.stderr.strip() == f"error: {given_by} {port}: {in_use}"
    assert not database.exists()


def test_demo_serves_a_run_that_collects_batches(tmp_path: Path) -> None:
    port = free_port()
    env = {
        **os.environ,
        "CORRAL_DATABASE_URL": f"sqlite:///{tmp_path / 'corral.db'}",
        "CORRAL_PORT": str(port),
        "CORRAL_DATA_DIR": str(tmp_path / "data"),
    }
    env.pop("CORRAL_OPERATOR_TOKEN", None)
    log = tmp_path / "serve.log"
    url = f"http://127.0.0.1:{port}"
    with corral_serve(env, log, ["--demo", "--demo-kind", "sim"]) as proc:

        def runs() -> list[dict[str, object]]:
            try:
                return list(httpx.get(f"{url}/api/runs", timeout=5).json())
            except httpx.TransportError:
                return []

        demo = wait_for(runs, 120, what="the demo run")[0]
        batches = wait_for(
            lambda: httpx.get(f"{url}/api/runs/{demo['id']}", timeout=5).json()["live"]["batches"],
            60,
            what="the demo's batches in GET /api/runs/{id}",
        )
        assert batches >= 1
        # The banner pointed a first-time user at JSON (GET /api/runs); it names the run's page.
        page = f"{url}/runs/{demo['id']}"
        wait_for(lambda: f"demo run {demo['id']}" in log.read_text(), 30, what="the demo banner")
        assert f"demo run {demo['id']}: sim, sentinel trainer; open {page}" in log.read_text()
        assert httpx.get(page, timeout=10).status_code == 200
        assert proc.poll() is None
    printed = log.read_text()
    assert f"corral serve: {url}" in printed
    assert "operator token (generated for this process): " in printed
    # A first-time user was not told how to stop it, nor that the demo run goes on until then.
    assert (
        "Ctrl-C stops the server and the runs it executes; the demo run collects batches until then"
        in printed
    )


def test_a_new_sqlite_database_gets_its_directory(tmp_path: Path) -> None:
    from app.cli.common import check_database

    path = tmp_path / "new" / "dir" / "corral.db"
    assert check_database(f"sqlite:///{path}") == f"sqlite:///{path}"
    assert path.stat().st_size > 0  # created and migrated
