"""ThunderAgent's pure decisions (``mars_openhands.policy.thunderagent``), table-driven."""

from __future__ import annotations

import doctest

import pytest

from mars_openhands.policy import thunderagent as ta
from mars_openhands.policy.params import parse_scheduler_params
from mars_openhands.policy.thunderagent import (
    PausedProgramView,
    ProgramView,
    ThunderAgentParams,
    acting_decay,
    can_admit_new_program,
    remaining_capacity_tokens,
    select_pauses,
    select_resumes,
)

NO_BUFFER = ThunderAgentParams(buffer_per_program_tokens=0)


def test_docstring_examples() -> None:
    failures, tried = doctest.testmod(ta)
    assert tried > 0 and failures == 0


def test_defaults_are_the_papers_and_the_public_codes() -> None:
    p = parse_scheduler_params({}).thunderagent
    assert (p.scheduler_interval_s, p.acting_token_weight, p.buffer_per_program_tokens,
            p.max_wait_s, p.acting_decay_half_life_s, p.pin_acting_kv) == (5.0, 1.0, 100, 1800.0, 1.0, True)
    with pytest.raises(ValueError, match="mars.thunderagent.max_wait"):
        parse_scheduler_params({"thunderagent": {"max_wait": 1}})


@pytest.mark.parametrize(("acting_s", "half_life_s", "weight"), [
    (0.0, 1.0, 1.0), (1.0, 1.0, 0.5), (5.0, 1.0, 2.0 ** -5), (2.0, 2.0, 0.5), (9.0, None, 1.0),
])
def test_acting_tokens_decay_exponentially_in_tool_time(acting_s, half_life_s, weight) -> None:
    p = ThunderAgentParams(acting_decay_half_life_s=half_life_s)
    assert acting_decay(acting_s, p) == pytest.approx(weight)


def test_capacity_counts_reasoning_once_acting_by_weight_and_a_buffer_per_program() -> None:
    views = [ProgramView("r", 1000, True), ProgramView("a", 1000, False, acting_s=2.0)]
    weighted = ThunderAgentParams(acting_token_weight=0.5)
    assert remaining_capacity_tokens(3000, views, weighted) == 3000 - 1500 - 200
    # The resume's view: decay instead of the weight (the router applies no weight there).
    assert remaining_capacity_tokens(3000, views, weighted, with_decay=True) == 3000 - 1250 - 200
    assert remaining_capacity_tokens(100, views, weighted) < 0  # oversubscribed: negative


@pytest.mark.parametrize(("tokens", "remaining", "has_paused", "admit"), [
    (900, 1000, False, True), (901, 1000, False, False), (1, 10**6, True, False),
])
def test_new_program_admission(tokens, remaining, has_paused, admit) -> None:
    assert can_admit_new_program(tokens, remaining, has_paused, ThunderAgentParams()) is admit


def test_acting_programs_are_paused_smallest_first_before_any_reasoning_one_is_marked() -> None:
    views = [ProgramView("r-small", 50, True), ProgramView("a-big", 400, False),
             ProgramView("a-small", 100, False), ProgramView("a-mid", 200, False)]
    # 750 tokens in a 600-token pool: 150 over; the smallest ACTING program alone frees 100.
    assert select_pauses(views, 600, 0, NO_BUFFER) == (["a-small", "a-mid"], [])
    assert select_pauses(views, 750, 0, NO_BUFFER) == ([], [])            # fits exactly
    # Only REASONING left: the smallest is marked, until marked tokens cover the overflow.
    reasoning = [ProgramView("r1", 300, True), ProgramView("r2", 100, True), ProgramView("r3", 200, True)]
    assert select_pauses(reasoning, 350, 0, NO_BUFFER) == ([], ["r2", "r3"])
    assert select_pauses(reasoning, 350, 250, NO_BUFFER) == ([], [])      # already marked enough
    marked = [ProgramView("r1", 300, True), ProgramView("r2", 100, True, is_marked=True)]
    assert select_pauses(marked, 100, 100, NO_BUFFER) == ([], ["r1"])      # never marked twice


def test_resume_takes_pending_requests_first_then_new_then_acting_each_smallest_first() -> None:
    g_r, g_new, g_act = ta.RESUME_GROUP_REASONING, ta.RESUME_GROUP_NEW, ta.RESUME_GROUP_ACTING
    pool = [PausedProgramView("act-tiny", 10, 10, g_act), PausedProgramView("new-small", 100, 100, g_new),
            PausedProgramView("r-big", 600, 600, g_r), PausedProgramView("r-small", 200, 200, g_r)]
    assert select_resumes(pool, 10_000, NO_BUFFER) == ["r-big", "r-small", "new-small", "act-tiny"]
    # Room for 300: r-small (200) first, r-big skipped, new-small (100) fills the rest.
    assert select_resumes(pool, 300, NO_BUFFER) == ["r-small", "new-small"]
    # Sorted by the context at pause time, sized by the context now (router PausedInfo vs Program).
    grown = [PausedProgramView("a", 500, 100, g_r), PausedProgramView("b", 200, 150, g_r)]
    assert select_resumes(grown, 550, NO_BUFFER) == ["a"]
    # A full backend (room <= one buffer) resumes nothing.
    assert select_resumes(pool, 100, ThunderAgentParams()) == []
