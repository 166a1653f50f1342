"""The control plane on a virtual clock (control/plane.py): lifecycle, signals, routing, policy."""

from __future__ import annotations

from collections.abc import Sequence

import pytest

from mars_openhands.control.config import GatewayConfig, ReplicaConfig
from mars_openhands.control.plane import ControlPlane
from mars_openhands.policy.admission import (
    AdmissionDecision,
    AdmissionParams,
    AdmissionState,
    PressureSnapshot,
)
from mars_openhands.policy.reorder import WaitingSession
from mars_openhands.stream.events import SessionStart, ToolEnd, ToolEnqueued, now_stamps

ONE = {"window_max": 1, "window_init": 1, "window_min": 1}


def plane(now: list[float], num_replicas: int = 2, **overrides: object) -> ControlPlane:
    """A plane on ``now[0]``'s clock in front of ``num_replicas`` replicas (the window's session
    counts are per replica: ``ONE`` holds one session per replica up)."""
    config = GatewayConfig.model_validate({
        "replicas": [ReplicaConfig(url=f"http://r{i}") for i in range(num_replicas)],
        "num_tool_workers": 4, "session_idle_timeout_s": 300.0, **overrides})
    return ControlPlane(config, clock=lambda: now[0])


def test_idle_release_frees_the_slot_for_a_waiter_in_the_same_tick() -> None:
    now = [0.0]
    cp = plane(now, num_replicas=1, admission=ONE)
    a, b = cp.open_session("a"), cp.open_session("b")
    cp.begin_request(a)
    assert cp.request_slot(a, 100)
    cp.begin_request(b)
    assert not cp.request_slot(b, 100)  # the window holds one session
    now[0] = 1.0
    assert cp.end_request(a) == []
    now[0] = 300.5  # b waits past the idle timeout too, but its request is in flight
    assert cp.tick().admitted == []
    now[0] = 301.0
    tick = cp.tick()
    assert (tick.idle_released, tick.admitted) == (["a"], ["b"])
    assert cp.sessions.get("a") is None and cp.admission.admitted == {"b"}
    assert (tick.report.num_admitted, tick.report.num_waiting) == (1, 0)
    assert cp.num_idle_releases == 1


def test_tool_calls_keep_a_session_alive_and_its_last_tool_travels_with_the_next_turn() -> None:
    now = [0.0]
    cp = plane(now)
    s = cp.open_session("s")
    cp.begin_request(s)
    assert cp.request_slot(s, 10) and cp.start_turn(s) == (0, None)
    cp.end_request(s)
    cp.tool_enqueued(s, "c", "pytest")
    now[0] = 800.0  # past the idle timeout (300 s), within the tool call's bound (900 s)
    assert cp.tick().idle_released == []  # a tool call in flight: not idle
    cp.tool_started(s, "c", "pytest", queue_wait_s=0.5)
    cp.tool_ended(s, "c", "pytest", duration_s=2.5)
    assert cp.tools.num_in_flight == 0 and cp.tools.wait_ema_s == 0.5
    cp.begin_request(s)
    turn, prev_tool = cp.start_turn(s)
    assert (turn, prev_tool) == (1, ("pytest", 2.5))
    cp.end_turn(s, turn, is_answered=False)  # the engine refused it: the retry is turn 1 again
    assert cp.start_turn(s) == (1, ("pytest", 2.5))


def test_the_tool_fraction_is_the_share_of_admitted_time_in_tool_calls() -> None:
    """Two admitted sessions, one in a tool call half the time: f = 1/4, the window's C_cpu
    4 x 1.25 / 0.25 = 20 sessions instead of the preview's 5; the preview's keeps 5."""
    for horizon, cap in ((600.0, 20), (None, 5)):
        now = [0.0]
        cp = plane(now, num_replicas=1, admission={"tool_fraction_horizon_s": horizon})
        sessions = [cp.open_session(sid) for sid in "ab"]
        for s in sessions:
            cp.begin_request(s)
            assert cp.request_slot(s, 10)
        cp.tick()
        assert cp.tools.tool_fraction in (None, 0.0)
        for step in range(1, 102):  # session a: in a tool call for 1 s of every 2 (ends in one)
            if step % 2:
                cp.tool_enqueued(sessions[0], f"c{step}", "pytest")
            else:
                cp.tool_ended(sessions[0], f"c{step - 1}", "pytest", duration_s=1.0)
            now[0] = float(step)
            tick = cp.tick()
        expected = None if horizon is None else pytest.approx(0.25, abs=0.01)
        assert cp.snapshot().tool_fraction == expected
        assert tick.decision.cpu_cap == cap


