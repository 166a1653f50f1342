"""``CpuEventInbox``: the CPU-plane events a scheduler consumes, queued between steps (design.md §3).

Mental model: the agents' tool events (``tool_enqueued``, ``tool_start``, ``tool_end``,
``session_end``) reach an engine from other threads: posted in-process (the simulator, tests) or
received by a ZeroMQ collector thread from the gateway (``mars.inbox_addr``). The engine thread
applies them only at safe points, at the start of a step or of a request's arrival, oldest first
and at most ``max_events_per_drain`` at a time, so a burst of events cannot stall a step. What an
event *means* is the scheduler's (``MarsBaseScheduler.on_stream_event``); this class only moves
them across threads.

Thread safety: :meth:`post` and the collector's callback may run on any thread; :meth:`drain`,
:meth:`listen` and :meth:`close` on the engine thread. ``len()`` / ``bool()`` read without the
lock (a deque's length is read atomically; a stale answer delays an event by one step at most).
"""

from __future__ import annotations

import threading
from collections import deque
from collections.abc import Callable
from typing import Any

__all__ = ["CpuEventInbox"]

_NOTHING: tuple[Any, ...] = ()


class CpuEventInbox:
    """A thread-safe FIFO of CPU-plane events, drained in bounded batches.

    Args:
        max_events_per_drain: most events one :meth:`drain` returns
            (``mars.max_inbox_events_per_step``, >= 1).

    Raises:
        ValueError: ``max_events_per_drain < 1``.
    """

    def __init__(self, max_events_per_drain: int) -> None:
        if max_events_per_drain < 1:
            raise ValueError(f"max_events_per_drain must be >= 1, got {max_events_per_drain} "
                             "(from --additional-config mars.max_inbox_events_per_step)")
        self.max_events_per_drain = max_events_per_drain
        self._events: deque[Any] = deque()
        self._lock = threading.Lock()
        self._collector: Any = None

    def __len__(self) -> int:
        return len(self._events)

    def __bool__(self) -> bool:
        return bool(self._events)

    @property
    def is_listening(self) -> bool:
        """Whether a collector thread may post events at any time."""
        return self._collector is not None

    def post(self, event: Any) -> None:
        """Queue one event (any thread). Mutates."""
        with self._lock:
            self._events.append(event)

    def drain(self) -> list[Any] | tuple[Any, ...]:
        """Take up to ``max_events_per_drain`` events, oldest first (engine thread). Mutates."""
        if not self._events:
            return _NOTHING
        with self._lock:
            num = min(self.max_events_per_drain, len(self._events))
            return [self._events.popleft() for _ in range(num)]

    def listen(self, address: str, on_posted: Callable[[], None] | None = None) -> None:
        """Receive events from publishers at ``address`` on a collector thread; each is posted,
        then ``on_posted`` is called on that thread (e.g. to wake an idle engine). Mutates.

        Raises:
            RuntimeError: already listening.
            ValueError: a non-loopback address; zmq.ZMQError: it cannot be bound
                (:class:`~mars_openhands.stream.transport.ZmqEventCollector`).
        """
        if self._collector is not None:
            raise RuntimeError("the CPU-event inbox is already listening; close() it first")
        from mars_openhands.stream.transport import ZmqEventCollector

        def on_event(event: Any) -> None:
            self.post(event)
            if on_posted is not None:
                on_posted()

        self._collector = ZmqEventCollector(address, on_event)

    def close(self) -> None:
        """Stop the collector thread, if any (queued events stay). Idempotent. Mutates."""
        if self._collector is not None:
            self._collector.stop()
            self._collector = None
