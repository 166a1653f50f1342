"""Issue 33 item 6, the client side: every LLM call and event post of a session carries the
gateway API key and the session's own token; event posts hold one session each; the agent's
terminal sees neither.

The gateway side (refusing what breaks the contract) is another branch's; here
:class:`~tests.openhands._helpers.SessionTokenContract` enforces the contract in front of the
real gateway. Before: no token was sent at all, and a batch mixed sessions.
"""

from __future__ import annotations

import json
import uuid
from pathlib import Path

import pytest

pytest.importorskip("openhands.sdk", reason="needs the OpenHands env (.venv-openhands)")

from mars_openhands.openhands.credentials import (  # noqa: E402
    TOKEN_HEADER,
    CredentialRegistry,
    SessionCredentials,
    attach_token,
    new_session_token,
)
from mars_openhands.openhands.executor import EventSender  # noqa: E402
from mars_openhands.openhands.llm import LLMSettings  # noqa: E402
from mars_openhands.openhands.playback import (  # noqa: E402
    RecordedToolCall,
    RecordedTurn,
    Script,
)
from mars_openhands.openhands.runner import RunConfig, TaskSpec, run_tasks  # noqa: E402
from mars_openhands.stream.events import ToolEnd, ToolStart, now_stamps  # noqa: E402
from tests.openhands._helpers import (  # noqa: E402
    EventCollector,
    playback_behind_gateway,
    session_events,
)

pytestmark = [pytest.mark.openhands, pytest.mark.timeout(600)]

API_KEY = "sk-gateway-test-31"


def _start(session_id: str, call: str) -> ToolStart:
    return ToolStart(**now_stamps(), session_id=session_id, source="agent", tool_name="terminal",
                     tool_call_id=call, queue_wait_s=0.0)


def _end(session_id: str, call: str) -> ToolEnd:
    return ToolEnd(**now_stamps(), session_id=session_id, source="agent", tool_name="terminal",
                   tool_call_id=call, duration_s=0.1, status="ok")


def test_each_post_holds_one_session_with_its_own_credentials() -> None:
    registry = CredentialRegistry()
    tokens = {"a": new_session_token(), "b": new_session_token()}
    for sid, token in tokens.items():
        registry.set(sid, SessionCredentials(token, API_KEY))
    with EventCollector(delay_s=0.2) as collector:
        sender = EventSender(collector.url, credentials=registry, api_key="fallback-key")
        sender.emit(_start("a", "a0"))  # the first post goes alone; the rest queue behind it
        for event in (_start("b", "b1"), _end("a", "a0"), _start("c", "c1"), _end("b", "b1"),
                      _end("c", "c1")):
            sender.emit(event)
        registry.forget("b")  # credentials are taken when an event is emitted
        sender.close()
    posts = [(h.get(TOKEN_HEADER.lower()), h.get("authorization"), [(e["session_id"], e["kind"])
              for e in events]) for h, events in collector.posts]
    assert all(len({sid for sid, _ in events}) == 1 for _, _, events in posts), posts
    by_session: dict[str, list[str]] = {}
    for token, authorization, events in posts:
        sid = events[0][0]
        assert token == tokens.get(sid), (sid, token)  # c has none registered: no token
        assert authorization == (f"Bearer {API_KEY}" if sid in tokens else "Bearer fallback-key")
        by_session.setdefault(sid, []).extend(kind for _, kind in events)
    assert by_session == {"a": ["tool_start", "tool_end"], "b": ["tool_start", "tool_end"],
                          "c": ["tool_start", "tool_end"]}  # each session's order kept
    assert len(tokens["a"]) >= 22  # >= 128 bits in URL-safe base64


def test_attach_token_reaches_copies_of_the_llm() -> None:
    from openhands.sdk import LLM

    llm = LLM(model="openai/x", base_url="http://127.0.0.1:9/v1", api_key="k", usage_id="agent",
              extra_headers={"X-Mars-Session": "s"})
    attach_token(llm, "tok")
    copy = llm.model_copy(update={"stream": False})  # what the SDK's title request uses
    assert copy.extra_headers == {"X-Mars-Session": "s", TOKEN_HEADER: "tok"}


def _script(session_id: str, note: str, workspace: Path) -> Script:
    def turn(name: str, **arguments: object) -> RecordedTurn:
        return RecordedTurn(content=name, tool_calls=(RecordedToolCall(name=name,
                                                                       arguments=arguments),))

    return Script(name=note, session_id=session_id, turns=(
        turn("terminal", command="env > env.txt"),
        turn("file_editor", command="create", path=str(workspace / "note.txt"), file_text=note)))


def test_runner_tasks_send_their_own_token_and_the_key_and_keep_them_from_the_terminal(
        tmp_path: Path) -> None:
    sessions = {name: str(uuid.uuid4()) for name in ("one", "two")}
    tasks = []
    for name, sid in sessions.items():
        (tmp_path / name).mkdir()
        tasks.append(TaskSpec(task_id=name, problem_statement="note it", session_id=sid,
                              workspace=str(tmp_path / name)))
    scripts = [_script(sid, name, tmp_path / name) for name, sid in sessions.items()]
    with playback_behind_gateway(scripts, api_key=API_KEY) as (gateway, sink):
        config = RunConfig(llm=LLMSettings(backend="mars", base_url=gateway.base_url,
                                           model="playback", api_key=API_KEY),
                           out_dir=str(tmp_path / "out"))
        results = run_tasks(tasks, config, rps=10.0)
        contract = gateway.contract
    assert [r.status for r in results] == ["finished", "finished"], [r.error for r in results]
    assert contract.refused() == []
    tokens = {}
    for name, sid in sessions.items():
        seen = contract.tokens_of(sid)
        kinds = [c["kind"] for c in contract.calls if c["session_id"] == sid]
        assert kinds.count("llm") == 3 and kinds.count("events") >= 2, kinds
        assert len(set(seen)) == 1 and seen[0] is not None and len(seen[0]) >= 22, seen
        tokens[name] = seen[0]
        assert {c["authorization"] for c in contract.calls if c["session_id"] == sid} == {
            f"Bearer {API_KEY}"}
        ends = [e for e in session_events(sink, sid) if e.kind == "tool_end"]
        assert [e.tool_name for e in ends] == ["terminal", "file_editor"]
    assert tokens["one"] != tokens["two"]
    for name in sessions:  # what the agent's terminal inherited: neither secret
        env = (tmp_path / name / "env.txt").read_text()
        assert "PATH=" in env and API_KEY not in env
        assert not any(token in env for token in tokens.values())
        result = json.loads((tmp_path / "out" / name / "result.json").read_text())
        assert not any(token in json.dumps(result) for token in tokens.values())
