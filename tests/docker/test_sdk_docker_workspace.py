"""An OpenHands SDK conversation in a Docker workspace, against the gateway, end to end.

The SDK's own ``DockerWorkspace`` (``openhands-workspace`` 1.34.0) runs our agent-server image
(built offline in a private engine, ``conftest.py``); the playback engine behind a real gateway
answers. Checked in the gateway's stream: the conversation's tool events, its session start and
end and their timing are exactly those of the same conversation with the process sandbox (our
agent-server as a local process); the container's clock is the host's (its ``t_mono_ns`` fall
inside the host's window of the run). And a container killed in the middle of a tool call: the
gateway closes the call as ``interrupted`` at its bound and frees the session's slot.
"""

from __future__ import annotations

import contextlib
import os
import platform
import resource
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest
from openhands.sdk import LLM, Agent, Conversation, Tool
from openhands.sdk.workspace import RemoteWorkspace
from openhands.tools.preset.default import register_default_tools
from openhands.workspace import DockerWorkspace
from pydantic import SecretStr

from mars_openhands.openhands.playback import RecordedToolCall, RecordedTurn, Script
from tests.docker._engine import AgentServerImage, PrivateDockerd
from tests.openhands._helpers import (
    free_port,
    playback_behind_gateway,
    serve_process,
    session_events,
    wait_for,
)

pytestmark = [pytest.mark.docker, pytest.mark.openhands, pytest.mark.integration,
              pytest.mark.timeout(1500)]  # a cold image build is in the first one

ROOT = Path(__file__).resolve().parents[2]
IN_CONTAINER = "/workspace/project"  # the image's working directory (the stock image's)
PER_EVENT = ("t_mono_ns", "t_wall", "session_id", "tool_call_id", "duration_s", "queue_wait_s")
"""Event fields that differ between two runs of one conversation (ids, instants, durations)."""


def _turn(name: str, **arguments: object) -> RecordedTurn:
    return RecordedTurn(content=f"calling {name}",
                        tool_calls=(RecordedToolCall(name=name, arguments=dict(arguments)),))


def _script(workdir: str) -> Script:
    return Script(name="docker", turns=(
        _turn("terminal", command="echo mars > note.txt && sleep 1 && cat note.txt"),
        _turn("file_editor", command="view", path=f"{workdir}/note.txt"),
        _turn("task_tracker", command="plan",
              task_list=[{"title": "note", "notes": "", "status": "done"}]),
    ))


def _agent(llm_base_url: str) -> Agent:
    llm = LLM(model="openai/playback", base_url=llm_base_url, api_key=SecretStr("x"),
              usage_id="agent")
    return Agent(llm=llm, tools=[Tool(name="terminal"), Tool(name="file_editor"),
                                 Tool(name="task_tracker")])


def _fit_nofile_limit(monkeypatch: pytest.MonkeyPatch) -> None:
    """``DockerWorkspace`` runs its container with ``--ulimit nofile=65536:65536``; where this
    host's hard limit is lower and root may not raise it (no CAP_SYS_RESOURCE, as on this
    project's CI machines: 20000), runc refuses to start the container ("error setting rlimit
    type 7"). Ask for the host's hard limit instead, in the command the SDK runs."""
    import openhands.workspace.docker.workspace as module

    hard = resource.getrlimit(resource.RLIMIT_NOFILE)[1]
    if hard == resource.RLIM_INFINITY or hard >= 65536:
        return
    run = module.execute_command

    def fitted(cmd: Any, *args: Any, **kwargs: Any) -> Any:
        if isinstance(cmd, list):
            cmd = [f"nofile={hard}:{hard}" if a == "nofile=65536:65536" else a for a in cmd]
        return run(cmd, *args, **kwargs)

    monkeypatch.setattr(module, "execute_command", fitted)