def test_retries_of_a_turn_keep_its_number_until_one_answers() -> None:
    """Attempts of one turn (the same body fingerprint) share its number, however they overlap;
    the turn is given back only when its last attempt ends and none answered (issue 33 item 7)."""
    now = [0.0]
    cp = plane(now)
    s = cp.open_session("s")
    assert cp.start_turn(s, fingerprint=10) == (0, None)
    cp.end_turn(s, 0, is_answered=True)
    cp.tool_ended(s, "c", "terminal", duration_s=1.0)
    first = cp.start_turn(s, fingerprint=11)
    assert first == (1, ("terminal", 1.0))
    assert cp.start_turn(s, fingerprint=11) == first  # the client re-sent it meanwhile
    cp.end_turn(s, 1, is_answered=False)  # the first attempt was aborted: the retry runs on
    assert s.num_turns == 2
    cp.end_turn(s, 1, is_answered=False)  # the retry failed too: the turn goes back
    assert (s.num_turns, s.prev_tool, s.last_turn) == (1, ("terminal", 1.0), None)
    assert cp.start_turn(s, fingerprint=12) == (1, ("terminal", 1.0))  # the agent's next body
    cp.end_turn(s, 1, is_answered=True)
    assert cp.start_turn(s, fingerprint=12) == (1, ("terminal", 1.0))  # re-sent after an answer
    cp.end_turn(s, 1, is_answered=False)  # ... and that one failed: turn 1 was answered, kept
    assert s.num_turns == 2 and s.num_turn_retries == 2
    assert cp.start_turn(s, fingerprint=13) == (2, None)
    assert cp.start_turn(s, fingerprint=14) == (3, None)  # turn 2 still running, turn 3 starts
    cp.end_turn(s, 2, is_answered=False)  # a turn followed by another keeps its number
    assert s.num_turns == 4
    assert cp.start_turn(s, is_side=True) == (None, None) and s.num_turns == 4
    assert cp.start_turn(s) == (4, None) and cp.start_turn(s) == (5, None)  # no fingerprint


def test_after_parallel_tool_calls_the_next_turn_carries_the_batch_span() -> None:
    """Issue 33 item 3: three tool calls of one turn ran side by side (or one after the other);
    the next turn waited from the first start to the last end, not the last call's duration."""
    now = [0.0]
    cp = plane(now)
    s = cp.open_session("s")
    cp.begin_request(s)
    assert cp.request_slot(s, 10) and cp.start_turn(s) == (0, None)
    cp.end_request(s)
    t0 = 5_000_000_000  # the agent's monotonic clock, ns
    # (call, start, end) seconds after t0: c2 ends last though c1 started first; c3 is short.
    for call, start_s, end_s in (("c3", 0.2, 1.3), ("c1", 0.0, 2.1), ("c2", 0.1, 3.25)):
        cp.on_cpu_event(s, ToolEnd(t_mono_ns=t0 + int(end_s * 1e9), t_wall=now_stamps()["t_wall"],
                                   source="agent", session_id="s", tool_name=f"t-{call}",
                                   tool_call_id=call, duration_s=end_s - start_s))
    cp.begin_request(s)
    turn, prev_tool = cp.start_turn(s)
    assert turn == 1 and prev_tool is not None
    assert prev_tool[0] == "t-c2" and prev_tool[1] == pytest.approx(3.25)  # not c2's own 3.15 s
    cp.end_request(s)
    # The next batch starts afresh: one call, its own duration.
    cp.on_cpu_event(s, ToolEnd(t_mono_ns=t0 + 9 * 10**9, t_wall=now_stamps()["t_wall"],
                               source="agent", session_id="s", tool_name="t-c4",
                               tool_call_id="c4", duration_s=0.5))
    cp.begin_request(s)
    assert cp.start_turn(s) == (2, ("t-c4", 0.5))


