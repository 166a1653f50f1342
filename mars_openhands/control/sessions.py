"""Session registry and tool-plane signals of the gateway (design.md §2, §6).

A :class:`Session` is one agent task as the gateway sees it: its turns (LLM requests), the replica
holding its KV, its admission slot and its tool calls. :class:`ToolTracker` turns CPU-plane events
into the two CPU pressure signals of the admission window: the backlog ratio
``rho = in-flight tool calls / tool workers`` and the EMA of tool queue wait.

Mutates only its own objects; single-threaded. Both are components of
:class:`~mars_openhands.control.plane.ControlPlane`, which drives the session lifecycle.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from dataclasses import dataclass, field

from mars_openhands.policy.admission import ema

__all__ = ["Session", "SessionRegistry", "ToolCall", "ToolTracker", "TurnAttempts"]


@dataclass
class ToolCall:
    """One enqueued or running tool call of a session. Mutable; owned by its :class:`Session`."""

    tool_name: str
    is_started: bool
    since_s: float
    """Monotonic seconds of its ``tool_enqueued`` or, once started, its ``tool_start``."""
    deadline_s: float
    """``since_s`` + its bound: past this with no ``tool_end`` the control plane closes it as
    ``"interrupted"`` (the agent is presumed dead) and it no longer keeps the session alive."""


@dataclass
class TurnAttempts:
    """A session's latest agent turn and its attempts in flight. Mutable; owned by its
    :class:`Session`.

    An agent retries a turn after an error (or a client library re-sends it): every attempt is the
    same turn. One that ends without an answer (client gone, replica or engine error) gives the
    turn back when no other attempt of it is running or has answered, so the next request takes
    its number again.
    """

    turn: int
    fingerprint: int | None
    """:func:`~mars_openhands.control.metadata.body_fingerprint` of the turn's request body; a
    request with the same one is another attempt of this turn (``None``: not compared)."""
    prev_tool: tuple[str, float] | None
    """The ``mars_prev_tool`` it carries (every attempt carries the same)."""
    num_live: int = 1
    """Attempts of it being served now."""
    is_answered: bool = False
    """An attempt of it was answered (its response ended normally)."""


@dataclass
class Session:
    """Gateway-side state of one session. Mutable; owned by :class:`SessionRegistry`."""

    session_id: str
    created_s: float
    """Monotonic seconds when the gateway first saw it."""
    is_one_turn: bool = False
    """A request without a session id: the session ends with its only request."""
    num_turns: int = 0
    """Agent turns (LLM requests that are not side requests) started so far: the next turn's
    0-based index."""
    num_side_requests: int = 0
    """Side requests (titles, summaries: chat requests without tools) started so far."""
    first_turn_s: float | None = None
    """Monotonic seconds when its first agent turn started (``None``: none yet); the engine's
    ``mars_session_age_s`` counts from it."""
    replica: int | None = None
    """Index of the replica holding its KV (affinity), once routed."""
    num_in_flight: int = 0
    """LLM requests of this session currently being served."""
    last_activity_s: float = 0.0
    """Monotonic seconds of the last request end, event or admission."""
    tools_in_flight: dict[str, ToolCall] = field(default_factory=dict)
    """tool_call_id → the call, for enqueued or running tool calls."""
    tool_timeout_s: float | None = None
    """The task's bound on one tool call (``session_start.tool_timeout_s``); ``None``: the
    gateway's ``tool_call_timeout_s``."""
    prev_tool: tuple[str, float] | None = None
    """(tool_name, duration_s) of the tools that ended since the previous turn: the one that ended
    last, and the span from the first start to the last end (what the next turn waited; one
    call: its own duration)."""
    tool_batch_ns: tuple[int, int] | None = None
    """(first start, last end) of those tools on the agent's monotonic clock, ns (``tool_end``'s
    ``t_mono_ns``, minus its ``duration_s`` for the start); ``None``: none ended since the turn."""
    last_turn: TurnAttempts | None = None
    """The latest turn and its attempts (``None``: none yet, or it was given back)."""
    num_turn_retries: int = 0
    """Requests taken as another attempt of the latest turn (same body)."""
    has_ended: bool = False


