"""GET /metrics (Prometheus, also in multiprocess mode), GET /healthz and the OpenAPI docs."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest
from api_support import make_run, wait_for
from factories import redis_answers
from prometheus_client.parser import text_string_to_metric_families


def test_metrics_follow_prometheus_names_and_count_a_run(api: httpx.Client) -> None:
    run_id = api.post("/api/runs", json=make_run(batches=2, trainer="sentinel", sentinel_step_s=0)).json()[
        "id"
    ]
    wait_for(lambda: api.get(f"/api/runs/{run_id}").json()["state"] == "completed", what="completed")
    text = api.get("/metrics").text
    families = {f.name: f for f in text_string_to_metric_families(text)}
    assert families["corral_trainer_idle_seconds"].type == "counter"
    assert families["corral_batch_collection_seconds"].type == "histogram"
    assert families["corral_group_staleness"].type == "histogram"
    assert families["corral_groups_in_flight"].type == "gauge"
    assert families["corral_discarded_groups"].type == "counter"

    def sample(name: str, **labels: str) -> float:
        for family in families.values():
            for s in family.samples:
                if s.name == name and all(s.labels.get(k) == v for k, v in labels.items()):
                    return float(s.value)
        raise AssertionError(f"no sample {name} {labels}")

    assert sample("corral_batch_collection_seconds_count", run=run_id) == 2
    assert sample("corral_group_staleness_count", run=run_id) == 4  # B = 2 groups x 2 batches
    assert sample("corral_trainer_idle_seconds_total", run=run_id) > 0
    assert sample("corral_engine_weight_version", run=run_id, engine="engine-0") >= 1
    assert sample("corral_lane_queue_depth", run=run_id, lane="exec") == 0  # ended: nothing queued
    assert sample("corral_discarded_groups_total", run=run_id, reason="cancelled") >= 1  # at the end
    assert sample("corral_groups_in_flight", run=run_id) == 0


WRITER = """
from app.metrics import CorralMetrics
m = CorralMetrics()
m.discarded_groups.labels("r1", "stale").inc({n})
m.lane_queue_depth.labels("r1", "exec").set({n})
m.engine_weight_version.labels("r1", "engine-0").set({n})
import os; print(os.getpid())
"""


def test_several_processes_contribute_in_multiprocess_mode(tmp_path: Path) -> None:
    env = {**os.environ, "PROMETHEUS_MULTIPROC_DIR": str(tmp_path)}
    pids = [
        subprocess.run(
            [sys.executable, "-c", WRITER.format(n=n)], env=env, check=True, timeout=60, capture_output=True,
            text=True,
        ).stdout.strip()
        for n in (2, 5)
    ]  # fmt: skip

    def scrape(dead: str = "") -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
        reader = (
            "from app.metrics import CorralMetrics, mark_process_dead\n"
            f"{'mark_process_dead(' + dead + ')' if dead else ''}\n"
            "print(CorralMetrics().exposition()[0].decode())"
        )
        text = subprocess.run(
            [sys.executable, "-c", reader], env=env, check=True, timeout=60, capture_output=True, text=True
        ).stdout
        return {
            (s.name, tuple(sorted(s.labels.items()))): s.value
            for f in text_string_to_metric_families(text)
            for s in f.samples
        }

    samples = scrape()
    assert samples[("corral_discarded_groups_total", (("reason", "stale"), ("run", "r1")))] == 7  # summed
    assert samples[("corral_engine_weight_version", (("engine", "engine-0"), ("run", "r1")))] == 5  # max
    assert samples[("corral_lane_queue_depth", (("lane", "exec"), ("run", "r1")))] == 7  # summed
    # A worker that exits is marked dead: its queue depth no longer counts, its counters still do.
    after = scrape(dead=pids[0])
    assert after[("corral_lane_queue_depth", (("lane", "exec"), ("run", "r1")))] == 5
    assert after[("corral_discarded_groups_total", (("reason", "stale"), ("run", "r1")))] == 7


def test_healthz_reports_database_broker_and_engines(api: httpx.Client) -> None:
    run_id = api.post("/api/runs", json=make_run(batches=None)).json()["id"]
    wait_for(lambda: api.get(f"/api/runs/{run_id}").json()["state"] == "running", what="running")
    health = api.get("/healthz")
    assert health.status_code == 200
    body = health.json()
    assert body["ok"] is True
    assert body["database"] == {"ok": True, "held": True}
    assert body["broker"] == {"mode": "in-process", "ok": True}
    assert body["engines"][run_id] == {"engine-0": True, "engine-1": True}
    assert "lanes" not in body  # in-process lanes: no lane workers to ask
    api.post(f"/api/runs/{run_id}/stop")


def test_healthz_is_503_when_the_broker_is_unreachable(tmp_path: Path, backend_url: str) -> None:
    from api_support import make_settings, serving

    settings = make_settings(tmp_path, backend_url, broker_url="redis://127.0.0.1:1/0")
    with serving(settings) as url:
        health = httpx.get(f"{url}/healthz", timeout=10)
    assert health.status_code == 503
    assert health.json()["broker"] == {"mode": "celery", "ok": False}


def test_healthz_pings_the_real_redis_broker_and_says_when_it_is_down(tmp_path: Path) -> None:
    """With a broker (the Celery orchestrator queue and the lane queues), /healthz pings it: `ok` with the
    real Redis answering (the lane and orchestrator workers then asked: none runs here, so the answer is
    503 for them, tests/workers/test_healthz_lanes.py starts them), and not `ok`, within a few seconds and the
    database still fine, with nothing listening on the broker's port (the lane workers not asked).
    The server that reaches Redis runs as its own process: in this one, the broadcast that asks the lane
    workers leaves kombu's connection pool behind, whose after-fork hook then blocked every process a
    later test forked (`corral advise`'s simulation workers hung at their start, reading Redis)."""
    from api_support import free_port, make_settings, serve_env, serving, wait_for
    from test_serve_restart import corral_serve

    if not redis_answers():
        pytest.skip("no Redis answering on 127.0.0.1:6379")
    db = f"sqlite:///{tmp_path / 'corral.db'}"
    port = free_port()
    env = {**serve_env(tmp_path, db, port), "CORRAL_BROKER_URL": "redis://127.0.0.1:6379/0"}
    log = tmp_path / "serve.log"

    def healthz() -> httpx.Response | None:
        try:
            return httpx.get(f"http://127.0.0.1:{port}/healthz", timeout=30)
        except httpx.TransportError:
            return None

    with corral_serve(env, log):
        health = wait_for(healthz, 60, what=f"corral serve to answer; log: {log}")
    body = health.json()
    assert body["broker"] == {"mode": "celery", "ok": True}, body
    assert body["database"] == {"ok": True, "held": True}
    assert body["lanes"]["workers"] is not None  # asked, the broker answering
    assert body["orchestrator"]["workers"] is not None
    assert health.status_code == (200 if body["lanes"]["ok"] and body["orchestrator"]["ok"] else 503)
    unused = free_port()  # bound and let go: nothing listens there
    down = make_settings(tmp_path, db, broker_url=f"redis://127.0.0.1:{unused}/0")
    with serving(down) as url:
        asked = time.monotonic()
        health = httpx.get(f"{url}/healthz", timeout=30)
        took = time.monotonic() - asked
    assert health.status_code == 503, health.text
    body = health.json()
    assert body["broker"] == {"mode": "celery", "ok": False}
    assert body["database"] == {"ok": True, "held": True}
    assert body["ok"] is False
    assert body["lanes"]["ok"] is None  # not asked while the broker does not answer
    assert body["orchestrator"] == {"ok": None, "workers": None}
    assert took < 5, f"/healthz took {took:.1f} s with the broker down"


def test_openapi_docs_list_the_contract_paths(api: httpx.Client) -> None:
    assert api.get("/docs").status_code == 200
    paths = set(api.get("/openapi.json").json()["paths"])
    assert {
        "/api/runs",
        "/api/runs/{run_id}",
        "/api/runs/{run_id}/batches/next",
        "/api/runs/{run_id}/batches/{batch_id}/ack",
        "/api/runs/{run_id}/batches/{batch_id}/release",
        "/api/runs/{run_id}/batches/{batch_id}/renew",
        "/api/runs/{run_id}/weights",
        "/api/runs/{run_id}/rollouts/{version}",
        "/api/runs/{run_id}/policy",
        "/api/runs/{run_id}/timeline",
        "/api/runs/{run_id}/metrics",
        "/api/runs/{run_id}/commands/{command_id}",
        "/api/runs/{run_id}/pause",
        "/api/runs/{run_id}/resume",
        "/api/runs/{run_id}/stop",
        "/healthz",
        "/metrics",
    } <= paths


def test_the_openapi_docs_describe_the_error_answers_the_api_gives(api: httpx.Client) -> None:
    """The OpenAPI documented 422 as FastAPI's list of validation errors, while the API answers
    `{"detail": "<one line>", "errors": [...]}`, and left 401, 403, 404 and 409 (and /healthz's 503)
    undocumented: a client generated from it misread every refusal."""
    from app.service.schemas import Problem, ValidationProblem

    spec = api.get("/openapi.json").json()
    components = spec["components"]["schemas"]
    assert "HTTPValidationError" not in components

    def documented(method: str, path: str, status: int, body: dict[str, object]) -> None:
        answers = spec["paths"][path][method]["responses"]
        assert str(status) in answers, f"{method} {path} does not document {status}"
        ref = answers[str(status)]["content"]["application/json"]["schema"]["$ref"].rsplit("/", 1)[1]
        model = {"Problem": Problem, "ValidationProblem": ValidationProblem}[ref]
        assert set(body) <= set(components[ref]["properties"])
        model.model_validate(body)  # the answer is what the docs say it is

    run_id = api.post("/api/runs", json=make_run(batches=1, trainer="sentinel", sentinel_step_s=0)).json()[
        "id"
    ]
    wait_for(lambda: api.get(f"/api/runs/{run_id}").json()["state"] == "completed", what="completed")
    cases = [
        ("get", "/api/runs/{run_id}", api.get("/api/runs/nope"), 404),
        ("get", "/api/runs/{run_id}", api.get("/api/runs/n%20o"), 422),
        ("post", "/api/runs", api.post("/api/runs", json={"speed": "fast"}), 422),
        ("post", "/api/runs/{run_id}/stop", api.post(f"/api/runs/{run_id}/stop"), 409),
        ("post", "/api/runs/{run_id}/stop", httpx.post(f"{api.base_url}/api/runs/{run_id}/stop"), 401),
        (
            "post",
            "/api/runs/{run_id}/stop",
            httpx.post(
                f"{api.base_url}/api/runs/{run_id}/stop", headers={"Authorization": "Bearer wrong-token"}
            ),
            403,
        ),
        ("patch", "/api/runs/{run_id}/policy", api.patch(f"/api/runs/{run_id}/policy", json={}), 422),
        ("get", "/api/runs/{run_id}/rollouts/{version}", api.get(f"/api/runs/{run_id}/rollouts/99"), 404),
        ("get", "/api/runs/{run_id}/batches/next", api.get("/api/runs/nope/batches/next"), 404),
        ("get", "/api/runs/{run_id}/commands/{command_id}", api.get(f"/api/runs/{run_id}/commands/c1"), 404),
    ]
    for method, path, answer, status in cases:
        assert answer.status_code == status, (path, answer.text)
        documented(method, path, status, answer.json())
    assert "503" in spec["paths"]["/healthz"]["get"]["responses"]


def test_large_answers_are_compressed_and_the_live_stream_is_not(api: httpx.Client) -> None:
    # A live run's timeline went whole on each change, uncompressed: 1.3 MB of SVG every few seconds on
    # a fast run, to each open page.
    spec = make_run(batches=3, trainer="sentinel", sentinel_step_s=0)
    run_id = api.post("/api/runs", json=spec).json()["id"]
    wait_for(lambda: api.get(f"/api/runs/{run_id}").json()["state"] == "completed", what="completed")
    zipped = api.get(f"/runs/{run_id}/block/timeline", headers={"Accept-Encoding": "gzip"})
    assert zipped.status_code == 200
    assert zipped.headers["content-encoding"] == "gzip"
    assert zipped.text.startswith('<svg xmlns="http://www.w3.org/2000/svg" id="timeline-svg"')  # as sent
    assert int(zipped.headers["content-length"]) < len(zipped.content) / 3
    plain = api.get(f"/runs/{run_id}/block/timeline", headers={"Accept-Encoding": "identity"})
    assert "content-encoding" not in plain.headers
    assert plain.text == zipped.text
    small = api.get("/healthz", headers={"Accept-Encoding": "gzip"})
    assert "content-encoding" not in small.headers  # under GZIP_MIN_BYTES: not worth it
    with api.stream("GET", f"/runs/{run_id}/stream", headers={"Accept-Encoding": "gzip"}) as stream:
        assert stream.headers["content-type"].startswith("text/event-stream")
        assert "content-encoding" not in stream.headers  # each event goes out as it is made