def test_a_tool_call_past_its_bound_is_interrupted_and_its_session_idles_out() -> None:
    """A dead agent (killed in the middle of a tool call) holds nothing forever: past the call's
    bound the tick closes it as interrupted (no prev_tool: nothing was measured), the backlog
    drops, and the session, silent past the idle timeout, gives its slot to a waiter."""
    now = [0.0]
    cp = plane(now, num_replicas=1, admission=ONE, session_idle_timeout_s=5.0, tool_call_timeout_s=60.0)
    dead, waiter = cp.open_session("dead"), cp.open_session("waiter")
    cp.begin_request(dead)
    assert cp.request_slot(dead, 10) and cp.start_turn(dead) == (0, None)
    cp.end_request(dead)
    cp.tool_enqueued(dead, "c1", "terminal", timeout_s=40.0)  # the tool's own bound wins
    now[0] = 0.5
    cp.tool_started(dead, "c1", "terminal", queue_wait_s=0.5, timeout_s=30.0)  # restarts it
    cp.begin_request(waiter)
    assert not cp.request_slot(waiter, 10)
    now[0] = 30.0
    tick = cp.tick()
    assert (tick.interrupted, tick.idle_released, cp.tools.num_in_flight) == ((), [], 1)
    now[0] = 30.5
    tick = cp.tick()
    assert [(t.session_id, t.tool_call_id, t.tool_name, t.turn) for t in tick.interrupted] == [
        ("dead", "c1", "terminal", 1)]
    assert tick.interrupted[0].waited_s == pytest.approx(30.0)
    assert (tick.idle_released, tick.admitted) == (["dead"], ["waiter"])
    assert cp.tools.num_in_flight == 0 and cp.tools.backlog_ratio == 0.0
    assert cp.num_tools_interrupted == 1


def test_a_session_end_first_closes_its_tool_calls_still_in_flight() -> None:
    """A resumed agent whose first run was killed between a call's start and its tool_end's post
    ends its session with that call open: the gateway closes it (interrupted, unmeasured), and
    only that session's calls."""
    now = [0.0]
    cp = plane(now)
    resumed, other = cp.open_session("resumed"), cp.open_session("other")
    cp.tool_started(resumed, "c1", "file_editor", queue_wait_s=0.0)
    cp.tool_enqueued(resumed, "c2", "terminal")
    cp.tool_started(other, "c1", "terminal", queue_wait_s=0.0)  # the same call id, another session
    now[0] = 4.0
    closed = cp.interrupt_tools_of(resumed)
    assert [(t.session_id, t.tool_call_id, t.tool_name, t.waited_s) for t in closed] == [
        ("resumed", "c1", "file_editor", 4.0), ("resumed", "c2", "terminal", 4.0)]
    assert resumed.tools_in_flight == {} and resumed.prev_tool is None
    assert list(other.tools_in_flight) == ["c1"]
    assert (cp.tools.num_in_flight, cp.tools.num_queued, cp.num_tools_interrupted) == (1, 0, 2)
    assert cp.interrupt_tools_of(resumed) == []


def test_tool_bounds_come_from_the_call_then_the_task_then_the_gateway() -> None:
    now = [0.0]
    cp = plane(now, tool_call_timeout_s=100.0)
    s = cp.open_session("s")
    assert cp.tool_bound_s(s, None) == 100.0
    cp.on_cpu_event(s, SessionStart(**now_stamps(), source="agent", session_id="s",
                                    tool_timeout_s=20.0))
    assert cp.tool_bound_s(s, None) == 20.0 and cp.tool_bound_s(s, 7.0) == 7.0
    cp.on_cpu_event(s, ToolEnqueued(**now_stamps(), source="agent", session_id="s",
                                    tool_name="mcp", tool_call_id="m"))
    now[0] = 19.0
    assert cp.tick().interrupted == ()
    now[0] = 20.0
    assert [t.tool_call_id for t in cp.tick().interrupted] == ["m"]
    # A late tool_end of the interrupted call is harmless: counts stay at 0.
    cp.on_cpu_event(s, ToolEnd(**now_stamps(), source="agent", session_id="s", tool_name="mcp",
                               tool_call_id="m", duration_s=25.0))
    assert (cp.tools.num_in_flight, cp.tools.num_queued, s.prev_tool) == (0, 0, ("mcp", 25.0))