@contextmanager
def _docker_workspace(engine: PrivateDockerd, image: str, events_url: str,
                      monkeypatch: pytest.MonkeyPatch) -> Iterator[DockerWorkspace]:
    """The SDK's ``DockerWorkspace`` on the test engine; the agent-server in it posts to
    ``events_url`` (``forward_env``: the SDK passes these variables from this process)."""
    for name, value in (("DOCKER_HOST", engine.host), ("MARS_EVENTS_URL", events_url),
                        ("MARS_SESSION_POLL_S", "0.1"), ("OPENHANDS_SUPPRESS_BANNER", "1")):
        monkeypatch.setenv(name, value)
    _fit_nofile_limit(monkeypatch)
    arch = "arm64" if platform.machine() in ("aarch64", "arm64") else "amd64"
    workspace = DockerWorkspace(server_image=image, working_dir=IN_CONTAINER, detach_logs=False,
                                forward_env=["MARS_EVENTS_URL", "MARS_SESSION_POLL_S",
                                             "OPENHANDS_SUPPRESS_BANNER"],
                                platform=f"linux/{arch}", health_check_timeout=240.0)
    try:
        yield workspace
    finally:
        workspace.cleanup()


def _converse(workspace: Any, llm_base_url: str, sink: Any) -> tuple[str, list[Any]]:
    """One conversation to its end; returns its id and its CPU-plane events in the stream."""
    conversation = Conversation(agent=_agent(llm_base_url), workspace=workspace)
    sid = str(conversation.id)
    try:
        conversation.send_message("write a note")
        conversation.run()
        wait_for(lambda: [e for e in session_events(sink, sid) if e.kind == "session_end"], 30,
                 f"session_end of {sid}")
    finally:
        conversation.close()
    return sid, session_events(sink, sid)


def _shape(event: Any) -> tuple:
    """What must be equal between two runs of one conversation: the kind, source, tool, status,
    turn and which fields are set."""
    fields = sorted(k for k, v in event.model_dump().items() if v is not None and k not in PER_EVENT)
    return (event.kind, event.source, getattr(event, "tool_name", None),
            getattr(event, "status", None), event.turn, tuple(fields))


def _check_timing(events: list[Any], t0_ns: int, t1_ns: int) -> None:
    """Instants on the host's monotonic clock, durations and waits from their own instants."""
    assert all(t0_ns <= e.t_mono_ns <= t1_ns for e in events), "an instant off the host's clock"
    by_call: dict[str, dict[str, Any]] = {}
    for e in events:
        if e.kind.startswith("tool_"):
            by_call.setdefault(e.tool_call_id, {})[e.kind] = e
    for call in by_call.values():
        queued, start, end = call["tool_enqueued"], call["tool_start"], call["tool_end"]
        assert queued.t_mono_ns <= start.t_mono_ns <= end.t_mono_ns
        assert start.queue_wait_s == pytest.approx((start.t_mono_ns - queued.t_mono_ns) / 1e9)
        assert end.duration_s == pytest.approx((end.t_mono_ns - start.t_mono_ns) / 1e9)
    [terminal] = [c["tool_end"] for c in by_call.values() if c["tool_end"].tool_name == "terminal"]
    # The command's `sleep 1`, timed where it ran: the span covers most of it (the terminal's tmux
    # polling starts its clock after the command was typed: 0.98 s once, 0.88 s with the unit
    # suite running beside it), and not the container's start or the host's queue.
    assert 0.5 <= terminal.duration_s < 30.0


def _process_run(tmp_path: Path) -> tuple[list[Any], int, int]:
    """The conversation with the process sandbox (as tests/openhands/test_agent_server.py)."""
    workdir = tmp_path / "ws"
    workdir.mkdir()
    port = free_port()
    with playback_behind_gateway([_script(str(workdir))]) as (gateway, sink):
        env = {**os.environ, "PYTHONPATH": str(ROOT), "OPENHANDS_SUPPRESS_BANNER": "1",
               "MARS_EVENTS_URL": f"{gateway.url}/mars/v1/events", "MARS_SESSION_POLL_S": "0.1"}
        argv = [sys.executable, "-m", "mars_openhands.openhands.agent_server", "--port", str(port)]
        url = f"http://127.0.0.1:{port}"
        with serve_process(argv, url, tmp_path / "agent-server.log", env, tmp_path):
            t0 = time.monotonic_ns()
            _, events = _converse(RemoteWorkspace(host=url, working_dir=str(workdir)),
                                  gateway.base_url, sink)
            t1 = time.monotonic_ns()
    assert (workdir / "note.txt").read_text() == "mars\n"
    return events, t0, t1


