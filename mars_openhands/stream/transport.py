"""Transport: moving events between processes cheaply (design.md §3).

Mental model: the engine's scheduler step must never wait on telemetry.
:meth:`ZmqEventPublisher.emit` only appends the (already validated, frozen) event to an in-memory
buffer under a lock; a background thread serializes batches as JSONL bytes (one event per line, the
recorder's format) and sends each batch as one ZeroMQ message on a PUSH socket with ``NOBLOCK``.
When nobody listens (``IMMEDIATE`` is set, so messages are not queued for a peer that is not
connected) or the send high-water mark is reached, the batch is dropped and counted, never retried.
A :class:`ZmqEventCollector` binds a PULL socket (several publishers may connect to it), decodes
batches and hands typed events to a callback, e.g. :meth:`StreamRecorder.record
<mars_openhands.stream.recorder.StreamRecorder.record>`.

Addresses are loopback only: ``ipc://<path>`` or ``tcp://127.0.0.1:<port>`` (``:*`` picks a free
port; read it back from :attr:`ZmqEventCollector.address`). pyzmq is imported lazily, here only.
"""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Callable
from types import TracebackType
from typing import Any, Protocol, runtime_checkable

from mars_openhands.stream.events import Event, EventError, parse_event

__all__ = ["EventSink", "ListSink", "ZmqEventCollector", "ZmqEventPublisher", "check_address"]

logger = logging.getLogger(__name__)


@runtime_checkable
class EventSink(Protocol):
    """Anything events can be emitted into: a publisher, a recorder, a list (tests/sim)."""

    def emit(self, event: Event) -> None:
        """Hand over one event. Must not block for long; may drop (and count) under pressure."""
        ...

    def close(self) -> None:
        """Deliver what can be delivered and release resources. Idempotent."""
        ...


class ListSink:
    """In-process sink keeping every event in :attr:`events` (tests and the simulator).

    Args:
        kinds: event kinds wanted (``None``: all). ``emit`` keeps only those; a producer may read
            :attr:`kinds` and not build the others (the simulator does).
    """

    def __init__(self, kinds: frozenset[str] | None = None) -> None:
        self.events: list[Event] = []
        self.kinds = kinds
        self._lock = threading.Lock()

    def emit(self, event: Event) -> None:
        """Append ``event`` to :attr:`events` (if of a wanted kind). Thread-safe."""
        if self.kinds is not None and event.kind not in self.kinds:
            return
        with self._lock:
            self.events.append(event)

    def close(self) -> None:
        """No-op (kept for the :class:`EventSink` protocol)."""


def check_address(address: str) -> str:
    """Return ``address`` if it is loopback-only ZeroMQ (``ipc://…`` or ``tcp://127.0.0.1:…``).

    Raises:
        ValueError: any other address (the project only listens on loopback).
    """
    if address.startswith("ipc://") and len(address) > len("ipc://"):
        return address
    if address.startswith("tcp://127.0.0.1:"):
        return address
    raise ValueError(
        f"stream address {address!r} is not loopback-only; use ipc:///path/to/socket or "
        "tcp://127.0.0.1:<port> (or tcp://127.0.0.1:* for a free port)"
    )


def _encode_batch(events: list[Event]) -> bytes:
    return "\n".join(event.model_dump_json() for event in events).encode()


