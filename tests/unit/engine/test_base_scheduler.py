"""MarsBaseScheduler: params, metadata, telemetry, inbox, integrity (real vLLM scheduler)."""

from __future__ import annotations

import time

import pytest

pytest.importorskip("vllm")

from vllm.v1.core.sched.scheduler import Scheduler  # noqa: E402
from vllm.v1.request import RequestStatus  # noqa: E402

from mars_openhands.engine import MarsBaseScheduler, MarsScheduler  # noqa: E402
from mars_openhands.stream.events import SessionEnd, now_stamps  # noqa: E402
from mars_openhands.stream.transport import ListSink, ZmqEventPublisher  # noqa: E402
from tests.unit.engine.harness import Harness  # noqa: E402


def test_bad_params_fail_at_init_naming_the_key() -> None:
    with pytest.raises(ValueError, match=r"mars\.retention\.max_ttl_s"):
        Harness(MarsBaseScheduler, num_blocks=16, mars={"retention": {"max_ttl_s": -1}})
    with pytest.raises(ValueError, match=r"mars\.nope"):
        Harness(MarsBaseScheduler, num_blocks=16, mars={"nope": 1})


def test_base_keeps_stock_fcfs_behaviour() -> None:
    """Without overridden hooks the base schedules exactly like stock vLLM."""
    traces = []
    for cls in (Scheduler, MarsBaseScheduler):
        h = Harness(cls, num_blocks=24, max_num_batched_tokens=96, seed=3)
        for i in range(6):
            h.add(h.make_request(None, h.tokens(40 + 13 * i), 5 + i))
        traces.append([(sorted(r.num_scheduled_tokens.items()), sorted(r.preempted_ids))
                       for r in h.run_until_done()])
        h.assert_no_leaks()
    assert traces[0] == traces[1]


@pytest.mark.parametrize("extra", [{"mars_turn": -1}, {"mars_turn": "x"}, {"mars_last_step": 2},
                                   {"mars_prev_tool_s": -3}, {"mars_tunr": 1}, {"mars_turn": "3"},
                                   {"mars_turn": 1e300}, {"mars_side": "title"}])
def test_invalid_extras_finish_the_request_with_error(extra, caplog) -> None:
    h = Harness(MarsBaseScheduler, num_blocks=32)
    good = h.add(h.make_request("s1", h.tokens(20), 3, {"mars_turn": 0}))
    bad = h.add(h.make_request("s2", h.tokens(20), 3, extra))
    res = h.step()
    assert bad.request_id not in res.num_scheduled_tokens
    assert bad.request_id in res.finished_ids and bad.status == RequestStatus.FINISHED_ERROR
    assert "mars_" in caplog.text
    h.run_until_done()
    assert good.status == RequestStatus.FINISHED_LENGTH_CAPPED
    h.assert_no_leaks()


def test_session_service_and_turns_are_tracked() -> None:
    h = Harness(MarsBaseScheduler, num_blocks=64)
    r0 = h.add(h.make_request("s1", h.tokens(50), 4, {"mars_turn": 0}))
    h.run_until_finished(r0.request_id)
    s = h.scheduler.sessions["s1"]
    assert s.attained_service_tokens == 50 + 3  # prompt + 3 decode steps (first token from prefill)
    assert s.num_turns_finished == 1 and s.last_finish_s == h.clock() and not s.active_request_ids
    r1 = h.add(h.next_turn(r0, 10, 2, {"mars_turn": 1}))
    assert s.active_request_ids == {r1.request_id} and s.last_turn == 1 and s.last_finish_s is None
    h.run_until_done()
    h.assert_no_leaks()


def test_telemetry_events_of_one_request() -> None:
    h = Harness(MarsScheduler, num_blocks=64)
    sink = ListSink()
    h.scheduler.set_telemetry_sink(sink)
    r = h.add(h.make_request("s1", h.tokens(40), 3, {"mars_turn": 0}))
    h.run_until_done()
    kinds = [e.kind for e in sink.events if e.kind != "engine_step"]
    assert kinds == ["queued", "first_scheduled", "first_token", "kv_retained", "finished"]
    finished = sink.events[-1]
    assert finished.request_id == r.request_id and finished.num_blocks_retained == 2
    assert finished.num_blocks_freed == 1 and finished.session_id == "s1" and finished.turn == 0
    assert any(e.kind == "engine_step" for e in sink.events)
    h.assert_no_leaks()


