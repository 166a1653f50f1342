"""Tests for the pure AIMD admission window (policy/admission.py; design.md §6)."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from pydantic import ValidationError

from mars_openhands.policy.admission import (
    AdmissionParams,
    AdmissionState,
    PressureSnapshot,
    cpu_window_cap,
    ema,
    initial_state,
    is_cpu_overloaded,
    is_kv_overloaded,
    kv_window_cap,
    update_window,
    window_bounds,
)

P = AdmissionParams(cpu_set_backlog_ratio=4.0)  # the design values: 30/30/4, x0.7, +1, rho 4/1, wait 5/2 s, kv 0.90/0.85


def snap(rho: float = 0.0, wait: float | None = None, kv: float | None = None, workers: int = 100,
         num_replicas: int = 1):
    return PressureSnapshot(tool_backlog_ratio=rho, tool_wait_ema_s=wait, kv_usage=kv,
                            num_tool_workers=workers, num_replicas=num_replicas)


def test_defaults_are_the_design_values_but_h() -> None:
    """Ours: overload once calls wait at half the workers (H = 1.5), C_cpu = ceil(1.25 N_tool)."""
    d = AdmissionParams()
    assert (d.cpu_set_backlog_ratio, d.cpu_clear_backlog_ratio) == (1.5, 1.0)
    assert cpu_window_cap(6, d) == 8 and cpu_window_cap(16, d) == 20
    assert d.model_dump(exclude={"cpu_set_backlog_ratio"}) == P.model_dump(exclude={"cpu_set_backlog_ratio"})
    assert is_cpu_overloaded(False, snap(rho=1.5), d) and not is_cpu_overloaded(False, snap(rho=1.4), d)


def test_preview_values() -> None:
    assert (P.window_max, P.window_init, P.window_min) == (30, 30, 4)
    assert (P.decrease_factor, P.increase_step, P.update_interval_s) == (0.7, 1, 0.2)
    assert (P.cpu_set_backlog_ratio, P.cpu_clear_backlog_ratio) == (4.0, 1.0)
    assert (P.cpu_set_wait_s, P.cpu_clear_wait_s) == (5.0, 2.0)
    assert (P.kv_set_usage, P.kv_clear_usage, P.tool_wait_ema_alpha) == (0.90, 0.85, 0.2)


@pytest.mark.parametrize(
    "was, rho, wait, expected",
    [
        (False, 3.9, 4.9, False),   # below both set thresholds
        (False, 4.0, None, True),   # rho hits H
        (False, 0.0, 5.0, True),    # wait hits set
        (True, 2.0, 1.0, True),     # between thresholds: stays set (hysteresis)
        (True, 1.0, 3.0, True),     # rho cleared but wait not
        (True, 1.0, 2.0, False),    # both at clear thresholds: cleared
        (True, 0.5, None, False),   # no wait samples yet: rho alone clears
        (False, 2.0, 3.0, False),   # between thresholds from healthy: stays healthy
    ],
)
def test_cpu_overload_hysteresis(was: bool, rho: float, wait: float | None, expected: bool) -> None:
    assert is_cpu_overloaded(was, snap(rho, wait), P) is expected


@pytest.mark.parametrize(
    "was, kv, expected",
    [(False, 0.89, False), (False, 0.90, True), (True, 0.87, True), (True, 0.85, False),
     (True, None, True), (False, None, False)],
)
def test_kv_overload_hysteresis(was: bool, kv: float | None, expected: bool) -> None:
    assert is_kv_overloaded(was, snap(kv=kv), P) is expected


@pytest.mark.parametrize(
    "workers, expected",
    [(1, 4), (2, 5), (4, 10), (8, 20), (12, 30), (100, 30)],  # ceil(N * 2.5) in [4, 30]
)
def test_cpu_cap(workers: int, expected: int) -> None:
    assert cpu_window_cap(workers, P) == expected


@pytest.mark.parametrize(
    "workers, fraction, expected",
    [(16, None, 20), (16, 1.0, 20), (16, 0.8, 25), (16, 0.7, 29), (16, 0.5, 30), (16, 0.0, 30),
     (2, 0.5, 5), (1, 1.0, 4)],  # ceil(N * 1.25 / f) in [4, 30]
)
def test_cpu_cap_counts_only_the_sessions_in_tools(workers: int, fraction: float | None,
                                                  expected: int) -> None:
    """Little's law: f x sessions are in a tool call at a time, so C_cpu = N (L + H) / (2 f)."""
    assert cpu_window_cap(workers, AdmissionParams(), fraction) == expected
    preview = AdmissionParams(tool_fraction_horizon_s=None)  # the preview's cap: f = 1 whatever
    assert cpu_window_cap(workers, preview, fraction) == cpu_window_cap(workers, preview)


