"""End to end: OpenHands tasks through the durable runtime, one runner killed mid-task, resumed.

Two OpenHands conversations (playback engine, real tools in temporary workspaces) run as durable
tasks in one runner process (``mars-openhands tasks submit``). The runner SIGKILLs itself after a
tool call of one ran and before its outcome was recorded, the other anywhere before its last turn
(held until the kill); ``tasks resume`` continues both from their logs:
recorded LLM responses are not asked again, recorded tool calls not run again, and the
conversations go on. Then ``tasks report`` shows the task metrics (table, Parquet, plot).

The engine sits behind a real MARS gateway (issue 33 item 4): the tasks take the ``mars`` path,
so the gateway's stream sees every tool call, each session's turns count on across the kill (no
``mars_turn`` 0 twice), and the resumed runner sends the token the first one did (kept in the
task database; the gateway binds the session to it, item 6).
"""

from __future__ import annotations

import json
from pathlib import Path

import httpx
import pytest

pytest.importorskip("openhands.sdk", reason="needs the OpenHands env (.venv-openhands)")
pytest.importorskip("dbos", reason="needs DBOS Transact (the 'runtime' extra)")

from mars_openhands.openhands.playback import (  # noqa: E402
    Script,
)
from mars_openhands.runtime.agent import session_id_of  # noqa: E402
from mars_openhands.runtime.store import Store  # noqa: E402
from tests.openhands._helpers import (  # noqa: E402
    TurnHold,
    playback_behind_gateway,
    run_tasks,
    session_events,
    turn_calling,
)

pytestmark = [pytest.mark.openhands, pytest.mark.timeout(600)]


