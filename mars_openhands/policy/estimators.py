"""Online estimators of tool durations and queueing delay (MARS §4.3; Continuum arXiv 2511.02230 §4.2).

Mental model: the engine never sees a tool run; it sees either CPU-plane events (``tool_end`` with
a measured ``duration_s``) or, without a gateway, the gap between a turn's finish and the session's
next arrival (Continuum's inference). Both feed the same per-tool sliding windows. A decision about
one tool uses that tool's empirical CDF once it has ``min_samples`` samples, else the CDF of all
tools pooled (Continuum's fallback, K = 100).

All classes are small mutable state objects owned by one scheduler instance (no module state).

Example:
    >>> est = ToolDurationEstimator(min_samples=2)
    >>> for s in (0.5, 1.0, 4.0):
    ...     est.observe("bash", s)
    >>> est.cdf_for("bash").prob_le(1.0), est.cdf_for("unknown-tool").num_samples
    (0.6666666666666666, 3)
"""

from __future__ import annotations

import bisect
import itertools
import operator
from collections import deque

__all__ = ["Ema", "EmpiricalCdf", "PrefillRate", "ToolDurationEstimator"]


class EmpiricalCdf:
    """Empirical CDF over a sliding window of the last ``max_samples`` values (seconds).

    ``prob_le`` is O(log n); ``observe`` is O(n) worst case (sorted-list insert), fine for the
    windows used here (<= a few thousand).
    """

    def __init__(self, max_samples: int = 2048) -> None:
        if max_samples < 1:
            raise ValueError(f"max_samples must be >= 1, got {max_samples}")
        self.max_samples = max_samples
        self._fifo: deque[float] = deque()
        self._sorted: list[float] = []
        self._sum = 0.0
        self._tail_sums: list[float] | None = None

    @property
    def num_samples(self) -> int:
        """Samples currently in the window."""
        return len(self._fifo)

    @property
    def mean_s(self) -> float | None:
        """Mean of the window, or None when empty."""
        return self._sum / len(self._fifo) if self._fifo else None

    def observe(self, value_s: float) -> None:
        """Add one sample. Mutates.

        Raises:
            ValueError: negative or non-finite value.
        """
        if not (value_s >= 0.0) or value_s == float("inf"):
            raise ValueError(f"duration must be a finite number of seconds >= 0, got {value_s!r}")
        self._fifo.append(value_s)
        self._tail_sums = None
        bisect.insort(self._sorted, value_s)
        self._sum += value_s
        if len(self._fifo) > self.max_samples:
            old = self._fifo.popleft()
            del self._sorted[bisect.bisect_left(self._sorted, old)]
            self._sum -= old

    def prob_le(self, x_s: float) -> float:
        """P(D <= x). 0.0 when empty. Pure."""
        n = len(self._sorted)
        return bisect.bisect_right(self._sorted, x_s) / n if n else 0.0

    def prob_le_given_gt(self, x_s: float, elapsed_s: float) -> float:
        """P(D <= x | D > elapsed): the chance a tool already running ``elapsed_s`` ends by x. Pure."""
        n = len(self._sorted)
        if not n or x_s <= elapsed_s:
            return 0.0
        alive = n - bisect.bisect_right(self._sorted, elapsed_s)
        if alive == 0:
            return 0.0
        done_by_x = bisect.bisect_right(self._sorted, x_s) - (n - alive)
        return done_by_x / alive

    def mean_remaining_s(self, elapsed_s: float) -> float | None:
        """E[D - elapsed | D > elapsed]: expected seconds left of a tool that has run
        ``elapsed_s``; None when empty or no sample exceeds ``elapsed_s``. O(log n) after the
        first call following an ``observe`` (prefix sums are rebuilt lazily, O(n)). Pure."""
        n = len(self._sorted)
        if not n:
            return None
        if self._tail_sums is None:  # sums[i] = sums[i + 1] + sorted[i], summed from the end (C-level)
            sums = list(itertools.accumulate(reversed(self._sorted), operator.add, initial=0.0))
            sums.reverse()
            self._tail_sums = sums
        i = bisect.bisect_right(self._sorted, elapsed_s)
        alive = n - i
        if alive == 0:
            return None
        return self._tail_sums[i] / alive - elapsed_s

    def support(self, max_value_s: float | None = None) -> list[float]:
        """Distinct sample values (sorted), optionally only those <= ``max_value_s``. Pure."""
        out: list[float] = []
        for v in self._sorted:
            if max_value_s is not None and v > max_value_s:
                break
            if not out or v != out[-1]:
                out.append(v)
        return out


