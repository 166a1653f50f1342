"""KV retention by the value model (design.md §4 last paragraph) on a real vLLM scheduler.

These run MarsScheduler with residency off (``mars.residency.enabled = False``): residency pins a
resident session's KV itself (tests/unit/engine/test_mars_residency.py); the value model decides
retention when residency is off, and is what InferCept/Continuum-style TTLs build on."""

from __future__ import annotations

import pytest

pytest.importorskip("vllm")

from vllm.v1.core.sched.scheduler import Scheduler  # noqa: E402
from vllm.v1.request import RequestStatus  # noqa: E402

from mars_openhands.engine import MarsScheduler  # noqa: E402
from mars_openhands.stream.events import SessionEnd, ToolEnd, ToolStart, now_stamps  # noqa: E402
from mars_openhands.stream.transport import ListSink  # noqa: E402
from tests.unit.engine.harness import Harness  # noqa: E402

TURN0 = {"mars_turn": 0, "mars_last_step": 0}
NO_RESIDENCY = {"residency": {"enabled": False}}


def value_model_harness(cls=MarsScheduler, mars: dict | None = None, **kwargs) -> Harness:
    """A harness whose MarsScheduler retains by the value model (residency off)."""
    if cls is MarsScheduler:
        mars = {**NO_RESIDENCY, **(mars or {})}
    return Harness(cls, mars=mars, **kwargs)


def _finish_turn0(h: Harness, sid: str = "s1", prompt_tokens: int = 200):
    r = h.add(h.make_request(sid, h.tokens(prompt_tokens), 4, TURN0))
    h.run_until_finished(r.request_id)
    return r


def _churn(h: Harness, num_tokens: int, times: int) -> None:
    """Run unrelated one-turn requests that push older blocks out of the prefix-cache LRU."""
    for _ in range(times):
        x = h.add(h.make_request(None, h.tokens(num_tokens), 2))
        h.run_until_finished(x.request_id)


@pytest.mark.parametrize(("cls", "expect_hit"), [(MarsScheduler, True), (Scheduler, False)])
def test_retained_kv_is_reused_by_next_turn(cls, expect_hit: bool) -> None:
    h = value_model_harness(cls, num_blocks=40)
    r0 = _finish_turn0(h)
    _churn(h, 400, times=2)  # 26 blocks each: LRU evicts s1's blocks unless pinned
    r1 = h.add(h.next_turn(r0, 20, 4, {"mars_turn": 1}))
    res = h.step(0.01)
    hit = r1.num_computed_tokens - res.num_scheduled_tokens[r1.request_id]
    if expect_hit:
        assert hit >= 192  # 200 prompt + 3 computed outputs: 12 full blocks
        assert "s1" not in h.scheduler.retained  # released at resume
    else:
        assert hit < 192
    h.run_until_done()
    h.assert_no_leaks()


def test_released_on_expiry() -> None:
    h = value_model_harness(num_blocks=40)
    sink = ListSink()
    h.scheduler.set_telemetry_sink(sink)
    _finish_turn0(h)
    entry = h.scheduler.retained["s1"]
    assert entry.num_blocks == 12 and h.assert_no_leaks()["retained"] == 12
    h.clock.advance(entry.expires_s - h.clock() - 0.001)
    h.step()
    assert "s1" in h.scheduler.retained  # not yet
    h.clock.advance(0.01)
    h.step()
    assert "s1" not in h.scheduler.retained
    assert [e.reason for e in sink.events if e.kind == "kv_released"] == ["expired"]
    assert h.assert_no_leaks()["retained"] == 0


def test_not_expired_while_next_turn_waits() -> None:
    h = value_model_harness(num_blocks=40, max_num_seqs=1)
    r0 = _finish_turn0(h)
    blocker = h.add(h.make_request(None, h.tokens(30), 200))  # occupies the only running slot
    h.step()
    h.add(h.next_turn(r0, 10, 2, {"mars_turn": 1}))
    h.clock.advance(100.0)
    h.step()
    assert "s1" in h.scheduler.retained  # expired, but its next turn waits
    h.run_until_done()
    assert blocker.is_finished() and "s1" not in h.scheduler.retained
    h.assert_no_leaks()


