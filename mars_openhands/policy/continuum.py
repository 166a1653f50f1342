"""Continuum: tool-call-aware KV pinning with a time-to-live (arXiv 2511.02230).

Continuum keeps a multi-turn agent's KV cache pinned on the GPU while the agent runs a tool, for a
time-to-live (TTL), and schedules at **program** (agent session) granularity. Two variants, as
MARS ran them (design.md §5):

* ``continuum`` (the public code, ``vllm-continuum`` ``ToolCallEstimator.set_up_pin``): pin for
  ``fixed_ttl_s`` = 2.0 s when the running mean of the tool's measured durations is at most
  ``pin_mean_threshold_s`` = 2.0 s, else do not pin;
* ``continuum-dy`` (paper §4.2, Eq. 2)::

      tau* = argmax_{tau in {0} ∪ S}  P(t <= tau) * (T * eta + PrefillReload(r)) - tau

  with ``S`` the observed tool durations (the tool's own if it has more than ``K`` = 100 samples,
  else all tools'), ``P`` their empirical CDF, ``T`` the mean queueing delay of evicted requests
  over a sliding window (200), ``eta = -Corr(k, N - k)`` (memoryfulness: ``k`` = calls a program
  had served when a call arrived, ``N`` = its calls in total; 1.0 until measurable) and
  ``PrefillReload`` a quadratic in the request's tokens (default 0.0002 s/token). While all tools
  together have at most ``K`` samples (cold start) the TTL is ``fixed_ttl_s``.

Scheduling: waiting requests of programs holding a pin go first, then program-level FCFS (the
program's first arrival). Pins expire at the start of a step once past their TTL, unless the
program has a waiting request; when KV allocation fails, pins are released latest program arrival
first, and the code never raises (the public code raises ``IndexError`` when one request runs and
nothing is pinned). Running victims: latest program arrival first, preferring calls not known to
be the program's last.

Tool durations are measured as the gap between a turn's finish and the next turn's arrival.

Mental model: a pin buys a warm resume (no re-prefill, no second trip through the queue) at the
price of idle KV; the static rule pins only tools that usually return fast, the dynamic rule picks
the TTL that maximizes expected saved seconds minus seconds held.

Port notes (differences from the public code, each because our engine sees less or more):

* The public code parses the next tool's name out of the generated text. The engine here learns
  it from the session's ``tool_start`` event, which usually arrives after the turn finished (the
  scheduler then recomputes the TTL for that tool; ``mars_prev_tool`` only labels the duration
  measured at the next arrival). An unknown or never-seen tool is treated like the public code
  treats a tool without history (``continuum``: mean 0 s, so pin; ``continuum-dy``: the
  all-tools samples).
* The public code keeps every sample in unsorted lists and rescans them per candidate (O(n^2));
  here the samples are the engine's per-tool sliding windows
  (:class:`~mars_openhands.policy.estimators.ToolDurationEstimator`, ``mars.retention.
  max_samples_per_tool``, 2048 by default) kept sorted, and the argmax is one pass.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Iterable
from typing import Annotated, Literal, TypeVar

from pydantic import BaseModel, ConfigDict, Field

from mars_openhands.policy.estimators import EmpiricalCdf, ToolDurationEstimator

__all__ = [
    "ContinuumParams",
    "MemoryfulnessEstimator",
    "PrefillReloadModel",
    "QueueDelayWindow",
    "continuum_ttl_s",
    "dynamic_ttl_s",
    "optimal_ttl_s",
    "pin_benefit_s",
    "pin_ttl_s",
    "pin_release_key",
    "pin_release_order",
    "running_victim_key",
    "should_unpin",
    "waiting_order_key",
]

KeyT = TypeVar("KeyT")
NonNegFloat = Annotated[float, Field(ge=0.0)]


class PrefillReloadModel(BaseModel):
    """Seconds to re-prefill a request's tokens: ``a*n^2 + b*n + c`` (``n`` tokens).

    Source: the public Continuum/InferCept code (``estimate_prefill_reload_s``: quadratic
    ``*_PREFILL_RELOAD_QUAD`` or ``0.0002`` s/token by default).
    """

    model_config = ConfigDict(frozen=True, extra="forbid")

    quad_s_per_token2: NonNegFloat = 0.0
    """Quadratic coefficient ``a``, seconds per token squared (attention cost)."""
    linear_s_per_token: NonNegFloat = 0.0002
    """Linear coefficient ``b``, seconds per token."""
    const_s: NonNegFloat = 0.0
    """Constant ``c``, seconds."""

    def seconds(self, num_tokens: int) -> float:
        """Reload time of ``num_tokens`` tokens, seconds (>= 0; negative counts count as 0).

        Examples:
            >>> PrefillReloadModel().seconds(10_000)
            2.0
        """
        n = float(max(0, num_tokens))
        return self.quad_s_per_token2 * n * n + self.linear_s_per_token * n + self.const_s


class ContinuumParams(BaseModel):
    """Parameters of the Continuum baseline (``--additional-config`` key ``mars.continuum``)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    mode: Literal["continuum", "continuum-dy"] = "continuum"
    """``continuum`` = public-code static rule; ``continuum-dy`` = paper §4.2 dynamic TTL."""
    fixed_ttl_s: NonNegFloat = 2.0
    """TTL of the static rule and of the dynamic rule's cold start, seconds
    (public code ``FIXED_THRESHOLD_CONTINUUM``)."""
    pin_mean_threshold_s: NonNegFloat = 2.0
    """Static rule: pin only when the tool's running-mean duration is at most this, seconds."""
    min_records: Annotated[int, Field(ge=0)] = 100
    """``K``: samples a tool needs (more than K) to use its own CDF; all tools together need more
    than K to leave the cold start (paper §4.2)."""
    queue_delay_window: Annotated[int, Field(gt=0)] = 200
    """Evicted-request queueing delays averaged for ``T`` (sliding window, samples)."""
    eta_default: float = 1.0
    """Memoryfulness ``eta`` used until it is measurable (or always if ``measure_eta`` is off)."""
    measure_eta: bool = True
    """Measure ``eta = -Corr(k, N - k)`` from finished programs (public code), else use the
    default."""
    prefill_reload: PrefillReloadModel = PrefillReloadModel()
    """``PrefillReload(r)`` as a function of the request's tokens."""
    min_pin_ttl_s: NonNegFloat = 0.01
    """TTLs at or below this are not pinned at all, seconds (public code: ``> 0.01``)."""


