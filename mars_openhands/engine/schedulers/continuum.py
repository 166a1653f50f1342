"""``ContinuumScheduler``: Continuum's tool-aware KV pinning on stock vLLM (arXiv 2511.02230).

Policy: :mod:`mars_openhands.policy.continuum` (both variants, formulas, port notes). Modes
(``mars.continuum.mode``): ``continuum`` (public code: pin 2 s if the tool's running-mean duration
is at most 2 s) and ``continuum-dy`` (paper §4.2: TTL maximizing expected saved seconds minus
seconds held). Each hook calls one policy function:

==========================  =================================================================
hook                        policy
==========================  =================================================================
``waiting_key``             :func:`waiting_order_key`: pinned programs first, program FCFS
``victim_key``              :func:`running_victim_key`: non-final calls, latest program first
``retention_decision``      :func:`pin_ttl_s` at the end of a non-final turn
``refine_retention``        :func:`pin_ttl_s` again once ``tool_start`` names the tool
``can_release_expired``     :func:`should_unpin`: expired and nothing of the program waiting
``_reclaim_for``            :func:`pin_release_order`: latest program arrival first
``on_preempted`` / ``on_scheduled``  :class:`QueueDelayWindow` (``T``: eviction -> re-scheduling)
arrivals / program ends     :class:`MemoryfulnessEstimator` (``eta = -Corr(k, N - k)``)
==========================  =================================================================

Tool durations (Continuum's ``S[f]``) come from the base class's estimator, fed with the gap
between a turn's finish and the next turn's arrival, or with ``mars_prev_tool_s`` / ``tool_end``
when the gateway sends them. A failed KV allocation releases pins (never the requesting session's
own) before vLLM preempts anyone, and nothing on that path raises: the public code raised
``IndexError`` when KV ran out with one running request and nothing pinned; here vLLM's own
preemption handles that case.

``--additional-config '{"mars": {"continuum": {...}}}'`` (see docs/schedulers.md).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from vllm.v1.request import Request, RequestStatus

from mars_openhands.engine.schedulers.base import MarsBaseScheduler, RetainedKv
from mars_openhands.policy.continuum import (
    ContinuumParams,
    MemoryfulnessEstimator,
    QueueDelayWindow,
    pin_benefit_s,
    pin_release_order,
    pin_ttl_s,
    running_victim_key,
    should_unpin,
    waiting_order_key,
)
from mars_openhands.policy.retention import RetentionDecision
from mars_openhands.policy.session import SessionState

__all__ = ["ContinuumScheduler"]

_WAITING = (RequestStatus.WAITING, RequestStatus.PREEMPTED)


class ContinuumScheduler(MarsBaseScheduler):
    """Continuum / Continuum-dy: program-level FCFS with TTL-pinned KV between turns."""

    coalescible_blocked_runs = True
    """Per-step work beyond the base timers: ``on_scheduled`` acts only on a request scheduled
    again after an eviction (never inside a run of decodes), and the victim ranks are rewritten
    before any step that could preempt."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.continuum_params: ContinuumParams = self.params.continuum
        self.evicted_queue_delay = QueueDelayWindow(self.continuum_params.queue_delay_window)
        self.memoryfulness = MemoryfulnessEstimator(self.continuum_params.eta_default)
        self._program_arrival_s: dict[str, float] = {}
        """Program (session, or request without one) -> its first arrival, scheduler clock."""
        self._program_ks: dict[str, list[int]] = {}
        """Session -> ``k`` (turns finished) at each of its calls' arrivals, for eta."""
        self._live: dict[str, tuple[str | None, bool]] = {}
        """Request -> (session, known last step) while it is in the engine."""
        self._evicted_at_s: dict[str, float] = {}

    # ------------------------------------------------------------------ request lifecycle
    def add_request(self, request: Request, **kwargs: Any) -> None:
        """vLLM: a new call; records its program's first arrival and its ``k``."""
        is_new = request.request_id not in self.requests
        super().add_request(request, **kwargs)
        if not is_new:
            return
        rid, sid = request.request_id, request.session_id
        state = self.req_state.get(rid)
        self._program_arrival_s.setdefault(sid or rid, state.arrival_s if state else self.clock())
        self._live[rid] = (sid, bool(state and state.meta.is_last_step))
        session = self.sessions.get(sid) if sid is not None else None
        if session is not None and not (state and state.meta.is_side):  # a side call is no turn
            self._program_ks.setdefault(sid, []).append(session.num_turns_finished)

    def on_requests_finished(self, request_ids: list[str]) -> None:
        """Base hook: finished or aborted calls end their bookkeeping (aborted ones count too)."""
        self._finish_calls(request_ids)

    def on_stream_event(self, event: Any, now_s: float | None = None) -> None:
        """Base event handling; ``session_end`` also ends the program (eta sample)."""
        super().on_stream_event(event, now_s)
        if event.kind == "session_end" and event.session_id is not None:
            self._end_program(event.session_id)

    # ------------------------------------------------------------------ ordering hooks
    def waiting_key(self, request: Request, now_s: float) -> Any:
        """Pinned programs first, then program-level FCFS, then FIFO within a program."""
        sid = request.session_id
        return waiting_order_key(
            sid is not None and sid in self.retained,
            self._program_arrival_s.get(sid or request.request_id, now_s),
            self.waiting.order_of(request),
        )

    def victim_key(self, request: Request, now_s: float) -> Any:
        """Non-final calls first, latest program arrival first (largest key evicted)."""
        sid, is_last = self._live.get(request.request_id, (request.session_id, False))
        return running_victim_key(
            is_last, self._program_arrival_s.get(sid or request.request_id, now_s)
        )

    # ------------------------------------------------------------------ retention hooks
    def retention_decision(
        self, request: Request, session: SessionState, now_s: float
    ) -> RetentionDecision | None:
        """Pin for :func:`pin_ttl_s` (tool named by ``tool_start`` if it came already)."""
        return self._decision(session.pending_tool, request.num_tokens, 0.0)

    def refine_retention(
        self, entry: RetainedKv, session: SessionState, tool_name: str, now_s: float
    ) -> RetentionDecision | None:
        """``tool_start`` named the tool: recompute the TTL as if known at the finish."""
        decision = self._decision(tool_name, entry.num_tokens, now_s - entry.retained_s)
        return decision or RetentionDecision(0.0, 0.0, f"{self.continuum_params.mode}:tool_start")

    def can_release_expired(self, entry: RetainedKv, now_s: float) -> bool:
        """Release an expired pin only if nothing of the program waits (public code)."""
        return should_unpin(now_s, entry.expires_s, self._has_waiting(entry.session_id))

    def _reclaim_for(self, request: Request) -> bool:
        """Allocation failed: release one pin of another program, latest program arrival first.

        Returns:
            True if a pin was released (vLLM retries the allocation), else False (vLLM preempts).
        """
        own = request.session_id
        order = pin_release_order(
            (sid, self._program_arrival_s.get(sid, 0.0)) for sid in self.retained if sid != own
        )
        if not order:
            return False
        self.reclaim(order[0])
        return True

    def on_preempted(self, request: Request) -> None:
        """Remember when ``request`` was evicted (for ``T``); it re-enters in program order."""
        self._evicted_at_s[request.request_id] = self.clock()
        self.waiting.is_dirty = True

    def release_retained(self, session_id: str, reason: str, now_s: float | None = None) -> int:
        """Base release; the program loses its pinned-first place in the waiting order."""
        released = super().release_retained(session_id, reason, now_s)
        if released:
            self.waiting.is_dirty = True
        return released

    def on_scheduled(self, request: Request, num_tokens: int, was_running: bool, now_s: float) -> None:
        """An evicted request is scheduled again: one queueing-delay sample for ``T``."""
        evicted_s = self._evicted_at_s.pop(request.request_id, None)
        if evicted_s is not None and not was_running:
            self.evicted_queue_delay.record(now_s - evicted_s)

    # ------------------------------------------------------------------ internals
    def eta(self) -> float:
        """Memoryfulness ``eta``: measured ``-Corr(k, N - k)`` or the configured default."""
        if self.continuum_params.measure_eta:
            return self.memoryfulness.eta()
        return self.continuum_params.eta_default

    def _decision(self, tool: str | None, num_tokens: int, held_s: float) -> RetentionDecision | None:
        p = self.continuum_params
        queue_delay_s, eta = self.evicted_queue_delay.mean_s(), self.eta()
        ttl_s = pin_ttl_s(tool, num_tokens, self.tool_durations, queue_delay_s, eta, p) - held_s
        if ttl_s <= 0.0:
            return None
        self.waiting.is_dirty = True  # the program may move to the pinned-first group
        value_s = pin_benefit_s(queue_delay_s, eta, p.prefill_reload.seconds(num_tokens))
        return RetentionDecision(ttl_s, max(value_s, 1e-9), f"{p.mode}:ttl")

    def _has_waiting(self, session_id: str) -> bool:
        session = self.sessions.get(session_id)
        if session is None:
            return False
        return any(
            (r := self.requests.get(rid)) is not None and r.status in _WAITING
            for rid in session.active_request_ids
        )

    def _finish_calls(self, request_ids: Iterable[str]) -> None:
        for rid in request_ids:
            self._evicted_at_s.pop(rid, None)
            sid, is_last = self._live.pop(rid, (None, False))
            if sid is None:
                self._program_arrival_s.pop(rid, None)
            elif is_last:
                self._end_program(sid)
        if len(self._program_arrival_s) > 2 * len(self.sessions) + 64:
            self._forget_idle_programs()

    def _end_program(self, session_id: str) -> None:
        ks = self._program_ks.pop(session_id, None)
        if ks:
            self.memoryfulness.observe_program(ks, len(ks))
        self._program_arrival_s.pop(session_id, None)

    def _forget_idle_programs(self) -> None:
        live = {sid for sid, _ in self._live.values()} | set(self._live)
        for pid in [p for p in self._program_arrival_s if p not in self.sessions and p not in live]:
            self._program_arrival_s.pop(pid, None)
            self._program_ks.pop(pid, None)