class ZmqEventPublisher:
    """Batched, never-blocking PUSH publisher of stream events (the engine's hot-path sink).

    Args:
        address: a collector's address (:func:`check_address`); the publisher connects to it.
        batch_size_events: buffered events that wake the sender thread early (default 256).
        flush_interval_s: the sender thread sends what is buffered at least this often
            (default 0.05 s: the latency the gateway's retention refinement can tolerate).
        max_buffered_events: events held while the sender is behind; beyond it :meth:`emit` drops
            (default 65536, ~10 MiB).
        sndhwm_batches: ZeroMQ send high-water mark in messages (batches) (default 1000).
        linger_s: on :meth:`close`, how long unsent batches may still be delivered (default 1.0).

    Raises:
        ValueError: a non-loopback address or a non-positive size.
        ImportError: pyzmq is missing (install the ``control`` extra; vLLM also brings it).
    """

    def __init__(
        self,
        address: str,
        *,
        batch_size_events: int = 256,
        flush_interval_s: float = 0.05,
        max_buffered_events: int = 65536,
        sndhwm_batches: int = 1000,
        linger_s: float = 1.0,
    ) -> None:
        import zmq

        if min(batch_size_events, max_buffered_events, sndhwm_batches) < 1 or flush_interval_s <= 0:
            raise ValueError(
                "batch_size_events, max_buffered_events, sndhwm_batches must be >= 1 and "
                f"flush_interval_s > 0, got {batch_size_events}, {max_buffered_events}, "
                f"{sndhwm_batches}, {flush_interval_s}"
            )
        self.address = check_address(address)
        self.batch_size_events = batch_size_events
        self.max_buffered_events = max_buffered_events
        self._flush_interval_s = flush_interval_s
        self._lock = threading.Lock()
        self._buffer: list[Event] = []
        self._num_emitted = 0
        self._num_sent = 0
        self._num_dropped = 0
        self._closed = False
        self._wake = threading.Event()
        self._context = zmq.Context()
        self._socket = self._context.socket(zmq.PUSH)
        self._socket.setsockopt(zmq.IMMEDIATE, 1)  # no queueing for a peer that is not there
        self._socket.setsockopt(zmq.SNDHWM, sndhwm_batches)
        self._socket.setsockopt(zmq.LINGER, int(linger_s * 1000))
        self._socket.connect(self.address)
        # From here on only the sender thread touches the socket (ZeroMQ sockets are not
        # thread-safe); Thread.start() is the memory barrier that hands it over.
        self._sender = threading.Thread(target=self._run, name="stream-publisher", daemon=True)
        self._sender.start()

    @property
    def num_emitted(self) -> int:
        """Events passed to :meth:`emit` (sent, buffered or dropped)."""
        return self._num_emitted

    @property
    def num_sent(self) -> int:
        """Events handed to ZeroMQ (delivered unless the peer vanishes with them queued)."""
        return self._num_sent

    @property
    def num_dropped(self) -> int:
        """Events dropped: buffer full, no peer, high-water mark reached, or emitted after close."""
        return self._num_dropped

    def emit(self, event: Event) -> None:
        """Buffer one event for sending; never blocks on I/O, drops (counted) when full.

        Thread-safe. Cost: one lock and a list append.
        """
        with self._lock:
            self._num_emitted += 1
            if self._closed or len(self._buffer) >= self.max_buffered_events:
                self._num_dropped += 1
                return
            self._buffer.append(event)
            if len(self._buffer) == self.batch_size_events:
                self._wake.set()

    def _take_buffer(self) -> list[Event]:
        with self._lock:
            batch, self._buffer = self._buffer, []
        return batch

    def _send(self, batch: list[Event]) -> None:
        import zmq

        for start in range(0, len(batch), self.batch_size_events):
            chunk = batch[start:start + self.batch_size_events]
            try:
                self._socket.send(_encode_batch(chunk), flags=zmq.NOBLOCK, copy=False)
                sent, dropped = len(chunk), 0
            except zmq.Again:  # no connected peer, or the high-water mark is reached
                sent, dropped = 0, len(chunk)
            with self._lock:
                self._num_sent += sent
                self._num_dropped += dropped

    def _run(self) -> None:
        while True:
            self._wake.wait(self._flush_interval_s)
            self._wake.clear()
            with self._lock:
                closing = self._closed
            batch = self._take_buffer()
            try:
                self._send(batch)
            except Exception:  # e.g. a ZMQError other than EAGAIN: keep the engine running
                logger.exception("stream publisher to %s: dropping a batch", self.address)
                with self._lock:
                    self._num_dropped += len(batch)
            if closing:
                break
        self._socket.close()  # honours LINGER for batches already queued
        self._context.term()

    def flush(self) -> None:
        """Ask the sender thread to send the buffer now (does not wait)."""
        self._wake.set()

    def close(self) -> None:
        """Send the buffer, let queued batches drain for up to ``linger_s``, stop. Idempotent."""
        with self._lock:
            self._closed = True
        self._wake.set()
        self._sender.join()

    def __enter__(self) -> ZmqEventPublisher:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()


