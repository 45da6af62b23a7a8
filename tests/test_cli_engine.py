"""`corral engine`: the embedded engine for real, and the vLLM backend's refusal where vLLM is absent."""

from __future__ import annotations

import importlib.util
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

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
