"""Operators and a trainer acting on one run at once, through a real `corral serve` (its own process,
stopped with Ctrl-C to its process group at the end of the module, which must exit 0) on SQLite and on
Postgres, from many HTTP clients in threads: what each gets is what docs/api.md says, and nothing the
run publishes is lost or doubled (its stored ledger)."""

from __future__ import annotations

import itertools
import re
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, TypeVar

import httpx
import pytest
from api_support import TOKEN, free_port, make_run, serve_env, serve_process, wait_for
from factories import take_write_lock

from app.client import CorralClient, CorralError, RunEnded
from app.core.events import Envelope
from app.core.events import RunEnded as RunEndedEvent
from app.service.manager import NOT_STARTED
from app.service.store import ServiceStore

T = TypeVar("T")


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory, backend_url: str) -> Iterator[tuple[str, Path]]:
    """A `corral serve` on `backend_url`: its URL and its log."""
    tmp = tmp_path_factory.mktemp("races")
    log = tmp / "serve.log"
    env = {**serve_env(tmp, backend_url, free_port()), "CORRAL_MAX_RUNS": "1000"}
    with serve_process(env, log) as api:
        yield str(api.base_url), log
    assert "Traceback" not in log.read_text(), log.read_text()[-3000:]


def _clients(url: str, n: int) -> list[httpx.Client]:
    """`n` operator clients, one connection each (so their requests reach the server at once)."""
    auth = {"Authorization": f"Bearer {TOKEN}"}
    return [httpx.Client(base_url=url, headers=auth, timeout=60) for _ in range(n)]


def _at_once(calls: list[Callable[[], T]]) -> list[T]:
    with ThreadPoolExecutor(len(calls)) as pool:
        return [f.result() for f in [pool.submit(call) for call in calls]]


def _running(api: httpx.Client, **overrides: Any) -> str:
    spec = make_run(speed=5.0, **overrides)
    spec.pop("batches")  # until stopped
    run_id = str(api.post("/api/runs", json=spec).json()["id"])
    wait_for(lambda: api.get(f"/api/runs/{run_id}").json()["state"] == "running", 60, what=f"{run_id} to run")
    return run_id


def _ended(api: httpx.Client, run_id: str) -> None:
    ended = ("stopped", "completed", "failed")
    wait_for(lambda: api.get(f"/api/runs/{run_id}").json()["state"] in ended, 60, what=f"{run_id} to end")


def _ledger_whole(database_url: str, run_id: str) -> None:
    store = ServiceStore(database_url, migrate=False)
    try:
        ledger, _ = store.ledger(run_id)
    finally:
        store.close()
    assert (ledger.lost, ledger.gaps, ledger.ended_twice, ledger.open_groups) == (0, 0, set(), set())


def test_a_publication_racing_a_stop_is_told_the_runs_end(served: tuple[str, Path], backend_url: str) -> None:
    """Publications sent as the run is stopped: each is published (202) or told the run has ended, 409
    "has ended (stopped)", which the client raises as `RunEnded`; never the run loop's "is stopping, not
    executing" or the runtime's "is stopping; it takes no new version" (a plain `CorralError`, which the
    README's trainer loop dies of)."""
    url, _ = served
    clients = _clients(url, 9)
    try:
        for attempt in range(4):
            run_id = _running(clients[0])

            weights = f"/api/runs/{run_id}/weights"
            calls: list[Callable[[], httpx.Response]] = [
                lambda c=c, v=v, w=weights: c.post(w, json={"version": v, "sentinel": True})
                for v, c in enumerate(clients[1:], start=1)
            ]
            calls.insert(attempt, lambda stop=f"/api/runs/{run_id}/stop": clients[0].post(stop))
            answers = _at_once(calls)
            stop = answers.pop(attempt)
            assert stop.status_code == 200, stop.text
            for answer in answers:
                assert answer.status_code in (202, 409, 422), answer.text
                if answer.status_code == 409:
                    assert answer.json()["detail"] == f"run {run_id!r} has ended (stopped)"
            _ended(clients[0], run_id)
            _ledger_whole(backend_url, run_id)
    finally:
        for client in clients:
            client.close()


def _publish_until_ended(client: CorralClient, run_id: str, versions: Iterator[int]) -> str:
    """Publish each of `versions` (a 422 for one another publisher passed is taken as published by it):
    the detail of the run's end once told it (`RunEnded`), another refusal's status and detail, or
    "published" when `versions` ran out first."""
    for version in versions:
        try:
            client.publish(run_id, version, sentinel=True)
        except RunEnded as exc:
            return exc.detail
        except CorralError as exc:
            if exc.status != 422 or "is not newer than" not in exc.detail:
                return f"{exc.status}: {exc.detail}"
    return "published"


