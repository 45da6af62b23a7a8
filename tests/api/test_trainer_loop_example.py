"""examples/trainer_loop.py (the README's trainer loop) against a live server."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import httpx
import pytest
from api_support import TOKEN, make_run, make_settings, serving, wait_for
from proc_children import reaped

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "trainer_loop.py"
SHORT_LEASE_S = 1.5  # ack_timeout_s of `short_lease_server`: a step of a few seconds outlasts it


def example_argv(url: str, run_id: str, *args: str) -> list[str]:
    return [sys.executable, str(EXAMPLE), "--url", url, "--run", run_id, "--token", TOKEN, *args]


def run_example(url: str, run_id: str, *args: str) -> subprocess.CompletedProcess[str]:
    """examples/trainer_loop.py on `run_id` at `url`, from the repository root, as its docstring runs it."""
    argv = example_argv(url, run_id, *args)
    return subprocess.run(argv, capture_output=True, text=True, timeout=120, cwd=EXAMPLE.parents[1])


@contextmanager
def training_on_batch_0(url: str, run_id: str, train_s: int, *args: str) -> Iterator[subprocess.Popen[str]]:
    """The example in a session of its own (as a terminal starts it), once it says it holds batch 0 and
    trains on it for `train_s`; reaped on the way out."""
    argv = example_argv(url, run_id, "--train-s", str(train_s), *args)
    trainer = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                               cwd=EXAMPLE.parents[1], start_new_session=True)  # fmt: skip
    with reaped(trainer):
        assert trainer.stdout is not None
        training = trainer.stdout.readline()
        assert training == f"batch 0: training for {train_s} s\n", (training, trainer.stderr)
        yield trainer


@pytest.fixture(scope="module")
def short_lease_server(tmp_path_factory: pytest.TempPathFactory, backend_url: str) -> Iterator[str]:
    settings = make_settings(tmp_path_factory.mktemp("short-lease"), backend_url, ack_timeout_s=SHORT_LEASE_S)
    with serving(settings) as url:
        yield url


def test_the_readme_trainer_loop_trains_on_three_batches(server: str, api: httpx.Client) -> None:
    run_id = api.post("/api/runs", json=make_run(batches=None)).json()["id"]
    done = run_example(server, run_id, "--steps", "3")
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    assert [line.split(":")[0] for line in lines] == ["batch 0", "batch 1", "batch 2"]
    assert lines[-1].endswith("published v3")
    assert api.get(f"/api/runs/{run_id}").json()["live"]["trainer_version"] == 3
    # The run goes on (a fourth batch may be waiting, unacked); the three it handed out were acked.
    assert api.get(f"/api/runs/{run_id}/metrics").json()["trainer"]["acked"] == 3
    api.post(f"/api/runs/{run_id}/stop")


def test_the_readme_and_the_api_docs_show_the_example_as_it_is() -> None:
    code = EXAMPLE.read_text()
    body = code[code.index("import argparse") :]
    for doc in ("README.md", "docs/api.md"):
        text = (EXAMPLE.parents[1] / doc).read_text()
        assert f"```python\n{body}```\n" in text, f"{doc} shows another trainer loop than {EXAMPLE.name}"


def test_the_examples_command_line_runs_as_written_outside_the_virtualenv() -> None:
    """Its docstring's command, typed from the repository root in a shell whose PATH has no virtualenv."""
    usage = next(line for line in EXAMPLE.read_text().splitlines() if "examples/trainer_loop.py" in line)
    command = usage[: usage.index(" --run")] + " --help"
    done = subprocess.run(
        command,
        shell=True,
        capture_output=True,
        text=True,
        timeout=60,
        cwd=EXAMPLE.parents[1],
        env={"PATH": "/usr/local/bin:/usr/bin:/bin"},
    )
    assert done.returncode == 0, f"{command}: {done.stderr}"
    assert "--token" in done.stdout


def test_the_loop_ends_cleanly_on_a_run_that_ended_while_it_held_a_batch(
    server: str, api: httpx.Client
) -> None:
    # The run ended with a batch offered and not acked (a Ctrl-C of the trainer, or of corral serve,
    # mid-step): the server offers it again, as documented, and the loop's publish was refused with
    # RunEnded (409), which it raised; every rerun crashed the same way, and the batch stayed unacked.
    run_id = api.post("/api/runs", json=make_run(batches=None)).json()["id"]
    held = api.get(f"/api/runs/{run_id}/batches/next", params={"timeout": 60})
    assert held.status_code == 200, held.text
    assert api.post(f"/api/runs/{run_id}/stop").status_code == 200
    wait_for(lambda: api.get(f"/api/runs/{run_id}").json()["state"] == "stopped", what="stopped")
    done = run_example(server, run_id, "--steps", "3")
    assert done.returncode == 0, done.stderr
    assert "Traceback" not in done.stderr
    assert [line.split(":")[0] for line in done.stdout.splitlines()] == [f"batch {held.json()['index']}"]
    # nothing was published: the line said "published v1" all the same
    unpublished = f"v{held.json()['publish_version']} not published: the run has ended"
    assert done.stdout.rstrip().endswith(unpublished)
    again = api.get(f"/api/runs/{run_id}/batches/next", params={"timeout": 1})
    assert again.status_code == 409, again.text  # acked: nothing is offered again, the run has ended


