"""Recorder: one run's unified information stream, written to JSONL and Parquet (design.md §3).

Mental model: the JSONL file is the source of truth and is written live. Each accepted event becomes
one complete line (``event.model_dump_json()`` + ``"\\n"``); lines are buffered in memory and
written in batches (every ``batch_size_events`` events, every ``flush_interval_s`` seconds by a
background thread, on :meth:`StreamRecorder.flush` and on close), each batch with one ``write`` and
a ``flush``. A crash therefore loses at most the last unflushed batch and can leave at most one
truncated final line, which :func:`~mars_openhands.stream.reader.read_stream` can skip. Events are
validated *before* they are buffered, so a bad event raises
:class:`~mars_openhands.stream.events.EventError` and never touches the file. The Parquet file is
derived from the complete JSONL on close (written to a temporary name, then renamed), so it is
either whole or absent.

Thread-safe: the gateway and the engine record from several threads; one lock guards the buffer and
the file.
"""

from __future__ import annotations

import logging
import os
import threading
from pathlib import Path
from types import TracebackType
from typing import Any

from pydantic import BaseModel

from mars_openhands.stream.events import EVENT_TYPES, Event, EventError, parse_event

__all__ = ["StreamRecorder"]

logger = logging.getLogger(__name__)

_EVENT_CLASSES = tuple(EVENT_TYPES.values())


