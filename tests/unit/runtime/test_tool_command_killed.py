"""A SIGKILLed ``tasks`` runner leaves none of its tool command running, and the resumed task treats
the call as in doubt (docs/structure.md, "Child processes when a launcher is killed").

The tool command makes an unkeyed HTTP POST to a counter service on loopback (irreversible), then
runs a ``setsid`` shell (a session of its own) with a ``sleep`` in it, to POST again once the sleep
ends. The runner is
SIGKILLed while the sleep runs: every process of the command must end within ``BOUND_S``, with
both cores busy as well. Then ``tasks resume``: the call is in doubt, so it is not run again but
escalated (``in_doubt``); denied, it is recorded ``not_repeated`` and the task finishes. The
counter holds the one POST from before the kill: nothing ran it again, nothing finished it late.

Before the fix (``bash -c`` started by the runner with nothing to end it) the ``setsid`` shell and
its ``sleep`` ran on, re-parented to pid 1, after the runner's SIGKILL.
"""

from __future__ import annotations

import contextlib
import json
import signal
import time
from pathlib import Path

import pytest

from mars_openhands.openhands.playback import (
    RecordedToolCall,
    RecordedTurn,
    Script,
    build_playback_app,
)
from mars_openhands.runtime.agent import session_id_of
from mars_openhands.runtime.store import Store
from tests.openhands._helpers import serve_app
from tests.proc_tree import (
    assert_ends_with_owner,
    busy_cpus,
    kill_alive,
    kill_leftovers,
    runs_under,
    wait_until,
    with_marker,
)
from tests.unit.runtime.helpers import (
    CounterServer,
    cli,
    deny_in_doubt,
    git_workspace,
    start_runner,
)

pytestmark = pytest.mark.timeout(300)

BOUND_S = 15.0
"""Seconds within which the command's processes must be gone after the runner's SIGKILL (the host
sees its owner's pidfd at once, then SIGTERM, 2 s grace, SIGKILL; generous for 2 busy cores)."""


TASK_ID = "killed-tool"


def _script(command: str) -> Script:
    return Script(name=TASK_ID, session_id=session_id_of(TASK_ID), turns=(
        RecordedTurn(content="run it", tool_calls=(RecordedToolCall(name="terminal", arguments={"command": command}),)),
        RecordedTurn(content="done", tool_calls=(RecordedToolCall(name="finish", arguments={"message": "done"}),)),
    ))


def _task_file(tmp_path: Path, workspace: Path, model_url: str) -> Path:
    spec = {"task_id": TASK_ID, "problem_statement": "run the command", "workspace": str(workspace),
            "agent": {"base_url": model_url + "/v1", "model": "playback"},
            "scope": {"allowed_effects": ["read", "idempotent_write", "compensable_write", "irreversible"],
                      "approval_effects": [], "network": True}}
    path = tmp_path / "task.json"
    path.write_text(json.dumps(spec))
    return path


@pytest.mark.parametrize("load", ["idle", "busy", "busy-again"])
@pytest.mark.parametrize("db_url", ["sqlite"], indirect=True)
def test_a_sigkilled_runner_ends_its_tool_command_and_resume_escalates_it(db_url: str, load: str,
                                                                         tmp_path: Path) -> None:
    workspace = git_workspace(tmp_path / "ws")
    marker = str(tmp_path / "tool-marker")
    log = tmp_path / "runner.log"
    with CounterServer() as counter:
        command = (f"curl -sf -X POST {counter.url}/incr/notify; "
                   f"setsid bash -c 'sleep 300; curl -sf -X POST {counter.url}/incr/late; : {marker}'")
        with serve_app(build_playback_app([_script(command)])) as model_url:
            task_file = _task_file(tmp_path, workspace, model_url)
            runner = start_runner(db_url, "submit", str(task_file), env={}, log=log)
            started: dict[int, int] = {}
            try:
                with busy_cpus() if load.startswith("busy") else contextlib.nullcontext():
                    # The POST has returned and the setsid shell sleeps (the runner's own shell holds the
                    # marker from the start: waiting for marked processes alone could kill before the POST).
                    assert wait_until(lambda: counter.hits["notify"] == 1 and runs_under(marker, "sleep 300"),
                                      60.0), log.read_text()[-3000:]
                    started = with_marker(marker)
                    t0 = time.monotonic()
                    assert_ends_with_owner(runner, started, signal.SIGKILL, BOUND_S)
                    print(f"{load}: {len(started)} processes of the command ended "
                          f"{time.monotonic() - t0:.2f} s after the SIGKILL")
            finally:
                kill_leftovers(runner, {**started, **with_marker(marker)})
            assert counter.hits["notify"] == 1 and counter.hits["late"] == 0
            _resume_and_deny(db_url, log, TASK_ID)
    store = Store(db_url)
    row, effects = store.task(TASK_ID), {e["step"]: e for e in store.effects(TASK_ID)}
    store.close()
    assert row is not None and row["status"] == "succeeded", (row, log.read_text()[-3000:])
    assert effects[1]["effect"] == "irreversible" and effects[1]["status"] == "not_repeated", effects[1]
    assert counter.hits == {"notify": 1}  # not run again on resume, not finished late


