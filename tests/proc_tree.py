"""Which processes a test started, by pid and start time from /proc (never by name: other
people's vLLM servers and Ray clusters run on the same machine), and whether they are gone; and
:func:`reap_with_this_process`, which every long-lived server a test starts in its own session
goes through, so that a killed pytest leaves none behind."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import time
from collections.abc import Callable
from pathlib import Path

from mars_openhands.engine.harness.reaper import is_process_alive, process_start_ticks, start_reaper


def _children() -> dict[int, list[int]]:
    """ppid -> pids of every process now."""
    tree: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                ppid = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue  # exited while we looked
            tree.setdefault(ppid, []).append(int(entry.name))
    return tree


def descendants(pid: int) -> dict[int, int]:
    """Every live descendant of ``pid``: pid -> start time in clock ticks (its identity)."""
    tree, found, todo = _children(), {}, [pid]
    while todo:
        for child in tree.get(todo.pop(), []):
            ticks = process_start_ticks(child)
            if ticks is not None:
                found[child] = ticks
                todo.append(child)
    return found


def identities(pids: list[int]) -> dict[int, int]:
    """pid -> start time of the live ones of ``pids``."""
    return {pid: ticks for pid in pids if (ticks := process_start_ticks(pid)) is not None}


def alive(processes: dict[int, int]) -> list[int]:
    """The pids of ``processes`` still running as the same process (not zombies, not reused)."""
    return sorted(pid for pid, ticks in processes.items() if is_process_alive(pid, ticks))


def wait_until(predicate: Callable[[], object], timeout_s: float, interval_s: float = 0.1) -> bool:
    """Poll ``predicate`` until true or ``timeout_s``; returns its last truth value."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(interval_s)
    return bool(predicate())


def kill_alive(processes: dict[int, int]) -> None:
    """SIGKILL what is left of ``processes`` (only the same pid with the same start time)."""
    for pid in alive(processes):
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)


def command_line(pid: int) -> str:
    """The command line of process ``pid`` (at most 200 characters), or "" if it is gone."""
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")[:200]
    except OSError:
        return ""


def assert_ends_with_owner(owner: subprocess.Popen[bytes], started: dict[int, int], sig: signal.Signals,
                           bound_s: float, owner_timeout_s: float = 30.0) -> None:
    """Send ``sig`` to ``owner``, wait for it to exit, and assert that every process of ``started``
    (pid -> start time) has ended within ``bound_s`` seconds after that."""
    owner.send_signal(sig)
    owner.wait(timeout=owner_timeout_s)
    assert wait_until(lambda: not alive(started), bound_s), (
        f"{sig.name} to pid {owner.pid}: still running {alive(started)} of {sorted(started)}: "
        + "; ".join(f"{pid} {command_line(pid)!r}" for pid in alive(started)))


def kill_leftovers(owner: subprocess.Popen[bytes], started: dict[int, int]) -> None:
    """A test's ``finally``: SIGKILL ``owner`` and what is left of ``started``."""
    owner.kill()
    owner.wait()
    kill_alive(started)


def reap_with_this_process(pgid: int, timeout_s: float = 10.0) -> subprocess.Popen[bytes]:
    """Kill process group ``pgid`` (a server a test started with ``start_new_session=True``:
    ``serve`` with its Ray cluster, a gateway, the OpenHands app, PostgreSQL) once this process
    dies without stopping it (pytest killed, even by SIGKILL): SIGTERM, then SIGKILL after
    ``timeout_s``, by the watchdog of ``mars_openhands/engine/harness/reaper.py``. The watchdog
    leaves by itself once the group is gone, so the test's own teardown needs no change.

    Returns:
        The watchdog process.
    """
    return start_reaper(pgid, timeout_s)
