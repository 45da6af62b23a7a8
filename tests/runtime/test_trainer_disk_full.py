"""`corral run`'s built-in trainer on a disk that fills up: its weights are written once there is room
again (a real full file system, `small_disk`)."""

from __future__ import annotations

import asyncio
import logging
import threading
from pathlib import Path

import pytest
from factories import wait_for
from small_disk import fill, small_disk

from app.core.scheduler import DeliverBatch
from app.engines.embedded.model import SENTINEL
from app.engines.embedded.weights import CHECKPOINT_FILE, read_tensors
from app.runtime.ports import TrainingBatch
from app.runtime.trainer import SentinelTrainer

EMPTY = TrainingBatch(DeliverBatch(0, (), 0), {})


def test_weights_the_full_disk_refuses_are_written_once_it_has_room(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Before, the step raised safetensors' "I/O error: No space left on device" into the run, which
    ended with a traceback and no report (measured: a `corral run` whose disk filled after batch 1), and
    the part of the file written stayed, holding the space."""
    caplog.set_level(logging.WARNING, "app.outputs")
    with small_disk(tmp_path / "disk", 1) as disk:
        weights = disk / "weights"
        (weights / "v1").mkdir(parents=True)
        filler = fill(disk)
        trainer = SentinelTrainer(0.0, weights)
        result: list[str | None] = []
        step = threading.Thread(target=lambda: result.append(asyncio.run(trainer.step(EMPTY, 1))))
        step.start()
        try:
            wait_for(lambda: "the disk refuses it" in caplog.text, 30, what="the refusal logged")
            assert [p.name for p in (weights / "v1").iterdir()] == []  # no partial file left
        finally:
            filler.unlink()
            step.join(30)
        assert result == [str(weights / "v1")]
        assert float(read_tensors(weights / "v1")[SENTINEL]) == 1.0
        assert [p.name for p in (weights / "v1").iterdir()] == [CHECKPOINT_FILE]
    assert "trainer: weights v1: written after" in caplog.text


def test_a_stop_ends_a_step_the_full_disk_holds_with_nothing_to_publish(tmp_path: Path) -> None:
    with small_disk(tmp_path / "disk", 1) as disk:
        fill(disk)
        stopping = threading.Event()
        trainer = SentinelTrainer(0.0, disk / "weights", stopping.is_set)
        result: list[str | None] = []
        step = threading.Thread(target=lambda: result.append(asyncio.run(trainer.step(EMPTY, 1))))
        step.start()
        stopping.set()
        step.join(30)
    assert result == [None]
