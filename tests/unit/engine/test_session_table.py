"""SessionTable: per-session records and the policy's program slot, without vLLM."""

from __future__ import annotations

from mars_openhands.engine.schedulers.sessions import SessionTable


def test_open_is_idempotent_and_keeps_the_first_arrival() -> None:
    table = SessionTable()
    a = table.open("a", 1.0)
    assert table.open("a", 5.0) is a and a.first_arrival_s == 1.0
    assert "a" in table and len(table) == 1 and table["a"] is a and table.get("b") is None
    assert not hasattr(table, "__setitem__")  # read-only mapping: changes go through open/forget


def test_a_session_that_moved_here_keeps_its_age() -> None:
    """``mars_session_age_s`` dates a new record back (the session moved from another replica);
    a record this engine already has keeps its own first arrival."""
    table = SessionTable()
    assert table.open("moved", 100.0, age_s=40.0).first_arrival_s == 60.0
    assert table.open("moved", 120.0, age_s=5.0).first_arrival_s == 60.0
    assert table.open("new", 100.0, age_s=None).first_arrival_s == 100.0


def test_program_slot_lives_and_dies_with_the_session() -> None:
    table = SessionTable()
    assert table.program("a") is None and table.program(None) is None
    assert not table.set_program("a", {"service": 1})  # no record: nothing stored
    table.open("a", 0.0)
    assert table.set_program("a", {"service": 1}) and table.program("a") == {"service": 1}
    assert table.forget("a").program == {"service": 1} and table.forget("a") is None
    table.open("a", 9.0)
    assert table.program("a") is None  # a reopened session starts a new program


def test_forget_idle_keeps_busy_kept_and_recent_sessions() -> None:
    table = SessionTable()
    for sid in ("idle", "busy", "kept", "recent"):
        table.open(sid, 0.0).last_activity_s = 0.0
    table["busy"].active_request_ids.add("r1")
    table["recent"].last_activity_s = 95.0
    assert table.forget_idle(100.0, 10.0, keep={"kept"}) == ["idle"]
    assert sorted(table) == ["busy", "kept", "recent"]
    assert table.forget_idle(100.0, 100.0, keep=()) == []  # not idle for *more* than the timeout
