"""Tool executor wrapper: exact ``tool_enqueued`` / ``tool_start`` / ``tool_end`` events (design.md §3, §10).

OpenHands runs every tool call through ``ToolExecutor.__call__(action, conversation)`` (same interface
in SDK 1.14 and 1.58). :class:`EventedExecutor` wraps a tool's executor and takes its timestamps
immediately around the inner call, so ``tool_start`` / ``tool_end`` carry the executor's own timing;
conversation callbacks and hooks see tool results later and in batches, which is fine for audit but
not for timing. Before starting, it runs the pre-tool policy check (``policy_check.py``): a denied
action is not executed, the agent gets an error observation naming the rule, and the stream gets
``tool_end`` with ``status="denied"``.

Only public SDK APIs are used: a ``ToolDefinition`` subclass whose ``create()`` builds the original
tool (``TerminalTool.create(...)``) and swaps in the wrapper with ``ToolDefinition.set_executor``,
registered with ``register_tool``. The LLM-visible tool names and schemas are unchanged.

Two ways in:

* the runner (``runner.py``) registers ``mars_terminal``, ``mars_file_editor``, ``mars_task_tracker``
  and passes per-session parameters in the tool specs (``mars_events_url``, ``mars_session_id``, ...);
* the OpenHands app / agent-server: importing :mod:`mars_openhands.openhands.agent_server_tools`
  (or calling :func:`register_evented_tools` with ``override_defaults=True``) re-registers the
  default names ``terminal``, ``file_editor``, ``task_tracker`` with wrapped versions configured from
  ``MARS_EVENTS_URL`` / ``MARS_EVENTS_PATH`` / ``MARS_POLICY``; existing agent specs then emit events
  unchanged. The session id is then the conversation id (what SDK 1.58 also sends the LLM as
  ``x-litellm-session-id``).

Every tool, not only these three: :class:`EventedToolsCallback` (a conversation callback) wraps, in
place, the executor of any tool of the agent that is not wrapped yet (custom tools, MCP tools, tools
added at run time) when the agent's ``ActionEvent`` for it is emitted, which the SDK does before it
runs the tool.

Transport: :class:`EventSender` posts batches to the gateway's ``POST /mars/v1/events`` from a
background thread, one session per post with that session's credentials (the gateway API key
and session token, :mod:`mars_openhands.openhands.credentials`), and appends each event to a
JSONL file when asked. Timestamps are taken when the
event happens, never when it is sent. Ordering with the agent's next LLM call: the SDK sends that
call about 20 ms after a tool returns, sooner than a background post reaches the gateway, and the
gateway would then attach no ``mars_prev_tool`` to it (the engine loses the tool's name and
duration). So a tool's observation goes back to the agent only once its ``tool_end`` was posted, or
after ``end_wait_s`` (default :data:`DEFAULT_END_WAIT_S`) when the gateway is slow or down: a
bounded wait, never an error.
"""

from __future__ import annotations

import functools
import json
import logging
import os
import queue
import threading
import time
import uuid
from collections.abc import Callable, Mapping, Sequence
from datetime import timedelta
from pathlib import Path
from typing import Any, ClassVar

try:  # SDK >= 1.20 (our tool-enqueue-time patch adds TOOL_CALL_ENQUEUED_NS to it)
    from openhands.sdk.agent import parallel_executor as _parallel_executor
except ImportError:  # pragma: no cover - older SDKs run tool calls one by one
    _parallel_executor = None
from openhands.sdk.tool import ToolDefinition, ToolExecutor, register_tool
from openhands.sdk.tool.registry import get_tool_module_qualnames

from mars_openhands.openhands.credentials import (
    SESSION_CREDENTIALS,
    CredentialRegistry,
    SessionCredentials,
)
from mars_openhands.openhands.policy_check import PolicyConfig, check_action
from mars_openhands.openhands.quiet import replacing_stock_tool
from mars_openhands.openhands.terminal_ready import CLEAN_ROUNDS, wait_until_ready
from mars_openhands.stream.events import Event, ToolEnd, ToolEnqueued, ToolStart, now_stamps

__all__ = [
    "DEFAULT_END_WAIT_S",
    "ENV_EVENTS_PATH",
    "ENV_EVENTS_URL",
    "ENV_POLICY",
    "EVENTED_TOOL_NAMES",
    "EventSender",
    "EventedExecutor",
    "EventedToolsCallback",
    "WrappingExecutor",
    "register_evented_tools",
    "wrap_tool",
]

logger = logging.getLogger(__name__)

ENV_EVENTS_URL = "MARS_EVENTS_URL"
"""Gateway events endpoint (``http://host:port/mars/v1/events``) for tools configured from the env."""
ENV_EVENTS_PATH = "MARS_EVENTS_PATH"
"""JSONL file that tools configured from the env append their events to."""
ENV_POLICY = "MARS_POLICY"
"""``on`` (default) or ``off``: whether env-configured tools run the pre-tool policy check."""

