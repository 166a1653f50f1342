"""``MarsScheduler``: our in-engine MARS policy (MARS §4.3; design.md §4 "Our mars policy").

Fixes the preview's weaknesses on the same hooks (docs/schedulers.md has each choice's measurement):

* level from the prefill work the turn *adds* (prompt beyond the session's previous context, and
  beyond the prefix hit measured at arrival, which includes retained KV), plus the session's
  attained service, with aging promotion bounded by ``mars.max_promotion_levels`` and counted from
  the request's arrival (waiting) or last scheduled step (running), so a continuation ranks by its
  new work whether or not its context survived in KV, and no request starves (policy/levels.py);
  re-prefilling a lost context does not demote the request (``mars.level_from_new_work``);
* within a level, program-level FIFO: the oldest session first (``mars.session_fifo``);
* per-level prefill quanta sized for MoE step costs (``mars.quanta_tokens``), then chunk shrinking
  down to block granularity when KV would not fit;
* victim ``argmax (level', session arrival, arrival)`` (decode ``level' = -1``): the youngest
  session goes first;
* KV retention at the end of a non-final turn by the value model (policy/retention.py), with the
  provisional TTL refined at ``tool_start`` by that tool's duration CDF, kept for the imminent turn
  at ``tool_end``, released at ``session_end``; reclaimed before any preemption, lowest value first,
  a younger session's always, an older session's only once its value no longer pays for its
  remaining TTL at the current shadow price.

No in-engine admission window by default (the gateway admits whole sessions); set
``mars.window.enabled`` to use one.
"""

from __future__ import annotations

from typing import Any, ClassVar

from vllm.v1.request import Request, RequestStatus

from mars_openhands.engine import seams
from mars_openhands.engine.schedulers.base import MarsBaseScheduler, RetainedKv
from mars_openhands.engine.schedulers.mars_preview import update_mlfq_feedback
from mars_openhands.policy.levels import DECODE_VICTIM_LEVEL, effective_level, mars_base_level
from mars_openhands.policy.retention import (
    RetentionDecision,
    choose_ttl,
    shadow_price_s_per_block_s,
)
from mars_openhands.policy.session import SessionState
from mars_openhands.policy.victim import victim_key

__all__ = ["MarsScheduler"]