class SessionRegistry:
    """All live sessions by id. Single-threaded."""

    def __init__(self) -> None:
        self._sessions: dict[str, Session] = {}

    def __len__(self) -> int:
        return len(self._sessions)

    def __iter__(self) -> Iterator[Session]:
        return iter(list(self._sessions.values()))

    def get(self, session_id: str) -> Session | None:
        """Return the session or ``None``."""
        return self._sessions.get(session_id)

    def get_or_create(self, session_id: str, now_s: float, is_one_turn: bool = False) -> Session:
        """Return the session, creating it (not admitted, no replica) if new. Mutates the registry."""
        session = self._sessions.get(session_id)
        if session is None:
            session = Session(session_id, now_s, is_one_turn=is_one_turn, last_activity_s=now_s)
            self._sessions[session_id] = session
        return session

    def remove(self, session_id: str) -> Session | None:
        """Forget the session; return it (or ``None``). Mutates the registry."""
        return self._sessions.pop(session_id, None)

    def idle(self, now_s: float, timeout_s: float) -> list[Session]:
        """Sessions with no request in flight, no tool call within its bound, and no activity for
        ``timeout_s`` seconds. A tool call past its ``deadline_s`` keeps nobody alive: its agent
        is presumed dead (the control plane closes such calls as ``"interrupted"``). Pure."""
        return [
            s for s in self._sessions.values()
            if s.num_in_flight == 0 and now_s - s.last_activity_s >= timeout_s
            and all(call.deadline_s <= now_s for call in s.tools_in_flight.values())
        ]

    def overdue_tools(self, now_s: float) -> list[tuple[Session, str, ToolCall]]:
        """``(session, tool_call_id, call)`` of every tool call past its deadline, oldest first.
        Pure."""
        overdue = [(s, call_id, call) for s in self._sessions.values()
                   for call_id, call in s.tools_in_flight.items() if call.deadline_s <= now_s]
        return sorted(overdue, key=lambda item: item[2].deadline_s)


def batch_span(batch: tuple[int, int], start_ns: int, end_ns: int) -> tuple[int, int]:
    """``batch`` (first start, last end), ns, widened by one call from ``start_ns`` to ``end_ns``.
    Pure.

    Mental model: the agent's next LLM call waits for the whole batch of tool calls of a turn,
    whether they ran side by side (SDK ``tool_concurrency_limit`` > 1) or one after the other::

        c1 |======|
        c2  |===========|          next turn: mars_prev_tool_s = last end - first start
        c3    |==|
           ^first start  ^last end
    """
    return min(batch[0], start_ns), max(batch[1], end_ns)


