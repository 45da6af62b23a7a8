"""`corral engine`: the embedded engine for real, and the vLLM backend's refusal where vLLM is absent."""

from __future__ import annotations

import importlib.util
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest
from proc_children import reaped

from app.sandboxes.cpuset import read_cpus_allowed

CORRAL = [sys.executable, "-c", "from app.cli import main; main()"]


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def corral(*args: str, timeout: float = 60) -> subprocess.CompletedProcess[str]:
    return subprocess.run([*CORRAL, *args], capture_output=True, text=True, timeout=timeout)


def test_embedded_engine_serves_pinned_to_its_cpus(tmp_path: Path) -> None:
    port = free_port()
    log = (tmp_path / "engine.log").open("w")
    proc = subprocess.Popen([*CORRAL, "engine", "--port", str(port), "--cpus", "0"], stdout=log, stderr=log)
    try:
        deadline = time.monotonic() + 60
        while True:
            assert proc.poll() is None, (tmp_path / "engine.log").read_text()
            try:
                if httpx.get(f"http://127.0.0.1:{port}/health", timeout=1).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            assert time.monotonic() < deadline, "engine did not become healthy"
            time.sleep(0.2)
        assert read_cpus_allowed(proc.pid) == (0,)
        answer = httpx.post(
            f"http://127.0.0.1:{port}/v1/completions",
            json={"model": "corral-embedded", "prompt": "ls", "max_tokens": 4},
            timeout=30,
        ).json()
        assert answer["usage"]["completion_tokens"] == 4
    finally:
        proc.terminate()
        proc.wait(timeout=20)
        log.close()
    assert f"serving on http://127.0.0.1:{port}" in (tmp_path / "engine.log").read_text()


def test_bad_cpu_list_is_refused_without_traceback() -> None:
    proc = corral("engine", "--port", str(free_port()), "--cpus", "0-x")
    assert proc.returncode == 2
    assert proc.stderr.startswith("error: corral engine: --cpus:")
    assert "Traceback" not in proc.stderr


@pytest.mark.skipif(
    shutil.which("vllm") is not None or importlib.util.find_spec("vllm") is not None,
    reason="vLLM is installed here, so the backend would really start",
)
def test_vllm_backend_needs_vllm_installed_and_says_so() -> None:
    proc = corral("engine", "--backend", "vllm", "--model", "Qwen/Qwen2.5-0.5B", "--port", "8000")
    assert proc.returncode == 2
    assert "vLLM is not installed" in proc.stderr
    assert "pip install 'corral[vllm]'" in proc.stderr
    assert "Traceback" not in proc.stderr


def test_vllm_backend_needs_a_model_and_unknown_backends_are_refused() -> None:
    proc = corral("engine", "--backend", "vllm")
    assert proc.returncode == 2
    assert "--model" in proc.stderr
    proc = corral("engine", "--backend", "sglang-ish")
    assert proc.returncode == 2
    assert "--backend" in proc.stderr


def wait_healthy(proc: subprocess.Popen[str], port: int) -> None:
    deadline = time.monotonic() + 60
    while True:
        assert proc.poll() is None, proc.communicate()
        try:
            if httpx.get(f"http://127.0.0.1:{port}/health", timeout=1).status_code == 200:
                return
        except httpx.TransportError:
            pass
        assert time.monotonic() < deadline, "engine did not become healthy"
        time.sleep(0.2)


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT, signal.SIGHUP], ids=["TERM", "INT", "HUP"])
def test_a_stop_signal_stops_the_embedded_engine_with_one_line(sig: signal.Signals) -> None:
    """SIGTERM (a supervisor, `kill PID`) killed `corral engine` by the signal: exit -15 and no word.
    Every stop signal now shuts the server down as Ctrl-C does, says so in one line, exit 0."""
    port = free_port()
    proc = subprocess.Popen(
        [*CORRAL, "engine", "--port", str(port)], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )
    try:
        wait_healthy(proc, port)
        proc.send_signal(sig)
        out, err = proc.communicate(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 0, (out, err)
    assert out.splitlines()[-1] == f"corral engine: stopped; no longer serving on http://127.0.0.1:{port}"
    assert "Traceback" not in err
    with pytest.raises(httpx.TransportError):
        httpx.get(f"http://127.0.0.1:{port}/health", timeout=1)


@pytest.mark.parametrize("gap_s", [0.0, 0.05, 0.3])
def test_ctrl_c_twice_to_the_embedded_engine_stops_it_as_once_does(gap_s: float) -> None:
    """Two Ctrl-Cs to the process group: uvicorn raised each captured signal again after its shutdown
    and took the second as "force quit", so `corral engine` printed a KeyboardInterrupt and a lifespan
    CancelledError traceback below its "stopped" line (3 of 4 double presses), or died by the signal
    (-2) when the second came as it exited. Now: the same line, exit 0, every time."""
    port = free_port()
    proc = subprocess.Popen(
        [*CORRAL, "engine", "--port", str(port)],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True,
    )  # fmt: skip
    with reaped(proc):
        wait_healthy(proc, port)
        os.killpg(proc.pid, signal.SIGINT)  # as a terminal does: the whole process group
        time.sleep(gap_s)
        os.killpg(proc.pid, signal.SIGINT)
        out, err = proc.communicate(timeout=30)
    assert proc.returncode == 0, (out, err)
    assert out.splitlines()[-1] == f"corral engine: stopped; no longer serving on http://127.0.0.1:{port}"
    assert "Traceback" not in err, err


FAKE_VLLM = """#!{python}
import os, signal, sys, time
open({pidfile!r}, "w").write(str(os.getpid()))
signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
while True:
    time.sleep(0.1)
"""


def test_sigterm_stops_vllm_serve_with_the_engine_command(tmp_path: Path) -> None:
    """`corral engine --backend vllm` died by SIGTERM and left `vllm serve` running, orphaned, on its
    GPU. It now stops vLLM (SIGTERM, then SIGKILL after a grace), says so in one line, exit 0."""
    pidfile = tmp_path / "vllm.pid"
    fake = tmp_path / "vllm"
    fake.write_text(FAKE_VLLM.format(python=sys.executable, pidfile=str(pidfile)))
    fake.chmod(0o755)
    env = {**os.environ, "PATH": f"{tmp_path}{os.pathsep}{os.environ['PATH']}"}
    port = str(free_port())
    proc = subprocess.Popen(
        [*CORRAL, "engine", "--backend", "vllm", "--model", "m", "--port", port],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
    )
    vllm_pid = None
    try:
        deadline = time.monotonic() + 60
        while not pidfile.exists() or not pidfile.read_text():
            assert proc.poll() is None, proc.communicate()
            assert time.monotonic() < deadline, "the fake vllm did not start"
            time.sleep(0.1)
        vllm_pid = int(pidfile.read_text())
        proc.send_signal(signal.SIGTERM)
        out, err = proc.communicate(timeout=60)
        assert proc.returncode == 0, (out, err)
        assert out.splitlines()[-1] == "corral engine: stopped vllm serve m (its exit status 0)"
        assert "Traceback" not in err
        assert not Path(f"/proc/{vllm_pid}").exists(), "vllm serve was left running"
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        if vllm_pid is not None and Path(f"/proc/{vllm_pid}").exists():
            os.kill(vllm_pid, signal.SIGKILL)
