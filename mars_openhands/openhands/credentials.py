"""Per-session credentials the gateway checks: the API key and the session token (issue 33 item 6).

A gateway started with ``--api-key`` takes ``Authorization: Bearer <key>`` on its OpenAI routes and
on ``POST /mars/v1/events``; and it binds each session to the first ``X-Mars-Session-Token`` it
sees, refusing (403) later LLM calls and event posts of that session with another token or none.
So an agent that can reach the gateway from its terminal cannot end, pin or otherwise forge
another session's state: it does not hold that session's token.

What our clients send:

* the **API key**: the one the session's LLM uses (LiteLLM sends it as Bearer on LLM calls; the
  event sender sends it on the session's event posts);
* the **token**: a random secret (:func:`new_session_token`, 256 bits) made once per session (one
  OpenHands conversation = one session), sent on every LLM call of the session (the
  per-conversation LLM's ``extra_headers``, :func:`attach_token`) and every event post for it.

Where a session's credentials live: in this process's :data:`SESSION_CREDENTIALS` (session id →
:class:`SessionCredentials`). Tool specs cannot carry them (the SDK persists specs as JSON), and
the environment cannot (the agent's terminal inherits it), so the senders look them up here.
Durable tasks keep the token in the runtime's database (``runtime/store.py``), so a task resumed
by another process sends the same one. The LLM's ``extra_headers`` are persisted with the
conversation (``base_state.json``): a resumed runner task reads its token back from there
(:func:`persisted_token`).

Limits: under one Unix user (runner tasks, the app's process sandbox) an agent can read the other
sessions' files and memory, persisted conversations included; the token keeps apart sessions
that do not share a user or a file system (the app's Docker sandboxes, one conversation each).
"""

from __future__ import annotations

import json
import secrets
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Any

__all__ = ["SESSION_CREDENTIALS", "TOKEN_HEADER", "CredentialRegistry", "SessionCredentials",
           "attach_token", "new_session_token", "persisted_token"]

TOKEN_HEADER = "X-Mars-Session-Token"
"""The session-token header on LLM calls and event posts (the gateway's contract)."""
TOKEN_BYTES = 32
"""Random bytes per token (``secrets.token_urlsafe(32)``: 256 bits; the contract asks >= 128)."""


def new_session_token() -> str:
    """A fresh session token: 43 URL-safe characters from ``secrets``."""
    return secrets.token_urlsafe(TOKEN_BYTES)


@dataclass(frozen=True)
class SessionCredentials:
    """What one session's requests carry to the gateway.

    Attributes:
        token: the session token (``None``: none is sent).
        api_key: the gateway API key, the session LLM's own (``None``: no ``Authorization``).
    """

    token: str | None = None
    api_key: str | None = None

    def event_headers(self) -> dict[str, str]:
        """Headers of an event post for this session. Pure."""
        headers = {}
        if self.api_key is not None:
            headers["authorization"] = f"Bearer {self.api_key}"
        if self.token is not None:
            headers[TOKEN_HEADER] = self.token
        return headers

    def __repr__(self) -> str:  # never print a secret
        return (f"SessionCredentials(token={'***' if self.token else None}, "
                f"api_key={'***' if self.api_key else None})")


class CredentialRegistry:
    """Session id → :class:`SessionCredentials`, for this process's event senders. Thread-safe."""

    def __init__(self) -> None:
        self._by_session: dict[str, SessionCredentials] = {}
        self._lock = threading.Lock()

    def set(self, session_id: str, credentials: SessionCredentials) -> None:
        """Record (or replace) the session's credentials."""
        with self._lock:
            self._by_session[session_id] = credentials

    def get(self, session_id: str) -> SessionCredentials | None:
        """The session's credentials, or ``None``."""
        with self._lock:
            return self._by_session.get(session_id)

    def forget(self, session_id: str) -> None:
        """Drop the session's credentials (idempotent)."""
        with self._lock:
            self._by_session.pop(session_id, None)


SESSION_CREDENTIALS = CredentialRegistry()
"""This process's registry: one per process by design, as the SDK's tool registry is (tools are
built from JSON specs, which cannot hold a secret; see the module docstring)."""


def attach_token(llm: Any, token: str) -> None:
    """Send ``token`` on every call of ``llm`` (and of its copies made from now on).

    Mutates: ``llm.extra_headers`` (a new dict with :data:`TOKEN_HEADER` added; the SDK reads
    it at each call, and its ``model_copy`` copies, e.g. for titles, keep it).
    """
    headers = dict(getattr(llm, "extra_headers", None) or {})
    if headers.get(TOKEN_HEADER) != token:
        headers[TOKEN_HEADER] = token
        llm.extra_headers = headers


def persisted_token(conversation_dir: Path, session_id: str) -> str | None:
    """The token a conversation persisted by the SDK under ``conversation_dir`` sent (its agent
    LLM's ``extra_headers``), or ``None`` (none persisted, or unreadable)."""
    state = conversation_dir / session_id.replace("-", "") / "base_state.json"
    try:
        headers = json.loads(state.read_text())["agent"]["llm"].get("extra_headers") or {}
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return None
    token = headers.get(TOKEN_HEADER)
    return token if isinstance(token, str) and token else None