EVENTED_TOOL_NAMES: tuple[str, ...] = ("terminal", "file_editor", "task_tracker")
"""OpenHands tools wrapped by default (the issue's tool set)."""

_MARS_PARAMS = ("mars_events_url", "mars_events_path", "mars_session_id", "mars_source",
                "mars_policy", "mars_workspace")


DEFAULT_END_WAIT_S = 2.0
"""Longest a tool's observation waits for its ``tool_end`` to be posted, seconds: a local post
takes ~1-5 ms; a gateway down for longer costs each tool call at most this."""

UNEVENTED_TOOL_NAMES = frozenset(("finish",))
"""Tools :class:`EventedToolsCallback` leaves alone: ``finish`` ends the conversation (no tool work,
no next LLM call to inform; ``session_end`` follows)."""

TOOL_BOUND_SLACK_S = 60.0
"""Added to a tool call's own timeout (the terminal's ``timeout``) to form the bound it sends
(``tool_start.timeout_s``): the gateway closes the call as interrupted only well after the tool
itself would have given up."""

_RETRY_STATUSES = frozenset((404, 408, 425, 429))
"""HTTP statuses worth retrying, besides 5xx: 404 is the gateway's "unknown session" after it
restarted, which the agent's next LLM request cures; the others are transient by definition."""