def continuum_ttl_s(tool_mean_s: float | None, params: ContinuumParams) -> float:
    """Static Continuum TTL from the tool's running-mean duration. Pure.

    Args:
        tool_mean_s: running mean of the tool's measured durations, seconds; ``None`` when the
            tool is unknown or has no samples (the public code then uses 0 s).
        params: Continuum parameters.

    Returns:
        ``fixed_ttl_s`` if ``tool_mean_s <= pin_mean_threshold_s`` else 0.0, seconds.

    Examples:
        >>> p = ContinuumParams()
        >>> continuum_ttl_s(1.5, p), continuum_ttl_s(2.5, p), continuum_ttl_s(None, p)
        (2.0, 0.0, 2.0)
    """
    mean_s = 0.0 if tool_mean_s is None else tool_mean_s
    return params.fixed_ttl_s if mean_s <= params.pin_mean_threshold_s else 0.0


def pin_benefit_s(queue_delay_s: float, eta: float, prefill_reload_s: float) -> float:
    """Seconds a warm resume saves: ``T * eta + PrefillReload(r)`` (Continuum §4.2). Pure."""
    return queue_delay_s * eta + prefill_reload_s


def optimal_ttl_s(durations: EmpiricalCdf, benefit_s: float) -> float:
    """``argmax_{tau in {0} ∪ S} P(t <= tau) * benefit_s - tau`` over the samples ``S``. Pure.

    Candidates above ``benefit_s`` are skipped: there ``P * benefit_s - tau < 0``. Ties go to the
    smallest ``tau``; a best reward of at most 0 gives 0 (do not pin).

    Args:
        durations: empirical CDF of the tool durations ``S``, seconds.
        benefit_s: seconds saved by a warm resume (:func:`pin_benefit_s`).

    Returns:
        The TTL ``tau*``, seconds (0.0 when ``S`` is empty or ``benefit_s <= 0``).

    Examples:
        >>> cdf = EmpiricalCdf()
        >>> for t in (1.0, 1.0, 9.0):
        ...     cdf.observe(t)
        >>> optimal_ttl_s(cdf, benefit_s=3.0)  # 2/3*3-1 = 1 beats 0 and 3-9
        1.0
    """
    if durations.num_samples == 0 or benefit_s <= 0.0:
        return 0.0
    best_tau_s, best_reward = 0.0, 0.0  # tau = 0 scores P(t <= 0) * benefit, found below if any
    for tau_s in durations.support(max_value_s=benefit_s):
        reward = durations.prob_le(tau_s) * benefit_s - tau_s
        if reward > best_reward:
            best_tau_s, best_reward = tau_s, reward
    return best_tau_s if best_reward > 0.0 else 0.0


