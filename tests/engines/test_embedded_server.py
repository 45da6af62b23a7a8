"""The embedded engine as a real process: `python -m app.engines.embedded` on a free 127.0.0.1 port."""

from __future__ import annotations

import asyncio
import os
import socket
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
import torch

from app.engines.base import PauseMode, TurnRequest
from app.engines.embedded.model import (
    PolicyConfig,
    PolicyModel,
    candidate_logprobs,
    candidate_sequence_logprobs,
)
from app.engines.embedded.server import DEFAULT_MODEL_NAME
from app.engines.embedded.weights import save_sentinel, save_weights
from app.engines.errors import TurnAborted
from app.engines.vllm import VLLMEngine

REPO = Path(__file__).resolve().parents[2]
LAYERS, HIDDEN, SEED = 1, 32, 0


@dataclass
class RunningEngine:
    url: str
    process: subprocess.Popen[bytes]
    log: Path


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


@contextmanager
def start_engine(tmp: Path, *extra: str) -> Iterator[RunningEngine]:
    """Start the engine process, wait for /health, and always terminate it."""
    port = free_port()
    log = tmp / f"engine-{port}.log"
    argv = [sys.executable, "-m", "app.engines.embedded", "--port", str(port)]
    argv += ["--layers", str(LAYERS), "--hidden", str(HIDDEN), "--seed", str(SEED), *extra]
    with log.open("wb") as sink:
        process = subprocess.Popen(argv, cwd=REPO, stdout=sink, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 30
        while True:
            if process.poll() is not None:
                pytest.fail(f"engine exited with {process.returncode}: {log.read_text()}")
            try:
                if httpx.get(f"{url}/health", timeout=1).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            if time.monotonic() > deadline:
                pytest.fail(f"engine did not become healthy in 30 s: {log.read_text()}")
            time.sleep(0.1)
        yield RunningEngine(url, process, log)
    finally:
        process.terminate()
        try:
            process.wait(timeout=10)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


@pytest.fixture(scope="module")
def engine(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RunningEngine]:
    with start_engine(tmp_path_factory.mktemp("engine"), "--cpus", "0") as running:
        yield running


@pytest.fixture
def client(engine: RunningEngine) -> Iterator[RunningEngine]:
    """The shared engine, resumed after each test so one test's pause cannot leak into the next."""
    yield engine
    httpx.post(f"{engine.url}/resume", timeout=10).raise_for_status()


def reference_model(seed: int = SEED) -> PolicyModel:
    return PolicyModel(PolicyConfig(layers=LAYERS, hidden=HIDDEN, seed=seed))


def greedy_text(model: PolicyModel, prompt: str, n: int) -> str:
    """What the engine must answer at temperature 0 with `model`'s weights."""
    with torch.no_grad():
        logits, state = model(torch.tensor([[256, *prompt.encode()]]))
        out: list[int] = []
        for _ in range(n):
            token = int(logits[0, -1].argmax())
            out.append(token)
            logits, state = model(torch.tensor([[token]]), state)
    return bytes(out).decode("utf-8", errors="replace")


async def complete(http: httpx.AsyncClient, prompt: str, max_tokens: int, **extra: Any) -> dict[str, Any]:
    response = await http.post("/v1/completions", json={"prompt": prompt, "max_tokens": max_tokens, **extra})
    assert response.status_code == 200, response.text
    body: dict[str, Any] = response.json()
    return body


async def stats(http: httpx.AsyncClient) -> dict[str, Any]:
    body: dict[str, Any] = (await http.get("/stats")).json()
    return body


async def wait_running(http: httpx.AsyncClient, count: int = 1) -> None:
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        s = await stats(http)
        if s["running"] >= count and s["steps"] > 0:
            return
        await asyncio.sleep(0.005)
    pytest.fail("requests never started running")


def make_client(engine: RunningEngine) -> httpx.AsyncClient:
    return httpx.AsyncClient(base_url=engine.url, timeout=30)


async def test_generation_returns_tokens(client: RunningEngine) -> None:
    async with make_client(client) as http:
        body = await complete(http, "$ ls\n", 12)
        models = (await http.get("/v1/models")).json()
    choice = body["choices"][0]
    assert body["object"] == "text_completion"
    assert choice["finish_reason"] == "length"
    assert choice["text"]
    assert "corral" not in choice
    assert body["usage"] == {"prompt_tokens": 5, "completion_tokens": 12, "total_tokens": 17}
    assert models["data"][0]["id"] == "corral-embedded"


async def test_greedy_generation_is_the_reference_models(client: RunningEngine) -> None:
    async with make_client(client) as http:
        body = await complete(http, "hello", 20, temperature=0)
    assert body["choices"][0]["text"] == greedy_text(reference_model(), "hello", 20)


async def test_bad_requests_are_4xx_json(client: RunningEngine) -> None:
    async with make_client(client) as http:
        wrong_model = await http.post("/v1/completions", json={"model": "other", "prompt": "x"})
        negative = await http.post("/v1/completions", json={"prompt": "x", "max_tokens": -1})
        bad_mode = await http.post("/pause", params={"mode": "later"})
        not_paused = (await http.get("/is_paused")).json()
    assert wrong_model.status_code == 404
    assert "does not exist" in wrong_model.json()["error"]["message"]
    assert negative.status_code == 400
    assert bad_mode.status_code == 400
    assert "later" in bad_mode.json()["error"]
    assert not_paused == {"is_paused": False}


@pytest.mark.parametrize("candidates", [None, ["a", "b"]])
async def test_a_tiny_temperature_is_greedy_and_fails_no_one_else(
    client: RunningEngine, candidates: list[str] | None
) -> None:
    """Logits divided by 1e-40 overflowed to inf: a 500, and the decode step it broke failed every turn
    in the batch with it. Below `GREEDY_BELOW` a temperature is greedy, as vLLM's is."""
    extra = {} if candidates is None else {"candidates": candidates}
    async with make_client(client) as http:
        other = asyncio.create_task(complete(http, "another client", 16000))
        await wait_running(http)
        tiny = await complete(http, "hello", 20, temperature=1e-40, **extra)
        greedy = await complete(http, "hello", 20, temperature=0, **extra)
        assert not other.done(), "the other turn should still be running beside the tiny temperature"
        await http.post("/pause", params={"mode": "abort"})
        aborted = await other
    assert aborted["choices"][0]["finish_reason"] == "abort"
    assert tiny["choices"][0]["text"] == greedy["choices"][0]["text"]
    assert tiny["choices"][0].get("corral") == greedy["choices"][0].get("corral")


@pytest.mark.parametrize("temperature", ["Infinity", "-Infinity", "NaN", "1e999"])
async def test_a_temperature_that_is_not_finite_is_a_400(client: RunningEngine, temperature: str) -> None:
    # Infinity was taken, and sampled uniformly, as if it were a temperature.
    async with make_client(client) as http:
        for route, body in [
            ("/v1/completions", '{"prompt": "x", "temperature": %s}'),
            ("/v1/chat/completions", '{"messages": [{"role": "user", "content": "x"}], "temperature": %s}'),
        ]:
            answer = await http.post(
                route, content=body % temperature, headers={"Content-Type": "application/json"}
            )
            assert answer.status_code == 400, answer.text
            assert "temperature" in answer.json()["error"]["message"]


async def test_new_request_joins_a_running_batch(client: RunningEngine) -> None:
    async with make_client(client) as http:
        long_turn = asyncio.create_task(complete(http, "long", 16000))
        await wait_running(http)
        short = await complete(http, "short", 5)
        assert not long_turn.done(), "the short request should finish while the long one still runs"
        during = await stats(http)
        assert (await http.post("/pause", params={"mode": "abort"})).json() == {"status": "paused"}
        aborted = await long_turn
    assert short["choices"][0]["finish_reason"] == "length"
    assert during["max_batch_size"] >= 2
    assert aborted["choices"][0]["finish_reason"] == "abort"
    assert 0 < aborted["usage"]["completion_tokens"] < 16000


async def test_the_client_takes_a_turn_aborted_by_a_pause_for_an_error(client: RunningEngine) -> None:
    """Through Corral's own client: the partial text of an aborted request used to come back as the turn."""
    async with (
        VLLMEngine("e0", client.url, DEFAULT_MODEL_NAME, timeout_s=30) as engine,
        make_client(client) as http,
    ):
        turn = asyncio.create_task(engine.generate(TurnRequest(prompt="long", max_tokens=16000)))
        await wait_running(http)
        await engine.pause(PauseMode.ABORT)
        with pytest.raises(TurnAborted, match=r"aborted after \d+ tokens"):
            await turn


async def test_requests_queued_while_paused_run_as_one_batch(client: RunningEngine) -> None:
    async with make_client(client) as http:
        await http.post("/pause", params={"mode": "keep"})
        turns = [asyncio.create_task(complete(http, f"p{i}", 30)) for i in range(4)]
        await asyncio.sleep(0.3)
        assert not any(t.done() for t in turns), "requests sent while paused must wait, not fail"
        assert (await stats(http))["queued"] == 4
        assert (await http.post("/resume")).json() == {"status": "resumed"}
        results = await asyncio.gather(*turns)
        after = await stats(http)
    assert all(r["usage"]["completion_tokens"] == 30 for r in results)
    assert after["max_batch_size"] >= 4


async def test_candidates_choice_matches_the_trainer_function(client: RunningEngine) -> None:
    candidates = ["pytest -x", "ls", "cat setup.py"]
    async with make_client(client) as http:
        greedy = await complete(http, "run tests", 8, temperature=0, candidates=candidates)
        sampled = [
            await complete(http, "run tests", 2, temperature=1.0, candidates=candidates) for _ in range(3)
        ]
    choice = greedy["choices"][0]
    with torch.no_grad():
        policy = candidate_logprobs(reference_model(), "run tests", candidates)
        summed = candidate_sequence_logprobs(reference_model(), "run tests", candidates)
    expected = int(policy.argmax())
    assert choice["corral"]["choice"] == expected
    assert choice["text"] == candidates[expected]
    assert choice["finish_reason"] == "stop"
    assert choice["corral"]["weight_version"] == 0
    assert choice["corral"]["logprob"] == pytest.approx(float(summed[expected]), abs=1e-4)
    assert choice["corral"]["choice_logprob"] == pytest.approx(float(policy[expected]), abs=1e-4)
    assert greedy["usage"]["completion_tokens"] == 8, "a candidate turn still generates max_tokens tokens"
    for body in sampled:
        c = body["choices"][0]
        assert c["text"] == candidates[c["corral"]["choice"]]


async def test_pause_keep_freezes_then_resume_completes(client: RunningEngine) -> None:
    async with make_client(client) as http:
        turn = asyncio.create_task(complete(http, "keep me", 3000))
        await wait_running(http)
        await http.post("/pause", params={"mode": "keep"})
        frozen = (await stats(http))["steps"]
        await asyncio.sleep(0.3)
        assert (await stats(http))["steps"] == frozen, "no decode step may run under pause keep"
        assert (await http.get("/is_paused")).json() == {"is_paused": True}
        assert not turn.done()
        await http.post("/resume")
        body = await turn
    assert body["choices"][0]["finish_reason"] == "length"
    assert body["usage"]["completion_tokens"] == 3000


async def test_pause_wait_drains_in_flight_requests(client: RunningEngine) -> None:
    async with make_client(client) as http:
        turn = asyncio.create_task(complete(http, "drain me", 1500))
        await wait_running(http)
        completed = (await stats(http))["completed"]
        await http.post("/pause", params={"mode": "wait"})
        drained = await stats(http)
        assert drained["running"] == 0, "pause?mode=wait returns only after in-flight requests finish"
        assert drained["completed"] == completed + 1
        late = asyncio.create_task(complete(http, "late", 3))
        await asyncio.sleep(0.2)
        assert not late.done()
        await http.post("/resume")
        assert (await late)["choices"][0]["finish_reason"] == "length"
    assert (await turn)["usage"]["completion_tokens"] == 1500


def test_process_is_pinned(engine: RunningEngine) -> None:
    status = Path(f"/proc/{engine.process.pid}/status").read_text()
    assert "Cpus_allowed_list:\t0\n" in status
    for task in Path(f"/proc/{engine.process.pid}/task").iterdir():
        assert "Cpus_allowed_list:\t0\n" in (task / "status").read_text(), (
            f"thread {task.name} escaped the pin"
        )
    body = httpx.get(f"{engine.url}/stats", timeout=5).json()
    assert body["cpus"] == "0"
    assert body["torch_threads"] == 1


@pytest.mark.parametrize("cpus", ["3-1", "zero", "0,,1", str(os.cpu_count() or 1) + "-4096"])
def test_bad_cpu_list_exits_2_without_traceback(cpus: str) -> None:
    run = subprocess.run(
        [sys.executable, "-m", "app.engines.embedded", "--port", str(free_port()), "--cpus", cpus],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert run.returncode == 2, run.stderr
    assert "--cpus" in run.stderr
    assert "Traceback" not in run.stderr


# --- weights ------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def weights_engine(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RunningEngine]:
    with start_engine(tmp_path_factory.mktemp("weights")) as running:
        yield running


async def publish(http: httpx.AsyncClient, path: Path | None, version: str) -> list[httpx.Response]:
    info = {} if path is None else {"path": str(path)}
    return [
        await http.post("/init_weight_transfer_engine", json={"init_info": {}}),
        await http.post("/start_weight_update", json={}),
        await http.post("/update_weights", json={"update_info": info}),
        await http.post("/finish_weight_update", json={"weight_version": version}),
    ]


async def test_weight_update_then_corrupt_directories_are_refused(
    weights_engine: RunningEngine, tmp_path: Path
) -> None:
    new = reference_model(seed=7)
    save_weights(new, tmp_path / "v3")
    truncated = save_weights(reference_model(seed=8), tmp_path / "truncated")
    truncated.write_bytes(truncated.read_bytes()[:-64])
    save_weights(PolicyModel(PolicyConfig(layers=LAYERS, hidden=HIDDEN + 8)), tmp_path / "shapes")
    expected_text = greedy_text(new, "abc", 16)

    async with make_client(weights_engine) as http:
        assert (await http.get("/weight_info")).json()["weight_version"] == "0"
        answers = await publish(http, tmp_path / "v3", "3")
        assert [r.status_code for r in answers] == [200, 200, 200, 200], [r.text for r in answers]
        assert (await http.get("/weight_info")).json()["weight_version"] == "3"
        body = await complete(http, "abc", 16, temperature=0, candidates=["a", "b"])
        assert body["choices"][0]["corral"]["weight_version"] == 3
        assert (await complete(http, "abc", 16, temperature=0))["choices"][0]["text"] == expected_text

        for bad, needle in [
            ("truncated", "cannot read"),
            ("shapes", "has shape"),
            ("missing", "does not exist"),
        ]:
            assert (await http.post("/start_weight_update", json={})).status_code == 200
            refused = await http.post("/update_weights", json={"update_info": {"path": str(tmp_path / bad)}})
            assert refused.status_code == 400, refused.text
            assert needle in refused.json()["error"]
            finish = await http.post("/finish_weight_update", json={"weight_version": "4"})
            assert finish.status_code == 409, "a refused update must not be finishable"
            assert (await http.get("/weight_info")).json()["weight_version"] == "3"
            assert (await complete(http, "abc", 16, temperature=0))["choices"][0]["text"] == expected_text

        assert (await http.post("/update_weights", json={"update_info": {"path": "/x"}})).status_code == 409
        assert (await http.post("/start_weight_update", json={})).status_code == 200
        assert (await http.post("/start_weight_update", json={})).status_code == 409
        assert (await http.post("/update_weights", json={})).status_code == 400
        bad_version = await http.post("/finish_weight_update", json={"weight_version": "step-5"})
        assert bad_version.status_code == 400
        answers = await publish(http, tmp_path / "v3", "5")
        assert answers[1].status_code == 409  # still in the session opened above
        assert [answers[2].status_code, answers[3].status_code] == [200, 200]
        assert (await http.get("/weight_info")).json()["weight_version"] == "5"
        assert (await http.post("/reset_prefix_cache")).status_code == 200


@pytest.mark.parametrize(
    "version",
    ["٣", "³", "３", "3.0", "+3", "-3", " 3", "1_000", "9" * 5000, "", -1, 3.0, True, None, [3],
     str(2**63), 2**63, "99999999999999999999999"],  # over an int64, which --weight-version is held to
)  # fmt: skip
async def test_a_weight_version_not_in_ascii_digits_is_a_400(
    weights_engine: RunningEngine, version: Any
) -> None:
    # str.isdigit() took '٣' as version 3, and '³' passed it but made int() raise: a 500.
    async with make_client(weights_engine) as http:
        current = (await http.get("/weight_info")).json()["weight_version"]
        assert (await http.post("/start_weight_update", json={})).status_code in (200, 409)
        answer = await http.post("/finish_weight_update", json={"weight_version": version})
        assert answer.status_code == 400, answer.text
        assert "ASCII digits" in answer.json()["error"]
        assert (await http.get("/weight_info")).json()["weight_version"] == current
        # Close the session on the version the engine serves, as the next test expects.
        closed = await http.post("/finish_weight_update", json={"weight_version": current})
        assert closed.status_code == 200, closed.text


async def test_sentinel_mode_swaps_only_the_marker(tmp_path_factory: pytest.TempPathFactory) -> None:
    tmp = tmp_path_factory.mktemp("sentinel")
    save_sentinel(tmp / "s", 11.0)
    save_weights(reference_model(seed=9), tmp / "full")
    with start_engine(tmp, "--sentinel") as running:
        async with make_client(running) as http:
            before = (await complete(http, "abc", 16, temperature=0))["choices"][0]["text"]
            assert all(r.status_code == 200 for r in await publish(http, tmp / "s", "1"))
            info = (await http.get("/weight_info")).json()
            assert info == {
                "weight_version": "1",
                "updating": False,
                "sentinel": True,
                "sentinel_value": 11.0,
            }
            # A full checkpoint still swaps only the sentinel in this mode.
            assert all(r.status_code == 200 for r in await publish(http, tmp / "full", "2"))
            assert all(r.status_code == 200 for r in await publish(http, None, "3"))
            info = (await http.get("/weight_info")).json()
            assert (info["weight_version"], info["sentinel_value"]) == ("3", 3.0)
            after = (await complete(http, "abc", 16, temperature=0))["choices"][0]["text"]
    assert after == before == greedy_text(reference_model(), "abc", 16)


# --- through Corral's client ----------------------------------------------------------------------


async def test_driven_through_vllm_engine(tmp_path: Path) -> None:
    from app.engines.base import PauseMode, TurnRequest
    from app.engines.vllm import VLLMEngine

    save_weights(reference_model(seed=4), tmp_path / "v1")
    with start_engine(tmp_path) as running:
        async with VLLMEngine("embedded-0", running.url, "corral-embedded", timeout_s=30) as client:
            assert await client.health()
            plain = await client.generate(TurnRequest(prompt="hi", max_tokens=7))
            assert (plain.tokens, plain.weight_version, plain.choice) == (7, 0, None)
            turn = await client.generate(TurnRequest(prompt="hi", max_tokens=3, candidates=("ls", "pwd")))
            assert turn.choice in (0, 1)
            assert turn.text == ("ls", "pwd")[turn.choice]
            assert turn.logprob is not None

            # A turn that spans a rolling update (pause keep → publish → resume) reports the older version.
            spanning = asyncio.create_task(
                client.generate(TurnRequest(prompt="span", max_tokens=2000, candidates=("a", "b")))
            )
            async with httpx.AsyncClient(base_url=running.url) as http:
                await wait_running(http)
            await client.pause(PauseMode.KEEP)
            assert await client.is_paused()
            await client.publish_weights(1, str(tmp_path / "v1"))
            await client.resume()
            assert (await spanning).weight_version == 0
            assert await client.weight_version() == 1
            after = await client.generate(TurnRequest(prompt="x", max_tokens=2, candidates=("a", "b")))
            assert after.weight_version == 1
