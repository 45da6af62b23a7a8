"""Argument tests for `vllm serve` launching; a fake `vllm` script stands in for the real CLI."""

from __future__ import annotations

import json
import os
import stat
import sys
from pathlib import Path

import pytest

from app.engines.vllm_launch import (
    VLLMNotInstalledError,
    find_vllm,
    launch_vllm,
    vllm_serve_argv,
    vllm_serve_env,
)


def test_argv_has_rl_flags_and_served_name() -> None:
    argv = vllm_serve_argv(
        "Qwen/Qwen3-0.6B", 8001, served_model_name="policy", extra=["--max-model-len", "4096"]
    )
    assert argv[:3] == ["vllm", "serve", "Qwen/Qwen3-0.6B"]
    assert argv[argv.index("--port") + 1] == "8001"
    assert argv[argv.index("--host") + 1] == "127.0.0.1"
    assert argv[argv.index("--served-model-name") + 1] == "policy"
    assert json.loads(argv[argv.index("--weight-transfer-config") + 1]) == {"backend": "disk"}
    assert argv[-2:] == ["--max-model-len", "4096"]


def test_served_name_defaults_to_model() -> None:
    argv = vllm_serve_argv("m", 8000)
    assert argv[argv.index("--served-model-name") + 1] == "m"


@pytest.mark.parametrize(
    "extra", [["--port", "9"], ["--weight-transfer-config={}"], ["--served-model-name", "x"]]
)
def test_extra_may_not_repeat_owned_flags(extra: list[str]) -> None:
    with pytest.raises(ValueError, match="repeats"):
        vllm_serve_argv("m", 8000, extra=extra)


def test_port_out_of_range() -> None:
    with pytest.raises(ValueError, match="port 0"):
        vllm_serve_argv("m", 0)


def test_env_sets_dev_mode_and_keeps_base() -> None:
    env = vllm_serve_env({"PATH": "/bin", "VLLM_SERVER_DEV_MODE": "0"})
    assert env == {"PATH": "/bin", "VLLM_SERVER_DEV_MODE": "1"}


def test_missing_vllm_raises_clear_error(tmp_path: Path) -> None:
    try:
        import vllm  # noqa: F401
    except ImportError:
        pass
    else:
        pytest.skip("vLLM is installed here")
    with pytest.raises(VLLMNotInstalledError, match="vLLM is not installed"):
        find_vllm({"PATH": str(tmp_path)})
    with pytest.raises(VLLMNotInstalledError):
        launch_vllm("m", 8000, env={"PATH": str(tmp_path)})


def test_launch_runs_found_executable_with_dev_mode(tmp_path: Path) -> None:
    out = tmp_path / "out.json"
    fake = tmp_path / "vllm"
    fake.write_text(
        f"#!{sys.executable}\n"
        "import json, os, sys\n"
        "seen = {'argv': sys.argv[1:], 'dev': os.environ.get('VLLM_SERVER_DEV_MODE')}\n"
        f"json.dump(seen, open({str(out)!r}, 'w'))\n"
    )
    fake.chmod(fake.stat().st_mode | stat.S_IXUSR)
    proc = launch_vllm("m", 8123, served_model_name="policy", env={"PATH": f"{tmp_path}{os.pathsep}/usr/bin"})
    assert proc.wait(timeout=30) == 0
    seen = json.loads(out.read_text())
    assert seen["dev"] == "1"
    assert seen["argv"] == vllm_serve_argv("m", 8123, served_model_name="policy")[1:]
