"""SIGTERM as a normal exit for command lines that start child processes.

Python's default SIGTERM action ends the process at once: no ``finally`` block and no ``atexit``
handler runs, so a vLLM server in its own process group
(:class:`~mars_openhands.engine.harness.launch.VllmServer`) outlived a ``compare`` that ``timeout``
killed, re-parented to pid 1. Inside :func:`sigterm_exits` the first SIGTERM raises
:class:`Terminated` (a ``SystemExit`` with status 143, ``128 + SIGTERM``) in the main thread, so
the command unwinds as on any other exit: its ``finally`` blocks and ``with`` exits stop what it
started, then ``atexit`` stops what is left. Further SIGTERMs are ignored while that teardown runs
(a second one would abort it half-way); SIGKILL still ends the process, and each server's
watchdog (:mod:`mars_openhands.engine.harness.reaper`) then kills its group.

SIGINT needs nothing: Python raises ``KeyboardInterrupt``, which unwinds the same way.

Every ``mars-openhands`` subcommand runs inside it (``eval/cli.py``), and so do the standalone
entry points that start servers (``python -m mars_openhands.openhands.cli``, the benchmarks),
except a subcommand whose parser sets ``sigterm_is_crash=True``: ``tasks``, whose runner, killed,
is resumed like a crashed one (``mars-openhands tasks resume``), and whose workflow runs in a
thread of its own: unwinding the main thread under it tore DBOS down beneath the running workflow,
which then failed over to compensation. Its only children are tool commands, each in a session of
its own, ended at their timeout.

The other direction, for a child that must not outlive a parent that may be SIGKILLed (nothing
runs in the parent then): :func:`end_with_parent`, which the child runs (the fake engine, each
``openhands run`` task). The engine's servers use a watchdog process instead
(:mod:`mars_openhands.engine.harness.reaper`): vLLM is not our code to add a thread to.
"""

from __future__ import annotations

import contextlib
import os
import select
import signal
import threading
import time
from collections.abc import Iterator
from types import FrameType

__all__ = ["EXIT_TERMINATED", "Terminated", "end_with_parent", "sigterm_exits"]

EXIT_TERMINATED = 128 + int(signal.SIGTERM)
"""Exit status after SIGTERM (143), the status a shell reports for a process SIGTERM ended."""


class Terminated(SystemExit):
    """Raised in the main thread by SIGTERM inside :func:`sigterm_exits`; exits with status 143."""

    def __init__(self) -> None:
        super().__init__(EXIT_TERMINATED)


@contextlib.contextmanager
def sigterm_exits() -> Iterator[None]:
    """Within the block, SIGTERM raises :class:`Terminated` in the main thread (once; later
    SIGTERMs are ignored until the block is left); the previous handler is restored on leaving.

    Mutates: the process's SIGTERM handler (only from the main thread; elsewhere, e.g. a command
    run in a test's worker thread, the block runs unchanged: only the main thread may set one).

    Raises:
        Terminated: SIGTERM arrived within the block (propagates out of it).
    """
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    fired = False

    def on_sigterm(_signum: int, _frame: FrameType | None) -> None:
        nonlocal fired
        if fired:
            return  # teardown is under way: let it finish
        fired = True
        raise Terminated()

    previous = signal.signal(signal.SIGTERM, on_sigterm)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


def end_with_parent(parent_pid: int, grace_s: float = 10.0, poll_s: float = 0.5) -> threading.Thread:
    """Start a daemon thread that ends this process once process ``parent_pid`` (the one that
    started it) has exited, even by SIGKILL: SIGTERM, then SIGKILL after ``grace_s`` seconds; to
    this process's whole group where it leads one (a process started with
    ``start_new_session=True``: its tools go with it), else to this process alone (never to a
    group it shares with its parent's other children). ``parent_pid`` already gone ends it at once.

    Mutates: signals this process (or its group) when the parent is gone.

    Returns:
        The started thread.
    """

    def watch() -> None:
        _wait_for_exit(parent_pid, poll_s)
        leads_group = os.getpgrp() == os.getpid()
        for sig in (signal.SIGTERM, signal.SIGKILL):
            if leads_group:
                os.killpg(0, sig)
            else:
                os.kill(os.getpid(), sig)
            time.sleep(grace_s)

    thread = threading.Thread(target=watch, name="end-with-parent", daemon=True)
    thread.start()
    return thread


def _wait_for_exit(pid: int, poll_s: float) -> None:
    """Block until process ``pid`` has exited: its pidfd turns readable (Linux >= 5.3; immune to
    the pid's reuse), else ``kill(pid, 0)`` every ``poll_s`` seconds."""
    try:
        fd = os.pidfd_open(pid)
    except ProcessLookupError:
        return
    except (AttributeError, OSError):  # no pidfd here
        while True:
            try:
                os.kill(pid, 0)
            except ProcessLookupError:
                return
            except PermissionError:
                pass  # alive, another user's (a reused pid): keep watching
            time.sleep(poll_s)
    try:
        select.select([fd], [], [])
    finally:
        os.close(fd)