def _race_the_completion(
    trainer: CorralClient, backend_url: str, others: Callable[[str], list[Callable[[], str]]]
) -> tuple[str, list[str], list[Envelope], RunEndedEvent]:
    """A one-batch run completes once `trainer` acks its batch and publishes version 1, while the calls
    `others(run_id)` make run at once, each until it is told the run's end. The run's id, what each call
    ended with (the trainer's first), and, once the run has completed, its stored events and its end."""
    run_id = str(trainer.create_run(**make_run(batches=1, speed=1.0))["id"])
    batch = trainer.next_batch(run_id, timeout=60)
    assert batch is not None

    def complete(batch_id: str = batch.batch_id) -> str:
        trainer.ack(run_id, batch_id)
        return _publish_until_ended(trainer, run_id, iter([1]))

    ends = _at_once([complete, *others(run_id)])
    wait_for(lambda: trainer.run(run_id)["state"] == "completed", 60, what="completed")
    store = ServiceStore(backend_url, migrate=False)
    try:
        events = store.envelopes(run_id, -1, 1_000_000)
    finally:
        store.close()
    [end] = [e.event for e in events if isinstance(e.event, RunEndedEvent)]
    return run_id, ends, events, end


def test_a_publication_racing_the_runs_completion_is_told_the_runs_end(
    served: tuple[str, Path], backend_url: str
) -> None:
    """A one-batch run completes once its trainer acks the batch and publishes version 1; 8 other
    publishers publish the versions after it meanwhile, each until it is told the run's end. The trainer
    loop is then over and the run drains its work (its turns and weight updates under way): a
    publication in that time was published (202, an update begun on a run that had ended for its
    trainer, which the drain then waited for), or, once the run's loop had ended, "is running, not
    executing". Each is now told the run's end, 409 "has ended (completed)", the client's `RunEnded`, and
    the stored stream has no publication after the trainer loop's end."""
    url, _ = served
    trainer = CorralClient(url, TOKEN, timeout_s=60)
    publishers = [CorralClient(url, TOKEN, timeout_s=60) for _ in range(8)]
    try:
        for _ in range(3):
            versions = itertools.count(2)
            run_id, ends, events, end = _race_the_completion(
                trainer,
                backend_url,
                lambda r, v=versions: [lambda c=c: _publish_until_ended(c, r, v) for c in publishers],
            )
            ended = f"run {run_id!r} has ended (completed)"
            assert ends[0] in ("published", ended), ends[0]  # or published meanwhile by another
            assert ends[1:] == [ended] * len(publishers), ends
            _ledger_whole(backend_url, run_id)
            assert end.reason == "completed"
            late = [(e.t, e.event) for e in events if e.event.kind == "version_published"]
            assert [v for t, v in late if t > (end.collection_ended_at or 0.0)] == []
    finally:
        for client in (trainer, *publishers):
            client.close()


def _change_until_ended(client: CorralClient, run_id: str, ks: Iterator[int]) -> str:
    """Set K to each of `ks`: the detail of the run's end once told it (`RunEnded`), another refusal's
    status and detail, or "changed" when `ks` ran out first."""
    for k in ks:
        try:
            client.set_policy(run_id, max_staleness=k)
        except RunEnded as exc:
            return exc.detail
        except CorralError as exc:
            return f"{exc.status}: {exc.detail}"
    return "changed"


