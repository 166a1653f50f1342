"""The process-group watchdog (mars_openhands/engine/harness/reaper.py): a SIGKILLed owner's
group goes (it stays without the watchdog), and with it what the server started that left the
group (setsid); the watchdog leaves with the group, and a reused pid does not pass for the owner."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from mars_openhands.engine.harness.launch import VllmServerOptions, live_pids_in_group
from mars_openhands.engine.harness.reaper import is_process_alive, process_start_ticks, start_reaper
from tests.proc_tree import (
    assert_ends_with_owner,
    busy_cpus,
    identities,
    kill_leftovers,
    runs_under,
    wait_until,
    with_marker,
)

_OWNER = textwrap.dedent("""
    import subprocess, sys, time
    from mars_openhands.engine.harness.reaper import start_reaper
    child = subprocess.Popen(["sleep", "300"], start_new_session=True)
    if sys.argv[1] == "reap":
        start_reaper(child.pid, 1.0)
    print(child.pid, flush=True)
    time.sleep(300)
""")


def _wait(predicate: object, timeout_s: float) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if predicate():  # type: ignore[operator]
            return True
        time.sleep(0.05)
    return False


def _owner_then_kill(mode: str) -> int:
    """Start an owner (its ``sleep`` group, with or without the watchdog), SIGKILL it; returns
    the group id."""
    repo = Path(__file__).parents[3]
    owner = subprocess.Popen([sys.executable, "-c", _OWNER, mode], stdout=subprocess.PIPE,
                             cwd=repo, env={**os.environ, "PYTHONPATH": str(repo)})
    assert owner.stdout is not None
    pgid = int(owner.stdout.readline())
    assert live_pids_in_group(pgid), "the owner's group runs"
    time.sleep(0.3)  # the watchdog has read the owner's start time
    owner.kill()  # SIGKILL: no atexit, no stop()
    owner.wait()
    return pgid


def _cleanup(pgid: int) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.killpg(pgid, signal.SIGKILL)


def test_a_sigkilled_owners_group_is_killed_by_the_watchdog() -> None:
    pgid = _owner_then_kill("reap")
    try:
        assert _wait(lambda: not live_pids_in_group(pgid), 10.0), live_pids_in_group(pgid)
    finally:
        _cleanup(pgid)


def test_without_the_watchdog_the_group_outlives_its_owner() -> None:
    """The control: what the watchdog is for (so the test above can fail)."""
    pgid = _owner_then_kill("plain")
    try:
        assert not _wait(lambda: not live_pids_in_group(pgid), 1.5)
    finally:
        _cleanup(pgid)


def test_the_watchdog_leaves_with_the_group_and_spares_a_live_owner() -> None:
    group = subprocess.Popen(["sleep", "300"], start_new_session=True)
    reaper = start_reaper(group.pid, 1.0)
    try:
        time.sleep(1.0)
        assert reaper.poll() is None and live_pids_in_group(group.pid), "owner alive: no kill"
        group.kill()
        group.wait()
        assert reaper.wait(timeout=10) == 0
    finally:
        _cleanup(group.pid)
        reaper.kill()


def test_a_pid_is_the_owner_only_with_its_start_time() -> None:
    ticks = process_start_ticks(os.getpid())
    assert ticks is not None and is_process_alive(os.getpid(), ticks)
    assert not is_process_alive(os.getpid(), ticks + 1)  # the pid reused by another process
    assert not is_process_alive(os.getpid(), None)
    assert process_start_ticks(2**22 + 12345) is None


def test_serves_engines_are_reaped_with_their_actor(tmp_path: Path) -> None:
    from mars_openhands.serve.config import ServeConfig
    from mars_openhands.serve.engine import engine_options

    options = engine_options(ServeConfig(num_replicas=1), 0, "127.0.0.1", str(tmp_path), tmp_path)
    assert options.reap_with_owner
    assert VllmServerOptions(model_dir=tmp_path).reap_with_owner  # every server, by default
    assert not VllmServerOptions(model_dir=tmp_path, reap_with_owner=False).reap_with_owner


_OWNER_OF_A_SETSID_CHILD = textwrap.dedent("""
    import subprocess, sys, time
    from mars_openhands.engine.harness.reaper import start_reaper
    marker = sys.argv[1]
    # The stand-in server (its own session, as VllmServer starts it) starts an "engine child" that
    # leaves the group (setsid), then waits: killing the group alone leaves that child running.
    server = subprocess.Popen(["bash", "-c", f"setsid bash -c 'sleep 300; : {marker}' & wait"],
                              start_new_session=True)
    start_reaper(server.pid, 1.0)
    print(server.pid, flush=True)
    time.sleep(300)
""")


@pytest.mark.parametrize("load", ["idle", "busy"])
@pytest.mark.parametrize("repeat", range(2))
def test_a_sigkilled_owners_server_ends_with_what_left_its_group(load: str, repeat: int, tmp_path: Path) -> None:
    """The watchdog ends the server's process tree, not only its group: a child that ``setsid``
    (its own session and group) goes too, with both cores busy as well. Failed before (group kill
    only): the ``setsid`` shell and its ``sleep`` ran on, re-parented to pid 1."""
    repo = Path(__file__).parents[3]
    marker = str(tmp_path / "engine-child")
    owner = subprocess.Popen([sys.executable, "-c", _OWNER_OF_A_SETSID_CHILD, marker], stdout=subprocess.PIPE,
                             cwd=repo, env={**os.environ, "PYTHONPATH": str(repo)})
    started: dict[int, int] = {}
    try:
        with busy_cpus() if load == "busy" else contextlib.nullcontext():
            assert owner.stdout is not None
            pgid = int(owner.stdout.readline())
            assert wait_until(lambda: runs_under(marker, "sleep 300"), 20.0), "the setsid child and its sleep run"
            time.sleep(1.5)  # the watchdog has read the owner's start time and polled the tree
            started = {**identities(live_pids_in_group(pgid)), **with_marker(marker)}
            assert any(os.getpgid(pid) != pgid for pid in with_marker(marker)), "a child left the group"
            assert_ends_with_owner(owner, started, signal.SIGKILL, bound_s=15.0)
    finally:
        kill_leftovers(owner, {**started, **with_marker(marker)})