def test_released_on_session_end_event() -> None:
    h = value_model_harness(num_blocks=40)
    _finish_turn0(h)
    h.scheduler.post_event(SessionEnd(**now_stamps(), session_id="s1", source="agent"))
    h.step()
    assert not h.scheduler.retained and "s1" not in h.scheduler.sessions
    assert h.assert_no_leaks()["retained"] == 0


def _tool_event(cls, sid: str, tool: str, **kw):
    return cls(**now_stamps(), session_id=sid, source="agent", tool_name=tool, tool_call_id="c1", **kw)


def test_tool_start_extends_for_slow_tool_and_cuts_for_too_slow_tool() -> None:
    h = value_model_harness(num_blocks=64, mars={"retention": {"min_tool_samples": 10}})
    est = h.scheduler.tool_durations
    for _ in range(50):
        est.observe("ls", 0.2)
    _finish_turn0(h, "a")
    _finish_turn0(h, "b")
    now = h.clock()
    assert h.scheduler.retained["a"].expires_s - now == pytest.approx(0.2, abs=0.05)
    for _ in range(20):
        est.observe("pytest", 20.0)
        est.observe("build", 500.0)  # beyond max_ttl_s = 60: never worth waiting for
    h.scheduler.on_stream_event(_tool_event(ToolStart, "a", "pytest"), now)
    h.scheduler.on_stream_event(_tool_event(ToolStart, "b", "build"), now)
    assert h.scheduler.retained["a"].expires_s - now == pytest.approx(20.0)
    assert h.scheduler.retained["a"].reason == "tool_start:extend"
    assert "b" not in h.scheduler.retained  # cut
    h.clock.advance(5.0)
    h.step()
    assert "a" in h.scheduler.retained  # the provisional 0.2 s TTL would have expired
    h.scheduler.on_stream_event(_tool_event(ToolEnd, "a", "pytest", duration_s=5.0), h.clock())
    assert h.scheduler.tool_durations.num_samples("pytest") == 21
    h.clock.advance(16.0)
    h.step()
    assert "a" not in h.scheduler.retained
    h.assert_no_leaks()


def test_reclaimed_before_any_running_request_is_preempted() -> None:
    h = value_model_harness(num_blocks=40, max_num_batched_tokens=512)
    sink = ListSink()
    h.scheduler.set_telemetry_sink(sink)
    _finish_turn0(h, "a", 200)  # 12 blocks pinned
    _finish_turn0(h, "b", 100)  # 6 blocks pinned
    runner = h.add(h.make_request(None, h.tokens(64), 40))
    h.step()
    big = h.add(h.make_request(None, h.tokens(400), 4))  # 26 blocks: needs the pinned ones
    results = h.run_until_done()
    assert not any(r.preempted_ids for r in results)
    assert runner.is_finished() and big.is_finished()
    reasons = [e.reason for e in sink.events if e.kind == "kv_released"]
    assert "reclaimed" in reasons and h.scheduler.num_reclaimed_blocks >= 6
    h.assert_no_leaks()


def test_gap_inferred_tool_duration_without_events() -> None:
    h = value_model_harness(num_blocks=64)
    r0 = _finish_turn0(h)
    h.clock.advance(3.0)
    r1 = h.add(h.next_turn(r0, 10, 2, {"mars_turn": 1, "mars_prev_tool": "bash"}))
    assert h.scheduler.tool_durations.num_samples("bash") == 1
    assert h.scheduler.tool_durations.all_tools.mean_s == pytest.approx(3.0, abs=0.05)
    h.run_until_finished(r1.request_id)
    h.add(h.next_turn(r1, 10, 2, {"mars_turn": 2, "mars_prev_tool": "bash", "mars_prev_tool_s": 1.5}))
    assert h.scheduler.tool_durations.cdf_for("bash").num_samples == 2
    h.run_until_done()
    h.assert_no_leaks()


