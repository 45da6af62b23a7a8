"""`corral serve` killed with SIGKILL in the middle of a local run, then started again, on both
deployments (Postgres with Celery lane workers on Redis; SQLite with in-process lanes).

The run resumes in the new server and delivers batches again. Every group the store had admitted before
the crash ends exactly once: the ones open at the crash are discarded as `orphaned`, except those of a
batch handed to the trainer and kept (its offer file) whose delivery the store had not got, which are
recorded delivered in it; the others were delivered or discarded with a reason; the stored stream has
no gap. The killed server's embedded engines
do not outlive it.

Nothing of the killed server's sandboxes is left once the run has resumed, read from the filesystem: work
directories, state files, pids cgroups, uid claims, processes. On SQLite the next `corral serve` removes
them as a dead owner's (app/sandboxes/leftovers.py); on Postgres they live on the lane workers, whose
cleanup worker removes them when the resumed run's sweep reaches it (workers/sandboxes.py). The resumed
run's own sandboxes are left alone: no group fails. The same for a run an orchestrator worker drives,
that worker killed whole and another one taking the run over.
"""

from __future__ import annotations

import json
import os
import signal
import time
from contextlib import suppress
from dataclasses import dataclass
from pathlib import Path

import pytest
from e2e_support import (
    CORRAL,
    POSTGRES_URL,
    REDIS_URL,
    TOKEN,
    answers,
    data_dir,
    free_port,
    healthy,
    make_local_config,
    op_results_on,
    processes,
    serve_env,
    start_lane_workers,
    start_serve,
    tree,
    unique_host,
    wait_for,
)

from app.client import CorralClient
from app.core.events import Ledger
from app.lanes.ops import incarnation_of
from app.sandboxes.cpuset import CGROUP_ROOT
from app.sandboxes.limits import pids_parent, uid_claims_dir
from app.service.store import ServiceStore
from app.store.db import scratch_database
from app.store.repos import GroupRepo

DEPLOYMENTS = {
    "postgres-celery": ("postgres", True),
    "sqlite-inprocess": ("sqlite", False),
}


def stored_ledger(db: str, run_id: str) -> Ledger:
    store = ServiceStore(db, migrate=False)
    try:
        return store.ledger(run_id)[0]
    finally:
        store.close()


@dataclass(frozen=True)
class Leftovers:
    """What sandboxes of a dead process hold on this host, as the filesystem shows it."""

    names: frozenset[str]  # work directories and state files
    incarnations: frozenset[int]  # of their names, where the run is on lane workers
    cgroups: frozenset[Path]
    claims: frozenset[tuple[str, str]]  # (uid, holder)

    def dead(self, name: str) -> bool:
        return name in self.names or incarnation_of(name) in self.incarnations


def sandbox_names(root: Path) -> set[str]:
    """The sandboxes in a run's sandbox directory: work directories and state files."""
    if not root.is_dir():
        return set()
    names = {p.name for p in root.iterdir() if not p.name.startswith(".")}
    return names | {p.name.split(".json")[0] for p in (root / ".corral-state").glob("*.json")}


def cgroups() -> set[Path]:
    parent = pids_parent(CGROUP_ROOT)
    return set(parent[0].iterdir()) if parent is not None and parent[0].is_dir() else set()


def claims() -> set[tuple[str, str]]:
    out = set()
    for claim in uid_claims_dir().glob("[0-9]*"):
        with suppress(OSError):
            out.add((claim.name, claim.read_text().strip()))
    return out


def leftovers_of(root: Path, dead_pid: int) -> Leftovers:
    """The sandboxes in `root` now, all of them a dead process's: their cgroups and uid claims (held by
    that process, or by a lane worker as their state files say)."""
    names = sandbox_names(root)
    uids = {str(json.loads(f.read_text()).get("uid")) for f in (root / ".corral-state").glob("*.json")}
    return Leftovers(
        frozenset(names),
        frozenset(i for i in map(incarnation_of, names) if i is not None),
        frozenset(g for g in cgroups() if any(g.name.startswith(f"{n}-") for n in names)),
        frozenset(c for c in claims() if c[1] == str(dead_pid) or c[0] in uids),
    )


def still_there(dead: Leftovers, root: Path) -> list[str]:
    """What of `dead` is still on this host: work directories or state files of its sandboxes (or of
    any sandbox of its incarnations), their cgroups, their uid claims (unless a live sandbox holds the
    uid again), processes whose working directory is in one of their work directories."""
    names = sandbox_names(root)
    left = [f"sandbox {n}" for n in sorted(names) if dead.dead(n)]
    left += [f"cgroup {g.name}" for g in sorted(dead.cgroups) if g.exists()]
    live_uids = set()
    for state in (root / ".corral-state").glob("*.json"):
        with suppress(OSError, ValueError):
            if not dead.dead(state.name.split(".json")[0]):
                live_uids.add(str(json.loads(state.read_text()).get("uid")))
    left += [f"uid claim {uid} ({holder})" for uid, holder in sorted(dead.claims & claims())
             if uid not in live_uids]  # fmt: skip
    for entry in os.listdir("/proc"):
        with suppress(OSError):
            cwd = os.readlink(f"/proc/{entry}/cwd")
            if cwd.startswith(f"{root}/") and dead.dead(cwd[len(str(root)) + 1 :].split("/")[0]):
                left.append(f"process {entry} in {cwd}")
    return left


def alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


@pytest.mark.slow
@pytest.mark.parametrize("deployment", list(DEPLOYMENTS))
def test_kill_9_of_serve_mid_run_then_restart_resumes_and_accounts_for_every_group(
    deployment: str, tmp_path: Path
) -> None:
    backend, celery = DEPLOYMENTS[deployment]
    if backend == "postgres" and not answers("127.0.0.1", 5432):
        pytest.skip("no Postgres answering on 127.0.0.1:5432")
    if celery and not answers("127.0.0.1", 6379):
        pytest.skip("no Redis answering on 127.0.0.1:6379")
    host = unique_host()
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    t0 = time.monotonic()
    with (
        scratch_database(backend, POSTGRES_URL, tmp_path) as db,
        data_dir() as data,
        processes(tmp_path) as procs,
        CorralClient(url, token=TOKEN, timeout_s=30) as corral,
    ):
        if celery:
            start_lane_workers(procs, host, REDIS_URL)
        env = serve_env(db, port, data, REDIS_URL if celery else None, host)
        first = start_serve(procs, env, "serve-1")
        wait_for(lambda: healthy(url), 120, f"corral serve to answer; log:\n{procs.tail('serve-1')}")
        spec = {"name": f"restart-{deployment}", "kind": "local", "config": make_local_config(),
                "trainer": "sentinel", "sentinel_step_s": 0.05}  # fmt: skip
        run_id = corral.create_run(**spec)["id"]
        wait_for(lambda: (corral.run(run_id)["live"] or {}).get("batches", 0) >= 2, 240, "2 batches")
        # Kill while the store holds a group in flight: the crash must then account for it; and while
        # sandboxes are on disk: the restart must remove them.
        sandboxes = data / run_id / "sandboxes"
        wait_for(
            lambda: stored_ledger(db, run_id).open_groups and sandbox_names(sandboxes),
            60,
            "a stored group in flight, with sandboxes",
        )
        family = tree(first.pid)
        os.kill(first.pid, signal.SIGKILL)  # the server alone, as `kill -9 <pid>` would
        assert first.wait(10) == -signal.SIGKILL
        procs.procs.pop("serve-1")
        killed_at = time.monotonic() - t0
        # Its embedded engines (in sessions of their own) die with it (PR_SET_PDEATHSIG).
        wait_for(lambda: not any(alive(p) for p in family[1:]), 30, f"the engines of {family} to exit")
        dead = leftovers_of(sandboxes, first.pid)
        assert dead.names
        at_crash = stored_ledger(db, run_id)
        open_at_crash = set(at_crash.open_groups)
        assert open_at_crash
        ops_before = len(op_results_on(REDIS_URL, host)) if celery else 0
        crashed = ServiceStore(db, migrate=False)
        try:  # the resumed run's live counters go on from these (not from zero)
            delivered_at_crash = {
                e["batch_index"]
                for e in crashed.timeline(run_id, -1, 1_000_000)
                if e["kind"] == "batch_delivered"
            }
        finally:
            crashed.close()
        stored_batches = len(delivered_at_crash)
        # Batches handed to the trainer and kept as files whose delivery the store had not got: the
        # restart records them delivered (the trainer has them), their groups too, not orphaned.
        offers = [json.loads(f.read_text()) for f in (data / run_id / "offers").glob("*.json")]
        kept = [o for o in offers if o["index"] not in delivered_at_crash]
        kept_groups = {g["group_id"] for o in kept for g in o["groups"]}

        start_serve(procs, env, "serve-2")
        wait_for(lambda: healthy(url), 120, f"corral serve to restart; log:\n{procs.tail('serve-2')}")
        # Executing again, in the new server: runs are resumed in the background once it listens
        # (docs/faults.md), so on a loaded machine `live` may still be null when /healthz first answers.
        wait_for(lambda: corral.run(run_id)["live"] is not None, 120, "the run to execute again")
        # "created" while its engines start again, then running
        wait_for(lambda: corral.run(run_id)["state"] == "running", 120, "the resumed run to run")
        wait_for(
            lambda: corral.run(run_id)["live"]["batches"] > stored_batches + len(kept),
            240,
            "a batch of the resumed run",
        )
        resumed_batch_at = time.monotonic() - t0
        # The lane workers sweep as the sweep reaches them, in the cleanup lane: soon, not at once.
        with suppress(AssertionError):
            wait_for(lambda: not still_there(dead, sandboxes), 60, "the dead server's sandboxes to go")
        assert still_there(dead, sandboxes) == []
        corral.stop(run_id)
        wait_for(lambda: corral.run(run_id)["state"] == "stopped", 120, "the run to stop")
        if celery:  # the resumed run's sandbox ops went to the lane workers too
            assert len(op_results_on(REDIS_URL, host)) > ops_before
        code = procs.stop("serve-2", signal.SIGTERM)  # a clean stop flushes every sink
        assert code in (0, -signal.SIGTERM), procs.tail("serve-2")

        store = ServiceStore(db, migrate=False)
        try:
            ledger, _ = store.ledger(run_id)
            assert ledger.gaps == 0  # the resumed stream continues where the stored one ended
            assert not ledger.ended_twice  # no group id reused by the second life
            assert not ledger.never_admitted
            assert not ledger.open_groups  # every admitted group ended: delivered or discarded
            assert ledger.lost == 0
            assert ledger.admitted_count > at_crash.admitted_count  # the second life admitted more
            assert all(reason for reason in ledger.discarded)
            assert "failed" not in ledger.discarded  # no sandbox of the resumed run was touched
            with store.session() as s:
                repo = GroupRepo(s)
                for gid in open_at_crash:
                    group = repo.get(run_id, gid)
                    assert group is not None
                    if gid in kept_groups:
                        assert (group.state, group.reason) == ("delivered", None)
                    else:
                        assert (group.state, group.reason) == ("discarded", "orphaned")
                groups = repo.list(run_id)
            assert all(g.state == "delivered" or (g.state == "discarded" and g.reason) for g in groups)
            assert len(groups) == ledger.admitted_count
            kinds = [e["kind"] for e in store.timeline(run_id, -1, 1_000_000)]
            assert kinds.count("run_started") == 2
            second_life = len(kinds) - 1 - kinds[::-1].index("run_started")
            assert "batch_delivered" in kinds[second_life:]
            assert kinds[-1] == "run_ended"
        finally:
            store.close()
    print(
        f"{deployment}: killed at {killed_at:.1f} s with {len(open_at_crash)} group(s) in flight "
        f"and {len(dead.names)} sandbox(es), {len(dead.cgroups)} cgroup(s), {len(dead.claims)} uid claim(s) "
        f"({len(open_at_crash & kept_groups)} in {len(kept)} kept batch(es) the store had not got); "
        f"resumed run's batch at {resumed_batch_at:.1f} s; total {time.monotonic() - t0:.1f} s"
    )


