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

ONE = {"window_max": 1, "window_init": 1, "window_min": 1}


def plane(now: list[float], **overrides: object) -> ControlPlane:
    config = GatewayConfig.model_validate({
        "replicas": [ReplicaConfig(url="http://r0"), ReplicaConfig(url="http://r1")],
        "num_tool_workers": 4, "session_idle_timeout_s": 300.0, **overrides})
    return ControlPlane(config, clock=lambda: now[0])


def test_idle_release_frees_the_slot_for_a_waiter_in_the_same_tick() -> None:
    now = [0.0]
    cp = plane(now, admission=ONE)
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
    now[0] = 1000.0
    assert cp.tick().idle_released == []  # a tool call in flight: not idle
    cp.tool_started(s, "c", "pytest", queue_wait_s=0.5)
    cp.tool_ended(s, "c", "pytest", duration_s=2.5)
    assert cp.tools.num_in_flight == 0 and cp.tools.wait_ema_s == 0.5
    cp.begin_request(s)
    turn, prev_tool = cp.start_turn(s)
    assert (turn, prev_tool) == (1, ("pytest", 2.5))
    cp.refuse_turn(s, turn, prev_tool)  # the engine refused it: the retry is turn 1 again
    assert cp.start_turn(s) == (1, ("pytest", 2.5))


def test_a_side_request_takes_no_turn_and_leaves_the_previous_tool_for_the_next() -> None:
    cp = plane([0.0])
    s = cp.open_session("s")
    assert cp.start_turn(s) == (0, None)
    cp.tool_ended(s, "c", "terminal", duration_s=1.5)
    assert cp.start_turn(s, is_side=True) == (None, None)  # the app's title request
    assert cp.start_turn(s) == (1, ("terminal", 1.5)) and s.num_side_requests == 1


def test_one_turn_sessions_end_with_their_request() -> None:
    now = [5.0]
    cp = plane(now, admission=ONE)
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
    cp = plane(now, admission=ONE)
    cp.router.replicas[0].block_size_tokens = blocks
    taken = cp.open_session("taken")
    cp.begin_request(taken)
    cp.request_slot(taken, 1)
    s = cp.open_session("s")
    cp.begin_request(s)
    cp.request_slot(s, 100)  # waits: ceil(100 / 16) = 7 blocks, or ceil(100 / 32) = 4
    assert [w.num_projected_blocks for w in cp.admission.waiting()] == [expected]