def test_a_client_gone_gives_its_slot_back_unless_more_of_its_session_is_in_flight() -> None:
    now = [0.0]
    cp = plane(now, num_replicas=1, admission=ONE)
    a, b = cp.open_session("a"), cp.open_session("b")
    cp.begin_request(a)
    assert cp.request_slot(a, 10)
    cp.start_turn(a)
    cp.begin_request(a)  # a second request of a (e.g. a title) still runs
    cp.begin_request(b)
    assert not cp.request_slot(b, 10)
    cp.end_request(a)
    assert cp.client_gone(a) == [] and cp.admission.is_admitted("a")
    cp.end_request(a)
    assert cp.client_gone(a) == ["b"] and not cp.admission.is_admitted("a")
    assert cp.sessions.get("a") is a and a.num_turns == 1  # known; queues again next time
    assert cp.num_client_gone_releases == 1
    cp.begin_request(a)
    assert not cp.request_slot(a, 10)  # b holds the only slot now


def test_a_side_request_takes_no_turn_and_leaves_the_previous_tool_for_the_next() -> None:
    cp = plane([0.0])
    s = cp.open_session("s")
    assert cp.start_turn(s) == (0, None)
    cp.tool_ended(s, "c", "terminal", duration_s=1.5)
    assert cp.start_turn(s, is_side=True) == (None, None)  # the app's title request
    assert cp.start_turn(s) == (1, ("terminal", 1.5)) and s.num_side_requests == 1


def test_one_turn_sessions_end_with_their_request() -> None:
    now = [5.0]
    cp = plane(now, num_replicas=1, admission=ONE)
    s = cp.open_session(None)
    assert s.is_one_turn and s.session_id.startswith("one-turn-1-")
    cp.begin_request(s)
    assert cp.request_slot(s, 10)
    waiter = cp.open_session("w")
    cp.begin_request(waiter)
    assert not cp.request_slot(waiter, 10)
    assert cp.end_request(s) == ["w"] and s.has_ended and cp.sessions.get(s.session_id) is None


def test_kv_usage_and_budget_come_from_fresh_engine_steps() -> None:
    now = [0.0]
    cp = plane(now, engine_step_max_age_s=2.0)
    assert cp.snapshot().kv_usage is None and cp.kv_budget_blocks() is None
    assert cp.router.observe_engine_step("engine:1", num_used_blocks=50, num_gpu_blocks=100)
    assert not cp.router.observe_engine_step("engine:7", 1, 100)  # no such replica
    assert cp.snapshot().kv_usage == 0.5
    assert cp.kv_budget_blocks() == 40  # floor((0.90 - 0.5) * 100)
    now[0] = 2.5  # the step is stale and nothing was polled: unknown again
    assert cp.snapshot().kv_usage is None and cp.kv_budget_blocks() is None


def test_with_a_host_tier_kv_usage_and_budget_are_over_the_gpu_and_host_pool() -> None:
    """A session displaced from the GPU resumes from the host by a copy: the window's KV pool is
    GPU + host (80 of 100 GPU blocks used with a 300-block tier: u = 0.2, budget 0.7 x 400)."""
    now = [0.0]
    cp = plane(now)
    assert cp.router.observe_engine_step("engine:0", 80, 100, num_host_blocks=300)
    assert cp.snapshot().kv_usage == pytest.approx(0.2) and cp.kv_budget_blocks() == 280
    assert cp.router.replicas[0].kv_usage(now[0], 2.0) == 0.8  # routing still sees the GPU's
    assert cp.router.observe_engine_step("engine:1", 85, 100)  # no tier: its GPU's usage
    # One pool of 500 blocks, 165 used; the budget is still the best replica's room.
    assert cp.snapshot().kv_usage == pytest.approx(165 / 500) and cp.kv_budget_blocks() == 280


@pytest.mark.parametrize("mode", ["pooled", "max"])
def test_one_full_replica_shrinks_the_window_only_when_u_is_the_fullest_replicas(mode: str) -> None:
    """u over several replicas: ``pooled`` = used / blocks over all of them (a down or stale one
    left out), ``max`` = the fullest; a full replica beside an empty one closes the window only
    under ``max``."""
    now = [0.0]
    cp = plane(now, admission={"kv_usage_over_replicas": mode}, engine_step_max_age_s=2.0,
               num_tool_workers=100)  # C_cpu above W_max: only KV moves the window
    assert cp.router.observe_engine_step("engine:0", 95, 100)
    assert cp.router.observe_engine_step("engine:1", 100, 300)
    expected = {"pooled": 195 / 400, "max": 0.95}[mode]
    assert cp.snapshot().kv_usage == pytest.approx(expected)
    window = cp.admission.window
    cp.tick()
    assert (cp.admission.window < window) is (mode == "max")
    cp.router.record_failure(1, "down", immediate=True)
    assert cp.snapshot().kv_usage == pytest.approx(0.95)  # only replica 0 is left
    cp.router.record_success(1)
    now[0] = 1.5
    assert cp.router.observe_engine_step("engine:1", 30, 300)
    now[0] = 3.0  # replica 0's step is stale: replica 1 alone
    assert cp.snapshot().kv_usage == pytest.approx(0.1)