@pytest.mark.slow
def test_kill_9_of_the_orchestrator_worker_mid_run_leaves_nothing_of_its_sandboxes(tmp_path: Path) -> None:
    """The same for a run an orchestrator worker drives (`"orchestrator": "celery"`): its worker killed
    whole (`kill -9` of its process group), another one takes the run over once its lease lapses, and
    the sandboxes the dead one had on the lane workers are removed."""
    if not answers("127.0.0.1", 5432) or not answers("127.0.0.1", 6379):
        pytest.skip("no Postgres or no Redis answering on 127.0.0.1")
    host = unique_host()
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    with (
        scratch_database("postgres", POSTGRES_URL, tmp_path) as db,
        data_dir() as data,
        processes(tmp_path) as procs,
        CorralClient(url, token=TOKEN, timeout_s=30) as corral,
    ):
        start_lane_workers(procs, host, REDIS_URL)
        env = serve_env(db, port, data, REDIS_URL, host)
        procs.stop("worker-orchestrator")  # started without the database: one that has it drives the run
        orchestrate = [str(CORRAL), "worker", "--orchestrator", "--concurrency", "1", "--loglevel", "info"]
        first = procs.start("orchestrator-1", orchestrate, env)
        start_serve(procs, env)
        wait_for(lambda: healthy(url), 120, f"corral serve to answer; log:\n{procs.tail('serve')}")
        spec = {"name": "orchestrator-kill", "kind": "local", "config": make_local_config(),
                "trainer": "sentinel", "sentinel_step_s": 0.05, "orchestrator": "celery"}  # fmt: skip
        run_id = corral.create_run(**spec)["id"]
        sandboxes = data / run_id / "sandboxes"
        wait_for(lambda: stored_ledger(db, run_id).delivered_count >= 4, 240, "2 batches")
        wait_for(
            lambda: stored_ledger(db, run_id).open_groups and sandbox_names(sandboxes),
            60,
            "a stored group in flight, with sandboxes",
        )
        os.killpg(first.pid, signal.SIGKILL)  # the whole worker: main and pool processes
        first.wait(10)
        procs.procs.pop("orchestrator-1")
        dead = leftovers_of(sandboxes, first.pid)
        assert dead.names
        delivered = stored_ledger(db, run_id).delivered_count

        procs.start("orchestrator-2", orchestrate, env)  # reclaims the run once its lease has lapsed
        wait_for(
            lambda: stored_ledger(db, run_id).delivered_count > delivered,
            240,
            f"a batch of the resumed run; log:\n{procs.tail('orchestrator-2')}",
        )
        with suppress(AssertionError):
            wait_for(lambda: not still_there(dead, sandboxes), 60, "the dead worker's sandboxes to go")
        assert still_there(dead, sandboxes) == []
        corral.stop(run_id)
        wait_for(lambda: corral.run(run_id)["state"] == "stopped", 120, "the run to stop")
        ledger = stored_ledger(db, run_id)
        assert "orphaned" in ledger.discarded
        assert "failed" not in ledger.discarded
        assert not ledger.open_groups