def test_the_window_caps_at_the_measured_fraction() -> None:
    d = AdmissionParams()
    grown = update_window(AdmissionState(window=30), PressureSnapshot(
        tool_backlog_ratio=0.5, num_tool_workers=16, tool_fraction=0.5), d)
    held = update_window(AdmissionState(window=30), PressureSnapshot(
        tool_backlog_ratio=0.5, num_tool_workers=16), d)
    assert (grown.cpu_cap, grown.state.window) == (30, 30)
    assert (held.cpu_cap, held.state.window) == (20, 20)


@pytest.mark.parametrize(
    "kv, expected",
    [(None, 30), (0.5, 30), (0.85, 30), (0.875, 17), (0.90, 4), (0.99, 4)],
)
def test_kv_cap_linear_between_clear_and_set(kv: float | None, expected: int) -> None:
    assert kv_window_cap(kv, P) == expected


@pytest.mark.parametrize(
    "window, signals, action, expected_window",
    [
        (30, snap(rho=4.0), "decrease", 21),              # floor(0.7 * 30)
        (5, snap(rho=4.0), "decrease", 4),                # floor(3.5) = 3 -> W_min
        (20, snap(rho=0.5, wait=0.1, kv=0.5), "increase", 21),
        (30, snap(rho=0.5, kv=0.5), "increase", 30),      # at W_max
        (20, snap(rho=2.0), "hold", 20),                  # between thresholds
        (20, snap(kv=0.87), "hold", 20),                  # KV between: hold, but cap 30-0.4*26
    ],
)
def test_update_window_table(window: int, signals: PressureSnapshot, action: str,
                             expected_window: int) -> None:
    d = update_window(AdmissionState(window=window), signals, P)
    assert d.action == action
    assert d.state.window == expected_window


def test_window_clamped_by_caps() -> None:
    d = update_window(AdmissionState(window=30), snap(rho=0.0, workers=2), P)
    assert d.cpu_cap == 5 and d.state.window == 5
    d = update_window(AdmissionState(window=30), snap(kv=0.88), P)
    assert d.kv_cap == round(30 - 0.6 * 26) and d.state.window == d.kv_cap


def test_shrinks_then_regrows_one_per_tick_after_clear() -> None:
    state = initial_state(P)
    windows = []
    for _ in range(6):  # overload: multiplicative decrease down to W_min
        state = update_window(state, snap(rho=5.0), P).state
        windows.append(state.window)
    assert windows == [21, 14, 9, 6, 4, 4]
    state = update_window(state, snap(rho=2.0), P).state  # in the band: still overloaded
    assert state.is_cpu_overloaded and state.window == 4
    for expected in (4, 5, 6):  # cleared: the clearing tick holds the flag off and grows
        state = update_window(state, snap(rho=0.5), P).state
        assert not state.is_cpu_overloaded
        assert state.window == expected + 1


def test_ema() -> None:
    assert ema(None, 3.0, 0.2) == 3.0
    assert ema(10.0, 0.0, 0.2) == pytest.approx(8.0)


@pytest.mark.parametrize(
    "bad",
    [dict(window_min=10, window_init=5), dict(window_init=40), dict(kv_clear_usage=0.95),
     dict(cpu_clear_backlog_ratio=4.0), dict(cpu_clear_wait_s=6.0), dict(decrease_factor=1.0),
     dict(unknown_key=1)],
)
def test_bad_params_rejected(bad: dict) -> None:
    with pytest.raises(ValidationError):
        AdmissionParams(**bad)


params_st = st.builds(
    lambda wmin, extra, extra2, factor, step: AdmissionParams(
        window_min=wmin, window_init=wmin + extra, window_max=wmin + extra + extra2,
        decrease_factor=factor, increase_step=step),
    st.integers(1, 10), st.integers(0, 20), st.integers(0, 40), st.floats(0.05, 0.95),
    st.integers(1, 5),
)
snap_st = st.builds(
    PressureSnapshot,
    tool_backlog_ratio=st.floats(0, 20), tool_wait_ema_s=st.none() | st.floats(0, 60),
    kv_usage=st.none() | st.floats(0, 1), num_tool_workers=st.integers(1, 64),
)