def _owner_only(address: str) -> None:
    """Make an ``ipc://`` socket file connectable by its owner only (mode 0600).

    Connecting to a Unix socket needs write permission on its file, which the umask may grant to
    the group (0775 under umask 002): then another user could push forged events into an engine's
    inbox or the gateway's collector. ``tcp://127.0.0.1`` has no such guard (any local process can
    connect); prefer ``ipc://`` in a private directory (docs/gateway.md, "Threat model").
    """
    path = address.removeprefix("ipc://")
    if address.startswith("ipc://") and not path.startswith("@"):  # "@": abstract, no file
        os.chmod(path, 0o600)


class ZmqEventCollector:
    """PULL socket that receives publishers' batches and calls ``on_event`` per typed event.

    The callback runs on the collector's thread, in arrival order per publisher. A batch line that
    is not a valid event is logged and counted (:attr:`num_invalid`), never fatal; so is an
    exception from the callback (:attr:`num_callback_errors`). For an engine that polls once per
    step, pass ``collections.deque().append`` and ``popleft`` from the step.

    Args:
        address: where to bind (:func:`check_address`); ``tcp://127.0.0.1:*`` picks a free port.
        on_event: called with each event.
        poll_interval_s: how often the thread checks for :meth:`stop` (default 0.05 s).
        rcvhwm_batches: ZeroMQ receive high-water mark in messages (default 1000).

    Raises:
        ValueError: a non-loopback address.
        zmq.ZMQError: the address cannot be bound (e.g. already in use); raised by the constructor.
    """

    def __init__(
        self,
        address: str,
        on_event: Callable[[Event], Any],
        *,
        poll_interval_s: float = 0.05,
        rcvhwm_batches: int = 1000,
    ) -> None:
        import zmq

        self._on_event = on_event
        self._poll_interval_ms = max(1, int(poll_interval_s * 1000))
        self._num_received = 0
        self._num_invalid = 0
        self._num_callback_errors = 0
        self._stop = threading.Event()
        self._context = zmq.Context()
        self._socket = self._context.socket(zmq.PULL)
        self._socket.setsockopt(zmq.RCVHWM, rcvhwm_batches)
        self._socket.setsockopt(zmq.LINGER, 0)
        try:
            self._socket.bind(check_address(address))
            _owner_only(address)
        except BaseException:
            self._socket.close()
            self._context.term()
            raise
        self.address: str = self._socket.getsockopt_string(zmq.LAST_ENDPOINT)
        """The bound address, with the real port when bound to ``:*``."""
        self._thread = threading.Thread(target=self._run, name="stream-collector", daemon=True)
        self._thread.start()

    @property
    def num_received(self) -> int:
        """Valid events handed to the callback."""
        return self._num_received

    @property
    def num_invalid(self) -> int:
        """Received lines that were not valid events (skipped)."""
        return self._num_invalid

    @property
    def num_callback_errors(self) -> int:
        """Events whose callback raised (logged, skipped)."""
        return self._num_callback_errors

    def _handle(self, message: bytes) -> None:
        for line in message.split(b"\n"):
            if not line:
                continue
            try:
                event = parse_event(line)
            except EventError as e:
                self._num_invalid += 1
                logger.warning("collector %s: dropping invalid event: %s", self.address, e)
                continue
            self._num_received += 1
            try:
                self._on_event(event)
            except Exception:
                self._num_callback_errors += 1
                logger.exception("collector %s: on_event failed for %s", self.address, event.kind)

    def _drain(self) -> None:
        import zmq

        while True:
            try:
                self._handle(self._socket.recv(flags=zmq.NOBLOCK))
            except zmq.Again:
                return

    def _run(self) -> None:
        import zmq

        try:
            while not self._stop.is_set():
                if self._socket.poll(self._poll_interval_ms, zmq.POLLIN):
                    self._drain()
            self._drain()  # what arrived before stop()
        finally:
            self._socket.close()
            self._context.term()

    def stop(self) -> None:
        """Handle what has arrived, close the socket and join the thread. Idempotent."""
        self._stop.set()
        if self._thread is not threading.current_thread():
            self._thread.join()

    close = stop

    def __enter__(self) -> ZmqEventCollector:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()
