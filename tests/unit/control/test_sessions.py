"""Session registry and tool-plane signals (control/sessions.py)."""

from __future__ import annotations

import pytest

from mars_openhands.control.sessions import SessionRegistry, ToolCall, ToolTracker


def test_tool_tracker_backlog_and_ema() -> None:
    reg = SessionRegistry()
    s = reg.get_or_create("s", 0.0)
    t = ToolTracker(num_tool_workers=2, alpha=0.2)
    t.on_enqueued(s, "c1", "bash", 0.0, 60.0)
    t.on_enqueued(s, "c2", "bash", 0.0, 60.0)
    assert (t.num_in_flight, t.num_queued, t.backlog_ratio) == (2, 2, 1.0)
    t.on_start(s, "c1", "bash", queue_wait_s=10.0, now_s=10.0, bound_s=60.0)
    assert (t.num_in_flight, t.num_queued, t.wait_ema_s) == (2, 1, 10.0)
    t.on_start(s, "c3", "grep", queue_wait_s=0.0, now_s=10.0, bound_s=60.0)  # start without enqueue counts too
    assert t.num_in_flight == 3 and t.wait_ema_s == pytest.approx(8.0)
    t.on_end(s, "c1", "bash", 2.5)
    assert t.num_in_flight == 2 and s.prev_tool == ("bash", 2.5)
    t.on_end(s, "c2", "bash", 0.1)  # ended while still queued
    assert (t.num_in_flight, t.num_queued) == (1, 0)
    t.forget(s)
    assert (t.num_in_flight, t.num_queued, s.tools_in_flight) == (0, 0, {})


def test_idle_decay_only_when_nothing_queued() -> None:
    s = SessionRegistry().get_or_create("s", 0.0)
    t = ToolTracker(1, 0.5)
    t.on_enqueued(s, "c", "x", 0.0, 60.0)
    t.wait_ema_s = 4.0
    t.decay_if_idle()
    assert t.wait_ema_s == 4.0
    t.on_start(s, "c", "x", 4.0, 4.0, 60.0)
    t.decay_if_idle()
    assert t.wait_ema_s == 2.0


def test_idle_sessions() -> None:
    reg = SessionRegistry()
    a = reg.get_or_create("a", 0.0)
    b = reg.get_or_create("b", 0.0)
    b.num_in_flight = 1
    c = reg.get_or_create("c", 0.0)
    c.tools_in_flight["t"] = ToolCall("bash", True, 0.0, deadline_s=20.0)
    assert [s.session_id for s in reg.idle(10.0, 5.0)] == ["a"]
    a.last_activity_s = 8.0
    assert reg.idle(10.0, 5.0) == []
    # Past its deadline a tool call keeps nobody alive (its agent is presumed dead).
    assert [s.session_id for s in reg.idle(20.0, 5.0)] == ["a", "c"]
    assert [(s.session_id, cid) for s, cid, _ in reg.overdue_tools(20.0)] == [("c", "t")]
