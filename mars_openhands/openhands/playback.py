"""Playback engine: an OpenAI-compatible server that answers with recorded assistant turns.

Where no real model can run (this CPU machine), the agent path must still be exercised for real. The
playback server stands in for the model's *choices* only: each chat completion is answered with the
next recorded assistant turn (text plus tool calls) of a script, so OpenHands parses real tool calls
and executes them with its real tools (terminal, file editor, task tracker) in a real workspace.

What is played back and what is real:

* **played back**: the assistant's message text and tool calls (from a script or a mini-swe-agent
  trace in ``shared/data/traces/mini-swe-agent``; its single ``bash`` tool maps to OpenHands'
  ``terminal`` tool, ``/testbed`` to the workspace).
* **real**: OpenHands' agent loop, prompt building, tool parsing and execution, the workspace's files,
  the tool wrapper's events and timings, the gateway, and (with ``upstream_url``) the engine: every
  turn is forwarded to a real vLLM server with the real prompt (truncated to ``max_prompt_chars``),
  the session's ``session_id`` / ``vllm_xargs`` and ``max_tokens`` = the recorded completion length
  (``ignore_eos``), so the engine's scheduler, prefix cache and KV do the work of that turn; its
  generated tokens are discarded and the recorded turn is returned with the engine's token usage.
  With ``upstream_prompt="recorded"`` the prompt is instead token ids of the *recorded* prompt
  length (the trace's ``usage.prompt_tokens``, capped at ``max_prompt_tokens``), prefix-consistent
  within a session as an agent's context is (turn ``k``'s ids + the engine's output ids + new
  ids), so an emulated GPU prefills and caches what the recorded run's engine did.

Which turn: the number of assistant messages already in the request (turn ``k`` answers with recorded
turn ``k``; past the end, a ``finish`` call). Which script: per session (``X-Mars-Session``,
``x-litellm-session-id``, ``session_id`` or ``prompt_cache_key``), scripts assigned round-robin in
order of first appearance. Stateless per request otherwise, so retries replay the same turn. A
request without tools (a conversation title, a summary: a side request) is answered with text only
and takes no turn. ``stream: true`` is answered as OpenAI-style server-sent events (the OpenHands
app always streams).
"""

from __future__ import annotations

import argparse
import gzip
import hashlib
import json
import random
import re
import threading
import time
import typing
import uuid
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, Literal

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, StreamingResponse
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from mars_openhands.cli_style import (
    CliParser,
    check_port_free,
    cli_error,
    config_error_lines,
    port_number,
    positive_int,
)

__all__ = [
    "PlaybackConfig",
    "PlaybackInputError",
    "RecordedToolCall",
    "RecordedTurn",
    "Script",
    "add_playback_flags",
    "build_playback_app",
    "load_script",
    "load_trace_script",
    "main",
    "resolve_script_path",
    "run_from_args",
]

_PROG = "mars-openhands openhands playback"

_SESSION_HEADERS = ("x-mars-session", "x-litellm-session-id")
_SESSION_BODY_FIELDS = ("mars_session", "session_id", "prompt_cache_key")


class RecordedToolCall(BaseModel):
    """One tool call of a recorded assistant turn (OpenHands tool name and JSON arguments)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    name: str
    """OpenHands tool name, e.g. ``"terminal"``, ``"file_editor"``, ``"task_tracker"``, ``"finish"``."""
    arguments: dict[str, Any]


class RecordedTurn(BaseModel):
    """One recorded assistant turn."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    content: str = ""
    tool_calls: tuple[RecordedToolCall, ...] = ()
    num_completion_tokens: int = Field(16, ge=1)
    """Recorded completion length, tokens (what the engine is asked to generate with ``upstream_url``)."""
    num_prompt_tokens: int | None = Field(None, ge=1)
    """Recorded prompt length, tokens (the trace's ``usage.prompt_tokens``); what the engine
    prefills with ``upstream_prompt="recorded"``. ``None``: unknown (the conversation is sent)."""


