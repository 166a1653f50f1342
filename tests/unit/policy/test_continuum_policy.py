"""Continuum policy (mars_openhands.policy.continuum): table-driven and property tests."""

from __future__ import annotations

import math
import statistics

import pytest
from hypothesis import given
from hypothesis import strategies as st
from pydantic import ValidationError

from mars_openhands.policy.continuum import (
    ContinuumParams,
    MemoryfulnessEstimator,
    PrefillReloadModel,
    QueueDelayWindow,
    continuum_ttl_s,
    dynamic_ttl_s,
    optimal_ttl_s,
    pin_benefit_s,
    pin_release_order,
    pin_ttl_s,
    running_victim_key,
    should_unpin,
    waiting_order_key,
)
from mars_openhands.policy.estimators import EmpiricalCdf, ToolDurationEstimator

P = ContinuumParams()
DY = ContinuumParams(mode="continuum-dy")


def cdf(samples: list[float]) -> EmpiricalCdf:
    out = EmpiricalCdf(max_samples=10_000)
    for t in samples:
        out.observe(t)
    return out


def test_defaults_match_design_section_5() -> None:
    assert (P.mode, P.fixed_ttl_s, P.pin_mean_threshold_s) == ("continuum", 2.0, 2.0)
    assert (P.min_records, P.queue_delay_window, P.eta_default) == (100, 200, 1.0)
    assert P.prefill_reload.linear_s_per_token == 0.0002
    assert P.prefill_reload.quad_s_per_token2 == 0.0 and P.prefill_reload.const_s == 0.0


@pytest.mark.parametrize(
    "kwargs", [{"mode": "continuum_dy"}, {"fixed_ttl_s": -1.0}, {"ttl": 2.0},
               {"queue_delay_window": 0}, {"prefill_reload": {"b": 1.0}}],
)
def test_bad_params_are_rejected(kwargs: dict) -> None:
    with pytest.raises(ValidationError):
        ContinuumParams(**kwargs)


@pytest.mark.parametrize(
    ("model", "tokens", "seconds"),
    [(PrefillReloadModel(), 10_000, 2.0), (PrefillReloadModel(), -5, 0.0),
     (PrefillReloadModel(quad_s_per_token2=1e-8, linear_s_per_token=1e-4, const_s=0.01), 1000,
      0.01 + 0.1 + 0.01)],
)
def test_prefill_reload_is_quadratic_in_tokens(
    model: PrefillReloadModel, tokens: int, seconds: float
) -> None:
    assert model.seconds(tokens) == pytest.approx(seconds)


@pytest.mark.parametrize(
    ("mean_s", "ttl_s"), [(0.0, 2.0), (1.99, 2.0), (2.0, 2.0), (2.01, 0.0), (50.0, 0.0),
                          (None, 2.0)],
)
def test_static_rule_pins_fast_tools_only(mean_s: float | None, ttl_s: float) -> None:
    assert continuum_ttl_s(mean_s, P) == ttl_s


@pytest.mark.parametrize(
    ("samples", "benefit", "tau"),
    [
        ([], 5.0, 0.0),
        ([1.0, 2.0, 3.0], 0.0, 0.0),
        ([1.0, 1.0, 9.0], 3.0, 1.0),       # 2/3*3-1 = 1 > 0 and > 3-9
        ([1.0, 1.0, 9.0], 30.0, 9.0),      # 30-9 = 21 > 2/3*30-1 = 19
        ([5.0, 6.0], 4.0, 0.0),            # every tau loses seconds
        ([0.0, 0.0, 4.0], 1.0, 0.0),       # P(t <= 0) = 2/3 > 0
        ([0.5, 1.5], 2.0, 0.5),            # tie 0.5 vs 0.5 -> smallest tau
    ],
)
def test_optimal_ttl_argmax(samples: list[float], benefit: float, tau: float) -> None:
    assert optimal_ttl_s(cdf(samples), benefit) == tau


