"""MLFQ priority levels (MARS §4.3; the public preview ``Afterglow231/MARS_preview``, design.md §4).

Smaller level = higher priority. Two variants:

* **Preview** (faithful port of the preview's ``policy=mars``): a waiting request's level is the
  bucket of its *full* prompt; a running request's base level is ``max(feedback, bucket(remaining
  prompt))`` where feedback is demoted one level after a prefill step that used a full quantum with
  work left and reset to 0 by any decode step; aging promotes one level per ``aging_interval_s``
  since the request was last scheduled, without bound (down to 0). A request never scheduled counts
  as last scheduled ``aging_interval_s * (num_levels + 1)`` ago, i.e. it starts at level 0.
* **Ours**: the base level is ``max(feedback, bucket(uncached prefill remainder), bucket(session
  attained service))``, so a continuation whose context is cached (retained KV or prefix cache)
  ranks with short prompts; aging promotes one level per ``aging_interval_s`` of *waiting* (since
  last scheduled, or since arrival), bounded by ``max_promotion_levels``.

Mental model (no starvation): a request that waits ``(num_levels - 1) * aging_interval_s`` reaches
level 0 (when ``max_promotion_levels >= num_levels - 1``), and within a level requests are served
FIFO, so its wait is bounded by the work queued ahead of it at level 0.

Region diagram of a prefill (tokens)::

    |<------------- num_prompt_tokens -------------->|
    |<--- cached (prefix hit) --->|<--- uncached --->|
    |<--- num_computed_tokens ------->|<- remaining ->|
"""

from __future__ import annotations

import bisect
import math

from mars_openhands.policy.params import LevelParams, MarsLevelParams

__all__ = [
    "DECODE_VICTIM_LEVEL",
    "bucket_level",
    "effective_level",
    "feedback_after_step",
    "mars_base_level",
    "preview_effective_level",
    "preview_remaining_level",
    "quantum_tokens",
]

DECODE_VICTIM_LEVEL = -1
"""Victim level of a decoding request: evicted last (MARS preview)."""


def bucket_level(num_tokens: int, thresholds_tokens: tuple[int, ...]) -> int:
    """Level of a token count: ``<= t[0] -> 0``, ``<= t[1] -> 1``, ..., above all -> len(t). Pure.

    >>> [bucket_level(n, (2048, 8192, 32768)) for n in (0, 2048, 2049, 8192, 32768, 32769)]
    [0, 0, 1, 1, 2, 3]
    """
    return bisect.bisect_left(thresholds_tokens, num_tokens)


def quantum_tokens(level: int, params: LevelParams, max_num_scheduled_tokens: int,
                   quanta_tokens: tuple[int, ...] | None = None) -> int:
    """Prefill token quantum of ``level`` (clamped to the level range), capped at the step budget.

    ``quanta_tokens`` overrides ``params.quanta_tokens`` (same length).

    >>> quantum_tokens(1, LevelParams(), 8192), quantum_tokens(9, LevelParams(), 100)
    (1024, 100)
    >>> quantum_tokens(0, LevelParams(), 8192, (8192, 2048, 1024, 512))
    8192
    """
    quanta = params.quanta_tokens if quanta_tokens is None else quanta_tokens
    q = quanta[max(0, min(level, params.num_levels - 1))]
    return min(q, max_num_scheduled_tokens)


def preview_remaining_level(
    num_prompt_tokens: int, num_computed_tokens: int, params: LevelParams
) -> int:
    """Preview's level of the remaining prompt; 0 once the prompt is computed (decode). Pure."""
    if num_computed_tokens >= num_prompt_tokens:
        return 0
    return bucket_level(num_prompt_tokens - num_computed_tokens, params.prompt_thresholds_tokens)


def _aging_boost(wait_s: float, interval_s: float) -> int:
    if interval_s <= 0 or wait_s <= 0:
        return 0
    return int(math.floor(wait_s / interval_s))


def preview_effective_level(
    feedback_level: int,
    remaining_level: int,
    last_scheduled_s: float | None,
    now_s: float,
    params: LevelParams,
) -> int:
    """Preview: ``max(0, max(feedback, remaining) - floor((now - last_scheduled) / aging))``. Pure.

    ``last_scheduled_s=None`` (never scheduled) counts as ``aging * (num_levels + 1)`` ago.
    """
    base = max(feedback_level, remaining_level)
    if params.aging_interval_s <= 0:
        return base
    if last_scheduled_s is None:
        last_scheduled_s = now_s - params.aging_interval_s * (params.num_levels + 1)
    return max(0, base - _aging_boost(now_s - last_scheduled_s, params.aging_interval_s))


def feedback_after_step(
    feedback_level: int,
    is_decode: bool,
    num_scheduled_tokens: int,
    quantum: int,
    num_remaining_after_tokens: int,
    params: LevelParams,
) -> int:
    """MLFQ feedback after one scheduled step. Pure.

    Decode resets to 0; a prefill step that used its full quantum with work left demotes one level
    (capped at the last level); otherwise unchanged.
    """
    if is_decode:
        return 0
    if num_scheduled_tokens >= quantum and num_remaining_after_tokens > 0:
        return min(feedback_level + 1, params.num_levels - 1)
    return feedback_level


def mars_base_level(
    feedback_level: int,
    num_uncached_prefill_tokens: int,
    session_service_tokens: int,
    params: LevelParams,
    mars: MarsLevelParams,
) -> int:
    """Our base level: max of feedback, uncached-remainder bucket and session-service bucket. Pure.

    Decode (no uncached prefill left) contributes 0 from the remainder.
    """
    rem = (
        bucket_level(num_uncached_prefill_tokens, params.prompt_thresholds_tokens)
        if num_uncached_prefill_tokens > 0
        else 0
    )
    level = max(feedback_level, rem)
    if mars.use_session_service:
        level = max(level, bucket_level(session_service_tokens, mars.session_service_thresholds_tokens))
    return min(level, params.num_levels - 1)


def effective_level(base_level: int, wait_s: float, params: LevelParams, mars: MarsLevelParams) -> int:
    """Our effective level: base minus bounded aging promotion. Pure.

    ``promotion = min(max_promotion_levels, floor(wait_s / aging_interval_s))``, result >= 0.

    >>> effective_level(3, 65.0, LevelParams(), MarsLevelParams(max_promotion_levels=1))
    2
    """
    boost = min(mars.max_promotion_levels, _aging_boost(wait_s, params.aging_interval_s))
    return max(0, base_level - boost)
