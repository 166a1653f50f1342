"""Tests for the pure waiting-session reorder (policy/reorder.py; design.md §6)."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from mars_openhands.policy.reorder import (
    ReorderContext,
    ReorderParams,
    WaitingSession,
    choose_mode,
    order_waiting,
    select_admissions,
)

P = ReorderParams()


def ws(sid: str, arrival: float, tokens: int, blocks: int | None = None) -> WaitingSession:
    return WaitingSession(session_id=sid, arrival_s=arrival, num_prompt_tokens=tokens,
                          num_projected_blocks=blocks)


SESSIONS = [ws("a", 0.0, 5000, 313), ws("b", 1.0, 100, 7), ws("c", 2.0, 20000, 1250),
            ws("d", 3.0, 800, 50)]


@pytest.mark.parametrize(
    "ctx, mode, order",
    [
        (ReorderContext(now_s=4, num_free_slots=4), "fcfs", ["a", "b", "c", "d"]),
        (ReorderContext(now_s=4, num_free_slots=1), "short_first", ["b", "d", "a", "c"]),
        (ReorderContext(now_s=4, num_free_slots=1, is_cpu_overloaded=True), "long_first",
         ["c", "a", "d", "b"]),
        (ReorderContext(now_s=4, num_free_slots=1, is_kv_overloaded=True, kv_budget_blocks=60),
         "kv_fit", ["b", "d", "a", "c"]),
        (ReorderContext(now_s=4, num_free_slots=1, is_kv_overloaded=True, is_cpu_overloaded=True,
                        kv_budget_blocks=400), "kv_fit", ["b", "d", "a", "c"]),
    ],
)
def test_order_by_pressure(ctx: ReorderContext, mode: str, order: list[str]) -> None:
    assert order_waiting(SESSIONS, ctx, P) == (mode, order)


def test_fcfs_fast_path_can_be_disabled() -> None:
    ctx = ReorderContext(now_s=4, num_free_slots=10)
    assert choose_mode(4, ctx, ReorderParams(fcfs_when_unpressured=False)) == "short_first"


def test_starved_sessions_go_first_in_arrival_order() -> None:
    params = ReorderParams(starvation_s=10.0)
    ctx = ReorderContext(now_s=12.5, num_free_slots=1)
    # a (arrival 0) and b (1) and c (2) waited >= 10 s; d did not.
    assert order_waiting(SESSIONS, ctx, params)[1] == ["a", "b", "c", "d"]
    ctx = ReorderContext(now_s=11.5, num_free_slots=1)  # only a and b starved
    assert order_waiting(SESSIONS, ctx, params)[1] == ["a", "b", "d", "c"]


def test_select_limits_to_free_slots() -> None:
    ctx = ReorderContext(now_s=4, num_free_slots=2)
    assert select_admissions(SESSIONS, ctx, P) == ("short_first", ["b", "d"])
    assert select_admissions(SESSIONS, ctx.model_copy(update={"num_free_slots": 0}), P)[1] == []


def test_kv_fit_admits_only_fitting_sessions() -> None:
    ctx = ReorderContext(now_s=4, num_free_slots=4, num_admitted=3, is_kv_overloaded=True,
                         kv_budget_blocks=60)
    assert select_admissions(SESSIONS, ctx, P) == ("kv_fit", ["b", "d"])  # 7 + 50 <= 60
    ctx = ctx.model_copy(update={"kv_budget_blocks": 5})
    assert select_admissions(SESSIONS, ctx, P)[1] == []


def test_kv_fit_progress_guarantee_when_nothing_admitted() -> None:
    ctx = ReorderContext(now_s=4, num_free_slots=4, num_admitted=0, is_kv_overloaded=True,
                         kv_budget_blocks=0)
    assert select_admissions(SESSIONS, ctx, P)[1] == ["b"]


waiting_st = st.lists(
    st.builds(ws, st.text("abcdefgh", min_size=1, max_size=4), st.floats(0, 100),
              st.integers(0, 100_000), st.none() | st.integers(0, 10_000)),
    max_size=20, unique_by=lambda s: s.session_id,
)
ctx_st = st.builds(
    ReorderContext, now_s=st.floats(100, 200), num_free_slots=st.integers(0, 30),
    num_admitted=st.integers(0, 30), is_cpu_overloaded=st.booleans(),
    is_kv_overloaded=st.booleans(), kv_budget_blocks=st.none() | st.integers(0, 5000),
)


@settings(max_examples=300, deadline=None)
@given(waiting_st, ctx_st, st.none() | st.floats(1, 150))
def test_order_is_a_permutation_and_selection_a_prefix(sessions, ctx, starvation_s) -> None:
    params = ReorderParams(starvation_s=starvation_s)
    _, order = order_waiting(sessions, ctx, params)
    assert sorted(order) == sorted(s.session_id for s in sessions)
    _, chosen = select_admissions(sessions, ctx, params)
    assert chosen == order[:len(chosen)]
    assert len(chosen) <= max(ctx.num_free_slots, 0)
