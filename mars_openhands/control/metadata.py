"""Session metadata: from the agent's request to the engine's ``session_id`` and ``vllm_xargs`` (design.md §2).

Agents need no engine knowledge: the gateway finds the session in what they already send and
rewrites the body for vLLM 0.32, which has a native per-conversation ``session_id`` field (it reaches
the engine as ``Request.session_id``) and passes ``vllm_xargs`` (str/int/float values) through as
``request.sampling_params.extra_args``.

Where the session id comes from, first match wins:

==========================  ======  ==========================================================
``X-Mars-Session``          header  ours, explicit
``mars_session``            body    ours, explicit (removed before forwarding)
``session_id``              body    vLLM's native field, already set by the client
``x-litellm-session-id``    header  OpenHands 1.58 (LiteLLM) sends the conversation id here
``prompt_cache_key``        body    OpenHands 1.58 also sends the conversation id here
==========================  ======  ==========================================================

A request with none of them is a one-turn session. Extras sent to the engine in ``vllm_xargs``:
``mars_turn`` (0-based agent turn; omitted on a side request), ``mars_last_step`` (0/1, when the agent says so via body
``mars_last_step`` or header ``X-Mars-Last-Step``), and ``mars_prev_tool`` / ``mars_prev_tool_s`` (name and
measured duration of the tool that ended since the previous turn, from the agent's ``tool_end``),
``mars_session_age_s`` (seconds since the session's first turn, on every request after it: a replica
the session moved to keeps its place in session order; an agent's own value is dropped), and
``mars_side=1`` on a side request.

Side requests: a chat completion without ``tools`` in a multi-turn session is a call made beside
the agent loop (the OpenHands app's conversation title, a condenser summary). It is not an agent
turn: it does not advance the session's ``mars_turn`` or take its ``mars_prev_tool``, and the engine
gets ``mars_side=1`` instead of a turn (:func:`is_side_request`; body ``mars_side`` 0/1 overrides
the rule). All functions here are pure and raise :class:`BadRequestError` (HTTP 400) naming the field.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

from mars_openhands.policy.types import MARS_EXTRA_KEYS, parse_turn_meta

__all__ = [
    "BadRequestError",
    "FINGERPRINT_SAMPLE_BYTES",
    "MAX_SESSION_ID_CHARS",
    "SESSION_SOURCES",
    "body_fingerprint",
    "build_engine_body",
    "check_xargs",
    "estimate_prompt_tokens",
    "extract_last_step",
    "extract_session_id",
    "gateway_xargs",
    "is_side_request",
    "validate_session_id",
]

MAX_SESSION_ID_CHARS = 256
"""Longest accepted session id, characters."""

SESSION_SOURCES: tuple[tuple[str, str], ...] = (
    ("header", "x-mars-session"),
    ("body", "mars_session"),
    ("body", "session_id"),
    ("header", "x-litellm-session-id"),
    ("body", "prompt_cache_key"),
)
"""(where, name) of each session id source, in priority order."""

_GATEWAY_BODY_FIELDS = ("mars_session", "mars_last_step", "mars_side")
FINGERPRINT_SAMPLE_BYTES = 4096
"""Bytes of a request body :func:`body_fingerprint` reads, spread evenly (plus its last 512)."""
CHAT_PATH = "/v1/chat/completions"


class BadRequestError(ValueError):
    """The agent's request is malformed; ``str(error)`` names the field, the value and the fix.

    Attributes:
        status_code: the HTTP status to answer with (400 unless stated).
        kind: the OpenAI error ``type`` of the answer.
    """

    def __init__(self, message: str, status_code: int = 400) -> None:
        super().__init__(message)
        self.status_code = status_code
        self.kind = "invalid_request_error"


def validate_session_id(value: Any, field: str) -> str:
    """Return ``value`` if it is a usable session id, else raise.

    Raises:
        BadRequestError: not a string, empty, longer than 256 characters or with control characters.
    """
    if not isinstance(value, str):
        raise BadRequestError(
            f"{field} must be a string session id, got {type(value).__name__} {value!r}"
        )
    if not value or len(value) > MAX_SESSION_ID_CHARS:
        raise BadRequestError(
            f"{field} must be 1..{MAX_SESSION_ID_CHARS} characters, got {len(value)}"
        )
    if not value.isprintable():
        raise BadRequestError(f"{field} must be printable text, got {value!r}")
    return value


def extract_session_id(headers: Mapping[str, str], body: Mapping[str, Any]) -> tuple[str | None, str | None]:
    """Find the session id of a request (sources in :data:`SESSION_SOURCES` order). Pure.

    Args:
        headers: request headers, with lower-case names (or a case-insensitive mapping).
        body: the parsed JSON body.

    Returns:
        ``(session_id, field)``, e.g. ``("conv-1", "header x-litellm-session-id")``, or
        ``(None, None)`` for a one-turn request.

    Raises:
        BadRequestError: the first present source holds a bad value.
    """
    for where, name in SESSION_SOURCES:
        value = headers.get(name) if where == "header" else body.get(name)
        if value is None:
            continue
        field = f"{where} {name}"
        return validate_session_id(value, field), field
    return None, None


def extract_last_step(headers: Mapping[str, str], body: Mapping[str, Any]) -> int | None:
    """Return ``mars_last_step`` (0 or 1) from the body or the ``X-Mars-Last-Step`` header, if given.

    Raises:
        BadRequestError: a value other than true/false/0/1.
    """
    value: Any = body.get("mars_last_step")
    field = "body mars_last_step"
    if value is None:
        value, field = headers.get("x-mars-last-step"), "header x-mars-last-step"
    if value is None:
        return None
    if isinstance(value, bool):
        return int(value)
    if value in (0, 1, "0", "1", "true", "false"):
        return 1 if value in (1, "1", "true") else 0
    raise BadRequestError(f"{field} must be 0/1 or true/false, got {value!r}")


def is_side_request(path: str, fields: Mapping[str, Any]) -> bool:
    """Whether a request is a side request rather than an agent turn. Pure.

    Args:
        path: the request path; only chat completions can be side requests (a raw
            ``/v1/completions`` prompt carries no tools to judge by).
        fields: the body's fields: ``has_tools`` (bool, from :func:`proxy.probe_body`) or
            ``tools`` (the list itself), and the agent's explicit ``mars_side`` if sent.

    Returns:
        The agent's ``mars_side`` when given, else ``True`` for a chat completion without tools.

    Raises:
        BadRequestError: ``mars_side`` other than true/false/0/1.
    """
    explicit = fields.get("mars_side")
    if explicit is not None:
        if isinstance(explicit, bool) or explicit in (0, 1):
            return bool(explicit)
        raise BadRequestError(f"body mars_side must be 0/1 or true/false, got {explicit!r}")
    has_tools = fields.get("has_tools", bool(fields.get("tools")))
    return path == CHAT_PATH and not has_tools


def check_xargs(value: Any) -> dict[str, Any]:
    """Return the agent's own ``vllm_xargs`` if the engine will accept it, else raise. Pure.

    vLLM passes ``vllm_xargs`` through as ``sampling_params.extra_args`` (str/int/float/list values);
    the scheduler plugin then parses the ``mars_*`` keys with
    :func:`mars_openhands.policy.types.parse_turn_meta` and fails the request (HTTP 500 from vLLM)
    on a bad one. Checking here turns that into a 400 before anything is forwarded.

    Raises:
        BadRequestError: not an object, a value of another type, an unknown ``mars_*`` key, or a
            ``mars_*`` value of the wrong type or range (a bool only for ``mars_side`` and
            ``mars_last_step``; a JSON ``true`` reaches the engine as ``1``, where it could pass
            as a turn); the message names ``body vllm_xargs.<key>``.
    """
    if not isinstance(value, dict):
        raise BadRequestError(f"body vllm_xargs must be an object, got {type(value).__name__}")
    for key, item in value.items():
        if key.startswith("mars_"):  # parse_turn_meta's strict types (a bool only as a flag)
            if key not in MARS_EXTRA_KEYS:
                raise BadRequestError(
                    f"body vllm_xargs.{key} is not a MARS key; supported: {list(MARS_EXTRA_KEYS)} "
                    "(mars_turn is set by the gateway)"
                )
            try:
                parse_turn_meta({key: item})
            except ValueError as e:
                raise BadRequestError(f"body vllm_xargs.{key}: {e}") from None
        elif not isinstance(item, (str, int, float, list)) or isinstance(item, bool):
            raise BadRequestError(
                f"body vllm_xargs.{key} must be a string, integer, float or list, got {item!r}"
            )
    return value


def build_engine_body(
    body: Mapping[str, Any],
    session_id: str | None,
    turn: int | None,
    last_step: int | None = None,
    prev_tool: tuple[str, float] | None = None,
    session_age_s: float | None = None,
) -> dict[str, Any]:
    """Return the body to send to vLLM: native ``session_id`` plus the MARS ``vllm_xargs``. Pure.

    Args:
        body: the agent's parsed body (not mutated).
        session_id: the session, or ``None`` for a one-turn request (no ``session_id`` is set).
        turn: 0-based turn of this request within the session; ``None`` for a side request
            (``mars_side=1`` is sent instead, and no ``mars_prev_tool``).
        last_step: 0/1 when the agent said whether this is the session's last LLM call.
        prev_tool: ``(tool_name, duration_s)`` of the tool that ended since the previous turn.
        session_age_s: seconds since the session's first turn (``mars_session_age_s``). The
            agent's own value is always dropped: only the gateway dates a session, or an agent
            could make its session the oldest on a replica.

    Raises:
        BadRequestError: the agent's own ``vllm_xargs`` is not an object of str/int/float/list
            values, or has a bad ``mars_*`` key or value (:func:`check_xargs`).
    """
    out = {k: v for k, v in body.items() if k not in _GATEWAY_BODY_FIELDS}
    xargs: dict[str, Any] = dict(check_xargs(body["vllm_xargs"])) if "vllm_xargs" in body else {}
    xargs.pop("mars_side", None)
    xargs.pop("mars_session_age_s", None)
    if turn is None:
        xargs.pop("mars_turn", None)
    xargs.update(gateway_xargs(turn, last_step, prev_tool, session_age_s))
    if session_id is not None:
        out["session_id"] = session_id
    out["vllm_xargs"] = xargs
    return out


def gateway_xargs(turn: int | None, last_step: int | None = None,
                  prev_tool: tuple[str, float] | None = None,
                  session_age_s: float | None = None) -> dict[str, Any]:
    """The ``vllm_xargs`` keys the gateway sets on a request (the arguments as in
    :func:`build_engine_body`): ``mars_turn``, or ``mars_side=1`` on a side request (``turn``
    None, which takes no ``mars_prev_tool``); ``mars_last_step``, ``mars_prev_tool`` /
    ``mars_prev_tool_s`` and ``mars_session_age_s`` when given. The gateway's two body paths and
    the simulator build them here. Pure."""
    xargs: dict[str, Any] = {"mars_turn": turn} if turn is not None else {"mars_side": 1}
    if last_step is not None:
        xargs["mars_last_step"] = last_step
    if prev_tool is not None and turn is not None:
        xargs["mars_prev_tool"] = prev_tool[0]
        xargs["mars_prev_tool_s"] = float(prev_tool[1])
    if session_age_s is not None:
        xargs["mars_session_age_s"] = float(session_age_s)
    return xargs


def body_fingerprint(raw: bytes) -> int:
    """A fingerprint of a request body, to tell a retry of a session's latest turn (the same
    body again) from its next turn. Pure; reads about 4.5 KiB whatever the body's size.

    Equal bodies have equal fingerprints. An agent's next turn has a longer body (the
    conversation grew) or, after a condenser rewrote its history, one that differs over a long
    stretch; the fingerprint covers the length, :data:`FINGERPRINT_SAMPLE_BYTES` bytes at an even
    stride and the last 512 bytes, so such bodies differ. Bodies that differ only in a few bytes
    between samples (the same conversation with another ``temperature``) may share one: they are
    the same turn asked again. In-process only (Python's ``hash`` is salted per process).
    """
    stride = max(1, len(raw) // FINGERPRINT_SAMPLE_BYTES)
    return hash((len(raw), raw[::stride], raw[-512:]))


def estimate_prompt_tokens(body: Mapping[str, Any], num_body_bytes: int, bytes_per_token: float) -> int:
    """Estimate a request's prompt tokens without a tokenizer: its text bytes / ``bytes_per_token``.

    Uses the ``messages`` (chat) or ``prompt`` (completions) part of the body when present, else the
    whole body size. Pure.
    """
    part = body.get("messages", body.get("prompt"))
    if part is None:
        size = num_body_bytes
    elif isinstance(part, str):
        size = len(part.encode())
    else:
        size = len(json.dumps(part, separators=(",", ":")).encode())
    return max(1, int(size / bytes_per_token))
