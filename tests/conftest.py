"""Shared test set-up. Pytest puts this folder on sys.path, so tests import `factories` from it."""

from __future__ import annotations

import gc
import multiprocessing
import shutil
import signal
import sys
import tempfile
import warnings
from collections.abc import Iterator
from pathlib import Path

import pytest
from redis_server import Redis, free_port

# The tests send real stop signals to the processes they start (`corral run`, `corral serve`, engines).
# A process inherits the signals its parent ignores, and a shell ignores SIGINT and SIGQUIT for a job it
# starts in the background (`make test &`, as a script does), so each process a test started from such
# a pytest began with them ignored, unlike a user's. Put back, they are what a terminal gives, and
# pytest's own handling of Ctrl-C comes back too.
for _sig, _default in ((signal.SIGINT, signal.default_int_handler), (signal.SIGHUP, signal.SIG_DFL),
                       (signal.SIGQUIT, signal.SIG_DFL)):  # fmt: skip
    if signal.getsignal(_sig) == signal.SIG_IGN:
        signal.signal(_sig, _default)


@pytest.fixture
def base_dir() -> Iterator[Path]:
    """A directory for local sandboxes, under /tmp rather than tmp_path: sandbox uids must be able to
    reach their work directories (o+x on every parent, which pytest's tmp_path parents lack)."""
    path = Path(tempfile.mkdtemp(prefix="corral-sb-", dir="/tmp"))
    path.chmod(0o711)
    yield path
    shutil.rmtree(path, ignore_errors=True)


@pytest.fixture
def task_root(tmp_path: Path) -> Path:
    """A task's files: `greeting.txt` and `lib/helper.sh` (what `factories.make_echo_task` copies)."""
    root = tmp_path / "task"
    (root / "lib").mkdir(parents=True)
    (root / "greeting.txt").write_text("hello world\n")
    (root / "lib" / "helper.sh").write_text("echo helper\n")
    return root


# The test-private redis-servers, each left running from its test's end to the session's
_LEFT_RUNNING: list[Redis] = []


@pytest.fixture
def redis(tmp_path: Path) -> Iterator[Redis]:
    """A `redis-server` of the test's own (redis_server.py), answering from the test's start to the end of
    the session, then stopped."""
    if shutil.which("redis-server") is None:
        pytest.skip("no redis-server on PATH (Debian's redis-server package)")
    server = Redis(free_port(), tmp_path)
    server.start()
    try:
        yield server
    finally:
        # Celery's AsyncResults that the test left behind unsubscribe from this Redis when they are
        # collected, in whatever test that happens. Collected once the server was stopped, each retried
        # it for 20 s and failed that test with an "Exception ignored in AsyncResult.__del__" (CI failed
        # tests/workers/test_docker_sandboxes.py that way twice, after test_broker_restart.py, the second
        # time although this fixture collected the test's garbage before it stopped the server: the
        # test's event loop, torn down after this fixture, still held some). So the server is left
        # answering (started again if the test left it stopped) until the session ends.
        # (Sockets a client left unclosed are collected with them; their ResourceWarnings, which this
        # suite's warning filter makes errors, are for the test of the client, not this fixture.)
        if server.proc is None or server.proc.poll() is not None:
            server.start()
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", ResourceWarning)
            gc.collect()
        _LEFT_RUNNING.append(server)


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    while _LEFT_RUNNING:
        _LEFT_RUNNING.pop().stop()
    # A multiprocessing child a test left running would hold pytest's exit for good (Python joins them
    # at exit): CI's run of 81040e2 printed its summary and then waited until the job's limit, behind a
    # forked child that hung. Such a child is killed and the session fails, naming it.
    left = multiprocessing.active_children()
    for child in left:
        child.kill()
        child.join(10)
    if left:
        names = ", ".join(f"{child.name} (pid {child.pid})" for child in left)
        print(f"\nthe tests left {len(left)} child process(es) running, killed: {names}", file=sys.stderr)
        session.exitstatus = pytest.ExitCode.TESTS_FAILED
