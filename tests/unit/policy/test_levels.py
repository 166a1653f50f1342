"""MLFQ levels (policy/levels.py): preview port and our bounded-promotion variant."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from mars_openhands.policy.levels import (
    bucket_level,
    effective_level,
    feedback_after_scheduled,
    feedback_after_step,
    mars_base_level,
    mars_level,
    preview_effective_level,
    preview_remaining_level,
    quantum_tokens,
)
from mars_openhands.policy.params import LevelParams, MarsLevelParams

LP = LevelParams()
MP = MarsLevelParams()


@pytest.mark.parametrize(("tokens", "level"), [(0, 0), (1, 0), (2048, 0), (2049, 1), (8192, 1),
                                               (8193, 2), (32768, 2), (32769, 3), (10**6, 3)])
def test_bucket_level_design_thresholds(tokens: int, level: int) -> None:
    assert bucket_level(tokens, LP.prompt_thresholds_tokens) == level


@pytest.mark.parametrize(("level", "budget", "quantum"), [(0, 8192, 2048), (1, 8192, 1024),
                                                          (2, 8192, 512), (3, 8192, 256),
                                                          (7, 8192, 256), (-1, 8192, 2048),
                                                          (0, 1000, 1000)])
def test_quanta_capped_at_budget(level: int, budget: int, quantum: int) -> None:
    assert quantum_tokens(level, LP, budget) == quantum


@pytest.mark.parametrize(("prompt", "computed", "level"), [(40000, 0, 3), (40000, 39000, 0),
                                                           (40000, 40000, 0), (5000, 0, 1)])
def test_preview_remaining_level(prompt: int, computed: int, level: int) -> None:
    assert preview_remaining_level(prompt, computed, LP) == level


@pytest.mark.parametrize(("fb", "rem", "wait_s", "level"), [
    (0, 3, 0.0, 3), (0, 3, 29.9, 3), (0, 3, 30.0, 2), (2, 1, 61.0, 0), (3, 0, 95.0, 0),
])
def test_preview_effective_level(fb: int, rem: int, wait_s: float, level: int) -> None:
    assert preview_effective_level(fb, rem, 100.0 - wait_s, 100.0, LP) == level


def test_preview_never_scheduled_starts_at_level_zero() -> None:
    assert preview_effective_level(3, 3, None, 100.0, LP) == 0
    assert preview_effective_level(3, 3, None, 100.0, LevelParams(aging_interval_s=0)) == 3


@pytest.mark.parametrize(("fb", "decode", "n", "q", "left", "out"), [
    (0, False, 2048, 2048, 10, 1), (0, False, 2048, 2048, 0, 0), (1, False, 500, 1024, 10, 1),
    (3, False, 256, 256, 10, 3), (2, True, 1, 512, 10, 0),
])
def test_feedback_after_step(fb, decode, n, q, left, out) -> None:
    assert feedback_after_step(fb, decode, n, q, left, LP) == out


@pytest.mark.parametrize(("fb", "uncached", "service", "level"), [
    (0, 0, 0, 0), (0, 20, 0, 0), (0, 60000, 0, 3), (1, 20, 0, 1), (0, 20, 300000, 1),
    (0, 20, 10**8, 3),
])
def test_mars_base_level(fb: int, uncached: int, service: int, level: int) -> None:
    assert mars_base_level(fb, uncached, service, LP, MP) == level


def test_mars_base_level_without_session_service() -> None:
    assert mars_base_level(0, 20, 10**8, LP, MarsLevelParams(use_session_service=False)) == 0


@given(base=st.integers(0, 3), wait_s=st.floats(0, 1e6), bound=st.integers(0, 5),
       aging=st.floats(0.1, 100))
def test_promotion_is_bounded(base: int, wait_s: float, bound: int, aging: float) -> None:
    lp = LevelParams(aging_interval_s=aging)
    mp = MarsLevelParams(max_promotion_levels=bound)
    level = effective_level(base, wait_s, lp, mp)
    assert max(0, base - bound) <= level <= base


@given(base=st.integers(0, 3), w1=st.floats(0, 1e5), dw=st.floats(0, 1e5))
def test_promotion_is_monotone_in_waiting_time(base: int, w1: float, dw: float) -> None:
    assert effective_level(base, w1 + dw, LP, MP) <= effective_level(base, w1, LP, MP)


@given(base=st.integers(0, 3), aging=st.floats(0.1, 100))
def test_no_starvation_beyond_bound(base: int, aging: float) -> None:
    """With promotion allowed over all levels, waiting (L-1) intervals reaches level 0."""
    lp = LevelParams(aging_interval_s=aging)
    mp = MarsLevelParams(max_promotion_levels=lp.num_levels - 1)
    assert effective_level(base, (lp.num_levels - 1) * aging * 1.0001, lp, mp) == 0


# ---------------------------------------------------------------- mars_level / feedback_after_scheduled


def _mars_level(**kw: object) -> int:
    args = dict(num_prompt_tokens=10_000, num_computed_tokens=0, num_cached_at_arrival_tokens=0,
                num_session_context_tokens=0, session_service_tokens=0, feedback_level=0,
                wait_s=0.0, params=LevelParams(), mars=MarsLevelParams())
    args.update(kw)
    return mars_level(**args)  # type: ignore[arg-type]


def test_mars_level_ranks_by_uncached_new_work() -> None:
    assert _mars_level() == 2                                  # 10k fresh tokens: bucket 2
    assert _mars_level(num_cached_at_arrival_tokens=9_000) == 0  # 1k left after the hit
    assert _mars_level(num_computed_tokens=3_000) == 1         # 7k left
    assert _mars_level(num_computed_tokens=10_000) == 0        # decode
    assert _mars_level(num_computed_tokens=20_000, feedback_level=3) == 0  # decode beats feedback


def test_mars_level_session_context_counts_only_with_level_from_new_work() -> None:
    on = MarsLevelParams(level_from_new_work=True)
    off = MarsLevelParams(level_from_new_work=False)
    assert _mars_level(num_session_context_tokens=9_500, mars=on) == 0
    assert _mars_level(num_session_context_tokens=9_500, mars=off) == 2


def test_mars_level_feedback_service_and_bounded_aging() -> None:
    mars = MarsLevelParams(max_promotion_levels=1)
    assert _mars_level(num_computed_tokens=9_000, feedback_level=3, mars=mars) == 3
    assert _mars_level(num_computed_tokens=9_000, feedback_level=3, wait_s=1e6, mars=mars) == 2
    heavy = _mars_level(num_computed_tokens=9_999, session_service_tokens=10**9)
    assert heavy > 0
    assert heavy == _mars_level(num_computed_tokens=9_999, session_service_tokens=10**9,
                                mars=MarsLevelParams(use_session_service=True))
    assert _mars_level(num_computed_tokens=9_999, session_service_tokens=10**9,
                       mars=MarsLevelParams(use_session_service=False)) == 0


@pytest.mark.parametrize(("fb", "quantum", "n", "prompt", "computed", "total", "out"), [
    (0, 2048, 2048, 10_000, 2048, 10_000, 1),   # full quantum, prompt left: demote
    (3, 256, 256, 10_000, 9_000, 10_000, 3),    # demotion capped at the last level
    (1, 2048, 1000, 10_000, 10_000, 10_000, 1), # chunk smaller than the quantum: unchanged
    (1, 512, 512, 1_000, 1_000, 1_000, 1),      # full quantum but nothing left: unchanged
    (2, None, 1, 100, 101, 102, 0),             # decode (computed before >= prompt): reset
    (1, None, 64, 10_000, 64, 10_000, 2),       # no quantum applied: the step counts as full
])
def test_feedback_after_scheduled(fb: int, quantum: int | None, n: int, prompt: int, computed: int,
                                  total: int, out: int) -> None:
    assert feedback_after_scheduled(fb, quantum, n, prompt, computed, total, LevelParams()) == out
