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
    "feedback_after_scheduled",
    "feedback_after_step",
    "mars_base_level",
    "mars_level",
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


def feedback_after_scheduled(
    feedback_level: int,
    quantum_tokens: int | None,
    num_scheduled_tokens: int,
    num_prompt_tokens: int,
    num_computed_tokens: int,
    num_tokens: int,
    params: LevelParams,
) -> int:
    """MLFQ feedback after a request was scheduled for ``num_scheduled_tokens`` in one step. Pure.

    The preview's ``_mars_on_scheduled`` rule (:func:`feedback_after_step`) from the request's
    counts as vLLM leaves them after ``schedule()``: ``num_computed_tokens`` already includes this
    step's tokens. The step was a decode when the computed tokens before it covered the prompt::

        |<------------------ num_tokens (prompt + outputs so far) ------------------>|
        |<-- computed before -->|<-- num_scheduled_tokens -->|<-- remaining after -->|
                                                  num_computed_tokens ^

    Args:
        feedback_level: the request's level before the step.
        quantum_tokens: the quantum the chunk hook applied this step; None (not capped): the
            step's own tokens count as a full quantum.
        num_scheduled_tokens: tokens scheduled this step (>= 1).
        num_prompt_tokens, num_computed_tokens, num_tokens: vLLM's counts after ``schedule()``.
        params: level parameters.

    Returns:
        The new feedback level, in ``[0, params.num_levels - 1]``.

    >>> feedback_after_scheduled(0, 2048, 2048, 10000, 2048, 10000, LevelParams())  # full quantum, work left
    1
    >>> feedback_after_scheduled(2, None, 1, 100, 101, 102, LevelParams())  # a decode resets
    0
    """
    is_decode = num_computed_tokens - num_scheduled_tokens >= num_prompt_tokens
    quantum = quantum_tokens if quantum_tokens is not None else num_scheduled_tokens
    remaining_after = max(0, num_tokens - num_computed_tokens)
    return feedback_after_step(feedback_level, is_decode, num_scheduled_tokens, quantum,
                               remaining_after, params)


def mars_level(
    *,
    num_prompt_tokens: int,
    num_computed_tokens: int,
    num_cached_at_arrival_tokens: int,
    num_session_context_tokens: int,
    session_service_tokens: int,
    feedback_level: int,
    wait_s: float,
    params: LevelParams,
    mars: MarsLevelParams,
) -> int:
    """Our effective MLFQ level of a request (0 = highest priority). Pure.

    The prefill work still to do is the prompt beyond what is computed, beyond the prefix hit
    measured at arrival (which includes retained KV) and, with ``mars.level_from_new_work``,
    beyond the session's previous context (re-prefilling a lost context is not new work)::

        |<------------------------- num_prompt_tokens -------------------------->|
        |<- max(computed, cached at arrival[, session context]) ->|<- uncached ->|

    The base level is :func:`mars_base_level` of that and the session's attained service; the
    effective level subtracts the bounded aging promotion for ``wait_s`` (:func:`effective_level`).
    A decode (``num_computed_tokens >= num_prompt_tokens``) is level 0 (design.md §4).

    Args:
        num_prompt_tokens, num_computed_tokens: vLLM's counts (computed may include this step's
            prefix hit, for a waiting request).
        num_cached_at_arrival_tokens: prefix-cache hit measured when the request arrived.
        num_session_context_tokens: the session's previous context (prompt + output) at arrival.
        session_service_tokens: the session's attained service, tokens.
        feedback_level: the request's MLFQ feedback level.
        wait_s: seconds since the request was last scheduled (or arrived).
        params, mars: level parameters.

    >>> mars_level(num_prompt_tokens=9000, num_computed_tokens=0, num_cached_at_arrival_tokens=8000,
    ...            num_session_context_tokens=0, session_service_tokens=0, feedback_level=0,
    ...            wait_s=0.0, params=LevelParams(), mars=MarsLevelParams())
    0
    """
    if num_computed_tokens >= num_prompt_tokens:
        return 0
    done = max(num_computed_tokens, num_cached_at_arrival_tokens)
    if mars.level_from_new_work:
        done = max(done, num_session_context_tokens)
    uncached = max(0, num_prompt_tokens - done)
    base = mars_base_level(feedback_level, uncached, session_service_tokens, params, mars)
    return effective_level(base, wait_s, params, mars)
