"""KV retention value model (policy/retention.py) and duration estimators (policy/estimators.py)."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from mars_openhands.policy.estimators import Ema, EmpiricalCdf, ToolDurationEstimator
from mars_openhands.policy.params import RetentionParams
from mars_openhands.policy.retention import (
    choose_ttl,
    net_value_s,
    reclaim_order_key,
    reload_time_s,
    shadow_price_s_per_block_s,
)

RP = RetentionParams()


def _cdf(values) -> EmpiricalCdf:
    cdf = EmpiricalCdf()
    for v in values:
        cdf.observe(v)
    return cdf


@pytest.mark.parametrize(("usage", "price"), [(0.0, 0.0), (0.5, 0.0), (0.75, 0.0008), (1.0, 0.0032)])
def test_shadow_price(usage: float, price: float) -> None:
    assert shadow_price_s_per_block_s(usage, RP) == pytest.approx(price)


def test_reload_time_quadratic_term() -> None:
    assert reload_time_s(100, RetentionParams(reload_quad_s_per_token2=1e-6)) == pytest.approx(0.03)


def test_no_pressure_retains_until_largest_duration_within_max_ttl() -> None:
    d = choose_ttl(_cdf([0.5, 1.0, 2.0, 100.0]), elapsed_s=0.0, num_tokens=1600, num_blocks=100,
                   queue_delay_s=0.5, kv_usage=0.1, params=RP)
    assert d is not None and d.ttl_s == 2.0 and d.value_s == pytest.approx(0.75 * (0.32 + 0.5))


def test_pressure_shortens_or_cancels_retention() -> None:
    cdf = _cdf([0.2] * 90 + [30.0] * 10)
    low = choose_ttl(cdf, elapsed_s=0.0, num_tokens=1600, num_blocks=100, queue_delay_s=0.5,
                     kv_usage=0.1, params=RP)
    high = choose_ttl(cdf, elapsed_s=0.0, num_tokens=1600, num_blocks=100, queue_delay_s=0.5,
                      kv_usage=1.0, params=RP)
    assert low is not None and low.ttl_s == 30.0
    assert high is not None and high.ttl_s == 0.2
    never = choose_ttl(_cdf([30.0] * 10), elapsed_s=0.0, num_tokens=16, num_blocks=100,
                       queue_delay_s=0.0, kv_usage=1.0, params=RP)
    assert never is None


def test_elapsed_time_conditions_the_cdf() -> None:
    cdf = _cdf([1.0] * 50 + [10.0] * 50)
    d = choose_ttl(cdf, elapsed_s=5.0, num_tokens=1600, num_blocks=10, queue_delay_s=0.5,
                   kv_usage=0.2, params=RP)
    assert d is not None and d.ttl_s == pytest.approx(5.0)  # only the 10 s mode remains


def test_cold_start_and_disabled() -> None:
    d = choose_ttl(EmpiricalCdf(), elapsed_s=0.0, num_tokens=1600, num_blocks=100,
                   queue_delay_s=0.5, kv_usage=0.2, params=RP)
    assert d is not None and (d.ttl_s, d.reason) == (2.0, "cold_start")
    assert choose_ttl(_cdf([1.0]), elapsed_s=0.0, num_tokens=16, num_blocks=1, queue_delay_s=0,
                      kv_usage=0, params=RetentionParams(enabled=False)) is None


@given(values=st.lists(st.floats(0, 100), min_size=1, max_size=60), usage=st.floats(0, 1),
       blocks=st.integers(1, 500), tokens=st.integers(1, 10**5), q=st.floats(0, 10))
def test_decision_is_worth_it_and_bounded(values, usage, blocks, tokens, q) -> None:
    p = RetentionParams()
    d = choose_ttl(_cdf(values), elapsed_s=0.0, num_tokens=tokens, num_blocks=blocks,
                   queue_delay_s=q, kv_usage=usage, params=p)
    if d is not None:
        assert 0 < d.ttl_s <= p.max_ttl_s and d.value_s > 0
        price = shadow_price_s_per_block_s(usage, p)
        prob = _cdf(values).prob_le(d.ttl_s)
        assert d.value_s == pytest.approx(
            net_value_s(prob, reload_time_s(tokens, p), q, d.ttl_s, blocks, price))


def test_reclaim_order_key_is_value_per_block() -> None:
    assert reclaim_order_key(1.0, 10) < reclaim_order_key(1.0, 5) < reclaim_order_key(0.5, 1)


@given(values=st.lists(st.floats(0, 1e4), min_size=1, max_size=100), x=st.floats(0, 1e4))
def test_empirical_cdf_matches_definition(values, x) -> None:
    cdf = _cdf(values)
    assert cdf.prob_le(x) == pytest.approx(sum(v <= x for v in values) / len(values))
    assert cdf.mean_s == pytest.approx(sum(values) / len(values))


def test_cdf_window_slides() -> None:
    cdf = EmpiricalCdf(max_samples=3)
    for v in (1.0, 2.0, 3.0, 4.0):
        cdf.observe(v)
    assert cdf.num_samples == 3 and cdf.prob_le(1.0) == 0.0 and cdf.mean_s == pytest.approx(3.0)
    with pytest.raises(ValueError, match="duration"):
        cdf.observe(-1.0)


def test_tool_estimator_falls_back_to_all_tools() -> None:
    est = ToolDurationEstimator(min_samples=3)
    est.observe("a", 1.0)
    est.observe("b", 9.0)
    assert est.cdf_for("a") is est.all_tools and est.mean_s("a") == 1.0
    est.observe("a", 1.0)
    est.observe("a", 1.0)
    assert est.cdf_for("a").prob_le(1.0) == 1.0 and est.num_samples("a") == 3
    assert est.cdf_for(None) is est.all_tools and est.mean_s("zzz") == pytest.approx(3.0)


def test_ema() -> None:
    e = Ema(0.5, 10.0)
    assert e.value == 10.0
    assert e.observe(2.0) == 2.0 and e.observe(4.0) == 3.0
    with pytest.raises(ValueError):
        Ema(0.0, 1.0)
