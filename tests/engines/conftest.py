"""Fixtures for engine client tests: a real stub vLLM server on 127.0.0.1 (see stub_vllm.py)."""

from __future__ import annotations

import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

# tests/ is not a package; this keeps `import stub_vllm` working even if tests/engines becomes one.
sys.path.insert(0, str(Path(__file__).parent))

from stub_vllm import RunningStub, StubState, serve_stub


@pytest.fixture
def stub() -> Iterator[RunningStub]:
    with serve_stub(StubState()) as running:
        yield running