def dynamic_ttl_s(
    tool_durations: EmpiricalCdf | None,
    all_durations: EmpiricalCdf,
    benefit_s: float,
    params: ContinuumParams,
) -> float:
    """Continuum-dy TTL with the paper's cold-start rules (§4.2). Pure.

    * ``benefit_s <= 0``: 0.0 (do not pin);
    * ``len(all) <= K``: cold start, ``fixed_ttl_s``;
    * else the tool's own samples if ``len(tool) > K``, else all tools' samples, through
      :func:`optimal_ttl_s`.

    Args:
        tool_durations: this tool's durations (None if unknown or not available separately).
        all_durations: every tool's durations.
        benefit_s: ``T * eta + PrefillReload(r)``, seconds.
        params: Continuum parameters.

    Returns:
        TTL, seconds (>= 0).
    """
    if benefit_s <= 0.0:
        return 0.0  # nothing to gain (public code checks this before the cold start)
    if all_durations.num_samples <= params.min_records:
        return params.fixed_ttl_s
    own = tool_durations is not None and tool_durations.num_samples > params.min_records
    return optimal_ttl_s(tool_durations if own else all_durations, benefit_s)


def pin_ttl_s(
    tool_name: str | None,
    num_tokens: int,
    durations: ToolDurationEstimator,
    queue_delay_s: float,
    eta: float,
    params: ContinuumParams,
) -> float:
    """TTL to pin a finished, non-final turn's KV for, per ``params.mode``. Reads ``durations``.

    Args:
        tool_name: the tool the session runs next, if known.
        num_tokens: the finished request's tokens (prompt + output), for ``PrefillReload``.
        durations: measured tool durations (per tool, and pooled).
        queue_delay_s: ``T``, mean queueing delay of evicted requests, seconds.
        eta: memoryfulness ``eta``.
        params: Continuum parameters.

    Returns:
        TTL in seconds, or 0.0 (do not pin) when it is at most ``params.min_pin_ttl_s``.
    """
    has_own = tool_name is not None and durations.num_samples(tool_name) > 0
    if params.mode == "continuum":
        ttl_s = continuum_ttl_s(durations.mean_s(tool_name) if has_own else None, params)
    else:
        benefit_s = pin_benefit_s(queue_delay_s, eta, params.prefill_reload.seconds(num_tokens))
        # cdf_for gives the tool's own window once it holds the estimator's minimum; below it
        # (or below K) dynamic_ttl_s falls back to the pooled window, as the paper does.
        own = durations.cdf_for(tool_name) if has_own else None
        if own is durations.all_tools:
            own = None
        ttl_s = dynamic_ttl_s(own, durations.all_tools, benefit_s, params)
    return ttl_s if ttl_s > params.min_pin_ttl_s else 0.0