def test_openhands_tasks_resume_after_a_kill_and_report(tmp_path: Path) -> None:
    ws_a, ws_b = tmp_path / "a", tmp_path / "b"
    ws_a.mkdir()
    ws_b.mkdir()
    scripts = [
        Script(name="hello", session_id=session_id_of("oh-hello"), turns=(
            turn_calling("terminal", command="ls"),
            turn_calling("file_editor", command="create", path=str(ws_a / "hello.py"), file_text="print('hello')\n"),
            turn_calling("terminal", command="python3 hello.py > out.txt"))),
        Script(name="notes", session_id=session_id_of("oh-notes"), turns=(
            turn_calling("file_editor", command="create", path=str(ws_b / "notes.md"), file_text="# notes\n"),
            turn_calling("terminal", command="cat notes.md"),
            turn_calling("file_editor", command="str_replace", path=str(ws_b / "notes.md"),
                         old_str="# notes", new_str="# notes\nresumed"))),
    ]
    db = f"sqlite:///{tmp_path / 'tasks.sqlite'}"
    # Step 3 of oh-hello (the file create) runs, then the runner dies before recording it.
    env = {"MARS_RUNTIME_CRASH_AT": "executed:tool:3:idempotent_write", "MARS_RUNTIME_CRASH_LOG": str(tmp_path / "crashed.txt"),
           "MARS_TASK_OUT_DIR": str(tmp_path / "out"), "LITELLM_LOCAL_MODEL_COST_MAP": "True"}
    # Both tasks are mid-task at the kill: oh-notes' last turn (its finish) waits for it. On a
    # loaded machine oh-notes ran ahead and finished before oh-hello's step 3 (one run, not two).
    hold = TurnHold(session_id_of("oh-notes"), 3, (tmp_path / "crashed.txt").exists)
    # And oh-notes has a recorded turn at the kill: oh-hello's step 3 (its turn 1) waits until
    # oh-notes asked its turn 1 (so its turn 0 is recorded). On a loaded machine oh-notes had
    # not yet got an answer when oh-hello crashed.
    ahead = TurnHold(session_id_of("oh-hello"), 1, lambda: hold.num_seen >= 2,
                     is_answered_on_release=True)
    with playback_behind_gateway(scripts, middleware=lambda app: ahead.wrap(hold.wrap(app))) as (
            gateway, sink):
        url = gateway.config.replicas[0].url  # the playback engine itself, for its records
        agent = {"kind": "openhands", "base_url": gateway.base_url, "model": "playback",
                 "max_iterations": 10}
        tasks = [{"task_id": "oh-hello", "problem_statement": "print hello", "workspace": str(ws_a),
                  "agent": agent, "acceptance": {"command": "grep -qx hello out.txt"}},
                 {"task_id": "oh-notes", "problem_statement": "write notes", "workspace": str(ws_b),
                  "agent": agent, "acceptance": {"command": "grep -q resumed notes.md"}}]
        task_file = tmp_path / "tasks.jsonl"
        task_file.write_text("\n".join(json.dumps(t) for t in tasks) + "\n")
        first = run_tasks("submit", str(task_file), db=db, env=env)
        assert first.returncode == -9, first.stdout + first.stderr  # killed mid-task
        assert (tmp_path / "crashed.txt").read_text().split() == ["executed:tool:3:idempotent_write"]
        store = Store(db)
        recorded = {(session_id_of(e["task_id"]), e["step"] // 2) for e in store.events() if e["kind"] == "llm_call"}
        store.close()
        resumed = run_tasks("resume", db=db, env=env)
        assert resumed.returncode == 0, resumed.stdout + resumed.stderr
        requests = httpx.get(f"{url}/playback/requests").json()["requests"]
        contract = gateway.contract
    assert (ws_a / "out.txt").read_text() == "hello\n"
    assert (ws_b / "notes.md").read_text() == "# notes\nresumed\n"
    # Recorded LLM responses were replayed, not asked again; a call in flight at the kill (the other
    # task's, if any) was asked again once: at-least-once for work that had no recorded outcome.
    asked = [(r["session_id"], r["turn"]) for r in requests]
    assert len(set(asked)) == 8 and len(recorded) >= 3, asked  # 3 tool turns + finish, per task
    assert all(asked.count(t) == 1 for t in recorded), (asked, recorded)
    assert len(asked) - len(set(asked)) <= 1 and all(asked.count(t) <= 2 for t in asked)
    store = Store(db)
    # Every tool call of each conversation (its recorded LLM responses' calls) reached the
    # gateway's stream; the turns went on across the kill; one token per session, in both runs.
    for task_id in ("oh-hello", "oh-notes"):
        sid = session_id_of(task_id)
        calls = {c["id"] for e in store.events(task_id) if e["kind"] == "llm_call"
                 for c in e["payload"]["response"]["message"].get("tool_calls") or []
                 if (c.get("name") or c.get("function", {}).get("name")) != "finish"}
        ended = {e.tool_call_id for e in session_events(sink, sid) if e.kind == "tool_end"}
        assert len(calls) == 3 and calls <= ended, (task_id, calls, ended)
        turns = [r["vllm_xargs"]["mars_turn"] for r in requests if r["session_id"] == sid]
        assert turns.count(0) == 1 and turns == sorted(turns), (task_id, turns)
        tokens = contract.tokens_of(sid)
        assert len(set(tokens)) == 1 and tokens[0] == store.session_token(task_id), tokens
        kinds = [e.kind for e in session_events(sink, sid)]
        assert kinds.count("session_start") == 2 and kinds[-1] == "session_end", kinds
    assert contract.refused() == []
    rows = {t["task_id"]: t for t in store.tasks()}
    assert {k: (v["status"], v["num_runs"]) for k, v in rows.items()} == {
        "oh-hello": ("succeeded", 2), "oh-notes": ("succeeded", 2)}
    attempts = {t: [e["num_attempts"] for e in store.effects(t)] for t in rows}
    store.close()
    # The call in the executed-not-recorded window ran twice (a keyed idempotent write: retried
    # with its key). The other task runs concurrently: its call in flight at the kill, if any, has
    # no recorded outcome either and ran at most twice; every other tool call ran once.
    assert len(sum(attempts.values(), [])) == 6, attempts
    assert sorted(attempts["oh-hello"]) == [1] * (len(attempts["oh-hello"]) - 1) + [2], attempts
    assert set(attempts["oh-notes"]) <= {1, 2} and attempts["oh-notes"].count(2) <= 1, attempts
    report = run_tasks("report", "--out", str(tmp_path / "report"), db=db, env={})
    assert report.returncode == 0, report.stderr
    print(report.stdout)
    assert "recovery success rate" in report.stdout and "100%" in report.stdout
    import pandas as pd

    frame = pd.read_parquet(tmp_path / "report" / "tasks.parquet")
    assert list(frame["num_recoveries"]) == [1, 1] and frame["num_duplicate_effects"].sum() == 0
    assert (tmp_path / "report" / "task_times.png").stat().st_size > 1000
