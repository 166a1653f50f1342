"""Issue 33 item 3: our tool wrappers declare the resources stock OpenHands declares, so parallel
tool calls run in parallel as they do in stock (a pooled tmux terminal takes no session lock).

Before the fix ``EventedExecutor`` hid the pooled terminal executor's ``is_pooled``: the terminal
declared ``terminal:session`` and the SDK ran three parallel ``sleep 2`` calls one after the other
(6.4 s instead of ~2 s).
"""

from __future__ import annotations

import shutil
import uuid
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("openhands.sdk", reason="needs the OpenHands env (.venv-openhands)")

from mars_openhands.openhands.executor import (  # noqa: E402
    EventedExecutor,
    EventSender,
    register_evented_tools,
    wrap_tool,
)
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

pytestmark = [pytest.mark.openhands, pytest.mark.timeout(600)]

HAS_TMUX = shutil.which("tmux") is not None
TERMINAL_TYPES = ["subprocess", *(["tmux"] if HAS_TMUX else [])]


def _tools(workspace: Path, specs: list[Any]) -> tuple[Any, dict[str, Any]]:
    """A conversation with these tool specs, initialized; ``(conversation, tools_map)``."""
    from openhands.sdk import LLM, Agent, Conversation

    llm = LLM(model="openai/none", base_url="http://127.0.0.1:9/v1", api_key="x", usage_id="agent")
    conversation = Conversation(agent=Agent(llm=llm, tools=specs), workspace=str(workspace),
                                visualizer=None)
    init = getattr(conversation, "_ensure_agent_ready", None)
    if init is not None:  # SDKs that build the tools lazily
        init()
    return conversation, conversation.agent.tools_map


@pytest.mark.parametrize("terminal_type", TERMINAL_TYPES)
def test_wrapped_tools_declare_exactly_the_stock_resources(tmp_path: Path,
                                                           terminal_type: str) -> None:
    from openhands.sdk import Tool
    from openhands.tools.file_editor import FileEditorAction
    from openhands.tools.terminal import TerminalAction

    register_evented_tools()
    params = {"terminal_type": terminal_type}
    stock_conv, stock = _tools(tmp_path, [Tool(name="terminal", params=params),
                                          Tool(name="file_editor")])
    ours_conv, ours = _tools(tmp_path, [
        Tool(name="mars_terminal", params={**params, "mars_policy": "off"}),
        Tool(name="mars_file_editor", params={"mars_policy": "off"})])
    try:
        assert isinstance(ours["terminal"].executor, EventedExecutor)
        action = TerminalAction(command="sleep 2")
        assert ours["terminal"].declared_resources(action) == stock["terminal"].declared_resources(action)
        if terminal_type == "tmux":  # stock takes no lock: the pane pool isolates calls
            assert stock["terminal"].declared_resources(action).keys == ()
        edit = FileEditorAction(command="view", path=str(tmp_path / "a.txt"))
        assert ours["file_editor"].declared_resources(edit) == stock["file_editor"].declared_resources(edit)
    finally:
        stock_conv.close()
        ours_conv.close()


def test_a_tool_wrapped_at_run_time_keeps_its_declared_resources(tmp_path: Path) -> None:
    """``wrap_tool`` (custom, MCP and other tools): a tool whose declaration checks its executor's
    class (glob: ``isinstance(self.executor, GlobExecutor)``) declares the same after wrapping."""
    glob_module = pytest.importorskip("openhands.tools.glob")
    from openhands.sdk import Tool

    conversation, tools = _tools(tmp_path, [Tool(name=glob_module.GlobTool.name)])
    try:
        tool = tools[glob_module.GlobTool.name]
        action = glob_module.GlobAction(pattern="*.py")
        stock = tool.declared_resources(action)
        assert wrap_tool(tool, "sess-g", EventSender(None), tmp_path)
        assert isinstance(tool.executor, EventedExecutor)
        assert isinstance(tool.executor, type(tool.executor.inner))  # what the SDK checks
        assert tool.declared_resources(action) == stock
    finally:
        conversation.close()


def _parallel_script(session_id: str) -> Script:
    def batch(command: str) -> tuple[RecordedToolCall, ...]:
        return tuple(RecordedToolCall(name="terminal", arguments={"command": command.format(i=i)})
                     for i in range(3))

    # The first call in a fresh tmux pane of SDK 1.58 can come back before its command ended
    # (empty output, stock too): the first turn opens the three panes, the second is measured.
    return Script(name="parallel", session_id=session_id, turns=(
        RecordedTurn(content="open the panes", tool_calls=batch("echo warm {i}")),
        RecordedTurn(content="three at once", tool_calls=batch("sleep 2; echo {i}"))))


@pytest.mark.skipif(not HAS_TMUX, reason="the pooled terminal needs tmux")
def test_three_parallel_sleeps_take_one_sleep_and_keep_exact_events(tmp_path: Path) -> None:
    workspace = tmp_path / "ws"
    workspace.mkdir()
    session_id = str(uuid.uuid4())
    with serve_app(build_playback_app([_parallel_script(session_id)])) as url, \
            EventCollector() as collector:
        config = RunConfig(llm=LLMSettings(backend="mars", base_url=f"{url}/v1", model="playback"),
                           events_url=collector.url, out_dir=str(tmp_path / "out"),
                           terminal_type="tmux", tool_concurrency_limit=3)
        result = run_task(TaskSpec(task_id="par", problem_statement="sleep thrice",
                                   workspace=str(workspace), session_id=session_id), config)
    assert result.status == "finished", result.error
    events = [parse_event(e) for e in collector.events]
    starts = {e.tool_call_id: e for e in events if e.kind == "tool_start" and e.turn == 1}
    ends = [e for e in events if e.kind == "tool_end" and e.turn == 1]
    assert len(ends) == 3 and {e.status for e in ends} == {"ok"} and len(starts) == 3
    span_s = (max(e.t_mono_ns for e in ends) - min(s.t_mono_ns for s in starts.values())) / 1e9
    # Stock runs them side by side (~2 s); one at a time they took >= 6 s.
    assert 2.0 <= span_s < 4.5, span_s
    assert max(e.duration_s for e in ends) >= 2.0  # the sleeps ran inside the measured calls
    for end in ends:  # each call's own events stay exact
        start = starts[end.tool_call_id]
        assert end.duration_s == pytest.approx((end.t_mono_ns - start.t_mono_ns) / 1e9)
    # The three ran at the same time: every start precedes every end.
    assert max(s.t_mono_ns for s in starts.values()) < min(e.t_mono_ns for e in ends)
