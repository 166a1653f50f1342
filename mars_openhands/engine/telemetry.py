"""GPU-plane telemetry of the scheduler plugins (MARS §4.1; design.md §3).

Per request: ``queued``, ``first_scheduled``, ``first_token``, ``finished``, ``preempted``; KV
retention: ``kv_retained`` / ``kv_released``; per step, rate-limited: ``engine_step``. Events are
handed to an :class:`~mars_openhands.stream.transport.EventSink`; the engine's sink is the
never-blocking ``ZmqEventPublisher`` (its ``emit`` only appends to a buffer), so the step loop
never waits on telemetry. With no address configured, :class:`EngineTelemetry` has
``enabled = False`` and the scheduler skips building events at all (one attribute check).

Timestamps: ``t_mono_ns`` from ``time.monotonic_ns()`` at emission and ``t_wall`` in UTC; durations
(``ttft_s``, ...) are measured on the scheduler's clock.
"""

from __future__ import annotations

import logging
import time
from datetime import UTC, datetime
from typing import Any

from mars_openhands.policy.params import TelemetryParams
from mars_openhands.stream import events as ev
from mars_openhands.stream.transport import EventSink

__all__ = ["EngineTelemetry", "make_telemetry"]

logger = logging.getLogger(__name__)


class EngineTelemetry:
    """Builds and emits GPU-plane events into a sink.

    Args:
        sink: where events go; None disables telemetry (``enabled`` is False).
        source: the ``source`` field, e.g. ``"engine:0"``.
        engine_step_interval_ms: minimum spacing of ``engine_step`` snapshots (``None``: none).
    """

    def __init__(
        self, sink: EventSink | None, source: str = "engine:0",
        engine_step_interval_ms: float | None = 100.0,
    ) -> None:
        self.sink = sink
        self.enabled = sink is not None
        self.source = source
        self._step_interval_ns = (None if engine_step_interval_ms is None
                                  else int(engine_step_interval_ms * 1e6))
        """``None``: no ``engine_step`` snapshots (the simulator takes its own on the virtual clock)."""
        self._last_step_ns: int | None = None
        self.num_errors = 0

    def _emit(self, cls: type[Any], session_id: str | None, turn: int | None, **fields: Any) -> None:
        if self.sink is None:
            return
        try:
            self.sink.emit(cls(
                t_mono_ns=time.monotonic_ns(), t_wall=datetime.now(UTC), session_id=session_id,
                turn=turn, source=self.source, **fields,
            ))
        except Exception:  # telemetry must never break scheduling
            self.num_errors += 1
            if self.num_errors <= 3:
                logger.exception("mars telemetry: dropping a %s event", cls.__name__)

    def queued(self, request_id: str, session_id: str | None, turn: int | None,
               num_prompt_tokens: int, num_projected_blocks: int | None) -> None:
        """A request entered the waiting queue."""
        self._emit(ev.RequestQueued, session_id, turn, request_id=request_id,
                   num_prompt_tokens=num_prompt_tokens, num_projected_blocks=num_projected_blocks)

    def first_scheduled(self, request_id: str, session_id: str | None, turn: int | None,
                        delay_s: float, num_cached_tokens: int) -> None:
        """First prefill chunk scheduled ``delay_s`` seconds after arrival."""
        self._emit(ev.RequestFirstScheduled, session_id, turn, request_id=request_id,
                   prefill_start_delay_s=max(0.0, delay_s), num_cached_tokens=num_cached_tokens)

    def first_token(self, request_id: str, session_id: str | None, turn: int | None,
                    ttft_s: float) -> None:
        """First output token, ``ttft_s`` after arrival."""
        self._emit(ev.RequestFirstToken, session_id, turn, request_id=request_id,
                   ttft_s=max(0.0, ttft_s))

    def finished(self, request_id: str, session_id: str | None, turn: int | None, *,
                 num_prompt_tokens: int, num_output_tokens: int, num_blocks_freed: int,
                 num_blocks_retained: int, finish_reason: str | None, e2e_s: float | None) -> None:
        """A request finished; its blocks were freed or retained."""
        self._emit(ev.RequestFinished, session_id, turn, request_id=request_id,
                   num_prompt_tokens=num_prompt_tokens, num_output_tokens=num_output_tokens,
                   num_blocks_freed=num_blocks_freed, num_blocks_retained=num_blocks_retained,
                   finish_reason=finish_reason, e2e_s=None if e2e_s is None else max(0.0, e2e_s))

    def preempted(self, request_id: str, session_id: str | None, turn: int | None,
                  num_blocks_freed: int, num_computed_tokens: int) -> None:
        """A running request was preempted (recompute)."""
        self._emit(ev.RequestPreempted, session_id, turn, request_id=request_id,
                   num_blocks_freed=num_blocks_freed, num_computed_tokens=num_computed_tokens)

    def kv_retained(self, request_id: str | None, session_id: str | None, turn: int | None,
                    num_blocks: int, ttl_s: float, reason: str) -> None:
        """A finished turn's blocks are pinned (or their TTL was refined)."""
        self._emit(ev.KvRetained, session_id, turn, request_id=request_id, num_blocks=num_blocks,
                   ttl_s=max(0.0, ttl_s), reason=reason)

    def kv_released(self, session_id: str | None, num_blocks: int, reason: str,
                    held_s: float | None, num_reused_blocks: int | None = None) -> None:
        """Retained blocks were unpinned; ``reason`` is one of KvReleased's reasons;
        ``num_reused_blocks``: how many of them the next turn reused."""
        self._emit(ev.KvReleased, session_id, None, num_blocks=num_blocks, reason=reason,
                   held_s=None if held_s is None else max(0.0, held_s),
                   num_reused_blocks=num_reused_blocks)

    @property
    def emits_steps(self) -> bool:
        """Whether ``engine_step`` snapshots are emitted at all (enabled, with an interval)."""
        return self.sink is not None and self._step_interval_ns is not None

    def should_emit_step(self) -> bool:
        """True at most once per ``engine_step_interval_ms`` (and only when enabled)."""
        if self.sink is None or self._step_interval_ns is None:
            return False
        now_ns = time.monotonic_ns()
        if self._last_step_ns is not None and now_ns - self._last_step_ns < self._step_interval_ns:
            return False
        self._last_step_ns = now_ns
        return True

    def engine_step(self, **fields: Any) -> None:
        """Emit one ``engine_step`` snapshot (after :meth:`should_emit_step`, or for an idle
        engine whose state changed, see ``MarsBaseScheduler._is_idle_snapshot_due``)."""
        self._emit(ev.EngineStep, None, None, **fields)

    def close(self) -> None:
        """Close the sink (idempotent)."""
        if self.sink is not None:
            try:
                self.sink.close()
            finally:
                self.sink = None
                self.enabled = False


def make_telemetry(params: TelemetryParams, sink: EventSink | None = None) -> EngineTelemetry:
    """Telemetry from params: ``sink`` if given, else a ZmqEventPublisher to ``params.addr``.

    Raises:
        ValueError: a non-loopback address (from the publisher).
    """
    if sink is None and params.addr:
        from mars_openhands.stream.transport import ZmqEventPublisher

        sink = ZmqEventPublisher(params.addr)
    return EngineTelemetry(sink, params.source, params.engine_step_interval_ms)
