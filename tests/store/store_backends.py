"""The databases the store tests run on: SQLite, and the real Postgres of this machine."""

from __future__ import annotations

import os

BACKENDS = ("sqlite", "postgres")
POSTGRES_URL = os.environ.get("CORRAL_TEST_POSTGRES_URL", "postgresql+psycopg://postgres@127.0.0.1:5432/test")
