"""Unified information stream: typed GPU-, CPU- and control-plane events (design.md §3).

``events`` defines the event kinds, ``recorder`` writes one run's stream (JSONL live, Parquet on
close), ``reader`` reads it back (typed events or a pandas DataFrame) and ``transport`` moves events
between processes (batched, non-blocking ZeroMQ PUSH/PULL). Importing this package needs only the
standard library and pydantic; pandas, pyarrow and pyzmq are imported when first used.
"""

from mars_openhands.stream.events import EVENT_TYPES, Event, EventError, now_stamps, parse_event
from mars_openhands.stream.reader import StreamReadError, iter_events, jsonl_to_parquet, read_stream
from mars_openhands.stream.recorder import StreamRecorder
from mars_openhands.stream.transport import (
    EventSink,
    ListSink,
    ZmqEventCollector,
    ZmqEventPublisher,
)

__all__ = [
    "EVENT_TYPES",
    "Event",
    "EventError",
    "EventSink",
    "ListSink",
    "StreamReadError",
    "StreamRecorder",
    "ZmqEventCollector",
    "ZmqEventPublisher",
    "iter_events",
    "jsonl_to_parquet",
    "now_stamps",
    "parse_event",
    "read_stream",
]