def _brute_force(samples: list[float], benefit: float) -> float:
    """The public code's O(n^2) argmax, as an oracle."""
    if not samples or benefit <= 0.0:
        return 0.0
    best_tau, best = 0.0, -math.inf
    for tau in sorted({0.0, *samples}):
        reward = sum(1 for t in samples if t <= tau) / len(samples) * benefit - tau
        if reward > best:
            best_tau, best = tau, reward
    return best_tau if best > 0.0 else 0.0


@given(
    samples=st.lists(st.floats(0.0, 60.0, allow_nan=False), max_size=80),
    benefit=st.floats(-1.0, 100.0, allow_nan=False),
)
def test_optimal_ttl_matches_the_brute_force_argmax(samples: list[float], benefit: float) -> None:
    tau = optimal_ttl_s(cdf(samples), benefit)
    assert tau == _brute_force(samples, benefit)
    assert tau == 0.0 or tau in samples


def test_dynamic_rule_cold_start_then_global_then_per_tool() -> None:
    fast = cdf([0.5] * 101)
    slow_global = [30.0] * 101
    # cold start: 100 samples in total -> fixed TTL whatever they say
    assert dynamic_ttl_s(None, cdf([30.0] * 100), 5.0, DY) == 2.0
    # warm, tool has <= K samples -> global CDF (all slow -> do not pin)
    assert dynamic_ttl_s(cdf([0.5] * 100), cdf(slow_global), 5.0, DY) == 0.0
    # tool has > K samples -> its own CDF
    assert dynamic_ttl_s(fast, cdf(slow_global + [0.5] * 101), 5.0, DY) == 0.5
    # nothing to gain -> no pin even at cold start
    assert dynamic_ttl_s(None, cdf([]), 0.0, DY) == 0.0


def test_pin_ttl_dispatches_on_mode_and_drops_tiny_ttls() -> None:
    durations = ToolDurationEstimator(min_samples=100)
    for _ in range(150):
        durations.observe("pytest", 3.0)
        durations.observe("ls", 0.005)
    assert pin_ttl_s("pytest", 1000, durations, 0.0, 1.0, P) == 0.0   # mean 3 s > 2 s
    assert pin_ttl_s("ls", 1000, durations, 0.0, 1.0, P) == 2.0
    assert pin_ttl_s(None, 1000, durations, 0.0, 1.0, P) == 2.0       # unknown tool: pin
    assert pin_ttl_s("pip", 1000, durations, 0.0, 1.0, P) == 2.0      # unseen tool: pin
    # dynamic: ls's own CDF, benefit = 0.0002*1000 = 0.2 s > 0.005 s -> tau = 0.005 <= 0.01
    assert pin_ttl_s("ls", 1000, durations, 0.0, 1.0, DY) == 0.0
    # pytest: benefit = 10 s queue delay + 0.2 s -> tau = 3 s
    assert pin_ttl_s("pytest", 1000, durations, 10.0, 1.0, DY) == 3.0
    # eta scales the queueing term
    assert pin_ttl_s("pytest", 1000, durations, 10.0, 0.1, DY) == 0.0
    # unknown tool: pooled CDF (half at 0.005 s, half at 3 s): 10.2 - 3 > 0.5 * 10.2 - 0.005
    assert pin_ttl_s(None, 1000, durations, 10.0, 1.0, DY) == 3.0
    # ... but with benefit 2.2 s: 0.5 * 2.2 - 0.005 > 2.2 - 3, and 0.005 s is below the minimum
    assert pin_ttl_s(None, 1000, durations, 2.0, 1.0, DY) == 0.0


def test_pin_ttl_uses_the_pooled_samples_while_a_tool_has_at_most_k() -> None:
    durations = ToolDurationEstimator(min_samples=100)
    for _ in range(200):
        durations.observe("pytest", 3.0)
    for _ in range(50):
        durations.observe("ls", 0.5)
    # ls has 50 <= K samples: pooled CDF (80% at 3 s), benefit 10.2 s -> tau = 3 s
    assert pin_ttl_s("ls", 1000, durations, 10.0, 1.0, DY) == 3.0


