"""A runner killed before a tool call's ``tool_end`` reached the gateway: the stream still closes
the call (openhands/durable.py, control/app.py; docs/tasks.md, "Tool events across a kill").

One OpenHands task (playback engine, real tools) through the durable runtime behind a real MARS
gateway. In its first run the ``tool_end`` of its last tool call (a ``str_replace``) is lost on
its way (:class:`~tests.openhands._helpers.ToolEndDropper`: what a kill between the edit and the
post does), then the runner is killed at a step boundary of that call and the task resumed:

* killed before the call's outcome was recorded (``executed``): the resumed run retries it, finds
  the edit applied and does not run it again, and reports that attempt: a ``tool_end`` ``ok``;
* killed after it was recorded (``after``): the outcome is replayed with no events, and the
  gateway closes the call at the session's ``session_end``: a ``tool_end`` ``interrupted``.

Either way every ``tool_start`` in the stream has a later ``tool_end`` (a clean-clone CI run lost
the first case's: ``call_2_0`` of ``oh-notes`` in ``test_runtime_e2e.py``).
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest

pytest.importorskip("openhands.sdk", reason="needs the OpenHands env (.venv-openhands)")
pytest.importorskip("dbos", reason="needs DBOS Transact (the 'runtime' extra)")

from mars_openhands.openhands.playback import (  # noqa: E402
    Script,
)
from mars_openhands.runtime.agent import session_id_of  # noqa: E402
from mars_openhands.runtime.store import Store  # noqa: E402
from tests.openhands._helpers import (  # noqa: E402
    ToolEndDropper,
    playback_behind_gateway,
    run_tasks,
    session_events,
    turn_calling,
)

pytestmark = [pytest.mark.openhands, pytest.mark.timeout(600)]


def _edit_task(tmp_path: Path, kill_at: str) -> tuple[Path, str, Script, str, dict[str, str]]:
    """Task ``oh-edit``'s workspace, session id, playback script (create notes.md, cat it,
    ``str_replace`` in it), database URL and environment (killed at ``kill_at``)."""
    ws = tmp_path / "ws"
    ws.mkdir()
    sid = session_id_of("oh-edit")
    script = Script(name="edit", session_id=sid, turns=(
        turn_calling("file_editor", command="create", path=str(ws / "notes.md"), file_text="# notes\n"),
        turn_calling("terminal", command="cat notes.md"),
        turn_calling("file_editor", command="str_replace", path=str(ws / "notes.md"),
                     old_str="# notes", new_str="# notes\nresumed")))
    db = f"sqlite:///{tmp_path / 'tasks.sqlite'}"
    env = {"MARS_RUNTIME_CRASH_AT": kill_at, "MARS_RUNTIME_CRASH_LOG": str(tmp_path / "crashed.txt"),
           "MARS_TASK_OUT_DIR": str(tmp_path / "out"), "LITELLM_LOCAL_MODEL_COST_MAP": "True"}
    return ws, sid, script, db, env


def _write_task(tmp_path: Path, ws: Path, base_url: str) -> None:
    """``tasks.jsonl`` in ``tmp_path``: task ``oh-edit`` (OpenHands, playback model at ``base_url``)."""
    agent = {"kind": "openhands", "base_url": base_url, "model": "playback", "max_iterations": 10}
    task = {"task_id": "oh-edit", "problem_statement": "write notes", "workspace": str(ws),
            "agent": agent, "acceptance": {"command": "grep -q resumed notes.md"}}
    (tmp_path / "tasks.jsonl").write_text(json.dumps(task) + "\n")


@pytest.mark.parametrize(("kill_at", "status", "source"), [
    ("executed:tool:5:*", "ok", "agent"), ("after:tool:5:*", "interrupted", "gateway")])
def test_a_tool_end_lost_at_a_kill_is_closed_in_the_stream(tmp_path: Path, kill_at: str, status: str,
                                                           source: str) -> None:
    ws, sid, script, db, env = _edit_task(tmp_path, kill_at)
    dropper = ToolEndDropper("call_2_")  # the third turn's call: the str_replace
    with playback_behind_gateway([script], middleware=dropper.wrap) as (gateway, sink):
        _write_task(tmp_path, ws, gateway.base_url)
        first = run_tasks("submit", str(tmp_path / "tasks.jsonl"), db=db, env=env)
        assert first.returncode == -9, first.stdout + first.stderr  # killed at kill_at
        # Dropped, or never posted: on a loaded machine the post may outlast the executor's
        # bounded wait for it (end_wait_s) and the kill. Lost either way.
        assert len(dropper.dropped) <= 1, dropper.dropped
        dropper.until_mono_ns = time.monotonic_ns()  # the first run's, however late they come
        resumed = run_tasks("resume", db=db, env=env)
        assert resumed.returncode == 0, resumed.stdout + resumed.stderr
    assert (ws / "notes.md").read_text() == "# notes\nresumed\n"
    store = Store(db)
    # A retry finds the edit applied and answers ok (it was an error: the observation lacked
    # the file editor's required ``command``).
    assert [(e["step"], e["num_attempts"], e["status"]) for e in store.effects("oh-edit")] == [
        (1, 1, "done"), (3, 1, "done"), (5, 1 + kill_at.startswith("executed"), "done")]
    store.close()
    events = session_events(sink, sid)
    kinds = [e.kind for e in events]
    assert kinds.count("session_start") == 2 and kinds[-1] == "session_end", kinds
    for i, start in enumerate(events):  # every tool_start has a later tool_end (the same call)
        if start.kind == "tool_start":
            assert any(e.kind == "tool_end" and e.tool_call_id == start.tool_call_id
                       for e in events[i + 1:]), (start.tool_call_id, kinds)
    ends = [(e.tool_call_id[:7], e.status, e.source) for e in events if e.kind == "tool_end"]
    assert ends[-1] == ("call_2_", status, source) and len(ends) == 3, ends


def test_a_create_killed_after_its_write_is_answered_as_applied_on_resume(tmp_path: Path) -> None:
    """Killed after the first call's ``create`` wrote notes.md and before its outcome was
    recorded: the resumed run retries it, finds the file holding exactly its ``file_text`` and
    answers ok (it was the editor's error 'File already exists'), and reports that attempt."""
    ws, sid, script, db, env = _edit_task(tmp_path, "executed:tool:1:*")
    with playback_behind_gateway([script]) as (gateway, sink):
        _write_task(tmp_path, ws, gateway.base_url)
        first = run_tasks("submit", str(tmp_path / "tasks.jsonl"), db=db, env=env)
        assert first.returncode == -9, first.stdout + first.stderr  # killed at the create
        assert (ws / "notes.md").read_text() == "# notes\n"  # it landed
        resumed = run_tasks("resume", db=db, env=env)
        assert resumed.returncode == 0, resumed.stdout + resumed.stderr
    assert (ws / "notes.md").read_text() == "# notes\nresumed\n"
    store = Store(db)
    effects = store.effects("oh-edit")
    store.close()
    assert [(e["step"], e["num_attempts"], e["status"]) for e in effects] == [
        (1, 2, "done"), (3, 1, "done"), (5, 1, "done")], [e.get("outcome") for e in effects]
    assert "already applied" in effects[0]["outcome"]["text"]
    ends = [(e.tool_call_id[:7], e.status) for e in session_events(sink, sid) if e.kind == "tool_end"]
    # The retry reports its own attempt; the first attempt's tool_end was posted before the kill,
    # or not (on a loaded machine the post may outlast the executor's end_wait_s).
    assert ends[-3:] == [("call_0_", "ok"), ("call_1_", "ok"), ("call_2_", "ok")], ends
    assert ends[:-3] in ([], [("call_0_", "ok")]), ends
