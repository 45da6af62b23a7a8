"""A publication or a policy change the store has not got in time is a 503, and asking again is safe: a
real `corral serve` on SQLite, the database locked by another connection (as a long write or a backup
holds it), the server killed with SIGKILL.

Before, both were answered (202, 200) after the 5 s wait all the same, with a warning in the server's
log: a kill -9 before the database took them forgot them, while the trainer believed them done."""

from __future__ import annotations

import signal
import sqlite3
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest
from api_support import TOKEN, make_run, wait_for
from test_serve_restart import _healthy, corral_serve
from test_serve_restart_answers import _serve_env
from test_trainer_loop_example import EXAMPLE

from app.client import CorralClient, RunEnded
from app.service.handle import STORED_WAIT_S
from app.service.store import ServiceStore

UNSTORED_VERSION = "is published, but the database has not stored it yet"
UNSTORED_POLICY = "is changed, but the database has not stored the change yet"


@contextmanager
def locked(database: str) -> Iterator[None]:
    """The SQLite database held by a write transaction of this process for the block's duration."""
    holder = sqlite3.connect(database.removeprefix("sqlite:///"), isolation_level=None)
    holder.execute("BEGIN IMMEDIATE")
    try:
        yield
    finally:
        holder.execute("ROLLBACK")
        holder.close()


def _published(database: str, run_id: str, version: int) -> int:
    """How many times the store holds `version` as published in the run's stream."""
    store = ServiceStore(database, migrate=False)
    try:
        events = store.timeline(run_id, -1, 100_000)
    finally:
        store.close()
    return sum(e["kind"] == "version_published" and e["version"] == version for e in events)


def _unavailable(answer: httpx.Response, words: str) -> None:
    assert answer.status_code == 503, answer.text
    assert answer.headers["retry-after"] == "5"
    assert words in answer.json()["detail"], answer.text


@dataclass
class Served:
    """A `corral serve` on SQLite in a test's directory (`_serve_env`): how to start it and reach it."""

    env: dict[str, str]
    url: str
    database: str
    log: Path
    api: httpx.Client

    @contextmanager
    def started(self) -> Iterator[subprocess.Popen[bytes]]:
        """A `corral serve` on the database, healthy (every run of a killed one resumed), for the block."""
        with corral_serve(self.env, self.log) as server:
            wait_for(lambda: _healthy(self.url), 120, what=f"corral serve to start; log: {self.log}")
            yield server

    def holding_a_batch(self) -> tuple[str, dict[str, Any], str, dict[str, Any]]:
        """A new run's first batch, taken: the run's id, the batch, and the publication it trains towards
        (its route and body)."""
        run_id = self.api.post("/api/runs", json=make_run(batches=None)).json()["id"]
        batch = self.api.get(f"/api/runs/{run_id}/batches/next", params={"timeout": 60}).json()
        return (
            run_id,
            batch,
            f"/api/runs/{run_id}/weights",
            {"version": batch["publish_version"], "sentinel": True},
        )


@pytest.fixture
def served(tmp_path: Path) -> Iterator[Served]:
    env, url, database, log, api = _serve_env(tmp_path)
    try:
        yield Served(env, url, database, log, api)
    finally:
        api.close()


def _kill(server: subprocess.Popen[bytes]) -> None:
    server.send_signal(signal.SIGKILL)
    assert server.wait(10) == -signal.SIGKILL


def test_a_publication_not_stored_is_a_503_and_publishing_it_again_is_answered_once_stored(
    served: Served, tmp_path: Path
) -> None:
    api = served.api
    with served.started() as first:
        run_id, batch, weights, publish = served.holding_a_batch()
        version = publish["version"]
        with locked(served.database):
            _unavailable(api.post(weights, json=publish), UNSTORED_VERSION)
            # asked again while the database is still locked: not "not newer", and not stored yet
            _unavailable(api.post(weights, json=publish), UNSTORED_VERSION)
        again = api.post(weights, json=publish)
        assert again.status_code == 202, again.text
        assert (again.json()["version"], again.json()["already_published"]) == (version, True)
        assert _published(served.database, run_id, version) == 1  # stored once the answer came, once
        assert api.post(f"/api/runs/{run_id}/batches/{batch['batch_id']}/ack").status_code == 200
        _kill(first)
    with served.started():
        # the resumed run has the version: a repeat after the restart is answered as one, too
        after = api.post(weights, json=publish)
        assert after.status_code == 202, after.text
        assert after.json()["already_published"] is True
        following = api.get(f"/api/runs/{run_id}/batches/next", params={"timeout": 60}).json()
        assert following["publish_version"] == version + 1  # not asked for the version again
        # the newest with other weights (or an older version) is still refused
        other = api.post(weights, json={"version": version, "path": str(tmp_path)})
        assert other.status_code == 422, other.text
        assert f"is not newer than the published version {version}" in other.json()["detail"]
        assert api.post(f"/api/runs/{run_id}/stop").status_code == 200
    assert _published(served.database, run_id, version) == 2  # the first life's, and the resume's reload


