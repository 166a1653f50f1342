"""Approvals bound to the action digest: single use, refused when replayed or forged, durable.

A runner process runs a task whose irreversible HTTP POSTs (to a counter service on loopback) need
a person's approval; decisions come from the CLI in other processes, as they would from another
shell, and the counter service is the judge of what ran.
"""

from __future__ import annotations

import json
import signal
from pathlib import Path

import pytest

from mars_openhands.openhands.playback import (
    RecordedToolCall,
    RecordedTurn,
    Script,
    build_playback_app,
)
from mars_openhands.runtime.agent import session_id_of
from mars_openhands.runtime.effects import Action
from mars_openhands.runtime.store import TERMINAL_STATUSES, Store
from tests.openhands._helpers import serve_app
from tests.unit.control.gateway_helpers import wait_until as wait_for
from tests.unit.runtime.helpers import CounterServer, cli, start_runner

pytestmark = pytest.mark.timeout(300)


def _post(url: str) -> RecordedTurn:
    return RecordedTurn(content="notify", tool_calls=(RecordedToolCall(
        name="terminal", arguments={"command": f"curl -sf -X POST {url}"}),))


def _task_file(tmp_path: Path, task_id: str, model_url: str) -> Path:
    workspace = tmp_path / "ws"
    workspace.mkdir(exist_ok=True)
    path = tmp_path / f"{task_id}.json"
    path.write_text(json.dumps({
        "task_id": task_id, "problem_statement": "notify the service", "workspace": str(workspace),
        "agent": {"base_url": model_url + "/v1", "model": "playback"}, "scope": {"network": True}}))
    return path


def _pending(store: Store, task_id: str, count: int = 1) -> list[dict]:
    return wait_for(lambda: (lambda p: p if len(p) == count else None)(
        store.approvals(task_id, status="pending")), 60, f"{count} pending request(s) in {task_id}")


def _digest(url: str, workspace: Path) -> str:
    return Action.build("terminal", {"command": f"curl -sf -X POST {url}"}, workspace).digest()


def _send(db_url: str, task_id: str, message: dict, topic: str) -> None:
    from dbos import DBOSClient

    client = DBOSClient(system_database_url=db_url)
    try:
        client.send(task_id, message, topic=topic)
    finally:
        client.destroy()


def test_an_approval_runs_exactly_one_action_with_its_digest(db_url: str, tmp_path: Path) -> None:
    task_id = "approvals"
    with CounterServer() as counter:
        same, changed = f"{counter.url}/incr/notify", f"{counter.url}/incr/notify?again=1"
        script = Script(name="a", session_id=session_id_of(task_id),
                        turns=(_post(same), _post(same), _post(changed)))
        with serve_app(build_playback_app([script])) as model_url:
            runner = start_runner(db_url, "submit", str(_task_file(tmp_path, task_id, model_url)),
                                  env={}, log=tmp_path / "runner.log")
            store = Store(db_url)
            try:
                ws = tmp_path / "ws"
                d_same, d_changed = _digest(same, ws), _digest(changed, ws)
                first = _pending(store, task_id)[0]
                assert first["digest"] == d_same and counter.hits["notify"] == 0
                bad = cli(db_url, "approve", task_id, "not-a-digest")
                assert bad.returncode == 2 and "64-hex" in bad.stderr and len(bad.stderr.splitlines()) == 1
                wrong = cli(db_url, "approve", task_id, d_changed)  # nothing waits with this digest
                assert wrong.returncode == 2 and "no action with digest" in wrong.stderr
                assert cli(db_url, "approve", task_id, d_same).returncode == 0
                # The same action again (next step, same digest) needs a new approval.
                second = wait_for(lambda: next((a for a in store.approvals(task_id, status="pending")
                                                if a["request_id"] != first["request_id"]), None), 60,
                                  "the second request")
                assert second["digest"] == d_same and counter.hits["notify"] == 1
                # A replayed approval (the first one's message) and a forged one are refused.
                topic = f"decision:{second['request_id']}"
                _send(db_url, task_id, {"request_id": first["request_id"], "digest": d_same}, topic)
                _send(db_url, task_id, {"request_id": second["request_id"], "digest": d_same}, topic)
                wait_for(lambda: sum(1 for e in store.events(task_id) if e["kind"] == "approval_refused") >= 2,
                         30, "two refusals")
                assert counter.hits["notify"] == 1
                assert store.approval(second["request_id"])["status"] == "pending"
                reused = cli(db_url, "approve", task_id, d_changed)  # the changed call is not waiting yet
                assert reused.returncode == 2
                assert cli(db_url, "deny", task_id, d_same, "--reason", "once is enough").returncode == 0
                # The changed argument is a new digest: a new request, and its own approval.
                third = _pending(store, task_id)[0]
                assert third["digest"] == d_changed
                assert cli(db_url, "approve", task_id, d_changed).returncode == 0
                assert runner.wait(60) == 0, (tmp_path / "runner.log").read_text()[-2000:]
                assert counter.hits["notify"] == 1 and counter.hits["notify?again=1"] == 1
                assert store.task(task_id)["status"] == "succeeded"
                statuses = [a["status"] for a in store.approvals(task_id)]
                assert statuses == ["consumed", "denied", "consumed"]
                replay = cli(db_url, "approve", task_id, d_same)  # used approvals cannot be re-applied
                assert replay.returncode == 2 and "already" in replay.stderr
            finally:
                runner.kill()
                store.close()


def test_approvals_survive_runner_restarts(db_url: str, tmp_path: Path) -> None:
    task_id = "durable-approval"
    crash_log = tmp_path / "crashed.txt"
    env = {"MARS_RUNTIME_CRASH_AT": "before:tool:1:*", "MARS_RUNTIME_CRASH_LOG": str(crash_log)}
    with CounterServer() as counter:
        url = f"{counter.url}/incr/notify"
        script = Script(name="r", session_id=session_id_of(task_id), turns=(_post(url),))
        with serve_app(build_playback_app([script])) as model_url:
            log = tmp_path / "runner.log"
            runner = start_runner(db_url, "submit", str(_task_file(tmp_path, task_id, model_url)), env=env, log=log)
            store = Store(db_url)
            try:
                request = _pending(store, task_id)[0]
                runner.send_signal(signal.SIGKILL)  # the runner dies while the task waits
                runner.wait(30)
                assert cli(db_url, "approve", task_id, request["digest"]).returncode == 0  # no runner alive
                # The next runner replays to the wait, takes the approval, and crashes before the call.
                second = start_runner(db_url, "resume", task_id, env=env, log=log)
                assert second.wait(60) == -9 and crash_log.read_text().split() == ["before:tool:1:irreversible"]
                assert counter.hits["notify"] == 0
                third = start_runner(db_url, "resume", task_id, env=env, log=log)
                assert third.wait(60) == 0, log.read_text()[-2000:]
                assert counter.hits["notify"] == 1  # the one approval ran the action once
                row = store.task(task_id)
                assert row["status"] == "succeeded" and row["num_runs"] == 3
                assert [a["status"] for a in store.approvals(task_id)] == ["consumed"]
                assert row["status"] in TERMINAL_STATUSES
            finally:
                runner.kill()
                store.close()