def test_pinned_programs_first_then_program_fcfs() -> None:
    waiting = {  # request -> (program pinned?, program first arrival, request arrival)
        "p1-turn3": (False, 1.0, 50.0),
        "p2-turn1": (False, 2.0, 20.0),
        "p3-turn2": (True, 3.0, 60.0),
        "p4-turn1": (True, 0.5, 70.0),
    }
    order = sorted(waiting, key=lambda r: waiting_order_key(*waiting[r]))
    assert order == ["p4-turn1", "p3-turn2", "p1-turn3", "p2-turn1"]


def test_running_victim_prefers_non_final_then_latest_program() -> None:
    running = {"a": (False, 1.0), "b": (True, 9.0), "c": (None, 5.0), "d": (False, 4.0)}
    order = sorted(running, key=lambda r: running_victim_key(*running[r]), reverse=True)
    assert order == ["c", "d", "a", "b"]


def test_pin_release_order_is_latest_program_arrival_first_and_stable() -> None:
    pins = [("s1", 1.0), ("s2", 3.0), ("s3", 2.0), ("s4", 3.0)]
    assert pin_release_order(pins) == ["s2", "s4", "s3", "s1"]
    assert pin_release_order([]) == []


@pytest.mark.parametrize(
    ("now", "expires", "waiting", "unpin"),
    [(5.0, 4.0, False, True), (4.0, 4.0, False, True), (3.9, 4.0, False, False),
     (9.0, 4.0, True, False)],
)
def test_unpin_when_expired_and_program_not_waiting(
    now: float, expires: float, waiting: bool, unpin: bool
) -> None:
    assert should_unpin(now, expires, waiting) is unpin


def test_queue_delay_window_slides() -> None:
    window = QueueDelayWindow(maxlen=3)
    assert window.mean_s() == 0.0
    for delay in (1.0, 2.0, 3.0, 10.0):
        window.record(delay)
    assert window.mean_s() == pytest.approx(5.0)  # (2 + 3 + 10) / 3


def test_memoryfulness_defaults_until_measurable() -> None:
    eta = MemoryfulnessEstimator(default=0.7)
    assert eta.eta() == 0.7
    eta.observe_program([0], 1)           # one pair: undefined
    assert eta.eta() == 0.7


def test_memoryfulness_of_equal_length_programs_is_one() -> None:
    eta = MemoryfulnessEstimator()
    for _ in range(3):
        eta.observe_program(range(5), 5)  # k and N - k move in lockstep: corr = -1
    assert eta.eta() == pytest.approx(1.0)


@given(lengths=st.lists(st.integers(1, 30), min_size=2, max_size=20))
def test_memoryfulness_matches_the_sample_correlation(lengths: list[int]) -> None:
    eta = MemoryfulnessEstimator(default=123.0)
    xs: list[float] = []
    ys: list[float] = []
    for n in lengths:
        eta.observe_program(range(n), n)
        xs += [float(k) for k in range(n)]
        ys += [float(n - k) for k in range(n)]
    try:
        expected = -statistics.correlation(xs, ys)
    except statistics.StatisticsError:  # constant input: undefined
        expected = 123.0
    assert eta.eta() == pytest.approx(expected, abs=1e-6)
    assert -1.0 <= eta.eta() <= 1.0 or eta.eta() == 123.0


@given(queue=st.floats(0, 100), eta=st.floats(-1, 1), reload=st.floats(0, 100))
def test_benefit_is_queue_delay_times_eta_plus_reload(queue: float, eta: float, reload: float) -> None:
    assert pin_benefit_s(queue, eta, reload) == pytest.approx(queue * eta + reload)
