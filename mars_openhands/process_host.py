"""A command that ends, with every process below it, once the process that started it has exited.

The durable-task runtime runs each tool command (``bash -c``, a session of its own) and each
compensation or acceptance command as a child of its runner. A runner killed by SIGKILL (a crash
by design: it is resumed later) ran no cleanup, so the command ran on, re-parented to pid 1: a
``sleep 300`` kept going, and a side-effecting command finished its writes after the crash,
unowned, while the resumed task re-ran it (a read or an idempotent write) or escalated it as in
doubt (an irreversible one) with the original still running. ``PR_SET_PDEATHSIG`` is no fix: it
fires when the forking *thread* exits (the runtime's workflow runs in a thread of its own) and
reaches the one process, not what it started (``setsid``, ``&``).

So the command runs under a host: ``python -m mars_openhands.process_host OWNER_PID -- ARGV...``
(:func:`hosted` builds the equivalent ``python -P -c ...``). The host becomes the subreaper of its descendants
(:func:`~mars_openhands.process_tree.become_subreaper`: a ``setsid``'d or double-forked child stays
in its tree), starts ``ARGV`` with its own stdin, stdout, stderr, working directory and environment,
and waits for whichever comes first: the command's exit (the host exits with its status, ``128 + N``
for signal N; what the command left running in the background stays, as without the host) or the
owner's exit (pidfds, Linux >= 5.3; else a poll every ``POLL_S``), on which it ends the command's
whole tree (:func:`~mars_openhands.process_tree.kill_tree`: SIGTERM, ``GRACE_S`` seconds, freeze,
SIGKILL) and exits with status ``EXIT_OWNER_GONE``; a SIGTERM to the host does the same (status 143). The owner ends a command early (its timeout)
with ``kill_tree(host_pid, 0.0)``, the host included.

Cost: one Python interpreter per command, idle while it waits: about 40 ms of CPU and 50 ms of
wall time more per command than a bare ``bash -c`` (2 shared cores, load 4).
"""

from __future__ import annotations

import os
import select
import signal
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from mars_openhands.process_tree import become_subreaper, kill_tree

__all__ = ["EXIT_OWNER_GONE", "GRACE_S", "POLL_S", "hosted", "main", "run_hosted"]

GRACE_S = 2.0
"""Seconds between the SIGTERM to the command's tree and its SIGKILL, once the owner is gone."""
POLL_S = 0.05
"""Seconds between two checks where pidfds are missing."""
EXIT_OWNER_GONE = 128 + int(signal.SIGKILL)
"""The host's exit status when it ended the command because its owner had exited (nobody reads
it: the owner is gone; it shows in a process accounting log)."""


_BOOT = (f"import sys; sys.path.insert(0, {str(Path(__file__).resolve().parents[1])!r}); "
         "from mars_openhands.process_host import main; sys.exit(main())")
"""The host's ``python -c`` program: this module's :func:`main`, from this checkout."""


def hosted(argv: Sequence[str], owner_pid: int | None = None) -> list[str]:
    """The command line that runs ``argv`` under a host for ``owner_pid`` (default: this process).

    The host imports this very package (its directory first on ``sys.path``; ``-P``: never the
    command's working directory, a workspace that may hold another ``mars_openhands``).

    Returns:
        ``[sys.executable, "-P", "-c", <run main() of this module>, OWNER, "--", *argv]``.
    """
    owner = os.getpid() if owner_pid is None else owner_pid
    return [sys.executable, "-P", "-c", _BOOT, str(owner), "--", *argv]


def run_hosted(argv: Sequence[str], timeout_s: float, **popen: Any) -> tuple[int | None, str]:
    """Run ``argv`` under a host for this process (:func:`hosted`), its stdout and stderr
    together as text; at ``timeout_s`` seconds end the host's whole tree (SIGKILL, frozen first:
    also what the command ``setsid``'d or left in the background).

    Mutates: starts (and may kill) processes. ``popen``: more ``subprocess.Popen`` arguments
    (``cwd``, ``env``, ``start_new_session``).

    Returns:
        ``(exit status, output)``; the status is ``None`` after the timeout.
    """
    proc = subprocess.Popen(hosted(argv), text=True, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            stdin=subprocess.DEVNULL, **popen)
    try:
        out, _ = proc.communicate(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        kill_tree(proc.pid, 0.0)
        out, _ = proc.communicate()
        return None, out or ""
    except BaseException:  # interrupted (KeyboardInterrupt): nothing of it keeps running
        kill_tree(proc.pid, 0.0)
        proc.wait()
        raise
    return proc.returncode, out or ""


def _status(returncode: int) -> int:
    return returncode if returncode >= 0 else 128 - returncode


def _pidfd(pid: int) -> int | None:
    """A pidfd of ``pid``; ``-1`` if it has exited already; ``None`` where pidfds are missing."""
    try:
        return os.pidfd_open(pid)
    except ProcessLookupError:
        return -1
    except (AttributeError, OSError):
        return None


def _owner_left_first(owner_pid: int, child: subprocess.Popen[bytes]) -> bool:
    """Block until ``child`` exits (False) or the owner has exited (True)."""
    owner_fd, child_fd = _pidfd(owner_pid), _pidfd(child.pid)
    if owner_fd == -1 or os.getppid() != owner_pid:
        return True  # gone before we watched it (the pid may be reused since: trust getppid)
    if owner_fd is None or child_fd is None or child_fd == -1:
        while child.poll() is None:
            if os.getppid() != owner_pid:
                return True
            time.sleep(POLL_S)
        return False
    try:
        ready, _, _ = select.select([owner_fd, child_fd], [], [])
        return child_fd not in ready
    finally:
        os.close(owner_fd)
        os.close(child_fd)


def _end_tree_and_exit(signum: int, _frame: object) -> None:
    kill_tree(os.getpid(), GRACE_S, include_root=False)
    os._exit(128 + signum)


def main(argv: list[str] | None = None) -> int:
    """``python -m mars_openhands.process_host OWNER_PID -- ARGV...``; returns the command's exit
    status, or ``EXIT_OWNER_GONE`` once it ended it because the owner had exited.

    Mutates: this process's prctl state; starts the command; signals its tree when the owner is gone.

    Raises:
        SystemExit: wrong arguments (exit code 2, usage on stderr).
    """
    args = sys.argv[1:] if argv is None else argv
    if len(args) < 3 or args[1] != "--" or not args[0].isdigit():
        print("usage: python -m mars_openhands.process_host OWNER_PID -- COMMAND [ARG...]", file=sys.stderr)
        raise SystemExit(2)
    owner_pid = int(args[0])
    become_subreaper()
    # SIGINT from a terminal reaches the command itself (the same group); the host waits for it.
    # SIGTERM to the host (its group's, with the runner's) ends the command's tree first. Both
    # handlers are reset to the default in the command (exec).
    signal.signal(signal.SIGINT, lambda _signum, _frame: None)
    signal.signal(signal.SIGTERM, _end_tree_and_exit)
    child = subprocess.Popen(args[2:])
    if not _owner_left_first(owner_pid, child):
        return _status(child.wait())
    kill_tree(os.getpid(), GRACE_S, include_root=False)
    child.wait()
    return EXIT_OWNER_GONE


if __name__ == "__main__":
    sys.exit(main())
