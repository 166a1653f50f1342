"""SIGTERM as a normal exit for command lines that start child processes.

Python's default SIGTERM action ends the process at once: no ``finally`` block and no ``atexit``
handler runs, so a vLLM server in its own process group
(:class:`~mars_openhands.engine.harness.launch.VllmServer`) outlived a ``compare`` that ``timeout``
killed, re-parented to pid 1. Inside :func:`sigterm_exits` the first SIGTERM raises
:class:`Terminated` (a ``SystemExit`` with status 143, ``128 + SIGTERM``) in the main thread, so
the command unwinds as on any other exit: its ``finally`` blocks and ``with`` exits stop what it
started, then ``atexit`` stops what is left. Further SIGTERMs are ignored while that teardown runs
(a second one would abort it half-way); SIGKILL still ends the process, and each server's
watchdog (:mod:`mars_openhands.engine.harness.reaper`) then kills its group and process tree.

SIGINT needs nothing: Python raises ``KeyboardInterrupt``, which unwinds the same way.

Every ``mars-openhands`` subcommand runs inside it (``eval/cli.py``), and so do the standalone
entry points that start servers (``python -m mars_openhands.openhands.cli``, the benchmarks),
except a subcommand whose parser sets ``sigterm_is_crash=True``: ``tasks``, whose runner, killed,
is resumed like a crashed one (``mars-openhands tasks resume``), and whose workflow runs in a
thread of its own: unwinding the main thread under it tore DBOS down beneath the running workflow,
which then failed over to compensation. Its only children are tool, compensation and acceptance
commands, each under a host that ends the command's tree once the runner has exited
(:mod:`mars_openhands.process_host`).

The other direction, for a child that must not outlive a parent that may be SIGKILLed (nothing
runs in the parent then): :func:`end_with_parent`, which the child runs (the fake engine, the
pool workers, each ``openhands run`` task); it ends the child's whole process tree, also what
left its group or session (the agent's terminal shell: :mod:`mars_openhands.process_tree`). The
engine's servers use a watchdog process instead (:mod:`mars_openhands.engine.harness.reaper`):
vLLM is not our code to add a thread to.

On the parent's side: :func:`stop_children` (SIGTERM, then each still running child's whole tree
after a grace) and :func:`run_child` (``subprocess.run`` that does so when interrupted).
"""

from __future__ import annotations

import atexit
import contextlib
import os
import select
import signal
import subprocess
import threading
import time
from collections.abc import Iterator, Sequence
from types import FrameType
from typing import Any

from mars_openhands.process_tree import become_subreaper, kill_tree

__all__ = ["EXIT_TERMINATED", "Terminated", "end_with_parent", "run_child", "sigterm_exits", "stop_children"]

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


def stop_children(procs: Sequence[subprocess.Popen[bytes]], grace_s: float = 5.0,
                  signal_group: bool = False) -> None:
    """End processes this process started, each with every process below it, and reap them:
    SIGTERM to each still running (to its group with ``signal_group``: one started with
    ``start_new_session=True``), then, for each still running after ``grace_s`` seconds, freeze
    and SIGKILL its whole tree (:func:`~mars_openhands.process_tree.kill_tree`: also what runs in
    a session of its own below it).

    Mutates: signals processes; waits for ``procs``.
    """
    targets = [proc for proc in procs if proc.poll() is None]
    for proc in targets:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            if signal_group:
                os.killpg(proc.pid, signal.SIGTERM)
            else:
                proc.send_signal(signal.SIGTERM)
    deadline = time.monotonic() + grace_s
    while time.monotonic() < deadline and any(proc.poll() is None for proc in targets):
        time.sleep(0.05)
    for proc in targets:
        if proc.poll() is None:
            kill_tree(proc.pid, 0.0)
    for proc in procs:
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(timeout=5.0)


def run_child(cmd: Sequence[str], grace_s: float = 30.0, **popen: Any) -> int:
    """``subprocess.run(cmd, **popen).returncode``, except that when this process is interrupted
    meanwhile (``KeyboardInterrupt``; :class:`Terminated` inside :func:`sigterm_exits`) the child
    gets SIGTERM, ``grace_s`` seconds to stop what it started (a ``compare`` stops its servers),
    then SIGKILL with its whole tree (:func:`stop_children`); the exception then propagates.

    Returns:
        The child's exit status.

    Raises:
        KeyboardInterrupt, Terminated: as received, once the child has ended.
    """
    proc = subprocess.Popen(list(cmd), **popen)
    try:
        return proc.wait()
    except BaseException:
        stop_children([proc], grace_s)
        raise


def end_with_parent(parent_pid: int, grace_s: float = 10.0, poll_s: float = 0.5) -> threading.Thread:
    """Make this process end, with every process below it, once process ``parent_pid`` (the one
    that started it) has exited, even by SIGKILL; ``parent_pid`` already gone ends it at once.

    This process becomes the subreaper of its descendants
    (:func:`~mars_openhands.process_tree.become_subreaper`: one that ``setsid``s, double-forks or
    outlives its own parent stays in its tree). A daemon thread waits for the parent, then
    SIGTERMs this process's tree and this process (which unwinds where it handles SIGTERM: inside
    :func:`sigterm_exits`), freezes and SIGKILLs what of the tree is left after ``grace_s``
    seconds, then SIGKILLs this process. An ``atexit`` handler ends the tree the same way when
    this process exits first (:func:`~mars_openhands.process_tree.kill_tree`, 2 s grace).

    Mutates: this process's prctl state and atexit handlers; signals this process and its tree
    when the parent is gone.

    Returns:
        The started thread.
    """
    become_subreaper()
    me = os.getpid()
    atexit.register(_end_tree_at_exit, me)

    def watch() -> None:
        _wait_for_exit(parent_pid, poll_s)
        deadline = time.monotonic() + grace_s
        handles_sigterm = signal.getsignal(signal.SIGTERM) not in (signal.SIG_DFL, None)
        if handles_sigterm:
            os.kill(me, signal.SIGTERM)  # unwinds alongside its tree
        kill_tree(me, grace_s, include_root=False)
        if not handles_sigterm:
            os.kill(me, signal.SIGTERM)
        time.sleep(max(0.0, deadline - time.monotonic()))
        os.kill(me, signal.SIGKILL)

    thread = threading.Thread(target=watch, name="end-with-parent", daemon=True)
    thread.start()
    return thread


def _end_tree_at_exit(pid: int) -> None:
    """atexit: end what this process started (not in a fork of it, whose atexit copy this is)."""
    if os.getpid() == pid:
        kill_tree(pid, 2.0, include_root=False)


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
