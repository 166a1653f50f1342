"""The crash matrix (test_crash_matrix.py) on PostgreSQL, in a file of its own so that the two
~70 s legs run on different pytest-xdist workers (``make integration`` distributes by file)."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.unit.runtime.test_crash_matrix import (
    test_kill_at_every_step_boundary_completes_without_duplicates as crash_matrix,
)

pytestmark = [pytest.mark.integration, pytest.mark.timeout(600)]


@pytest.mark.parametrize("db_url", ["postgres"], indirect=True)
def test_kill_at_every_step_boundary_completes_without_duplicates_on_postgres(db_url: str,
                                                                            tmp_path: Path) -> None:
    crash_matrix(db_url, tmp_path)
