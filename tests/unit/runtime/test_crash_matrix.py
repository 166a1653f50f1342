"""Crash matrix: the runner is SIGKILLed at every step boundary of a scripted task and restarted.

The task (playback model, real tools in a temporary git workspace, a counter service on loopback)
makes one call of each effect class: ``ls`` (read), a file create (idempotent write), a keyed HTTP
POST (idempotent write over the network), ``git commit`` (compensable write) and an unkeyed HTTP
POST (irreversible). The runner kills itself at the first boundary not yet crashed at
(``MARS_RUNTIME_CRASH_AT=*``), so the chain of runs crashes once at every boundary: before, in the
executed-not-recorded window, and after each of the 6 LLM calls and 5 tool calls. Checked at the
targets: the file's content, the counter service's applied counts and raw hits, the git history, and
the playback server's requests per turn.
"""

from __future__ import annotations

import json
import resource
import time
from pathlib import Path

import httpx
import pytest

from mars_openhands.openhands.playback import (
    RecordedToolCall,
    RecordedTurn,
    Script,
    build_playback_app,
)
from mars_openhands.runtime.agent import session_id_of
from mars_openhands.runtime.store import TERMINAL_STATUSES, Store
from tests.openhands._helpers import serve_app
from tests.unit.runtime.helpers import (
    CounterServer,
    deny_in_doubt,
    git_workspace,
    start_runner,
)

pytestmark = [pytest.mark.integration, pytest.mark.timeout(600)]

TOOL_CLASSES = ("read", "idempotent_write", "idempotent_write", "compensable_write", "irreversible")


def _turn(name: str, **arguments: object) -> RecordedTurn:
    return RecordedTurn(content=f"calling {name}", tool_calls=(RecordedToolCall(name=name, arguments=arguments),))


def scripted_task(task_id: str, workspace: Path, counter_url: str) -> Script:
    return Script(name="crash-matrix", session_id=session_id_of(task_id), turns=(
        _turn("terminal", command="ls"),
        _turn("file_editor", command="create", path="notes.txt", file_text="hello\n"),
        _turn("terminal", command=f'curl -sf -X POST -H "Idempotency-Key: $MARS_IDEMPOTENCY_KEY" {counter_url}/incr/keyed'),
        _turn("terminal", command="git add notes.txt && git commit -qm notes"),
        _turn("terminal", command=f"curl -sf -X POST {counter_url}/incr/notify"),
    ))


def expected_boundaries() -> set[str]:
    """Step n: LLM calls at even steps 0..10, tool calls at odd steps 1..9."""
    names = set()
    for i in range(6):
        names |= {f"{phase}:llm:{2 * i}" for phase in ("before", "executed", "after")}
    for i, effect in enumerate(TOOL_CLASSES):
        names |= {f"{phase}:tool:{2 * i + 1}:{effect}" for phase in ("before", "executed", "after")}
    return names


def _task_file(tmp_path: Path, task_id: str, workspace: Path, model_url: str) -> Path:
    spec = {"task_id": task_id, "problem_statement": "write notes, notify, commit",
            "workspace": str(workspace), "agent": {"base_url": model_url + "/v1", "model": "playback"},
            "scope": {"allowed_effects": ["read", "idempotent_write", "compensable_write", "irreversible"],
                      "approval_effects": [], "network": True},
            "acceptance": {"command": "grep -qx hello notes.txt && git log --format=%s | grep -qx notes"}}
    path = tmp_path / "task.json"
    path.write_text(json.dumps(spec))
    return path


def _run_chain(db_url: str, task_file: Path, task_id: str, tmp_path: Path) -> tuple[int, list[str]]:
    """Run, crash, resume until the task ends; answer the one escalation with deny (it happened)."""
    crash_log = tmp_path / "crashed.txt"
    env = {"MARS_RUNTIME_CRASH_AT": "*", "MARS_RUNTIME_CRASH_LOG": str(crash_log)}
    args = ["submit", str(task_file)]
    num_runs, denied = 0, []
    store = Store(db_url)
    while num_runs < 60:
        proc = start_runner(db_url, *args, env=env, log=tmp_path / "runner.log")
        num_runs += 1
        while proc.poll() is None:
            denied += deny_in_doubt(store, db_url, task_id, "checked: it was sent")
            time.sleep(0.05)
        row = store.task(task_id)
        if row is not None and row["status"] in TERMINAL_STATUSES:
            assert proc.returncode in (0, 1), (tmp_path / "runner.log").read_text()[-3000:]
            break
        assert proc.returncode == -9, (tmp_path / "runner.log").read_text()[-3000:]
        args = ["resume", task_id]
    store.close()
    return num_runs, denied


@pytest.mark.parametrize("db_url", ["sqlite"], indirect=True)  # postgres: test_crash_matrix_postgres.py
def test_kill_at_every_step_boundary_completes_without_duplicates(db_url: str, tmp_path: Path) -> None:
    task_id = "crash-matrix"
    workspace = git_workspace(tmp_path / "ws")
    t0 = time.monotonic()
    with CounterServer() as counter:
        script = scripted_task(task_id, workspace, counter.url)
        with serve_app(build_playback_app([script])) as model_url:
            num_runs, denied = _run_chain(db_url, _task_file(tmp_path, task_id, workspace, model_url),
                                          task_id, tmp_path)
            requests = httpx.get(f"{model_url}/playback/requests").json()["requests"]
    children = resource.getrusage(resource.RUSAGE_CHILDREN)
    print(f"crash matrix on {db_url.split(':')[0]}: {num_runs} runner processes, "
          f"{time.monotonic() - t0:.1f} s wall, {children.ru_utime + children.ru_stime:.1f} CPU-s in them")
    crashed = (tmp_path / "crashed.txt").read_text().split()
    assert len(crashed) == len(set(crashed))
    assert set(crashed) == expected_boundaries()  # each boundary crashed at exactly once
    assert num_runs == len(crashed) + 1
    store = Store(db_url)
    row = store.task(task_id)
    assert row is not None and row["status"] == "succeeded", (row, (tmp_path / "runner.log").read_text()[-3000:])
    effects = {e["step"]: e for e in store.effects(task_id)}
    store.close()
    # Targets: one file write, one keyed write applied, one notification, one commit.
    assert (workspace / "notes.txt").read_text() == "hello\n"
    assert counter.applied["keyed"] == 1 and counter.hits["keyed"] == 2  # repeated with its key
    assert counter.hits["notify"] == 1  # the irreversible POST never ran twice ...
    assert len(denied) == 1 and effects[9]["status"] == "not_repeated"  # ... it escalated instead
    log = [line for line in _git_log(workspace) if line == "notes"]
    assert log == ["notes"]  # the in-doubt commit was undone before it ran again
    # Completed steps never re-executed: each LLM turn was asked twice (once lost in the
    # executed-not-recorded window), never a third time; tools ran twice only after that window.
    turns = [r["turn"] for r in requests]
    assert sorted(set(turns)) == list(range(6)) and all(turns.count(t) == 2 for t in range(6))
    assert [effects[s]["num_attempts"] for s in (1, 3, 5, 7, 9)] == [2, 2, 2, 2, 1]


def _git_log(workspace: Path) -> list[str]:
    import subprocess

    return subprocess.run(["git", "log", "--format=%s"], cwd=workspace, capture_output=True,
                          text=True, check=True).stdout.split()
