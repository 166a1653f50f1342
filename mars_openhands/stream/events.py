"""Typed events of the unified information stream (MARS arXiv 2604.26963, §4.1; design.md §3).

One stream carries both planes:

* **GPU plane** (emitted by the engine plugin): per-request lifecycle (`queued`, `first_scheduled`,
  `first_token`, `finished`, `preempted`), KV retention decisions (`kv_retained`, `kv_released`) and
  periodic KV / queue snapshots (`engine_step`).
* **CPU plane** (emitted by the agent runtime or the replay driver): `tool_enqueued`, `tool_start`,
  `tool_end`, `session_start`, `session_end`.
* **Control plane** (emitted by the gateway): `admission_update` (AIMD window and pressure signals),
  `aborted` (a request the gateway gave up: client gone, admission timeout, replica down), and the
  `tool_end` with status ``"interrupted"`` it records for a tool call past its bound.

Every event is a frozen pydantic model that rejects unknown fields and carries a ``kind``
discriminator, ``t_mono_ns`` (``time.monotonic_ns()`` of the emitting process), ``t_wall`` (UTC),
``session_id``, ``turn`` and ``source``. Monotonic clocks are only comparable within one process
(or one machine); analysis orders events by ``t_wall`` across processes and uses ``t_mono_ns`` for
durations within a source.

Mental model: an event is a fact that already happened, never a command. Consumers (the recorder,
the gateway hub, the engine's retention logic) may drop or batch events, but never mutate them.
"""

from __future__ import annotations

import json
import time
from datetime import UTC, datetime
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, TypeAdapter, ValidationError, field_validator

__all__ = [
    "AdmissionUpdate",
    "EngineStep",
    "Event",
    "EventError",
    "EVENT_TYPES",
    "KvReleased",
    "KvRetained",
    "ReplicaReplaced",
    "RequestAborted",
    "RequestFinished",
    "RequestFirstScheduled",
    "RequestFirstToken",
    "RequestPreempted",
    "RequestQueued",
    "SessionEnd",
    "SessionStart",
    "ToolEnd",
    "ToolEnqueued",
    "ToolStart",
    "parse_event",
    "now_stamps",
]

NonNegInt = Annotated[int, Field(ge=0)]
NonNegFloat = Annotated[float, Field(ge=0.0)]
PosFloat = Annotated[float, Field(gt=0.0)]


def now_stamps() -> dict[str, Any]:
    """Return ``{"t_mono_ns": int, "t_wall": datetime(UTC)}`` for the current instant.

    Use as ``ToolStart(**now_stamps(), session_id=..., ...)``.
    """
    return {"t_mono_ns": time.monotonic_ns(), "t_wall": datetime.now(UTC)}


class _EventBase(BaseModel):
    """Fields shared by every event. Frozen; unknown fields are an error."""

    model_config = ConfigDict(frozen=True, extra="forbid", strict=False)

    t_mono_ns: NonNegInt
    """Monotonic clock of the emitting process, in nanoseconds (``time.monotonic_ns()``)."""
    t_wall: datetime
    """Wall-clock time in UTC (timezone-aware)."""
    session_id: str | None = None
    """Agent session (one agent task); ``None`` for engine-wide events and one-turn requests."""
    turn: NonNegInt | None = None
    """0-based LLM call index within the session; ``None`` when not tied to a turn."""
    source: str
    """Emitter, e.g. ``"engine:0"``, ``"gateway"``, ``"agent"``, ``"replay"``, ``"sim"``."""

    @field_validator("t_wall")
    @classmethod
    def _t_wall_is_aware(cls, value: datetime) -> datetime:
        # Events from several processes are ordered by t_wall; a naive (local?) time would sort
        # silently wrong, so reject it instead of guessing its zone.
        if value.tzinfo is None or value.utcoffset() is None:
            raise ValueError(
                f"t_wall must be timezone-aware (UTC), got naive {value.isoformat()}; "
                "use now_stamps() or datetime.now(UTC)"
            )
        return value.astimezone(UTC)