class EventSender:
    """Posts events to the gateway in batches from a background thread; optionally logs them.

    Args:
        events_url: ``POST`` target (the gateway's ``/mars/v1/events``); ``None``: no posting.
        events_path: JSONL file each event is appended to (one ``model_dump_json`` per line); ``None``:
            no file. Events the gateway never accepted go to ``<stem>_lost.jsonl`` beside it.
        timeout_s: HTTP timeout per post, seconds.
        max_batch: most events per post.
        max_retries: further attempts per batch after a failed post (connection error, timeout,
            HTTP 404/408/425/429 or 5xx); other answers are not retried.
        retry_backoff_s: wait before the first retry, seconds; doubled per retry, at most 4 s. The
            default 0.25 s and 6 retries span ~12 s, a gateway restart.
        credentials: where each session's credentials are looked up when an event is emitted
            (default: this process's :data:`~mars_openhands.openhands.credentials.SESSION_CREDENTIALS`).
        api_key: the gateway API key for events of sessions with no credentials there
            (``None``: no ``Authorization`` header for them).

    Each post holds the events of one session (the gateway binds a post to one session's token)
    and carries that session's ``Authorization: Bearer <api key>`` and ``X-Mars-Session-Token``,
    as resolved when the event was emitted (so a session forgotten meanwhile still posts its
    last events with its credentials). ``emit`` never blocks on I/O. Failed attempts are logged and counted (``num_post_errors``);
    events given up on are counted (``num_lost``) and written to the lost file, never raised into
    the agent: the stream is telemetry, the task must go on. Batches are posted in order, so a
    retried batch holds back the ones after it.
    """

    def __init__(self, events_url: str | None, events_path: str | Path | None = None,
                 timeout_s: float = 5.0, max_batch: int = 256, max_retries: int = 6,
                 retry_backoff_s: float = 0.25, credentials: CredentialRegistry | None = None,
                 api_key: str | None = None) -> None:
        self.events_url = events_url
        self.credentials = SESSION_CREDENTIALS if credentials is None else credentials
        self._fallback = SessionCredentials(api_key=api_key)
        self.events_path = Path(events_path) if events_path else None
        self.lost_path = (self.events_path.with_name(self.events_path.stem + "_lost.jsonl")
                          if self.events_path else None)
        self.timeout_s = timeout_s
        self.max_batch = max_batch
        self.max_retries = max_retries
        self.retry_backoff_s = retry_backoff_s
        self.num_sent = 0
        self.num_post_errors = 0
        self.num_lost = 0
        self._queue: queue.Queue[tuple[Event, dict[str, str]] | None] = queue.Queue()
        self._lock = threading.Lock()
        self._num_queued = 0
        self._num_done = 0
        """Events posted or given up on, in order (batches are posted in order)."""
        self._done = threading.Condition()
        self._thread: threading.Thread | None = None
        self._is_closed = False
        self._closing = threading.Event()

    def emit(self, event: Event) -> int:
        """Queue ``event`` for sending (and write it to the JSONL file now). Thread-safe, non-blocking.

        Returns:
            Its sequence number for :meth:`wait_sent` (0 when nothing is posted).
        """
        if self.events_path is not None:
            line = event.model_dump_json() + "\n"
            with self._lock, self.events_path.open("a") as f:
                f.write(line)
        if self.events_url is None:
            return 0
        headers = (self.credentials.get(event.session_id) or self._fallback).event_headers()
        with self._lock:
            if self._is_closed:
                raise RuntimeError("EventSender.emit after close(); create a new sender")
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="mars-events", daemon=True)
                self._thread.start()
            self._num_queued += 1
            seq = self._num_queued
            self._queue.put((event, headers))
        return seq

    def wait_sent(self, seq: int, timeout_s: float) -> bool:
        """Wait until event ``seq`` (from :meth:`emit`) and every one before it was posted or given
        up on. Blocks the caller at most ``timeout_s`` seconds.

        Returns:
            True if it was; False on timeout (the event is still sent later, in order).
        """
        with self._done:
            return self._done.wait_for(lambda: self._num_done >= seq, timeout_s)

    def flush(self, timeout_s: float = 10.0) -> bool:
        """Wait until every queued event was posted (or given up on). ``False`` on timeout."""
        deadline = time.monotonic() + timeout_s
        while self._queue.unfinished_tasks and time.monotonic() < deadline:
            time.sleep(0.005)
        return not self._queue.unfinished_tasks

    def close(self, timeout_s: float = 10.0) -> None:
        """Flush, then stop the thread. Idempotent. Retries stop waiting once closing: a batch
        still failing then is lost (counted), so close returns within about ``timeout_s``."""
        with self._lock:
            if self._is_closed:
                return
            self._is_closed = True
            thread = self._thread
        if thread is not None:
            self._queue.put(None)
            if not self.flush(timeout_s * 0.8):
                self._closing.set()  # stop backing off: one last attempt per batch, then give up
            thread.join(timeout_s * 0.2 + self.timeout_s)

    def _run(self) -> None:
        import httpx

        with httpx.Client(timeout=self.timeout_s) as client:
            while True:
                first = self._queue.get()
                batch = [first]
                while len(batch) < self.max_batch:
                    try:
                        batch.append(self._queue.get_nowait())
                    except queue.Empty:
                        break
                items = [item for item in batch if item is not None]
                for headers, events in _per_session(items):
                    self._post_with_retries(client, events, headers)
                with self._done:
                    self._num_done += len(items)
                    self._done.notify_all()
                for _ in batch:
                    self._queue.task_done()
                if len(items) < len(batch):
                    return

    def _post_with_retries(self, client: Any, events: list[Event], headers: dict[str, str]) -> None:
        # Unset optional fields are left out, so a gateway older than a field still accepts the
        # events (its models reject unknown keys, null ones included).
        body = "[" + ",".join(e.model_dump_json(exclude_none=True) for e in events) + "]"
        error = ""
        for attempt in range(self.max_retries + 1):
            if attempt:
                delay_s = min(4.0, self.retry_backoff_s * 2 ** (attempt - 1))
                if self._closing.wait(delay_s) and attempt > 1:
                    break  # closing: the wait was cut short and one retry already failed
            is_retryable, error = self._post(client, body, headers)
            if not error:
                self.num_sent += len(events)
                return
            self.num_post_errors += 1
            if not is_retryable:
                break
        self._lose(events, error)

    def _post(self, client: Any, body: str, headers: dict[str, str]) -> tuple[bool, str]:
        """One attempt: ``(is_retryable, error)``; ``error`` is empty on success."""
        try:
            response = client.post(self.events_url, content=body,
                                   headers={"content-type": "application/json", **headers})
        except Exception as e:  # connection refused, timeout, ...: telemetry must not break the agent
            return True, f"{type(e).__name__}: {e}"
        if response.status_code < 400:
            return False, ""
        retry = response.status_code in _RETRY_STATUSES or response.status_code >= 500
        return retry, f"HTTP {response.status_code}: {response.text[:300]}"

    def _lose(self, events: list[Event], error: str) -> None:
        self.num_lost += len(events)
        logger.warning("gave up posting %d events to %s: %s", len(events), self.events_url, error)
        if self.lost_path is not None:
            with self._lock, self.lost_path.open("a") as f:
                f.writelines(e.model_dump_json() + "\n" for e in events)


def _per_session(items: list[tuple[Event, dict[str, str]]]
                 ) -> list[tuple[dict[str, str], list[Event]]]:
    """The posts of a batch: ``(headers, events)`` of one session each, sessions in order of
    first appearance, a session's events in their order (a change of its headers mid-batch
    starts a new post). Pure."""
    by_session: dict[str, list[tuple[dict[str, str], list[Event]]]] = {}
    for event, headers in items:
        posts = by_session.setdefault(event.session_id, [])
        if not posts or posts[-1][0] != headers:
            posts.append((headers, []))
        posts[-1][1].append(event)
    return [post for posts in by_session.values() for post in posts]


