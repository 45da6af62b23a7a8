"""Build and start the `vllm serve` command line that Corral's RL control routes need.

Invariants: this module never imports vLLM (it only looks for it), so it imports on machines without
vLLM or a GPU. The launched server always has `VLLM_SERVER_DEV_MODE=1` (without it the pause and
weight-transfer routes are not mounted) and the disk weight-transfer backend
(docs/training/weight_transfer/disk.md: `--weight-transfer-config '{"backend": "disk"}'`).
"""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import subprocess
import sys
from collections.abc import Mapping, Sequence

WEIGHT_TRANSFER_CONFIG = json.dumps({"backend": "disk"})
DEV_MODE_ENV = {"VLLM_SERVER_DEV_MODE": "1"}
# vLLM's console script `vllm` is this module's `main`.
VLLM_CLI_MODULE = "vllm.entrypoints.cli.main"

# Flags Corral owns; passing them again in `extra` would make the command line ambiguous.
_OWNED_FLAGS = ("--host", "--port", "--served-model-name", "--weight-transfer-config")


class VLLMNotInstalledError(RuntimeError):
    """Neither a `vllm` executable nor an importable `vllm` package was found."""


def vllm_serve_argv(
    model: str,
    port: int,
    host: str = "127.0.0.1",
    served_model_name: str | None = None,
    extra: Sequence[str] = (),
    executable: Sequence[str] = ("vllm",),
) -> list[str]:
    """The argv of `vllm serve` for Corral; `served_model_name` defaults to `model`.

    `extra` is appended verbatim (e.g. `["--max-model-len", "8192"]`) but may not repeat a flag Corral sets.
    """
    if not 0 < port < 65536:
        raise ValueError(f"port {port} is outside 1..65535")
    for arg in extra:
        flag = arg.split("=", 1)[0]
        if flag in _OWNED_FLAGS:
            raise ValueError(f"extra argument {arg!r} repeats {flag}, which vllm_serve_argv sets itself")
    return [
        *executable,
        "serve",
        model,
        "--host",
        host,
        "--port",
        str(port),
        "--served-model-name",
        served_model_name or model,
        "--weight-transfer-config",
        WEIGHT_TRANSFER_CONFIG,
        *extra,
    ]


def vllm_serve_env(base: Mapping[str, str] | None = None) -> dict[str, str]:
    """`base` (default: this process's environment) with the dev-mode switch the RL routes need."""
    env = dict(os.environ if base is None else base)
    env.update(DEV_MODE_ENV)
    return env


def find_vllm(env: Mapping[str, str] | None = None) -> list[str]:
    """The command prefix that runs vLLM's CLI: the `vllm` executable on PATH, else `python -m ...`."""
    path = (os.environ if env is None else env).get("PATH")
    exe = shutil.which("vllm", path=path)
    if exe is not None:
        return [exe]
    if importlib.util.find_spec("vllm") is not None:
        return [sys.executable, "-m", VLLM_CLI_MODULE]
    raise VLLMNotInstalledError(
        "vLLM is not installed: no `vllm` executable on PATH and no importable `vllm` package. "
        "Install it with `pip install 'corral[vllm]'` on a machine with a supported GPU, "
        "or use the embedded engine."
    )


def launch_vllm(
    model: str,
    port: int,
    host: str = "127.0.0.1",
    served_model_name: str | None = None,
    extra: Sequence[str] = (),
    env: Mapping[str, str] | None = None,
) -> subprocess.Popen[bytes]:
    """Start `vllm serve` as a child process (the caller owns it: wait for /health, terminate it).

    Raises `VLLMNotInstalledError` before starting anything if vLLM cannot be found.
    """
    full_env = vllm_serve_env(env)
    argv = vllm_serve_argv(model, port, host, served_model_name, extra, executable=find_vllm(full_env))
    return subprocess.Popen(argv, env=full_env)
