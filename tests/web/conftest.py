"""Shared set-up of the dashboard's browser tests (test_browser.py, test_browser_faults.py)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest


@pytest.fixture(scope="module")
def browser() -> Iterator[object]:
    """Debian's Chromium driven by Playwright, for one test module (its tests skip without either)."""
    from test_browser import ARGS, CHROMIUM, sync_api

    with sync_api.sync_playwright() as p:
        chromium = p.chromium.launch(executable_path=CHROMIUM, args=ARGS)
        yield chromium
        chromium.close()