def waiting_order_key(
    program_is_pinned: bool, program_arrival_s: float, arrival_s: float
) -> tuple[int, float, float]:
    """Sort key of a waiting request: pinned programs first, then program-level FCFS. Pure.

    Smallest key is scheduled first: ``(0 if pinned else 1, program's first arrival, arrival)``.
    """
    return (0 if program_is_pinned else 1, program_arrival_s, arrival_s)


def running_victim_key(is_last_step: bool | None, program_arrival_s: float) -> tuple[int, float]:
    """Preemption victim key: the running request with the **largest** key is preempted. Pure.

    Calls not known to be their program's last go first (their program will come back and can
    resume from the prefix cache), then the latest program arrival (public code
    ``pop_running_request_based_on_last_step``). ``None`` (unknown) counts as not last.
    """
    return (0 if is_last_step else 1, program_arrival_s)


def pin_release_key(program_arrival_s: float) -> float:
    """Sort key of a pin on KV allocation failure (smallest released first): latest program
    arrival first. Pure.

    Args:
        program_arrival_s: the pin's program's first arrival, seconds.
    """
    return -program_arrival_s


def pin_release_order(pins: Iterable[tuple[KeyT, float]]) -> list[KeyT]:
    """Order in which pins are released on KV allocation failure: latest program arrival first.

    Pure. Ties keep the input order.

    Args:
        pins: ``(pin key, program's first arrival in seconds)`` pairs.

    Returns:
        The pin keys, latest program arrival first.
    """
    ordered = sorted(enumerate(pins), key=lambda item: (pin_release_key(item[1][1]), item[0]))
    return [key for _, (key, _) in ordered]


def should_unpin(now_s: float, expires_at_s: float, program_has_waiting: bool) -> bool:
    """Whether a pin expires at the start of this step: past its TTL and nothing waiting. Pure."""
    return now_s >= expires_at_s and not program_has_waiting


class QueueDelayWindow:
    """Sliding window of evicted requests' queueing delays (Continuum's ``T``).

    Small state object. Mutates: :meth:`record`.

    Args:
        maxlen: samples kept (``queue_delay_window``).
    """

    def __init__(self, maxlen: int) -> None:
        self._samples: deque[float] = deque(maxlen=maxlen)

    def record(self, delay_s: float) -> None:
        """Add one delay: seconds from a request's preemption to its re-scheduling (>= 0)."""
        self._samples.append(max(0.0, delay_s))

    def mean_s(self) -> float:
        """Mean delay over the window, seconds; 0.0 when empty (public code)."""
        return sum(self._samples) / len(self._samples) if self._samples else 0.0


class MemoryfulnessEstimator:
    """Online ``eta = -Corr(k, N - k)`` over finished programs' calls (Continuum §4.2).

    For every call of a finished program, ``k`` = calls the program had finished when the call
    arrived and ``N`` = the program's calls in total. Small state object. Mutates:
    :meth:`observe_program`.

    Args:
        default: value returned while the correlation is undefined (< 2 pairs, zero variance).
    """

    def __init__(self, default: float = 1.0) -> None:
        self._default = default
        self._n = 0
        self._sx = self._sy = self._sxx = self._syy = self._sxy = 0.0

    def observe_program(self, ks: Iterable[int], num_calls: int) -> None:
        """Add one finished program: the ``k`` of each of its calls and its call count ``N``."""
        for k in ks:
            x, y = float(k), float(num_calls - k)
            self._n += 1
            self._sx += x
            self._sy += y
            self._sxx += x * x
            self._syy += y * y
            self._sxy += x * y

    def eta(self) -> float:
        """``-Corr(k, N - k)`` clamped to [-1, 1], or the default while undefined."""
        n = self._n
        if n < 2:
            return self._default
        cov = n * self._sxy - self._sx * self._sy
        var_x = n * self._sxx - self._sx * self._sx
        var_y = n * self._syy - self._sy * self._sy
        if var_x <= 0.0 or var_y <= 0.0:
            return self._default
        return -max(-1.0, min(1.0, cov / math.sqrt(var_x * var_y)))
