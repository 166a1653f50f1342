"""InferCept policy (mars_openhands.policy.infercept): waste formulas and the MARS-port TTL."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st
from pydantic import ValidationError

from mars_openhands.policy.continuum import PrefillReloadModel
from mars_openhands.policy.infercept import (
    InferceptParams,
    break_even_ttl_s,
    chunked_discard_waste,
    discard_waste,
    infercept_ttl_s,
    preserve_waste,
    swap_waste,
)

P = InferceptParams()


def test_defaults() -> None:
    assert P.prefill_reload.linear_s_per_token == 0.0002
    assert P.min_pin_ttl_s == 0.01


def test_unknown_keys_are_rejected() -> None:
    with pytest.raises(ValidationError, match="Extra inputs"):
        InferceptParams(swap=True)


@pytest.mark.parametrize(
    ("waste", "expected"),
    [
        (discard_waste(0.5, 1000, 3000), 0.5 * 4000),
        (discard_waste(0.5, 1000, 3000, kv_bytes_per_token=2.0), 0.5 * 4000 * 2),
        (chunked_discard_waste(0.5, 0.1, 1000, 3000, 4), 0.5 * 1000 / 2 + 4 * 0.1 * 3000),
        (preserve_waste(3.0, 1000), 3000.0),
        (preserve_waste(3.0, 1000, kv_bytes_per_token=4.0), 12000.0),
        (swap_waste(0.05, 8000), 2 * 0.05 * 8000),
    ],
)
def test_waste_formulas(waste: float, expected: float) -> None:
    assert waste == pytest.approx(expected)


def test_chunked_discard_needs_at_least_one_chunk() -> None:
    with pytest.raises(ValueError, match="num_chunks must be >= 1, got 0"):
        chunked_discard_waste(1.0, 1.0, 10, 10, 0)


@pytest.mark.parametrize(
    ("t_fwd", "c", "c_other", "ttl"),
    [(0.2, 1000, 3000, 0.4), (0.2, 1000, 0, 0.1), (1.0, 0, 500, 0.0), (0.0, 100, 100, 0.0)],
)
def test_break_even_ttl(t_fwd: float, c: int, c_other: int, ttl: float) -> None:
    assert break_even_ttl_s(t_fwd, c, c_other) == pytest.approx(ttl)


@pytest.mark.parametrize(
    ("c", "c_other", "ttl"),
    [(1000, 3000, 0.4),       # T_fwd = 0.2 s
     (50, 0, 0.0),            # 0.01 s * 50 / 100 = 0.005 <= 0.01 -> do not retain
     (0, 10_000, 0.0)],
)
def test_infercept_ttl_uses_the_reload_model_and_drops_tiny_ttls(
    c: int, c_other: int, ttl: float
) -> None:
    assert infercept_ttl_s(c, c_other, P) == pytest.approx(ttl)


def test_infercept_ttl_follows_a_quadratic_reload_model() -> None:
    params = InferceptParams(prefill_reload=PrefillReloadModel(quad_s_per_token2=1e-7,
                                                               linear_s_per_token=0.0))
    # T_fwd(2000) = 0.4 s; TTL = 0.4 * (2000 + 2000) / 4000 = 0.4 s
    assert infercept_ttl_s(2000, 2000, params) == pytest.approx(0.4)


@given(
    t_fwd=st.floats(0.0, 10.0), c=st.integers(1, 200_000), c_other=st.integers(0, 1_000_000)
)
def test_break_even_ttl_equalizes_preserve_and_chunked_discard(
    t_fwd: float, c: int, c_other: int
) -> None:
    ttl = break_even_ttl_s(t_fwd, c, c_other)
    # preserve for ttl wastes exactly the chunked-discard estimate T_fwd (C + C_other) / 2
    assert preserve_waste(ttl, c) == pytest.approx(t_fwd * (c + c_other) / 2.0, rel=1e-9, abs=1e-9)
    assert ttl >= t_fwd / 2.0 - 1e-12


@given(c=st.integers(1, 100_000), a=st.integers(0, 10**6), b=st.integers(0, 10**6))
def test_more_concurrent_context_means_longer_retention(c: int, a: int, b: int) -> None:
    lo, hi = sorted((a, b))
    assert infercept_ttl_s(c, lo, P) <= infercept_ttl_s(c, hi, P)
