"""Which processes a test started, by pid and start time from /proc (never by name: other
people's vLLM servers and Ray clusters run on the same machine), and whether they are gone; and
:func:`reap_with_this_process`, which every long-lived server a test starts in its own session
goes through, so that a killed pytest leaves none behind."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path

from mars_openhands.engine.harness.reaper import start_reaper
from mars_openhands.process_tree import descendants, is_process_alive, process_start_ticks  # noqa: F401 (descendants: re-exported for the tests)


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


def with_marker(marker: str) -> dict[int, int]:
    """Live processes whose command line holds ``marker`` (a test's unique temporary path: safe
    on a shared machine), with every process below them: pid -> start time. Finds what left a
    launcher's tree (re-parented to pid 1) and could not be found by parent pid."""
    found: dict[int, int] = {}
    for entry in Path("/proc").iterdir():
        try:
            marked = entry.name.isdigit() and marker.encode() in (entry / "cmdline").read_bytes()
        except OSError:
            continue  # exited while we looked
        if marked:
            pid = int(entry.name)
            if (ticks := process_start_ticks(pid)) is not None:
                found[pid] = ticks
                found.update(descendants(pid))
    return found


def runs_under(marker: str, command_prefix: str) -> bool:
    """Whether a process found by ``with_marker(marker)`` runs a command line that starts with
    ``command_prefix``: waits for a given step of a test's command, not for any marked process
    (the launching shell holds the marker in its own command line before that step starts)."""
    return any(command_line(pid).startswith(command_prefix) for pid in with_marker(marker))


@contextlib.contextmanager
def busy_cpus(count: int = 2, max_s: float = 300.0) -> Iterator[None]:
    """``count`` processes that busy-loop (nice 0) through the block: the load of another job on a
    2-core CI machine. Each also ends by itself after ``max_s`` seconds (a killed pytest leaves
    none for long). Mutates: starts and kills processes."""
    loop = f"import time\nend = time.monotonic() + {max_s}\nwhile time.monotonic() < end: pass"
    procs = [subprocess.Popen([sys.executable, "-c", loop]) for _ in range(count)]
    try:
        yield
    finally:
        for proc in procs:
            proc.kill()
            proc.wait()
