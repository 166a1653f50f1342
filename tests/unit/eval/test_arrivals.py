"""Arrival processes: exact fixed/burst times, seeded Poisson statistics, workload application."""

from __future__ import annotations

import numpy as np
import pytest

from eval.workloads.arrivals import (
    BurstArrivals,
    FixedRateArrivals,
    PoissonArrivals,
    arrival_times_s,
    parse_arrival,
    with_arrivals,
)
from eval.workloads.format import Session, Turn, Workload, WorkloadMeta


def _rng(seed: int = 0) -> np.random.Generator:
    return np.random.default_rng(seed)


def test_fixed_rate_is_exact() -> None:
    times = arrival_times_s(FixedRateArrivals(rate_per_s=4.0, start_s=1.0), 4, _rng())
    np.testing.assert_allclose(times, [1.0, 1.25, 1.5, 1.75])


def test_burst_is_exact() -> None:
    process = BurstArrivals(burst_size=3, burst_interval_s=10.0, intra_burst_gap_s=0.5)
    np.testing.assert_allclose(arrival_times_s(process, 7, _rng()),
                               [0.0, 0.5, 1.0, 10.0, 10.5, 11.0, 20.0])


def test_overlapping_bursts_are_rejected() -> None:
    with pytest.raises(ValueError, match="longer than burst_interval_s"):
        BurstArrivals(burst_size=5, burst_interval_s=1.0, intra_burst_gap_s=0.5)


def test_poisson_is_seeded_and_has_the_right_rate() -> None:
    process = PoissonArrivals(rate_per_s=2.0, start_s=3.0)
    a = arrival_times_s(process, 20_000, _rng(1))
    np.testing.assert_array_equal(a, arrival_times_s(process, 20_000, _rng(1)))
    assert not np.array_equal(a, arrival_times_s(process, 20_000, _rng(2)))
    assert a[0] == 3.0 and np.all(np.diff(a) >= 0)
    gaps = np.diff(a)
    assert gaps.mean() == pytest.approx(0.5, rel=0.03)  # exponential: mean 1/rate,
    assert gaps.std() == pytest.approx(0.5, rel=0.05)   # and std 1/rate


@pytest.mark.parametrize("process", [FixedRateArrivals(rate_per_s=1.0), PoissonArrivals(rate_per_s=1.0),
                                     BurstArrivals(burst_size=2, burst_interval_s=1.0)])
def test_edge_counts(process) -> None:
    assert arrival_times_s(process, 0, _rng()).shape == (0,)
    assert arrival_times_s(process, 1, _rng()).tolist() == [0.0]
    with pytest.raises(ValueError, match="num_sessions must be >= 0"):
        arrival_times_s(process, -1, _rng())


def test_bad_params_and_parse() -> None:
    with pytest.raises(ValueError, match="rate_per_s"):
        FixedRateArrivals(rate_per_s=0.0)
    assert parse_arrival({"kind": "poisson", "rate_per_s": 2}) == PoissonArrivals(rate_per_s=2.0)
    with pytest.raises(ValueError, match="burst"):
        parse_arrival('{"kind": "uniform", "rate_per_s": 2}')


def test_with_arrivals_sets_times_and_records_the_process() -> None:
    turns = (Turn(prompt_tokens_appended=10, output_tokens=1),)
    workload = Workload(meta=WorkloadMeta(source="t", seed=5),
                        sessions=tuple(Session(session_id=f"s{i}", turns=turns) for i in range(3)))
    shaped = with_arrivals(workload, FixedRateArrivals(rate_per_s=0.5))
    assert [s.arrival_s for s in shaped.sessions] == [0.0, 2.0, 4.0]
    assert [s.turns for s in shaped.sessions] == [s.turns for s in workload.sessions]
    assert shaped.meta.arrival == {"process": {"kind": "fixed", "rate_per_s": 0.5, "start_s": 0.0}, "seed": 5}
    assert [s.arrival_s for s in workload.sessions] == [0.0, 0.0, 0.0]  # input unchanged
    poisson = PoissonArrivals(rate_per_s=1.0)
    assert with_arrivals(workload, poisson) == with_arrivals(workload, poisson, seed=5)
    assert with_arrivals(workload, poisson, seed=6) != with_arrivals(workload, poisson, seed=5)
