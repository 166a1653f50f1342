"""A real OpenHands conversation (real tools, real workspace) driven by the playback engine.

The model's choices are played back; OpenHands' agent loop, tool parsing and execution, the tool
wrapper's events and the runner's results are real.
"""

from __future__ import annotations

import subprocess
import uuid
from pathlib import Path

import httpx
import pytest

pytest.importorskip("openhands.sdk", reason="needs the OpenHands env (.venv-openhands)")

from mars_openhands.openhands.llm import LLMSettings  # noqa: E402
from mars_openhands.openhands.playback import (  # noqa: E402
    RecordedToolCall,
    RecordedTurn,
    Script,
    build_playback_app,
)
from mars_openhands.openhands.runner import RunConfig, TaskSpec, run_task  # noqa: E402
from mars_openhands.stream.events import parse_event  # noqa: E402
from tests.openhands._helpers import EventCollector, serve_app  # noqa: E402

pytestmark = [pytest.mark.openhands, pytest.mark.timeout(900)]


def _turn(name: str, **arguments: object) -> RecordedTurn:
    return RecordedTurn(content=f"calling {name}",
                        tool_calls=(RecordedToolCall(name=name, arguments=dict(arguments)),))


def workspace_script(session_id: str, workspace: Path, outside: Path) -> Script:
    """Terminal, file editor, a command the policy denies, task tracker; then finish."""
    return Script(name=f"script-{session_id[:8]}", session_id=session_id, turns=(
        _turn("terminal", command="ls -la && sleep 0.2 && echo slept"),
        _turn("file_editor", command="create", path=str(workspace / "hello.py"),
              file_text="print('hello')\n"),
        _turn("terminal", command=f"echo pwned > {outside}"),
        _turn("terminal", command="python3 hello.py > out.txt"),
        _turn("task_tracker", command="plan",
              task_list=[{"title": "say hello", "notes": "", "status": "done"}]),
    ))


def test_conversation_runs_real_tools_and_reports_events(tmp_path: Path) -> None:
    workspace = tmp_path / "ws"
    workspace.mkdir()
    outside = tmp_path / "outside.txt"
    session_id = str(uuid.uuid4())
    app = build_playback_app([workspace_script(session_id, workspace, outside)])
    with serve_app(app) as url, EventCollector() as collector:
        config = RunConfig(llm=LLMSettings(backend="mars", base_url=f"{url}/v1", model="playback",
                                           temperature=0.0),
                           events_url=collector.url, out_dir=str(tmp_path / "out"))
        task = TaskSpec(task_id="t0", problem_statement="print hello", workspace=str(workspace),
                        session_id=session_id)
        result = run_task(task, config)
        requests = httpx.get(f"{url}/playback/requests").json()["requests"]
    assert result.status == "finished", result.error
    assert (workspace / "out.txt").read_text() == "hello\n"  # the agent's commands really ran
    assert not outside.exists()  # the denied one did not
    assert sorted(result.files_changed) == ["hello.py", "out.txt"]
    assert (result.num_tool_calls, result.num_denied, result.num_llm_calls) == (5, 1, 6)
    # The SDK's own per-call latencies, joined to what the engine answered (the playback's ids).
    assert [c.response_id for c in result.llm_calls] == [r["response_id"] for r in requests]
    assert all(c.latency_s >= r["handle_s"] for c, r in zip(result.llm_calls, requests, strict=True))
    assert result.llm_s == pytest.approx(sum(c.latency_s for c in result.llm_calls))
    assert 0 < result.llm_s < result.wall_s
    assert result.num_completion_tokens == 6 * 16  # the playback's default completion length
    # Every request carried the session; the turn metadata counted up per LLM call.
    assert {r["header_session"] for r in requests} == {session_id}
    assert [r["vllm_xargs"]["mars_turn"] for r in requests] == list(range(6))
    # What the gateway would have received equals the local log, session_start first, end last.
    posted = [parse_event(e) for e in collector.events]
    assert sorted(posted, key=lambda e: e.t_mono_ns) == [parse_event(e) for e in
                                                         sorted(result.events, key=lambda e: e["t_mono_ns"])]
    kinds = [e.kind for e in sorted(posted, key=lambda e: e.t_mono_ns)]
    assert kinds[0] == "session_start" and kinds[-1] == "session_end"
    ends = [e for e in posted if e.kind == "tool_end"]
    assert [(e.tool_name, e.turn, e.status) for e in sorted(ends, key=lambda e: e.t_mono_ns)] == [
        ("terminal", 0, "ok"), ("file_editor", 1, "ok"), ("terminal", 2, "denied"),
        ("terminal", 3, "ok"), ("task_tracker", 4, "ok")]
    starts = {e.tool_call_id: e for e in posted if e.kind == "tool_start"}
    for end in ends:
        if end.status != "denied":
            assert end.duration_s == pytest.approx((end.t_mono_ns - starts[end.tool_call_id].t_mono_ns) / 1e9)
    first = next(e for e in ends if e.turn == 0)
    assert first.duration_s >= 0.2, first  # the sleep ran inside the measured interval
    assert all(e.session_id == session_id for e in posted)


