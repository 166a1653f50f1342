"""The gateway's end of the unified information stream (MARS arXiv 2604.26963 §4.1; design.md §3).

Three flows meet here:

* **CPU plane in**: agents ``POST /mars/v1/events`` (``tool_enqueued``, ``tool_start``, ``tool_end``,
  ``session_start``, ``session_end``). :func:`validate_cpu_batch` checks a whole batch before anything
  is applied, so a bad batch changes nothing.
* **GPU plane in**: engines publish ``engine_step`` and request events with
  :class:`~mars_openhands.stream.transport.ZmqEventPublisher` to the gateway's
  :class:`~mars_openhands.stream.transport.ZmqEventCollector`.
* **Out**: every event (both planes and the gateway's own ``admission_update``) is recorded to one
  stream per run (:class:`~mars_openhands.stream.recorder.StreamRecorder` or any ``EventSink``), and
  each session's CPU-plane events are forwarded to the replica holding the session: one
  ``ZmqEventPublisher`` (PUSH, connect, never blocking) per replica with an ``events_address``; the
  scheduler plugin binds a ``ZmqEventCollector`` (PULL) there and drains it once per step. The wire
  format is the transport's: one ZeroMQ message per batch, one JSON event per line
  (docs/gateway.md, "Engine contract").
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable, Collection, Sequence
from typing import Any

from mars_openhands.control.config import GatewayConfig
from mars_openhands.control.metadata import BadRequestError
from mars_openhands.stream.events import (
    Event,
    EventError,
    SessionEnd,
    SessionStart,
    ToolEnd,
    ToolEnqueued,
    ToolStart,
    parse_event,
)
from mars_openhands.stream.transport import EventSink

__all__ = ["CPU_PLANE_KINDS", "GATEWAY_SOURCE", "EventHub", "is_reserved_source", "parse_cpu_batch",
           "validate_cpu_batch"]

logger = logging.getLogger(__name__)

CPU_PLANE_KINDS = ("session_start", "session_end", "tool_enqueued", "tool_start", "tool_end")
"""Event kinds agents may POST."""

CpuEvent = SessionStart | SessionEnd | ToolEnqueued | ToolStart | ToolEnd

GATEWAY_SOURCE = "gateway"
"""``source`` of the events the gateway records itself (idle ``session_end``, interrupted
``tool_end``, ``admission_update``, ``aborted``)."""


def is_reserved_source(source: str, engine_sources: Collection[str] = ()) -> bool:
    """Whether ``source`` names the gateway or an engine, which an agent's event may not claim. Pure.

    Reserved: ``"gateway"``, ``"engine"``, any ``"engine:..."`` and each of ``engine_sources`` (the
    replicas' configured GPU-plane sources, which need not start with ``engine``).
    """
    return (source in (GATEWAY_SOURCE, "engine") or source.startswith("engine:")
            or source in engine_sources)


def parse_cpu_batch(raw: bytes, max_events: int,
                    engine_sources: Collection[str] = ()) -> list[CpuEvent]:
    """Parse a ``POST /mars/v1/events`` body: one event, a list, or ``{"events": [...]}``. Pure.

    Args:
        raw: the request body.
        max_events: the most events one body may carry.
        engine_sources: the replicas' GPU-plane sources (also refused as an agent's ``source``).

    Raises:
        BadRequestError: not JSON, not an event/list, too many events, an invalid or unknown kind, a
            non-CPU-plane kind, no ``session_id``, or a ``source`` of the gateway or an engine (an
            agent could otherwise record e.g. an idle-timeout ``session_end`` as the gateway's); the
            message names the event index and field.
    """
    try:
        data: Any = json.loads(raw)
    except ValueError as e:
        raise BadRequestError(f"events body is not valid JSON: {e}") from None
    if isinstance(data, dict) and "events" in data and "kind" not in data:
        data = data["events"]
        if not isinstance(data, list):
            raise BadRequestError(f'"events" must be a list of event objects, got {type(data).__name__}; '
                                  'e.g. {"events": [{"kind": "tool_start", ...}]}')
    items = data if isinstance(data, list) else [data]
    if len(items) > max_events:
        raise BadRequestError(
            f"events batch has {len(items)} events, more than max_events_per_post={max_events}; "
            "split it or raise --max-events-per-post", status_code=413,
        )
    events: list[CpuEvent] = []
    for i, item in enumerate(items):
        try:
            event = parse_event(item)
        except EventError as e:
            raise BadRequestError(f"event [{i}]: {e}") from None
        if event.kind not in CPU_PLANE_KINDS:
            raise BadRequestError(
                f"event [{i}]: kind {event.kind!r} cannot be posted by agents; expected one of "
                f"{list(CPU_PLANE_KINDS)}"
            )
        if event.session_id is None:
            raise BadRequestError(f"event [{i}] ({event.kind}): session_id is required")
        if is_reserved_source(event.source, engine_sources):
            raise BadRequestError(
                f"event [{i}] ({event.kind}): source {event.source!r} is the gateway's or an "
                "engine's; an agent's events name the agent, e.g. \"agent\"")
        events.append(event)  # type: ignore[arg-type]
    return events


def validate_cpu_batch(events: Sequence[CpuEvent], is_known: Callable[[str], bool]) -> None:
    """Check that every event names a known session (or one started earlier in the batch).

    Raises:
        BadRequestError: HTTP 404 naming the first event whose session the gateway does not know.
    """
    started: set[str] = set()
    for i, event in enumerate(events):
        sid = event.session_id
        assert sid is not None, "parse_cpu_batch guarantees a session_id"
        if event.kind == "session_start":
            started.add(sid)
        elif sid not in started and not is_known(sid):
            raise BadRequestError(
                f"event [{i}] ({event.kind}): unknown session {sid!r}; send session_start or an LLM "
                "request with this session first (sessions also vanish after session_end or the "
                "idle timeout)", status_code=404,
            )


class EventHub:
    """Records every event and forwards CPU-plane events to replicas.

    Args:
        config: gateway config (replicas' ``events_address``).
        sink: where the run's stream goes (a ``StreamRecorder``); ``None`` records nothing.
        publisher_factory: builds a publisher for an address (default ``ZmqEventPublisher``).
    """

    def __init__(
        self,
        config: GatewayConfig,
        sink: EventSink | None,
        publisher_factory: Callable[[str], EventSink] | None = None,
    ) -> None:
        self.sink = sink
        self.num_recorded = 0
        self.num_record_errors = 0
        self.num_forwarded = 0
        self.num_cpu_events = 0
        self.num_gpu_events = 0
        self.publishers: dict[int, EventSink] = {}
        if publisher_factory is None:
            from mars_openhands.stream.transport import ZmqEventPublisher

            publisher_factory = ZmqEventPublisher
        for i, replica in enumerate(config.replicas):
            if replica.events_address is not None:
                self.publishers[i] = publisher_factory(replica.events_address)

    def record(self, event: Event) -> None:
        """Append ``event`` to the run's stream (never raises: a failing sink is logged, counted)."""
        if self.sink is None:
            return
        try:
            self.sink.emit(event)
            self.num_recorded += 1
        except Exception:  # the stream must never take the proxy down
            self.num_record_errors += 1
            logger.exception("recording %s failed", event.kind)

    def forward(self, replica_index: int | None, event: Event) -> bool:
        """Send a CPU-plane event to the replica's scheduler plugin, if it has an address."""
        if replica_index is None:
            return False
        publisher = self.publishers.get(replica_index)
        if publisher is None:
            return False
        publisher.emit(event)
        self.num_forwarded += 1
        return True

    def num_forward_dropped(self) -> int:
        """Events the publishers dropped (no engine connected, buffers full)."""
        return sum(getattr(p, "num_dropped", 0) for p in self.publishers.values())

    def close(self) -> None:
        """Close the publishers (the sink belongs to the caller). Idempotent."""
        for publisher in self.publishers.values():
            publisher.close()
        self.publishers.clear()