def test_a_ctrl_c_while_the_example_trains_hands_its_batch_back_for_the_next_trainer_at_once(
    server: str, api: httpx.Client
) -> None:
    """A trainer stopped with Ctrl-C in its terminal (SIGINT to its process group) while it trains:
    before, its batch stayed leased for `ack_timeout_s` (30 s on this server, 60 s by default) and the
    next trainer waited that long; it printed a traceback too. Now it hands the batch back and exits 130,
    and the next `batches/next` gets the same batch at once, as delivery 2."""
    run_id = api.post("/api/runs", json=make_run(batches=None)).json()["id"]
    with training_on_batch_0(server, run_id, 120) as trainer:
        time.sleep(0.5)
        os.killpg(trainer.pid, signal.SIGINT)
        out, err = trainer.communicate(timeout=30)
    assert trainer.returncode == 130, err
    assert "Traceback" not in err, err
    assert out.splitlines() == ["batch 0: handed back untrained"]  # after the line read above
    asked = time.monotonic()
    again = api.get(f"/api/runs/{run_id}/batches/next", params={"timeout": 20})
    assert again.status_code == 200, again.text
    assert (again.json()["index"], again.json()["delivery"]) == (0, 2)
    assert time.monotonic() - asked < 10  # not the 30 s lease
    api.post(f"/api/runs/{run_id}/stop")


def test_release_answers_for_the_holder_only_and_refuses_what_it_cannot_release(api: httpx.Client) -> None:
    run_id = api.post("/api/runs", json=make_run(batches=None)).json()["id"]
    held = api.get(f"/api/runs/{run_id}/batches/next", params={"timeout": 60}).json()
    url = f"/api/runs/{run_id}/batches/{held['batch_id']}/release"
    for bad in ({}, {"delivery": 0}, {"delivery": "1"}, {"delivery": 2**31}, {"delivery": 1, "x": 1}):
        refused = api.post(url, json=bad)
        assert refused.status_code == 422, (bad, refused.text)
        assert "delivery" in refused.json()["detail"] or "x" in refused.json()["detail"]
    assert httpx.post(api.base_url.join(url), json={"delivery": 1}).status_code == 401  # no token
    assert api.post(url, json={"delivery": 2}).json() == {
        "batch_id": held["batch_id"], "released": False, "delivery": 1,
        "detail": "it has been handed out 1 time(s), not 2",
    }  # fmt: skip
    assert api.post(url, json={"delivery": 1}).json()["released"] is True
    again = api.get(f"/api/runs/{run_id}/batches/next", params={"timeout": 5}).json()
    assert (again["batch_id"], again["delivery"]) == (held["batch_id"], 2)
    assert api.post(f"/api/runs/{run_id}/batches/{held['batch_id']}/ack").status_code == 200
    acked = api.post(url, json={"delivery": 2})
    assert acked.status_code == 409
    assert "is acked" in acked.json()["detail"]
    unknown = api.post(f"/api/runs/{run_id}/batches/{run_id}-b999/release", json={"delivery": 1})
    assert unknown.status_code == 404
    assert api.post("/api/runs/nope/batches/nope-b0/release", json={"delivery": 1}).status_code == 404
    api.post(f"/api/runs/{run_id}/stop")


def test_the_example_renews_its_lease_so_a_step_longer_than_the_lease_is_not_handed_out_twice(
    short_lease_server: str,
) -> None:
    """A step of 6 s on leases of 1.5 s: the batch was handed out to the next trainer as the lease ran
    out, while the example still trained on it. It renews the lease every third of it as it trains, so
    a second trainer's long-poll over two leases gets nothing (204), and the example acks the batch."""
    with httpx.Client(base_url=short_lease_server, headers={"Authorization": f"Bearer {TOKEN}"}) as api:
        run_id = api.post("/api/runs", json=make_run(batches=None)).json()["id"]
        # it holds batch 0 (the run offers one at a time)
        with training_on_batch_0(short_lease_server, run_id, 6, "--steps", "1") as trainer:
            timeout = 2 * SHORT_LEASE_S + 0.5  # over, by far, before the step ends and batch 1 is offered
            second = api.get(f"/api/runs/{run_id}/batches/next", params={"timeout": timeout}, timeout=30)
            assert second.status_code == 204, second.text
            out, err = trainer.communicate(timeout=60)
        assert trainer.returncode == 0, err
        assert "Traceback" not in err, err
        [line] = out.splitlines()  # its step's line alone: no "lease not renewed"
        assert line.startswith("batch 0: ")
        assert line.endswith(", published v1")
        trainer_metrics = api.get(f"/api/runs/{run_id}/metrics").json()["trainer"]
        assert (trainer_metrics["acked"], trainer_metrics["redelivered"]) == (1, 0)
        api.post(f"/api/runs/{run_id}/stop")
