"""Who may call the gateway: the API key, the admin key and per-session tokens (docs/gateway.md,
"Threat model").

An agent's own terminal can reach the gateway (the OpenHands command guard lets it ``curl``
loopback), so a prompt-injected agent must not be able to act for another session or read the
others' ids. Three credentials, each checked before a call changes anything:

* **API key** (``--api-key`` / ``MARS_GATEWAY_API_KEY``, vLLM's convention): the OpenAI routes
  (``/v1/*``) and ``POST /mars/v1/events`` need ``Authorization: Bearer <key>``; otherwise HTTP 401
  with vLLM's body, ``{"error": "Unauthorized"}``. Unset: open, as vLLM without ``--api-key``.
* **Admin key** (``--admin-key`` / ``MARS_GATEWAY_ADMIN_KEY``): ``GET /mars/v1/state`` with
  session ids needs it (401 otherwise). Unset: that route gives aggregate figures only.
* **Session token** (header ``X-Mars-Session-Token``): a random secret (≥ 128 bits) the client
  generates once per session. Trust on first use: the first token the gateway sees for a session
  id (on an LLM call or an event) binds the session to its SHA-256; from then on every event for
  the session and every LLM call naming it must carry the same token (HTTP 403 otherwise, nothing
  changes). An events batch always needs one (400 without it) and carries one session's events.
  An LLM call without a token for a session never bound works (stock clients), and the session
  stays unbound.

Mental model of a binding's life: bound at first use; forgotten when its owner ends the session
(``session_end``: the id may be bound again by the next token, e.g. the same client starting
over); kept ``session_token_keep_s`` after an idle release (the gateway forgot the session, but a
client that crashed may come back: a durable task resumes with the same persisted token and
passes, anyone else gets 403 until then).

Keys and tokens are compared as SHA-256 digests with :func:`secrets.compare_digest` (as vLLM's
``AuthenticationMiddleware`` does); the gateway keeps no token itself.
"""

from __future__ import annotations

import collections
import hashlib
import secrets
from collections.abc import Iterator

from mars_openhands.control.metadata import BadRequestError

__all__ = [
    "AuthError",
    "Credentials",
    "MAX_RELEASED_BINDINGS",
    "MAX_TOKEN_CHARS",
    "MIN_TOKEN_CHARS",
    "SESSION_TOKEN_HEADER",
    "SessionTokens",
    "UNAUTHORIZED_BODY",
]

SESSION_TOKEN_HEADER = "x-mars-session-token"
"""The per-session token's header (lower-case, as ASGI and httpx give header names)."""
MIN_TOKEN_CHARS = 22
"""Shortest accepted session token: 128 bits as URL-safe base64 (``secrets.token_urlsafe(16)``)."""
MAX_TOKEN_CHARS = 256
"""Longest accepted session token."""
MAX_RELEASED_BINDINGS = 100_000
"""Bindings kept for idle-released sessions at most (oldest dropped first; ~100 bytes each)."""
UNAUTHORIZED_BODY = b'{"error":"Unauthorized"}'
"""vLLM's 401 body (``AuthenticationMiddleware``), for a missing or wrong API or admin key."""


class AuthError(BadRequestError):
    """A call refused for its credentials: 400 (the token header is missing or malformed) or 403
    (the session belongs to another token, or a batch names another session). ``str()`` says which
    and how to fix it; ``kind`` is the OpenAI error type."""

    def __init__(self, message: str, status_code: int = 403) -> None:
        super().__init__(message, status_code)
        self.kind = "permission_error" if status_code == 403 else "invalid_request_error"


def _digest(secret: str) -> bytes:
    return hashlib.sha256(secret.encode("utf-8")).digest()


def bearer(authorization: str | None) -> str | None:
    """The credential of an ``Authorization: Bearer <credential>`` header (scheme case-insensitive,
    as vLLM reads it), or ``None``. Pure."""
    if not authorization:
        return None
    scheme, _, credential = authorization.partition(" ")
    return credential if scheme.lower() == "bearer" else None


class Credentials:
    """The gateway's API and admin keys, as digests.

    Args:
        api_key: the API key (``None``: the API routes are open).
        admin_key: the admin key (``None``: no admin view, only aggregate figures).
    """

    def __init__(self, api_key: str | None, admin_key: str | None) -> None:
        self._api = _digest(api_key) if api_key else None
        self._admin = _digest(admin_key) if admin_key else None

    @property
    def has_api_key(self) -> bool:
        """An API key is configured."""
        return self._api is not None

    @property
    def has_admin_key(self) -> bool:
        """An admin key is configured."""
        return self._admin is not None

    @staticmethod
    def _matches(authorization: str | None, digest: bytes) -> bool:
        credential = bearer(authorization)
        return credential is not None and secrets.compare_digest(_digest(credential), digest)

    def is_api_allowed(self, authorization: str | None) -> bool:
        """Whether a call with this ``Authorization`` header may use the API routes (always, when no
        API key is configured). Pure."""
        return self._api is None or self._matches(authorization, self._api)

    def is_admin(self, authorization: str | None) -> bool:
        """Whether this ``Authorization`` header carries the admin key (never, when none is
        configured). Pure."""
        return self._admin is not None and self._matches(authorization, self._admin)


