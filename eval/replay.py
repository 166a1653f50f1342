"""Replay driver: run a workload's sessions against an OpenAI-compatible endpoint (design.md §1, §2, §7).

The endpoint is a vLLM server (``endpoint_kind="engine"``) or the MARS gateway (``"gateway"``). Each
session is one asyncio task: it waits for its arrival time, then plays its turns in order, each an
LLM call followed by its recorded tool call on a bounded :class:`~eval.tools.ToolPool`.

Prompts are token ids, and each turn's prompt extends the previous one exactly, as an agent's
conversation does (the layout of :mod:`eval.workloads.format`)::

    turn k   prompt : |<------------- prompt_k ------------->|
    turn k   output :                                         |<- out_k (engine's ids) ->|
    turn k+1 prompt : |<------------- prompt_k ------------->|<- out_k ->|<- obs_{k+1} ->|

    prompt_0     = obs_0                      (len = turn 0's prompt_tokens_appended)
    prompt_{k+1} = prompt_k + out_k + obs_{k+1}
    obs_k        = observation_token_ids(seed, session_id, k, prompt_tokens_appended_k)

``out_k`` are the ids the engine returned (``return_token_ids``), so the prefix cache or retained
KV can serve everything but ``obs_{k+1}``. Output length is forced: ``max_tokens`` = the turn's
``output_tokens`` with ``ignore_eos``. Observation ids are deterministic per (seed, session, turn)
and drawn from ``[token_id_low, token_id_high)``; the defaults (0..255) are the tiny test model's
byte tokens (:mod:`mars_openhands.engine.harness.tiny_model`), so set the range to the served model's vocab.

Session metadata (design.md §2): every request carries the native ``session_id`` body field and
``vllm_xargs`` ``{"mars_turn": k, "mars_last_step": 0|1, "mars_prev_tool": name,
"mars_prev_tool_s": measured seconds}`` (the last two from turn 1 on); through the gateway also the
headers ``X-Mars-Session`` and ``X-Mars-Session-Token`` (a random secret made once per session, as
the gateway's session binding asks: docs/gateway.md "Threat model"; events carry it too).

CPU-plane events (design.md §3), ``source="replay"``, per session in this order::

    session_start (at ARRIVAL, before any admission wait)
    [tool_enqueued, tool_start(queue_wait_s), tool_end(duration_s)] after each non-final turn
    session_end(status)   "ok" only when every turn finished normally

``status`` is ``"error"`` (an HTTP error, a timeout or a malformed response ended the session; the
run goes on), ``"truncated"`` (``overflow="end_session"`` stopped it before a turn that does not fit
``max_model_len``), ``"timeout"`` (the run's ``run_timeout_s`` passed) or ``"cancelled"`` (Ctrl-C).
Sessions that had not arrived when the run stopped emit nothing. Events go to a local sink (a
:class:`~mars_openhands.stream.recorder.StreamRecorder` or a ``ListSink``) and, through the
gateway, are also POSTed in batches to ``{endpoint}/mars/v1/events`` (``{"events": [...]}``, one
session's per batch, with its token; see ``mars_openhands/control/hub.py``), where the control
plane reads tool backlog and queue wait.

Unreachable endpoint: before anything is emitted or written, the driver GETs ``/v1/models``; if no
connection can be made (nothing listens at the URL), or the server answers 401 (a keyed gateway or
vLLM server, and no key or the wrong one: ``api_key``, ``--api-key`` or ``MARS_API_KEY``), the run
is refused with one line naming the URL, instead of recording every session as an error. A server
that accepts the connection counts as up, whatever else it answers.

Long traces: real sessions reach 100k tokens, far past a tiny CPU engine's ``max_model_len``. The
driver checks every session up front (``overflow="error"``, the default) and names the sessions that
do not fit; cap them with ``eval.workloads.transform.trim_workload(w, max_context_tokens=...)``, or
pass ``overflow="end_session"`` to play each session until its first turn that would not fit.

Client-side times (send, first token, finish per turn; arrival, end per session) are in the
returned :class:`ReplayResult`. The stream's metrics (:mod:`eval.metrics`) take a session's end from
the engine's GPU-plane ``finished`` events, so serve with our telemetry plugin when analysing the
stream; against a bare engine use ``SessionRecord.e2e_s``.

Command line: ``mars-openhands replay WORKLOAD -o runs/x/stream.jsonl --endpoint-url URL --model
NAME [--tool-mode cpu --num-tool-workers 4 ...]`` (flags generated from :class:`ReplayConfig`).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import functools
import hashlib
import json
import logging
import os
import re
import secrets
import sys
import time
import types
import typing
import urllib.parse
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Annotated, Any, Literal

import httpx
import httpx_sse
import numpy as np
from pydantic import BaseModel, ConfigDict, Field, SecretStr, ValidationError, model_validator

from eval.argtypes import config_error_lines, long_flags
from eval.tools import BurnClock, ToolMode, ToolPool
from eval.workloads.format import Session, Workload
from mars_openhands.cli_style import EXIT_USAGE, cli_error, is_usable_key, redact_url
from mars_openhands.env import API_KEY
from mars_openhands.stream.events import Event, SessionEnd, SessionStart, now_stamps
from mars_openhands.stream.recorder import StreamRecorder
from mars_openhands.stream.transport import EventSink, ListSink

__all__ = [
    "GatewayEventPoster",
    "ReplayConfig",
    "ReplayResult",
    "SessionTokens",
    "SessionRecord",
    "SessionStatus",
    "TurnRecord",
    "add_replay_subcommand",
    "check_fits",
    "observation_token_ids",
    "replay",
    "run_replay",
]

logger = logging.getLogger(__name__)

SessionStatus = Literal["ok", "error", "truncated", "timeout", "cancelled", "not_started"]
"""Outcome of one session (see the module docstring)."""

PositiveFloat = Annotated[float, Field(gt=0.0, allow_inf_nan=False)]


class ReplayConfig(BaseModel):
    """Everything a replay run needs besides the workload. Frozen; unknown keys are an error.

    The ``mars-openhands replay`` flags are generated from these fields (``--num-tool-workers``).
    """

    model_config = ConfigDict(frozen=True, extra="forbid", use_attribute_docstrings=True)

    endpoint_url: Annotated[str, Field(min_length=1)]
    """Server root, e.g. ``http://127.0.0.1:8000`` (requests go to ``/v1/completions``)."""
    model: Annotated[str, Field(min_length=1)]
    """Served model name for the ``model`` field."""
    endpoint_kind: Literal["engine", "gateway"] = "engine"
    """``"gateway"`` adds the ``X-Mars-Session`` header and (see below) posts CPU-plane events."""
    post_events: bool = True
    """Through the gateway: also POST events to ``/mars/v1/events`` (ignored for an engine)."""
    api_key: SecretStr | None = None
    """Key sent as ``Authorization: Bearer <key>`` on every request (``/v1/models``, the LLM calls,
    the event posts): a keyed gateway's API key, or a vLLM server's ``--api-key``. None: no key
    (the command line reads ``MARS_API_KEY``; the flag shows the key in ``ps``). Never recorded."""
    max_active_sessions: Annotated[int, Field(ge=1)] | None = None
    """Client-side cap on sessions in progress (arrived sessions wait for a slot; the wait counts
    in E2E). ``None``: no cap (leave admission to the gateway)."""
    max_connections: Annotated[int, Field(ge=1)] = 512
    """HTTP connection pool size (one request in flight per active session)."""
    request_timeout_s: PositiveFloat = 600.0
    """Bound on one LLM call (connect to last byte); past it the session ends with ``"error"``.
    Through the gateway it includes the admission wait: keep it above the longest expected wait."""
    run_timeout_s: PositiveFloat | None = None
    """Bound on the whole run; sessions still going end with ``"timeout"``. ``None``: no bound."""
    stream: bool = True
    """Stream responses to measure TTFT client-side (``first_token_s``)."""
    temperature: Annotated[float, Field(ge=0.0)] = 0.0
    """Sampling temperature (0 = greedy; lengths are forced either way)."""
    num_tool_workers: Annotated[int, Field(ge=1)] = 4
    """Tool pool size (MARS's ``N_tool``)."""
    tool_mode: ToolMode = "sleep"
    """``"sleep"`` or ``"cpu"`` (burn CPU in worker processes; see :mod:`eval.tools`)."""
    tool_burn_clock: BurnClock = "wall"
    """``cpu`` mode: burn the recorded wall time (default) or that much CPU time."""
    token_id_low: Annotated[int, Field(ge=0)] = 0
    """Smallest observation token id (inclusive)."""
    token_id_high: Annotated[int, Field(ge=1)] = 256
    """Largest observation token id (exclusive); default: the tiny model's byte tokens."""
    seed: int = 0
    """Seed of the observation token ids (with the session id and turn)."""
    max_model_len_tokens: Annotated[int, Field(ge=1)] | None = None
    """Longest prompt + output the engine accepts; ``None``: read ``max_model_len`` from
    ``/v1/models`` (no check if the endpoint does not say)."""
    overflow: Literal["error", "end_session"] = "error"
    """A session that does not fit: refuse the run up front, or end it before that turn."""
    event_batch_size: Annotated[int, Field(ge=1)] = 256
    """Events per ``POST /mars/v1/events`` (the gateway's default cap is 1024)."""
    event_flush_interval_s: PositiveFloat = 0.05
    """Posting period; the gateway's view of tool backlog lags by at most about this."""
    show_progress: bool = True
    """Show a rich progress bar (sessions done / total)."""
    source: Annotated[str, Field(min_length=1)] = "replay"
    """``source`` of the emitted events."""

    @model_validator(mode="after")
    def _check(self) -> ReplayConfig:
        try:  # "http://" (no host) or "http://[bad" reached every session as a connection error
            parts = urllib.parse.urlsplit(self.endpoint_url)
            parts.port  # noqa: B018 -- raises ValueError for a port that is not one
        except ValueError as e:
            raise ValueError(f"endpoint_url is not a URL ({e}); give an http(s) server root such as "
                             f"http://127.0.0.1:8000, got {self.endpoint_url!r} (--endpoint-url)") from None
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise ValueError(
                f"endpoint_url must be an http(s) server root such as http://127.0.0.1:8000, got "
                f"{self.endpoint_url!r} (--endpoint-url)"
            )
        key = self.api_key.get_secret_value() if self.api_key is not None else ""
        if self.api_key is not None and not is_usable_key(key):
            raise ValueError(f"api_key is empty or has whitespace or control characters ({len(key)} characters); "
                             "give the key alone (--api-key, or MARS_API_KEY)")
        if self.token_id_high <= self.token_id_low:
            raise ValueError(
                f"token_id_high ({self.token_id_high}) must be > token_id_low ({self.token_id_low}); "
                "set them to a range of valid ids of the served model's vocab"
            )
        return self


