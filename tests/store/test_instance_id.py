"""The database's own id (`ServiceStore.instance_id`, the `instance` table of migration 0005), which run
directories' tombstones name: one per database, however many processes ask, on SQLite and Postgres."""

from __future__ import annotations

from pathlib import Path

import pytest
from store_backends import BACKENDS, POSTGRES_URL

from app.service.store import ServiceStore
from app.store.db import scratch_database
from app.store.models import Instance


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_database_has_one_id_however_many_ask(backend: str, tmp_path: Path) -> None:
    """Two processes asking a fresh database at once each inserted an id of their own (Postgres), and
    one's tombstones then named an id no later call returned. The table holds one row (key 1)."""
    from sqlalchemy.exc import IntegrityError

    with scratch_database(backend, POSTGRES_URL, tmp_path) as url:
        one, two = ServiceStore(url), ServiceStore(url)
        try:
            assert one.instance_id(create=False) is None  # made when first asked for, not by migration
            first = one.instance_id()
            assert two.instance_id() == first
            with pytest.raises(IntegrityError), two.session() as s:
                s.add(Instance(key=1, id="f" * 32))
            with pytest.raises(IntegrityError), two.session() as s:
                s.add(Instance(key=2, id="f" * 32))
            assert one.instance_id() == first
        finally:
            one.close()
            two.close()