class StreamRecorder:
    """Write one run's events to ``<path>`` (JSONL, live) and ``<path>.parquet`` (on close).

    Usage::

        with StreamRecorder(run_dir / "stream.jsonl") as recorder:
            recorder.record(ToolStart(**now_stamps(), source="agent", ...))
        df = read_stream(run_dir / "stream.parquet")

    A recorder is also an :class:`~mars_openhands.stream.transport.EventSink` (:meth:`emit`), so it
    can be handed to a :class:`~mars_openhands.stream.transport.ZmqEventCollector` as its callback.

    Args:
        path: the JSONL file (conventionally ``stream.jsonl``). Its parent directory is created.
        parquet_path: where :meth:`close` writes the Parquet copy; default ``path`` with suffix
            ``.parquet``. ``None`` together with ``write_parquet=False`` writes JSONL only.
        write_parquet: convert to Parquet on close (needs pandas and pyarrow, the ``eval`` extra).
            Pass ``False`` in environments without them (e.g. the OpenHands env).
        append: continue an existing stream (after a crash). A truncated final line left by the
            crash is cut off first so that new lines stay parseable. Without it an existing file is
            an error: one run yields one stream.
        batch_size_events: buffered events that trigger a write (default 256: one ``write`` per
            ~50 KiB, a few per second at engine-step rates).
        flush_interval_s: the background thread writes buffered events at least this often, so a
            crash loses at most this many seconds of events (default 1.0). ``0`` disables the
            thread (flush only on size, :meth:`flush` and close).

    Raises:
        FileExistsError: ``path`` exists and ``append`` is false.
        ValueError: ``batch_size_events`` < 1, ``flush_interval_s`` < 0, or the Parquet copy
            would overwrite ``path`` (``path`` ends in ``.parquet``).
    """

    def __init__(
        self,
        path: str | os.PathLike[str],
        *,
        parquet_path: str | os.PathLike[str] | None = None,
        write_parquet: bool = True,
        append: bool = False,
        batch_size_events: int = 256,
        flush_interval_s: float = 1.0,
    ) -> None:
        if batch_size_events < 1:
            raise ValueError(f"batch_size_events must be >= 1, got {batch_size_events}")
        if flush_interval_s < 0:
            raise ValueError(
                f"flush_interval_s must be >= 0 (0 = no timer), got {flush_interval_s}"
            )
        self.path = Path(path)
        self.parquet_path = (
            Path(parquet_path) if parquet_path is not None else self.path.with_suffix(".parquet")
        )
        if write_parquet and self.parquet_path == self.path:
            raise ValueError(
                f"stream path {str(self.path)!r} is also its Parquet copy's path; give the JSONL "
                f"path ({str(self.path.with_suffix('.jsonl'))!r}) and the .parquet is written next "
                "to it on close"
            )
        self.write_parquet = write_parquet
        self.batch_size_events = batch_size_events
        self._lock = threading.Lock()
        self._buffer: list[str] = []
        self._num_events = 0
        self._closed = False
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._file = self._open(append)
        self._stop = threading.Event()
        self._timer: threading.Thread | None = None
        if flush_interval_s > 0:
            self._timer = threading.Thread(
                target=self._flush_periodically, args=(flush_interval_s,),
                name=f"stream-recorder:{self.path.name}", daemon=True,
            )
            self._timer.start()

    def _open(self, append: bool) -> Any:
        """Open the JSONL file; in append mode, cut a truncated final line left by a crash."""
        if not append:
            try:
                return open(self.path, "x", encoding="utf-8")  # closed in close()
            except FileExistsError:
                raise FileExistsError(
                    f"stream file {self.path} already exists; one run yields one stream: choose a "
                    "new path or run directory (in Python, StreamRecorder(..., append=True) "
                    "continues it)"
                ) from None
        if self.path.exists():
            with open(self.path, "rb+") as f:
                data = f.read()
                keep_bytes = data.rfind(b"\n") + 1
                if keep_bytes < len(data):
                    logger.warning(
                        "cutting a truncated final line (%d bytes) from %s before appending",
                        len(data) - keep_bytes, self.path,
                    )
                    f.truncate(keep_bytes)
        return open(self.path, "a", encoding="utf-8")  # closed in close()

    @property
    def num_events(self) -> int:
        """Events accepted so far (buffered or written)."""
        return self._num_events

    @property
    def closed(self) -> bool:
        """True once :meth:`close` has run."""
        return self._closed

    def record(self, event: Event | BaseModel | dict[str, Any]) -> None:
        """Validate one event and append it to the stream.

        Args:
            event: a typed event, or a dict validated with
                :func:`~mars_openhands.stream.events.parse_event`.

        Raises:
            EventError: the event is invalid (the message names the field) or of an unknown type.
                Nothing is written; the recorder stays usable.
            ValueError: the recorder is closed.
        """
        if isinstance(event, dict):
            event = parse_event(event)
        elif not isinstance(event, _EVENT_CLASSES):
            raise EventError(
                f"cannot record a {type(event).__name__}; expected a stream event "
                f"({', '.join(c.__name__ for c in _EVENT_CLASSES)}) or a dict with a 'kind' field"
            )
        line = event.model_dump_json() + "\n"
        with self._lock:
            if self._closed:
                raise ValueError(
                    f"stream recorder for {self.path} is closed; cannot record {line!r}"
                )
            self._buffer.append(line)
            self._num_events += 1
            if len(self._buffer) >= self.batch_size_events:
                self._write_buffer_locked()

    emit = record
    """Alias so a recorder satisfies the ``EventSink`` protocol."""

    def flush(self) -> None:
        """Write buffered events to the JSONL file and flush it to the OS. No-op when closed."""
        with self._lock:
            if not self._closed:
                self._write_buffer_locked()

    def _write_buffer_locked(self) -> None:
        if self._buffer:
            self._file.write("".join(self._buffer))
            self._buffer.clear()
        self._file.flush()

    def _flush_periodically(self, interval_s: float) -> None:
        while not self._stop.wait(interval_s):
            try:
                self.flush()
            except OSError:  # e.g. disk full: keep the thread alive, close() will raise it
                logger.exception("periodic flush of %s failed", self.path)

    def close(self) -> None:
        """Flush, fsync and close the JSONL file, then write the Parquet copy. Idempotent.

        Raises:
            ImportError: ``write_parquet`` is true but pandas/pyarrow are missing (the JSONL file
                is complete and closed by then).
        """
        with self._lock:
            if self._closed:
                return
            self._closed = True
            try:
                self._write_buffer_locked()
                os.fsync(self._file.fileno())
            finally:
                self._file.close()
        self._stop.set()
        if self._timer is not None and self._timer is not threading.current_thread():
            self._timer.join()
        if self.write_parquet:
            from mars_openhands.stream.reader import jsonl_to_parquet

            jsonl_to_parquet(self.path, self.parquet_path)

    def __enter__(self) -> StreamRecorder:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"StreamRecorder({str(self.path)!r}, num_events={self._num_events})"