@settings(max_examples=300, deadline=None)
@given(params_st, st.lists(snap_st, min_size=1, max_size=30))
def test_window_always_within_bounds(params: AdmissionParams, snaps: list[PressureSnapshot]) -> None:
    state = initial_state(params)
    for s in snaps:
        d = update_window(state, s, params)
        assert params.window_min <= d.state.window <= params.window_max
        assert d.state.window <= max(params.window_min, min(d.cpu_cap, d.kv_cap))
        if d.action == "decrease":
            assert d.state.window <= state.window
        state = d.state


@settings(max_examples=300, deadline=None)
@given(st.booleans(), snap_st)
def test_hysteresis_band_keeps_previous_flag(was: bool, s: PressureSnapshot) -> None:
    """Strictly inside both bands, the flags never change."""
    inside_cpu = (P.cpu_clear_backlog_ratio < s.tool_backlog_ratio < P.cpu_set_backlog_ratio
                  and (s.tool_wait_ema_s is None
                       or P.cpu_clear_wait_s < s.tool_wait_ema_s < P.cpu_set_wait_s))
    if inside_cpu:
        assert is_cpu_overloaded(was, s, P) is was
    if s.kv_usage is not None and P.kv_clear_usage < s.kv_usage < P.kv_set_usage:
        assert is_kv_overloaded(was, s, P) is was


@settings(max_examples=200, deadline=None)
@given(snap_st)
def test_overload_never_grows_and_healthy_never_shrinks_below_caps(s: PressureSnapshot) -> None:
    for window in (P.window_min, 10, P.window_max):
        d = update_window(AdmissionState(window=window), s, P)
        if d.state.is_cpu_overloaded or d.state.is_kv_overloaded:
            assert d.state.window <= window
        elif d.action == "increase":
            assert d.state.window == min(window + 1, P.window_max, d.cpu_cap, d.kv_cap) or (
                d.state.window == P.window_min)


def test_window_bounds_are_per_replica() -> None:
    """W_min, W_max and the increase step count sessions per replica: N replicas, N times each."""
    assert window_bounds(P) == (4, 30, 1) and window_bounds(P, 8) == (32, 240, 8)
    assert initial_state(P, 8).window == 240
    assert kv_window_cap(None, P, 8) == 240 and kv_window_cap(0.95, P, 8) == 32
    assert kv_window_cap(0.875, P, 8) == 8 * kv_window_cap(0.875, P)  # midway: 17 per replica
    assert cpu_window_cap(1000, P, 1.0, 8) == 240 and cpu_window_cap(1, P, 1.0, 8) == 32
    # Healthy: +1 per replica per tick; overload: x0.7 but never below N W_min.
    grown = update_window(AdmissionState(window=100), snap(num_replicas=8), P)
    shrunk = update_window(AdmissionState(window=40), snap(kv=0.95, num_replicas=8), P)
    assert (grown.action, grown.state.window) == ("increase", 108)
    assert (shrunk.action, shrunk.state.window) == ("decrease", 32)


@settings(max_examples=300, deadline=None)
@given(params_st, st.lists(st.tuples(snap_st, st.integers(1, 16)), min_size=1, max_size=30))
def test_the_window_stays_within_the_bounds_of_the_replicas_up(
        params: AdmissionParams, steps: list[tuple[PressureSnapshot, int]]) -> None:
    """Replicas come and go between ticks: after every tick the window lies in N x [W_min, W_max]
    for that tick's N, under both caps (or at N W_min), and an overload never grows it."""
    state = initial_state(params, steps[0][1])
    for s, n in steps:
        d = update_window(state, s.model_copy(update={"num_replicas": n}), params)
        assert n * params.window_min <= d.state.window <= n * params.window_max
        assert d.state.window <= max(n * params.window_min, min(d.cpu_cap, d.kv_cap))
        if d.state.is_cpu_overloaded or d.state.is_kv_overloaded:
            assert d.state.window <= max(state.window, n * params.window_min)
        state = d.state


@settings(max_examples=200, deadline=None)
@given(params_st, st.lists(snap_st, min_size=1, max_size=30), st.integers(2, 8))
def test_n_replicas_never_admit_fewer_than_one(params: AdmissionParams, snaps: list[PressureSnapshot],
                                               n: int) -> None:
    """Under the same signals, the window behind N replicas is never below the one-replica window
    (and at most N times it when nothing caps them): more GPUs never shut the door tighter."""
    one, many = initial_state(params), initial_state(params, n)
    for s in snaps:
        one = update_window(one, s, params).state
        many = update_window(many, s.model_copy(update={"num_replicas": n}), params).state
        assert many.window >= one.window
        assert (many.is_cpu_overloaded, many.is_kv_overloaded) == (one.is_cpu_overloaded, one.is_kv_overloaded)
