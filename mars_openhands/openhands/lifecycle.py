"""``session_start`` / ``session_end`` for conversations an agent-server (or the app's sandbox) hosts.

In our runner the task process knows when a session starts and ends and says so itself
(``runner.py``). In the OpenHands agent-server nobody does: conversations are created over REST
and end when the agent finishes, and a finished session would hold its gateway admission slot
until the idle timeout. :class:`ConversationLifecycle` closes that gap from inside the
agent-server process, with public SDK objects only:

* a conversation is *tracked* when its tools are built (``ToolDefinition.create(conv_state)``,
  before its first LLM call): ``session_start`` unless it is already in a terminal state (a
  finished conversation reloaded from disk);
* one background thread reads each tracked conversation's public ``ConversationState`` fields
  every ``poll_interval_s`` (the SDK offers no public multi-subscriber state hook, and the
  agent-server's webhooks would post every event of every conversation): a terminal
  ``execution_status`` (``finished``, ``error``, ``stuck``, ``deleting``) once the agent has
  answered the latest user message sends ``session_end`` (``status`` ``ok`` for ``finished``, else
  the status); a new user message (``last_user_message_id``) or a running status after the end
  sends a new ``session_start``. The user message, not the status alone, marks a new run, so a
  follow-up answered between two reads (status ``finished`` at both) is still a session of its
  own: the end then waits for an event after that message (``events.get_index``);
* closing the conversation's tools (the agent-server deletes or evicts it) sends ``session_end``
  with ``status="closed"`` if the session is still open, and stops tracking it.

The session id is the conversation id, as for the tool events. Thread-safe.

Credentials (:mod:`mars_openhands.openhands.credentials`): tracking a conversation gives it a new
session token, attached to every LLM of its agent (``extra_headers``; the SDK's own copies, such
as the title's, keep it) and registered, with the API key of the agent's LLM, for the event
posts of the session. The user sets nothing: the app's per-user LLM settings stay as they are.
Each poll attaches it again (an LLM switched at run time gets it within ``poll_interval_s``).
The token lives in this process only: never in the environment the agent's terminal inherits.
"""

from __future__ import annotations

import logging
import threading
import weakref
from dataclasses import dataclass
from typing import Any

from mars_openhands.openhands.credentials import (
    SESSION_CREDENTIALS,
    SessionCredentials,
    attach_token,
    new_session_token,
)
from mars_openhands.openhands.executor import UNEVENTED_TOOL_NAMES, EventSender, wrap_tool
from mars_openhands.stream.events import SessionEnd, SessionStart, now_stamps

__all__ = ["DEFAULT_POLL_INTERVAL_S", "TERMINAL_STATUSES", "ConversationLifecycle", "status_of"]

logger = logging.getLogger(__name__)

DEFAULT_POLL_INTERVAL_S = 0.2
"""How often the conversations' statuses are read, seconds: a finished session's slot is released
at most this much after the agent finished (vs. the gateway's 300 s idle timeout)."""
TERMINAL_STATUSES = frozenset(("finished", "error", "stuck", "deleting"))
"""``ConversationExecutionStatus`` values after which the agent does nothing until a new message."""
_NOT_STARTED = frozenset(("idle",))


def status_of(conv_state: Any) -> str:
    """The conversation's execution status as a lower-case string (``"running"``, ...). Pure.

    SDK >= 1.20 name it ``execution_status``; older ones ``agent_status``.
    """
    status = getattr(conv_state, "execution_status", None)
    if status is None:
        status = getattr(conv_state, "agent_status", "")
    return str(getattr(status, "value", status)).rsplit(".", 1)[-1].lower()


def _progress(conv_state: Any) -> tuple[Any, int | None, int | None]:
    """``(last_user_message_id, its event index, number of events)``; ``None`` where this SDK
    version lacks the field (then only the status is read)."""
    message_id = getattr(conv_state, "last_user_message_id", None)
    events = getattr(conv_state, "events", None)
    if events is None:
        return message_id, None, None
    num_events = len(events)
    index = num_events - 1
    if message_id is not None:
        try:
            index = events.get_index(message_id)
        except (AttributeError, KeyError, ValueError):
            pass
    return message_id, index, num_events


def _llms_of(conv_state: Any) -> list[Any]:
    """Every LLM of the conversation's agent (its own, a condenser's, ...): the SDK's
    ``get_all_llms`` where it has one, else the agent's ``llm``; ``[]`` before the agent is set."""
    agent = getattr(conv_state, "agent", None)
    if agent is None:
        return []
    get_all = getattr(agent, "get_all_llms", None)
    try:
        llms = list(get_all()) if get_all is not None else []
    except Exception:  # an agent the SDK cannot walk: its own LLM still gets the token
        llms = []
    own = getattr(agent, "llm", None)
    return llms if own is None or any(x is own for x in llms) else [own, *llms]


def _api_key_of(llm: Any) -> str | None:
    """The API key of an SDK LLM as a string (``SecretStr`` unwrapped), or ``None``."""
    key = getattr(llm, "api_key", None)
    if key is None:
        return None
    return str(key.get_secret_value() if hasattr(key, "get_secret_value") else key)


@dataclass
class _Tracked:
    state: weakref.ReferenceType[Any]
    is_open: bool
    token: str
    """The session token of this conversation (this process only)."""
    message_id: Any = None
    """The latest user message seen."""
    message_index: int | None = None
    """Its index in the event log: the session ends once an event follows it."""


