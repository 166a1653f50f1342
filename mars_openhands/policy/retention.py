"""KV retention value model (MARS §4.3 "retain only when warm resumption yields a latency benefit";
design.md §4 last paragraph; the TTL search follows Continuum-dy, arXiv 2511.02230 §4.2).

At the end of a non-final turn the session's KV can be *retained* (pinned) for a TTL tau so that
the next turn hits it instead of re-prefilling. Retain for tau when::

    P(tool returns within tau) * (reload_s + queue_delay_s)  >  tau * num_blocks * price(u)

* ``reload_s``: prefill time of the retained prefix, ``a * n + b * n^2`` for n tokens
  (Continuum's PrefillReload, default 0.0002 s/token, no quadratic term);
* ``queue_delay_s``: the expected queueing delay a cold next turn would suffer (EMA, engine);
* ``price(u)``: shadow price of one KV block for one second at KV usage u, 0 below
  ``price_free_usage``, rising quadratically to ``price_max_s_per_block_s`` at u = 1.

Mental model: both sides are seconds of latency. The left is what a warm resume saves, weighted by
the chance the tool is back in time; the right is what holding the blocks costs everyone else.
The TTL maximises the difference over candidate TTLs taken from the tool's empirical duration CDF
(conditioned on the time the tool has already run). With no pressure the price is 0 and the TTL is
the largest observed duration up to ``max_ttl_s``; when memory is needed the engine reclaims
retained KV lowest ``value_per_block`` first, before preempting any running request.
"""

from __future__ import annotations

from dataclasses import dataclass

from mars_openhands.policy.estimators import EmpiricalCdf
from mars_openhands.policy.params import RetentionParams

__all__ = [
    "RetentionDecision",
    "choose_ttl",
    "is_reclaimable_by_value",
    "net_value_s",
    "reclaim_order_key",
    "reload_time_s",
    "shadow_price_s_per_block_s",
]

_MAX_CANDIDATES = 64
_COLD_START_PROB = 0.5


@dataclass(frozen=True, slots=True)
class RetentionDecision:
    """Retain for ``ttl_s`` seconds; ``value_s`` is the expected net saving (seconds, > 0)."""

    ttl_s: float
    value_s: float
    reason: str = "value>cost"


def reload_time_s(num_tokens: int, params: RetentionParams) -> float:
    """Seconds to re-prefill ``num_tokens`` tokens (linear + quadratic model). Pure.

    >>> reload_time_s(1000, RetentionParams())
    0.2
    """
    return params.reload_linear_s_per_token * num_tokens + params.reload_quad_s_per_token2 * (
        num_tokens * num_tokens
    )


def shadow_price_s_per_block_s(kv_usage: float, params: RetentionParams) -> float:
    """Seconds of latency one block costs per second held, at KV usage ``kv_usage`` in [0, 1]. Pure.

    >>> p = RetentionParams()
    >>> shadow_price_s_per_block_s(0.4, p), shadow_price_s_per_block_s(1.0, p)
    (0.0, 0.0032)
    """
    u0 = params.price_free_usage
    if kv_usage <= u0:
        return 0.0
    x = min(1.0, (kv_usage - u0) / (1.0 - u0))
    return params.price_max_s_per_block_s * x * x


def net_value_s(
    prob_back: float, reload_s: float, queue_delay_s: float, ttl_s: float, num_blocks: int,
    price_s_per_block_s: float,
) -> float:
    """Expected saving minus holding cost, seconds (the inequality above as a difference). Pure."""
    return prob_back * (reload_s + queue_delay_s) - ttl_s * num_blocks * price_s_per_block_s


def _candidates(cdf: EmpiricalCdf, elapsed_s: float, max_ttl_s: float) -> list[float]:
    """Candidate end times (absolute tool durations) in (elapsed, elapsed + max_ttl]."""
    support = [v for v in cdf.support(elapsed_s + max_ttl_s) if v > elapsed_s]
    if len(support) > _MAX_CANDIDATES:
        step = len(support) / _MAX_CANDIDATES
        support = [support[int(i * step)] for i in range(_MAX_CANDIDATES)] + [support[-1]]
    return support