def test_a_failed_replica_detaches_its_sessions_which_keep_their_slots() -> None:
    now = [0.0]
    cp = plane(now, replica_failure_threshold=1)
    s = cp.open_session("s")
    cp.begin_request(s)
    cp.request_slot(s, 10)
    first = cp.router.route(s)
    assert cp.replica_failed(first.index, "boom")
    assert s.replica is None and cp.admission.is_admitted("s")
    assert cp.router.route(s).index != first.index


class _OneByOne:
    """A stand-in policy: one new session per tick, whatever the pressure."""

    def __init__(self) -> None:
        self.state = AdmissionState(window=1)
        self.last_decision: AdmissionDecision | None = None
        self.last_mode = None
        self.num_updates = 0

    def update(self, snapshot: PressureSnapshot) -> AdmissionDecision:
        self.num_updates += 1
        self.last_decision = AdmissionDecision(state=self.state, action="hold", cpu_cap=1, kv_cap=1)
        return self.last_decision

    def can_admit(self, num_admitted: int, num_waiting: int) -> bool:
        return False

    def select(self, waiting: Sequence[WaitingSession], num_admitted: int, now_s: float,
               kv_budget_blocks: int | None) -> list[str]:
        return [waiting[-1].session_id] if waiting else []


def test_the_admission_policy_is_swappable() -> None:
    now = [0.0]
    config = GatewayConfig(replicas=[ReplicaConfig(url="http://r0")],
                           admission=AdmissionParams(window_max=30))
    policy = _OneByOne()
    cp = ControlPlane(config, clock=lambda: now[0], policy=policy)
    for sid in ("a", "b", "c"):
        session = cp.open_session(sid)
        cp.begin_request(session)
        assert not cp.request_slot(session, 10)  # the window (30) has room; the policy says no
    assert [cp.tick().admitted for _ in range(4)] == [["c"], ["b"], ["a"], []]
    assert policy.num_updates == 4


@pytest.mark.parametrize("blocks, expected", [(None, 7), (32, 4)])
def test_projected_blocks_use_the_replica_block_size(blocks: int | None, expected: int) -> None:
    now = [0.0]
    cp = plane(now, num_replicas=1, admission=ONE)
    cp.router.replicas[0].block_size_tokens = blocks
    taken = cp.open_session("taken")
    cp.begin_request(taken)
    cp.request_slot(taken, 1)
    s = cp.open_session("s")
    cp.begin_request(s)
    cp.request_slot(s, 100)  # waits: ceil(100 / 16) = 7 blocks, or ceil(100 / 32) = 4
    assert [w.num_projected_blocks for w in cp.admission.waiting()] == [expected]


def test_the_window_is_per_replica_and_follows_the_replicas_up() -> None:
    """Window counts are per replica: two replicas up admit two sessions at window 1; one down,
    the window falls to one at the next tick, the sessions it holds keep their slots, and a new
    session waits until a slot frees or the replica is back."""
    now = [0.0]
    cp = plane(now, admission=ONE, num_tool_workers=100)
    assert cp.admission.window == 2
    sessions = [cp.open_session(name) for name in "abc"]
    for s in sessions:
        cp.begin_request(s)
    assert [cp.request_slot(s, 10) for s in sessions] == [True, True, False]
    cp.router.record_failure(1, "down", immediate=True)
    now[0] = 0.2
    cp.tick()
    assert cp.admission.window == 1 and cp.admission.is_admitted("a") and cp.admission.is_admitted("b")
    assert cp.admission.is_waiting("c")
    cp.router.record_success(1)
    now[0] = 0.4
    tick = cp.tick()
    assert cp.admission.window == 2 and tick.admitted == [] and cp.admission.is_waiting("c")  # 2 hold 2
    assert cp.end_session(sessions[0]) == ["c"]
