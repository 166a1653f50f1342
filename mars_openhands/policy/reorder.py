"""Reordering of the sessions waiting for admission (MARS arXiv 2604.26963 §4.2; design.md §6).

Which waiting session gets the next free slot of the AIMD window depends on which resource is tight:

* **fcfs**: nothing is tight and every waiting session fits in the free slots, so order does not
  matter for latency; keep arrival order (the preview's ``low_pressure_fcfs`` fast path).
* **short_first** (normal): fewest estimated prompt tokens first, which minimises mean latency.
* **long_first** (CPU overloaded): GPU-heavy sessions (long prefill) first, so the GPU has work that
  does not add to the tool backlog while the tool workers drain.
* **kv_fit** (KV overloaded): sessions whose projected KV blocks fit the remaining KV budget, smallest
  first and packed greedily; the rest follow, smallest first. :func:`select_admissions` admits only
  fitting sessions in this mode (conservative), except that it always admits one session when none
  is admitted, so the system cannot stall.

Mental model: short-first starves long sessions, so a session that has waited ``starvation_s`` or
longer is moved to the front in arrival order in every mode (our addition; the preview has a
tail-draining phase instead, which needs to know that arrivals have ended).

Pure functions: snapshot in, decision out; the control plane (:mod:`mars_openhands.control.admission`)
builds the snapshot from its registry.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

__all__ = [
    "ReorderContext",
    "ReorderMode",
    "ReorderParams",
    "WaitingSession",
    "choose_mode",
    "order_waiting",
    "select_admissions",
]

ReorderMode = Literal["fcfs", "short_first", "long_first", "kv_fit"]


class ReorderParams(BaseModel):
    """Parameters of the waiting-session reorder. Frozen; unknown keys are an error."""

    model_config = ConfigDict(frozen=True, extra="forbid", use_attribute_docstrings=True)

    starvation_s: float | None = Field(60.0, gt=0.0)
    """Seconds of waiting after which a session goes first (arrival order); ``None`` disables
    (default 60 s, ours: the preview has no aging at admission)."""
    fcfs_when_unpressured: bool = True
    """Keep arrival order when no plane is overloaded and all waiting sessions fit the free slots
    (the preview's low-pressure fast path)."""


class WaitingSession(BaseModel):
    """One session waiting for admission. Frozen."""

    model_config = ConfigDict(frozen=True, extra="forbid", use_attribute_docstrings=True)

    session_id: str
    arrival_s: float
    """When it started waiting, seconds on the caller's monotonic clock."""
    num_prompt_tokens: int = Field(ge=0)
    """Estimated prompt tokens of its pending request (its prefill work)."""
    num_projected_blocks: int | None = Field(None, ge=0)
    """KV blocks its pending request will need, if known."""


class ReorderContext(BaseModel):
    """The pressure and capacity one reorder sees. Frozen."""

    model_config = ConfigDict(frozen=True, extra="forbid", use_attribute_docstrings=True)

    now_s: float
    """Now, seconds on the same clock as ``WaitingSession.arrival_s``."""
    num_free_slots: int = Field(ge=0)
    """Window minus admitted sessions (0 when the window is full)."""
    num_admitted: int = Field(0, ge=0)
    is_cpu_overloaded: bool = False
    is_kv_overloaded: bool = False
    kv_budget_blocks: int | None = Field(None, ge=0)
    """KV blocks that may still be committed before the KV set threshold, if known."""


def choose_mode(
    num_waiting: int, ctx: ReorderContext, params: ReorderParams
) -> ReorderMode:
    """Pick the ordering for the current pressure (KV first: thrashing KV hurts every session). Pure."""
    if ctx.is_kv_overloaded:
        return "kv_fit"
    if ctx.is_cpu_overloaded:
        return "long_first"
    if params.fcfs_when_unpressured and num_waiting <= ctx.num_free_slots:
        return "fcfs"
    return "short_first"


def _blocks(session: WaitingSession) -> int:
    # Unknown projection: order by tokens as a proxy (same monotone order for one block size).
    return session.num_projected_blocks if session.num_projected_blocks is not None else 0


def _kv_fit_order(
    sessions: Sequence[WaitingSession], budget_blocks: int | None
) -> tuple[list[WaitingSession], list[WaitingSession]]:
    """Split into (fitting, rest): smallest first, greedily packed into ``budget_blocks``."""
    by_size = sorted(sessions, key=lambda s: (_blocks(s), s.num_prompt_tokens, s.arrival_s))
    if budget_blocks is None:
        return by_size, []
    fitting: list[WaitingSession] = []
    rest: list[WaitingSession] = []
    remaining = budget_blocks
    for session in by_size:
        need = _blocks(session)
        if session.num_projected_blocks is not None and need <= remaining:
            fitting.append(session)
            remaining -= need
        else:
            rest.append(session)
    return fitting, rest


def _ordered(
    sessions: Sequence[WaitingSession], ctx: ReorderContext, params: ReorderParams
) -> tuple[ReorderMode, list[WaitingSession], int]:
    """Return (mode, order, number of leading sessions that may be admitted in this mode)."""
    starved: list[WaitingSession] = []
    rest: list[WaitingSession] = list(sessions)
    if params.starvation_s is not None:
        starved = [s for s in sessions if ctx.now_s - s.arrival_s >= params.starvation_s]
        rest = [s for s in sessions if ctx.now_s - s.arrival_s < params.starvation_s]
    starved.sort(key=lambda s: s.arrival_s)
    mode = choose_mode(len(sessions), ctx, params)
    if mode == "fcfs":
        body = sorted(rest, key=lambda s: s.arrival_s)
        return mode, starved + body, len(sessions)
    if mode == "short_first":
        body = sorted(rest, key=lambda s: (s.num_prompt_tokens, s.arrival_s))
        return mode, starved + body, len(sessions)
    if mode == "long_first":
        body = sorted(rest, key=lambda s: (-s.num_prompt_tokens, s.arrival_s))
        return mode, starved + body, len(sessions)
    fitting, unfit = _kv_fit_order(rest, ctx.kv_budget_blocks)
    if ctx.kv_budget_blocks is None:
        return mode, starved + fitting, len(sessions)
    return mode, starved + fitting + unfit, len(starved) + len(fitting)


def order_waiting(
    sessions: Sequence[WaitingSession], ctx: ReorderContext, params: ReorderParams
) -> tuple[ReorderMode, list[str]]:
    """Order every waiting session for admission. Pure.

    Returns:
        ``(mode, session_ids)``: the mode used and all ids, best first (a permutation of the input).
    """
    mode, order, _ = _ordered(sessions, ctx, params)
    return mode, [s.session_id for s in order]


def select_admissions(
    sessions: Sequence[WaitingSession], ctx: ReorderContext, params: ReorderParams
) -> tuple[ReorderMode, list[str]]:
    """Choose which waiting sessions to admit now. Pure.

    At most ``ctx.num_free_slots`` sessions, in :func:`order_waiting` order. In ``kv_fit`` mode with
    a known budget only sessions that fit are admitted, except that one session is admitted when
    nothing is admitted and a slot is free (progress guarantee).

    Returns:
        ``(mode, session_ids)`` to admit, in admission order.
    """
    mode, order, num_eligible = _ordered(sessions, ctx, params)
    limit = min(ctx.num_free_slots, num_eligible)
    if limit == 0 and ctx.num_admitted == 0 and ctx.num_free_slots > 0 and order:
        limit = 1
    return mode, [s.session_id for s in order[:limit]]