class Script(BaseModel):
    """A session's recorded turns; played in order, then ``finish``."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    name: str
    turns: tuple[RecordedTurn, ...]
    session_id: str | None = None
    """Play this script for exactly this session; ``None``: assigned round-robin to new sessions."""


class PlaybackConfig(BaseModel):
    """Playback server settings."""

    model_config = ConfigDict(frozen=True, extra="forbid", use_attribute_docstrings=True)

    served_model_name: str = "playback"
    """Model name reported by ``/v1/models`` (clients use ``openai/<name>``)."""
    upstream_url: str | None = None
    """Base URL of a real engine (``http://127.0.0.1:8001``) that does each turn's work; ``None``:
    answer at once with no engine."""
    upstream_model: str | None = None
    """Model name to send upstream (default: the engine's first ``/v1/models`` entry)."""
    max_prompt_chars: int = Field(1500, ge=1)
    """Upstream prompt is the rendered conversation cut to its first this many characters (a tiny
    model's context is small; the prefix is kept so prefix caching still sees shared prefixes)."""
    max_completion_tokens: int = Field(64, ge=1)
    """Cap on the upstream ``max_tokens`` per turn, tokens."""
    upstream_prompt: Literal["conversation", "recorded"] = "conversation"
    """What the engine prefills: ``conversation`` = the rendered conversation cut to
    ``max_prompt_chars``; ``recorded`` = token ids of the recorded prompt length (prefix-consistent
    per session; an emulated GPU then does the recorded run's prefill work)."""
    max_prompt_tokens: int = Field(30_000, ge=1)
    """Cap on a ``recorded`` prompt, tokens (keep it below the engine's ``--max-model-len`` minus
    ``max_completion_tokens``)."""
    prompt_token_id_high: int = Field(256, ge=2)
    """Synthetic ids of ``recorded`` prompts are in ``[0, this)`` (default: the tiny model's byte
    ids, :mod:`mars_openhands.engine.harness.tiny_model`)."""
    upstream_timeout_s: float = Field(120.0, gt=0)
    """Seconds to wait for the upstream engine's answer to one turn before the request fails."""
    api_key: str | None = None
    """Answer chat requests without ``Authorization: Bearer <api_key>`` with 401, as vLLM's
    ``--api-key`` does; ``None``: no check."""


def _clean_command(command: str, workspace_alias: str) -> str:
    """Map a mini-swe-agent command to the OpenHands workspace (its ``/testbed`` is the repo)."""
    return command.replace("/testbed", workspace_alias)


def load_trace_script(
    path: Path,
    max_turns: int | None = None,
    is_allowed: Callable[[str], bool] | None = None,
    workspace_alias: str = ".",
) -> Script:
    """Read a mini-swe-agent trajectory (``*.traj.json[.gz]``) as a playback script.

    Each assistant message with ``bash`` tool calls becomes one turn of ``terminal`` calls; turns
    without tool calls are skipped (OpenHands would end the conversation on them).

    Args:
        path: the trajectory file (gzip or plain JSON).
        max_turns: keep at most this many turns (``None``: all).
        is_allowed: ``command -> bool``; turns with a command it rejects are dropped (keeps
            dangerous recorded commands out of playback; the policy check would deny them).
        workspace_alias: what ``/testbed`` becomes in commands (the terminal starts in the workspace).

    Raises:
        ValueError: the file is not a mini-swe-agent trajectory (no ``messages``).
    """
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "rt") as f:
        data = json.load(f)
    if not isinstance(data, dict) or "messages" not in data:
        raise ValueError(f"{path} is not a mini-swe-agent trajectory: no 'messages' field")
    turns: list[RecordedTurn] = []
    for message in data["messages"]:
        if message.get("role") != "assistant" or not message.get("tool_calls"):
            continue
        commands = [
            _clean_command(json.loads(c["function"]["arguments"]).get("command", ""), workspace_alias)
            for c in message["tool_calls"]
            if c.get("function", {}).get("name") == "bash"
        ]
        if not commands or (is_allowed and not all(is_allowed(c) for c in commands)):
            continue
        usage = (message.get("extra") or {}).get("response", {}).get("usage") or {}
        turns.append(RecordedTurn(
            content=str(message.get("content") or ""),
            tool_calls=tuple(RecordedToolCall(name="terminal", arguments={"command": c})
                             for c in commands),
            num_completion_tokens=max(1, int(usage.get("completion_tokens") or 16)),
            num_prompt_tokens=int(usage["prompt_tokens"]) if usage.get("prompt_tokens") else None,
        ))
        if max_turns is not None and len(turns) >= max_turns:
            break
    return Script(name=str(data.get("instance_id", path.stem)), turns=tuple(turns))


def load_script(path: Path) -> Script:
    """Read a script: JSON ``{"name": ..., "turns": [{"content", "tool_calls": [{"name", "arguments"}]}]}``
    or a mini-swe-agent trajectory (``*.traj.json[.gz]``).

    Raises:
        ValueError: neither format (the message names the file).
    """
    if path.name.endswith((".traj.json", ".traj.json.gz")):
        return load_trace_script(path)
    try:
        return Script.model_validate_json(path.read_text())
    except ValueError as e:
        raise ValueError(f"{path} is not a playback script: {e}") from None


class _Sessions:
    """Assigns scripts to sessions round-robin, in order of first appearance. Thread-safe."""

    def __init__(self, scripts: Sequence[Script]) -> None:
        if not scripts:
            raise ValueError("playback needs at least one script (--script FILE)")
        self._bound = {s.session_id: s for s in scripts if s.session_id is not None}
        self._free = tuple(s for s in scripts if s.session_id is None) or tuple(scripts)
        self._by_session: dict[str, Script] = {}
        self._lock = threading.Lock()

    def script_for(self, session_id: str) -> Script:
        if session_id in self._bound:
            return self._bound[session_id]
        with self._lock:
            if session_id not in self._by_session:
                self._by_session[session_id] = self._free[len(self._by_session) % len(self._free)]
            return self._by_session[session_id]


def session_of(headers: Any, body: dict[str, Any]) -> str:
    """The request's session id (headers first, then body fields); ``"default"`` when none. Pure."""
    for name in _SESSION_HEADERS:
        if headers.get(name):
            return str(headers[name])
    for name in _SESSION_BODY_FIELDS:
        if body.get(name):
            return str(body[name])
    return "default"


def _turn_message(turn: RecordedTurn, turn_index: int) -> dict[str, Any]:
    calls = [
        {"id": f"call_{turn_index}_{i}_{uuid.uuid4().hex[:8]}", "type": "function",
         "function": {"name": c.name, "arguments": json.dumps(c.arguments)}}
        for i, c in enumerate(turn.tool_calls)
    ]
    message: dict[str, Any] = {"role": "assistant", "content": turn.content or None}
    if calls:
        message["tool_calls"] = calls
    return message


def _finish_turn(script: Script) -> RecordedTurn:
    return RecordedTurn(content="", tool_calls=(RecordedToolCall(
        name="finish", arguments={"message": f"playback of {script.name} complete"}),))


def _render_prompt(messages: list[dict[str, Any]], max_chars: int) -> str:
    parts = []
    for m in messages:
        content = m.get("content")
        if isinstance(content, list):
            content = "".join(str(p.get("text", "")) for p in content if isinstance(p, dict))
        parts.append(f"<{m.get('role')}>{content or ''}{json.dumps(m.get('tool_calls') or '')}")
    return "".join(parts)[:max_chars]


class _Upstream:
    """Forwards a turn's work to a real engine; ``None`` URL: no engine (answer at once)."""

    def __init__(self, config: PlaybackConfig) -> None:
        import httpx

        self.config = config
        self.client = (httpx.AsyncClient(base_url=config.upstream_url, timeout=config.upstream_timeout_s)
                       if config.upstream_url else None)
        self._model = config.upstream_model
        self.prompts = _RecordedPrompts(config.max_prompt_tokens, config.prompt_token_id_high)

    async def model(self) -> str:
        assert self.client is not None
        if self._model is None:
            response = await self.client.get("/v1/models")
            response.raise_for_status()
            self._model = str(response.json()["data"][0]["id"])
        return self._model

    async def run_turn(self, body: dict[str, Any], turn: RecordedTurn, session_id: str,
                       turn_index: int) -> dict[str, int] | None:
        """Make the engine prefill the prompt and decode the recorded length; return its usage.

        Mutates: the session's recorded-prompt state (``upstream_prompt="recorded"``).
        """
        if self.client is None:
            return None
        is_recorded = (self.config.upstream_prompt == "recorded"
                       and turn.num_prompt_tokens is not None)
        prompt: str | list[int] = (
            self.prompts.prompt(session_id, turn_index, turn.num_prompt_tokens or 1) if is_recorded
            else _render_prompt(body.get("messages") or [], self.config.max_prompt_chars))
        request: dict[str, Any] = {
            "model": await self.model(),
            "prompt": prompt,
            "max_tokens": min(turn.num_completion_tokens, self.config.max_completion_tokens),
            "ignore_eos": True,
            "temperature": 0.0,
        }
        if is_recorded:
            request["return_token_ids"] = True  # the next turn's prompt extends these (vLLM >= 0.10)
        for name in ("session_id", "vllm_xargs"):  # set by the gateway (design.md §2)
            if name in body:
                request[name] = body[name]
        response = await self.client.post("/v1/completions", json=request)
        if response.status_code != 200:
            raise RuntimeError(f"upstream engine answered {response.status_code}: {response.text[:500]}")
        data = response.json()
        if is_recorded:
            choice = (data.get("choices") or [{}])[0]
            self.prompts.record_output(session_id, turn_index, choice.get("token_ids") or [])
        usage = data.get("usage") or {}
        return {k: int(usage.get(k, 0)) for k in ("prompt_tokens", "completion_tokens", "total_tokens")}


class _RecordedPrompts:
    """Prefix-consistent token-id prompts of recorded lengths, per session. Thread-safe.

    Mental model: an agent's prompt at turn ``k+1`` is its prompt at turn ``k``, the model's answer
    and the new observation. Here::

        prompt_k+1 = prompt_k + out_k + fresh ids      (fresh: deterministic in session and turn)
        |<- prompt_k ->|<- out_k ->|<- fresh ->|        len = recorded prompt_tokens of turn k+1

    cut to ``max_tokens``. A recorded length shorter than the carried prefix keeps the prefix (a
    context never shrinks here). A retried turn gets the same prompt (kept per turn index).
    """

    def __init__(self, max_tokens: int, id_high: int) -> None:
        self.max_tokens = max_tokens
        self.high = id_high
        self._prompts: dict[tuple[str, int], list[int]] = {}
        self._outputs: dict[tuple[str, int], list[int]] = {}
        self._lock = threading.Lock()

    def prompt(self, session_id: str, turn: int, num_tokens: int) -> list[int]:
        """The ids of ``session_id``'s turn ``turn`` (``num_tokens`` long, capped)."""
        with self._lock:
            if (session_id, turn) in self._prompts:
                return self._prompts[(session_id, turn)]
            carried = (self._prompts.get((session_id, turn - 1), [])
                       + self._outputs.get((session_id, turn - 1), []))
            fresh = max(0, min(num_tokens, self.max_tokens) - len(carried))
            seed = hashlib.sha256(f"{session_id}\x00{turn}".encode()).digest()
            rng = random.Random(int.from_bytes(seed[:8], "little"))
            ids = (carried + [rng.randrange(self.high) for _ in range(fresh)])
            self._prompts[(session_id, turn)] = ids[: self.max_tokens]
            return self._prompts[(session_id, turn)]

    def record_output(self, session_id: str, turn: int, ids: Sequence[int]) -> None:
        """Keep the engine's output ids of a turn (the next turn's prompt carries them)."""
        with self._lock:
            self._outputs[(session_id, turn)] = list(ids)


def _pick_turn(body: dict[str, Any], script: Script) -> tuple[int, RecordedTurn, bool]:
    """``(turn_index, turn, is_side)`` for a request: a request without tools (a title, a
    summary) is a side request answered with text and no tool call. Pure."""
    turn_index = sum(1 for m in body.get("messages") or [] if m.get("role") == "assistant")
    if not body.get("tools"):
        return turn_index, RecordedTurn(content=f"Playback of {script.name}"), True
    turn = script.turns[turn_index] if turn_index < len(script.turns) else _finish_turn(script)
    return turn_index, turn, False


async def _answer(body: dict[str, Any], headers: Any, sessions: _Sessions, upstream: _Upstream,
                  config: PlaybackConfig, seen: list[dict[str, Any]]) -> dict[str, Any]:
    """One chat completion: the session's next recorded turn, after the engine did its work.

    Mutates: ``seen`` (appends what was asked).

    Raises:
        RuntimeError: the upstream engine failed.
    """
    session_id = session_of(headers, body)
    script = sessions.script_for(session_id)
    turn_index, turn, is_side = _pick_turn(body, script)
    received_wall_s, received = time.time(), time.perf_counter()
    try:
        usage = await upstream.run_turn(body, turn, session_id, turn_index)
    except Exception as e:
        raise RuntimeError(str(e) or type(e).__name__) from e
    completion_id = f"chatcmpl-{uuid.uuid4().hex}"
    seen.append({"session_id": session_id, "turn": turn_index, "script": script.name,
                 "response_id": completion_id, "received_wall_s": received_wall_s,
                 "handle_s": time.perf_counter() - received,
                 "is_side": is_side, "stream": bool(body.get("stream")),
                 "tool_calls": [c.name for c in turn.tool_calls],
                 "header_session": headers.get("x-mars-session"),
                 "header_token": headers.get("x-mars-session-token"),
                 "header_authorization": headers.get("authorization"),
                 "num_user_messages": sum(1 for m in body.get("messages") or []
                                          if isinstance(m, dict) and m.get("role") == "user"),
                 "body_session_id": body.get("session_id"), "vllm_xargs": body.get("vllm_xargs"),
                 "temperature": body.get("temperature"), "top_p": body.get("top_p"),
                 "has_reasoning_effort": "reasoning_effort" in body,
                 "num_tools": len(body.get("tools") or []), "engine_usage": usage})
    usage = usage or {"prompt_tokens": 1, "completion_tokens": turn.num_completion_tokens,
                      "total_tokens": 1 + turn.num_completion_tokens}
    return {"id": completion_id, "object": "chat.completion",
            "created": int(time.time()), "model": body.get("model", config.served_model_name),
            "choices": [{"index": 0, "message": _turn_message(turn, turn_index),
                         "finish_reason": "tool_calls" if turn.tool_calls else "stop"}],
            "usage": usage}


def sse_chunks(completion: dict[str, Any], include_usage: bool) -> list[str]:
    """A whole chat completion as OpenAI ``chat.completion.chunk`` server-sent events. Pure.

    One chunk with the role and text, one per tool call (id, name and all its arguments), one with
    the ``finish_reason``, then the usage (when ``stream_options.include_usage``) and ``[DONE]``.
    """
    head = {k: completion[k] for k in ("id", "created", "model")} | {"object": "chat.completion.chunk"}
    choice = completion["choices"][0]
    message = choice["message"]

    def chunk(delta: dict[str, Any], finish_reason: str | None = None) -> str:
        body = {**head, "choices": [{"index": 0, "delta": delta, "finish_reason": finish_reason}]}
        return f"data: {json.dumps(body)}\n\n"

    events = [chunk({"role": "assistant", "content": message.get("content") or ""})]
    for i, call in enumerate(message.get("tool_calls") or []):
        events.append(chunk({"tool_calls": [{"index": i, **call}]}))
    events.append(chunk({}, choice["finish_reason"]))
    if include_usage:
        events.append(f"data: {json.dumps({**head, 'choices': [], 'usage': completion['usage']})}\n\n")
    return [*events, "data: [DONE]\n\n"]


def build_playback_app(scripts: Sequence[Script], config: PlaybackConfig | None = None) -> Any:
    """Return the FastAPI app of the playback server.

    Routes: ``POST /v1/chat/completions`` (whole, or server-sent events with ``stream: true``),
    ``GET /v1/models``, ``GET /health``, ``GET /metrics`` (the upstream engine's, else empty),
    ``GET /playback/requests`` (what was asked: session, turn, tool calls; for tests).

    Raises:
        ValueError: no scripts.
    """
    config = config or PlaybackConfig()
    sessions = _Sessions(scripts)
    upstream = _Upstream(config)
    seen: list[dict[str, Any]] = []
    app = FastAPI(title="mars-openhands playback")

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Any:
        if config.api_key and request.headers.get("authorization") != f"Bearer {config.api_key}":
            return JSONResponse({"error": {"message": "invalid API key"}}, status_code=401)
        body = await request.json()
        try:
            completion = await _answer(body, request.headers, sessions, upstream, config, seen)
        except RuntimeError as e:  # the engine's error, as a gateway-visible 502
            return JSONResponse({"error": {"message": f"playback upstream failed: {e}"}},
                                status_code=502)
        if not body.get("stream"):
            return completion
        include_usage = bool((body.get("stream_options") or {}).get("include_usage"))
        return StreamingResponse(iter(sse_chunks(completion, include_usage)),
                                 media_type="text/event-stream")

    @app.get("/v1/models")
    async def models(request: Request) -> Any:
        if config.api_key and request.headers.get("authorization") != f"Bearer {config.api_key}":
            return JSONResponse({"error": {"message": "invalid API key"}}, status_code=401)
        return {"object": "list", "data": [{"id": config.served_model_name, "object": "model"}]}

    @app.get("/health")
    async def health() -> Any:
        return PlainTextResponse("ok")

    @app.get("/metrics")
    async def metrics() -> Any:
        if upstream.client is None:
            return PlainTextResponse("")
        response = await upstream.client.get("/metrics")
        return PlainTextResponse(response.text, status_code=response.status_code)

    @app.get("/playback/requests")
    async def requests() -> Any:
        return {"requests": seen}

    return app


class PlaybackInputError(ValueError):
    """A ``--script`` that cannot be read; ``str(error)`` is one line naming the path and the fix."""


_REPO_ROOT = Path(__file__).resolve().parents[2]
TRACES_HINT = ("the bundled mini-swe-agent traces are in ../shared/data/traces/mini-swe-agent next "
               "to the repository (from the repository root: --script ../shared/data/traces/"
               "mini-swe-agent/deepseek_chat_dev/<instance>.traj.json.gz)")


def resolve_script_path(path: Path, cwd: Path | None = None) -> Path:
    """``path`` as given when it exists (relative to ``cwd``), else relative to the repository
    root (where the docs' commands run).

    Raises:
        PlaybackInputError: neither exists (the message names both and where the traces are).
    """
    cwd = cwd or Path.cwd()
    tried = [path if path.is_absolute() else cwd / path]
    if not path.is_absolute():
        tried.append(_REPO_ROOT / path)
    for candidate in tried:
        if candidate.is_file():
            return candidate
    where = " or ".join(str(p) for p in dict.fromkeys(tried))
    raise PlaybackInputError(f"--script {path}: no such file ({where}); {TRACES_HINT}")


def load_scripts(paths: Sequence[Path], max_turns: int | None) -> list[Script]:
    """The scripts of ``--script`` (traces keep only turns the policy check would allow).

    Raises:
        PlaybackInputError: a missing or unreadable file, or one that is neither format.
    """
    from mars_openhands.openhands.policy_check import is_safe_to_replay

    scripts = []
    for given in paths:
        path = resolve_script_path(given)
        try:
            if path.name.endswith((".traj.json", ".traj.json.gz")):
                scripts.append(load_trace_script(path, max_turns, is_safe_to_replay))
            else:
                scripts.append(load_script(path))
        except (OSError, ValueError) as e:  # pydantic's ValidationError is a ValueError
            first = str(e).splitlines()[0] if str(e) else type(e).__name__
            raise PlaybackInputError(f"--script {given}: {first}") from None
    return scripts


def add_playback_flags(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Add the playback server's flags (``--script``, ``--port``, the :class:`PlaybackConfig`
    fields, ``--check``) to ``parser``; ``func`` runs :func:`run_from_args`."""
    parser.add_argument("--script", action="append", type=Path, required=True,
                        help="playback script JSON or mini-swe-agent *.traj.json(.gz); repeatable. "
                             + TRACES_HINT.replace("%", "%%"))
    parser.add_argument("--max-turns", type=positive_int, default=None, metavar="N",
                        help="play at most the first N >= 1 turns of each trace script (default: all)")
    parser.add_argument("--host", default="127.0.0.1",
                        help="address to listen on (default 127.0.0.1: this machine only)")
    parser.add_argument("--port", type=port_number, default=8100,
                        help="port to listen on, 1..65535 (default 8100)")
    for name, field in PlaybackConfig.model_fields.items():
        text = re.sub(r"``([^`]*)``|:[a-z]+:`~?([^`]*)`", lambda m: m.group(1) or m.group(2),
                      " ".join((field.description or "").split()))  # no reST in --help
        # A flag cannot be set to None: say what leaving it out does, and show no "(default: none)".
        text = re.sub(r"\bNone\b: ", "not given: ", text)
        if "(default" not in text and field.default is not None:  # a docstring that explains its
            text += f" (default: {field.default})"  # default keeps its words
        choices = typing.get_args(field.annotation) if typing.get_origin(field.annotation) is Literal else None
        parser.add_argument("--" + name.replace("_", "-"), default=field.default, choices=choices,
                            type=type(field.default) if field.default is not None else str,
                            help=text.replace("%", "%%"))
    parser.add_argument("--check", action="store_true",
                        help="load the scripts, print one line per script (name, turns) and exit")
    parser.set_defaults(func=run_from_args)
    return parser


def run_from_args(args: argparse.Namespace) -> int:
    """Serve the playback engine (or, with ``--check``, list the scripts). Exit code 2 on bad input
    (one line on stderr)."""
    try:
        config = PlaybackConfig(**{k: getattr(args, k) for k in PlaybackConfig.model_fields})
    except ValidationError as e:  # one line per flag out of range, e.g. --max-prompt-chars 0
        return max(cli_error(_PROG, line) for line in config_error_lines(e, {}))
    try:
        scripts = load_scripts(args.script, args.max_turns)
    except ValueError as e:
        return cli_error(_PROG, str(e).splitlines()[0])
    if args.check:
        for script in scripts:
            print(json.dumps({"script": script.name, "num_turns": len(script.turns)}))
        return 0
    busy = check_port_free(args.host, args.port)
    if busy is not None:  # before uvicorn, whose "[Errno 98]" names no flag
        return cli_error(_PROG, busy)
    import uvicorn

    uvicorn.run(build_playback_app(scripts, config), host=args.host, port=args.port,
                log_level="warning", access_log=False)
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m mars_openhands.openhands.playback --script F [--script F ...] --port P``."""
    parser = CliParser(prog=_PROG, description=(__doc__ or "").split("\n")[0])
    args = add_playback_flags(parser).parse_args(argv)
    return int(args.func(args))


if __name__ == "__main__":
    raise SystemExit(main())
