"""The built-in (sentinel) trainer of a local run writes a weights directory for each version it
publishes; it removes those no engine can be asked to load again. Before, it kept every one: the demo,
left running, wrote about 8,500 directories a day (docs/limits.md, the soak audit)."""

from __future__ import annotations

from pathlib import Path

import pytest
from api_support import free_port, serve_env, serve_process, wait_for
from factories import make_local_config

from app.service.handle import prune_sentinel_weights


def test_only_versions_below_the_floor_are_removed(tmp_path: Path) -> None:
    for name in ("v0", "v1", "v2", "v3", "v10", "vx", "other"):
        (tmp_path / name).mkdir()
    (tmp_path / "v1" / "model.safetensors").write_bytes(b"x")
    (tmp_path / "v9").write_text("a file, not a version directory")
    assert prune_sentinel_weights(tmp_path, 3) == 3
    assert sorted(p.name for p in tmp_path.iterdir()) == ["other", "v10", "v3", "v9", "vx"]


@pytest.mark.slow
def test_a_local_runs_sentinel_trainer_keeps_only_the_weights_its_engines_may_load(tmp_path: Path) -> None:
    env = serve_env(tmp_path, f"sqlite:///{tmp_path / 'corral.db'}", free_port())
    log = tmp_path / "serve.log"
    with serve_process(env, log) as api:
        spec = {"name": "local", "kind": "local", "config": make_local_config(), "trainer": "sentinel",
                "sentinel_step_s": 0.1}  # fmt: skip
        run_id = api.post("/api/runs", json=spec).json()["id"]

        def versions() -> int:
            return int(api.get(f"/api/runs/{run_id}").json()["live"].get("trainer_version", 0))

        wait_for(lambda: versions() >= 6, 280, what=f"6 versions published; log {log}")
        weights = tmp_path / "data" / run_id / "weights"
        newest = versions()
        kept = sorted(int(p.name[1:]) for p in weights.iterdir() if p.name[1:].isdigit())
        assert kept  # the newest is kept: a restarted engine loads it
        assert max(kept) >= newest
        assert len(kept) <= 3  # one engine: the version it serves, the newest, and one being written
        assert api.post(f"/api/runs/{run_id}/stop").status_code == 200
        wait_for(lambda: api.get(f"/api/runs/{run_id}").json()["state"] == "stopped", 120, what="the stop")
    assert "Traceback" not in log.read_text()