# ----------------------------------------------------------------------------- results
@dataclass
class TurnRecord:
    """One LLM call as the client saw it. Times in seconds since the run started (monotonic).

    Attributes:
        turn: 0-based index.
        num_prompt_tokens: prompt ids sent (``usage.prompt_tokens`` when the endpoint reports it).
        num_output_tokens: output ids received (``usage.completion_tokens`` when reported).
        num_cached_tokens: ``usage.prompt_tokens_details.cached_tokens``, if reported.
        send_s: request sent. first_token_s: first output token seen (streaming only).
        finish_s: response complete.
        tool_name, tool_queue_wait_s, tool_duration_s: the tool call after it (None when final).
    """

    turn: int
    num_prompt_tokens: int
    send_s: float
    num_output_tokens: int = 0
    num_cached_tokens: int | None = None
    first_token_s: float | None = None
    finish_s: float | None = None
    tool_name: str | None = None
    tool_queue_wait_s: float | None = None
    tool_duration_s: float | None = None


@dataclass
class SessionRecord:
    """One session's outcome. Times in seconds since the run started (monotonic).

    Attributes:
        arrival_s: scheduled arrival (the workload's). start_s: ``session_start`` emitted.
        admitted_s: got a client slot (``max_active_sessions``). end_s: ``session_end`` emitted.
        status: see :data:`SessionStatus`. error: why, for ``"error"`` / ``"truncated"``.
    """

    session_id: str
    arrival_s: float
    start_s: float | None = None
    admitted_s: float | None = None
    end_s: float | None = None
    status: SessionStatus = "not_started"
    error: str | None = None
    turns: list[TurnRecord] = field(default_factory=list)

    @property
    def e2e_s(self) -> float | None:
        """Client-side E2E (last response − arrival), seconds; ``None`` unless status ``"ok"``."""
        if self.status != "ok" or not self.turns or self.turns[-1].finish_s is None:
            return None
        return self.turns[-1].finish_s - self.arrival_s


