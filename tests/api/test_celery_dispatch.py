"""A run created with `"orchestrator": "celery"` while the broker does not answer: a 503 with one line
and a Retry-After, and the run stored as failed, saying why. Before: a 500 after about 20 s (Celery's
result consumer gave up on the result backend), and the run stayed `created` for ever, never sent to a
worker. A real `corral serve` process, its broker a loopback port nothing listens on."""

from __future__ import annotations

from pathlib import Path

import httpx
from api_support import TOKEN, free_port, make_run, serve_env, wait_for
from test_serve_restart import corral_serve


def test_a_celery_run_created_while_the_broker_is_away_is_refused_and_stored_failed(tmp_path: Path) -> None:
    db = f"sqlite:///{tmp_path / 'corral.db'}"
    port = free_port()
    away = f"redis://127.0.0.1:{free_port()}/0"  # bound and let go: nothing listens there
    env = {**serve_env(tmp_path, db, port), "CORRAL_BROKER_URL": away, "CORRAL_LANE_HOSTS": "h1"}
    log = tmp_path / "serve.log"
    url = f"http://127.0.0.1:{port}"
    with corral_serve(env, log):
        wait_for(lambda: _answers(url), 120, what=f"corral serve to answer; log {log}")
        api = httpx.Client(base_url=url, headers={"Authorization": f"Bearer {TOKEN}"}, timeout=120)
        created = api.post("/api/runs", json=make_run(trainer="sentinel", orchestrator="celery"))
        assert created.status_code == 503, created.text
        assert created.headers["Retry-After"] == "5"
        detail = created.json()["detail"]
        assert "\n" not in detail
        assert "was not started (stored as failed): the broker did not answer" in detail
        [run] = api.get("/api/runs").json()
        assert run["state"] == "failed"
        assert run["error"].startswith("not sent to the orchestrator queue: the broker did not answer")
        api.close()
    assert "Traceback" not in log.read_text()


def _answers(url: str) -> bool:
    try:
        return httpx.get(f"{url}/healthz", timeout=5).status_code in (200, 503)
    except httpx.TransportError:
        return False