def test_a_docker_workspace_conversation_reaches_the_stream_as_with_the_process_sandbox(
        docker_engine: PrivateDockerd, agent_server_image: AgentServerImage, tmp_path: Path,
        monkeypatch: pytest.MonkeyPatch) -> None:
    register_default_tools(enable_browser=False)  # the client deserializes the stock tools
    local, l0, l1 = _process_run(tmp_path)
    with playback_behind_gateway([_script(IN_CONTAINER)], host="0.0.0.0") as (gateway, sink):
        seen_from_container = f"http://{docker_engine.gateway_ip}:{gateway.config.port}"
        t0 = time.monotonic_ns()
        with _docker_workspace(docker_engine, agent_server_image.tag,
                               f"{seen_from_container}/mars/v1/events", monkeypatch) as workspace:
            sid, events = _converse(workspace, f"{seen_from_container}/v1", sink)
            note = workspace.execute_command(f"cat {IN_CONTAINER}/note.txt")
        t1 = time.monotonic_ns()
        state = gateway.gateway.state()
    assert note.stdout == "mars\n"  # the tools ran in the container
    assert docker_engine.containers(agent_server_image.tag) == []  # the workspace removed it
    kinds = [e.kind for e in events]
    assert kinds[0] == "session_start" and kinds[-1] == "session_end", kinds
    assert [(e.tool_name, e.status, e.turn) for e in events if e.kind == "tool_end"] == [
        ("terminal", "ok", 0), ("file_editor", "ok", 1), ("task_tracker", "ok", 2)]
    assert [_shape(e) for e in events] == [_shape(e) for e in local]  # exactly as in a process
    _check_timing(events, t0, t1)
    _check_timing(local, l0, l1)
    assert sid not in state["sessions"] and state["num_admitted"] == 0  # the slot was released


def test_a_container_killed_mid_tool_ends_the_call_as_interrupted_and_frees_the_slot(
        docker_engine: PrivateDockerd, agent_server_image: AgentServerImage,
        monkeypatch: pytest.MonkeyPatch) -> None:
    register_default_tools(enable_browser=False)
    script = Script(name="killed", turns=(_turn("terminal", command="sleep 300"),))
    bounds = {"tool_call_timeout_s": 5.0, "session_idle_timeout_s": 2.0}
    with playback_behind_gateway([script], host="0.0.0.0", **bounds) as (gateway, sink):
        seen_from_container = f"http://{docker_engine.gateway_ip}:{gateway.config.port}"
        with _docker_workspace(docker_engine, agent_server_image.tag,
                               f"{seen_from_container}/mars/v1/events", monkeypatch) as workspace:
            conversation = Conversation(agent=_agent(f"{seen_from_container}/v1"),
                                        workspace=workspace)
            sid = str(conversation.id)
            conversation.send_message("wait")
            conversation.run(blocking=False)
            [start] = wait_for(lambda: [e for e in session_events(sink, sid)
                                        if e.kind == "tool_start"], 120, "the sleep's tool_start")
            [container] = docker_engine.containers(agent_server_image.tag)
            killed = docker_engine.docker("kill", container)
            assert killed.returncode == 0, killed.stderr
            [end] = wait_for(lambda: [e for e in session_events(sink, sid)
                                      if e.kind == "tool_end"], 30, "the gateway's tool_end")
            wait_for(lambda: sid not in gateway.gateway.state()["sessions"], 30,
                     "the session's release")
            state = gateway.gateway.state()
            with contextlib.suppress(Exception):  # its server is gone
                conversation.close()
    assert (end.tool_call_id, end.status) == (start.tool_call_id, "interrupted")
    assert end.t_mono_ns - start.t_mono_ns >= 4e9  # at its bound (5 s from tool_enqueued)
    last = session_events(sink, sid)[-1]
    assert (last.kind, last.status) == ("session_end", "idle_timeout")
    assert end.source == "gateway"
    assert state["num_admitted"] == 0 and state["tool_backlog_ratio"] == 0
    assert docker_engine.containers(agent_server_image.tag) == []