@dataclass
class ReplayResult:
    """What a run did. ``sessions`` follow the workload's order.

    Attributes:
        started_at: wall-clock (UTC) start of the run (time 0 of every ``*_s`` field).
        duration_s: run length in seconds.
        max_model_len_tokens: the length limit applied (``None``: unchecked).
        is_timed_out: ``run_timeout_s`` passed.
        num_events: events emitted to the local sink.
        num_events_posted / num_events_post_failed: events the gateway accepted / that failed.
    """

    started_at: datetime
    sessions: list[SessionRecord]
    duration_s: float = 0.0
    max_model_len_tokens: int | None = None
    is_timed_out: bool = False
    num_events: int = 0
    num_events_posted: int = 0
    num_events_post_failed: int = 0

    def num_with_status(self, status: SessionStatus) -> int:
        """Number of sessions with ``status``."""
        return sum(1 for s in self.sessions if s.status == status)

    def turn_rows(self) -> list[dict[str, Any]]:
        """One flat dict per turn (session_id + :class:`TurnRecord` fields), e.g. for pandas."""
        return [{"session_id": s.session_id, "session_status": s.status, **vars(t)}
                for s in self.sessions for t in s.turns]


# ----------------------------------------------------------------------------- token ids
def observation_token_ids(seed: int, session_id: str, turn: int, num_tokens: int,
                          low: int = 0, high: int = 256) -> list[int]:
    """The ``num_tokens`` synthetic ids appended before ``turn`` (turn 0: system + task). Pure.

    Deterministic in (seed, session_id, turn), independent of everything else, so that two runs (or
    two schedulers) replay identical prompts.

    Returns:
        ``num_tokens`` ints in ``[low, high)``.
    """
    digest = hashlib.sha256(f"{seed}\x00{session_id}\x00{turn}".encode()).digest()
    rng = np.random.default_rng(int.from_bytes(digest[:16], "little"))
    return rng.integers(low, high, size=num_tokens).tolist()


# ----------------------------------------------------------------------------- event posting
class SessionTokens:
    """The ``X-Mars-Session-Token`` of each session of a run: a random secret (192 bits) made at
    the session's first use, sent on its LLM calls and event posts (the gateway binds the session
    to it; nobody else can post its events)."""

    def __init__(self) -> None:
        self._tokens: dict[str, str] = {}

    def headers(self, session_id: str) -> dict[str, str]:
        """The session's token header (made on first use)."""
        token = self._tokens.get(session_id)
        if token is None:
            token = self._tokens[session_id] = secrets.token_urlsafe(24)
        return {"X-Mars-Session-Token": token}


class GatewayEventPoster:
    """Batches events and POSTs them, in order per session, to the gateway's ``/mars/v1/events``.

    :meth:`emit` only appends (call it on the loop); a background task posts every
    ``flush_interval_s`` or once ``batch_size`` events are pending. Each POST carries one
    session's events with that session's token (the gateway refuses a batch naming another
    session). A failed post (HTTP error or unreachable gateway, e.g. 404 for a session that
    expired there) is logged and counted, never retried and never fatal: the local stream still
    has every event.

    Args:
        client: the run's HTTP client. url: the full events URL.
        tokens: the run's session tokens (shared with its LLM calls).
        batch_size: events per POST. flush_interval_s: posting period in seconds.
    """

    def __init__(self, client: httpx.AsyncClient, url: str, tokens: SessionTokens, *,
                 batch_size: int = 256, flush_interval_s: float = 0.05) -> None:
        self.url = url
        self.tokens = tokens
        self.batch_size = batch_size
        self.flush_interval_s = flush_interval_s
        self.num_posted = 0
        self.num_failed = 0
        self._client = client
        self._pending: list[Event] = []
        self._wake = asyncio.Event()
        self._task: asyncio.Task[None] | None = None
        self._is_closing = False

    def start(self) -> None:
        """Start the posting task (on the running loop)."""
        self._task = asyncio.create_task(self._run(), name="gateway-event-poster")

    def emit(self, event: Event) -> None:
        """Queue one event for posting."""
        self._pending.append(event)
        if len(self._pending) >= self.batch_size:
            self._wake.set()

    async def _run(self) -> None:
        while not self._is_closing:
            try:
                await asyncio.wait_for(self._wake.wait(), self.flush_interval_s)
            except TimeoutError:
                pass
            self._wake.clear()
            await self.flush()

    async def flush(self) -> None:
        """POST everything pending now: per session, in its order, in batches of ``batch_size``."""
        while self._pending:
            pending, self._pending = self._pending, []
            by_session: dict[str | None, list[Event]] = {}
            for event in pending:
                by_session.setdefault(event.session_id, []).append(event)
            for session_id, events in by_session.items():
                for start in range(0, len(events), self.batch_size):
                    batch = events[start:start + self.batch_size]
                    self._count(batch, await self._post(session_id, batch))

    def _count(self, batch: list[Event], status: int | None) -> None:
        if status is not None and status < 400:
            self.num_posted += len(batch)
        else:
            self.num_failed += len(batch)

    async def _post(self, session_id: str | None, batch: list[Event]) -> int | None:
        """POST one session's batch; return the HTTP status (None: no response). Logs failures."""
        payload = {"events": [json.loads(e.model_dump_json()) for e in batch]}
        headers = self.tokens.headers(session_id) if session_id is not None else {}
        try:
            response = await self._client.post(self.url, json=payload, headers=headers)
        except httpx.HTTPError as e:
            logger.warning("posting %d events to %s failed: %r", len(batch), self.url, e)
            return None
        if response.status_code >= 400:
            logger.warning("posting %d events to %s failed: HTTP %d %s", len(batch), self.url,
                           response.status_code, response.text[:300])
        return response.status_code

    async def aclose(self, timeout_s: float = 10.0) -> None:
        """Post what is left and stop (bounded by ``timeout_s``; then the rest is counted failed)."""
        self._is_closing = True
        self._wake.set()
        task, self._task = self._task, None
        try:
            await asyncio.wait_for(task if task is not None else self.flush(), timeout_s)
            if self._pending:  # emitted while the last post was in flight
                await asyncio.wait_for(self.flush(), timeout_s)
        except TimeoutError:
            logger.warning("gave up posting events to %s after %.1f s", self.url, timeout_s)
        self.num_failed += len(self._pending)
        self._pending.clear()