def _find_action_event(action: Any, conversation: Any) -> tuple[str | None, int | None]:
    """``(tool_call_id, turn)`` of the ``ActionEvent`` holding ``action``, searched from the newest
    event; ``turn`` = 0-based index of its LLM response among the conversation's LLM responses.
    ``(None, None)`` when there is no conversation or no match.

    The match is by identity (SDK 1.58 keeps events in memory), else by equality (SDK 1.14 hands
    out deserialized copies); newest first, so the call being executed wins over older equal ones.
    """
    if conversation is None:
        return None, None
    try:
        events = conversation.state.events
        for i in range(len(events) - 1, -1, -1):
            event = events[i]
            candidate = getattr(event, "action", None)
            if candidate is action or (candidate is not None and candidate == action):
                response_ids = {getattr(e, "llm_response_id", None) for e in events[: i + 1]}
                response_ids.discard(None)
                return str(event.tool_call_id), max(0, len(response_ids) - 1)
    except Exception as e:  # older/newer event stores: timing matters more than the id
        logger.debug("could not find the ActionEvent of %r: %s", type(action).__name__, e)
    return None, None


def _enqueued_stamps(action: Any) -> dict[str, Any]:
    """When ``action`` was queued: the instant its batch reached the SDK's
    ``ParallelToolExecutor`` where the SDK has the tool-enqueue-time patch (``patches/``; then
    waits for a resource lock or a worker count), else now (the call reached this executor)."""
    now = now_stamps()
    entry = getattr(_parallel_executor, "TOOL_CALL_ENQUEUED_NS", {}).get(id(action))
    if entry is None or entry[0]() is not action:
        return now
    age_ns = max(0, now["t_mono_ns"] - entry[1])
    return {"t_mono_ns": now["t_mono_ns"] - age_ns,
            "t_wall": now["t_wall"] - timedelta(microseconds=age_ns / 1000)}


def _denied_observation(observation_type: Any, action: Any, reason: str) -> Any:
    """An error observation of the tool's own type carrying ``reason`` (see
    :func:`_text_observation`)."""
    return _text_observation(observation_type, action,
                             f"[MARS policy] {reason}. The command was NOT executed.", is_error=True)


def _text_observation(observation_type: Any, action: Any, text: str, is_error: bool) -> Any:
    """An observation of the tool's own type carrying ``text``; the fields it requires and the
    action has (the file editor's ``command``, the terminal's) are copied from the action, as
    ``from_text`` alone fails on them (pydantic ``ValidationError``)."""
    extra = {}
    for name, field in getattr(observation_type, "model_fields", {}).items():
        if field.is_required() and name not in ("content",) and hasattr(action, name):
            extra[name] = getattr(action, name)
    return observation_type.from_text(text=text, is_error=is_error, **extra)


def _wrapper_class(wrapper_cls: type, inner_cls: type) -> type:
    """A subclass of ``wrapper_cls`` that ``isinstance`` takes for an ``inner_cls`` too (registered
    as an ABC virtual subclass of it: no method of ``inner_cls`` is inherited). Cached per pair.

    Mutates: ``inner_cls``'s ABC registry (once per pair).
    """
    key = (wrapper_cls, inner_cls)
    cls = _WRAPPER_CLASSES.get(key)
    if cls is None:
        cls = type(f"{wrapper_cls.__name__}[{inner_cls.__name__}]", (wrapper_cls,),
                   {"__module__": wrapper_cls.__module__, "__qualname__": wrapper_cls.__qualname__})
        register = getattr(inner_cls, "register", None)  # ABCMeta's; ToolExecutor is an ABC
        if register is not None and not issubclass(cls, inner_cls):
            register(cls)
        _WRAPPER_CLASSES[key] = cls
    return cls


_WRAPPER_CLASSES: dict[tuple[type, type], type] = {}
"""(wrapper class, inner executor class) -> their :func:`_wrapper_class`. Grows by one entry per
tool executor class wrapped, a handful per process."""


class WrappingExecutor(ToolExecutor):
    """Base of our executor wrappers: what the SDK reads of a tool's executor reads the inner one.

    Stock tools decide their ``declared_resources`` (which resource locks the SDK's parallel tool
    executor takes) from their executor: the terminal from ``executor.is_pooled`` (a tmux pane
    pool takes no lock), glob from ``isinstance(executor, GlobExecutor)``; the SDK finds a
    toolset's MCP tools by ``isinstance(executor, MCPToolExecutor)`` and ``executor.client``. A
    wrapper that hid them made the terminal declare a session lock, and parallel calls ran one
    at a time (issue 33). So an attribute the wrapper lacks is read from ``inner``, and an
    instance passes ``isinstance`` for the inner executor's class (an ABC virtual subclass; no
    method of it is inherited, so nothing runs against the wrapper's own state).

    Subclasses set ``self.inner`` in ``__init__``; their first argument is the inner executor.
    """

    inner: ToolExecutor

    def __new__(cls, inner: Any = None, *args: Any, **kwargs: Any) -> WrappingExecutor:
        target = cls if inner is None else _wrapper_class(cls, type(inner))  # None: copy/unpickle
        return super().__new__(target)

    def __getattr__(self, name: str) -> Any:
        # Only names not found on the wrapper itself arrive here. Dunders stay the wrapper's own
        # (copy and pickle protocols), and nothing is forwarded before ``inner`` is set.
        if name.startswith("__") or "inner" not in self.__dict__:
            raise AttributeError(name)
        return getattr(self.__dict__["inner"], name)


