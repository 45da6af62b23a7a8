"""`PROMETHEUS_MULTIPROC_DIR` at a start of `corral serve`: the previous run's `*.db` files are removed
before any metric is built, so its counters start from zero; but not while another process (an
orchestrator worker going on) holds the directory. Real `corral serve` processes."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import httpx
from api_support import free_port, serve_env, wait_for
from prometheus_client.parser import text_string_to_metric_families

WRITER = """
import sys
from app.metrics import CorralMetrics
m = CorralMetrics()
m.discarded_groups.labels("r1", "stale").inc(7)
m.batches.labels("r1").inc(3)
print("written", flush=True)
sys.stdin.read()  # holds the directory until its stdin closes
"""


def _writer(prom_dir: Path, *, stay: bool) -> subprocess.Popen[str]:
    """A process that counts for run r1 in `prom_dir`: exited at once (a previous run's), or going on."""
    env = {**os.environ, "PROMETHEUS_MULTIPROC_DIR": str(prom_dir)}
    proc = subprocess.Popen(
        [sys.executable, "-c", WRITER], env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    )
    assert proc.stdout is not None
    assert proc.stdout.readline().strip() == "written"
    if not stay:
        proc.communicate(timeout=60)
    return proc


@contextmanager
def _serve(tmp_path: Path, prom_dir: Path) -> Iterator[str]:
    port = free_port()
    outside = {k: v for k, v in os.environ.items() if not k.startswith("CORRAL_")}
    env = serve_env(tmp_path, f"sqlite:///{tmp_path / 'corral.db'}", port, base=outside)
    env["PROMETHEUS_MULTIPROC_DIR"] = str(prom_dir)
    url = f"http://127.0.0.1:{port}"
    with (tmp_path / "serve.log").open("ab") as log:
        proc = subprocess.Popen(
            [sys.executable, "-c", "from app.cli import main; main()", "serve"],
            env=env, stdout=log, stderr=subprocess.STDOUT,
        )  # fmt: skip

    def up() -> bool:
        try:
            return httpx.get(f"{url}/healthz", timeout=2).status_code == 200
        except httpx.TransportError:
            return False

    try:
        wait_for(up, 120, what=f"corral serve to start; log {tmp_path / 'serve.log'}")
        yield url
    finally:
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(60) in (0, -signal.SIGTERM)


def _r1(url: str) -> dict[str, float]:
    text = httpx.get(f"{url}/metrics", timeout=10).text
    return {
        s.name: s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
        if s.labels.get("run") == "r1"
    }


def test_serve_empties_the_previous_runs_metric_files_at_start(tmp_path: Path) -> None:
    prom_dir = tmp_path / "prometheus"
    prom_dir.mkdir()
    writer = _writer(prom_dir, stay=False)  # the previous run of the control plane, gone
    stale = sorted(p.name for p in prom_dir.glob(f"*_{writer.pid}.db"))
    assert stale
    with _serve(tmp_path, prom_dir) as url:
        assert not [name for name in stale if (prom_dir / name).exists()]
        assert _r1(url) == {}  # its counters start from zero, not from 7 and 3
    log = (tmp_path / "serve.log").read_text()
    assert f"metrics: emptied {prom_dir} ({len(stale)} files of the previous run)" in log


def test_serve_leaves_the_metric_files_of_a_process_that_goes_on(tmp_path: Path) -> None:
    prom_dir = tmp_path / "prometheus"
    prom_dir.mkdir()
    writer = _writer(prom_dir, stay=True)  # an orchestrator worker still running: it holds the directory
    try:
        with _serve(tmp_path, prom_dir) as url:
            assert _r1(url)["corral_discarded_groups_total"] == 7
            assert _r1(url)["corral_batches_delivered_total"] == 3
        assert "left as is (other processes write there" in (tmp_path / "serve.log").read_text()
    finally:
        writer.communicate(timeout=60)
