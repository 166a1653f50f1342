"""KV retention value model (policy/retention.py) and duration estimators (policy/estimators.py)."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from mars_openhands.policy.estimators import Ema, EmpiricalCdf, PrefillRate, ToolDurationEstimator
from mars_openhands.policy.params import RetentionParams
from mars_openhands.policy.retention import (
    choose_ttl,
    is_reclaimable_by_value,
    net_value_s,
    reclaim_order_key,
    reload_time_s,
    shadow_price_s_per_block_s,
)
from mars_openhands.policy.session import SessionState, tool_sample_at_arrival

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


# ---------------------------------------------------------------- reclaim test, prefill rate, tool samples


def test_is_reclaimable_by_value_compares_value_with_the_remaining_holding_cost() -> None:
    p = RetentionParams()
    price = p.price_max_s_per_block_s  # full pressure: usage counts as 1
    cost = 10.0 * 4 * price            # 10 s left, 4 blocks
    assert is_reclaimable_by_value(cost * 0.99, 20.0, 4, 10.0, p)
    assert not is_reclaimable_by_value(cost, 20.0, 4, 10.0, p)  # strict: equal value is kept
    assert not is_reclaimable_by_value(1e-9, 5.0, 4, 10.0, p)   # expired: nothing left to pay for
    free = RetentionParams(price_max_s_per_block_s=0.0)
    assert not is_reclaimable_by_value(1e-9, 1e9, 1000, 0.0, free)


def test_prefill_rate_samples_only_large_prefills_in_order() -> None:
    rate = PrefillRate(0.001, min_sample_tokens=100, alpha=0.5)
    rate.step_done(5.0)  # nothing pending: no-op
    assert rate.value == 0.001 and rate.num_samples == 0
    rate.step_scheduled(0.0, 99)    # too small
    rate.step_scheduled(1.0, 1000)
    rate.step_scheduled(2.0, 2000)
    rate.step_done(1.0)
    assert rate.num_samples == 0
    rate.step_done(2.0)             # (2 - 1) / 1000
    assert rate.value == pytest.approx(0.001) and rate.num_samples == 1
    rate.step_done(4.0)             # (4 - 2) / 2000 = 0.001 again; EMA of equal samples
    assert rate.value == pytest.approx(0.001) and rate.num_samples == 2
    with pytest.raises(ValueError, match="alpha"):
        PrefillRate(0.001, alpha=0.0)


@pytest.mark.parametrize(("session", "prev_tool", "prev_tool_s", "out"), [
    (SessionState("s", num_turns_finished=1, last_finish_s=10.0, pending_tool="bash"), None, None,
     ("bash", 2.5)),
    (SessionState("s", num_turns_finished=1, last_finish_s=10.0, pending_tool="bash"), "edit", 1.0,
     ("edit", 1.0)),                                                     # the report wins
    (SessionState("s", num_turns_finished=1, last_finish_s=10.0, tool_ended=True), None, None, None),
    (SessionState("s", num_turns_finished=1), None, None, None),        # no finish known
    (SessionState("s"), "edit", 3.0, ("edit", 3.0)),                    # first turn here: report only
    (SessionState("s"), "edit", None, None),
    (SessionState("s", tool_ended=True), "edit", 3.0, None),            # tool_end counted it
])
def test_tool_sample_at_arrival(session: SessionState, prev_tool: str | None, prev_tool_s: float | None,
                                out: tuple[str | None, float] | None) -> None:
    assert tool_sample_at_arrival(session, 12.5, prev_tool, prev_tool_s) == out


@given(values=st.lists(st.floats(0, 1e4), min_size=1, max_size=80), window=st.integers(1, 40),
       elapsed=st.lists(st.floats(0, 1e4), min_size=1, max_size=5))
def test_mean_remaining_is_the_conditional_mean(values, window, elapsed) -> None:
    """E[D - e | D > e] over the window, with the tail sums rebuilt after every observe."""
    cdf = EmpiricalCdf(max_samples=window)
    for i, v in enumerate(values):
        cdf.observe(v)
        kept = sorted(values[max(0, i + 1 - window):i + 1])
        for e in elapsed:
            alive = [d for d in kept if d > e]
            got = cdf.mean_remaining_s(e)
            if not alive:
                assert got is None
            else:
                tail = 0.0
                for d in reversed(alive):  # the same summation order: exact
                    tail += d
                assert got == tail / len(alive) - e