class EventedExecutor(WrappingExecutor):
    """Wraps a tool's executor: policy check, then ``tool_enqueued`` / ``tool_start`` / ``tool_end``.

    Args:
        inner: the tool's original executor.
        tool_name: the tool's LLM-visible name (``"terminal"``).
        observation_type: the tool's observation class (denials are returned as one, ``is_error``).
        session_id: session of every event (the conversation / gateway session).
        sender: where events go.
        workspace: root for the policy's path rules.
        policy: rules to apply; ``None`` disables the check.
        source: events' ``source``.
        timings_path: JSONL file each entry of ``timings`` is appended to (``None``: none); lets a
            parent process compare the stream with the executor's own record.
        on_close: called once the executor and its sender are closed (the session lifecycle's
            end of the conversation), or ``None``.
        owns_sender: close ``sender`` on :meth:`close` (False: a shared sender, only flushed).
        end_wait_s: longest the observation waits for its ``tool_end`` to be posted, seconds
            (see the module docstring); 0: do not wait.

    Attributes:
        timings: ``(tool_call_id, tool_name, start_mono_ns, end_mono_ns, status)`` per call, taken
            by this wrapper (for tests and results; the events carry the same instants).

    Other attributes read through to ``inner`` (:class:`WrappingExecutor`), so the tool declares
    the resources the stock tool declares.

    Timing contract: ``tool_start.t_mono_ns`` is taken immediately before ``inner(action, conv)`` and
    ``tool_end.t_mono_ns`` immediately after it returns or raises; ``duration_s`` is their difference.
    ``tool_enqueued`` is stamped at entry, before the policy check, or, where the SDK has the
    tool-enqueue-time patch (``patches/``), when the call's batch reached the SDK's
    ``ParallelToolExecutor`` (emitted at entry, stamped then); ``queue_wait_s`` is start −
    enqueued: the policy check, plus with the patch the waits for a resource lock or a worker.
    The call returns only after its ``tool_end`` was posted (or ``end_wait_s``), so the agent's
    next LLM call cannot overtake it; ``tool_start.timeout_s`` is the action's own ``timeout``
    plus :data:`TOOL_BOUND_SLACK_S` when it has one.
    """

    def __init__(self, inner: ToolExecutor, tool_name: str, observation_type: Any, session_id: str,
                 sender: EventSender, workspace: Path, policy: PolicyConfig | None,
                 source: str = "agent", timings_path: Path | None = None,
                 on_close: Callable[[], None] | None = None, owns_sender: bool = True,
                 end_wait_s: float = DEFAULT_END_WAIT_S) -> None:
        self.inner = inner
        self.end_wait_s = end_wait_s
        self.num_end_wait_timeouts = 0
        """Calls whose observation went back before their ``tool_end`` was posted."""
        self.owns_sender = owns_sender
        self.tool_name = tool_name
        self.observation_type = observation_type
        self.session_id = session_id
        self.sender = sender
        self.workspace = workspace
        self.policy = policy
        self.source = source
        self.timings_path = timings_path
        self.on_close = on_close
        self.timings: list[tuple[str, str, int, int, str]] = []

    def __call__(self, action: Any, conversation: Any = None) -> Any:
        return self.call_with(action, conversation, self.inner)

    def call_with(self, action: Any, conversation: Any, answer: Callable[[Any, Any], Any]) -> Any:
        """As ``__call__``, with ``answer(action, conversation)`` in place of the inner executor:
        the call is reported (``tool_enqueued`` / ``tool_start`` / ``tool_end``, its timings) as
        if the tool ran. The durable runtime answers a retried call this way when it finds the
        first attempt's effect already done (``durable.py``): a killed first attempt may have
        posted its ``tool_start`` and not its ``tool_end``, and this attempt's events close it.
        """
        tool_call_id, turn = _find_action_event(action, conversation)
        tool_call_id = tool_call_id or f"mars-{uuid.uuid4().hex[:12]}"
        common = {"session_id": self.session_id, "turn": turn, "source": self.source,
                  "tool_name": self.tool_name, "tool_call_id": tool_call_id}
        enqueued = _enqueued_stamps(action)
        self.sender.emit(ToolEnqueued(**enqueued, **common))
        if self.policy is not None:
            decision = check_action(self.tool_name, _action_fields(action), self.workspace, self.policy)
            if not decision.is_allowed:
                end = now_stamps()
                self._record(tool_call_id, end["t_mono_ns"], end["t_mono_ns"], "denied")
                self._send_end(ToolEnd(**end, **common, duration_s=0.0, status="denied"))
                return _denied_observation(self.observation_type, action, decision.reason)
        start = now_stamps()
        start_ns = start["t_mono_ns"]
        wait_s = (start_ns - enqueued["t_mono_ns"]) / 1e9
        self.sender.emit(ToolStart(**start, **common, queue_wait_s=max(0.0, wait_s),
                                   timeout_s=_bound_s(action)))
        status = "error"
        try:
            observation = answer(action, conversation)
            status = "error" if getattr(observation, "is_error", False) else "ok"
            if getattr(observation, "timeout", False) is True:
                status = "timeout"
            return observation
        finally:
            end = now_stamps()
            self._record(tool_call_id, start_ns, end["t_mono_ns"], status)
            self._send_end(ToolEnd(**end, **common, status=status,
                                   duration_s=(end["t_mono_ns"] - start_ns) / 1e9))

    def _send_end(self, event: ToolEnd) -> None:
        """Emit ``tool_end`` and wait (at most ``end_wait_s``) until it was posted."""
        seq = self.sender.emit(event)
        if seq and self.end_wait_s > 0 and not self.sender.wait_sent(seq, self.end_wait_s):
            self.num_end_wait_timeouts += 1
            logger.warning("tool_end of %s (%s) not posted within %.1f s; the agent goes on",
                           event.tool_call_id, event.tool_name, self.end_wait_s)

    def _record(self, tool_call_id: str, start_ns: int, end_ns: int, status: str) -> None:
        entry = (tool_call_id, self.tool_name, start_ns, end_ns, status)
        self.timings.append(entry)
        if self.timings_path is not None:
            keys = ("tool_call_id", "tool_name", "start_mono_ns", "end_mono_ns", "status")
            with self.timings_path.open("a") as f:
                f.write(json.dumps(dict(zip(keys, entry, strict=True))) + "\n")

    def close(self) -> None:
        """Close the inner executor, then flush and stop the sender (a shared one is only
        flushed), then call ``on_close``."""
        try:
            self.inner.close()
        finally:
            if self.owns_sender:
                self.sender.close()
            else:
                self.sender.flush()
            if self.on_close is not None:
                self.on_close()

    def interrupt(self) -> None:
        """Forward an interrupt to the inner executor (SDK versions that have it)."""
        interrupt = getattr(self.inner, "interrupt", None)
        if interrupt is not None:
            interrupt()