class ToolTracker:
    """In-flight tool calls and the EMA of their queue wait (the CPU plane of design.md §6).

    Args:
        num_tool_workers: N_tool.
        alpha: EMA weight of the newest queue-wait sample (design default 0.2).
    """

    def __init__(self, num_tool_workers: int, alpha: float) -> None:
        self.num_tool_workers = num_tool_workers
        self.alpha = alpha
        self.num_queued = 0
        """Tool calls enqueued and not yet started."""
        self.num_in_flight = 0
        """Tool calls enqueued or running, not yet ended."""
        self.wait_ema_s: float | None = None
        self._fraction_num = 0.0
        self._fraction_den = 0.0
        self._fraction_at_s: float | None = None

    @property
    def tool_fraction(self) -> float | None:
        """f: share of admitted sessions' time in tool calls (queued or running), the ratio of the
        two decayed integrals :meth:`observe_fraction` keeps; ``None`` before any admitted time."""
        return min(1.0, self._fraction_num / self._fraction_den) if self._fraction_den > 0.0 else None

    def observe_fraction(self, num_admitted: int, now_s: float, horizon_s: float) -> None:
        """Add the interval since the last call to the tool fraction: its in-flight tool calls and
        ``num_admitted`` sessions, each integral decayed by ``exp(-dt / horizon_s)``. Mutates."""
        last, self._fraction_at_s = self._fraction_at_s, now_s
        if last is None or now_s <= last:
            return
        dt = now_s - last
        decay = math.exp(-dt / horizon_s)
        self._fraction_num = self._fraction_num * decay + self.num_in_flight * dt
        self._fraction_den = self._fraction_den * decay + num_admitted * dt

    @property
    def backlog_ratio(self) -> float:
        """rho = in-flight tool calls / tool workers."""
        return self.num_in_flight / self.num_tool_workers

    def on_enqueued(self, session: Session, tool_call_id: str, tool_name: str, now_s: float,
                    bound_s: float) -> None:
        """A tool call entered the tool queue; ``bound_s`` seconds from ``now_s`` it is overdue.
        Mutates ``session`` and the counts."""
        if tool_call_id not in session.tools_in_flight:
            session.tools_in_flight[tool_call_id] = ToolCall(tool_name, False, now_s, now_s + bound_s)
            self.num_in_flight += 1
            self.num_queued += 1

    def on_start(self, session: Session, tool_call_id: str, tool_name: str, queue_wait_s: float,
                 now_s: float, bound_s: float) -> None:
        """A tool call started (with or without a prior ``tool_enqueued``); its bound restarts.
        Mutates the counts."""
        call = session.tools_in_flight.get(tool_call_id)
        if call is None:
            self.num_in_flight += 1
        elif not call.is_started:
            self.num_queued -= 1
        session.tools_in_flight[tool_call_id] = ToolCall(tool_name, True, now_s, now_s + bound_s)
        self.wait_ema_s = ema(self.wait_ema_s, queue_wait_s, self.alpha)

    def on_end(self, session: Session, tool_call_id: str, tool_name: str, duration_s: float,
               is_measured: bool = True, end_mono_ns: int | None = None) -> None:
        """A tool call ended; a measured one joins the session's ``prev_tool`` (an interrupted
        one, ``is_measured=False``, has no duration to report). ``end_mono_ns``: its
        ``tool_end.t_mono_ns`` (the agent's clock); with it, calls that ended since the previous
        turn add up to their span (:func:`batch_span`), without it the call's own duration
        stands. Mutates the counts and ``session``."""
        call = session.tools_in_flight.pop(tool_call_id, None)
        if call is not None:
            self.num_in_flight -= 1
            self.num_queued -= 0 if call.is_started else 1
        if not is_measured:
            return
        if end_mono_ns is None:
            session.prev_tool, session.tool_batch_ns = (tool_name, duration_s), None
            return
        start_ns = end_mono_ns - round(duration_s * 1e9)
        batch = session.tool_batch_ns
        if batch is None or session.prev_tool is None:
            session.tool_batch_ns, session.prev_tool = (start_ns, end_mono_ns), (tool_name, duration_s)
            return
        name = tool_name if end_mono_ns >= batch[1] else session.prev_tool[0]
        session.tool_batch_ns = batch_span(batch, start_ns, end_mono_ns)
        session.prev_tool = (name, (session.tool_batch_ns[1] - session.tool_batch_ns[0]) / 1e9)

    def forget(self, session: Session) -> None:
        """Drop the session's in-flight tool calls (session ended or timed out)."""
        self.num_in_flight -= len(session.tools_in_flight)
        self.num_queued -= sum(1 for c in session.tools_in_flight.values() if not c.is_started)
        session.tools_in_flight.clear()

    def decay_if_idle(self) -> None:
        """Feed a 0 s sample when no tool call is queued (``tool_wait_idle_decay``)."""
        if self.num_queued == 0 and self.wait_ema_s is not None:
            self.wait_ema_s = ema(self.wait_ema_s, 0.0, self.alpha)
