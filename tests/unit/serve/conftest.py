"""Fixtures of the serve tests."""

from __future__ import annotations

import signal
from collections.abc import Iterator

import pytest


@pytest.fixture
def restore_handlers() -> Iterator[None]:
    """Put back the SIGINT and SIGTERM handlers a test's ``serve`` start or stop installed."""
    saved = {sig: signal.getsignal(sig) for sig in (signal.SIGINT, signal.SIGTERM)}
    yield
    for sig, handler in saved.items():
        signal.signal(sig, handler)
