"""`corral run`'s progress lines: each engine reported as it answers /health, start-up failures raised as
themselves (not wrapped in an exception group), and plain text even for names holding `[`."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

import pytest
from rich.console import Console

from app.runtime.config import LocalRunConfig, LocalRunError
from app.runtime.progress import RunProgress


@dataclass
class FakeEngine:
    port: int


@dataclass
class FakeEngines:
    """The two things RunProgress reads from EngineProcesses: the engines' ports and wait_healthy."""

    engines: dict[str, FakeEngine]
    wait_s: float = 0.3
    error: Exception | None = None
    waited: list[bool] = field(default_factory=list)
    exited_at_start: dict[str, str] = field(default_factory=dict)

    async def wait_healthy(self) -> None:
        await asyncio.sleep(self.wait_s)
        self.waited.append(True)
        if self.error is not None:
            raise self.error


async def answer_health(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    await reader.readuntil(b"\r\n\r\n")
    writer.write(b"HTTP/1.1 200 OK\r\ncontent-length: 0\r\nconnection: close\r\n\r\n")
    await writer.drain()
    writer.close()


@pytest.fixture
async def health_port() -> AsyncIterator[int]:
    server = await asyncio.start_server(answer_health, "127.0.0.1", 0)
    async with server:
        yield int(server.sockets[0].getsockname()[1])


def make_progress() -> tuple[RunProgress, Console]:
    console = Console(record=True, width=200)
    return RunProgress(console, batches=2), console


async def test_each_engine_is_reported_ready_with_its_url(health_port: int) -> None:
    progress, console = make_progress()
    engines = FakeEngines({"engine-0": FakeEngine(health_port)})
    await progress.wait_for_engines(engines, every_s=0.05)
    text = console.export_text()
    assert f"engine-0 ready on http://127.0.0.1:{health_port}" in text
    assert "all 1 engines ready" in text
    assert engines.waited == [True]


async def test_an_engine_that_died_at_start_is_not_reported_ready(health_port: int) -> None:
    progress, console = make_progress()
    dead = FakeEngine(health_port + 1 if health_port < 65535 else health_port - 1)
    engines = FakeEngines(
        {"engine-0": FakeEngine(health_port), "engine-1": dead},
        exited_at_start={"engine-1": "exited with -9 during start-up"},
    )
    await progress.wait_for_engines(engines, every_s=0.05)
    text = console.export_text()
    assert "engine-0 ready on" in text
    assert "engine-1 ready" not in text
    assert "1 of 2 engines ready" in text


async def test_a_start_up_failure_is_raised_as_itself(health_port: int) -> None:
    progress, console = make_progress()
    engines = FakeEngines(
        {"engine-0": FakeEngine(health_port)}, error=LocalRunError("engine-0 exited with 1")
    )
    with pytest.raises(LocalRunError, match="exited with 1"):
        await progress.wait_for_engines(engines, every_s=0.05)
    assert "all 1 engines ready" not in console.export_text()


def test_starting_lines_name_cpus_and_lanes() -> None:
    progress, console = make_progress()
    config = LocalRunConfig.model_validate({"engines": {"count": 2, "cpus": [0]}, "lanes": {"cpus": [1]}})
    progress.starting(config, [0], pinned_lanes=True)
    progress.starting(config, [0, 1], pinned_lanes=False)
    text = console.export_text()
    assert "starting 2 embedded engines on CPUs 0 (8 turns each at once" in text
    assert "sandbox lanes (slots: reset 2, exec 2, validate 1, cleanup 1) on CPUs 1" in text
    assert "starting 2 embedded engines on CPUs 0-1" in text
    assert "sharing every CPU with serving" in text


def test_status_line_between_batches_counts_turns_attempts_and_ready_groups(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from app.core.events import AttemptFinished, BatchDelivered, Envelope, GroupReady, TurnDone
    from app.runtime import progress as progress_module

    progress, console = make_progress()
    progress.starting(LocalRunConfig.model_validate({}), [0], pinned_lanes=True)
    monkeypatch.setattr(progress_module, "STATUS_EVERY_S", 3600.0)
    turn = TurnDone(
        group_id=1, attempt=0, engine="engine-0", version=0, queued_at=0, start=0, end=1, tokens=4
    )
    for seq, event in enumerate([turn, turn, AttemptFinished(group_id=1, attempt=0, reward=1.0)]):
        progress.on_envelope(Envelope("run", seq, 0.0, event))
    assert "collecting" not in console.export_text(clear=False)  # nothing printed within the interval
    monkeypatch.setattr(progress_module, "STATUS_EVERY_S", 0.0)
    progress.on_envelope(Envelope("run", 3, 0.0, GroupReady(group_id=1)))
    assert (
        "collecting batch 1: 1 of 4 groups ready, 1 attempt finished, 2 turns and 0 sandbox operations"
        in console.export_text(clear=False)
    )
    progress.on_envelope(Envelope("run", 4, 3.0, BatchDelivered(0, (1,), 1, 0.0, 2.0, staleness=(0,))))
    progress.on_envelope(Envelope("run", 5, 3.0, turn))
    assert (
        "collecting batch 2: 0 of 4 groups ready, 1 attempt finished, 3 turns and 0 sandbox operations"
        in console.export_text()
    )


def test_a_lane_resize_and_a_live_policy_change_each_get_a_line() -> None:
    from app.core.events import Envelope, LaneResized, PolicyChanged

    progress, console = make_progress()
    progress.starting(LocalRunConfig.model_validate({}), [0], pinned_lanes=True)
    why = "5 queued, 0.80 idle cores, ~0.12 cores an operation"
    progress.on_envelope(Envelope("run", 0, 1.0, LaneResized("reset", 2, 3, 2, why)))
    progress.on_envelope(Envelope("run", 1, 2.0, PolicyChanged("max_staleness", 2, 3, "operator")))
    text = console.export_text()
    assert f"lane reset: 2 → 3 slots (configured 2; {why})" in text
    assert "max_staleness changed from 2 to 3 by operator" in text


def test_a_refused_update_does_not_say_the_engine_left_rotation() -> None:
    # An engine that refuses weights serves on (docs/faults.md); the line said it left rotation.
    from app.core.events import EngineUpdateEnd, Envelope

    progress, console = make_progress()
    refused = EngineUpdateEnd("engine-0", 3, ok=False, error="HTTP 400: 'lacks 7 tensors'", refused=True)
    progress.on_envelope(Envelope("run", 0, 1.0, refused))
    progress.on_envelope(Envelope("run", 1, 2.0, EngineUpdateEnd("engine-1", 3, ok=False, error="timed out")))
    text = console.export_text()
    assert (
        "engine-0 failed to load policy version 3, refused by the engine, which serves on at its version: "
        "HTTP 400: 'lacks 7 tensors'"
    ) in text
    assert "engine-0 failed to load policy version 3 and left rotation" not in text
    assert "engine-1 failed to load policy version 3 and left rotation: timed out" in text