class ToolDurationEstimator:
    """Per-tool duration windows with an all-tools fallback (Continuum's rule).

    Args:
        min_samples: samples a tool needs before its own CDF is used (Continuum K = 100).
        max_samples: window per tool (and for the pooled CDF).
    """

    def __init__(self, min_samples: int = 100, max_samples: int = 2048) -> None:
        self.min_samples = min_samples
        self.max_samples = max_samples
        self._per_tool: dict[str, EmpiricalCdf] = {}
        self._all = EmpiricalCdf(max_samples)

    @property
    def all_tools(self) -> EmpiricalCdf:
        """Pooled CDF of every observed duration."""
        return self._all

    def observe(self, tool_name: str | None, duration_s: float) -> None:
        """Record one duration of ``tool_name`` (None: unknown tool, pooled only). Mutates."""
        self._all.observe(duration_s)
        if tool_name:
            cdf = self._per_tool.get(tool_name)
            if cdf is None:
                cdf = self._per_tool[tool_name] = EmpiricalCdf(self.max_samples)
            cdf.observe(duration_s)

    def num_samples(self, tool_name: str) -> int:
        """Samples held for ``tool_name`` (0 if never seen)."""
        cdf = self._per_tool.get(tool_name)
        return cdf.num_samples if cdf else 0

    def cdf_for(self, tool_name: str | None) -> EmpiricalCdf:
        """The tool's own CDF if it has >= ``min_samples`` samples, else the pooled CDF."""
        cdf = self._per_tool.get(tool_name) if tool_name else None
        if cdf is not None and cdf.num_samples >= self.min_samples:
            return cdf
        return self._all

    def mean_s(self, tool_name: str | None) -> float | None:
        """Running mean duration of ``tool_name`` (any sample count), else pooled, else None."""
        cdf = self._per_tool.get(tool_name) if tool_name else None
        if cdf is not None and cdf.num_samples:
            return cdf.mean_s
        return self._all.mean_s


class Ema:
    """Exponential moving average: ``v <- (1 - alpha) v + alpha x``; starts at ``initial``."""

    def __init__(self, alpha: float, initial: float) -> None:
        if not 0.0 < alpha <= 1.0:
            raise ValueError(f"alpha must be in (0, 1], got {alpha}")
        self.alpha = alpha
        self.value = initial
        self.num_samples = 0

    def observe(self, x: float) -> float:
        """Fold in one sample and return the new value. Mutates."""
        self.value = x if self.num_samples == 0 else (1 - self.alpha) * self.value + self.alpha * x
        self.num_samples += 1
        return self.value


class PrefillRate:
    """Measured seconds per prefill token, from step durations (an EMA over sampled steps).

    A step is recorded when it is scheduled (:meth:`step_scheduled`: its start and its prefill
    tokens) and sampled when its output comes back (:meth:`step_done`), in the same order.
    Steps with fewer than ``min_sample_tokens`` prefill tokens say more about decode than about
    prefill speed and are not sampled; the decodes batched with a sampled step are included, so
    the rate is an upper bound.

    Args:
        prior_s_per_token: the value before any sample (``retention.reload_linear_s_per_token``).
        min_sample_tokens: smallest prefill a step needs to be a sample (default 512).
        alpha: EMA weight of a new sample, in (0, 1].

    Raises:
        ValueError: ``alpha`` outside (0, 1].

    >>> rate = PrefillRate(0.0002, min_sample_tokens=512)
    >>> rate.step_scheduled(10.0, 1000); rate.step_scheduled(10.5, 10)
    >>> rate.step_done(10.5); rate.step_done(10.6)
    >>> rate.value, rate.num_samples
    (0.0005, 1)
    """

    def __init__(self, prior_s_per_token: float, min_sample_tokens: int = 512, alpha: float = 0.2) -> None:
        self._ema = Ema(alpha, prior_s_per_token)
        self.min_sample_tokens = min_sample_tokens
        self._pending: deque[tuple[float, int]] = deque()

    @property
    def value(self) -> float:
        """Seconds per prefill token (the prior until the first sample)."""
        return self._ema.value

    @property
    def num_samples(self) -> int:
        """Steps sampled so far."""
        return self._ema.num_samples

    def step_scheduled(self, start_s: float, num_prefill_tokens: int) -> None:
        """A step started at ``start_s`` with ``num_prefill_tokens`` prefill tokens. Mutates."""
        self._pending.append((start_s, num_prefill_tokens))

    def step_done(self, now_s: float) -> None:
        """The oldest pending step's output came back at ``now_s``: sample it if it qualifies.
        No-op without a pending step. Mutates."""
        if self._pending:
            t0, num_prefill = self._pending.popleft()
            if num_prefill >= self.min_sample_tokens:
                self._ema.observe((now_s - t0) / num_prefill)