# ----------------------------------------------------------------------------- the run
class _TurnError(Exception):
    """One LLM call failed; the session ends with status ``"error"``."""


class _Emitter:
    """Fans each event out to the local sinks and, optionally, the gateway poster."""

    def __init__(self, sinks: Sequence[EventSink], poster: GatewayEventPoster | None) -> None:
        self.sinks = tuple(sinks)
        self.poster = poster
        self.num_events = 0

    def emit(self, event: Event) -> None:
        for sink in self.sinks:
            sink.emit(event)
        self.num_events += 1
        if self.poster is not None:
            self.poster.emit(event)


def check_fits(workload: Workload, max_model_len_tokens: int) -> None:
    """Raise unless every session's largest context fits ``max_model_len_tokens``. Pure.

    A session's largest context is its final prompt plus final output
    (:attr:`~eval.workloads.format.Session.max_context_tokens`).

    Raises:
        ValueError: naming how many sessions do not fit, a few of them, and the fix.
    """
    too_long = [(s.session_id, s.max_context_tokens) for s in workload.sessions
                if s.max_context_tokens > max_model_len_tokens]
    if too_long:
        examples = ", ".join(f"{sid} ({n} tokens)" for sid, n in too_long[:5])
        raise ValueError(
            f"{len(too_long)} of {len(workload.sessions)} sessions need more than max_model_len = "
            f"{max_model_len_tokens} tokens, e.g. {examples}; cap them with "
            f"trim_workload(workload, max_context_tokens={max_model_len_tokens}) (or "
            "`mars-openhands workload ... --max-context-tokens`), raise the engine's "
            "--max-model-len, or replay with overflow='end_session' (replay --overflow end_session)"
        )


