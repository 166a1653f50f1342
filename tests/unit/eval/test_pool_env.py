"""The sweep's worker server starts with vLLM's import-time warnings off, and only it does
(eval/pool.py): compare's first output line is its own, and the user's setting wins."""

from __future__ import annotations

import multiprocessing

import pytest

import eval.pool as pool


@pytest.mark.skipif("forkserver" not in multiprocessing.get_all_start_methods(), reason="no forkserver here")
def test_the_worker_server_gets_vllm_logging_at_error_only_while_it_starts(monkeypatch) -> None:
    from multiprocessing import forkserver

    seen = []
    monkeypatch.setattr(forkserver, "ensure_running", lambda: seen.append(pool.os.environ.get("VLLM_LOGGING_LEVEL")))
    monkeypatch.delenv("VLLM_LOGGING_LEVEL", raising=False)
    assert pool.start_worker_server() == "forkserver"
    assert seen == ["ERROR"] and "VLLM_LOGGING_LEVEL" not in pool.os.environ
    monkeypatch.setenv("VLLM_LOGGING_LEVEL", "DEBUG")
    pool.start_worker_server()
    assert seen[-1] == "DEBUG" and pool.os.environ["VLLM_LOGGING_LEVEL"] == "DEBUG"
