"""The knee: the largest stable Poisson arrival rate of one policy on one workload (design.md §7).

*Stable* = every session completes and the mean slowdown (E2E / ideal) is at most a bound
(``--knee-slowdown``, default 2). FCFS's knee is the base rate the load points multiply; the same
search run for every policy is its *capacity at SLO* (``compare --capacity``).

Mental model: slowdown grows with the rate (more sessions in flight, more queueing, and past the
KV cliff every turn re-prefills), so the stable rates form an interval ``(0, knee]``. The search
first *brackets* the knee (double from a start rate while stable, halve while unstable; the ladder's
factor is a parameter), then
*bisects* the bracket geometrically until ``hi / lo <= tolerance`` (the early stop: a 10% bracket
is finer than the run-to-run noise of one arrival seed) or the run budget is spent. With ``width``
probes per round (parallel workers), a round probes ``width`` rates at once: the next rungs of the
doubling ladder while bracketing, ``width`` geometrically even points inside the bracket while
bisecting (``width = 1`` is plain bisection), so a round shrinks the log-bracket ``width + 1``-fold.

:class:`KneeSearch` is the state machine (pure: rates out, results in), so one driver can interleave
several searches (one per GPU, or per policy) on one worker pool; :func:`find_base_rate` drives one
search sequentially.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

__all__ = ["BaseRateSearch", "KneeSearch", "find_base_rate"]


@dataclass(frozen=True)
class BaseRateSearch:
    """Result of a knee search.

    Attributes:
        rate_per_s: the largest stable rate probed (sessions/s); if no probe was stable, the
            smallest rate probed.
        probes: ``(rate_per_s, mean slowdown or inf, is_stable)`` in probe order.
        how: one sentence on how the rate was found (for ``summary.md``).
        error: why the search failed (a probe raised, e.g. an engine stall), else ``None``;
            a failed search has no capacity, whatever its probes say.
    """

    rate_per_s: float
    probes: tuple[tuple[float, float, bool], ...]
    how: str
    error: str | None = None

    @property
    def is_bracketed(self) -> bool:
        """Whether a stable and an unstable rate were both probed (the knee lies between them)."""
        return len({stable for _, _, stable in self.probes}) == 2

    @property
    def has_stable(self) -> bool:
        """Whether any probed rate was stable (else ``rate_per_s`` is only an upper bound)."""
        return any(stable for _, _, stable in self.probes)


class KneeSearch:
    """Bracket-then-bisect search for the largest stable rate (see the module docstring).

    Use: ``while not s.is_done: rates = s.next_rates(k); s.record(rate, slowdown) for each``;
    then :meth:`result`. Mutates only itself.

    Args:
        start_rate_per_s: first probe, sessions/s (> 0).
        bound: stable iff mean slowdown <= bound (> 1).
        max_runs: most probes in all (>= 1).
        tolerance: stop bisecting once ``hi / lo <= tolerance`` (> 1).
        label: who is searched, for :meth:`result`'s sentence (e.g. ``"FCFS"``).
        step: the bracketing ladder's factor (> 1; 2 = doubling). A step near the tolerance
            brackets a knee already known to lie near the start rate in one or two rounds,
            without probes at twice or half of it.

    Raises:
        ValueError: a parameter out of range (names it and the value).
    """

    def __init__(self, start_rate_per_s: float, bound: float, max_runs: int, tolerance: float = 1.05,
                 label: str = "FCFS", step: float = 2.0) -> None:
        if not start_rate_per_s > 0 or max_runs < 1 or not tolerance > 1 or not step > 1:
            raise ValueError(f"need start_rate_per_s > 0, max_runs >= 1, tolerance > 1 and step > 1, got "
                             f"{start_rate_per_s}, {max_runs}, {tolerance}, {step}")
        self.start_rate_per_s, self.bound, self.max_runs = start_rate_per_s, bound, max_runs
        self.tolerance, self.label, self.step = tolerance, label, step
        self.probes: list[tuple[float, float, bool]] = []
        self._pending: set[float] = set()
        self.error: str | None = None
        """Set by :meth:`fail`: the search is over, with no capacity."""

    @property
    def _stable(self) -> list[float]:
        return [r for r, _, s in self.probes if s]

    @property
    def _unstable(self) -> list[float]:
        return [r for r, _, s in self.probes if not s]

    @property
    def is_bracketed(self) -> bool:
        """A stable rate below an unstable one has been probed."""
        return bool(self._stable and self._unstable and max(self._stable) < min(self._unstable))

    @property
    def is_done(self) -> bool:
        """No more probes are wanted (failed, budget spent, or the bracket is within ``tolerance``)."""
        if self.error is not None:
            return True
        if len(self.probes) + len(self._pending) >= self.max_runs:
            return True
        if self.is_bracketed:
            return min(self._unstable) / max(self._stable) <= self.tolerance
        return False

    def next_rates(self, width: int = 1) -> list[float]:
        """Up to ``width`` rates to probe next (fewer near the budget; none when done or waiting).

        Rates handed out count against the budget until :meth:`record` reports them.
        """
        if self.is_done or self._pending:
            return []
        width = max(1, min(width, self.max_runs - len(self.probes)))
        stable, unstable = self._stable, self._unstable
        if not self.probes:
            rates = [self.start_rate_per_s * self.step ** i for i in range(width)]
        elif self.is_bracketed:
            lo, hi = max(stable), min(unstable)
            rates = [lo * (hi / lo) ** ((i + 1) / (width + 1)) for i in range(width)]
        elif unstable:  # nothing stable yet: go down
            rates = [min(unstable) / self.step ** (i + 1) for i in range(width)]
        else:  # nothing unstable yet: go up
            rates = [max(stable) * self.step ** (i + 1) for i in range(width)]
        self._pending.update(rates)
        return rates

    def record(self, rate_per_s: float, mean_slowdown: float) -> bool:
        """Report one probe's mean slowdown (``inf`` if a session did not finish); returns is_stable."""
        self._pending.discard(rate_per_s)
        stable = math.isfinite(mean_slowdown) and mean_slowdown <= self.bound
        self.probes.append((rate_per_s, mean_slowdown, stable))
        return stable

    def fail(self, rate_per_s: float, error: str) -> None:
        """End the search: the probe at ``rate_per_s`` raised ``error`` (one line). A fault is not
        a load effect, so it is neither stable nor unstable; :meth:`result` carries it."""
        self._pending.discard(rate_per_s)
        self.error = f"the probe at {rate_per_s:.4g}/s failed: {error}"

    def result(self) -> BaseRateSearch:
        """The largest stable rate and the sentence saying how it was found (see :class:`BaseRateSearch`)."""
        probes = tuple(self.probes)
        if self.error is not None:
            rate = max(self._stable, default=self.start_rate_per_s)
            return BaseRateSearch(rate, probes, f"{self.label} knee search FAILED after {len(probes)} runs: "
                                                f"{self.error}", self.error)
        stable, unstable = self._stable, self._unstable
        if stable:
            best = max(stable)
            above = [r for r in unstable if r > best]
            bracket = (f"; first unstable rate {min(above):.4g}/s" if above
                       else "; no unstable rate found within the budget (the knee may be higher)")
            ladder = "doubling" if self.step == 2.0 else f"steps of ×{self.step:g}"
            how = (f"{self.label} knee search: {len(probes)} runs ({ladder} from "
                   f"{self.start_rate_per_s:.4g}/s, then bisection to a {self.tolerance:g}× bracket), "
                   f"stable = all sessions complete and mean slowdown <= {self.bound:g}; "
                   f"largest stable rate {best:.4g}/s{bracket}")
            return BaseRateSearch(best, probes, how)
        if not probes:
            raise ValueError("no probe was recorded; call next_rates() and record() first")
        best = min(unstable)
        lowest = min(probes, key=lambda p: p[0])
        how = (f"{self.label} knee search: no stable rate within {len(probes)} runs (lowest probed "
               f"{best:.4g}/s had mean slowdown {lowest[1]:.3g} > {self.bound:g}); using it as the base")
        return BaseRateSearch(best, probes, how)


def find_base_rate(mean_slowdown_at: Callable[[float], float], start_rate_per_s: float,
                   bound: float, max_runs: int, tolerance: float = 1.05) -> BaseRateSearch:
    """Largest stable arrival rate by doubling then geometric bisection, one probe at a time.

    Args:
        mean_slowdown_at: rate (sessions/s) -> mean slowdown (``inf`` if sessions failed).
        start_rate_per_s: first probe (> 0).
        bound: stable iff mean slowdown <= bound.
        max_runs: most calls of ``mean_slowdown_at`` (>= 1).
        tolerance: stop once the bracket ``hi / lo`` is at most this (> 1).

    Returns:
        See :class:`BaseRateSearch`.

    Raises:
        ValueError: ``start_rate_per_s <= 0``, ``max_runs < 1`` or ``tolerance <= 1``.
    """
    search = KneeSearch(start_rate_per_s, bound, max_runs, tolerance)
    while rates := search.next_rates(1):
        for rate in rates:
            search.record(rate, mean_slowdown_at(rate))
    return search.result()
