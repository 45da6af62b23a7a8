"""The embedded engine's policy: a small GRU language model over bytes, plus candidate scoring.

Invariants:
- Same `PolicyConfig` (layers, hidden, seed) ⇒ bit-identical initial weights, regardless of the global
  torch RNG state (initialisation draws from a forked RNG).
- Tokens are bytes 0..255; input id 256 is BOS, always prepended to a prompt, so an empty prompt and an
  empty candidate are well defined. The head predicts bytes only, so sampling never yields BOS.
- `candidate_logprobs` is differentiable: a trainer calls it with grad enabled and back-propagates a
  GRPO loss through it. It is exactly the distribution the engine samples a candidate from:
  softmax over candidates of (per-byte mean log-probability / temperature).
- The registered buffer `corral_sentinel` is part of the state dict (and of every checkpoint); in
  sentinel mode a weight update swaps only this tensor.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import nn

BYTE_VOCAB = 256
BOS = 256
INPUT_VOCAB = BYTE_VOCAB + 1
SENTINEL = "corral_sentinel"
# Temperatures below this sample greedily, as vLLM's `_SAMPLING_EPS` does: logits divided by a smaller
# one (1e-40 is a float32 denormal) overflow to inf, the probabilities are NaN, and the decode step failed
# for every sequence in its batch, other clients' turns included.
GREEDY_BELOW = 1e-5


@dataclass(frozen=True)
class PolicyConfig:
    """Model size and initialisation; latency grows with layers × hidden²."""

    layers: int = 2
    hidden: int = 64
    seed: int = 0
    # Longer prompts are cut from the left: prefill cost stays bounded whatever the transcript length.
    max_prompt_tokens: int = 2048

    def __post_init__(self) -> None:
        if self.layers < 1:
            raise ValueError(f"layers must be >= 1, got {self.layers}")
        if self.hidden < 1:
            raise ValueError(f"hidden must be >= 1, got {self.hidden}")
        if self.max_prompt_tokens < 1:
            raise ValueError(f"max_prompt_tokens must be >= 1, got {self.max_prompt_tokens}")


class PolicyModel(nn.Module):
    """Embedding → multi-layer GRU → linear head over bytes. Recurrent state is the whole context,
    so a sequence's decode state is one `[layers, hidden]` tensor, which makes batching trivial."""

    corral_sentinel: torch.Tensor

    def __init__(self, config: PolicyConfig) -> None:
        super().__init__()
        self.config = config
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(config.seed)
            self.embed = nn.Embedding(INPUT_VOCAB, config.hidden)
            self.gru = nn.GRU(config.hidden, config.hidden, num_layers=config.layers, batch_first=True)
            self.head = nn.Linear(config.hidden, BYTE_VOCAB)
        self.register_buffer(SENTINEL, torch.zeros((), dtype=torch.float32))

    def forward(
        self, ids: torch.Tensor, state: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """`ids` [batch, time] → (logits [batch, time, 256], state [layers, batch, hidden])."""
        out, new_state = self.gru(self.embed(ids), state)
        return self.head(out), new_state

    def initial_state(self, batch: int) -> torch.Tensor:
        return torch.zeros(self.config.layers, batch, self.config.hidden)


def encode(text: str) -> list[int]:
    return list(text.encode("utf-8"))


def decode(ids: Sequence[int]) -> str:
    return bytes(ids).decode("utf-8", errors="replace")


def prompt_ids(model: PolicyModel, prompt: str) -> list[int]:
    """BOS + the last `max_prompt_tokens` bytes of the prompt."""
    return [BOS, *encode(prompt)[-model.config.max_prompt_tokens :]]


def prefill(model: PolicyModel, ids: Sequence[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """Run a prompt; return (next-token logits [256], state [layers, hidden])."""
    logits, state = model(torch.tensor([list(ids)], dtype=torch.long))
    return logits[0, -1], state[:, 0]


def sequence_logprobs(
    model: PolicyModel, last_logits: torch.Tensor, state: torch.Tensor, candidates: Sequence[str]
) -> torch.Tensor:
    """[n] summed log-probability of each candidate's bytes continuing a prefilled prompt.

    `last_logits` [256] predicts the first candidate byte; `state` [layers, hidden] is the prompt's state.
    """
    encoded = [encode(c) for c in candidates]
    n = len(encoded)
    longest = max((len(e) for e in encoded), default=0)
    if n == 0:
        return torch.zeros(0)
    if longest == 0:
        return last_logits.new_zeros(n)
    padded = torch.zeros(n, longest, dtype=torch.long)
    mask = torch.zeros(n, longest, dtype=torch.bool)
    for i, e in enumerate(encoded):
        padded[i, : len(e)] = torch.tensor(e, dtype=torch.long)
        mask[i, : len(e)] = True
    first = last_logits.expand(n, 1, BYTE_VOCAB)
    if longest > 1:
        # Padding sits after each candidate's last byte, so causality keeps it out of real positions.
        rest, _ = model(padded[:, :-1], state.unsqueeze(1).expand(-1, n, -1).contiguous())
        all_logits = torch.cat([first, rest], dim=1)
    else:
        all_logits = first
    logp = torch.log_softmax(all_logits, dim=-1).gather(-1, padded.unsqueeze(-1)).squeeze(-1)
    return (logp * mask).sum(dim=1)


def policy_logits(summed: torch.Tensor, candidates: Sequence[str]) -> torch.Tensor:
    """Per-byte mean log-probability: the candidate policy's logits.

    Summed log-probabilities would make the policy pick the shortest candidate almost surely (each
    byte costs ~log 256 nats at init), leaving a GRPO group no variance to learn from.
    """
    lengths = torch.tensor([max(len(encode(c)), 1) for c in candidates], dtype=summed.dtype)
    return summed / lengths


def choice_logprobs(logits: torch.Tensor, temperature: float = 1.0) -> torch.Tensor:
    """Log-probabilities of picking each candidate (a greedy temperature, below `GREEDY_BELOW`, is
    scored as temperature 1)."""
    return torch.log_softmax(logits / (temperature if temperature >= GREEDY_BELOW else 1.0), dim=-1)


def candidate_sequence_logprobs(model: PolicyModel, prompt: str, candidates: Sequence[str]) -> torch.Tensor:
    """[n] summed log-probability of each candidate's bytes given `prompt` (differentiable)."""
    last_logits, state = prefill(model, prompt_ids(model, prompt))
    return sequence_logprobs(model, last_logits, state, candidates)


def candidate_logprobs(
    model: PolicyModel, prompt: str, candidates: Sequence[str], temperature: float = 1.0
) -> torch.Tensor:
    """[n] log π(candidate | prompt) under the engine's candidate policy; differentiable.

    This is the distribution the engine samples its `corral.choice` from (its `corral.choice_logprob`
    is this tensor at the choice), so a GRPO trainer computes its ratio and loss from it.
    """
    summed = candidate_sequence_logprobs(model, prompt, candidates)
    return choice_logprobs(policy_logits(summed, candidates), temperature)


def sample_next(logits: torch.Tensor, temperatures: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
    """One token per row of `logits` [batch, 256]; rows with a temperature below `GREEDY_BELOW` (0
    included) are greedy."""
    greedy = logits.argmax(dim=-1)
    sampling = temperatures >= GREEDY_BELOW
    safe_t = torch.where(sampling, temperatures, torch.ones_like(temperatures))
    probs = torch.softmax(logits / safe_t.unsqueeze(-1), dim=-1)
    sampled = torch.multinomial(probs, 1, generator=generator).squeeze(-1)
    return torch.where(sampling, sampled, greedy)
