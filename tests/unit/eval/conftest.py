"""Fixtures of the eval unit tests."""

from __future__ import annotations

import pytest


@pytest.fixture(scope="module")
def sim():
    """The ``eval.sim`` module (skips when vLLM is missing)."""
    return pytest.importorskip("eval.sim", reason="the sim backend needs vllm")


@pytest.fixture(autouse=True)
def _private_cache(tmp_path_factory, monkeypatch):
    """compare's content-hash cache goes to a per-test folder, never to the user's ~/.cache."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path_factory.mktemp("xdg-cache")))
