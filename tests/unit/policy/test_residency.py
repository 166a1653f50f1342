"""plan_residency: the resident set is the highest-priority sessions whose KV fits; displace_value_s:
an idle resident is displaced only when its idle time left likely outlasts re-prefilling it."""

from __future__ import annotations

import pytest

from mars_openhands.policy.estimators import EmpiricalCdf
from mars_openhands.policy.residency import (
    RESIDENT_FIRST,
    HostReload,
    SessionDemand,
    displace_value_s,
    plan_residency,
    response_ratio_priority,
    resume_cost_s,
)
from mars_openhands.policy.session import SessionState


def s(sid: str, prio: float, blocks: int, *, resident: bool = False, busy: bool = False,
      held: bool = False, can_suspend: bool = True) -> SessionDemand:
    return SessionDemand(sid, (prio,), blocks, is_resident=resident, is_busy=busy, is_held=held,
                         can_suspend=can_suspend)


def test_busy_sessions_are_kept_even_over_budget() -> None:
    plan = plan_residency([s("a", 0, 80, resident=True, busy=True),
                           s("b", 1, 50, resident=True, busy=True)], budget_blocks=100)
    assert plan.suspend == () and plan.activate == () and plan.used_blocks == 130


def test_idle_residents_that_no_longer_fit_are_suspended_youngest_first() -> None:
    plan = plan_residency([s("old", 0, 60, resident=True, busy=True),
                           s("mid", 1, 30, resident=True),
                           s("young", 2, 30, resident=True)], budget_blocks=100)
    assert plan.suspend == ("young",)
    assert plan.used_blocks == 90


def test_an_idle_resident_that_cannot_be_suspended_is_kept() -> None:
    plan = plan_residency([s("old", 0, 60, resident=True, busy=True),
                           s("young", 2, 60, resident=True, can_suspend=False)], budget_blocks=100)
    assert plan.suspend == () and plan.used_blocks == 120


def test_held_sessions_are_activated_in_priority_order_while_they_fit() -> None:
    plan = plan_residency([s("c", 3, 30, held=True), s("a", 1, 30, held=True),
                           s("b", 2, 30, held=True), s("d", 4, 30, held=True)], budget_blocks=100)
    assert plan.activate == ("a", "b", "c")
    assert plan.blocked == ("d",)


def test_no_bypass_a_small_younger_session_waits_behind_a_blocked_older_one() -> None:
    plan = plan_residency([s("run", 0, 70, resident=True, busy=True),
                           s("big", 1, 50, held=True), s("small", 2, 5, held=True)],
                          budget_blocks=100)
    assert plan.activate == ()
    assert plan.blocked == ("big", "small")


def test_a_blocked_head_displaces_younger_idle_residents_when_that_makes_it_fit() -> None:
    plan = plan_residency([s("run", 0, 40, resident=True, busy=True),
                           s("head", 1, 40, held=True),
                           s("y1", 2, 20, resident=True), s("y2", 3, 30, resident=True)],
                          budget_blocks=100)
    # 40 + 40 = 80: y2 (youngest, 30) must go; y1 (20) still fits beside the head.
    assert plan.activate == ("head",)
    assert plan.suspend == ("y2",)
    assert plan.used_blocks == 100


def test_a_blocked_head_does_not_displace_anyone_when_it_cannot_fit_anyway() -> None:
    plan = plan_residency([s("run", 0, 70, resident=True, busy=True),
                           s("head", 1, 50, held=True),
                           s("y1", 2, 20, resident=True)], budget_blocks=100)
    assert plan.activate == () and plan.suspend == ()
    assert plan.blocked == ("head",)


def test_older_idle_residents_are_not_displaced_for_a_younger_head() -> None:
    plan = plan_residency([s("old", 0, 60, resident=True),
                           s("head", 1, 50, held=True)], budget_blocks=100)
    assert plan.activate == () and plan.suspend == ()


def test_progress_a_session_larger_than_the_budget_runs_when_nothing_else_does() -> None:
    plan = plan_residency([s("huge", 0, 500, held=True), s("next", 1, 10, held=True)],
                          budget_blocks=100)
    assert plan.activate == ("huge",)
    assert plan.blocked == ("next",)


@pytest.mark.parametrize("budget", [0, 1, 50, 99, 100, 1000])
def test_kept_idle_and_activated_demand_never_exceeds_the_budget_beyond_busy(budget: int) -> None:
    sessions = [s("b0", 0, 30, resident=True, busy=True), s("i1", 1, 25, resident=True),
                s("h2", 2, 20, held=True), s("i3", 3, 15, resident=True), s("h4", 4, 10, held=True)]
    plan = plan_residency(sessions, budget)
    by_id = {x.session_id: x for x in sessions}
    idle_kept = [x for x in sessions if x.is_resident and not x.is_busy and x.session_id not in plan.suspend]
    extra = sum(x.demand_blocks for x in idle_kept) + sum(by_id[a].demand_blocks for a in plan.activate)
    assert 30 + extra == plan.used_blocks
    assert extra <= max(0, budget - 30)