def _bound_s(action: Any) -> float | None:
    """The bound a call sends (``tool_start.timeout_s``): the action's own positive ``timeout``
    (seconds; the terminal has one) plus :data:`TOOL_BOUND_SLACK_S`, else ``None`` (the
    session's or gateway's default)."""
    timeout = getattr(action, "timeout", None)
    if isinstance(timeout, (int, float)) and not isinstance(timeout, bool) and timeout > 0:
        return float(timeout) + TOOL_BOUND_SLACK_S
    return None


def wrap_tool(tool: Any, session_id: str, sender: EventSender, workspace: Path,
              source: str = "agent", end_wait_s: float = DEFAULT_END_WAIT_S) -> bool:
    """Wrap ``tool``'s executor in an :class:`EventedExecutor`, in place, unless it already is one
    or has no executor. No policy check (its rules are for the three built-in tools).

    Mutates: ``tool.executor`` (the SDK's tool objects are frozen models; the agent holds this
    very object, so its next call goes through the wrapper).

    Returns:
        True if it was wrapped now.
    """
    inner = getattr(tool, "executor", None)
    if inner is None or isinstance(inner, EventedExecutor):
        return False
    wrapped = EventedExecutor(inner, tool.name, tool.observation_type, session_id, sender,
                              workspace, None, source, owns_sender=False, end_wait_s=end_wait_s)
    object.__setattr__(tool, "executor", wrapped)
    return True


class EventedToolsCallback:
    """Conversation callback: every tool the agent runs emits tool events, whatever it is.

    On each ``ActionEvent`` (emitted by the SDK before the tool runs) the named tool of
    :attr:`agent` is wrapped by :func:`wrap_tool` if it is not yet (custom tools, MCP tools, tools
    added at run time; the three built-in ones are wrapped at creation). Set :attr:`agent` to the
    conversation's agent once the conversation exists.

    Args:
        session_id, sender, workspace, source, end_wait_s: as :class:`EventedExecutor`.
    """

    def __init__(self, session_id: str, sender: EventSender, workspace: Path,
                 source: str = "agent", end_wait_s: float = DEFAULT_END_WAIT_S) -> None:
        self.session_id = session_id
        self.sender = sender
        self.workspace = workspace
        self.source = source
        self.end_wait_s = end_wait_s
        self.agent: Any = None
        self.wrapped: list[str] = []
        """Names of the tools this callback wrapped."""

    def __call__(self, event: Any) -> None:
        name = getattr(event, "tool_name", None)
        if (self.agent is None or name is None or name in UNEVENTED_TOOL_NAMES
                or not hasattr(event, "action")):
            return
        try:
            tool = self.agent.tools_map.get(name)
        except RuntimeError:  # agent not initialized yet: it cannot run a tool either
            return
        if tool is not None and wrap_tool(tool, self.session_id, self.sender, self.workspace,
                                          self.source, self.end_wait_s):
            self.wrapped.append(name)


