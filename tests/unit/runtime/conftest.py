"""Fixtures for the runtime tests: one tasks database per test, on SQLite or PostgreSQL.

``db_url`` is parametrized: ``sqlite`` runs with the unit tests, ``postgres`` (a throwaway cluster
on loopback, started once per session) is marked ``integration``, so the same tests run on both
backends. Without a PostgreSQL server the ``postgres`` leg skips, or fails under CI
(``MARS_REQUIRE_POSTGRES=1``, set by .ci/run).
"""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.unit.runtime.helpers import create_database, postgres_cluster

pytest.importorskip("dbos", reason="needs DBOS Transact (the 'runtime' extra; scripts/setup.sh)")


@pytest.fixture(scope="session")
def postgres_base_url() -> Iterator[str]:
    with postgres_cluster() as url:
        yield url


@pytest.fixture(params=["sqlite", pytest.param("postgres", marks=pytest.mark.integration)])
def db_url(request: pytest.FixtureRequest, tmp_path: Path) -> str:
    """A fresh, empty tasks database on the parametrized backend."""
    if request.param == "sqlite":
        return f"sqlite:///{tmp_path / 'tasks.sqlite'}"
    base = request.getfixturevalue("postgres_base_url")
    return create_database(base, f"mars_{uuid.uuid4().hex[:12]}")