def test_an_overdue_held_session_goes_first_and_is_activated_even_when_it_does_not_fit() -> None:
    def held(sid: str, prio: float, blocks: int, overdue: bool = False) -> SessionDemand:
        return SessionDemand(sid, (prio,), blocks, is_resident=False, is_held=True,
                             is_overdue=overdue)

    sessions = [s("old", 0, 60, resident=True, busy=True), held("head", 2, 50),
                held("late", 3, 30, overdue=True), s("young", 4, 20, resident=True)]
    plan = plan_residency(sessions, budget_blocks=100)
    assert plan.activate == ("late",)  # past the blocked head; the younger idle one makes room
    assert plan.suspend == ("young",) and plan.used_blocks == 90 and plan.blocked == ("head",)
    forced = plan_residency([s("old", 0, 90, resident=True, busy=True),
                             held("late", 3, 30, overdue=True)], budget_blocks=100)
    assert forced.activate == ("late",) and forced.used_blocks == 120  # over budget: forced


def test_progress_a_held_head_over_the_budget_runs_once_only_displaceable_residents_block_it() -> None:
    """Issue 16 kind 4: a preempted long request (held again, demand over the budget) behind
    finished sessions whose pinned KV may be displaced, with nothing busy, waited forever."""
    def idle(sid: str, prio: float, blocks: int, value_s: float) -> SessionDemand:
        return SessionDemand(sid, (prio,), blocks, is_resident=True, displace_value_s=value_s)

    sessions = [idle("a", 0, 99, 40.0), idle("b", 0, 99, 38.0), idle("c", 0, 99, 37.0),
                s("long", 0, 428, held=True), s("next", 1, 50, held=True)]
    plan = plan_residency(sessions, budget_blocks=371)
    assert plan.activate == ("long",) and set(plan.suspend) == {"a", "b", "c"}
    assert plan.blocked == ("next",)
    # Not while a session is busy (it will free room), nor past an older idle resident that may
    # not be displaced (its next turn is expected soon): the head waits.
    busy = plan_residency([*sessions, s("run", 2, 10, resident=True, busy=True)], 371)
    assert busy.activate == () and busy.suspend == ()
    kept = plan_residency([*sessions, idle("old", -1, 10, 0.0)], 371)
    assert kept.activate == () and kept.suspend == ()


# ---------------------------------------------------------------------- the value model (pure)
def test_output_reserve_tokens_estimate_prior_and_cap() -> None:
    from mars_openhands.policy.residency import output_reserve_tokens

    assert output_reserve_tokens(10, 25.7, 100, None) == 25  # the estimate, truncated
    assert output_reserve_tokens(10, None, 100, None) == 90  # the prior's rest
    assert output_reserve_tokens(300, None, 100, None) == 300  # outlived the prior: as many again
    assert output_reserve_tokens(10, 25.0, 100, 20) == 10  # never past max_tokens
    assert output_reserve_tokens(30, None, 100, 20) == 0


def _cdf(samples: list[float]) -> EmpiricalCdf:
    cdf = EmpiricalCdf()
    for d in samples:
        cdf.observe(d)
    return cdf


def _value(session: SessionState | None, now_s: float, cdfs: dict[str, EmpiricalCdf]) -> float:
    """displace_value_s of a 10-block resident with 2 busy sessions (cost 0.48 s)."""
    return displace_value_s(session, 10, 2, now_s, imminent_grace_s=1.0, tool_queue_wait_s=3.0,
                            tool_cdf=lambda tool: cdfs.get(tool or "", EmpiricalCdf()),
                            block_size=16, prefill_s_per_token=0.001)


COST = 10 * 16 * 0.001 * (1 + 2)  # 10 blocks re-prefilled, paid by it and 2 busy sessions