class _Replay:
    """State of one run (nothing is shared between runs)."""

    def __init__(self, workload: Workload, config: ReplayConfig, emitter: _Emitter,
                 client: httpx.AsyncClient, pool: ToolPool, max_len: int | None,
                 tokens: SessionTokens) -> None:
        self.workload = workload
        self.tokens = tokens
        self.config = config
        self.emitter = emitter
        self.client = client
        self.pool = pool
        self.max_len = max_len
        self.t0_s = time.monotonic()
        self.stop_status: SessionStatus = "cancelled"
        self.slots = (asyncio.Semaphore(config.max_active_sessions)
                      if config.max_active_sessions is not None else None)
        self.on_session_done: Callable[[], None] = lambda: None

    def now_s(self) -> float:
        return time.monotonic() - self.t0_s

    def _emit_session(self, cls: type[SessionStart] | type[SessionEnd], session_id: str,
                      turn: int | None, **fields: Any) -> None:
        self.emitter.emit(cls(**now_stamps(), session_id=session_id, turn=turn,
                              source=self.config.source, **fields))

    async def run_session(self, session: Session, record: SessionRecord) -> None:
        """Arrive, (wait for a slot,) play the turns, end. Never raises but CancelledError."""
        await asyncio.sleep(max(0.0, session.arrival_s - self.now_s()))
        record.start_s = self.now_s()
        self._emit_session(SessionStart, session.session_id, 0)
        try:
            if self.slots is None:
                await self._play(session, record)
            else:
                async with self.slots:
                    await self._play(session, record)
        except _TurnError as e:
            record.status, record.error = "error", str(e)
            logger.warning("session %s ended with an error: %s", session.session_id, e)
        except asyncio.CancelledError:
            record.status = self.stop_status
            raise
        except Exception as e:  # a bug must end one session, never hang or kill the run
            logger.exception("session %s failed", session.session_id)
            record.status, record.error = "error", repr(e)
        finally:
            record.end_s = self.now_s()
            last_turn = record.turns[-1].turn if record.turns else 0
            self._emit_session(SessionEnd, session.session_id, last_turn, status=record.status,
                               error=record.error)
            self.on_session_done()

    async def _play(self, session: Session, record: SessionRecord) -> None:
        record.admitted_s = self.now_s()
        cfg = self.config
        prompt_ids: list[int] = []
        prev_tool: tuple[str, float] | None = None
        for k, turn in enumerate(session.turns):
            prompt_ids.extend(observation_token_ids(
                cfg.seed, session.session_id, k, turn.prompt_tokens_appended,
                cfg.token_id_low, cfg.token_id_high))
            if self.max_len is not None and len(prompt_ids) + turn.output_tokens > self.max_len:
                record.status = "truncated"
                record.error = (f"turn {k} needs {len(prompt_ids)} + {turn.output_tokens} tokens "
                                f"> max_model_len {self.max_len}")
                return
            turn_record = TurnRecord(turn=k, num_prompt_tokens=len(prompt_ids), send_s=self.now_s())
            record.turns.append(turn_record)
            xargs: dict[str, str | int | float] = {
                "mars_turn": k, "mars_last_step": int(k == session.num_turns - 1)}
            if prev_tool is not None:
                xargs["mars_prev_tool"], xargs["mars_prev_tool_s"] = prev_tool
            output_ids = await self._complete(session.session_id, k, prompt_ids,
                                              turn.output_tokens, xargs, turn_record)
            prompt_ids.extend(output_ids)
            if turn.tool_name is not None:
                result = await self.pool.run(session.session_id, k, turn.tool_name,
                                             turn.tool_duration_s)
                turn_record.tool_name = turn.tool_name
                turn_record.tool_queue_wait_s = result.queue_wait_s
                turn_record.tool_duration_s = result.duration_s
                prev_tool = (turn.tool_name, round(result.duration_s, 6))
        record.status = "ok"

    def _request(self, session_id: str, prompt_ids: list[int], max_tokens: int,
                 xargs: dict[str, Any]) -> tuple[dict[str, Any], dict[str, str]]:
        body: dict[str, Any] = {
            "model": self.config.model, "prompt": prompt_ids, "max_tokens": max_tokens,
            "ignore_eos": True, "temperature": self.config.temperature, "return_token_ids": True,
            "session_id": session_id, "vllm_xargs": xargs,
        }
        if self.config.stream:
            body["stream"] = True
            body["stream_options"] = {"include_usage": True}
        headers = ({"X-Mars-Session": session_id, **self.tokens.headers(session_id)}
                   if self.config.endpoint_kind == "gateway" else {})
        return body, headers

    async def _complete(self, session_id: str, turn: int, prompt_ids: list[int], max_tokens: int,
                        xargs: dict[str, Any], record: TurnRecord) -> list[int]:
        """One ``/v1/completions`` call; returns the output ids. Raises _TurnError."""
        body, headers = self._request(session_id, prompt_ids, max_tokens, xargs)
        url = self.config.endpoint_url.rstrip("/") + "/v1/completions"
        where = f"session {session_id!r} turn {turn} ({url})"
        try:
            async with asyncio.timeout(self.config.request_timeout_s):
                if self.config.stream:
                    output_ids, usage = await self._stream(url, body, headers, record, where)
                else:
                    output_ids, usage = await self._whole(url, body, headers, where)
        except TimeoutError:
            raise _TurnError(f"{where}: no complete response within request_timeout_s = "
                             f"{self.config.request_timeout_s} s") from None
        except httpx.HTTPError as e:
            raise _TurnError(f"{where}: {type(e).__name__}: {e}") from None
        record.finish_s = self.now_s()
        record.num_prompt_tokens = int(usage.get("prompt_tokens") or record.num_prompt_tokens)
        record.num_output_tokens = int(usage.get("completion_tokens") or len(output_ids))
        details = usage.get("prompt_tokens_details") or {}
        record.num_cached_tokens = details.get("cached_tokens")
        if len(output_ids) != max_tokens:
            logger.warning("%s: asked for %d output tokens, got %d", where, max_tokens,
                           len(output_ids))
        return output_ids

    async def _whole(self, url: str, body: dict[str, Any], headers: dict[str, str],
                     where: str) -> tuple[list[int], dict[str, Any]]:
        response = await self.client.post(url, json=body, headers=headers)
        if response.status_code >= 400:
            raise _TurnError(f"{where}: HTTP {response.status_code}: {response.text[:500]}")
        data = _json_object(response.text, where)
        choice = _only_choice(data, where)
        return _token_ids(choice, where), data.get("usage") or {}

    async def _stream(self, url: str, body: dict[str, Any], headers: dict[str, str],
                      record: TurnRecord, where: str) -> tuple[list[int], dict[str, Any]]:
        output_ids: list[int] = []
        usage: dict[str, Any] = {}
        # httpx-sse splits lines only on CR/LF as the SSE spec says; httpx's aiter_lines() also
        # splits on U+0085/U+2028/U+2029, which generated text carries raw inside JSON strings.
        async with httpx_sse.aconnect_sse(self.client, "POST", url, json=body,
                                          headers=headers) as source:
            response = source.response
            if response.status_code >= 400:
                text = (await response.aread()).decode(errors="replace")
                raise _TurnError(f"{where}: HTTP {response.status_code}: {text[:500]}")
            try:
                async for sse in source.aiter_sse():
                    payload = sse.data.strip()
                    if not payload:
                        continue
                    if payload == "[DONE]":
                        break
                    chunk = _json_object(payload, where)
                    if "error" in chunk:
                        raise _TurnError(
                            f"{where}: error in stream: {str(chunk['error'])[:500]}")
                    usage = chunk.get("usage") or usage
                    for choice in chunk.get("choices") or ():
                        ids = _token_ids(choice, where)
                        if ids and record.first_token_s is None:
                            record.first_token_s = self.now_s()
                        output_ids.extend(ids)
            except httpx_sse.SSEError as e:  # the response is not text/event-stream
                raise _TurnError(f"{where}: not an event stream: {e}") from None
        return output_ids, usage


