"""``EngineWaker``: has an idle vLLM engine core run a step when the scheduler has work due.

Why: vLLM's engine core blocks on its input queue while no request is unfinished
(``has_requests()`` False), so without a wake a ``session_end`` posted after a session's last
turn, or a retained-KV TTL that runs out while nothing runs, would keep the session's blocks
pinned until the next request arrives. The scheduler's ``has_requests()`` says True while such
work is due, so the woken loop steps once (nothing scheduled) and ``schedule()`` applies it.

Two triggers: a CPU-plane event was queued (:meth:`EngineWaker.wake`, from the inbox's collector
thread), and the earliest retained-KV expiry came due (a daemon thread watches it). In-process
(the simulator, tests) there is no wake function and nothing runs: the caller steps the scheduler.
"""

from __future__ import annotations

import threading
from collections.abc import Callable

__all__ = ["EngineWaker"]

EXPIRY_POLL_S = 0.25
"""Longest the expiry watcher sleeps: a retention made while it slept is noticed this late."""


class EngineWaker:
    """Calls a wake function at once on :meth:`wake`, and once per expiry that comes due.

    Args:
        clock: the scheduler's clock, seconds (read on the watcher thread).
        next_due_s: the earliest expiry still to act on, same clock (``inf``: none). Read
            without a lock: a float, rewritten whole by the engine thread; a stale read at worst
            wakes a busy engine once, or checks again ``poll_s`` later.
        poll_s: longest the watcher sleeps (default :data:`EXPIRY_POLL_S`).
    """

    def __init__(self, clock: Callable[[], float], next_due_s: Callable[[], float],
                 poll_s: float = EXPIRY_POLL_S) -> None:
        self._clock = clock
        self._next_due_s = next_due_s
        self._poll_s = poll_s
        self._wake_fn: Callable[[], None] | None = None
        self._watcher: threading.Thread | None = None
        self._stop = threading.Event()

    @property
    def wake_fn(self) -> Callable[[], None] | None:
        """The wake function in use (None: no waking)."""
        return self._wake_fn

    def set(self, wake: Callable[[], None] | None) -> None:
        """Use ``wake`` (thread-safe, non-blocking) from now on and start the expiry watcher
        (once); ``None``: no waking. Mutates."""
        self._wake_fn = wake
        if wake is None or self._watcher is not None:
            return
        self._watcher = threading.Thread(target=self._watch, daemon=True, name="mars-expiry-watcher")
        self._watcher.start()

    def wake(self) -> None:
        """Wake the engine now (any thread); no-op without a wake function."""
        if self._wake_fn is not None:
            self._wake_fn()

    def stop(self) -> None:
        """Stop the watcher (it exits within ``poll_s``). Idempotent. Mutates."""
        self._stop.set()

    def _watch(self) -> None:
        """Watcher thread: wake once per expiry that comes due."""
        woken_for = float("inf")
        while not self._stop.is_set():
            due = self._next_due_s()
            now = self._clock()
            if due <= now and due != woken_for and self._wake_fn is not None:
                self._wake_fn()
                woken_for = due
            wait_s = self._poll_s if due <= now else min(self._poll_s, due - now)
            self._stop.wait(wait_s)
