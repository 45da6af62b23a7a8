"""`corral serve` killed with SIGKILL while a local run has sandboxes: the next `corral serve` removes
what the dead one left (work directories, pids cgroups) before it serves, and says so in its log
(app/sandboxes/leftovers.py)."""

from __future__ import annotations

import json
import os
import signal
from pathlib import Path

import httpx
import pytest
from api_support import TOKEN, free_port, wait_for
from factories import make_local_config
from test_serve_restart import _healthy, corral_serve

from app.sandboxes.cpuset import CGROUP_ROOT
from app.sandboxes.limits import pids_parent


def marked(registration: Path) -> list[Path]:
    """The sandbox markers of the process registered in `registration`."""
    if not registration.exists():
        return []
    roots = json.loads(registration.read_text())["roots"]
    return [m for root in roots for m in (Path(root) / ".corral-owners").glob("*")]


def work_dirs(registration: Path) -> list[Path]:
    """The sandbox work directories under the roots registered in `registration`. A marker is
    written before its work directory, so a marker alone does not mean there is one yet."""
    if not marked(registration):
        return []
    roots = json.loads(registration.read_text())["roots"]
    return [p for root in roots for p in Path(root).iterdir() if not p.name.startswith(".")]


@pytest.mark.slow
def test_what_a_killed_corral_serve_left_is_removed_by_the_next_start(
    tmp_path: Path, backend_url: str
) -> None:
    if backend_url.startswith("postgresql"):
        pytest.skip("one backend is enough for the real engines and sandboxes")
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    owners = tmp_path / "owners"
    env = {
        **os.environ,
        "CORRAL_DATABASE_URL": backend_url,
        "CORRAL_OPERATOR_TOKEN": TOKEN,
        "CORRAL_PORT": str(port),
        "CORRAL_DATA_DIR": str(tmp_path / "data"),
        "CORRAL_OWNERS_DIR": str(owners),
    }
    log = tmp_path / "serve.log"
    api = httpx.Client(base_url=url, headers={"Authorization": f"Bearer {TOKEN}"}, timeout=30)
    spec = {"name": "local", "kind": "local", "config": make_local_config(), "batches": 50}
    with api, corral_serve(env, log) as first:
        wait_for(lambda: _healthy(url), 120, what=f"corral serve to start; log: {log}")
        assert api.post("/api/runs", json=spec).status_code < 300
        registration = owners / f"{first.pid}.json"
        wait_for(lambda: work_dirs(registration), 240, what=f"sandboxes of the local run; log: {log}")
        roots = [Path(r) for r in json.loads(registration.read_text())["roots"]]
        first.send_signal(signal.SIGKILL)
        assert first.wait(10) == -signal.SIGKILL
    left = [p for root in roots for p in root.iterdir() if not p.name.startswith(".")]
    assert left, "no sandbox left behind to remove"

    with corral_serve(env, log) as second:
        wait_for(lambda: _healthy(url), 120, what="corral serve to restart")
        text = log.read_text()
        second.send_signal(signal.SIGTERM)
        assert second.wait(60) in (0, -signal.SIGTERM), log.read_text()[-2000:]
    assert f"removed what dead corral process {first.pid} left behind" in text, text[-2000:]
    assert [p for p in left if p.exists()] == []
    parent = pids_parent(CGROUP_ROOT)
    if parent is not None:
        assert [g.name for g in parent[0].iterdir() if g.name.endswith(f"-{first.pid}")] == []