def _json_object(text: str, where: str) -> dict[str, Any]:
    try:
        data = json.loads(text, strict=False)  # generated text may carry raw control characters
    except ValueError as e:
        raise _TurnError(f"{where}: response is not JSON ({e}): {text[:300]!r}") from None
    if not isinstance(data, dict):
        raise _TurnError(f"{where}: response is not a JSON object: {text[:300]!r}")
    return data


def _only_choice(data: dict[str, Any], where: str) -> dict[str, Any]:
    choices = data.get("choices")
    if not isinstance(choices, list) or len(choices) != 1 or not isinstance(choices[0], dict):
        raise _TurnError(f"{where}: expected exactly one choice, got {str(choices)[:300]}")
    return choices[0]


def _token_ids(choice: dict[str, Any], where: str) -> list[int]:
    ids = choice.get("token_ids")
    if not isinstance(ids, list) or not all(isinstance(t, int) for t in ids):
        raise _TurnError(
            f"{where}: the response has no integer 'token_ids' (got {str(ids)[:100]}); the replay "
            "needs vLLM's return_token_ids (vLLM >= 0.10) to keep prompts prefix-consistent"
        )
    return ids


# ----------------------------------------------------------------------------- entry points
async def replay(workload: Workload, config: ReplayConfig, *,
                 sink: EventSink | Sequence[EventSink] | None = None,
                 transport: httpx.AsyncBaseTransport | None = None,
                 open_sinks: Callable[[], Sequence[EventSink]] | None = None) -> ReplayResult:
    """Replay ``workload`` against ``config.endpoint_url``; the async core.

    Every session runs as its own task; a failing session never stops the others. On return (or
    on cancellation, e.g. Ctrl-C) every started session has emitted its ``session_end``, the tool
    pool is closed and pending gateway posts are flushed; sinks are left open (their owner closes
    them).

    Args:
        workload: the sessions (see :mod:`eval.workloads.format`).
        config: endpoint, concurrency, tools, token ids, limits.
        sink: local event sink(s), each gets every event: e.g. a ``StreamRecorder``, a
            ``ZmqEventPublisher``; default (with no ``open_sinks`` either): a new ``ListSink``.
        transport: HTTP transport for tests (e.g. ``httpx.MockTransport``); default: the network.
        open_sinks: called once the up-front checks passed, before the first event; the sinks it
            returns get every event too (its caller closes them). A run refused by a check never
            calls it, so e.g. a stream file made there is not left behind (:func:`run_replay`).

    Returns:
        Per-session and per-turn records.

    Raises:
        ValueError: nothing answers at ``config.endpoint_url`` (no connection to it could be
            made), or ``overflow="error"`` and a session does not fit ``max_model_len`` (both
            raised before any session starts or any event is emitted; the message names the URL
            or the sessions, and the fix).
        asyncio.CancelledError: the run was cancelled (after the cleanup above).
    """
    sinks: list[EventSink] = ([] if open_sinks is not None else [ListSink()]) if sink is None else (
        [sink] if isinstance(sink, EventSink) else list(sink))
    result = ReplayResult(started_at=datetime.now(UTC), sessions=[
        SessionRecord(s.session_id, s.arrival_s) for s in workload.sessions])
    limits = httpx.Limits(max_connections=config.max_connections,
                          max_keepalive_connections=config.max_connections)
    timeout = httpx.Timeout(config.request_timeout_s, connect=min(30.0, config.request_timeout_s))
    headers = {"Authorization": f"Bearer {config.api_key.get_secret_value()}"} if config.api_key else {}
    async with httpx.AsyncClient(transport=transport, limits=limits, timeout=timeout, headers=headers) as client:
        models = await _get_models(client, config)  # raises if nothing answers: nothing recorded
        max_len = config.max_model_len_tokens or _served_max_model_len(models, config)
        result.max_model_len_tokens = max_len
        if max_len is not None and config.overflow == "error":
            check_fits(workload, max_len)
        if open_sinks is not None:  # every check passed: the run goes ahead
            sinks += open_sinks()
        poster = None
        tokens = SessionTokens()
        if config.endpoint_kind == "gateway" and config.post_events:
            poster = GatewayEventPoster(
                client, config.endpoint_url.rstrip("/") + "/mars/v1/events", tokens,
                batch_size=config.event_batch_size, flush_interval_s=config.event_flush_interval_s)
            poster.start()
        emitter = _Emitter(sinks, poster)
        try:
            async with ToolPool(config.num_tool_workers, config.tool_mode, emit=emitter.emit,
                                source=config.source, burn_clock=config.tool_burn_clock) as pool:
                run = _Replay(workload, config, emitter, client, pool, max_len, tokens)
                with _progress(config.show_progress, len(workload.sessions)) as advance:
                    run.on_session_done = advance
                    await _drive(run, result)
                result.duration_s = run.now_s()
        finally:
            if poster is not None:
                await poster.aclose()
                result.num_events_posted, result.num_events_post_failed = (
                    poster.num_posted, poster.num_failed)
            result.num_events = emitter.num_events
    return result


async def _drive(run: _Replay, result: ReplayResult) -> None:
    """Run every session task; on the run timeout or cancellation, stop them all cleanly."""
    run.t0_s, result.started_at = time.monotonic(), datetime.now(UTC)  # time 0: arrivals count from here
    tasks = [asyncio.create_task(run.run_session(s, r), name=f"session:{s.session_id}")
             for s, r in zip(run.workload.sessions, result.sessions, strict=True)]
    if not tasks:
        return
    try:
        _, pending = await asyncio.wait(tasks, timeout=run.config.run_timeout_s)
        if pending:
            logger.warning("run_timeout_s = %s passed; stopping %d sessions",
                           run.config.run_timeout_s, len(pending))
            run.stop_status, result.is_timed_out = "timeout", True
    except asyncio.CancelledError:
        run.stop_status = "cancelled"
        raise
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