# ----------------------------------------------------------------------------- GPU plane
class RequestQueued(_EventBase):
    """A request entered the engine's waiting queue."""

    kind: Literal["queued"] = "queued"
    request_id: str
    num_prompt_tokens: NonNegInt
    num_projected_blocks: NonNegInt | None = None
    """KV blocks the request will need for its full prompt (cached or not), if known."""


class RequestFirstScheduled(_EventBase):
    """A request got its first prefill chunk scheduled."""

    kind: Literal["first_scheduled"] = "first_scheduled"
    request_id: str
    prefill_start_delay_s: NonNegFloat
    """Seconds between arrival in the engine and the first scheduled prefill chunk."""
    num_cached_tokens: NonNegInt = 0
    """Prompt tokens served from the prefix cache or retained KV (no prefill needed)."""


class RequestFirstToken(_EventBase):
    """A request produced its first output token."""

    kind: Literal["first_token"] = "first_token"
    request_id: str
    ttft_s: NonNegFloat
    """Time to first token, seconds from arrival in the engine."""


class RequestFinished(_EventBase):
    """A request finished; its KV blocks were freed or retained."""

    kind: Literal["finished"] = "finished"
    request_id: str
    num_prompt_tokens: NonNegInt
    num_output_tokens: NonNegInt
    num_blocks_freed: NonNegInt = 0
    num_blocks_retained: NonNegInt = 0
    finish_reason: str | None = None
    e2e_s: NonNegFloat | None = None
    """Seconds from arrival in the engine to the last token."""


class RequestPreempted(_EventBase):
    """A running request was preempted (recompute); its blocks were freed."""

    kind: Literal["preempted"] = "preempted"
    request_id: str
    num_blocks_freed: NonNegInt
    num_computed_tokens: NonNegInt = 0


class KvRetained(_EventBase):
    """A finished turn's KV blocks are pinned for a warm resume of the session's next turn."""

    kind: Literal["kv_retained"] = "kv_retained"
    request_id: str | None = None
    num_blocks: NonNegInt
    ttl_s: NonNegFloat
    """Seconds the blocks stay pinned unless the next turn arrives or they are reclaimed."""
    reason: str
    """Why, e.g. ``"value>cost"``, ``"tool_start:extend"``, ``"continuum:ttl"``."""


class KvReleased(_EventBase):
    """Retained KV blocks were unpinned (they return to the prefix-cache LRU or the free pool)."""

    kind: Literal["kv_released"] = "kv_released"
    num_blocks: NonNegInt
    reason: Literal["resumed", "expired", "reclaimed", "suspended", "session_end", "tool_start:cut",
                    "shutdown", "aborted", "reset"]
    """``"aborted"``: the turn was aborted after its final token (its client is gone);
    ``"reset"``: vLLM's prefix cache was reset (``/reset_prefix_cache``, a weight update)."""
    held_s: NonNegFloat | None = None
    """Seconds the blocks were held."""
    num_reused_blocks: NonNegInt | None = None
    """Of these blocks, how many the session's next turn actually reused (its prefix hit took
    them): up to ``num_blocks`` for ``"resumed"``, 0 for a release without a resume; ``None`` in
    streams written before it was measured. The retention hit ratio is measured from it."""


class EngineStep(_EventBase):
    """Periodic snapshot of one engine's KV and queues (at most one per step, rate-limited)."""

    kind: Literal["engine_step"] = "engine_step"
    num_gpu_blocks: NonNegInt
    num_used_blocks: NonNegInt
    """Blocks referenced by running requests (excludes evictable prefix-cache blocks)."""
    num_free_blocks: NonNegInt
    """Blocks free or evictable from the prefix cache."""
    num_retained_blocks: NonNegInt = 0
    num_running: NonNegInt
    num_waiting: NonNegInt
    num_projected_blocks: NonNegInt | None = None
    """Blocks that admitted (running + waiting) work will need at full prompt length."""
    step_time_s: NonNegFloat | None = None
    num_host_blocks: NonNegInt = 0
    """The host-memory KV tier's capacity in GPU blocks (``--kv-offloading-size``; 0: no tier)."""


