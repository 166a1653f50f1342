"""Fixtures of the eval unit tests."""

from __future__ import annotations

import pytest


@pytest.fixture(scope="module")
def sim():
    """The ``eval.sim`` module (skips when vLLM is missing)."""
    return pytest.importorskip("eval.sim", reason="the sim backend needs vllm")
