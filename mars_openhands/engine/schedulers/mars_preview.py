"""``MarsPreviewScheduler``: a faithful port of the MARS preview's ``policy=mars`` (design.md §4).

Source: ``Afterglow231/MARS_preview`` (commit 7e649f3), ``vllm-continuum/vllm/v1/core/sched/
scheduler.py`` (``_mars_*`` methods) and ``request_queue.py`` (``MarsRequestQueue``). Ported as
behaviour on stock vLLM's hooks, not copied:

* waiting order: ``(level of the FULL prompt, FIFO)``; a request vLLM prepends (preempted or
  skipped) goes first at level 0, most recent first;
* running order: ``(effective level, last scheduled, arrival)``, where effective level =
  ``max(0, max(feedback, remaining-prompt level) - floor((now - last scheduled) / 30 s))`` and a
  never-scheduled request counts as scheduled ``30 s * (levels + 1)`` ago;
* per-level prefill quanta (2048, 1024, 512, 256) capped at the step budget; feedback: a running
  prefill step that used a full quantum with work left demotes one level, decode resets to 0
  (only running-path steps update feedback, as in the preview); preemption resets level and clock;
* chunk shrinking: halve a prefill chunk (not below block_size) until its KV fits;
* victim: ``argmax (level', blocks from computed tokens, arrival)``, decode ``level' = -1``;
* in-engine window of 30 requests with an FCFS overflow queue;
* no KV retention (blocks go to the prefix-cache LRU).
"""

from __future__ import annotations

import math
from typing import Any, ClassVar

from vllm.v1.request import Request

from mars_openhands.engine import seams
from mars_openhands.engine.schedulers.base import MarsBaseScheduler
from mars_openhands.engine.schedulers.coalesce import CertifiedRuns
from mars_openhands.engine.schedulers.request_state import reset_mlfq, update_mlfq_feedback
from mars_openhands.policy.levels import (
    bucket_level,
    preview_effective_level,
    preview_remaining_level,
    quantum_tokens,
)
from mars_openhands.policy.victim import victim_key

__all__ = ["MarsPreviewScheduler", "update_mlfq_feedback"]


