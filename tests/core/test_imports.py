"""The core and the simulator import nothing heavy: no torch, vLLM, database, broker or web stack."""

from __future__ import annotations

import subprocess
import sys

HEAVY = ["torch", "vllm", "sqlalchemy", "celery", "docker", "fastapi", "uvicorn", "matplotlib", "httpx"]


def test_core_and_sim_import_without_heavy_dependencies() -> None:
    code = (
        "import sys\n"
        "import app.core.scheduler, app.core.rollout, app.core.router, app.core.config\n"
        "import app.sim.run, app.sim.bench, app.sim.workload, app.sim.clock, app.sim.cpu\n"
        f"loaded = sorted(m for m in {HEAVY!r} if m in sys.modules)\n"
        "print(','.join(loaded))\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == ""
