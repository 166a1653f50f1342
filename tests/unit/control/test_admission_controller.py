"""Session admission over the pure policies (control/admission.py): the sets and the AIMD policy."""

from __future__ import annotations

from mars_openhands.control.admission import AdmissionController, AimdWindow
from mars_openhands.policy.admission import AdmissionParams, PressureSnapshot
from mars_openhands.policy.reorder import ReorderParams, WaitingSession

PARAMS = AdmissionParams(window_max=3, window_init=2, window_min=1)
HEALTHY = PressureSnapshot(num_tool_workers=100)
OVERLOADED = PressureSnapshot(tool_backlog_ratio=10.0, num_tool_workers=100)


def controller(reorder: ReorderParams | None = None, is_enforced: bool = True) -> AdmissionController:
    return AdmissionController(AimdWindow(PARAMS, reorder or ReorderParams(), is_enforced))


def view(session_id: str, arrival_s: float, num_prompt_tokens: int) -> WaitingSession:
    return WaitingSession(session_id=session_id, arrival_s=arrival_s,
                          num_prompt_tokens=num_prompt_tokens)


def test_fast_path_then_wait_then_release_admits_shortest() -> None:
    ac = controller(ReorderParams(fcfs_when_unpressured=False))
    assert ac.request(view("a", 0.0, 100)) and ac.request(view("b", 0.0, 100))
    assert ac.admitted == {"a", "b"} and not ac.can_admit_now()
    assert not ac.request(view("long", 1.0, 10_000))
    assert not ac.request(view("short", 2.0, 10))
    assert ac.num_waiting == 2
    assert ac.release("a", 3.0) == ["short"]
    assert ac.is_waiting("long") and not ac.is_admitted("long")
    assert ac.admitted == {"b", "short"}
    assert ac.release("b", 4.0) == ["long"]
    assert ac.admitted == {"short", "long"} and ac.num_waiting == 0


def test_tick_grows_window_and_admits_waiters() -> None:
    ac = controller()
    for sid in ("a", "b"):
        assert ac.request(view(sid, 0.0, 1))
    assert not ac.request(view("c", 0.0, 1))
    d, admitted = ac.tick(HEALTHY, 1.0)
    assert d.state.window == 3 and admitted == ["c"]
    d, admitted = ac.tick(OVERLOADED, 2.0)  # shrinking never evicts admitted sessions
    assert d.state.window == 2 and len(ac.admitted) == 3 and admitted == []


def test_withdraw_and_release_of_a_waiter_leave_no_waiter() -> None:
    ac = controller()
    for sid in ("a", "b"):
        ac.request(view(sid, 0.0, 1))
    assert not ac.request(view("c", 0.0, 1))
    assert ac.withdraw("c") and not ac.withdraw("c")
    assert ac.num_waiting == 0
    assert not ac.request(view("d", 0.0, 1))
    assert ac.num_waiting == 1
    assert ac.release("d", 1.0) == []  # it held no slot: nobody else is admitted
    assert ac.num_waiting == 0 and "d" not in ac.admitted


def test_a_waiting_session_keeps_its_first_arrival() -> None:
    ac = controller()
    for sid in ("a", "b"):
        ac.request(view(sid, 0.0, 1))
    ac.request(view("first", 1.0, 1))
    ac.request(view("second", 5.0, 1))
    ac.request(view("first", 9.0, 1))  # its second request: still waiting since 1 s
    assert ac.release("a", 10.0) == ["first"]  # one slot, equal sizes: arrival order
    assert ac.num_admitted_total == 3


def test_disabled_admits_everyone_but_still_computes_window() -> None:
    ac = controller(is_enforced=False)
    for i in range(10):
        assert ac.request(view(f"s{i}", 0.0, 1))
    assert len(ac.admitted) == 10
    assert ac.tick(OVERLOADED, 1.0)[0].state.window == 1


def test_a_session_waiting_past_the_bound_is_admitted_whatever_the_window() -> None:
    params = PARAMS.model_copy(update={"max_admission_wait_s": 100.0})
    ac = AdmissionController(AimdWindow(params, ReorderParams()))
    for sid in ("a", "b"):
        assert ac.request(view(sid, 0.0, 1))
    assert not ac.request(view("old", 10.0, 1)) and not ac.request(view("young", 50.0, 1))
    _, admitted = ac.tick(OVERLOADED, 109.0)  # window at its minimum, nobody has waited 100 s
    assert admitted == [] and ac.num_waiting == 2
    _, admitted = ac.tick(OVERLOADED, 110.0)  # "old" has: admitted beyond the window
    assert admitted == ["old"] and ac.is_admitted("old") and ac.is_waiting("young")
    assert len(ac.admitted) > ac.policy.state.window
    unbounded = AdmissionController(AimdWindow(PARAMS.model_copy(update={"max_admission_wait_s": None}),
                                               ReorderParams()))
    for sid in ("a", "b"):
        unbounded.request(view(sid, 0.0, 1))
    unbounded.request(view("old", 10.0, 1))
    assert unbounded.tick(OVERLOADED, 1e6)[1] == []
