"""In-process tests of the embedded engine's parts: CPU lists, the policy, checkpoints, batching."""

from __future__ import annotations

import math
import time
from pathlib import Path

import pytest
import torch

from app.engines.embedded.batching import BatchEngine, GenerationRequest, PauseMode
from app.engines.embedded.cpus import CpuListError, format_cpu_list, parse_cpu_list
from app.engines.embedded.model import (
    SENTINEL,
    PolicyConfig,
    PolicyModel,
    candidate_logprobs,
    candidate_sequence_logprobs,
)
from app.engines.embedded.weights import WeightsError, load_checkpoint, save_sentinel, save_weights


def make_model(**overrides: int) -> PolicyModel:
    fields: dict[str, int] = {"layers": 1, "hidden": 16, "seed": 0}
    fields.update(overrides)
    return PolicyModel(PolicyConfig(**fields))


@pytest.mark.parametrize(
    ("text", "cpus"),
    [("0", [0]), ("0,1", [0, 1]), ("0-3", [0, 1, 2, 3]), ("3,0-1,1", [0, 1, 3]), (" 2 ", [2])],
)
def test_parse_cpu_list(text: str, cpus: list[int]) -> None:
    assert parse_cpu_list(text) == cpus


@pytest.mark.parametrize("text", ["", "a", "1-", "3-1", "-1", "0,,1", "1.5"])
def test_parse_cpu_list_refuses_bad_input(text: str) -> None:
    with pytest.raises(CpuListError):
        parse_cpu_list(text)


def test_format_cpu_list_is_the_kernel_format() -> None:
    assert format_cpu_list([3, 0, 1, 2, 7, 9, 10]) == "0-3,7,9-10"


def test_init_is_seeded_and_independent_of_global_rng() -> None:
    torch.manual_seed(123)
    a = make_model(seed=5)
    torch.manual_seed(999)
    b = make_model(seed=5)
    c = make_model(seed=6)
    for name, tensor in a.state_dict().items():
        assert torch.equal(tensor, b.state_dict()[name])
    assert not torch.equal(a.head.weight, c.head.weight)


def test_candidate_logprobs_are_a_distribution_with_gradients() -> None:
    model = make_model()
    logp = candidate_logprobs(model, "$ ls\n", ["pytest -x", "cat README.md", ""])
    assert logp.shape == (3,)
    assert math.isclose(logp.exp().sum().item(), 1.0, rel_tol=1e-5)
    torch.autograd.backward(-logp[0])
    assert model.head.weight.grad is not None
    assert model.head.weight.grad.abs().sum().item() > 0
    assert model.gru.weight_hh_l0.grad is not None


def test_sequence_logprobs_match_token_by_token_scoring() -> None:
    model = make_model()
    with torch.no_grad():
        summed = candidate_sequence_logprobs(model, "ab", ["cd", "e"])
        ids = torch.tensor([[256, *b"abcd"]])
        logits, _ = model(ids)
        logp = torch.log_softmax(logits[0], dim=-1)
        expected = float(logp[2, ord("c")] + logp[3, ord("d")])
    assert math.isclose(float(summed[0]), expected, rel_tol=1e-5)
    assert math.isclose(float(summed[1]), float(logp[2, ord("e")]), rel_tol=1e-5)


def test_a_trainer_step_moves_the_policy_towards_a_rewarded_candidate() -> None:
    model = make_model()
    candidates = ["ls", "pytest", "rm -rf build"]
    optimizer = torch.optim.Adam(model.parameters(), lr=0.1)
    before = candidate_logprobs(model, "fix the test", candidates)[1].item()
    for _ in range(8):
        optimizer.zero_grad()
        loss = -candidate_logprobs(model, "fix the test", candidates)[1]
        torch.autograd.backward(loss)
        optimizer.step()
    assert candidate_logprobs(model, "fix the test", candidates)[1].item() > before + 0.5


def test_checkpoint_round_trip(tmp_path: Path) -> None:
    source = make_model(seed=3)
    save_weights(source, tmp_path)
    loaded = load_checkpoint(tmp_path, make_model(seed=0).state_dict())
    target = make_model(seed=0)
    target.load_state_dict(loaded, strict=True)
    assert torch.equal(target.head.weight, source.head.weight)


def test_checkpoint_refusals(tmp_path: Path) -> None:
    expected = make_model().state_dict()
    with pytest.raises(WeightsError, match="not absolute"):
        load_checkpoint("relative/dir", expected)
    with pytest.raises(WeightsError, match="does not exist"):
        load_checkpoint(tmp_path / "missing", expected)
    with pytest.raises(WeightsError, match=r"no \*\.safetensors"):
        load_checkpoint(tmp_path, expected)

    save_weights(make_model(hidden=24), tmp_path / "shape")
    with pytest.raises(WeightsError, match="has shape"):
        load_checkpoint(tmp_path / "shape", expected)

    save_weights(make_model(layers=2), tmp_path / "extra")
    with pytest.raises(WeightsError, match="tensors the model lacks"):
        load_checkpoint(tmp_path / "extra", expected)

    save_sentinel(tmp_path / "partial", 1.0)
    with pytest.raises(WeightsError, match="lacks"):
        load_checkpoint(tmp_path / "partial", expected)

    half = make_model().half()
    save_weights(half, tmp_path / "dtype")
    with pytest.raises(WeightsError, match="dtype"):
        load_checkpoint(tmp_path / "dtype", expected)

    nan_model = make_model()
    with torch.no_grad():
        nan_model.head.bias[0] = float("nan")
    save_weights(nan_model, tmp_path / "nan")
    with pytest.raises(WeightsError, match="NaN"):
        load_checkpoint(tmp_path / "nan", expected)

    path = save_weights(make_model(), tmp_path / "truncated")
    path.write_bytes(path.read_bytes()[:100])
    with pytest.raises(WeightsError, match="cannot read"):
        load_checkpoint(tmp_path / "truncated", expected)


def test_sentinel_only_checkpoint_loads_with_only(tmp_path: Path) -> None:
    save_sentinel(tmp_path, 4.0)
    loaded = load_checkpoint(tmp_path, make_model().state_dict(), only={SENTINEL})
    assert float(loaded[SENTINEL]) == 4.0


def test_batch_engine_reports_the_older_version_across_a_kept_pause() -> None:
    engine = BatchEngine(make_model(), seed=0, weight_version=1)
    engine.start()
    try:
        future = engine.submit(GenerationRequest("hi", max_tokens=3000, candidates=("a", "b")))
        deadline = time.monotonic() + 5
        while engine.stats()["steps"] == 0 and time.monotonic() < deadline:
            time.sleep(0.001)
        # Admitted under v1, then held: a kept pause lets weights change under an admitted request.
        engine.pause(PauseMode.KEEP).result(timeout=5)
        engine.run_on_worker(lambda _model: engine.set_weight_version(2)).result(timeout=5)
        engine.resume()
        result = future.result(timeout=10)
    finally:
        engine.stop()
    assert result.weight_version == 1
    assert result.finish_reason == "stop"
    assert result.completion_tokens == 3000
    assert engine.weight_version == 2
