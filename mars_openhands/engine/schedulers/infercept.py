"""``InferceptScheduler``: InferCept's min-waste retention, as MARS ported it (design.md §5).

Policy: :mod:`mars_openhands.policy.infercept` (formulas, and why there is no swap on vLLM 0.32
here). At the end of a turn that is not the session's last, the request's KV is retained for the
break-even TTL ``T_fwd(C) * (C + C_other) / (2 C)`` with ``C`` its tokens and ``C_other`` the
tokens of the other running requests; scheduling order (FCFS) and the preemption victim are
stock vLLM's. The base class releases the pin when the session's next turn is scheduled
("resumed"), when it expires with nothing of the session in the engine, or when an allocation
fails (lowest value per block first, before any running request is preempted).

Difference from the MARS preview: the preview kept InferCept pins until they expired unless the
running queue was empty; here a failed allocation reclaims them first, because under InferCept's
own waste metric an idle preserved context is the cheapest memory to give back (preempting a
running request costs the same recompute plus its progress).

``--additional-config '{"mars": {"infercept": {...}}}'`` (see docs/schedulers.md).
"""

from __future__ import annotations

from vllm.v1.request import Request

from mars_openhands.engine.schedulers.base import MarsBaseScheduler
from mars_openhands.engine.schedulers.coalesce import (
    CertifiedRuns,
    HeadRule,
    head_rule_without_hit_cap,
)
from mars_openhands.policy.infercept import InferceptParams, infercept_ttl_s
from mars_openhands.policy.retention import RetentionDecision
from mars_openhands.policy.session import SessionState

__all__ = ["InferceptScheduler"]


class InferceptScheduler(CertifiedRuns, MarsBaseScheduler):
    """FCFS with InferCept's break-even KV retention at the end of non-final turns.

    Merged runs (:class:`CertifiedRuns`): no per-step hook, only the base class's timers."""

    def head_rule(self) -> HeadRule:
        """No chunk hook: vLLM's own chunking (:func:`head_rule_without_hit_cap`). Pure."""
        return head_rule_without_hit_cap(self.chunk_shrinking)

    def retention_decision(
        self, request: Request, session: SessionState, now_s: float
    ) -> RetentionDecision | None:
        """Retain for :func:`infercept_ttl_s` (``C`` = the request's tokens, capped at
        max_model_len; ``C_other`` = the other running requests' tokens); None when it is 0."""
        params: InferceptParams = self.params.infercept
        context_tokens = min(request.num_tokens, self.max_model_len)
        other_tokens = sum(
            min(r.num_tokens, self.max_model_len) for r in self.running if r is not request
        )
        ttl_s = infercept_ttl_s(context_tokens, other_tokens, params)
        if ttl_s <= 0.0:
            return None
        # value: the re-prefill seconds a warm resume saves (reclaim order: lowest per block)
        return RetentionDecision(ttl_s, params.prefill_reload.seconds(context_tokens),
                                 "infercept:break_even")
