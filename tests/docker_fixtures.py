"""The sandbox tests' docker fixtures (tests/sandboxes/conftest.py: the daemon that answers, or a private
dockerd, and the busybox image built for it) for tests in other directories, which that conftest does not
reach. A test module binds the fixture to its own name: `docker_client = docker_fixtures.docker_client`."""

from __future__ import annotations

import importlib.util
from pathlib import Path

_spec = importlib.util.spec_from_file_location(
    "corral_sandbox_fixtures", Path(__file__).resolve().parent / "sandboxes" / "conftest.py"
)
assert _spec is not None
assert _spec.loader is not None
_fixtures = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(_fixtures)
docker_client = _fixtures.docker_client
TEST_IMAGE = _fixtures.TEST_IMAGE
