"""Session arrival processes: fixed rate (MARS), Poisson (Continuum, Autellix), bursts (design.md §8).

Each process is a frozen params model with a ``kind`` discriminator, so a workload records exactly
how its arrivals were drawn (``meta.arrival``) and the same seed reproduces them. Times are seconds
after the start of the run; the first session always arrives at ``start_s`` (no idle lead-in), and
times are non-decreasing in session order.

Load points are defined against measured capacity (design.md §7: a multiple of FCFS's largest stable
Poisson rate); these classes only turn a chosen rate into times.
"""

from __future__ import annotations

from typing import Annotated, Literal

import numpy as np
from pydantic import BaseModel, ConfigDict, Field, TypeAdapter, model_validator

from eval.workloads.format import Workload

ARRIVAL_STREAM = 1
"""Stream index of the arrival draws: ``default_rng([seed, ARRIVAL_STREAM])``, so a workload's
sessions (stream 0) and its arrivals come from independent streams of one seed."""

__all__ = [
    "ARRIVAL_STREAM",
    "ArrivalProcess",
    "BurstArrivals",
    "FixedRateArrivals",
    "PoissonArrivals",
    "arrival_times_s",
    "parse_arrival",
    "with_arrivals",
]

PositiveRate = Annotated[float, Field(gt=0.0, allow_inf_nan=False)]
NonNegFloat = Annotated[float, Field(ge=0.0, allow_inf_nan=False)]


class FixedRateArrivals(BaseModel):
    """Deterministic arrivals every ``1 / rate_per_s`` seconds (MARS's replay; design.md §8)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    kind: Literal["fixed"] = "fixed"
    rate_per_s: PositiveRate
    """Sessions per second."""
    start_s: NonNegFloat = 0.0
    """Arrival time of the first session, seconds."""


class PoissonArrivals(BaseModel):
    """Poisson arrivals: i.i.d. exponential gaps of mean ``1 / rate_per_s`` (Continuum, Autellix)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    kind: Literal["poisson"] = "poisson"
    rate_per_s: PositiveRate
    """Mean sessions per second."""
    start_s: NonNegFloat = 0.0
    """Arrival time of the first session, seconds."""


class BurstArrivals(BaseModel):
    """Bursts of ``burst_size`` sessions every ``burst_interval_s`` seconds.

    Within a burst, sessions are ``intra_burst_gap_s`` apart (0: all at once). ``burst_size`` equal
    to the number of sessions gives the "everything at t = 0" stress case.
    """

    model_config = ConfigDict(frozen=True, extra="forbid")

    kind: Literal["burst"] = "burst"
    burst_size: Annotated[int, Field(ge=1)]
    """Sessions per burst."""
    burst_interval_s: NonNegFloat
    """Seconds from the start of one burst to the start of the next."""
    intra_burst_gap_s: NonNegFloat = 0.0
    """Seconds between consecutive sessions of one burst."""
    start_s: NonNegFloat = 0.0
    """Arrival time of the first session, seconds."""

    @model_validator(mode="after")
    def _bursts_do_not_overlap(self) -> BurstArrivals:
        span_s = self.intra_burst_gap_s * (self.burst_size - 1)
        if span_s > self.burst_interval_s:
            raise ValueError(
                f"a burst spans intra_burst_gap_s * (burst_size - 1) = {span_s} s, longer than "
                f"burst_interval_s = {self.burst_interval_s} s; raise burst_interval_s or lower "
                "intra_burst_gap_s so that arrivals stay in order"
            )
        return self


ArrivalProcess = Annotated[
    FixedRateArrivals | PoissonArrivals | BurstArrivals, Field(discriminator="kind")
]
"""Any arrival process; parse a JSON/dict form with :func:`parse_arrival`."""

_ADAPTER: TypeAdapter[ArrivalProcess] = TypeAdapter(ArrivalProcess)


def parse_arrival(data: dict[str, object] | str) -> ArrivalProcess:
    """Validate an arrival process from a dict or JSON text (e.g. a workload's ``meta.arrival``).

    Raises:
        pydantic.ValidationError: unknown ``kind`` (lists ``fixed``/``poisson``/``burst``), a
            missing or out-of-range field.
    """
    if isinstance(data, str):
        return _ADAPTER.validate_json(data)
    return _ADAPTER.validate_python(data)


def arrival_times_s(process: ArrivalProcess, num_sessions: int, rng: np.random.Generator) -> np.ndarray:
    """Draw ``num_sessions`` arrival times. Pure apart from advancing ``rng``.

    Args:
        process: the arrival process.
        num_sessions: how many times to draw (>= 0).
        rng: numpy generator; only :class:`PoissonArrivals` consumes randomness.

    Returns:
        float64 array, shape ``(num_sessions,)``, seconds, non-decreasing, first = ``start_s``.

    Raises:
        ValueError: ``num_sessions < 0``.
    """
    if num_sessions < 0:
        raise ValueError(f"num_sessions must be >= 0, got {num_sessions}")
    index = np.arange(num_sessions, dtype=np.float64)
    if isinstance(process, FixedRateArrivals):
        return process.start_s + index / process.rate_per_s
    if isinstance(process, PoissonArrivals):
        gaps_s = rng.exponential(1.0 / process.rate_per_s, size=max(num_sessions - 1, 0))
        return process.start_s + np.concatenate([[0.0], np.cumsum(gaps_s)])[:num_sessions]
    burst, slot = np.divmod(index, process.burst_size)
    return process.start_s + burst * process.burst_interval_s + slot * process.intra_burst_gap_s


def with_arrivals(workload: Workload, process: ArrivalProcess, seed: int | None = None) -> Workload:
    """Return a copy of ``workload`` whose sessions arrive per ``process``, in session order.

    The process and seed are recorded in ``meta.arrival`` (``{"process": ..., "seed": ...}``).
    Pure: ``workload`` is not changed.

    Args:
        workload: the sessions (any existing arrival times are replaced).
        process: the arrival process.
        seed: the arrival draws use ``numpy.random.default_rng([seed, ARRIVAL_STREAM])``
            (``None``: the workload's ``meta.seed``, else 0).
    """
    seed = seed if seed is not None else (workload.meta.seed if workload.meta.seed is not None else 0)
    times_s = arrival_times_s(process, len(workload.sessions), np.random.default_rng([seed, ARRIVAL_STREAM]))
    sessions = tuple(
        s.model_copy(update={"arrival_s": float(t)}) for s, t in zip(workload.sessions, times_s, strict=True)
    )
    meta = workload.meta.model_copy(
        update={"arrival": {"process": process.model_dump(mode="json"), "seed": seed}}
    )
    return workload.model_copy(update={"sessions": sessions, "meta": meta})