def test_a_policy_change_racing_the_runs_completion_is_told_the_runs_end(
    served: tuple[str, Path], backend_url: str
) -> None:
    """As the publications above: 4 operators change K, and 4 trainers publish (each publication's weight
    update makes the drain longer), while the trainer completes a one-batch run. Once the trainer loop
    is over, a change is 409 "has ended (completed)" (with "; its policy is fixed" where it reached the
    run's loop), and no `PolicyChanged` is stored after the trainer loop's end. Before, changes then
    passed (200), altering the settings of a run that had ended for its trainer."""
    url, _ = served
    trainer = CorralClient(url, TOKEN, timeout_s=60)
    operators = [CorralClient(url, TOKEN, timeout_s=60) for _ in range(4)]
    publishers = [CorralClient(url, TOKEN, timeout_s=60) for _ in range(4)]

    def others(run_id: str) -> list[Callable[[], str]]:
        versions = itertools.count(2)
        cycles = [itertools.cycle([2 + i, 3 + i]) for i in range(len(operators))]
        changes = [
            lambda c=c, k=k: _change_until_ended(c, run_id, k) for c, k in zip(operators, cycles, strict=True)
        ]
        publications = [lambda c=c: _publish_until_ended(c, run_id, versions) for c in publishers]
        return [*changes, *publications]

    try:
        for _ in range(3):
            run_id, ends, events, end = _race_the_completion(trainer, backend_url, others)
            ended = f"run {run_id!r} has ended (completed)"
            told = ends[1 : 1 + len(operators)]
            assert all(said in (ended, f"{ended}; its policy is fixed") for said in told), ends
            changed = [e.t for e in events if e.event.kind == "policy_changed"]
            assert changed, "no change was made before the run's end: the race was not run"
            assert [t for t in changed if t > (end.collection_ended_at or 0.0)] == []
    finally:
        for client in (trainer, *operators, *publishers):
            client.close()


# Holds SQLite's write lock for `sys.argv[2]` seconds, as `corral prune` deleting old runs (or a
# DELETE of a run of millions of events) does from another process; says "held" once it holds it.
LOCK_HOLDER = """
import sqlite3, sys, time
db = sqlite3.connect(sys.argv[1], isolation_level=None)
db.execute("BEGIN IMMEDIATE")
print("held", flush=True)
time.sleep(float(sys.argv[2]))
db.execute("ROLLBACK")
"""


def test_requests_that_wait_for_the_database_hold_up_no_other(tmp_path: Path) -> None:
    """A stop of a run not executing here (deleted, ended long ago, unknown) and the live stream of an
    ended run's page read the store: they did so on the server's event loop, so while another process
    held SQLite's write lock (`corral prune`, say, which a read here waits for: transactions begin
    IMMEDIATE) every request waited with them, a trainer's long-poll and the run views answered from
    memory included. They read it off the loop now: the others are answered at once."""
    database = tmp_path / "corral.db"
    env = serve_env(tmp_path, f"sqlite:///{database}", free_port())
    with serve_process(env, tmp_path / "serve.log") as api:
        live = _running(api)
        ended = _running(api)
        api.post(f"/api/runs/{ended}/stop")
        _ended(api, ended)
        hold_s = 5.0
        holder = subprocess.Popen(
            [sys.executable, "-c", LOCK_HOLDER, str(database), str(hold_s)], stdout=subprocess.PIPE, text=True
        )
        try:
            assert holder.stdout is not None
            assert holder.stdout.readline().strip() == "held"
            clients = _clients(str(api.base_url), 3)

            def stream() -> int:
                with clients[1].stream("GET", f"/runs/{ended}/stream") as answer:
                    return answer.status_code

            def view_after_them() -> float:
                time.sleep(0.5)  # the stop and the stream are waiting for the lock by now
                began = time.monotonic()
                assert clients[2].get(f"/api/runs/{live}").status_code == 200
                return time.monotonic() - began

            calls: list[Callable[[], Any]] = [
                lambda: clients[0].post("/api/runs/no-such-run/stop").status_code,
                stream,
                view_after_them,
            ]
            stop, streamed, took = _at_once(calls)
        finally:
            holder.wait(30)
            if holder.stdout is not None:
                holder.stdout.close()
            for client in clients:
                client.close()
        assert stop == 404
        assert streamed == 200
        assert took < 1.0, f"the live run's view took {took:.1f} s while the lock was held {hold_s:g} s"


def _signed_in(url: str) -> tuple[httpx.Client, str]:
    """A browser's session on the dashboard at `url`: a client holding the `corral_csrf` cookie, signed in
    with the operator token through the sign-in form (its `corral_token` cookie), and the CSRF token its
    forms carry."""
    client = httpx.Client(base_url=url, timeout=60)
    page = client.get("/login")
    found = re.search(r'name="csrf_token" value="([^"]+)"', page.text)
    assert found is not None, page.text
    csrf = found.group(1)
    assert client.post("/login", data={"csrf_token": csrf, "token": TOKEN}).status_code == 303
    return client, csrf


