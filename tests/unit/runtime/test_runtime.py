"""Task identity, budget, deadline, the gate's denials and undo, run in this process (one runner)."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path
from typing import Any

import pytest

from mars_openhands.openhands.playback import (
    RecordedToolCall,
    RecordedTurn,
    Script,
    build_playback_app,
)
from mars_openhands.runtime import metrics
from mars_openhands.runtime.agent import session_id_of
from mars_openhands.runtime.config import RuntimeConfig
from mars_openhands.runtime.engine import Runtime
from mars_openhands.runtime.store import SpecConflictError
from mars_openhands.runtime.task import TaskSpec
from tests.openhands._helpers import serve_app
from tests.unit.runtime.helpers import cli, git_workspace

pytestmark = pytest.mark.timeout(300)


def _turn(command: str) -> RecordedTurn:
    return RecordedTurn(content="", tool_calls=(RecordedToolCall(name="terminal", arguments={"command": command}),))


def _spec(task_id: str, workspace: Path, url: str, **fields: Any) -> TaskSpec:
    return TaskSpec.model_validate({"task_id": task_id, "problem_statement": "work",
                                    "workspace": str(workspace),
                                    "agent": {"base_url": url + "/v1", "model": "playback"}, **fields})


def _run(db_url: str, spec: TaskSpec, commands: list[str]) -> tuple[dict[str, Any], Runtime]:
    script = Script(name=spec.task_id, session_id=session_id_of(spec.task_id),
                    turns=tuple(_turn(c) for c in commands))
    with serve_app(build_playback_app([script])) as url:
        spec = spec.model_copy(update={"agent": spec.agent.model_copy(update={"base_url": url + "/v1"})})
        runtime = Runtime(RuntimeConfig(db_url=db_url, approval_poll_s=0.2))
        with runtime:
            runtime.submit(spec)
            assert runtime.start(spec.task_id) == "started"
            row = runtime.wait([spec.task_id], timeout_s=120)[0]
    return row, runtime


def _head(workspace: Path) -> str:
    return subprocess.run(["git", "rev-parse", "HEAD"], cwd=workspace, capture_output=True, text=True,
                          check=True).stdout.strip()


def test_budget_end_undoes_compensable_writes(db_url: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ("GIT_AUTHOR_NAME", "GIT_COMMITTER_NAME", "GIT_AUTHOR_EMAIL", "GIT_COMMITTER_EMAIL"):
        monkeypatch.setenv(name, "agent")
    workspace = git_workspace(tmp_path / "ws")
    start = _head(workspace)
    spec = _spec("budget", workspace, "http://unused", budget={"max_turns": 2})
    row, runtime = _run(db_url, spec, ["echo x > x.txt && git add x.txt && git commit -qm x", "ls"])
    assert row["status"] == "ended_budget" and "budget.max_turns" in row["end_reason"]
    assert _head(workspace) == start  # the commit was compensated (git reset --soft)
    effect = runtime.store.effects("budget")[0]
    assert effect["effect"] == "compensable_write" and effect["status"] == "compensated"
    m = metrics.task_rows(runtime.store)[0]
    assert m["is_ended_by_budget"] and m["num_llm_calls"] == 2 and m["num_duplicate_effects"] == 0


def test_deadline_caps_tool_time_and_ends_the_task(db_url: str, tmp_path: Path) -> None:
    workspace = tmp_path / "ws"
    workspace.mkdir()
    spec = _spec("deadline", workspace, "http://unused", deadline_s=2.0)
    row, runtime = _run(db_url, spec, ["sleep 30", "ls"])
    assert row["status"] == "ended_deadline", row
    calls = [e["payload"] for e in runtime.store.events("deadline") if e["kind"] == "tool_call"]
    assert calls[0]["status"] == "timeout" and calls[0]["duration_s"] < 5  # capped by the deadline


def test_gate_denials_are_told_to_the_agent_or_end_the_task(db_url: str, tmp_path: Path) -> None:
    workspace = tmp_path / "ws"
    workspace.mkdir()
    outside = tmp_path / "outside.txt"
    commands = [f"echo pwned > {outside}", "curl -sf -X POST http://127.0.0.1:9/x", "echo ok > in.txt"]
    row, runtime = _run(db_url, _spec("deny", workspace, "http://unused"), commands)
    assert row["status"] == "succeeded" and not outside.exists() and (workspace / "in.txt").exists()
    # No acceptance command: nothing was checked, and the reason says so (was "acceptance passed").
    assert row["end_reason"] == "agent finished; no acceptance command was given (finishing accepts)"
    gates = [e["payload"] for e in runtime.store.events("deny") if e["kind"] == "gate"]
    assert [(g["verdict"], g["rule"]) for g in gates] == [
        ("deny", "guard.write_outside_workspace"), ("deny", "scope.network"), ("allow", "scope.effects")]
    strict = _spec("deny-end", workspace, "http://unused", scope={"end_on_deny": True})
    row, _ = _run(db_url, strict, commands)
    assert row["status"] == "ended_policy" and "outside the workspace" in row["end_reason"]


def test_same_task_id_attaches_and_a_changed_spec_is_refused(db_url: str, tmp_path: Path) -> None:
    workspace = tmp_path / "ws"
    workspace.mkdir()
    spec = _spec("ident", workspace, "http://127.0.0.1:9")
    runtime = Runtime(RuntimeConfig(db_url=db_url))
    try:
        assert runtime.submit(spec)[1] is True
        assert runtime.submit(spec)[1] is False  # attaches: same row, nothing new
        assert len(runtime.store.tasks()) == 1
        with pytest.raises(SpecConflictError, match="different spec"):
            runtime.submit(spec.model_copy(update={"problem_statement": "other"}))
    finally:
        runtime.close()
    changed = tmp_path / "changed.json"
    changed.write_text(spec.model_copy(update={"problem_statement": "other"}).model_dump_json())
    r = cli(db_url, "submit", str(changed), "--no-wait")
    assert r.returncode == 2 and "different spec" in r.stderr and len(r.stderr.splitlines()) == 1


def test_cli_input_errors_are_one_line_and_exit_2(db_url: str, tmp_path: Path) -> None:
    workspace = tmp_path / "ws"
    workspace.mkdir()
    good = tmp_path / "good.json"
    good.write_text(json.dumps({"task_id": "t1", "problem_statement": "p", "workspace": str(workspace),
                                "agent": {"base_url": "http://127.0.0.1:9/v1", "model": "m"}}))
    assert cli(db_url, "submit", str(good), "--no-wait").returncode == 0
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"task_id": "t2", "problem_statement": "p"}\n')
    malformed = tmp_path / "malformed.jsonl"
    malformed.write_text('{"task_id": "t3"}\n{not json\n')
    cases = [
        (("show", "nope"), "unknown task 'nope'"),
        (("approve", "t1", "abc"), "bad digest"),
        (("deny", "t1", "a" * 64), "no action with digest"),
        (("resume", "nope"), "unknown task"),
        (("submit", str(bad)), "invalid task: workspace: Field required"),
        (("submit", str(malformed)), "line 2: not JSON"),
        (("submit", str(tmp_path / "missing.json")), "cannot read"),
    ]
    for args, expected in cases:
        r = cli(db_url, *args)
        assert r.returncode == 2, (args, r.stdout, r.stderr)
        assert expected in r.stderr and len(r.stderr.strip().splitlines()) == 1, (args, r.stderr)
    listing = cli(db_url, "list")
    assert listing.returncode == 0 and "t1" in listing.stdout and "submitted" in listing.stdout


def _closed_port() -> int:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def test_cli_database_and_flag_errors_are_one_line_naming_the_flag(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """A database that is down, malformed or not a file was a 130-line traceback (or, for
    ``sqlite://``, a quiet in-memory database); ``--status bogus`` and ``--events -1`` were taken."""
    from mars_openhands.runtime.cli import main

    workspace = tmp_path / "ws"
    workspace.mkdir()
    spec = tmp_path / "t.json"
    spec.write_text(json.dumps({"task_id": "t1", "problem_statement": "p", "workspace": str(workspace),
                                "agent": {"base_url": "http://127.0.0.1:9/v1", "model": "m"}}))
    down = f"postgresql://mars:secret@127.0.0.1:{_closed_port()}/tasks"
    shown = down.replace(":secret@", ":***@")
    refused = f"--db {shown}: cannot open the tasks database ("
    (tmp_path / "afile").write_text("")
    digest = "a" * 64
    cases = [
        *[((*args, "--db", down), refused) for args in (
            ("list",), ("show", "t1"), ("report",), ("approve", "t1", digest), ("deny", "t1", digest),
            ("resume",), ("resume", "t1"), ("submit", str(spec), "--no-wait"))],
        (("list", "--db", "postgresql://mars:secret@127.0.0.1:notaport/x"),
         "--db postgresql://mars:***@127.0.0.1:notaport/x: not a database URL"),
        (("list", "--db", "mysql://h/x"), "--db: tasks database 'mysql://h/x': unsupported scheme 'mysql'"),
        (("list", "--db", "sqlite://"), "--db sqlite://: no database file"),
        (("list", "--db", str(tmp_path)), f"--db {tmp_path}: {tmp_path} is a directory"),
        (("list", "--db", str(tmp_path / "none" / "t.sqlite")), "no tasks database at"),
        (("resume", "--db", str(tmp_path / "none" / "t.sqlite")), "no tasks database at"),
        (("submit", str(spec), "--no-wait", "--db", str(tmp_path / "afile" / "t.sqlite")),
         "cannot create the tasks database"),
        (("--db", down, "list"), refused),  # before the command too (was "invalid choice: '<URL>'")
        (("--db", down, "list", "--db", down.replace("secret", "other")), "--db given twice (postgresql://mars:***@"),
        (("list", "--status", "bogus"), "--status: invalid choice: 'bogus' (choose from 'submitted', "),
        (("show", "t1", "--events", "-1"), "--events: expected an integer >= 0"),
    ]
    for args, expected in cases:
        try:
            code = main(list(args))
        except SystemExit as e:  # argparse's own errors
            code = e.code
        err = capsys.readouterr().err
        assert code == 2, (args, err)
        assert expected in err and len(err.strip().splitlines()) == 1, (args, err)
        assert "secret" not in err and "Traceback" not in err, (args, err)
    assert not (tmp_path / "none").exists()  # a refused resume made no database


def test_list_says_when_a_task_runner_is_gone(db_url: str, tmp_path: Path) -> None:
    """A task whose runner was SIGKILLed showed ``running`` in ``tasks list``: the runner's pid and
    start time are in the database, so the list tells a live runner from a gone one."""
    import os
    import socket
    import sys

    from mars_openhands.process_tree import process_start_ticks
    from mars_openhands.runtime.store import Store
    from tests.unit.runtime.helpers import ROOT, TASKS_CLI

    store = Store(db_url)
    killed = subprocess.Popen(["sleep", "60"])
    reaped = subprocess.Popen(["sleep", "60"])
    runners = {"alive": os.getpid(), "zombie": killed.pid, "reaped": reaped.pid}
    try:
        for task_id, pid in runners.items():
            store.create_task(task_id, "{}", "d", "chat", None)
            store.claim(task_id, {"id": f"r-{task_id}", "host": socket.gethostname(), "pid": pid,
                                  "start_ticks": process_start_ticks(pid)})
        store.create_task("stored", "{}", "d", "chat", None)  # `submit --no-wait`: never claimed
        killed.kill()  # SIGKILLed and not yet reaped by its parent: a zombie
        reaped.kill()
        reaped.wait()
        out = subprocess.run([*TASKS_CLI, "--db", db_url, "list"], cwd=ROOT, capture_output=True,
                             text=True, timeout=120, env={**os.environ, "PYTHONPATH": str(ROOT)},
                             executable=sys.executable)
    finally:
        killed.kill()
        killed.wait()
        store.close()
    assert out.returncode == 0, out.stderr
    status = {line.split()[0]: line.split(None, 2)[2].rsplit(None, 1)[0].strip()
              for line in out.stdout.splitlines()[1:]}
    assert status == {"alive": "running", "zombie": "running (runner gone; tasks resume zombie)",
                      "reaped": "running (runner gone; tasks resume reaped)",
                      "stored": "submitted (no runner; tasks resume stored)"}, out.stdout


def test_list_status_choices_are_every_status_a_task_takes() -> None:
    from mars_openhands.runtime.config import TASK_STATUSES
    from mars_openhands.runtime.store import TERMINAL_STATUSES

    assert TERMINAL_STATUSES <= set(TASK_STATUSES)
    assert {"submitted", "running", "waiting_approval", "escalated"} <= set(TASK_STATUSES)


def test_a_task_sends_the_session_token_it_keeps_in_the_database(db_url: str, tmp_path: Path) -> None:
    """Issue 33 items 4/6: the token a gateway binds the task's session to is made once and kept
    with the task, so every run of the task (a resume by another process too) sends it."""
    import httpx

    from mars_openhands.runtime.agent import SESSION_TOKEN_HEADER
    from mars_openhands.runtime.store import Store

    workspace = git_workspace(tmp_path / "ws")
    spec = _spec("token", workspace, "http://127.0.0.1:9")
    script = Script(name="token", session_id=session_id_of("token"), turns=(_turn("ls"),))
    with serve_app(build_playback_app([script])) as url:
        spec = spec.model_copy(update={"agent": spec.agent.model_copy(update={"base_url": url + "/v1"})})
        with Runtime(RuntimeConfig(db_url=db_url)) as runtime:
            runtime.submit(spec)
            runtime.start("token")
            assert runtime.wait(["token"], timeout_s=120)[0]["status"] == "succeeded"
        requests = httpx.get(f"{url}/playback/requests").json()["requests"]
    other = Store(db_url)  # another process's view of the same database
    try:
        token = other.session_token("token")
        assert other.session_token("token") == token and len(token) >= 22
        assert other.session_token("another") != token
    finally:
        other.close()
    assert [r["header_token"] for r in requests] == [token, token]  # the ls turn, then finish
    assert SESSION_TOKEN_HEADER.lower() == "x-mars-session-token"
    events = json.dumps(cli(db_url, "show", "token").stdout)
    assert token not in events  # never printed with the task
