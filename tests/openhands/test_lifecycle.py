"""ConversationLifecycle: session_start / session_end from conversation statuses (no server)."""

from __future__ import annotations

import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path

import pytest

pytest.importorskip("openhands.sdk", reason="needs the OpenHands env (.venv-openhands)")

from openhands.sdk.conversation.state import ConversationExecutionStatus  # noqa: E402

from mars_openhands.openhands.executor import EventSender  # noqa: E402
from mars_openhands.openhands.lifecycle import ConversationLifecycle, status_of  # noqa: E402
from mars_openhands.stream.events import parse_event  # noqa: E402

pytestmark = pytest.mark.openhands


@dataclass
class FakeState:
    """What the lifecycle reads of a ``ConversationState``: ``id`` and ``execution_status``."""

    execution_status: ConversationExecutionStatus = ConversationExecutionStatus.IDLE
    id: uuid.UUID = field(default_factory=uuid.uuid4)


def _events(path: Path) -> list[tuple[str, str, str | None]]:
    return [(e.kind, e.session_id, getattr(e, "status", None))
            for e in map(parse_event, path.read_text().splitlines())]


def test_a_conversation_starts_ends_and_restarts_with_a_new_message(tmp_path: Path) -> None:
    path = tmp_path / "events.jsonl"
    lifecycle = ConversationLifecycle(EventSender(None, path), poll_interval_s=60)
    state = FakeState()
    sid = lifecycle.track(state)
    assert lifecycle.track(state) == sid == str(state.id)  # the other tools of the conversation
    for status in ("RUNNING", "WAITING_FOR_CONFIRMATION", "FINISHED", "FINISHED", "RUNNING",
                   "ERROR"):
        state.execution_status = ConversationExecutionStatus[status]
        lifecycle.poll_once()
    lifecycle.closed(sid)
    lifecycle.closed(sid)  # every tool of the conversation closes
    assert _events(path) == [("session_start", sid, None), ("session_end", sid, "ok"),
                             ("session_start", sid, None), ("session_end", sid, "error")]


def test_a_reloaded_finished_conversation_sends_nothing_until_it_runs(tmp_path: Path) -> None:
    path = tmp_path / "events.jsonl"
    lifecycle = ConversationLifecycle(EventSender(None, path), poll_interval_s=60)
    state = FakeState(ConversationExecutionStatus.FINISHED)
    sid = lifecycle.track(state)
    state.execution_status = ConversationExecutionStatus.IDLE
    lifecycle.poll_once()
    assert not path.exists()
    state.execution_status = ConversationExecutionStatus.RUNNING
    lifecycle.poll_once()
    lifecycle.closed(sid)  # deleted while running
    assert _events(path) == [("session_start", sid, None), ("session_end", sid, "closed")]


def test_the_thread_polls_and_close_ends_open_sessions(tmp_path: Path) -> None:
    path = tmp_path / "events.jsonl"
    lifecycle = ConversationLifecycle(EventSender(None, path), poll_interval_s=0.01)
    done, running = FakeState(), FakeState()
    lifecycle.track(done)
    lifecycle.track(running)
    done.execution_status = ConversationExecutionStatus.STUCK
    deadline = time.monotonic() + 5
    while lifecycle.num_ended == 0 and time.monotonic() < deadline:
        time.sleep(0.01)
    lifecycle.close()
    assert (("session_end", str(done.id), "stuck") in _events(path)
            and ("session_end", str(running.id), "closed") in _events(path))
    assert lifecycle.num_started == 2 and lifecycle.num_ended == 2


class FakeEvents(list):
    """An event log: ``len`` and ``get_index(event_id)`` (the public ``EventLog`` calls used)."""

    def get_index(self, event_id: str) -> int:
        return self.index(event_id)