def choose_ttl(
    cdf: EmpiricalCdf,
    *,
    elapsed_s: float,
    num_tokens: int,
    num_blocks: int,
    queue_delay_s: float,
    kv_usage: float,
    params: RetentionParams,
    reuse_fraction: float = 1.0,
) -> RetentionDecision | None:
    """Best TTL for retaining ``num_blocks`` blocks (``num_tokens`` tokens) of a dormant session.

    Args:
        cdf: tool-duration CDF to use (the tool's own, or pooled; see ToolDurationEstimator).
        elapsed_s: seconds the tool has already run (0 at turn end / tool_start).
        num_tokens: tokens the retained blocks hold (what a cold resume re-prefills).
        num_blocks: blocks retained.
        queue_delay_s: expected queueing delay of a cold resume.
        kv_usage: current KV usage in [0, 1] (for the shadow price).
        params: retention parameters.
        reuse_fraction: expected share of the retained context the next turn reuses, in [0, 1]
            (the session's measured reuse, policy/session.py; 1 before any is measured). The
            gain of a warm resume scales with it: 0 means retention saves nothing.

    Returns:
        The decision with the largest positive net value, or None when no TTL pays off. With no
        samples the cold-start TTL is used with an assumed 50% chance of return.
        Pure.
    """
    if num_blocks <= 0 or not params.enabled:
        return None
    gain_s = (reload_time_s(num_tokens, params) + queue_delay_s) * min(1.0, max(0.0, reuse_fraction))
    price = shadow_price_s_per_block_s(kv_usage, params)
    if cdf.num_samples == 0:
        ttl = min(params.cold_start_ttl_s, params.max_ttl_s)
        value = net_value_s(_COLD_START_PROB, gain_s, 0.0, ttl, num_blocks, price)
        return RetentionDecision(ttl, value, "cold_start") if ttl > 0 and value > 0 else None
    best: RetentionDecision | None = None
    for end_s in _candidates(cdf, elapsed_s, params.max_ttl_s):
        ttl = end_s - elapsed_s
        # At elapsed 0 nothing is known yet: the unconditional CDF (0-second tools count).
        prob = cdf.prob_le_given_gt(end_s, elapsed_s) if elapsed_s > 0 else cdf.prob_le(end_s)
        value = net_value_s(prob, gain_s, 0.0, ttl, num_blocks, price)
        if value > 0 and (best is None or value > best.value_s):
            best = RetentionDecision(ttl, value)
    return best


def reclaim_order_key(value_s: float, num_blocks: int) -> float:
    """Reclaim retained KV in increasing order of this key (value per block, seconds). Pure."""
    return value_s / max(1, num_blocks)


def is_reclaimable_by_value(value_s: float, expires_s: float, num_blocks: int, now_s: float,
                            params: RetentionParams) -> bool:
    """Whether a retained entry no longer pays for its remaining TTL at full-pressure price. Pure.

    Used when an allocation just failed, so KV is the binding constraint and usage counts as 1:
    reclaim when ``value_s < remaining_s * num_blocks * price(1)``, with ``remaining_s`` the
    seconds left until ``expires_s`` (0 once past it: then any positive value is kept only if
    the price is 0).

    Args:
        value_s: the entry's expected saving, seconds (its :class:`RetentionDecision` value).
        expires_s: when it expires, scheduler clock seconds.
        num_blocks: blocks it pins.
        now_s: the scheduler clock now.
        params: retention parameters (``price_*``).

    >>> p = RetentionParams()
    >>> is_reclaimable_by_value(0.1, 100.0, 10, 0.0, p), is_reclaimable_by_value(10.0, 100.0, 10, 0.0, p)
    (True, False)
    """
    price = shadow_price_s_per_block_s(1.0, params)
    remaining_s = max(0.0, expires_s - now_s)
    return value_s < remaining_s * num_blocks * price