def test_displace_value_s_gain_minus_reload_cost() -> None:
    cdfs = {"bash": _cdf([13.0] * 10)}
    assert _value(None, 50.0, cdfs) == 0.0
    assert _value(SessionState("s"), 50.0, cdfs) == 0.0  # no finished turn yet
    running = SessionState("s", last_finish_s=40.0, pending_tool="bash", tool_started_s=45.0)
    assert _value(running, 50.0, cdfs) == pytest.approx(8.0 - COST)  # 13 s calls, 5 s in
    unknown = SessionState("s", last_finish_s=40.0, pending_tool="grep", tool_started_s=44.0)
    assert _value(unknown, 50.0, cdfs) == pytest.approx(6.0 - COST)  # no samples: as long again
    queued = SessionState("s", last_finish_s=40.0, tool_enqueued_s=49.0)
    assert _value(queued, 50.0, cdfs) == pytest.approx(0.0 + 2.0 - COST)  # the queue wait's rest
    ended = SessionState("s", last_finish_s=40.0, last_activity_s=49.5, tool_ended=True)
    assert _value(ended, 50.0, cdfs) == 0.0  # imminent
    assert _value(ended, 52.0, cdfs) == pytest.approx(2.5 - COST)  # late: as late again


HEAVY = [0.3] * 45 + [60.0] * 5
"""Nine calls in ten return in 0.3 s, one in ten runs 60 s: mean 6.27 s."""


def _running_for(elapsed_s: float) -> SessionState:
    return SessionState("s", last_finish_s=40.0, pending_tool="pytest", tool_started_s=50.0 - elapsed_s)


def test_a_call_that_usually_returns_before_its_reload_is_not_displaced_whatever_its_mean() -> None:
    # 0.1 s in, the mean remaining (~6.2 s) is far above the 0.48 s cost, but 9 in 10 calls end by 0.3 s
    assert _cdf(HEAVY).mean_remaining_s(0.1) > 10 * COST
    assert _value(_running_for(0.1), 50.0, {"pytest": _cdf(HEAVY)}) <= 0.0


def test_once_a_call_has_outlasted_the_short_ones_its_mean_remaining_counts() -> None:
    assert _value(_running_for(1.0), 50.0, {"pytest": _cdf(HEAVY)}) == pytest.approx(59.0 - COST)


def test_a_queue_wait_longer_than_the_cost_pays_for_the_displacement_on_its_own() -> None:
    # still waiting ~2.5 s for a tool worker: the call cannot return before the 0.48 s reload
    queued = SessionState("s", last_finish_s=40.0, pending_tool="pytest", tool_enqueued_s=49.5)
    value = _value(queued, 50.0, {"pytest": _cdf(HEAVY)})
    assert value == pytest.approx(_cdf(HEAVY).mean_remaining_s(0.0) + 2.5 - COST)


@pytest.mark.parametrize(("host", "num_host_blocks", "expected_s"), [
    (None, 10, COST),  # GPU KV only: all 10 blocks re-prefilled, paid by it and 2 busy sessions
    (HostReload(0.001, 1.0), 10, 0.01),  # all on the host, copies free for the others: 10 loads
    (HostReload(0.001, 1.5), 10, 0.01 * (1 + 2 * 0.5)),  # the busy steps run 1.5x while it loads
    (HostReload(0.001, 1.0), 6, 0.006 + 4 * 16 * 0.001 * 3),  # 4 blocks not stored: re-prefilled
    (HostReload(0.001, 1.0), 25, 0.01),  # never more than its demand
])
def test_resume_cost_s_loads_what_the_host_holds_and_re_prefills_the_rest(
        host: HostReload | None, num_host_blocks: int, expected_s: float) -> None:
    cost = resume_cost_s(10, 2, block_size=16, prefill_s_per_token=0.001, host=host,
                         num_host_blocks=num_host_blocks)
    assert cost == pytest.approx(expected_s)


def test_with_the_tier_a_call_that_usually_returns_before_a_re_prefill_is_worth_displacing() -> None:
    # 0.2 s in: on GPU KV only the 0.48 s re-prefill outlasts most calls (no displacement); the
    # 10 ms host load does not, and the long calls' mean remaining pays for it.
    session = _running_for(0.35)
    cdfs = {"pytest": _cdf([0.3] * 4 + [0.5] * 4 + [60.0] * 2)}
    assert _value(session, 50.0, cdfs) <= 0.0
    with_tier = displace_value_s(session, 10, 2, 50.0, imminent_grace_s=1.0, tool_queue_wait_s=3.0,
                                 tool_cdf=lambda tool: cdfs[tool or "pytest"], block_size=16,
                                 prefill_s_per_token=0.001, host=HostReload(0.001, 1.0), num_host_blocks=10)
    assert with_tier > 0.0


