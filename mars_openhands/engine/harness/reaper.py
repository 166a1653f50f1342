"""A watchdog that kills a server's process group, and every process below it, when its owner
dies without cleaning up.

:class:`~.launch.VllmServer` runs vLLM in its own process group and tears it down in ``stop()``
(also at interpreter exit). A SIGKILLed owner runs neither: under ``mars-openhands serve`` Ray
kills a replica's actor that way, and its vLLM server, engine core and worker kept running,
holding the port, the memory and (on a GPU node) the GPU; so did a ``compare`` that ``timeout``
SIGTERMed. With ``reap_with_owner`` (on by default) the server starts this watchdog (``python -m mars_openhands.engine.harness.reaper OWNER_PID PGID
TIMEOUT_S``): a small process in its own session, so a signal to the owner's group does not reach
it, and, as :class:`~.launch.VllmServer` starts it (:func:`start_detached_reaper`), no child of the
owner, so the owner's own exit path does not take it either: a Ray worker that exits (``ray.kill``:
Ray Serve's force-stop of a replica whose graceful shutdown overran or that it replaces; a worker
its raylet stops) first SIGKILLs its direct children (Ray's ``core_worker_shutdown_executor.cc``,
"Try killing all child processes of this worker as it exits"), which were the API server *and*
this watchdog, and the engine core below them ran on for good, re-parented to pid 1. The watchdog
polls every ``POLL_INTERVAL_S`` whether the owner still lives, and once it does not,
SIGTERMs the group and its process tree (also a child that left the group with ``setsid``:
:func:`~mars_openhands.process_tree.kill_tree`, and one seen in the tree at an earlier poll
and re-parented since), freezes and SIGKILLs the survivors after ``TIMEOUT_S`` and exits. It also exits when the
group is gone (``stop()`` ran, or the server died by itself).

Why not ``PR_SET_PDEATHSIG``: it fires when the *thread* that forked the child exits, and Ray
may construct an actor on a thread that does not outlive the constructor; it also reaches only
the API server, not the engine-core and worker processes of its group.

Cost: one small Python process per server, reading ``/proc/<pid>/stat`` of every process twice
each poll (the group, then the tree below it: about 4 ms of CPU per poll with ~100 processes on
the machine).

Mental model: the owner's identity is its pid *and* its start time (``/proc/<pid>/stat`` field
22), so a pid reused by an unrelated process still reads as the owner's death.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time

from mars_openhands.process_tree import descendants, is_process_alive, process_start_ticks

__all__ = ["POLL_INTERVAL_S", "is_process_alive", "main", "process_start_ticks",
           "start_detached_reaper", "start_reaper", "stop_detached_reaper"]

POLL_INTERVAL_S = 0.5
"""Seconds between two checks of the owner (a dead owner's group goes within about this)."""


def _command(pgid: int, timeout_s: float, owner_pid: int | None, *flags: str) -> list[str]:
    """The watchdog's command line (``owner_pid`` ``None``: this process). Pure."""
    owner = os.getpid() if owner_pid is None else owner_pid
    return [sys.executable, "-m", "mars_openhands.engine.harness.reaper", *flags, str(owner),
            str(pgid), str(timeout_s)]


def start_reaper(pgid: int, timeout_s: float, owner_pid: int | None = None) -> subprocess.Popen[bytes]:
    """Start the watchdog of process group ``pgid`` for ``owner_pid`` (default: this process).

    Mutates: spawns a process (in its own session, output discarded).

    Args:
        pgid: the group to kill when the owner dies.
        timeout_s: seconds between its SIGTERM and SIGKILL.
        owner_pid: the process whose death triggers it.

    Returns:
        The watchdog (stop it with ``terminate()`` once the group is gone).
    """
    return subprocess.Popen(_command(pgid, timeout_s, owner_pid), stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL, start_new_session=True)


def start_detached_reaper(pgid: int, timeout_s: float,
                          owner_pid: int | None = None) -> tuple[int, int | None]:
    """Start the watchdog of :func:`start_reaper`, detached: a launcher forks it and exits, so it
    is re-parented to pid 1 (or to the nearest subreaper above this process: not a Ray worker) and
    no process that kills the owner's children takes it (Ray's worker exit path: module
    docstring). Not a child, it cannot be waited for: :func:`stop_detached_reaper` ends it.

    Mutates: spawns a process (in its own session, output discarded) and waits for its launcher
    (a Python start-up: about 0.1 s).

    Args:
        pgid: the group to kill when the owner dies.
        timeout_s: seconds between its SIGTERM and SIGKILL.
        owner_pid: the process whose death triggers it (default: this process).

    Returns:
        ``(pid, start ticks)`` of the watchdog; ticks ``None`` if it has left already (the
        group was gone, or the owner had died and it did its job).

    Raises:
        RuntimeError: the launcher did not report the watchdog's pid within 60 s.
    """
    launcher = subprocess.Popen(_command(pgid, timeout_s, owner_pid, "--detach"), stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                                stderr=subprocess.DEVNULL, start_new_session=True)
    try:
        out, _ = launcher.communicate(timeout=60.0)
        pid = int(out)
    except (subprocess.TimeoutExpired, ValueError):
        launcher.kill()
        launcher.wait()
        raise RuntimeError(f"the watchdog of process group {pgid} did not start (launcher "
                           f"exit code {launcher.returncode})") from None
    return pid, process_start_ticks(pid)


def stop_detached_reaper(pid: int, start_ticks: int | None, timeout_s: float = 5.0) -> None:
    """SIGTERM the watchdog ``pid`` (if it is still the process that started at ``start_ticks``)
    and wait until it is gone, at most ``timeout_s`` seconds. Call it once the group is gone (it
    would leave by itself within ``POLL_INTERVAL_S``).

    Mutates: signals a process.
    """
    if is_process_alive(pid, start_ticks):
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.kill(pid, signal.SIGTERM)
    deadline = time.monotonic() + timeout_s
    while is_process_alive(pid, start_ticks) and time.monotonic() < deadline:
        time.sleep(0.02)


def watch(owner_pid: int, pgid: int, timeout_s: float) -> bool:
    """Poll until the group is gone (False) or the owner died, then kill the group and every
    process below it (True). Each poll remembers the tree (pid and start time), so a process
    that left the group (``setsid``) and then lost its parent (re-parented to pid 1, out of any
    later walk from the group) still ends with the server."""
    from mars_openhands.engine.harness.launch import live_pids_in_group, terminate_server_tree

    start_ticks = process_start_ticks(owner_pid)
    seen: dict[int, int] = {}
    while group := live_pids_in_group(pgid):
        seen = {pid: ticks for pid, ticks in seen.items() if is_process_alive(pid, ticks)}
        seen.update(descendants(*group))
        if not is_process_alive(owner_pid, start_ticks):
            terminate_server_tree(pgid, timeout_s, also=seen)
            return True
        time.sleep(POLL_INTERVAL_S)
    return False


def main(argv: list[str] | None = None) -> int:
    """``python -m mars_openhands.engine.harness.reaper [--detach] OWNER_PID PGID TIMEOUT_S``;
    returns 0. With ``--detach`` it forks, prints the watching child's pid and exits at once.

    Raises:
        SystemExit: wrong arguments (exit code 2, usage on stderr).
    """
    args = sys.argv[1:] if argv is None else argv
    is_detached = args[:1] == ["--detach"]
    args = args[1:] if is_detached else args
    if len(args) != 3:
        print("usage: python -m mars_openhands.engine.harness.reaper [--detach] OWNER_PID PGID "
              "TIMEOUT_S", file=sys.stderr)
        raise SystemExit(2)
    if is_detached:
        child = os.fork()  # this launcher is single-threaded: a plain fork is safe
        if child:
            print(child, flush=True)
            os._exit(0)
        os.dup2(os.open(os.devnull, os.O_WRONLY), 1)  # the launcher's reader waits for EOF
    watch(int(args[0]), int(args[1]), float(args[2]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