def _action_fields(action: Any) -> Mapping[str, Any]:
    try:
        return action.model_dump()
    except Exception:
        return {}


def _inner_tool_class(name: str) -> type[ToolDefinition]:
    """The original OpenHands tool class for ``name`` (``terminal``, ``file_editor``, ``task_tracker``).

    Raises:
        ValueError: another name (the message lists the supported ones).
    """
    if name == "terminal":
        from openhands.tools.terminal import TerminalTool

        return TerminalTool
    if name == "file_editor":
        from openhands.tools.file_editor import FileEditorTool

        return FileEditorTool
    if name == "task_tracker":
        from openhands.tools.task_tracker import TaskTrackerTool

        return TaskTrackerTool
    raise ValueError(f"cannot wrap tool {name!r}; supported: {list(EVENTED_TOOL_NAMES)}")


def _policy_from(value: Any) -> PolicyConfig | None:
    if value is None:
        value = os.environ.get(ENV_POLICY, "on")
    if value in (False, "off", "0", "false"):
        return None
    if value in (True, "on", "1", "true"):
        return PolicyConfig()
    if isinstance(value, Mapping):
        return PolicyConfig(**value)
    raise ValueError(f"mars_policy must be on/off or a PolicyConfig dict, got {value!r} "
                     f"(or set {ENV_POLICY}=on|off)")


class _EventedToolBase(ToolDefinition):
    """Builds the inner tool and swaps in :class:`EventedExecutor` (subclasses set ``inner_name``).

    Spec params ``mars_events_url``, ``mars_events_path``, ``mars_session_id`` (default: the
    conversation id), ``mars_source`` (default ``"agent"``), ``mars_policy`` (``on``/``off`` or a
    :class:`PolicyConfig` dict) and ``mars_workspace`` (default: the conversation's working dir) are
    consumed here, with ``MARS_EVENTS_URL`` / ``MARS_EVENTS_PATH`` / ``MARS_POLICY`` as fallbacks;
    every other param goes to the inner tool's ``create``. A class whose ``lifecycle`` is set (the
    stock-name registrations of the agent-server) also has the conversation tracked for
    ``session_start`` / ``session_end`` (:mod:`mars_openhands.openhands.lifecycle`).
    """

    inner_name: ClassVar[str] = ""
    lifecycle: ClassVar[Any] = None
    """The process's :class:`~mars_openhands.openhands.lifecycle.ConversationLifecycle`, or None."""

    @classmethod
    def is_usable(cls) -> bool:
        """The inner tool's own check (SDK versions that have one), so the catalog stays honest."""
        check = getattr(_inner_tool_class(cls.inner_name), "is_usable", None)
        return bool(check()) if check is not None else True

    @classmethod
    def create(cls, conv_state: Any = None, **params: Any) -> Sequence[ToolDefinition]:
        mars = {k: params.pop(k) for k in _MARS_PARAMS if k in params}
        inner_cls = _inner_tool_class(cls.inner_name)
        tools = inner_cls.create(conv_state=conv_state, **params)
        if cls.inner_name == "terminal":  # its shell in step before the first command's events
            for tool in tools:
                rounds = wait_until_ready(tool.executor)
                if rounds > CLEAN_ROUNDS:
                    logger.warning("terminal: its shell answered after %d handshakes (a busy "
                                   "machine; mars_openhands/openhands/terminal_ready.py)", rounds)
        session_id = str(mars.get("mars_session_id") or conv_state.id)
        workspace = Path(mars.get("mars_workspace") or conv_state.workspace.working_dir)
        lifecycle = cls.lifecycle
        if lifecycle is not None and not (mars.get("mars_events_url") or mars.get("mars_events_path")):
            # One sender, one ordered queue: a conversation's last tool_end cannot be overtaken by
            # the session_end its lifecycle posts (separate senders raced on a loaded machine).
            sender = lifecycle.sender
        else:
            sender = EventSender(mars.get("mars_events_url") or os.environ.get(ENV_EVENTS_URL),
                                 mars.get("mars_events_path") or os.environ.get(ENV_EVENTS_PATH))
        policy = _policy_from(mars.get("mars_policy"))
        timings_path = (Path(sender.events_path).with_name("tool_timings.jsonl")
                        if sender.events_path else None)
        if lifecycle is not None:
            lifecycle.track(conv_state)
        return [
            tool.set_executor(EventedExecutor(
                tool.executor, tool.name, tool.observation_type, session_id, sender, workspace,
                policy, str(mars.get("mars_source") or "agent"), timings_path,
                on_close=None if lifecycle is None else functools.partial(lifecycle.closed,
                                                                          str(conv_state.id)),
                owns_sender=sender is not getattr(lifecycle, "sender", None)))
            for tool in tools
        ]


