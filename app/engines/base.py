"""The Engine port: what the runtime needs from a serving engine.

One client speaks to both kinds of real engine (a `vllm serve` process and Corral's embedded torch
engine, which serves the same HTTP surface); the simulator supplies its own implementation.

Invariant: `generate` reports the weight version that produced the turn. When a turn spans a weight
update (pause with mode `keep`), the version reported is the older one, so staleness is never
under-counted.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Protocol

from app.core.events import fast_frozen_init


class PauseMode(StrEnum):
    """How an engine treats its in-flight requests when paused (vLLM's `/pause?mode=`)."""

    ABORT = "abort"
    WAIT = "wait"
    KEEP = "keep"


@fast_frozen_init  # built once a turn: without a frozen dataclass's `object.__setattr__` per field
@dataclass(frozen=True)
class TurnRequest:
    """One model turn. `candidates`, when given, asks the engine to choose among them by logits."""

    prompt: str
    max_tokens: int = 64
    temperature: float = 1.0
    candidates: tuple[str, ...] = ()
    # Simulated costs (seconds) read only by simulated engines.
    meta: Mapping[str, float] = field(default_factory=dict)


@fast_frozen_init
@dataclass(frozen=True)
class TurnResult:
    text: str
    weight_version: int
    tokens: int
    choice: int | None = None
    logprob: float | None = None


class Engine(Protocol):
    """A serving engine. Implementations: `VLLMEngine` (HTTP), `SimEngine` (virtual time)."""

    name: str

    async def generate(self, request: TurnRequest) -> TurnResult: ...

    async def pause(self, mode: PauseMode) -> None: ...

    async def resume(self) -> None: ...

    async def publish_weights(self, version: int, path: str | None) -> None:
        """Load weights `version` (from the safetensors directory `path` where the engine needs one)."""
        ...

    async def weight_version(self) -> int: ...

    async def health(self) -> bool: ...

    async def aclose(self) -> None: ...