def test_telemetry_preempted_event() -> None:
    h = Harness(MarsScheduler, num_blocks=14, max_num_batched_tokens=128,
                long_prefill_token_threshold=32)
    sink = ListSink()
    h.scheduler.set_telemetry_sink(sink)
    h.add(h.make_request(None, h.tokens(160), 4, request_id="P"))
    for i in range(2):
        h.add(h.make_request(None, h.tokens(32), 40, request_id=f"D{i}"))
    h.run_until_done()
    pre = [e for e in sink.events if e.kind == "preempted"]
    assert pre and all(e.request_id == "P" and e.num_blocks_freed > 0 for e in pre)
    h.assert_no_leaks()


def test_zmq_inbox_consumes_cpu_plane_events(tmp_path) -> None:
    addr = f"ipc://{tmp_path}/inbox"
    h = Harness(MarsScheduler, num_blocks=40, mars={"inbox_addr": addr})
    r = h.add(h.make_request("s1", h.tokens(100), 2, {"mars_turn": 0}))
    h.run_until_finished(r.request_id)
    assert "s1" in h.scheduler.retained
    with ZmqEventPublisher(addr, flush_interval_s=0.01) as pub:
        deadline = time.monotonic() + 30
        while "s1" in h.scheduler.retained and time.monotonic() < deadline:
            # The publisher drops batches until its connection is up (IMMEDIATE), so resend;
            # session_end is idempotent.
            pub.emit(SessionEnd(**now_stamps(), session_id="s1", source="gateway"))
            time.sleep(0.05)
            h.step()
    assert "s1" not in h.scheduler.retained
    h.scheduler.shutdown()
    h.assert_no_leaks()