class MarsTerminalTool(_EventedToolBase):
    """``terminal`` with MARS tool events and the policy check."""

    inner_name: ClassVar[str] = "terminal"
    user_selectable: ClassVar[bool] = False  # the runner's spec name; the catalog offers "terminal"


class MarsFileEditorTool(_EventedToolBase):
    """``file_editor`` with MARS tool events and the policy check."""

    inner_name: ClassVar[str] = "file_editor"
    user_selectable: ClassVar[bool] = False


class MarsTaskTrackerTool(_EventedToolBase):
    """``task_tracker`` with MARS tool events."""

    inner_name: ClassVar[str] = "task_tracker"
    user_selectable: ClassVar[bool] = False


class StockNamedTerminalTool(MarsTerminalTool):
    """``terminal`` registered under its stock name (agent-server, app): as the stock tool in the
    catalog, with the session lifecycle when one is installed."""

    user_selectable: ClassVar[bool] = True


class StockNamedFileEditorTool(MarsFileEditorTool):
    """``file_editor`` under its stock name (see :class:`StockNamedTerminalTool`)."""

    user_selectable: ClassVar[bool] = True


class StockNamedTaskTrackerTool(MarsTaskTrackerTool):
    """``task_tracker`` under its stock name (see :class:`StockNamedTerminalTool`)."""

    user_selectable: ClassVar[bool] = True


_EVENTED_CLASSES: dict[str, type[_EventedToolBase]] = {
    "terminal": MarsTerminalTool, "file_editor": MarsFileEditorTool,
    "task_tracker": MarsTaskTrackerTool,
}
_STOCK_NAMED_CLASSES: dict[str, type[_EventedToolBase]] = {
    "terminal": StockNamedTerminalTool, "file_editor": StockNamedFileEditorTool,
    "task_tracker": StockNamedTaskTrackerTool,
}


def register_evented_tools(override_defaults: bool = False,
                           lifecycle: Any = None) -> dict[str, str]:
    """Register the wrapped tools with the SDK's tool registry (idempotent).

    Args:
        override_defaults: also register them under the default names (``terminal``, ...), so that
            agent specs written for stock OpenHands (app, agent-server) get events and the policy
            check without changes. The stock tool modules are imported first: their import
            registers the stock tools, and an import after ours (the agent-server's tool router
            imports them at start-up) would replace ours. The runner leaves this off and uses the
            ``mars_*`` names.
        lifecycle: with ``override_defaults``, the
            :class:`~mars_openhands.openhands.lifecycle.ConversationLifecycle` that conversations
            using the stock names are tracked by (``None``: no session events from the tools).

    Returns:
        spec name → LLM-visible tool name, e.g. ``{"mars_terminal": "terminal", ...}``.

    Mutates: the SDK's tool registry; with ``override_defaults``, the stock-named classes'
    ``lifecycle`` (one per process: the registry is process-wide too).
    """
    names = {}
    for tool_name in EVENTED_TOOL_NAMES:
        # The stock tool classes must be importable before a persisted conversation is loaded:
        # its state names them by kind (a resumed task failed with "Unexpected kind
        # 'TerminalTool'" in a fresh process, issue 33).
        _inner_tool_class(tool_name)
    registered = get_tool_module_qualnames()
    for tool_name, cls in _EVENTED_CLASSES.items():
        if registered.get(f"mars_{tool_name}") != cls.__module__:  # (the SDK warns on a repeat)
            register_tool(f"mars_{tool_name}", cls)
        names[f"mars_{tool_name}"] = tool_name
    if override_defaults:
        for tool_name, cls in _STOCK_NAMED_CLASSES.items():
            inner = _inner_tool_class(tool_name)  # the stock module's import registered it first
            cls.catalog_description = getattr(inner, "catalog_description", "")
            cls.lifecycle = lifecycle
            with replacing_stock_tool(tool_name):  # on purpose: no "Duplicate tool name" warning
                register_tool(tool_name, cls)
            names[tool_name] = tool_name
    return names


# Like the SDK's own tool modules, importing this module registers its tools (under the ``mars_*``
# names only; stock names are untouched). This is what lets an agent-server import it by qualname
# (``tool_module_qualnames`` sent by a RemoteConversation, or ``--import-modules``).
register_evented_tools()
