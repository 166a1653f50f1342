"""``python -m mars_openhands.openhands.agent_server``: the stock agent-server with MARS tool events
and session lifecycle, against the playback engine behind a real gateway.

Runs with whichever agent-server this env has: 1.58.2 in ``.venv-openhands`` (``make
openhands-test``) and 1.34.0, the version the OpenHands app 1.11 pins, in ``.venv-openhands-app``
(``make openhands-app-test``). The client is the SDK's own ``RemoteConversation`` of the same
version, with stock tool specs (``Tool(name="terminal")``), as the app sends them.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from importlib import metadata
from pathlib import Path

import pytest

pytest.importorskip("openhands.agent_server", reason="needs openhands-agent-server in this env")

from mars_openhands.openhands.playback import RecordedToolCall, RecordedTurn, Script  # noqa: E402
from tests.openhands._helpers import (  # noqa: E402
    free_port,
    playback_behind_gateway,
    serve_process,
    session_events,
    wait_for,
)

pytestmark = [pytest.mark.openhands, pytest.mark.timeout(600)]

ROOT = Path(__file__).resolve().parents[2]
AGENT_SERVER_VERSION = metadata.version("openhands-agent-server")
_QUALNAMES = ("from openhands.sdk.tool.registry import get_tool_module_qualnames as q; "
              "print(json.dumps({n: q().get(n) for n in ('terminal', 'file_editor', 'task_tracker')}))")


def _env(**extra: str) -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": str(ROOT), "OPENHANDS_SUPPRESS_BANNER": "1",
            "LITELLM_LOCAL_MODEL_COST_MAP": "True", **extra}


def _python(code: str) -> dict[str, str]:
    out = subprocess.run([sys.executable, "-c", code], env=_env(), capture_output=True, text=True,
                         timeout=300, cwd=ROOT)
    assert out.returncode == 0, out.stderr[-2000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_the_entry_point_keeps_our_tools_after_the_tool_router() -> None:
    """``--mars-check`` imports the agent-server's tool router (which registers the stock tools at
    start-up) and reports who serves the stock names: ours."""
    out = subprocess.run([sys.executable, "-m", "mars_openhands.openhands.agent_server",
                          "--mars-check"], env=_env(MARS_EVENTS_URL="http://gw:8000/mars/v1/events"),
                         capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert out.returncode == 0, out.stderr[-2000:]
    report = json.loads(out.stdout.strip().splitlines()[-1])
    tools = report["tools"]
    assert {tools[n] for n in ("terminal", "file_editor", "task_tracker")} == {
        "mars_openhands.openhands.executor"}
    assert tools["browser_tool_set"] == "mars_openhands.openhands.agent_server"  # MARS_BROWSER=auto
    assert report["events_url"] == "http://gw:8000/mars/v1/events"
    assert report["openhands_agent_server"] == AGENT_SERVER_VERSION
    assert report["host"] == "127.0.0.1"  # issue 34: the stock 1.34 server binds 0.0.0.0


@pytest.mark.parametrize("env, args, host", [
    ({"MARS_AGENT_SERVER_HOST": "0.0.0.0"}, [], "0.0.0.0"),
    ({"MARS_AGENT_SERVER_HOST": "0.0.0.0"}, ["--host", "127.0.0.2"], "127.0.0.2"),
    ({}, ["--host=::1", "--port", "8001"], "::1")])
def test_the_bind_address_is_loopback_unless_told(env: dict[str, str], args: list[str],
                                                  host: str) -> None:
    from mars_openhands.openhands.agent_server import bind_argv, check_report

    argv = bind_argv(args, env)
    assert argv[: len(args)] == args and check_report(env, args)["host"] == host
    assert bind_argv(["--port", "8001"], {}) == ["--port", "8001", "--host", "127.0.0.1"]


def test_the_import_modules_recipe_keeps_our_tools_too() -> None:
    """``--import-modules mars_openhands.openhands.agent_server_tools`` runs before the tool router
    is imported; the stock tools it registers must not replace ours (they did: no tool events)."""
    names = _python("import json, mars_openhands.openhands.agent_server_tools, "
                    "openhands.agent_server.tool_router; " + _QUALNAMES)
    assert set(names.values()) == {"mars_openhands.openhands.executor"}, names


def _script(workspace: Path) -> Script:
    def turn(name: str, **arguments: object) -> RecordedTurn:
        return RecordedTurn(content=f"calling {name}",
                            tool_calls=(RecordedToolCall(name=name, arguments=dict(arguments)),))

    return Script(name="agent-server", turns=(
        turn("terminal", command="echo mars > note.txt && cat note.txt && env > env.txt"),
        turn("file_editor", command="view", path=str(workspace / "note.txt")),
        turn("task_tracker", command="plan", task_list=[{"title": "note", "notes": "", "status": "done"}]),
    ))


@pytest.mark.integration
def test_a_conversation_reaches_the_gateway_with_tool_events_and_its_session_end(tmp_path: Path) -> None:
    from openhands.sdk import LLM, Agent, Conversation, Tool
    from openhands.sdk.workspace import RemoteWorkspace
    from openhands.tools.preset.default import register_default_tools
    from pydantic import SecretStr

    register_default_tools(enable_browser=False)  # the client deserializes the stock tools
    workspace = tmp_path / "ws"
    workspace.mkdir()
    port = free_port()
    with playback_behind_gateway([_script(workspace)]) as (gateway, sink):
        env = _env(MARS_EVENTS_URL=f"{gateway.url}/mars/v1/events", MARS_SESSION_POLL_S="0.1")
        argv = [sys.executable, "-m", "mars_openhands.openhands.agent_server", "--port", str(port)]
        url = f"http://127.0.0.1:{port}"
        with serve_process(argv, url, tmp_path / "agent-server.log", env, tmp_path):
            # Issue 34: started as the app starts it (only --port), it listens on loopback.
            assert f"Agent Server on 127.0.0.1:{port}" in (tmp_path / "agent-server.log").read_text()
            llm = LLM(model="openai/playback", base_url=gateway.base_url, api_key=SecretStr("x"),
                      usage_id="agent")
            agent = Agent(llm=llm, tools=[Tool(name="terminal"), Tool(name="file_editor"),
                                          Tool(name="task_tracker")])
            conversation = Conversation(agent=agent, workspace=RemoteWorkspace(
                host=url, working_dir=str(workspace)))
            sid = str(conversation.id)
            conversation.send_message("write a note")
            conversation.run()
            first = wait_for(lambda: [e for e in session_events(sink, sid)
                                      if e.kind == "session_end"], 10, "the first session_end")
            conversation.send_message("anything else?")  # after finish: a new session of it
            conversation.run()
            wait_for(lambda: len([e for e in session_events(sink, sid)
                                  if e.kind == "session_end"]) == 2, 10, "the second session_end")
            state = gateway.gateway.state()
            conversation.close()
    assert (workspace / "note.txt").read_text() == "mars\n"  # the tools really ran
    events = session_events(sink, sid)
    kinds = [e.kind for e in events]
    assert kinds[0] == "session_start" and first[0].status == "ok"
    ends = [e for e in events if e.kind == "tool_end"]
    assert [(e.tool_name, e.status) for e in ends] == [
        ("terminal", "ok"), ("file_editor", "ok"), ("task_tracker", "ok")]
    assert [e.turn for e in ends] == [0, 1, 2]
    assert kinds.index("session_end") > kinds.index("tool_end") + 2  # the end comes last
    assert kinds[kinds.index("session_end") + 1:] == ["session_start", "session_end"]
    assert sid not in state["sessions"] and state["num_admitted"] == 0  # the slot was released
    # Issue 33 item 6: the conversation's LLM calls (the title's too) and event posts carried its
    # token and the key of its LLM, though the user set neither; its terminal saw no token.
    contract = gateway.contract
    assert contract.refused() == []
    tokens = contract.tokens_of(sid)
    assert contract.tokens_of(sid, "llm") and contract.tokens_of(sid, "events")
    assert len(set(tokens)) == 1 and tokens[0] is not None and len(tokens[0]) >= 22, tokens
    assert {c["authorization"] for c in contract.calls if c["session_id"] == sid} == {"Bearer x"}
    assert tokens[0] not in (workspace / "env.txt").read_text()


def test_without_chromium_a_conversation_gets_no_browser_tools_instead_of_failing() -> None:
    """The app adds the browser to every conversation; the stock tool set raises without
    Chromium while the agent is built (the app's conversation then never starts)."""
    from openhands.tools.browser_use import BrowserToolSet

    if BrowserToolSet.is_usable():
        pytest.skip("Chromium is installed here")
    if AGENT_SERVER_VERSION == "1.34.0":  # the app's pin: the stock set raises at once
        with pytest.raises(Exception, match="Chromium"):
            BrowserToolSet.create(conv_state=type("S", (), {"env_observation_persistence_dir": None})())
    from mars_openhands.openhands.agent_server import OptionalBrowserToolSet

    assert OptionalBrowserToolSet.create(conv_state=None) == []


@pytest.mark.parametrize("name, value", [("MARS_BROWSER", "maybe"), ("MARS_SESSION_POLL_S", "x"),
                                         ("MARS_POLICY", "sometimes")])
def test_bad_settings_are_one_line_and_exit_2(name: str, value: str) -> None:
    out = subprocess.run([sys.executable, "-m", "mars_openhands.openhands.agent_server",
                          "--mars-check"], env=_env(**{name: value}), capture_output=True,
                         text=True, timeout=300, cwd=ROOT)
    assert out.returncode == 2 and name in out.stderr and "Traceback" not in out.stderr
