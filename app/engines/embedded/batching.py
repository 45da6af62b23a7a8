"""Continuous batching for the embedded engine: one worker thread owns the model.

Invariants:
- Every forward pass and every weight swap runs on the worker thread, between decode steps, so a step
  never sees half-swapped weights.
- Requests join the running batch between decode steps and leave it as soon as they have `max_tokens`
  tokens; the running batch never exceeds `max_batch` sequences.
- While paused no request is admitted and no decode step runs, except that `wait` drains the requests
  that were in flight when it was called. Requests that arrive while paused wait, never fail.
- A request's `weight_version` is the version at its admission: a request that spans a weight update
  (pause `keep`) reports the older version, so staleness is never under-counted.
- Every submitted request is resolved exactly once: completed, aborted (`finish_reason="abort"`), or
  failed with the exception that stopped it.
"""

from __future__ import annotations

import logging
import threading
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future, InvalidStateError
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any, TypeVar

import torch

from app.engines.embedded.model import (
    GREEDY_BELOW,
    PolicyModel,
    choice_logprobs,
    decode,
    policy_logits,
    prefill,
    prompt_ids,
    sample_next,
    sequence_logprobs,
)

log = logging.getLogger(__name__)

T = TypeVar("T")


class PauseMode(StrEnum):
    ABORT = "abort"
    WAIT = "wait"
    KEEP = "keep"


class EngineStopped(RuntimeError):
    """The worker has stopped; the request was not (or will not be) served."""


@dataclass(frozen=True)
class GenerationRequest:
    prompt: str
    max_tokens: int = 16
    temperature: float = 1.0
    candidates: tuple[str, ...] = ()


@dataclass(frozen=True)
class GenerationResult:
    text: str
    finish_reason: str
    prompt_tokens: int
    completion_tokens: int
    weight_version: int
    # Set only for candidate requests that were admitted (scoring happens at admission).
    choice: int | None = None
    logprob: float | None = None
    choice_logprob: float | None = None


@dataclass(eq=False)
class _Sequence:
    request: GenerationRequest
    future: Future[GenerationResult]
    ids: list[int] = field(default_factory=list)
    generated: list[int] = field(default_factory=list)
    state: torch.Tensor | None = None
    logits: torch.Tensor | None = None
    version: int = 0
    choice: int | None = None
    logprob: float | None = None
    choice_logprob: float | None = None


@dataclass(eq=False)
class _Command:
    fn: Callable[[PolicyModel], Any]
    future: Future[Any]


def _settle(future: Future[Any], *, result: Any = None, error: BaseException | None = None) -> None:
    # The client may have cancelled (HTTP disconnect); a cancelled future must not crash the worker.
    try:
        if error is None:
            future.set_result(result)
        else:
            future.set_exception(error)
    except InvalidStateError:
        pass


@dataclass
class BatchStats:
    steps: int = 0
    max_batch_size: int = 0
    last_batch_size: int = 0
    tokens_generated: int = 0
    completed: int = 0
    aborted: int = 0
    failed: int = 0