def test_last_step_is_not_retained() -> None:
    h = value_model_harness(num_blocks=40)
    r = h.add(h.make_request("s1", h.tokens(200), 4, {"mars_turn": 3, "mars_last_step": 1}))
    h.run_until_finished(r.request_id)
    assert not h.scheduler.retained
    h.assert_no_leaks()


def test_retention_disabled_by_params() -> None:
    h = value_model_harness(num_blocks=40, mars={"retention": {"enabled": False}})
    _finish_turn0(h)
    assert not h.scheduler.retained
    h.assert_no_leaks()


def test_shutdown_releases_everything() -> None:
    h = value_model_harness(num_blocks=40)
    _finish_turn0(h)
    h.scheduler.shutdown()
    assert not h.scheduler.retained
    h.assert_no_leaks()


def test_admission_reclaims_only_entries_not_worth_their_ttl() -> None:
    h = value_model_harness(num_blocks=40)
    _finish_turn0(h, "a", 200)  # 12 blocks pinned, 27 free
    entry = h.scheduler.retained["a"]
    entry.value_s = 100.0  # worth far more than holding 12 blocks for 2 s at any price
    busy = h.add(h.make_request("c", h.tokens(40), 60))  # keeps the engine running (not stuck)
    h.step(0.01)
    big = h.add(h.make_request(None, h.tokens(440), 2))  # 28 blocks: does not fit next to "a"
    for _ in range(3):
        assert big.request_id not in h.step(0.01).num_scheduled_tokens
    assert "a" in h.scheduler.retained
    entry.value_s = 1e-6  # now cheaper than its remaining TTL at full-pressure price
    assert big.request_id in h.step(0.01).num_scheduled_tokens
    assert "a" not in h.scheduler.retained
    h.run_until_finished(busy.request_id)
    h.run_until_done()
    h.assert_no_leaks()


def test_idle_engine_reclaims_any_entry_rather_than_stall() -> None:
    """Nothing running and a waiting turn that does not fit: keeping a valuable entry would leave
    the GPU idle (and deadlock when every waiting turn's session holds retained KV)."""
    h = value_model_harness(num_blocks=40)
    _finish_turn0(h, "a", 200)  # 12 blocks pinned, 27 free
    h.scheduler.retained["a"].value_s = 100.0
    big = h.add(h.make_request(None, h.tokens(440), 2))  # 28 blocks
    assert big.request_id in h.step(0.01).num_scheduled_tokens
    assert "a" not in h.scheduler.retained
    h.run_until_done()
    h.assert_no_leaks()


@pytest.mark.parametrize(("older_requester", "reclaimed"), [(True, True), (False, False)])
def test_reclaim_follows_session_age(older_requester: bool, reclaimed: bool) -> None:
    """session_fifo: a retained entry is taken only for an *older* session's turn; a younger
    session's turn waits (here: while another request keeps the engine busy)."""
    h = value_model_harness(num_blocks=40)
    if older_requester:
        old = h.add(h.make_request("old", h.tokens(20), 2, {"mars_turn": 0}))
        h.run_until_finished(old.request_id)
        h.clock.advance(0.5)
    _finish_turn0(h, "a", 200)  # 12 blocks pinned
    h.scheduler.retained["a"].value_s = 100.0
    busy = h.add(h.make_request("c", h.tokens(40), 60))
    h.step(0.01)
    prompt = h.tokens(440)  # 28 blocks: does not fit next to "a"
    if older_requester:
        turn = h.add(h.make_request("old", prompt, 2, {"mars_turn": 1}))
    else:
        turn = h.add(h.make_request("young", prompt, 2, {"mars_turn": 0}))
    assert (turn.request_id in h.step(0.01).num_scheduled_tokens) == reclaimed
    assert ("a" in h.scheduler.retained) != reclaimed
    h.run_until_finished(busy.request_id)
    h.run_until_done()
    h.assert_no_leaks()