@dataclass
class FakeStateWithLog(FakeState):
    events: FakeEvents = field(default_factory=FakeEvents)
    last_user_message_id: str | None = None

    def user_says(self) -> None:
        self.last_user_message_id = f"user-{len(self.events)}"
        self.events.append(self.last_user_message_id)

    def agent_answers(self, status: str) -> None:
        self.events.append(f"agent-{len(self.events)}")
        self.execution_status = ConversationExecutionStatus[status]


def _one_run_finished(tmp_path: Path) -> tuple[Path, ConversationLifecycle, FakeStateWithLog, str]:
    """A lifecycle (read by hand) whose conversation ran once to ``finished``."""
    path = tmp_path / "events.jsonl"
    lifecycle = ConversationLifecycle(EventSender(None, path), poll_interval_s=60)
    state = FakeStateWithLog()
    sid = lifecycle.track(state)
    state.user_says()
    state.agent_answers("FINISHED")
    lifecycle.poll_once()
    return path, lifecycle, state, sid


def test_a_follow_up_answered_between_two_reads_is_a_session_of_its_own(tmp_path: Path) -> None:
    """Status ``finished`` at both reads: the new user message still marks a new session (with
    the status alone it was missed, and the gateway never saw its end)."""
    path, lifecycle, state, sid = _one_run_finished(tmp_path)
    state.user_says()  # the follow-up, answered before the next read
    state.agent_answers("FINISHED")
    lifecycle.poll_once()
    lifecycle.poll_once()
    assert _events(path) == [("session_start", sid, None), ("session_end", sid, "ok"),
                             ("session_start", sid, None), ("session_end", sid, "ok")]


def test_a_new_message_not_yet_answered_keeps_the_session_open(tmp_path: Path) -> None:
    """Read between the user's message and the run's start, the old ``finished`` is stale."""
    path, lifecycle, state, sid = _one_run_finished(tmp_path)
    state.user_says()
    lifecycle.poll_once()  # still "finished" from the first run
    assert _events(path)[-1] == ("session_start", sid, None)
    state.execution_status = ConversationExecutionStatus.RUNNING
    lifecycle.poll_once()
    state.agent_answers("FINISHED")
    lifecycle.poll_once()
    assert [k for k, _, _ in _events(path)] == ["session_start", "session_end", "session_start",
                                               "session_end"]


def test_status_of_reads_enum_values_and_old_names() -> None:
    assert status_of(FakeState(ConversationExecutionStatus.FINISHED)) == "finished"

    @dataclass
    class Old:  # SDK 1.14 called it agent_status
        agent_status: str = "AgentExecutionStatus.RUNNING"

    assert status_of(Old()) == "running"
    with pytest.raises(ValueError, match="MARS_SESSION_POLL_S"):
        ConversationLifecycle(EventSender(None), poll_interval_s=0)


def test_the_agent_servers_other_tools_are_evented_by_the_poll(tmp_path: Path) -> None:
    """Issue 16 kind 2: tools the agent-server builds itself (custom, MCP; here the SDK's think
    tool) post tool events through the lifecycle's sender once a poll has seen them."""
    from types import SimpleNamespace

    from openhands.sdk.tool.builtins import FinishTool, ThinkAction, ThinkTool

    path = tmp_path / "events.jsonl"
    lifecycle = ConversationLifecycle(EventSender(None, path), poll_interval_s=60)
    think, finish = ThinkTool.create()[0], FinishTool.create()[0]
    state = FakeState(ConversationExecutionStatus.RUNNING)
    state.agent = SimpleNamespace(tools_map={"think": think, "finish": finish})
    state.workspace = SimpleNamespace(working_dir=str(tmp_path))
    sid = lifecycle.track(state)
    lifecycle.poll_once()
    assert lifecycle.wrap_tools(sid, state) == []  # idempotent: wrapped by the poll
    think(ThinkAction(thought="x"), None)
    kinds = [(k, s) for k, s, _ in _events(path) if k.startswith("tool")]
    assert kinds == [("tool_enqueued", sid), ("tool_start", sid), ("tool_end", sid)]
    lifecycle.closed(sid)