class BatchEngine:
    """Queue + worker thread. Thread-safe: call `submit`, `pause`, `resume`, `run_on_worker` anywhere."""

    def __init__(
        self, model: PolicyModel, *, seed: int = 0, max_batch: int = 64, weight_version: int = 0
    ) -> None:
        if max_batch < 1:
            raise ValueError(f"max_batch must be >= 1, got {max_batch}")
        self.model = model
        self.max_batch = max_batch
        self._generator = torch.Generator().manual_seed(seed)
        # Re-entrant: abort/finish helpers take the lock and are also called with it held.
        self._cond = threading.Condition(threading.RLock())
        self._queue: deque[_Sequence] = deque()
        self._drain: deque[_Sequence] = deque()  # queued before a `wait` pause: in flight, so drained
        self._running: list[_Sequence] = []  # worker-owned
        self._commands: deque[_Command] = deque()
        self._pause_acks: list[Future[None]] = []
        self._paused = False
        self._pause_mode: PauseMode | None = None
        self._abort_pending = False
        self._stopping = False
        self._weight_version = weight_version
        self._stats = BatchStats()
        self._thread = threading.Thread(target=self._run, name="corral-embedded-worker", daemon=True)

    # --- public API (any thread) ----------------------------------------------------------------

    def start(self) -> None:
        self._thread.start()

    def stop(self, timeout_s: float = 5.0) -> None:
        with self._cond:
            self._stopping = True
            self._cond.notify_all()
        if self._thread.is_alive():
            self._thread.join(timeout_s)

    @property
    def alive(self) -> bool:
        return self._thread.is_alive()

    @property
    def weight_version(self) -> int:
        with self._cond:
            return self._weight_version

    @property
    def paused(self) -> bool:
        with self._cond:
            return self._paused

    def submit(self, request: GenerationRequest) -> Future[GenerationResult]:
        future: Future[GenerationResult] = Future()
        with self._cond:
            if self._stopping:
                raise EngineStopped("the embedded engine is shutting down")
            self._queue.append(_Sequence(request=request, future=future))
            self._cond.notify_all()
        return future

    def pause(self, mode: PauseMode) -> Future[None]:
        """Pause; the future resolves when the pause is in effect (for `wait`: once drained)."""
        ack: Future[None] = Future()
        with self._cond:
            self._paused = True
            self._pause_mode = mode
            if mode is PauseMode.ABORT:
                for seq in [*self._queue, *self._drain]:
                    self._abort(seq)
                self._queue.clear()
                self._drain.clear()
                self._abort_pending = True
            elif mode is PauseMode.WAIT:
                self._drain.extend(self._queue)
                self._queue.clear()
            self._pause_acks.append(ack)
            self._cond.notify_all()
        return ack

    def resume(self) -> None:
        with self._cond:
            self._paused = False
            self._pause_mode = None
            # A `wait` pause still draining ends here; its caller is released.
            self._queue.extendleft(reversed(self._drain))
            self._drain.clear()
            for ack in self._pause_acks:
                _settle(ack)
            self._pause_acks.clear()
            self._cond.notify_all()

    def run_on_worker(self, fn: Callable[[PolicyModel], T]) -> Future[T]:
        """Run `fn(model)` on the worker between decode steps (also while paused)."""
        future: Future[T] = Future()
        with self._cond:
            if self._stopping:
                raise EngineStopped("the embedded engine is shutting down")
            self._commands.append(_Command(fn, future))
            self._cond.notify_all()
        return future

    def set_weight_version(self, version: int) -> None:
        """Only from the worker (inside `run_on_worker`), so admissions see version and weights together."""
        with self._cond:
            self._weight_version = version

    def stats(self) -> dict[str, Any]:
        with self._cond:
            s = self._stats
            return {
                "running": len(self._running),
                "queued": len(self._queue) + len(self._drain),
                "paused": self._paused,
                "pause_mode": None if self._pause_mode is None else self._pause_mode.value,
                "weight_version": self._weight_version,
                "max_batch": self.max_batch,
                "steps": s.steps,
                "max_batch_size": s.max_batch_size,
                "last_batch_size": s.last_batch_size,
                "tokens_generated": s.tokens_generated,
                "completed": s.completed,
                "aborted": s.aborted,
                "failed": s.failed,
            }

    # --- worker ---------------------------------------------------------------------------------

    def _has_work(self) -> bool:
        if self._stopping or self._commands or self._abort_pending or self._pause_acks:
            return True
        if not self._paused:
            return bool(self._queue or self._running)
        return self._pause_mode is PauseMode.WAIT and bool(self._drain or self._running)

    def _run(self) -> None:
        with torch.no_grad():
            while True:
                with self._cond:
                    while not self._has_work():
                        self._cond.wait()
                    if self._stopping:
                        break
                    commands = list(self._commands)
                    self._commands.clear()
                    abort_running = self._abort_pending
                    self._abort_pending = False
                    admit = self._take_admissions()
                    may_step = not self._paused or self._pause_mode is PauseMode.WAIT
                for command in commands:
                    self._execute(command)
                if abort_running:
                    for seq in self._running:
                        self._abort(seq)
                    self._set_running([])
                self._admit(admit)
                if may_step and self._running:
                    self._step_guarded()
                self._acknowledge_pauses()
        self._shutdown()

    def _take_admissions(self) -> list[_Sequence]:
        room = self.max_batch - len(self._running)
        admit: list[_Sequence] = []
        if self._paused:
            if self._pause_mode is PauseMode.WAIT:
                while self._drain and len(admit) < room:
                    admit.append(self._drain.popleft())
            return admit
        while self._queue and len(admit) < room:
            admit.append(self._queue.popleft())
        return admit

    def _execute(self, command: _Command) -> None:
        try:
            result = command.fn(self.model)
        except Exception as exc:
            _settle(command.future, error=exc)
        else:
            _settle(command.future, result=result)

    def _admit(self, seqs: list[_Sequence]) -> None:
        if not seqs:
            return
        version = self.weight_version
        joined: list[_Sequence] = []
        for seq in seqs:
            if seq.future.cancelled():
                continue
            try:
                self._prefill(seq, version)
            except Exception as exc:
                log.exception("embedded engine: prefill failed (prompt of %d chars)", len(seq.request.prompt))
                self._fail(seq, exc)
                continue
            if seq.request.max_tokens == 0:
                self._finish(seq)
            else:
                joined.append(seq)
        self._set_running([*self._running, *joined])

    def _prefill(self, seq: _Sequence, version: int) -> None:
        request = seq.request
        seq.version = version
        seq.ids = prompt_ids(self.model, request.prompt)
        logits, state = prefill(self.model, seq.ids)
        seq.logits, seq.state = logits, state
        if request.candidates:
            summed = sequence_logprobs(self.model, logits, state, request.candidates)
            policy = policy_logits(summed, request.candidates)
            if request.temperature >= GREEDY_BELOW:
                probs = torch.softmax(policy / request.temperature, dim=-1)
                choice = int(torch.multinomial(probs, 1, generator=self._generator).item())
            else:
                choice = int(policy.argmax().item())
            seq.choice = choice
            seq.logprob = float(summed[choice])
            seq.choice_logprob = float(choice_logprobs(policy, request.temperature)[choice])

    def _step_guarded(self) -> None:
        try:
            self._step()
        except Exception as exc:
            # Fault tolerance is the point here: a failed step must not hang every waiting client.
            log.exception("embedded engine: decode step failed for a batch of %d", len(self._running))
            for seq in self._running:
                self._fail(seq, exc)
            self._set_running([])

    def _step(self) -> None:
        batch = [s for s in self._running if not s.future.cancelled()]
        if not batch:
            self._set_running([])
            return
        logits = torch.stack([s.logits for s in batch if s.logits is not None])
        temperatures = torch.tensor([s.request.temperature for s in batch], dtype=torch.float32)
        tokens = sample_next(logits, temperatures, self._generator).tolist()
        still: list[_Sequence] = []
        for seq, token in zip(batch, tokens, strict=True):
            seq.generated.append(int(token))
            if len(seq.generated) >= seq.request.max_tokens:
                self._finish(seq)
            else:
                still.append(seq)
        if still:
            ids = torch.tensor([[s.generated[-1]] for s in still], dtype=torch.long)
            state = torch.stack([s.state for s in still if s.state is not None], dim=1)
            out, new_state = self.model(ids, state)
            for i, seq in enumerate(still):
                seq.logits = out[i, -1]
                seq.state = new_state[:, i]
        with self._cond:
            self._stats.steps += 1
            self._stats.last_batch_size = len(batch)
            self._stats.max_batch_size = max(self._stats.max_batch_size, len(batch))
            self._stats.tokens_generated += len(batch)
        self._set_running(still)

    def _set_running(self, seqs: list[_Sequence]) -> None:
        with self._cond:
            self._running = seqs

    def _acknowledge_pauses(self) -> None:
        with self._cond:
            if not self._pause_acks:
                return
            if self._pause_mode is PauseMode.WAIT and (self._running or self._drain):
                return
            for ack in self._pause_acks:
                _settle(ack)
            self._pause_acks.clear()

    def _result(self, seq: _Sequence, finish_reason: str) -> GenerationResult:
        request = seq.request
        if request.candidates and seq.choice is not None:
            text = request.candidates[seq.choice]
        else:
            text = decode(seq.generated)
        return GenerationResult(
            text=text,
            finish_reason=finish_reason,
            prompt_tokens=max(len(seq.ids) - 1, 0),
            completion_tokens=len(seq.generated),
            weight_version=seq.version if seq.ids else self.weight_version,
            choice=seq.choice,
            logprob=seq.logprob,
            choice_logprob=seq.choice_logprob,
        )

    def _finish(self, seq: _Sequence) -> None:
        reason = "stop" if seq.request.candidates else "length"
        _settle(seq.future, result=self._result(seq, reason))
        with self._cond:
            self._stats.completed += 1

    def _abort(self, seq: _Sequence) -> None:
        _settle(seq.future, result=self._result(seq, "abort"))
        with self._cond:
            self._stats.aborted += 1

    def _fail(self, seq: _Sequence, error: BaseException) -> None:
        _settle(seq.future, error=error)
        with self._cond:
            self._stats.failed += 1

    def _shutdown(self) -> None:
        with self._cond:
            pending = [*self._queue, *self._drain, *self._running]
            self._queue.clear()
            self._drain.clear()
            self._running = []
            commands = list(self._commands)
            self._commands.clear()
            acks = list(self._pause_acks)
            self._pause_acks.clear()
        stopped = EngineStopped("the embedded engine shut down before serving this request")
        for seq in pending:
            _settle(seq.future, error=stopped)
        for command in commands:
            _settle(command.future, error=stopped)
        for ack in acks:
            _settle(ack)