# ---------------------------------------------------------------- issue 16, kind 3: honesty
def test_each_entry_is_released_within_a_step_of_its_expiry_whatever_others_do() -> None:
    """A's entry expires while A's next turn waits (kept); B's expires 0.4 s later and must go at
    the first step after that, not when A's hold is re-checked (main: a second later)."""
    h = value_model_harness(num_blocks=64, max_num_seqs=1)
    ra = _finish_turn0(h, "a", 100)
    h.clock.advance(0.4)
    _finish_turn0(h, "b", 100)
    a, b = h.scheduler.retained["a"], h.scheduler.retained["b"]
    assert b.expires_s == pytest.approx(a.expires_s + 0.4, abs=0.05)
    blocker = h.add(h.make_request(None, h.tokens(30), 400))  # holds the only running slot
    h.step()
    h.add(h.next_turn(ra, 10, 2, {"mars_turn": 1}))  # A's next turn waits behind it
    h.clock.advance(a.expires_s - h.clock() + 0.01)
    h.step()
    assert "a" in h.scheduler.retained and "b" in h.scheduler.retained
    h.clock.advance(b.expires_s - h.clock() + 0.01)
    h.step()
    assert "b" not in h.scheduler.retained  # its own expiry, one step
    assert "a" in h.scheduler.retained  # still held: its next turn waits
    h.run_until_done()
    assert blocker.is_finished() and h.scheduler.retained["a"].turn == 1  # turn 1's own KV
    h.assert_no_leaks()


def test_a_hit_counts_the_blocks_the_next_turn_actually_reused() -> None:
    """The next turn keeps only the first half of the retained context (the agent rewrote the
    rest): the release is "resumed" but its hit is the 6 reused blocks of 12, not 12."""
    h = value_model_harness(num_blocks=64)
    sink = ListSink()
    h.scheduler.set_telemetry_sink(sink)
    r0 = _finish_turn0(h, "s1", 200)
    assert h.scheduler.retained["s1"].num_blocks == 12
    kept = list(r0.prompt_token_ids)[:96]  # 6 full blocks of 16
    r1 = h.add(h.make_request("s1", kept + h.tokens(150), 4, {"mars_turn": 1}))
    h.run_until_finished(r1.request_id)
    released = [e for e in sink.events if e.kind == "kv_released"]
    assert [(e.reason, e.num_blocks, e.num_reused_blocks) for e in released] == [("resumed", 12, 6)]
    assert (h.scheduler.num_reused_blocks, h.scheduler.num_released_blocks) == (6, 12)
    h.assert_no_leaks()


def test_the_value_model_stops_retaining_a_session_that_does_not_reuse_its_kv() -> None:
    """Measured reuse feeds the value model: a session whose next turn kept none of its context
    is not retained at its next turn end; once its turns reuse their context again it is."""
    h = value_model_harness(num_blocks=96)
    r0 = _finish_turn0(h, "s1", 200)
    assert "s1" in h.scheduler.retained
    h.clock.advance(0.5)  # the tool call between the turns
    r1 = h.add(h.make_request("s1", h.tokens(200), 4, {"mars_turn": 1}))  # nothing kept
    h.run_until_finished(r1.request_id)
    session = h.scheduler.sessions["s1"]
    assert session.reuse_fraction_ema == 0.0
    assert "s1" not in h.scheduler.retained  # nothing worth keeping: the gain is 0
    h.clock.advance(0.5)
    r2 = h.add(h.next_turn(r1, 20, 4, {"mars_turn": 2}))  # keeps all of turn 1's context
    h.run_until_finished(r2.request_id)
    assert session.reuse_fraction_ema == pytest.approx(0.5)
    assert "s1" in h.scheduler.retained
    h.run_until_done()
    h.assert_no_leaks()
    del r0


def test_kv_of_a_turn_aborted_after_its_final_token_is_not_kept_to_ttl() -> None:
    h = value_model_harness(num_blocks=40)
    sink = ListSink()
    h.scheduler.set_telemetry_sink(sink)
    r0 = _finish_turn0(h)
    assert "s1" in h.scheduler.retained
    h.scheduler.finish_requests([r0.request_id], RequestStatus.FINISHED_ABORTED)  # client gone
    assert "s1" not in h.scheduler.retained
    assert [e.reason for e in sink.events if e.kind == "kv_released"] == ["aborted"]
    assert h.assert_no_leaks()["retained"] == 0