# ----------------------------------------------------------------------------- CPU plane
class SessionStart(_EventBase):
    """An agent session (one task) started."""

    kind: Literal["session_start"] = "session_start"
    tool_timeout_s: PosFloat | None = None
    """The task's bound on one tool call, seconds: a call with no ``tool_end`` this long after its
    ``tool_enqueued`` / ``tool_start`` is closed by the gateway as ``"interrupted"``; ``None``: the
    gateway's ``tool_call_timeout_s``. A tool's own ``timeout_s`` wins."""


class SessionEnd(_EventBase):
    """An agent session ended; everything it holds may be released."""

    kind: Literal["session_end"] = "session_end"
    status: str = "ok"
    error: str | None = None
    """Why the session ended early (``status`` other than ``"ok"``), e.g. the failing turn's HTTP
    error; ``None`` when it finished."""


class ToolEnqueued(_EventBase):
    """A tool call was handed to the tool pool (may wait for a worker)."""

    kind: Literal["tool_enqueued"] = "tool_enqueued"
    tool_name: str
    tool_call_id: str
    timeout_s: PosFloat | None = None
    """This call's bound, seconds (the tool's own timeout plus slack); ``None``: the session's
    ``tool_timeout_s`` or the gateway's default. Past it without a ``tool_end``, the gateway
    closes the call with status ``"interrupted"``."""


class ToolStart(_EventBase):
    """A tool call started executing on a worker."""

    kind: Literal["tool_start"] = "tool_start"
    tool_name: str
    tool_call_id: str
    queue_wait_s: NonNegFloat = 0.0
    """Seconds between ``tool_enqueued`` and this start."""
    timeout_s: PosFloat | None = None
    """This call's bound from its start, seconds; as :attr:`ToolEnqueued.timeout_s`."""


class ToolEnd(_EventBase):
    """A tool call ended."""

    kind: Literal["tool_end"] = "tool_end"
    tool_name: str
    tool_call_id: str
    duration_s: NonNegFloat
    """Seconds from ``tool_start`` to the end (execution only, not queue wait)."""
    status: Literal["ok", "error", "timeout", "denied", "interrupted"] = "ok"
    """``"interrupted"``: no ``tool_end`` came from the agent within the call's bound (the agent
    died or lost the gateway); recorded by the gateway, ``duration_s`` is the time it waited."""


# ----------------------------------------------------------------------------- control plane
class RequestAborted(_EventBase):
    """The gateway gave up an LLM request before its response ended (emitted by the gateway).

    The engine's own ``finished`` (``finish_reason="abort"``) follows when the request had reached
    it; this event is the request's end when it had not (it waited for admission) and says why.
    """

    kind: Literal["aborted"] = "aborted"
    request_id: str
    """The gateway's id of the request (the agent's ``x-request-id`` when it sent one)."""
    reason: Literal["client_disconnect", "admission_timeout", "replica_failed"]
    stage: Literal["body", "admission", "upstream", "stream"]
    """Where it was: reading the body, waiting for a slot, waiting for the replica's first byte,
    relaying the response."""
    is_slot_released: bool = False
    """The session's admission slot was released with it (a client gone with nothing else in
    flight; the session queues again on its next request)."""
    elapsed_s: NonNegFloat = 0.0
    """Seconds since the gateway received the request."""