def _resume_and_deny(db_url: str, log: Path, task_id: str) -> None:
    """``tasks resume``; deny the in-doubt escalation of the killed call; wait for the runner."""
    runner = start_runner(db_url, "resume", task_id, env={}, log=log)
    store = Store(db_url)
    denied = []
    deadline = time.monotonic() + 120.0
    try:
        while runner.poll() is None and time.monotonic() < deadline:
            denied += deny_in_doubt(store, db_url, task_id, "checked: it ran")
            time.sleep(0.05)
        assert runner.returncode == 0 and len(denied) == 1, (runner.returncode, denied, log.read_text()[-3000:])
    finally:
        store.close()
        if runner.poll() is None:
            runner.kill()
            runner.wait()


@pytest.mark.timeout(60)
def test_a_tool_timeout_ends_what_the_command_setsid_in_the_background(tmp_path: Path) -> None:
    """At its timeout a command's whole tree ends, not its group only: a ``setsid`` child in the
    background (holding the output pipe) no longer keeps the call, or its process, running.
    Before (the group killed): the call hung until that child ended (300 s here)."""
    from mars_openhands.runtime.tools import run_terminal

    marker = str(tmp_path / "background-marker")
    command = f"setsid bash -c 'sleep 300; : {marker}' & sleep 300"
    t0 = time.monotonic()
    try:
        result = run_terminal(command, tmp_path, "key", "task", timeout_s=1.0, max_chars=1000)
        assert result["status"] == "timeout" and time.monotonic() - t0 < 10.0, result
        assert wait_until(lambda: not with_marker(marker), 5.0), with_marker(marker)
    finally:
        kill_alive(with_marker(marker))


APPEND_TASK_ID = "killed-append"


@pytest.mark.parametrize("db_url", ["sqlite"], indirect=True)
def test_a_killed_append_is_not_run_again_but_escalated(db_url: str, tmp_path: Path) -> None:
    """A user's report: ``echo one >> log.txt; sleep 8``, runner SIGKILLed once ``log.txt`` existed,
    then ``tasks resume``. The append was classed ``idempotent_write`` and ran again (``log.txt``
    held ``one`` twice) while ``tasks report`` said 0 duplicates. Now it is a ``local_write``: in
    doubt, it escalates; denied, it is ``not_repeated`` and the file holds one line."""
    workspace = git_workspace(tmp_path / "ws")
    log = tmp_path / "runner.log"
    script = Script(name=APPEND_TASK_ID, session_id=session_id_of(APPEND_TASK_ID), turns=(
        RecordedTurn(content="run it", tool_calls=(RecordedToolCall(
            name="terminal", arguments={"command": "echo one >> log.txt; sleep 300"}),)),
        RecordedTurn(content="done", tool_calls=(RecordedToolCall(name="finish", arguments={"message": "done"}),)),
    ))
    with serve_app(build_playback_app([script])) as model_url:
        spec = {"task_id": APPEND_TASK_ID, "problem_statement": "append", "workspace": str(workspace),
                "agent": {"base_url": model_url + "/v1", "model": "playback"}}  # the default scope
        task_file = tmp_path / "task.json"
        task_file.write_text(json.dumps(spec))
        runner = start_runner(db_url, "submit", str(task_file), env={}, log=log)
        try:
            assert wait_until(lambda: (workspace / "log.txt").exists(), 60.0), log.read_text()[-3000:]
            runner.send_signal(signal.SIGKILL)
            runner.wait(30)
        finally:
            if runner.poll() is None:
                runner.kill()
                runner.wait()
        _resume_and_deny(db_url, log, APPEND_TASK_ID)
    store = Store(db_url)
    row, effects = store.task(APPEND_TASK_ID), {e["step"]: e for e in store.effects(APPEND_TASK_ID)}
    approvals = store.approvals(APPEND_TASK_ID)
    store.close()
    assert (workspace / "log.txt").read_text() == "one\n"  # before the fix: "one\none\n"
    assert row is not None and row["status"] == "succeeded", (row, log.read_text()[-3000:])
    assert (effects[1]["effect"], effects[1]["status"], effects[1]["num_attempts"]) == (
        "local_write", "not_repeated", 1), effects[1]
    assert [a["kind"] for a in approvals] == ["in_doubt"] and "not provably a no-op" in approvals[0]["reason"]
    report = cli(db_url, "report")
    assert report.returncode == 0, report.stderr
    assert "possible duplicate side effects" in report.stdout, report.stdout
