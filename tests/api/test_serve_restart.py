"""`corral serve` killed with SIGKILL in the middle of a run, then started again: the run resumes, and
every group admitted before the crash ends delivered or discarded with a reason (`orphaned` for those
in flight), with no gap in the stored stream and no group id used twice."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import httpx
from api_support import TOKEN, free_port, make_run, serve_env, wait_for

from app.service.store import ServiceStore
from app.store.repos import BatchRepo


@contextmanager
def corral_serve(
    env: dict[str, str], log: Path, args: tuple[str, ...] | list[str] = ()
) -> Iterator[subprocess.Popen[bytes]]:
    with log.open("ab") as out:
        proc = subprocess.Popen(
            [sys.executable, "-c", "from app.cli import main; main()", "serve", *args],
            env=env,
            stdout=out,
            stderr=subprocess.STDOUT,
        )
    try:
        yield proc
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.wait()


def _healthy(url: str) -> bool:
    """Whether the server answers /healthz, healthy, with every run of the previous one resumed (a restart
    resumes them in the background: until then their commands answer 503)."""
    try:
        answer = httpx.get(f"{url}/healthz", timeout=2)
    except httpx.TransportError:
        return False
    return answer.status_code == 200 and answer.json()["resuming"] == []


def _collecting(store: ServiceStore, run_id: str) -> bool:
    """Whether the store holds a batch requested and not delivered (the one being collected)."""
    with store.session() as s:
        return any(b.delivered_at is None for b in BatchRepo(s).list(run_id))


def _on_sqlite(tmp_path: Path) -> tuple[dict[str, str], str, Path, httpx.Client]:
    """A `corral serve` on SQLite in `tmp_path`, on a free port: its environment, URL and log file, and
    an API client holding the operator token."""
    port = free_port()
    env = serve_env(tmp_path, f"sqlite:///{tmp_path / 'corral.db'}", port)
    url = f"http://127.0.0.1:{port}"
    api = httpx.Client(base_url=url, headers={"Authorization": f"Bearer {TOKEN}"}, timeout=60)
    return env, url, tmp_path / "serve.log", api


def test_kill_9_mid_run_then_restart_resumes_and_accounts_for_every_group(
    tmp_path: Path, backend_url: str
) -> None:
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    db = backend_url  # SQLite, then Postgres: one fresh database per backend for the test session
    env = serve_env(tmp_path, db, port)
    log = tmp_path / "serve.log"
    api = httpx.Client(base_url=url, headers={"Authorization": f"Bearer {TOKEN}"}, timeout=30)
    spec = make_run(batches=None, trainer="sentinel", sentinel_step_s=0.05, speed=8.0)

    store = ServiceStore(db, migrate=False)
    with corral_serve(env, log) as first:
        wait_for(lambda: _healthy(url), 120, what=f"corral serve to start; log: {log}")
        run_id = api.post("/api/runs", json=spec).json()["id"]
        wait_for(lambda: api.get(f"/api/runs/{run_id}").json()["live"]["batches"] >= 2, what="2 batches")
        # Kill once the store holds groups in flight (its sink writes in batches, a moment behind) and a
        # batch being collected: requested, not delivered.
        wait_for(
            lambda: store.resume_point(run_id).open_groups and _collecting(store, run_id),
            what="stored groups in flight and a batch requested",
        )
        first.send_signal(signal.SIGKILL)
        assert first.wait(10) == -signal.SIGKILL
    in_flight = store.resume_point(run_id).open_groups  # what the store knew at the kill
    assert in_flight
    # Batches handed to the trainer and kept as files whose delivery the store had not got yet: their
    # groups are recorded delivered at the restart (the trainer has them), not orphaned.
    stored = {
        e["batch_index"] for e in store.timeline(run_id, -1, 1_000_000) if e["kind"] == "batch_delivered"
    }
    stored_batches = len(stored)
    offers = [json.loads(f.read_text()) for f in (tmp_path / "data" / run_id / "offers").glob("*.json")]
    offers = [offer for offer in offers if offer["index"] not in stored]
    kept = {g["group_id"] for offer in offers for g in offer["groups"]}

    with corral_serve(env, log) as second:
        wait_for(lambda: _healthy(url), 120, what="corral serve to restart")
        resumed = api.get(f"/api/runs/{run_id}").json()
        assert resumed["state"] == "running"
        assert resumed["live"] is not None  # executing again in this server

        def live_batches() -> int:  # counted on from the stored stream, not from zero
            return int(api.get(f"/api/runs/{run_id}").json()["live"]["batches"])

        # (a kept batch recorded delivered at the restart counts too: one more than those)
        wait_for(lambda: live_batches() > stored_batches + len(offers), what="a batch more")
        assert api.post(f"/api/runs/{run_id}/stop").status_code == 200
        wait_for(lambda: api.get(f"/api/runs/{run_id}").json()["state"] == "stopped", what="stopped")
        second.send_signal(signal.SIGTERM)  # a clean stop flushes every sink
        # uvicorn re-raises the signal it handled once it has shut down
        assert second.wait(60) in (0, -signal.SIGTERM), log.read_text()[-2000:]

    try:
        ledger, _ = store.ledger(run_id)
        assert ledger.gaps == 0  # the resumed stream continues where the stored one ended
        assert not ledger.ended_twice  # no group id reused by the second incarnation
        assert not ledger.never_admitted
        assert not ledger.open_groups  # every admitted group ended: delivered or discarded
        assert ledger.lost == 0
        orphaned = {e["group_id"] for e in store.timeline(run_id, -1, 1_000_000)
                    if e["kind"] == "group_discarded" and e["reason"] == "orphaned"}  # fmt: skip
        assert orphaned == in_flight - kept  # the groups in flight at the kill, but those kept
        delivered = {
            e["group_id"] for e in store.timeline(run_id, -1, 1_000_000) if e["kind"] == "group_delivered"
        }
        assert in_flight & kept <= delivered
        # Events still buffered at the kill are lost with the process; what the store holds accounts.
        assert ledger.delivered_count >= 2
        with store.session() as s:
            indices = [b.batch_index for b in BatchRepo(s).list(run_id) if b.delivered_at is not None]
        assert indices == sorted(set(indices))
        # Contiguous: the batch being collected at the kill (its request stored, not its delivery) keeps
        # its index in the resumed run; it was skipped (b_n never existed).
        assert indices == list(range(len(indices)))
        kinds = [e["kind"] for e in store.timeline(run_id, -1, 1_000_000)]
        assert kinds.count("run_started") == 2
        resumed_at = len(kinds) - 1 - kinds[::-1].index("run_started")
        assert "batch_delivered" in kinds[resumed_at:]  # the second life delivered batches
        assert kinds[-1] == "run_ended"
    finally:
        store.close()
        api.close()


def test_a_batch_handed_out_before_a_kill_is_offered_again_after_the_restart(tmp_path: Path) -> None:
    env, url, log, api = _on_sqlite(tmp_path)
    try:
        with corral_serve(env, log) as first:
            wait_for(lambda: _healthy(url), 120, what=f"corral serve to start; log: {log}")
            run_id = api.post("/api/runs", json=make_run(batches=None)).json()["id"]
            taken = api.get(f"/api/runs/{run_id}/batches/next", params={"timeout": 60}).json()
            kept = tmp_path / "data" / run_id / "offers" / f"{taken['batch_id']}.json"

            def handed_out() -> bool:  # kept on disk, with the take
                return kept.exists() and json.loads(kept.read_text()).get("delivery") == 1

            wait_for(handed_out, what="the offer kept on disk, handed out once")
            first.send_signal(signal.SIGKILL)  # the trainer never acked it
            first.wait(10)
        with corral_serve(env, log):
            wait_for(lambda: _healthy(url), 120, what="corral serve to restart")
            again = api.get(f"/api/runs/{run_id}/batches/next", params={"timeout": 60}).json()
            assert again["batch_id"] == taken["batch_id"]
            assert again["groups"] == taken["groups"]
            # Its second delivery, as after a missed ack without a restart: it said 1 again, so a
            # trainer could not tell that it was given the same batch twice.
            assert (taken["delivery"], again["delivery"]) == (1, 2)
            # The trainer is still on that batch's step: the resumed run offers no other batch until
            # it is acked and its version published (it offered the next one at once, towards the
            # same version, and the trainer's second publication of that version was refused).
            nothing = api.get(f"/api/runs/{run_id}/batches/next", params={"timeout": 3})
            assert nothing.status_code == 204, nothing.text
            acked = api.post(f"/api/runs/{run_id}/batches/{again['batch_id']}/ack").json()
            assert acked["already_acked"] is False
            wait_for(lambda: not kept.exists(), what="the acked offer's file removed")
            nothing = api.get(f"/api/runs/{run_id}/batches/next", params={"timeout": 3})
            assert nothing.status_code == 204, nothing.text  # acked, but its version not published yet
            publish = {"version": again["publish_version"], "sentinel": True}
            assert api.post(f"/api/runs/{run_id}/weights", json=publish).status_code == 202, publish
            following = api.get(f"/api/runs/{run_id}/batches/next", params={"timeout": 60}).json()
            assert following["index"] == again["index"] + 1
            assert following["publish_version"] == again["publish_version"] + 1
            api.post(f"/api/runs/{run_id}/stop")
    finally:
        api.close()


def test_the_readme_trainer_loop_outlives_a_kill_9_and_restart_of_the_server(tmp_path: Path) -> None:
    """The shipped trainer loop, mid-run, while its server is killed with SIGKILL and started again: it
    died with httpx's RemoteProtocolError (or ConnectError), since the client let transport errors
    through and the loop only waited out a 503. Now it waits for the server, goes on with the resumed
    run, and trains on every step it was asked for, each batch once."""
    env, url, log, api = _on_sqlite(tmp_path)
    example = Path(__file__).resolve().parents[2] / "examples" / "trainer_loop.py"
    steps = 8
    try:
        with corral_serve(env, log) as first:
            wait_for(lambda: _healthy(url), 120, what=f"corral serve to start; log: {log}")
            run_id = api.post("/api/runs", json=make_run(batches=None, speed=8.0)).json()["id"]
            trainer = subprocess.Popen(
                [sys.executable, str(example), "--url", url, "--run", run_id, "--token", TOKEN,
                 "--steps", str(steps)],
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
                cwd=example.parents[1],
            )  # fmt: skip

            def trained() -> int:
                return int((api.get(f"/api/runs/{run_id}").json()["live"] or {}).get("trainer_version", 0))

            wait_for(lambda: trained() >= 2, 60, what="two trainer steps")
            first.send_signal(signal.SIGKILL)
            assert first.wait(10) == -signal.SIGKILL
        time.sleep(3)  # the trainer finds no server for a while
        with corral_serve(env, log) as second:
            try:
                out, err = trainer.communicate(timeout=180)
            except subprocess.TimeoutExpired:
                trainer.kill()
                out, err = trainer.communicate()
                raise AssertionError(f"no end:\n{out}\n{err}\n{log.read_text()[-3000:]}") from None
            assert trainer.returncode == 0, err
            assert "Traceback" not in err
            second.send_signal(signal.SIGTERM)
            second.wait(60)
    finally:
        if trainer.poll() is None:
            trainer.kill()
        api.close()
    assert "server unavailable (no answer from the server" in out
    steps_done = [line for line in out.splitlines() if line.startswith("batch ")]
    assert len(steps_done) == steps, out
    # Each batch trained on once: an ack answered is in the store, so the restarted server hands out
    # only the batch whose ack had no answer (the loop acks it again, then prints it). Before acks and
    # publications waited for the store, the restarted server went back to batch 0 and version 1.
    indices = [int(line.split(":")[0].removeprefix("batch ")) for line in steps_done]
    assert indices == sorted(set(indices)), out