def test_repo_task_returns_a_patch(tmp_path: Path) -> None:
    repo = tmp_path / "repo"
    repo.mkdir()
    (repo / "calc.py").write_text("def add(a, b):\n    return a - b\n")
    for args in (["init", "-q"], ["add", "."], ["-c", "user.email=t@t", "-c", "user.name=t",
                                                 "commit", "-qm", "init"]):
        subprocess.run(["git", *args], cwd=repo, check=True)
    session_id = str(uuid.uuid4())
    script = Script(name="fix", session_id=session_id, turns=(
        _turn("terminal", command="sed -i 's/a - b/a + b/' calc.py && cat calc.py"),))
    with serve_app(build_playback_app([script])) as url:
        config = RunConfig(llm=LLMSettings(backend="url", base_url=f"{url}/v1", model="playback"),
                           out_dir=str(tmp_path / "out"))
        result = run_task(TaskSpec(task_id="fix-add", problem_statement="add() subtracts",
                                   repo=str(repo), session_id=session_id), config)
    assert result.status == "finished", result.error
    assert result.files_changed == ["calc.py"]
    assert "-    return a - b" in result.patch and "+    return a + b" in result.patch
    assert (repo / "calc.py").read_text().endswith("a - b\n")  # the original repo is untouched


TRACE = Path("/work/shared/data/traces/mini-swe-agent/deepseek_chat_dev/"
             "marshmallow-code__marshmallow-1343.traj.json.gz")


@pytest.mark.skipif(not TRACE.exists(), reason="bundled mini-swe-agent traces not present")
def test_recorded_trace_turns_run_as_real_terminal_calls(tmp_path: Path) -> None:
    from mars_openhands.openhands.playback import load_trace_script
    from mars_openhands.openhands.policy_check import is_safe_to_replay

    recorded = load_trace_script(TRACE, max_turns=4, is_allowed=is_safe_to_replay)
    session_id = str(uuid.uuid4())
    script = recorded.model_copy(update={"session_id": session_id})
    workspace = tmp_path / "ws"
    workspace.mkdir()
    with serve_app(build_playback_app([script])) as url:
        config = RunConfig(llm=LLMSettings(backend="url", base_url=f"{url}/v1", model="playback"),
                           out_dir=str(tmp_path / "out"))
        result = run_task(TaskSpec(task_id="trace", problem_statement="reproduce the bug",
                                   workspace=str(workspace), session_id=session_id), config)
    assert result.status == "finished", result.error
    assert result.num_tool_calls == 4 and result.num_denied == 0
    # Turn 3 of the recording writes reproduce_issue.py with a heredoc; it really exists now.
    written = (workspace / "reproduce_issue.py").read_text()
    assert "from marshmallow import Schema, fields, validates" in written
    assert result.files_changed == ["reproduce_issue.py"]


def test_tools_beyond_the_wrapped_three_are_evented_in_a_real_conversation(tmp_path: Path) -> None:
    """Issue 16 kind 2: the agent's other tools (here the SDK's think tool; custom and MCP tools
    take the same path) emit tool events, through a slow gateway too."""
    workspace = tmp_path / "ws"
    workspace.mkdir()
    session_id = str(uuid.uuid4())
    script = Script(name="think", session_id=session_id, turns=(
        _turn("think", thought="first list the files"), _turn("terminal", command="ls")))
    with serve_app(build_playback_app([script])) as url, EventCollector(delay_s=0.05) as collector:
        config = RunConfig(llm=LLMSettings(backend="mars", base_url=f"{url}/v1", model="playback"),
                           events_url=collector.url, out_dir=str(tmp_path / "out"),
                           tool_timeout_s=120.0)
        result = run_task(TaskSpec(task_id="think", problem_statement="look around",
                                   workspace=str(workspace), session_id=session_id), config)
    assert result.status == "finished", result.error
    ends = sorted((parse_event(e) for e in collector.events if e["kind"] == "tool_end"),
                  key=lambda e: e.t_mono_ns)
    assert [(e.tool_name, e.turn, e.status) for e in ends] == [("think", 0, "ok"),
                                                               ("terminal", 1, "ok")]
    start = next(e for e in collector.events if e["kind"] == "session_start")
    assert start["tool_timeout_s"] == 120.0  # the task's tool bound, for the gateway
