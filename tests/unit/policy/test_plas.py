"""Autellix PLAS policy (mars_openhands.policy.plas): table-driven and property tests."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st
from pydantic import ValidationError

from mars_openhands.policy.plas import (
    PlasCall,
    PlasParams,
    PlasProgram,
    accrue_wait,
    arrival_level,
    level_quantum_tokens,
    new_call,
    on_call_finished,
    on_scheduled,
    promote,
    running_order_key,
    should_promote,
    step_token_cap,
    victim_key,
)

P = PlasParams()
BUDGET = 8192


def test_defaults_are_marss_baseline_parameters() -> None:
    assert P.service_thresholds_tokens == (2048, 8192, 32768)
    assert P.level_quanta_tokens == (2048, 1024, 512, 256)
    assert P.starvation_beta == 2.0
    assert P.max_level == 3


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"service_thresholds_tokens": (2048, 2048, 4096)}, "strictly increasing"),
        ({"level_quanta_tokens": (2048, 1024, 512)}, r"needs len\(service_thresholds_tokens\) \+ 1 = 4"),
        ({"starvation_beta": 0.0}, "greater than 0"),
        ({"level_quanta_tokens": (2048, 0, 512, 256)}, "greater than 0"),
        ({"beta": 2.0}, "Extra inputs are not permitted"),
    ],
)
def test_bad_params_are_rejected_with_a_named_reason(kwargs: dict, message: str) -> None:
    with pytest.raises(ValidationError, match=message):
        PlasParams(**kwargs)


def test_params_are_frozen() -> None:
    with pytest.raises(ValidationError):
        P.starvation_beta = 3.0  # type: ignore[misc]


@pytest.mark.parametrize(
    ("service", "level"),
    [(0, 0), (2047, 0), (2048, 1), (8191, 1), (8192, 2), (32767, 2), (32768, 3), (10**9, 3)],
)
def test_arrival_level_buckets_program_service(service: int, level: int) -> None:
    assert arrival_level(service, P) == level


@pytest.mark.parametrize(
    ("level", "budget", "quantum"),
    [(0, 8192, 2048), (1, 8192, 1024), (2, 8192, 512), (3, 8192, 256), (7, 8192, 256),
     (-1, 8192, 2048), (0, 1000, 1000), (3, 100, 100)],
)
def test_level_quantum_is_clamped_and_capped_by_the_step_budget(
    level: int, budget: int, quantum: int
) -> None:
    assert level_quantum_tokens(level, P, budget) == quantum


def test_new_call_starts_at_its_programs_level_with_that_levels_quantum() -> None:
    call = new_call(PlasProgram(service_tokens=9000), P, BUDGET)
    assert (call.level, call.quantum_left_tokens) == (2, 512)
    assert call.program_service_at_arrival_tokens == 9000
    assert (call.service_tokens, call.wait_tokens) == (0, 0)


@pytest.mark.parametrize(
    ("level", "left", "scheduled", "remaining", "want_level", "want_left"),
    [
        (0, 2048, 2048, 10, 1, 1024),   # full quantum used, work left -> demote
        (0, 2048, 2048, 0, 0, 0),       # full quantum, nothing left -> stay
        (0, 2048, 1000, 500, 0, 1048),  # partial chunk (budget-limited) -> stay
        (0, 5, 5, 1, 1, 1024),          # decode tokens exhaust the quantum -> demote
        (3, 256, 256, 100, 3, 256),     # last level stays, quantum refilled
        (1, 0, 1024, 1, 2, 512),        # empty quantum is refilled before charging
    ],
)
def test_on_scheduled_charges_and_demotes_when_the_quantum_is_used(
    level: int, left: int, scheduled: int, remaining: int, want_level: int, want_left: int
) -> None:
    call = PlasCall(level=level, quantum_left_tokens=left, service_tokens=7)
    after = on_scheduled(call, scheduled, remaining, P, BUDGET)
    assert (after.level, after.quantum_left_tokens) == (want_level, want_left)
    assert after.service_tokens == 7 + scheduled


def test_step_cap_is_the_remaining_quantum_and_never_zero() -> None:
    assert step_token_cap(PlasCall(level=1, quantum_left_tokens=300), P, BUDGET) == 300
    assert step_token_cap(PlasCall(level=1, quantum_left_tokens=0), P, BUDGET) == 1024
    assert step_token_cap(PlasCall(level=0, quantum_left_tokens=2048), P, 512) == 512


def test_budget_capped_step_demotes_at_the_cap() -> None:
    # quantum 2048 but only 512 tokens per step: using the whole cap with work left demotes.
    call = PlasCall(level=0, quantum_left_tokens=2048)
    assert on_scheduled(call, 512, 100, P, 512).level == 1


@pytest.mark.parametrize(
    ("level", "call_service", "call_wait", "prog_service", "prog_wait", "promoted"),
    [
        (2, 100, 100, 900, 1900, True),    # 2000 / 1000 = 2.0 >= 2.0
        (2, 100, 100, 1000, 1900, False),  # 2000 / 1100 < 2.0
        (0, 1, 1000, 0, 0, False),         # already at level 0
        (3, 0, 5000, 0, 5000, False),      # no service yet: undefined ratio
        (1, 0, 4000, 2000, 0, True),       # program service alone counts
    ],
)
def test_anti_starvation_ratio(
    level: int, call_service: int, call_wait: int, prog_service: int, prog_wait: int,
    promoted: bool,
) -> None:
    call = PlasCall(level=level, quantum_left_tokens=1, service_tokens=call_service,
                    wait_tokens=call_wait)
    assert should_promote(call, PlasProgram(prog_service, prog_wait), P) is promoted


def test_promote_moves_to_level_zero_and_resets_call_counters() -> None:
    call = PlasCall(level=3, quantum_left_tokens=3, service_tokens=50, wait_tokens=900,
                    program_service_at_arrival_tokens=40000)
    after = promote(call, P, BUDGET)
    assert after == PlasCall(level=0, quantum_left_tokens=2048, service_tokens=0, wait_tokens=0,
                             program_service_at_arrival_tokens=40000)


def test_finished_call_updates_program_service_without_double_counting_parallel_calls() -> None:
    program = PlasProgram(service_tokens=1000, wait_tokens=10)
    a = PlasCall(level=0, quantum_left_tokens=0, service_tokens=500, wait_tokens=5,
                 program_service_at_arrival_tokens=1000)
    b = PlasCall(level=0, quantum_left_tokens=0, service_tokens=300, wait_tokens=7,
                 program_service_at_arrival_tokens=1000)
    after_a = on_call_finished(program, a)
    assert after_a == PlasProgram(service_tokens=1500, wait_tokens=15)
    assert on_call_finished(after_a, b) == PlasProgram(service_tokens=1500, wait_tokens=22)


def test_wait_accrues() -> None:
    assert accrue_wait(PlasCall(level=1, quantum_left_tokens=1, wait_tokens=3), 40).wait_tokens == 43


def test_victim_is_max_of_level_then_blocks_then_arrival() -> None:
    running = {
        "old-big-l1": (PlasCall(level=1, quantum_left_tokens=1), 90, 1.0),
        "new-small-l2": (PlasCall(level=2, quantum_left_tokens=1), 3, 5.0),
        "new-big-l2": (PlasCall(level=2, quantum_left_tokens=1), 10, 4.0),
        "newest-big-l2": (PlasCall(level=2, quantum_left_tokens=1), 10, 6.0),
    }
    order = sorted(running, key=lambda k: victim_key(*running[k]), reverse=True)
    assert order == ["newest-big-l2", "new-big-l2", "new-small-l2", "old-big-l1"]


def test_running_order_is_level_then_arrival() -> None:
    calls = {"a": (PlasCall(level=1, quantum_left_tokens=1), 1.0),
             "b": (PlasCall(level=0, quantum_left_tokens=1), 3.0),
             "c": (PlasCall(level=0, quantum_left_tokens=1), 2.0)}
    assert sorted(calls, key=lambda k: running_order_key(*calls[k])) == ["c", "b", "a"]


# ----------------------------------------------------------------------------- properties
steps = st.lists(
    st.tuples(st.integers(1, 4096), st.integers(0, 100_000), st.integers(0, 10_000)),
    min_size=1, max_size=60,
)


@given(service=st.integers(0, 10**7), budget=st.integers(1, 16384), seq=steps)
def test_levels_stay_in_range_and_service_only_grows(service: int, budget: int, seq) -> None:
    call = new_call(PlasProgram(service_tokens=service), P, budget)
    for wanted, remaining, others in seq:
        cap = step_token_cap(call, P, budget)
        scheduled = min(wanted, cap)
        before = call
        call = accrue_wait(on_scheduled(call, scheduled, remaining, P, budget), others)
        assert 0 <= call.level <= P.max_level
        assert call.level in (before.level, min(before.level + 1, P.max_level))
        assert call.service_tokens == before.service_tokens + scheduled
        assert 0 <= call.quantum_left_tokens <= max(P.level_quanta_tokens)
        if should_promote(call, PlasProgram(service, 0), P):
            call = promote(call, P, budget)
            assert call.level == 0 and call.wait_tokens == 0


@given(a=st.integers(0, 10**7), b=st.integers(0, 10**7))
def test_arrival_level_is_monotone_in_program_service(a: int, b: int) -> None:
    lo, hi = sorted((a, b))
    assert arrival_level(lo, P) <= arrival_level(hi, P)


@given(
    call_service=st.integers(0, 10**6), call_wait=st.integers(0, 10**6),
    prog_service=st.integers(0, 10**6), prog_wait=st.integers(0, 10**6),
    extra_wait=st.integers(0, 10**6),
)
def test_more_waiting_never_undoes_a_promotion(
    call_service: int, call_wait: int, prog_service: int, prog_wait: int, extra_wait: int
) -> None:
    call = PlasCall(level=2, quantum_left_tokens=1, service_tokens=call_service,
                    wait_tokens=call_wait)
    program = PlasProgram(prog_service, prog_wait)
    if should_promote(call, program, P):
        assert should_promote(accrue_wait(call, extra_wait), program, P)


@given(seq=st.lists(st.tuples(st.integers(0, 5000), st.integers(0, 100)), max_size=30))
def test_program_service_is_non_decreasing(seq) -> None:
    program = PlasProgram()
    for service, wait in seq:
        call = PlasCall(level=0, quantum_left_tokens=0, service_tokens=service, wait_tokens=wait,
                        program_service_at_arrival_tokens=program.service_tokens)
        after = on_call_finished(program, call)
        assert after.service_tokens == program.service_tokens + service
        assert after.wait_tokens == program.wait_tokens + wait
        program = after