class ReplicaReplaced(_EventBase):
    """The cluster layer replaced a dead engine replica (emitted by the gateway under
    ``mars-openhands serve`` when Ray Serve's new actor for the replica first answers): a new vLLM
    server, with an empty KV cache, at ``url``. The sessions it held re-prefill their context on
    their next turn (the gateway detached them when the old one went down)."""

    kind: Literal["replica_replaced"] = "replica_replaced"
    replica: str
    """The replica's name (``engine-<i>``)."""
    url: str
    """Where the new server serves."""
    previous_incarnation: str
    """Id of the actor that died (``EngineReplica.incarnation``)."""
    incarnation: str
    """Id of the actor that replaced it."""


class AdmissionUpdate(_EventBase):
    """The gateway's AIMD admission window after an update (MARS §4.2)."""

    kind: Literal["admission_update"] = "admission_update"
    window: NonNegInt
    num_admitted: NonNegInt
    num_waiting: NonNegInt
    cpu_overloaded: bool
    kv_overloaded: bool
    tool_backlog_ratio: NonNegFloat
    """rho = in-flight tool calls / tool workers."""
    tool_wait_ema_s: NonNegFloat
    kv_usage: Annotated[float, Field(ge=0.0, le=1.0)]


Event = Annotated[
    RequestQueued
    | RequestFirstScheduled
    | RequestFirstToken
    | RequestFinished
    | RequestPreempted
    | RequestAborted
    | ReplicaReplaced
    | KvRetained
    | KvReleased
    | EngineStep
    | SessionStart
    | SessionEnd
    | ToolEnqueued
    | ToolStart
    | ToolEnd
    | AdmissionUpdate,
    Field(discriminator="kind"),
]
"""Any stream event; parse with :func:`parse_event`."""

EVENT_TYPES: dict[str, type[BaseModel]] = {
    cls.model_fields["kind"].default: cls
    for cls in (
        RequestQueued, RequestFirstScheduled, RequestFirstToken, RequestFinished, RequestPreempted,
        RequestAborted, KvRetained, KvReleased, EngineStep, SessionStart, SessionEnd, ToolEnqueued, ToolStart,
        ToolEnd, AdmissionUpdate, ReplicaReplaced,
    )
}
"""kind → event class."""

_ADAPTER: TypeAdapter[Event] = TypeAdapter(Event)


class EventError(ValueError):
    """An event failed validation; the message names the kind and the offending field(s)."""


def parse_event(data: dict[str, Any] | str | bytes) -> Event:
    """Validate one event from a dict or a JSON document.

    Args:
        data: a mapping, or JSON text/bytes of one object, with a ``kind`` field.

    Returns:
        The typed, frozen event.

    Raises:
        EventError: unknown ``kind`` (the message lists the known kinds), a missing field, a wrong
            type or an unknown field; the message names each offending field.
    """
    try:
        if isinstance(data, (str, bytes)):
            return _ADAPTER.validate_json(data)
        return _ADAPTER.validate_python(data)
    except ValidationError as e:
        raise EventError(_describe(data, e)) from None


def _describe(data: dict[str, Any] | str | bytes, error: ValidationError) -> str:
    """Build an :class:`EventError` message naming the kind and each offending field."""
    if isinstance(data, (str, bytes)):
        try:
            data = json.loads(data)
        except ValueError as json_error:
            return f"event is not valid JSON: {json_error}"
    if not isinstance(data, dict):
        return f"event must be a JSON object with a 'kind' field, got {type(data).__name__}"
    if "kind" not in data:
        return f"event has no 'kind' field; expected one of {sorted(EVENT_TYPES)}"
    kind = data["kind"]
    if not isinstance(kind, str) or kind not in EVENT_TYPES:
        return f"unknown event kind {kind!r}; expected one of {sorted(EVENT_TYPES)}"
    problems = "; ".join(
        f"{'.'.join(str(p) for p in err['loc'][1:] or err['loc'])}: {err['msg']}"
        for err in error.errors()
    )
    return f"invalid {kind} event: {problems}"
