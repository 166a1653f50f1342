"""``MarsScheduler``: our in-engine MARS policy (MARS §4.3; design.md §4 "Our mars policy").

Fixes the preview's weaknesses on the same hooks:

* level from the *uncached* prefill remainder (prefix hit measured at arrival, which includes
  retained KV), plus the session's attained service, with aging promotion bounded by
  ``mars.max_promotion_levels`` and counted from the request's arrival (waiting) or last scheduled
  step (running), so a continuation with a long cached context ranks with short prompts and no
  request starves (policy/levels.py);
* per-level prefill quanta, then chunk shrinking down to block granularity when KV would not fit;
* victim ``argmax (level', blocks held, arrival)``, decode ``level' = -1``;
* KV retention at the end of a non-final turn by the value model (policy/retention.py), with the
  provisional TTL refined at ``tool_start`` by that tool's duration CDF, kept for the imminent turn
  at ``tool_end``, released at ``session_end``; reclaimed lowest value first before any preemption
  (for admitting a waiting request, only entries whose value no longer pays for their remaining TTL
  at the current shadow price).

No in-engine admission window by default (the gateway admits whole sessions); set
``mars.window.enabled`` to use one.
"""

from __future__ import annotations

from typing import Any, ClassVar

from vllm.v1.request import Request, RequestStatus

from mars_openhands.engine import seams
from mars_openhands.engine.schedulers.base import MarsBaseScheduler, RetainedKv
from mars_openhands.engine.schedulers.mars_preview import update_mlfq_feedback
from mars_openhands.policy.levels import effective_level, mars_base_level
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
        cached = max(computed, state.cached_at_arrival_tokens)
        uncached = max(0, request.num_prompt_tokens - cached)
        session = self.sessions.get(state.session_id) if state.session_id else None
        service = self.session_service_tokens(session) if session else 0
        base = mars_base_level(state.feedback_level, uncached, service, self.params.levels,
                               self.params.mars)
        since = state.mlfq_last_scheduled_s if state.mlfq_last_scheduled_s is not None else state.arrival_s
        return effective_level(base, now_s - since, self.params.levels, self.params.mars)

    def waiting_key(self, request: Request, now_s: float) -> Any:
        """(effective level, preempted/skipped first, arrival, FIFO)."""
        state = self.req_state.get(request.request_id)
        order = self.waiting.order_of(request)
        return (self.level(request, now_s), 0 if order < 0 else 1,
                state.arrival_s if state else 0.0, order)

    def running_key(self, request: Request, now_s: float) -> Any:
        """(effective level, last scheduled, arrival)."""
        state = self.req_state.get(request.request_id)
        last = state.mlfq_last_scheduled_s if state and state.mlfq_last_scheduled_s is not None else 0.0
        return (self.level(request, now_s), last, state.arrival_s if state else 0.0)

    def victim_key(self, request: Request, now_s: float) -> Any:
        """argmax (level', blocks held, arrival); decode level' = -1."""
        state = self.req_state.get(request.request_id)
        is_decode = request.num_computed_tokens >= request.num_prompt_tokens
        return victim_key(self.level(request, now_s), is_decode,
                          seams.num_request_blocks(self, request.request_id),
                          state.arrival_s if state else 0.0)

    def chunk_tokens(self, request: Request, num_new_tokens: int, num_computed_tokens: int) -> int:
        """Cap a prefill chunk at its level's quantum (shrink-to-fit follows in the base)."""
        return self.cap_chunk_at_quantum(request, self.level(request, self.clock(), num_computed_tokens), num_new_tokens)

    def on_prefill_scheduled(
        self, request: Request, num_tokens: int, was_running: bool, now_s: float
    ) -> None:
        """MLFQ feedback after every scheduled prefill chunk (running or newly admitted); decode
        needs none (it is level 0)."""
        state = self.req_state.get(request.request_id)
        if state is not None:
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
        """Always before preempting running work; for admitting a waiting request only when the
        entry's value no longer pays for its remaining TTL at full-pressure shadow price (an
        allocation just failed, so KV is the binding constraint: usage counts as 1)."""
        if request.status == RequestStatus.RUNNING:
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