def test_dashboard_controls_that_wait_for_the_database_hold_up_no_other(tmp_path: Path) -> None:
    """The dashboard's controls (Pause, Resume, Stop, Publish, the policy form) build the run's view
    first, which for a run not executing here (ended before this start) reads the store. Signed in as an
    operator, each is posted on such a run while another process holds SQLite's write lock: they wait
    for it (each is answered after the lock is let go), and a live run's view, asked meanwhile, is
    answered at once, as `test_requests_that_wait_for_the_database_hold_up_no_other` has it for the API."""
    database = tmp_path / "corral.db"
    env = serve_env(tmp_path, f"sqlite:///{database}", free_port())
    with serve_process(env, tmp_path / "serve.log") as api:
        ended = _running(api)
        api.post(f"/api/runs/{ended}/stop")
        _ended(api, ended)
    with serve_process(env, tmp_path / "serve.log") as api:
        live = _running(api)
        browsers = [_signed_in(str(api.base_url)) for _ in range(5)]
        viewer = _clients(str(api.base_url), 1)[0]
        forms: list[tuple[str, dict[str, str]]] = [(name, {}) for name in ("pause", "resume", "stop")]
        forms += [("publish", {}), ("policy", {"max_staleness": "3"})]  # K
        hold_s = 5.0
        lock = take_write_lock(database)
        try:

            def control(browser: tuple[httpx.Client, str], name: str, form: dict[str, str]) -> float:
                client, csrf = browser
                answer = client.post(f"/runs/{ended}/{name}", data={"csrf_token": csrf, **form})
                assert answer.status_code == 409, (name, answer.status_code, answer.text)
                assert f"run {ended} is not executing in this server" in answer.text, answer.text
                return time.monotonic()

            def let_go() -> float:
                time.sleep(hold_s)
                lock.execute("ROLLBACK")
                return time.monotonic()

            def view_after_them() -> float:
                time.sleep(0.5)  # the controls are waiting for the lock by now
                began = time.monotonic()
                assert viewer.get(f"/api/runs/{live}").status_code == 200
                return time.monotonic() - began

            calls: list[Callable[[], float]] = [
                lambda b=b, n=n, f=f: control(b, n, f) for b, (n, f) in zip(browsers, forms, strict=True)
            ]
            *answered, let_go_at, took = _at_once([*calls, let_go, view_after_them])
        finally:
            lock.close()
            viewer.close()
            for client, _ in browsers:
                client.close()
        assert min(answered) >= let_go_at  # each waited for the lock: it read the store
        assert took < 1.0, f"the live run's view took {took:.1f} s while the lock was held {hold_s:g} s"


def test_a_create_the_stop_overtakes_leaves_no_run_to_the_next_start(tmp_path: Path) -> None:
    """Ctrl-C while a create waits for the database (another process holds SQLite's write lock past the
    open requests' 10 s): the create stored its run after the shutdown had stopped every run, started
    it, and the exit (0) left it `running` in the store, for the next start to resume, while its client
    got a 500, under a traceback in the log. Now the run is stored `stopped`, never started, the log
    says the cut-off request in uvicorn's one line, and its client gets the API's JSON 503 with
    `Retry-After`, not uvicorn's plain-text 500 ("Internal Server Error")."""
    database = tmp_path / "corral.db"
    log = tmp_path / "serve.log"
    env = serve_env(tmp_path, f"sqlite:///{database}", free_port())
    answers: list[httpx.Response] = []
    with serve_process(env, log) as api:
        holder = subprocess.Popen(
            [sys.executable, "-c", LOCK_HOLDER, str(database), "13"], stdout=subprocess.PIPE, text=True
        )
        assert holder.stdout is not None
        assert holder.stdout.readline().strip() == "held"
        create = lambda: answers.append(api.post("/api/runs", json=make_run()))  # noqa: E731
        creating = threading.Thread(target=create)
        creating.start()
        time.sleep(1.0)  # the create waits for the lock; the block's end is the Ctrl-C
    holder.wait(30)
    holder.stdout.close()
    creating.join(30)
    [answer] = answers  # cut off by uvicorn at the end of the grace
    assert (answer.status_code, answer.headers.get("retry-after")) == (503, "5"), answer.text
    assert answer.json() == {
        "detail": "corral serve is stopping: this request was cut off at the end of the 10 s open requests "
        "get; send it again once it is back"
    }
    store = ServiceStore(f"sqlite:///{database}", migrate=False)
    try:
        runs = store.list_runs()
    finally:
        store.close()
    assert [(r.state, r.error) for r in runs] == [("stopped", NOT_STARTED)]
    out = log.read_text()
    assert "Traceback" not in out, out
    assert "timeout graceful shutdown exceeded" in out