def test_a_publication_not_stored_when_the_server_is_killed_is_published_by_asking_again(
    served: Served,
) -> None:
    api = served.api
    with served.started() as first:
        run_id, batch, weights, publish = served.holding_a_batch()
        with locked(served.database):
            _unavailable(api.post(weights, json=publish), UNSTORED_VERSION)
            _kill(first)  # before the database took it
    assert _published(served.database, run_id, publish["version"]) == 0  # forgotten, as the 503 said
    with served.started():
        again = api.get(f"/api/runs/{run_id}/batches/next", params={"timeout": 60}).json()
        assert (again["batch_id"], again["delivery"]) == (batch["batch_id"], 2)
        published = api.post(weights, json=publish)  # the trainer's ask again
        assert published.status_code == 202, published.text
        assert published.json()["already_published"] is False
        assert api.post(f"/api/runs/{run_id}/batches/{batch['batch_id']}/ack").status_code == 200
        following = api.get(f"/api/runs/{run_id}/batches/next", params={"timeout": 60}).json()
        assert following["publish_version"] == publish["version"] + 1
        assert api.post(f"/api/runs/{run_id}/stop").status_code == 200


def test_a_policy_change_not_stored_is_a_503_and_sending_it_again_is_answered_once_stored(
    served: Served,
) -> None:
    api = served.api
    change = {"max_staleness": 5, "surplus_groups": 3}
    with served.started() as first:
        run_id, _, _, _ = served.holding_a_batch()
        policy = f"/api/runs/{run_id}/policy"
        with locked(served.database):
            _unavailable(api.patch(policy, json=change), UNSTORED_POLICY)
            _unavailable(api.patch(policy, json=change), UNSTORED_POLICY)
        again = api.patch(policy, json=change)
        assert again.status_code == 200, again.text
        assert {k: again.json()["policy"][k] for k in change} == change
        _kill(first)
    with served.started():
        assert {
            k: v for k, v in api.get(f"/api/runs/{run_id}").json()["policy"].items() if k in change
        } == change


def test_the_trainer_loop_asks_again_while_its_publication_is_not_stored(served: Served) -> None:
    """examples/trainer_loop.py with the database locked for a while as it publishes and acks: it asks
    again after each 503 and ends its step once both are stored, where it took the 202 as done."""
    api = served.api
    with served.started():
        run_id = api.post("/api/runs", json=make_run(batches=None)).json()["id"]
        wait_for(lambda: api.get(f"/api/runs/{run_id}/metrics").json()["trainer"]["offered"], what="a batch")
        argv = [
            sys.executable,
            str(EXAMPLE),
            "--url",
            served.url,
            "--run",
            run_id,
            "--token",
            TOKEN,
            "--steps",
            "1",
        ]
        with locked(served.database):
            trainer = subprocess.Popen(
                argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=EXAMPLE.parents[1]
            )
            wait_for(lambda: _published_live(api, run_id), 60, what="the version published in the run")
            time.sleep(STORED_WAIT_S + 1)  # past the publication's wait for the store
        out, err = trainer.communicate(timeout=120)
        assert trainer.returncode == 0, err
        assert f"server unavailable (version 1 {UNSTORED_VERSION}" in out, out
        assert out.splitlines()[-1].startswith("batch 0: "), out
        assert _published(served.database, run_id, 1) == 1
        assert api.get(f"/api/runs/{run_id}/metrics").json()["trainer"]["acked"] == 1
        assert api.post(f"/api/runs/{run_id}/stop").status_code == 200


def _published_live(api: httpx.Client, run_id: str) -> bool:
    return bool(api.get(f"/api/runs/{run_id}").json()["live"]["trainer_version"] >= 1)


def test_a_publication_to_a_run_still_stopping_tells_the_trainer_the_run_has_ended(served: Served) -> None:
    """A run stopping (its last events waiting for a locked database) answered a publication 409 "run …
    is stopping, not executing": the client raised a plain CorralError, and the README's trainer loop,
    holding a batch when the run was stopped, died of it. Now the 409 the trainer's `next` gives."""
    api = served.api
    with served.started(), CorralClient(served.url, token=TOKEN) as corral:
        run_id, batch, _, publish = served.holding_a_batch()
        with locked(served.database):
            assert api.post(f"/api/runs/{run_id}/stop").status_code == 200
            assert api.get(f"/api/runs/{run_id}").json()["state"] == "stopping"
            with pytest.raises(RunEnded) as ended:
                corral.publish(run_id, publish["version"], sentinel=True)
            assert ended.value.detail == f"run {run_id!r} has ended (stopped)"
            assert api.get(f"/api/runs/{run_id}").json()["state"] == "stopping"  # still, when refused
        assert corral.ack(run_id, batch["batch_id"])["already_acked"] is False
