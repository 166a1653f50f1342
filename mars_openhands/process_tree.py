"""Every process below a process, found by parent pid, and ended as a whole.

A process group is not a process tree: the OpenHands terminal starts its ``bash -i`` with
``setsid`` (a session and group of its own), a tool command may run ``setsid``/``nohup``/``&``,
and a tmux server double-forks away from its parent. Killing the task's group reached none of
them; they ended only when the task's own cleanup got to them, or by the pty's SIGHUP, which
an inherited ``SIG_IGN`` (a launcher started under ``nohup``) turns off. So a killed
``openhands run`` left a tool's ``sleep 300`` running.

Here a process is ended with everything below it, by parent pid from ``/proc`` (Linux):
:func:`kill_tree` SIGTERMs the tree, waits, then freezes what is left with SIGSTOP (a stopped
process cannot fork, and a pending signal aborts a fork under way), walks again until no new
process shows up, and SIGKILLs the lot: no cooperation and no CPU share needed from the
processes killed. :func:`become_subreaper` (``PR_SET_CHILD_SUBREAPER``) keeps the tree whole
while its root lives: a descendant whose parent exits (a double-fork, a closed shell's job) is
re-parented to the root, not to pid 1, so a later walk still finds it.

Mental model: a process's identity is its pid *and* its start time (``/proc/<pid>/stat`` field
22), so a pid reused by an unrelated process is never signalled. Zombies count as gone.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import signal
import time
from pathlib import Path

__all__ = ["become_subreaper", "descendants", "is_process_alive", "kill_tree", "process_start_ticks"]

_PR_SET_CHILD_SUBREAPER = 36
"""``prctl`` option (Linux >= 3.4): orphaned descendants are re-parented to this process."""
_FREEZE_ROUNDS = 50
"""Walks while freezing before giving up on a tree that keeps growing (it cannot: frozen)."""


def process_start_ticks(pid: int) -> int | None:
    """Start time of process ``pid`` in clock ticks since boot (``/proc/<pid>/stat`` field 22),
    or ``None`` if there is no such process (or it is a zombie). Pure read."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    fields = stat.rsplit(")", 1)[1].split()  # after the command name: state ppid pgrp ...
    return None if fields[0] == "Z" else int(fields[19])


def is_process_alive(pid: int, start_ticks: int | None) -> bool:
    """Whether ``pid`` is still the process that started at ``start_ticks``. Pure read."""
    return start_ticks is not None and process_start_ticks(pid) == start_ticks


def _children() -> dict[int, list[int]]:
    """ppid -> pids of every process now (zombies included: they may still have a stat)."""
    tree: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                ppid = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue  # exited while we looked
            tree.setdefault(ppid, []).append(int(entry.name))
    return tree


def _walk(tree: dict[int, list[int]], roots: list[int]) -> dict[int, int]:
    """The live processes below ``roots`` in ``tree`` (ppid -> pids): pid -> start ticks."""
    found: dict[int, int] = {}
    todo = list(roots)
    while todo:
        for child in tree.get(todo.pop(), []):
            ticks = process_start_ticks(child)
            if ticks is not None and child not in found:
                found[child] = ticks
                todo.append(child)
    return found


def descendants(pid: int, *more: int) -> dict[int, int]:
    """Every live descendant of ``pid`` and of each of ``more`` (not those themselves): pid ->
    start time in clock ticks. Pure read of ``/proc`` (one pass however many roots)."""
    return _walk(_children(), [pid, *more])


def become_subreaper() -> bool:
    """Make this process the subreaper of its descendants (``PR_SET_CHILD_SUBREAPER``): one whose
    parent exits is re-parented here, so :func:`descendants` of this process still lists it.

    Mutates: this process's prctl state (inherited by nothing; the orphans it adopts become
    zombies here until this process exits or waits for them).

    Returns:
        Whether it took effect (``False`` where ``prctl`` is missing: not Linux).
    """
    try:
        # The symbols this process already has (libc's among them): no ctypes.util.find_library,
        # which runs ldconfig and gcc (about 0.2 s: paid by every tool command's host).
        libc = ctypes.CDLL(None, use_errno=True)
        return libc.prctl(_PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) == 0
    except (OSError, AttributeError):
        return False


def _signal(processes: dict[int, int], sig: signal.Signals) -> None:
    for pid, ticks in processes.items():
        if is_process_alive(pid, ticks):
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(pid, sig)


def _tree(root: int, include_root: bool, more: dict[int, int] | None = None) -> dict[int, int]:
    """The live tree of ``root`` (with ``root`` where asked) and below the live ones of ``more``
    (processes that left it), never this process."""
    seeds = [root] + [pid for pid, ticks in (more or {}).items() if is_process_alive(pid, ticks)]
    tree = _walk(_children(), seeds)
    for pid in seeds[1:]:
        tree[pid] = (more or {})[pid]
    if include_root and (ticks := process_start_ticks(root)) is not None:
        tree[root] = ticks
    tree.pop(os.getpid(), None)
    return tree


def _freeze(root: int, include_root: bool, more: dict[int, int]) -> dict[int, int]:
    """SIGSTOP the tree of ``root`` (and of ``more``) until a walk finds nothing new; returns it."""
    frozen: dict[int, int] = {}
    for _ in range(_FREEZE_ROUNDS):
        new = {pid: ticks for pid, ticks in _tree(root, include_root, {**more, **frozen}).items()
               if pid not in frozen}
        if not new:
            break
        _signal(new, signal.SIGSTOP)
        frozen.update(new)
    return frozen


def kill_tree(root: int, grace_s: float, include_root: bool = True, poll_s: float = 0.05,
              also: dict[int, int] | None = None) -> list[int]:
    """End process ``root`` and every process below it: SIGTERM to each, then, after ``grace_s``
    seconds (at once when 0) for whatever is still running, freeze and SIGKILL, including what
    left the tree meanwhile (re-parented to pid 1 when ``root`` is no subreaper) and what that
    started. ``also`` (pid -> start ticks, from :func:`descendants`) are processes known to have
    belonged to the tree earlier: those still alive end with it, with what is below them.

    ``root`` may be this process with ``include_root=False`` (end everything this process
    started and keep running); this process itself is never signalled.

    Mutates: signals processes.

    Args:
        root: the pid whose tree ends.
        grace_s: seconds between SIGTERM and SIGKILL (>= 0).
        include_root: end ``root`` too.
        poll_s: seconds between two checks during the grace.
        also: more processes to end with their trees (a pid reused since is never signalled).

    Returns:
        The pids that needed SIGKILL (sorted).
    """
    started = _tree(root, include_root, also)
    if grace_s > 0:
        _signal(started, signal.SIGTERM)
        deadline = time.monotonic() + grace_s
        while time.monotonic() < deadline and _tree(root, include_root, started):
            time.sleep(poll_s)
    left = _freeze(root, include_root, started)
    _signal(left, signal.SIGKILL)
    return sorted(left)
