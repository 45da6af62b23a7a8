"""Shared test set-up. Pytest puts this folder on sys.path, so tests import `factories` from it."""

from __future__ import annotations

import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest


@pytest.fixture
def base_dir() -> Iterator[Path]:
    """A directory for local sandboxes, under /tmp rather than tmp_path: sandbox uids must be able to
    reach their work directories (o+x on every parent, which pytest's tmp_path parents lack)."""
    path = Path(tempfile.mkdtemp(prefix="corral-sb-", dir="/tmp"))
    path.chmod(0o711)
    yield path
    shutil.rmtree(path, ignore_errors=True)