class MarsScheduler(MarsBaseScheduler):
    """Our MARS internal scheduler (session-aware MLFQ + KV retention)."""

    default_window_enabled: ClassVar[bool] = False
    default_chunk_shrinking: ClassVar[bool] = True

    # ------------------------------------------------------------------ levels
    def _cached_at_arrival(self, request: Request) -> int:
        return seams.prefix_hit_tokens(self, request)

    def level(self, request: Request, now_s: float, num_computed_tokens: int | None = None) -> int:
        """Effective MLFQ level of ``request`` now (0 = highest priority). Pure w.r.t. state."""
        state = self.req_state.get(request.request_id)
        computed = request.num_computed_tokens if num_computed_tokens is None else num_computed_tokens
        if state is None or computed >= request.num_prompt_tokens:
            return 0  # decode is level 0 (design.md §4)
        done = max(computed, state.cached_at_arrival_tokens)
        if self.params.mars.level_from_new_work:
            done = max(done, state.session_context_tokens)
        uncached = max(0, request.num_prompt_tokens - done)
        session = self.sessions.get(state.session_id) if state.session_id else None
        service = self.session_service_tokens(session) if session else 0
        base = mars_base_level(state.feedback_level, uncached, service, self.params.levels,
                               self.params.mars)
        since = state.mlfq_last_scheduled_s if state.mlfq_last_scheduled_s is not None else state.arrival_s
        return effective_level(base, now_s - since, self.params.levels, self.params.mars)

    def _session_arrival_s(self, state: Any) -> float:
        """Program-level arrival of the request's session (its own arrival without a session)."""
        if state is None:
            return 0.0
        if self.params.mars.session_fifo and state.session_id:
            session = self.sessions.get(state.session_id)
            if session is not None:
                return session.first_arrival_s
        return state.arrival_s

    def waiting_key(self, request: Request, now_s: float) -> Any:
        """(effective level, preempted/skipped first, session arrival, arrival, FIFO)."""
        state = self.req_state.get(request.request_id)
        order = self.waiting.order_of(request)
        return (self.level(request, now_s), 0 if order < 0 else 1, self._session_arrival_s(state),
                state.arrival_s if state else 0.0, order)

    def running_key(self, request: Request, now_s: float) -> Any:
        """(effective level, session arrival, last scheduled, arrival)."""
        state = self.req_state.get(request.request_id)
        last = state.mlfq_last_scheduled_s if state and state.mlfq_last_scheduled_s is not None else 0.0
        first = self._session_arrival_s(state) if self.params.mars.session_fifo else 0.0
        return (self.level(request, now_s), first, last, state.arrival_s if state else 0.0)

    def victim_key(self, request: Request, now_s: float) -> Any:
        """argmax (level', blocks held, arrival); decode level' = -1. With ``session_fifo`` the
        youngest session goes first (largest session arrival) instead of the largest footprint."""
        state = self.req_state.get(request.request_id)
        is_decode = request.num_computed_tokens >= request.num_prompt_tokens
        level = self.level(request, now_s)
        if self.params.mars.session_fifo:
            return ((DECODE_VICTIM_LEVEL if is_decode else level), self._session_arrival_s(state),
                    state.arrival_s if state else 0.0)
        return victim_key(level, is_decode, seams.num_request_blocks(self, request.request_id),
                          state.arrival_s if state else 0.0)

    def chunk_tokens(self, request: Request, num_new_tokens: int, num_computed_tokens: int) -> int:
        """Cap a prefill chunk at its level's quantum (shrink-to-fit follows in the base)."""
        level = self.level(request, self.clock(), num_computed_tokens)
        return self.cap_chunk_at_quantum(request, level, num_new_tokens, self.params.mars.quanta_tokens)

    def on_prefill_scheduled(
        self, request: Request, num_tokens: int, was_running: bool, now_s: float
    ) -> None:
        """MLFQ feedback after every scheduled prefill chunk (running or newly admitted); decode
        needs none (it is level 0)."""
        state = self.req_state.get(request.request_id)
        if state is None:
            return
        if self.params.mars.level_from_new_work and request.num_computed_tokens <= state.session_context_tokens:
            state.mlfq_last_scheduled_s = now_s  # still re-prefilling old context: no demotion
            return
        update_mlfq_feedback(state, request, num_tokens, now_s, self.params.levels)

    def on_preempted(self, request: Request) -> None:
        """A preempted request keeps its feedback level; its aging clock restarts now."""
        state = self.req_state.get(request.request_id)
        if state is not None:
            state.mlfq_last_scheduled_s = self.clock()

    # ------------------------------------------------------------------ retention
    def _decide(self, tool_name: str | None, num_tokens: int, num_blocks: int) -> RetentionDecision | None:
        return choose_ttl(
            self.tool_durations.cdf_for(tool_name), elapsed_s=0.0, num_tokens=num_tokens,
            num_blocks=num_blocks, queue_delay_s=self.queue_delay.value,
            kv_usage=self.kv_cache_manager.usage, params=self.params.retention,
        )

    def retention_decision(
        self, request: Request, session: SessionState, now_s: float
    ) -> RetentionDecision | None:
        """Provisional decision at turn end from the pooled tool-duration CDF (next tool unknown)."""
        if not self.params.retention.enabled:
            return None
        num_blocks = request.num_computed_tokens // self.block_size
        return self._decide(None, num_blocks * self.block_size, num_blocks)

    def can_reclaim_for(self, entry: RetainedKv, request: Request, now_s: float) -> bool:
        """Whether ``entry`` may be released so ``request`` can allocate.

        With ``mars.session_fifo`` (default): always when the entry's session is younger than the
        requester's; otherwise only when the entry's value no longer pays for its remaining TTL at
        full-pressure shadow price (an allocation just failed, so KV is the binding constraint:
        usage counts as 1). Without it: always for running work, by that value test for a
        waiting request."""
        if self.params.mars.session_fifo:
            # Priority-aligned: a younger session's KV is always taken; an older session's only
            # when it no longer pays for its TTL (else vLLM preempts the youngest running one).
            owner = self.sessions.get(entry.session_id)
            requester_s = self._session_arrival_s(self.req_state.get(request.request_id))
            if owner is None or owner.first_arrival_s > requester_s:
                return True
        elif request.status == RequestStatus.RUNNING:
            return True
        price = shadow_price_s_per_block_s(1.0, self.params.retention)
        remaining_s = max(0.0, entry.expires_s - now_s)
        return entry.value_s < remaining_s * entry.num_blocks * price

    def refine_retention(
        self, entry: RetainedKv, session: SessionState, tool_name: str, now_s: float
    ) -> RetentionDecision | None:
        """At ``tool_start``: re-decide with that tool's CDF; ttl 0 releases ("tool_start:cut")."""
        decision = self._decide(tool_name, entry.num_tokens, entry.num_blocks)
        if decision is None:
            return RetentionDecision(0.0, 0.0, "tool_start:cut")
        longer = now_s + decision.ttl_s > entry.expires_s
        return RetentionDecision(decision.ttl_s, decision.value_s,
                                 "tool_start:extend" if longer else "tool_start:shorten")