_REACH_TIMEOUT_S = 5.0
"""Seconds to open a connection to the endpoint before the run: a local or LAN server accepts
within milliseconds, and a refused connection fails at once."""


async def _get_models(client: httpx.AsyncClient, config: ReplayConfig) -> httpx.Response | Exception:
    """``GET {endpoint_url}/v1/models``: the reachability check, and vLLM's model cards.

    Returns the response, or the error of a server that accepted the connection but did not
    answer in time (it is up; ``max_model_len`` stays unread). Waits ``request_timeout_s`` for
    the answer when :func:`_served_max_model_len` needs it, else 2 s.

    Raises:
        ValueError: no connection could be made within 5 s (nothing listens there, or no route),
            or the server answers 401 (no key, or not its key: every LLM call would get the
            same): one line naming the URL and the fix, never the key.
    """
    url = config.endpoint_url.rstrip("/") + "/v1/models"
    read_s = config.request_timeout_s if config.max_model_len_tokens is None else min(2.0, config.request_timeout_s)
    try:
        response = await client.get(url, timeout=httpx.Timeout(read_s, connect=min(_REACH_TIMEOUT_S, read_s)))
    except (httpx.ConnectError, httpx.ConnectTimeout) as e:
        raise ValueError(redact_url(
            f"nothing answers at {config.endpoint_url} (GET /v1/models: {type(e).__name__}: "
            f"{e or 'no connection'}); start the server there, or give endpoint_url (--endpoint-url) "
            "the root of a running one")) from None
    except httpx.HTTPError as e:  # connected, then no (or a broken) answer: up, but unread
        return e
    if response.status_code == httpx.codes.UNAUTHORIZED:
        sent = ("the API key sent was refused" if config.api_key is not None
                else "it needs an API key and none was sent")
        raise ValueError(f"{redact_url(config.endpoint_url)} answers 401 Unauthorized to GET /v1/models: {sent}; give the "
                         "server's key with --api-key or MARS_API_KEY (a gateway's is its --api-key / "
                         "MARS_GATEWAY_API_KEY)")
    return response


def _served_max_model_len(models: httpx.Response | Exception, config: ReplayConfig) -> int | None:
    """``max_model_len`` of ``config.model`` from the ``GET /v1/models`` answer (vLLM's model
    card), or None (logged: prompt lengths are then unchecked). Pure but for the log."""
    url = config.endpoint_url.rstrip("/") + "/v1/models"
    try:
        if isinstance(models, Exception):  # connected, but no answer in time
            raise models
        models.raise_for_status()
        cards = models.json().get("data") or []
    except (httpx.HTTPError, ValueError, AttributeError) as e:
        logger.warning("cannot read max_model_len from %s (%r); prompt lengths are unchecked "
                       "(set max_model_len_tokens)", url, e)
        return None
    for card in cards:
        if isinstance(card, dict) and card.get("id") == config.model:
            value = card.get("max_model_len")
            return int(value) if isinstance(value, int) else None
    logger.warning("%s does not list model %r; prompt lengths are unchecked", url, config.model)
    return None