def check_token_format(token: str) -> None:
    """Raise unless ``token`` can be a session token (printable ASCII without spaces,
    :data:`MIN_TOKEN_CHARS`..:data:`MAX_TOKEN_CHARS` characters).

    Raises:
        AuthError: HTTP 400 naming the header, the length and the fix.
    """
    if not (MIN_TOKEN_CHARS <= len(token) <= MAX_TOKEN_CHARS and token.isascii()
            and token.isprintable() and " " not in token):
        raise AuthError(
            f"header X-Mars-Session-Token must be {MIN_TOKEN_CHARS}..{MAX_TOKEN_CHARS} printable "
            f"ASCII characters without spaces, got {len(token)} characters; send a random secret "
            "made once per session, e.g. secrets.token_urlsafe(32)", 400)


class SessionTokens:
    """Session id → SHA-256 of its token (trust on first use). Single-threaded.

    Queries (:meth:`check`) bind nothing; the caller binds (:meth:`bind`) once the whole call is
    accepted, so a refused call changes nothing.

    Args:
        keep_s: seconds a binding outlives an idle release (:meth:`release`).
        max_released: bindings kept for released sessions at most (oldest dropped first).
    """

    def __init__(self, keep_s: float, max_released: int = MAX_RELEASED_BINDINGS) -> None:
        self.keep_s = keep_s
        self.max_released = max_released
        self._bound: dict[str, bytes] = {}
        self._released: collections.OrderedDict[str, tuple[bytes, float]] = collections.OrderedDict()
        """Released session id → (digest, monotonic seconds it expires), oldest first."""

    def __len__(self) -> int:
        return len(self._bound) + len(self._released)

    def __iter__(self) -> Iterator[str]:
        return iter([*self._bound, *self._released])

    def _bound_digest(self, session_id: str, now_s: float) -> bytes | None:
        digest = self._bound.get(session_id)
        if digest is not None:
            return digest
        released = self._released.get(session_id)
        if released is None or released[1] <= now_s:
            return None
        return released[0]

    def is_bound(self, session_id: str, now_s: float) -> bool:
        """Whether ``session_id`` is bound to a token now (live, or released within keep_s). Pure."""
        return self._bound_digest(session_id, now_s) is not None

    def check(self, session_id: str, token: str | None, now_s: float,
              is_required: bool) -> bytes | None:
        """Whether a caller presenting ``token`` may act for ``session_id``. Binds nothing.

        Args:
            session_id: the session the call names.
            token: the ``X-Mars-Session-Token`` header (``None``: absent).
            now_s: monotonic seconds (the control plane's clock).
            is_required: a token must be sent (events); else a tokenless call is fine for an
                unbound session (LLM calls of stock clients).

        Returns:
            The digest to :meth:`bind` (a token for an unbound session, or a released binding's
            own token coming back), else ``None``.

        Raises:
            AuthError: 400 the token is required but absent, or malformed; 403 the session is
                bound and the token is absent or another one.
        """
        if token is None:
            if is_required:
                raise AuthError(
                    f"header X-Mars-Session-Token is required on POST /mars/v1/events (session "
                    f"{session_id!r}); send the session's token, the one its LLM calls carry", 400)
            if self.is_bound(session_id, now_s):
                raise AuthError(
                    f"session {session_id!r} is bound to a session token: send it in header "
                    "X-Mars-Session-Token on every LLM call and event of the session")
            return None
        check_token_format(token)
        digest = _digest(token)
        bound = self._bound_digest(session_id, now_s)
        if bound is None:
            return digest
        if not secrets.compare_digest(digest, bound):
            raise AuthError(
                f"session {session_id!r} is bound to another X-Mars-Session-Token; send the token "
                "its client made, or use a session id of your own")
        return digest if session_id not in self._bound else None

    def bind(self, session_id: str, digest: bytes) -> None:
        """Bind ``session_id`` to ``digest`` (from :meth:`check`). Mutates the table."""
        self._released.pop(session_id, None)
        self._bound[session_id] = digest

    def forget(self, session_id: str) -> None:
        """The session's owner ended it (``session_end``): the id is free for the next token.
        Mutates the table."""
        self._bound.pop(session_id, None)
        self._released.pop(session_id, None)

    def release(self, session_id: str, now_s: float) -> None:
        """The gateway released the session for silence: keep its binding ``keep_s`` seconds (a
        crashed client resumes with its persisted token). Mutates the table."""
        digest = self._bound.pop(session_id, None)
        if digest is None:
            return
        self._released[session_id] = (digest, now_s + self.keep_s)
        self._released.move_to_end(session_id)
        while len(self._released) > self.max_released:
            self._released.popitem(last=False)

    def expire(self, now_s: float) -> int:
        """Drop released bindings past their time. Returns how many. Mutates the table."""
        num = 0
        while self._released:
            session_id, (_, until_s) = next(iter(self._released.items()))
            if until_s > now_s:
                break
            del self._released[session_id]
            num += 1
        return num
