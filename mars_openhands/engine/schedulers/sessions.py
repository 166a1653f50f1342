"""``SessionTable``: the engine's per-session records, with one slot for the policy's program.

Mental model: a session (``Request.session_id``) is a sequence of LLM calls separated by tool
runs (:mod:`mars_openhands.policy.session`). The base scheduler opens a session's record at its
first request and forgets it at ``session_end`` (once nothing of it is in the engine) or after
``session_idle_timeout_s`` without a request or event (when it holds no retained KV). Program-level
policies keep their per-program state in the record's ``program`` slot (Autellix's PLAS program,
Continuum's program arrival and turn counts), so it lives and dies with the session instead of in
a dictionary of their own that needs its own garbage collection. A request without a session is
a one-call program; its state stays with the request, not here.

Owned by one scheduler; not thread-safe (the engine thread only).
"""

from __future__ import annotations

from collections.abc import Container, Iterator, Mapping
from typing import Any

from mars_openhands.policy.session import SessionState

__all__ = ["SESSION_GC_INTERVAL_S", "SessionTable"]

SESSION_GC_INTERVAL_S = 10.0
"""Seconds between two sweeps for idle sessions (:meth:`SessionTable.forget_idle`): the scheduler
sweeps at its first step past the interval."""


class SessionTable(Mapping[str, SessionState]):
    """Session id -> :class:`SessionState`; a read-only mapping to its users.

    Changed only through :meth:`open`, :meth:`adopt`, :meth:`forget` and :meth:`forget_idle`.
    """

    def __init__(self) -> None:
        self._sessions: dict[str, SessionState] = {}

    def __getitem__(self, session_id: str) -> SessionState:
        return self._sessions[session_id]

    def __iter__(self) -> Iterator[str]:
        return iter(self._sessions)

    def __len__(self) -> int:
        return len(self._sessions)

    def __contains__(self, session_id: object) -> bool:
        return session_id in self._sessions

    def get(self, session_id: str, default: Any = None) -> Any:
        """The session's record, else ``default``. Pure."""
        return self._sessions.get(session_id, default)

    def open(self, session_id: str, now_s: float, age_s: float | None = None) -> SessionState:
        """The session's record, created with ``first_arrival_s = now_s - age_s`` if it has none
        (``age_s``: the gateway's ``mars_session_age_s``, seconds, for a session that moved here
        from another replica; ``None``: 0, a new session). An existing record keeps its own first
        arrival. Mutates."""
        session = self._sessions.get(session_id)
        if session is None:
            first = now_s if age_s is None else now_s - age_s
            session = self._sessions[session_id] = SessionState(session_id, first_arrival_s=first)
        return session

    def adopt(self, session: SessionState) -> None:
        """Take over another table's record (a session moving between the schedulers of one
        shared KV pool), its program included. Mutates.

        Raises:
            ValueError: this table already has a record for the session.
        """
        if session.session_id in self._sessions:
            raise ValueError(f"session {session.session_id!r} already has a record here")
        self._sessions[session.session_id] = session

    def forget(self, session_id: str) -> SessionState | None:
        """Drop the session's record (and its program); returns it, or None. Mutates."""
        return self._sessions.pop(session_id, None)

    def forget_idle(self, now_s: float, timeout_s: float, keep: Container[str]) -> list[str]:
        """Drop every session with no request in the engine, not in ``keep`` (e.g. holding
        retained KV), and idle for more than ``timeout_s`` seconds. Returns their ids. Mutates."""
        idle = [sid for sid, s in self._sessions.items()
                if not s.active_request_ids and sid not in keep and now_s - s.last_activity_s > timeout_s]
        for sid in idle:
            del self._sessions[sid]
        return idle

    def program(self, session_id: str | None) -> Any:
        """The policy's program state of the session (None: no session, or none yet). Pure."""
        session = self._sessions.get(session_id) if session_id is not None else None
        return session.program if session is not None else None

    def set_program(self, session_id: str, program: Any) -> bool:
        """Store ``program`` in the session's slot (None clears it). Returns False, storing
        nothing, when the session has no record (it was forgotten: so is its program). Mutates."""
        session = self._sessions.get(session_id)
        if session is None:
            return False
        session.program = program
        return True
