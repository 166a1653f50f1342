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
``reclaim_key``             :func:`pin_release_key`: latest program arrival first
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
from dataclasses import dataclass, field
from typing import Any

from vllm.v1.request import Request, RequestStatus

from mars_openhands.engine.schedulers.base import MarsBaseScheduler, RetainedKv
from mars_openhands.engine.schedulers.coalesce import (
    CertifiedRuns,
    HeadRule,
    head_rule_without_hit_cap,
)
from mars_openhands.policy.continuum import (
    ContinuumParams,
    MemoryfulnessEstimator,
    QueueDelayWindow,
    pin_benefit_s,
    pin_release_key,
    pin_ttl_s,
    running_victim_key,
    should_unpin,
    waiting_order_key,
)
from mars_openhands.policy.retention import RetentionDecision
from mars_openhands.policy.session import SessionState

__all__ = ["ContinuumScheduler"]

_WAITING = (RequestStatus.WAITING, RequestStatus.PREEMPTED)


@dataclass(slots=True)
class _Program:
    """A session's program (its ``SessionState.program`` slot), from its first call to its end."""

    arrival_s: float
    """The program's first arrival, scheduler clock (program-level FCFS)."""
    ks: list[int] = field(default_factory=list)
    """``k`` (turns finished) at each of its turns' arrivals, for eta."""


@dataclass(slots=True)
class _Call:
    """A request while it is in the engine."""

    session_id: str | None
    is_last_step: bool
    arrival_s: float
    """Its arrival: the program arrival of a request without a session (a one-call program)."""


class ContinuumScheduler(CertifiedRuns, MarsBaseScheduler):
    """Continuum / Continuum-dy: program-level FCFS with TTL-pinned KV between turns.

    Merged runs (:class:`CertifiedRuns`): per-step work beyond the base timers: ``on_scheduled``
    acts only on a request scheduled again after an eviction (never inside a run of decodes),
    and the victim ranks are rewritten before any step that could preempt."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.continuum_params: ContinuumParams = self.params.continuum
        self.evicted_queue_delay = QueueDelayWindow(self.continuum_params.queue_delay_window)
        self.memoryfulness = MemoryfulnessEstimator(self.continuum_params.eta_default)
        self._live: dict[str, _Call] = {}
        """Request -> its session, known last step and arrival, while it is in the engine."""
        self._evicted_at_s: dict[str, float] = {}

    def head_rule(self) -> HeadRule:
        """No chunk hook: vLLM's own chunking (:func:`head_rule_without_hit_cap`). Pure."""
        return head_rule_without_hit_cap(self.chunk_shrinking)

    # ------------------------------------------------------------------ request lifecycle
    def on_request_added(self, request: Request) -> None:
        """Base hook: a new call; records its program's first arrival and its ``k``."""
        rid, sid = request.request_id, request.session_id
        state = self.req_state.get(rid)
        arrival_s = state.arrival_s if state else self.clock()
        self._live[rid] = _Call(sid, bool(state and state.meta.is_last_step), arrival_s)
        session = self.sessions.get(sid) if sid is not None else None
        if session is None:
            return
        if session.program is None:
            session.program = _Program(arrival_s)
        if not (state and state.meta.is_side):  # a side call is no turn
            session.program.ks.append(session.num_turns_finished)

    def on_requests_finished(self, request_ids: list[str]) -> None:
        """Base hook: finished or aborted calls end their bookkeeping (aborted ones count too)."""
        self._finish_calls(request_ids)

    def on_stream_event(self, event: Any, now_s: float | None = None) -> None:
        """Base event handling; ``session_end`` also ends the program (eta sample), first: the
        base may forget the session, and its program slot with it."""
        if event.kind == "session_end" and event.session_id is not None:
            self._end_program(event.session_id)
        super().on_stream_event(event, now_s)

    def _program_arrival_s(self, session_id: str | None, request_id: str, default_s: float) -> float:
        """Program-level arrival: the session's program's, or the session-less request's own;
        ``default_s`` when neither is known. Pure."""
        if session_id is not None:
            program = self.sessions.program(session_id)
            return default_s if program is None else program.arrival_s
        call = self._live.get(request_id)
        return default_s if call is None else call.arrival_s

    # ------------------------------------------------------------------ ordering hooks
    def waiting_key(self, request: Request, now_s: float) -> Any:
        """Pinned programs first, then program-level FCFS, then FIFO within a program."""
        sid = request.session_id
        return waiting_order_key(
            sid is not None and sid in self.retained,
            self._program_arrival_s(sid, request.request_id, now_s),
            self.waiting.order_of(request),
        )

    def victim_key(self, request: Request, now_s: float) -> Any:
        """Non-final calls first, latest program arrival first (largest key evicted)."""
        call = self._live.get(request.request_id)
        sid, is_last = (request.session_id, False) if call is None else (call.session_id, call.is_last_step)
        return running_victim_key(is_last, self._program_arrival_s(sid, request.request_id, now_s))

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

    def reclaim_key(self, entry: RetainedKv, request: Request, now_s: float) -> Any:
        """Allocation failed: another program's pin goes in Continuum's order, latest program
        arrival first (:func:`pin_release_key`). Pure."""
        owner = self.retention_owner(entry)
        return pin_release_key(owner._program_arrival_s(entry.session_id, "", 0.0))

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
            call = self._live.pop(rid, None)
            if call is not None and call.session_id is not None and call.is_last_step:
                self._end_program(call.session_id)

    def _end_program(self, session_id: str) -> None:
        """The program ended (last step or ``session_end``): one eta sample, slot cleared."""
        program = self.sessions.program(session_id)
        if program is not None and program.ks:
            self.memoryfulness.observe_program(program.ks, len(program.ks))
        self.sessions.set_program(session_id, None)