class MarsPreviewScheduler(CertifiedRuns, MarsBaseScheduler):
    """The MARS preview's in-engine policy on stock vLLM (the anchor our ``mars`` must beat).

    Merged runs (:class:`CertifiedRuns`): in a blocked decode run every running request decodes
    (feedback 0, effective level 0) and was stamped by the probe step, so the running order is
    arrival order in every step; the stamps the run's steps would leave are its last step's
    (``MergedRun.last_step_s``), and the waiting order has no clock
    (:meth:`is_waiting_order_timeless`). A long prompt at the last level (feedback and effective
    level) is given the last level's quantum each step and stays there (a full quantum with work
    left demotes to the last level again); every running request is stamped each step, so the
    running order is fixed, as in a blocked decode run. The run stays inside the prompt
    (:meth:`run_max_steps`: past it the preview counts a step as decode) and each step is
    shorter than the aging interval (:meth:`run_max_prefill_step_s`: no aging boost between two
    steps)."""

    default_window_enabled: ClassVar[bool] = True
    default_chunk_shrinking: ClassVar[bool] = True

    def is_waiting_order_timeless(self) -> bool:
        """The waiting key is (full-prompt level, FIFO) with prepended requests first at level 0,
        most recent first: where vLLM's prepend puts them, and no clock. Pure."""
        return True

    def prefill_run_chunk_tokens(self, request: Request) -> int | None:
        """The last level's quantum for a running prompt whose feedback and effective level are
        the last level, with more than one quantum of prompt left, else None. Pure."""
        state = self.req_state.get(request.request_id)
        lp = self.params.levels
        last = lp.num_levels - 1
        if state is None or state.feedback_level != last or state.mlfq_last_scheduled_s is None:
            return None
        c = request.num_computed_tokens
        quantum = quantum_tokens(last, lp, seams.hooks.max_num_scheduled_tokens(self))
        if (quantum != lp.quanta_tokens[last] or request.num_prompt_tokens - c <= quantum
                or self._effective_level(request, self.clock(), c) != last):
            return None
        return quantum

    def run_max_prefill_step_s(self) -> float:
        """Longest single step a merged prefill run may hold: the aging interval (a longer one
        would age a prompt by a level before its next step). Pure."""
        interval = self.params.levels.aging_interval_s
        return interval if interval > 0 else math.inf

    def run_max_steps(self, limit: int, step_tokens: int | None = None) -> int:
        """Most steps a merged run may take: a running prompt's chunks stay inside its prompt,
        with a token to spare (``(prompt - computed - 1) // quantum``). Pure."""
        k = limit
        for request in self.running:
            c = request.num_computed_tokens
            if c < request.num_prompt_tokens:
                quantum = self.prefill_run_chunk_tokens(request)
                if quantum is None:
                    return 1
                k = min(k, (request.num_prompt_tokens - c - 1) // quantum)
        return max(1, k)

    def _effective_level(self, request: Request, now_s: float, num_computed_tokens: int) -> int:
        state = self.req_state.get(request.request_id)
        lp = self.params.levels
        remaining = preview_remaining_level(request.num_prompt_tokens, num_computed_tokens, lp)
        if state is None:
            return remaining
        return preview_effective_level(
            state.feedback_level, remaining, state.mlfq_last_scheduled_s, now_s, lp
        )

    def waiting_key(self, request: Request, now_s: float) -> Any:
        """(full-prompt level, FIFO); prepended requests first at level 0 (preview queue)."""
        order = self.waiting.order_of(request)
        if order < 0:
            return (0, order)
        return (bucket_level(request.num_prompt_tokens, self.params.levels.prompt_thresholds_tokens),
                order)

    def running_key(self, request: Request, now_s: float) -> Any:
        """(effective level, last scheduled, arrival) (preview ``_mars_reorder_running``)."""
        state = self.req_state.get(request.request_id)
        last = state.mlfq_last_scheduled_s if state else None
        if last is None:
            lp = self.params.levels
            last = now_s - lp.aging_interval_s * (lp.num_levels + 1)
        return (self._effective_level(request, now_s, request.num_computed_tokens), last,
                request.arrival_time)

    def victim_key(self, request: Request, now_s: float) -> Any:
        """argmax (level', blocks estimated from computed tokens, arrival); decode level' = -1."""
        state = self.req_state.get(request.request_id)
        lp = self.params.levels
        level = max(state.feedback_level if state else 0,
                    preview_remaining_level(request.num_prompt_tokens,
                                            request.num_computed_tokens, lp))
        is_decode = request.num_computed_tokens >= request.num_prompt_tokens
        num_blocks = -(-min(request.num_computed_tokens, self.max_model_len) // self.block_size)
        return victim_key(level, is_decode, num_blocks, request.arrival_time)

    def chunk_tokens(self, request: Request, num_new_tokens: int, num_computed_tokens: int) -> int:
        """Cap a prefill chunk at the quantum of the request's effective level."""
        return self.cap_chunk_at_quantum(request, self._effective_level(request, self.clock(), num_computed_tokens), num_new_tokens)

    def on_scheduled(self, request: Request, num_tokens: int, was_running: bool, now_s: float) -> None:
        """Preview: only running-path steps update the MLFQ feedback."""
        if not was_running:
            return
        state = self.req_state.get(request.request_id)
        if state is not None:
            update_mlfq_feedback(state, request, num_tokens, now_s, self.params.levels)

    def on_preempted(self, request: Request) -> None:
        """Preview: a preempted request restarts at level 0 with no aging clock."""
        state = self.req_state.get(request.request_id)
        if state is not None:
            reset_mlfq(state)