def _wait_for(predicate, timeout_s: float = 30.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while not predicate() and time.monotonic() < deadline:
        time.sleep(0.02)
    return bool(predicate())


def test_an_idle_engine_is_woken_to_apply_a_session_end(tmp_path) -> None:
    """Issue 16 (soak on real engines): vLLM's engine loop sleeps while ``has_requests()`` is
    False, so a ``session_end`` that reaches an idle engine must wake it, and the woken step must
    release the session's retained KV; before, it stayed pinned until the next request."""
    addr = f"ipc://{tmp_path}/inbox"
    h = Harness(MarsScheduler, num_blocks=40, mars={"inbox_addr": addr})
    wakes: list[float] = []
    h.scheduler.set_engine_waker(lambda: wakes.append(time.monotonic()))
    r = h.add(h.make_request("s1", h.tokens(100), 2, {"mars_turn": 0}))
    h.run_until_done()
    h.step()  # the empty step vLLM runs after the last finish (has_finished_requests)
    assert h.scheduler.retained["s1"].request_id == r.request_id
    assert not h.scheduler.has_requests()  # idle: vLLM's loop would block here
    with ZmqEventPublisher(addr, flush_interval_s=0.01) as pub:
        # The publisher drops batches until its connection is up (IMMEDIATE): first send another
        # session's end until one arrives, then the one that matters, once.
        assert _wait_for(lambda: (pub.emit(SessionEnd(**now_stamps(), session_id="other",
                                                      source="gateway")), wakes)[1])
        time.sleep(0.1)
        while h.scheduler.has_requests():
            h.step()
        assert "s1" in h.scheduler.retained
        del wakes[:]
        pub.emit(SessionEnd(**now_stamps(), session_id="s1", source="gateway"))
        assert _wait_for(lambda: wakes, 10.0)
    assert h.scheduler.has_requests()  # the woken loop steps ...
    out = h.step().scheduler_output
    assert out.total_num_scheduled_tokens == 0 and "s1" not in h.scheduler.retained  # ... and releases
    assert not h.scheduler.has_requests()
    h.scheduler.shutdown()
    assert h.assert_no_leaks()["retained"] == 0


def test_an_idle_engine_is_woken_when_retained_kv_expires() -> None:
    h = Harness(MarsScheduler, num_blocks=40, mars={"residency": {"enabled": False}})
    wakes: list[float] = []
    h.scheduler.set_engine_waker(lambda: wakes.append(h.clock()))
    h.add(h.make_request("s1", h.tokens(200), 4, {"mars_turn": 0, "mars_last_step": 0}))
    h.run_until_done()
    h.step()  # the empty step vLLM runs after the last finish
    entry = h.scheduler.retained["s1"]
    assert not h.scheduler.has_requests() and not wakes
    h.clock.advance(entry.expires_s - h.clock() + 0.01)  # expired while nothing runs
    assert _wait_for(lambda: wakes, 5.0) and wakes[0] >= entry.expires_s
    assert h.scheduler.has_requests()
    sink = ListSink()
    h.scheduler.set_telemetry_sink(sink)
    h.step()
    assert "s1" not in h.scheduler.retained and not h.scheduler.has_requests()
    assert [e.reason for e in sink.events if e.kind == "kv_released"] == ["expired"]
    h.scheduler.shutdown()
    assert h.assert_no_leaks()["retained"] == 0


def test_the_last_engine_step_of_an_engine_going_idle_shows_it_idle() -> None:
    """The rate limit of ``engine_step`` must not leave a busy snapshot as an engine's last word:
    the step that finds it idle reports 0 used blocks (and what is still retained) at once."""
    h = Harness(MarsScheduler, num_blocks=40, mars={"residency": {"enabled": False},
                                                   "telemetry": {"engine_step_interval_ms": 60_000}})
    sink = ListSink()
    h.scheduler.set_telemetry_sink(sink)
    h.add(h.make_request("s1", h.tokens(200), 4, {"mars_turn": 0, "mars_last_step": 0}))
    h.add(h.make_request(None, h.tokens(50), 4))
    h.run_until_done()
    h.step()  # the empty step vLLM runs after the last finish (has_finished_requests)
    h.step()  # nothing changed since: no second idle snapshot
    steps = [e for e in sink.events if e.kind == "engine_step"]
    assert steps[0].num_used_blocks > 0
    retained = h.scheduler.retained["s1"].num_blocks
    assert [(e.num_used_blocks, e.num_retained_blocks, e.num_running, e.num_waiting)
            for e in steps[1:]] == [(0, retained, 0, 0)]


def test_idle_sessions_are_forgotten() -> None:
    h = Harness(MarsBaseScheduler, num_blocks=32, mars={"session_idle_timeout_s": 60})
    r = h.add(h.make_request("s1", h.tokens(20), 2, {"mars_turn": 0}))
    h.run_until_finished(r.request_id)
    h.clock.advance(30)
    h.step()
    assert "s1" in h.scheduler.sessions
    h.clock.advance(61)
    h.step()
    assert "s1" not in h.scheduler.sessions
    h.assert_no_leaks()


def test_abort_releases_nothing_retained_and_leaks_nothing() -> None:
    h = Harness(MarsScheduler, num_blocks=40)
    r = h.add(h.make_request("s1", h.tokens(100), 50, {"mars_turn": 0}))
    h.step()
    h.step()
    h.scheduler.finish_requests(r.request_id, RequestStatus.FINISHED_ABORTED)
    assert not h.scheduler.retained  # an aborted turn is not worth keeping
    h.assert_no_leaks()


@pytest.mark.parametrize("depth", [1, 2])
def test_multi_turn_sessions_with_async_pipelining(depth: int) -> None:
    """Our classes work with async scheduling on (depth 2) as well as off (CPU, depth 1)."""
    h = Harness(MarsScheduler, num_blocks=120, max_num_batched_tokens=256, pipeline_depth=depth)
    sessions = {f"s{i}": h.add(h.make_request(f"s{i}", h.tokens(150 + 40 * i), 6,
                                              {"mars_turn": 0})) for i in range(4)}
    hits = []
    for turn in range(1, 4):
        while any(not r.is_finished() for r in sessions.values()):
            h.step(0.01)
        h.assert_no_leaks()
        h.clock.advance(0.3)
        for sid, prev in list(sessions.items()):
            last = int(turn == 3)
            sessions[sid] = h.add(h.next_turn(prev, 30, 6, {"mars_turn": turn,
                                                            "mars_last_step": last}))
        res = h.step(0.01)
        hits += [sessions[sid].num_computed_tokens - n for sid in sessions
                 for rid, n in res.num_scheduled_tokens.items() if rid == sessions[sid].request_id]
    h.run_until_done()
    assert hits and min(hits) > 100  # every resumed turn hit its retained prefix
    assert not h.scheduler.retained  # final turns are not retained
    h.assert_no_leaks()


def test_a_side_request_is_not_the_sessions_next_turn() -> None:
    """A title request (``mars_side=1``) between two turns keeps the session's retained KV, turn
    count and tool phase; the next agent turn then resumes from the retained prefix."""
    h = Harness(MarsScheduler, num_blocks=64)
    r0 = h.add(h.make_request("s1", h.tokens(100), 4, {"mars_turn": 0}))
    h.run_until_finished(r0.request_id)
    assert "s1" in h.scheduler.retained
    s = h.scheduler.sessions["s1"]
    finished_s = s.last_finish_s
    side = h.add(h.make_request("s1", h.tokens(30), 3, {"mars_side": 1}))
    h.run_until_finished(side.request_id)
    assert "s1" in h.scheduler.retained  # neither released as "resumed" nor replaced
    assert s.num_turns_finished == 1 and s.last_finish_s == finished_s and s.last_turn == 0
    assert not s.active_request_ids
    r1 = h.add(h.next_turn(r0, 10, 2, {"mars_turn": 1}))
    res = h.step()
    assert r1.num_computed_tokens - res.num_scheduled_tokens[r1.request_id] >= 96  # a prefix hit
    assert "s1" not in h.scheduler.retained  # the agent's turn consumed it
    h.run_until_done()
    h.assert_no_leaks()


@pytest.mark.parametrize("extra", [{"mars_turn": 3}, {"mars_side": 1}])
def test_a_session_new_here_is_dated_back_by_its_age(extra: dict) -> None:
    """A session whose first request on this engine carries ``mars_session_age_s`` (it moved here)
    gets the first arrival it had where it started, whether that request is a turn or a side
    request; a later request's age does not move it, and a new session without one is now."""
    h = Harness(MarsScheduler, num_blocks=64)
    h.clock.advance(100.0)
    fresh = h.add(h.make_request("fresh", h.tokens(40), 2, {"mars_turn": 0}))
    moved = h.add(h.make_request("moved", h.tokens(40), 2, {**extra, "mars_session_age_s": 60.0}))
    first = h.scheduler.sessions["moved"].first_arrival_s
    assert first == pytest.approx(h.clock() - 60.0)
    assert h.scheduler.sessions["fresh"].first_arrival_s == h.clock()
    # The older session ranks first in MARS's session order, though its request came second.
    assert h.scheduler.waiting_key(moved, h.clock()) < h.scheduler.waiting_key(fresh, h.clock())
    h.run_until_done()
    again = h.add(h.make_request("moved", h.tokens(40), 2, {"mars_turn": 4, "mars_session_age_s": 1.0}))
    assert h.scheduler.sessions["moved"].first_arrival_s == first
    h.run_until_finished(again.request_id)
    h.assert_no_leaks()


def test_side_extra_is_checked() -> None:
    h = Harness(MarsBaseScheduler, num_blocks=32)
    bad = h.add(h.make_request("s1", h.tokens(20), 3, {"mars_side": 2}))
    res = h.step()
    assert bad.request_id in res.finished_ids and bad.status == RequestStatus.FINISHED_ERROR
    h.assert_no_leaks()


@pytest.mark.parametrize(("cls", "mars"), [
    (MarsScheduler, None),  # residency on: a later session's request is held outside vLLM
    (MarsScheduler, {"residency": {"enabled": False}}),
    (MarsBaseScheduler, {"window": {"enabled": True, "size": 1}}),  # overflow window
])
def test_every_aborted_request_gets_a_finished_event(cls, mars) -> None:
    """Issue 16 kind 1: a request aborted wherever it is (running, waiting, held by residency, in
    the overflow window) ends with a ``finished`` event (finish_reason abort) and leaks nothing."""
    h = Harness(cls, num_blocks=24, max_num_seqs=1, mars=mars)
    sink = ListSink()
    h.scheduler.set_telemetry_sink(sink)
    running = h.add(h.make_request("a", h.tokens(100), 50, {"mars_turn": 0}))
    h.step()
    others = [h.add(h.make_request(sid, h.tokens(300), 5, {"mars_turn": 0})) for sid in "bc"]
    h.step()
    ids = [running.request_id] + [r.request_id for r in others]
    h.scheduler.finish_requests(ids, RequestStatus.FINISHED_ABORTED)
    h.step()
    finished = {e.request_id: e.finish_reason for e in sink.events if e.kind == "finished"}
    assert finished == dict.fromkeys(ids, "abort")
    assert h.scheduler.get_request_counts() == (0, 0)
    h.assert_no_leaks()