class ConversationLifecycle:
    """Sends ``session_start`` / ``session_end`` for the conversations it tracks.

    Args:
        sender: where the events go (owned: :meth:`close` closes it).
        poll_interval_s: seconds between status reads (> 0).
        source: the events' ``source``.

    Attributes:
        num_started, num_ended: events sent so far.
    """

    def __init__(self, sender: EventSender, poll_interval_s: float = DEFAULT_POLL_INTERVAL_S,
                 source: str = "agent") -> None:
        if not poll_interval_s > 0:
            raise ValueError(f"poll_interval_s must be > 0 seconds, got {poll_interval_s} "
                             "(MARS_SESSION_POLL_S)")
        self.sender = sender
        self.poll_interval_s = poll_interval_s
        self.source = source
        self.num_started = 0
        self.num_ended = 0
        self._tracked: dict[str, _Tracked] = {}
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def track(self, conv_state: Any) -> str:
        """Start tracking ``conv_state`` (idempotent per conversation id); returns the session id.

        Mutates: sends ``session_start`` unless the conversation is in a terminal state; starts
        the polling thread on first use.
        """
        session_id = str(conv_state.id)
        with self._lock:
            if session_id in self._tracked:
                return session_id
            is_open = status_of(conv_state) not in TERMINAL_STATUSES
            message_id, index, _ = _progress(conv_state)
            token = new_session_token()
            self._tracked[session_id] = _Tracked(weakref.ref(conv_state), is_open, token,
                                                 message_id, index)
            self.attach_credentials(session_id, conv_state, token)
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="mars-lifecycle",
                                                daemon=True)
                self._thread.start()
        if is_open:
            self._start(session_id)
        return session_id

    def attach_credentials(self, session_id: str, conv_state: Any, token: str) -> None:
        """Give the conversation's LLMs ``token`` and register the session's credentials (the
        token, the API key of the agent's LLM) for event posts. Idempotent.

        Mutates: the LLMs' ``extra_headers``; ``SESSION_CREDENTIALS``.
        """
        llms = _llms_of(conv_state)
        for llm in llms:
            attach_token(llm, token)
        SESSION_CREDENTIALS.set(session_id, SessionCredentials(
            token, _api_key_of(llms[0]) if llms else None))

    def closed(self, session_id: str) -> None:
        """The conversation's tools were closed: end its session if open, stop tracking it."""
        with self._lock:
            tracked = self._tracked.pop(session_id, None)
        if tracked is not None and tracked.is_open:
            self._end(session_id, "closed")
        if tracked is not None:  # the end's post took the credentials when emitted
            SESSION_CREDENTIALS.forget(session_id)

    def poll_once(self) -> None:
        """Read every tracked conversation's status once and send what changed; attach its
        token to its agent's LLMs again (:meth:`attach_credentials`); wrap the tools of its agent
        that emit no events yet (:meth:`wrap_tools`)."""
        with self._lock:
            items = list(self._tracked.items())
        for session_id, tracked in items:
            state = tracked.state()
            if state is None:  # garbage-collected without its tools being closed
                self.closed(session_id)
                continue
            self.attach_credentials(session_id, state, tracked.token)
            self._step(session_id, tracked, status_of(state), *_progress(state))
            self.wrap_tools(session_id, state)

    def wrap_tools(self, session_id: str, conv_state: Any) -> list[str]:
        """Wrap every tool of the conversation's agent that is not evented yet (custom and MCP
        tools, which the agent-server builds itself) so it posts tool events through this
        lifecycle's sender. A tool added at run time is evented from the first poll after it
        appeared (at most ``poll_interval_s`` later).

        Returns:
            Names of the tools wrapped now. Mutates those tools' executors.
        """
        try:
            tools = conv_state.agent.tools_map
            workspace = conv_state.workspace.working_dir
        except (AttributeError, RuntimeError):  # agent not initialized yet, or an older SDK
            return []
        from pathlib import Path

        return [name for name, tool in tools.items() if name not in UNEVENTED_TOOL_NAMES
                and wrap_tool(tool, session_id, self.sender, Path(workspace), self.source)]

    def _step(self, session_id: str, tracked: _Tracked, status: str, message_id: Any,
              message_index: int | None, num_events: int | None) -> None:
        """One conversation's transitions for one read. Mutates ``tracked``; sends events."""
        if message_id is not None and message_id != tracked.message_id:  # the user wrote again
            tracked.message_id, tracked.message_index = message_id, message_index
            if not tracked.is_open:
                tracked.is_open = True
                self._start(session_id)
        has_answer = (num_events is None or tracked.message_index is None
                      or num_events - 1 > tracked.message_index)
        if tracked.is_open and status in TERMINAL_STATUSES and has_answer:
            tracked.is_open = False
            self._end(session_id, "ok" if status == "finished" else status)
        elif not tracked.is_open and status not in TERMINAL_STATUSES | _NOT_STARTED:
            tracked.is_open = True
            tracked.message_index = None if num_events is None else num_events - 1
            self._start(session_id)

    def close(self) -> None:
        """Stop polling, end every open session (``status="closed"``), close the sender."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(5.0)
        with self._lock:
            open_ids = [sid for sid, t in self._tracked.items() if t.is_open]
            tracked_ids = list(self._tracked)
            self._tracked.clear()
        for session_id in open_ids:
            self._end(session_id, "closed")
        for session_id in tracked_ids:
            SESSION_CREDENTIALS.forget(session_id)
        self.sender.close()

    def _run(self) -> None:
        while not self._stop.wait(self.poll_interval_s):
            try:
                self.poll_once()
            except Exception:  # telemetry must never take the agent-server down
                logger.exception("reading conversation statuses failed")

    def _start(self, session_id: str) -> None:
        self.num_started += 1
        self.sender.emit(SessionStart(**now_stamps(), session_id=session_id, source=self.source))

    def _end(self, session_id: str, status: str) -> None:
        self.num_ended += 1
        self.sender.emit(SessionEnd(**now_stamps(), session_id=session_id, source=self.source,
                                    status=status))