def test_response_ratio_puts_a_new_held_session_before_an_old_one_after_a_short_wait() -> None:
    # old was in the system 600 s when its turn was held (E = 660 s); new was held on arrival (E = 60 s).
    old = response_ratio_priority(now_s=603.0, first_arrival_s=0.0, held_since_s=600.0, prior_s=60.0)
    new = response_ratio_priority(now_s=603.0, first_arrival_s=601.0, held_since_s=601.0, prior_s=60.0)
    assert old[0] == pytest.approx(-663.0 / 660.0) and new[0] == pytest.approx(-62.0 / 60.0)
    assert new < old  # new's 2 s of waiting weigh more than old's 3 s
    old_later = response_ratio_priority(now_s=1003.0, first_arrival_s=0.0, held_since_s=600.0, prior_s=60.0)
    new_later = response_ratio_priority(now_s=1003.0, first_arrival_s=1000.0, held_since_s=1000.0, prior_s=60.0)
    assert old_later < new_later  # old held 403 s (ratio 1.61) goes before a new one held 3 s (1.05)


def test_past_waits_count_as_waiting_and_not_as_service() -> None:
    """count_past_waits: of two sessions of the same age held for the same time, the one that
    spent 300 s of its 600 s held earlier goes first (ratio (3 + 300 + 360) / 360 against
    663 / 660); with no past wait the key is the plain response ratio's."""
    plain = response_ratio_priority(603.0, 0.0, 600.0, 60.0)
    assert response_ratio_priority(603.0, 0.0, 600.0, 60.0, past_wait_s=0.0) == plain
    waited = response_ratio_priority(603.0, 0.0, 600.0, 60.0, past_wait_s=300.0)
    assert waited[0] == pytest.approx(-663.0 / 360.0)
    assert waited < plain
    # A new session held 2 s outranks the plain old one (62 / 60 > 663 / 660), not the one that waited.
    new = response_ratio_priority(603.0, 601.0, 601.0, 60.0)
    assert plain > new > waited


def test_response_ratio_never_starves_a_held_session_and_keeps_residents_first() -> None:
    old = [response_ratio_priority(t, 0.0, 3600.0, 60.0) for t in (3600.0, 7200.0, 14400.0)]
    assert old[0] > old[1] > old[2]  # its rank only rises while it waits
    fresh = response_ratio_priority(14400.0, 14400.0, 14400.0, 60.0)
    assert old[2] < fresh  # held 3 h with E = 1 h: ratio 4 against a new arrival's 1
    resident = response_ratio_priority(14400.0, 14000.0, None, 60.0)
    assert resident < old[2] and resident[0] == RESIDENT_FIRST


def test_plan_activates_a_fitting_new_session_past_an_old_one_only_by_response_ratio() -> None:
    busy = SessionDemand("mid", (RESIDENT_FIRST, 600.0), 21, is_resident=True, is_busy=True)
    old = SessionDemand("old", response_ratio_priority(603.0, 0.0, 600.0, 60.0), 27, is_resident=False, is_held=True)
    new = SessionDemand("new", response_ratio_priority(603.0, 601.0, 601.0, 60.0), 5, is_resident=False, is_held=True)
    plan = plan_residency([busy, old, new], budget_blocks=39)
    assert plan.activate == ("new",) and plan.blocked == ("old",)
    fifo = [SessionDemand("mid", (600.0,), 21, is_resident=True, is_busy=True),
            SessionDemand("old", (0.0,), 27, is_resident=False, is_held=True), SessionDemand("new", (601.0,), 5, is_resident=False, is_held=True)]
    assert plan_residency(fifo, budget_blocks=39).activate == ()  # strict FIFO: new waits behind old


def test_with_a_host_tier_an_older_held_session_displaces_a_younger_idle_resident() -> None:
    """Response-ratio order: residents rank first, so without a tier a younger idle resident whose
    displacement does not pay keeps its KV and the older held session waits; with a tier
    (``displaces_by_age``) its resume is a host load, and age decides as under fifo."""
    busy = SessionDemand("busy", (RESIDENT_FIRST, 100.0), 20, is_resident=True, is_busy=True)
    young = SessionDemand("young", (RESIDENT_FIRST, 500.0), 15, is_resident=True, displace_value_s=-1.0)
    pinned = SessionDemand("pinned", (RESIDENT_FIRST, 550.0), 5, is_resident=True, can_suspend=False)
    old = SessionDemand("old", response_ratio_priority(600.0, 0.0, 590.0, 60.0), 12,
                        is_resident=False, is_held=True)
    assert plan_residency([busy, young, pinned, old], budget_blocks=45).blocked == ("old",)
    plan = plan_residency([busy, young, pinned, old], budget_blocks=45, displaces_by_age=True)
    assert (plan.suspend, plan.activate, plan.used_blocks) == (("young",), ("old",), 37)
    # A held session younger than every idle resident displaces nothing by age.
    new = SessionDemand("new", response_ratio_priority(600.0, 590.0, 590.0, 60.0), 12,
                        is_resident=False, is_held=True)
    assert plan_residency([busy, young, pinned, new], budget_blocks=45, displaces_by_age=True).blocked == ("new",)