@contextlib.contextmanager
def _progress(enabled: bool, total: int) -> Iterator[Callable[[], None]]:
    """A rich progress bar of sessions done / total; yields the 'one more done' callback."""
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    columns = (TextColumn("replay"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn())
    with Progress(*columns, disable=not enabled) as progress:
        task_id = progress.add_task("sessions", total=total)
        yield lambda: progress.advance(task_id)


def run_replay(workload: Workload, config: ReplayConfig, *,
               stream_path: str | os.PathLike[str] | None = None,
               sink: EventSink | Sequence[EventSink] | None = None,
               transport: httpx.AsyncBaseTransport | None = None) -> ReplayResult:
    """Synchronous wrapper of :func:`replay`: runs it on a new event loop.

    Args:
        workload, config, transport: as for :func:`replay`.
        stream_path: write the events to a new :class:`StreamRecorder` at this JSONL path (a
            Parquet copy is written next to it); it is made once the up-front checks passed (a
            refused run leaves no file) and closed even on error or Ctrl-C.
        sink: also (or only) emit into these sinks (left open).

    Raises:
        ValueError: a session does not fit (nothing was written).
        FileExistsError: ``stream_path`` exists (one run yields one stream; checked first).
        KeyboardInterrupt: Ctrl-C (after every started session emitted ``session_end`` and the
            recorder was closed).
        RuntimeError: called from a running event loop (``await replay(...)`` there instead).
    """
    path = Path(stream_path) if stream_path is not None else None
    if path is not None and path.exists():
        raise FileExistsError(f"stream file {path} already exists; one run yields one stream: choose a "
                              "new path or run directory")
    sinks: list[EventSink] = [] if sink is None else [sink] if isinstance(sink, EventSink) else list(sink)
    recorders: list[StreamRecorder] = []

    def open_recorder() -> list[StreamRecorder]:
        assert path is not None, "open_sinks is passed only with a stream path"
        recorders.append(StreamRecorder(path))
        return recorders

    try:
        return asyncio.run(replay(workload, config, sink=sinks or None, transport=transport,
                                  open_sinks=open_recorder if path is not None else None))
    finally:
        for recorder in recorders:
            recorder.close()


# ----------------------------------------------------------------------------- CLI
EXIT_SESSIONS_FAILED = 1
EXIT_BAD_INPUT = EXIT_USAGE
EXIT_INTERRUPTED = 130

# ReplayConfig fields whose flag is not ``--`` + the field name with dashes (none so far); the
# rest of the field → flag map comes from the parser's dest names.
_FLAG_RENAMES: types.MappingProxyType[str, str] = types.MappingProxyType({})


def _flag_type(annotation: Any) -> tuple[Any, list[Any] | None]:
    """(scalar type, choices) of a config field annotation (Annotated/Optional/Literal unwrapped)."""
    origin, args = typing.get_origin(annotation), typing.get_args(annotation)
    if origin is Annotated:
        return _flag_type(args[0])
    if origin in (typing.Union, types.UnionType):
        return _flag_type(next(a for a in args if a is not type(None)))
    if origin is Literal:
        return type(args[0]), list(args)
    return annotation, None


def add_replay_subcommand(subparsers: Any) -> argparse.ArgumentParser:
    """Add ``replay WORKLOAD -o STREAM.jsonl --endpoint-url URL --model NAME [...]``.

    Every :class:`ReplayConfig` field is a flag (``max_active_sessions`` → ``--max-active-sessions``,
    booleans as ``--x/--no-x``) with the field's docstring as help; unset flags keep the model's
    defaults. Writes the stream (JSONL + Parquet) and ``<stream stem>.result.json`` (per-session and
    per-turn records). Exit status: 0 all sessions ok, 1 some did not finish ok, 2 bad input,
    130 interrupted. Mutates: ``subparsers``.

    Returns:
        The ``replay`` parser.
    """
    parser = subparsers.add_parser(
        "replay", help="replay a workload against an engine or gateway",
        description="Replay a workload's sessions against an OpenAI-compatible engine or the MARS "
                    "gateway, recording the event stream. Exit status: 0 every session ok, 1 some "
                    "did not finish ok, 2 bad input (nothing written), 130 interrupted.")
    parser.add_argument("workload", help="workload file (.json/.jsonl[.gz])")
    parser.add_argument("-o", "--output", required=True,
                        help="new stream file, e.g. runs/x/stream.jsonl (+ .parquet, .result.json); "
                             "none of the three may exist")
    for name, info in ReplayConfig.model_fields.items():
        flag = "--" + name.replace("_", "-")
        kind, choices = _flag_type(info.annotation)
        help_text = _flag_help(info, flag).replace("%", "%%")
        if kind is bool:
            parser.add_argument(flag, dest=name, action=argparse.BooleanOptionalAction,
                                default=argparse.SUPPRESS, help=help_text)
        else:
            parser.add_argument(flag, dest=name, type=kind, choices=choices,
                                required=info.is_required(), default=argparse.SUPPRESS,
                                help=help_text)
    parser.set_defaults(func=functools.partial(
        _replay_command, flags={**long_flags(parser), **_FLAG_RENAMES}))
    return parser


def _flag_help(info: Any, flag: str) -> str:
    """A :class:`ReplayConfig` field's ``--help``: its docstring without reST markup, ``None``
    (which no flag can pass) said as "not given", and its default once. Pure."""
    text = re.sub(r"``([^`]*)``|:[a-z]+:`~?([^`]*)`", lambda m: m.group(1) or m.group(2),
                  " ".join((info.description or "").split()))
    text = re.sub(r"(^|\. )None: ", r"\1Not given: ", text)
    text = re.sub(r"\bNone: ", "not given: ", text)
    if info.is_required() or info.default is None or "(default" in text:
        return text  # a None default is explained by the docstring's "not given: ..."
    if info.default is True or info.default is False:
        return f"{text} (default: {flag if info.default else '--no-' + flag[2:]})"
    return f"{text} (default: {info.default})"


def _error(message: str) -> int:
    return cli_error("mars-openhands replay", message)


def _replay_command(args: argparse.Namespace, flags: dict[str, str] | None = None) -> int:
    """Run ``replay`` from parsed flags; ``flags`` maps field names to flags for error lines."""
    from eval.workloads.format import WorkloadFormatError, load_workload

    fields = {k: v for k, v in vars(args).items() if k in ReplayConfig.model_fields}
    if "api_key" not in fields:
        try:
            fields["api_key"] = API_KEY.get_secret()
        except ValueError as e:  # a key pasted with its newline: names the variable, not the key
            return _error(str(e))
    if not str(args.output).endswith((".jsonl", ".parquet")):  # check before replaying anything
        return _error(f"--output {args.output!r}: expected a .jsonl or .parquet stream file, "
                      "e.g. runs/x/stream.jsonl")
    try:
        config = ReplayConfig(**fields)
    except ValidationError as e:
        return max(_error(line) for line in config_error_lines(e, flags or {}))
    # The recorder writes JSONL live and its Parquet copy on close: "-o x.parquet" records x.jsonl.
    stream_path = Path(args.output).with_suffix(".jsonl")
    outputs = [stream_path, stream_path.with_suffix(".parquet"), stream_path.with_suffix(".result.json")]
    existing = [str(path) for path in outputs if path.exists()]
    if existing:  # checked first: a run never overwrites a file, and is refused before it starts
        return _error(f"--output {args.output}: {', '.join(existing)} already exist{'s' * (len(existing) == 1)}; "
                      "one run yields one stream: choose a new path or run directory")
    try:
        workload = load_workload(args.workload)
        result = run_replay(workload, config, stream_path=stream_path)
    except (WorkloadFormatError, ValueError, OSError) as e:  # refused: nothing was written
        return _error(str(e))
    except KeyboardInterrupt:
        print(f"interrupted; the stream so far is in {stream_path}" if stream_path.exists()
              else "interrupted before the run started; nothing was written", file=sys.stderr)
        return EXIT_INTERRUPTED
    result_path = Path(args.output).with_suffix(".result.json")
    result_path.write_text(json.dumps(dataclasses.asdict(result), default=str, indent=1))
    counts = {s: result.num_with_status(s) for s in typing.get_args(SessionStatus)}
    print(f"replayed {len(result.sessions)} sessions in {result.duration_s:.1f} s: "
          + ", ".join(f"{n} {s}" for s, n in counts.items() if n)
          + f"; stream {stream_path} (+ .parquet), records {result_path}")
    return 0 if counts["ok"] == len(result.sessions) else EXIT_SESSIONS_FAILED
