"""ThunderAgent: program-level admission by KV token accounting (arXiv 2602.13692, ICML'26).

Source: the paper (§4.1 program abstraction, §4.3.1 scheduling policy, §5.1 configuration) and
its public code, ``ThunderAgent-org/ThunderAgent`` at commit ``a7eef77`` (2026-03-06):
``ThunderAgent/scheduler/router.py`` (``MultiBackendRouter``), ``ThunderAgent/backend/state.py``
(``BackendState``), ``ThunderAgent/program/state.py``, ``ThunderAgent/config.py``. NVIDIA Dynamo
ships a port of the same scheduler as a router plugin (docs.nvidia.com/dynamo, "ThunderAgent
Program Scheduler"); where the paper is vague this module follows the public code.

Mental model: an agent session is an *LLM program*, REASONING while it has a request in the
engine and ACTING while it runs a tool. Every admitted (ACTIVE) program reserves its whole
context in the KV pool, ACTING ones included, so a returning program finds its KV: the
admitted programs' contexts must fit::

    capacity = block_size * num_gpu_blocks                       (tokens, vLLM's cache_config_info)
    used     = Σ_REASONING c_p + w · Σ_ACTING c_q + 100 · #ACTIVE     (code: remaining_capacity)

A new program is admitted at once only if no program is paused and ``used + c + 100 <=
capacity``; otherwise it waits in the global paused pool. Every ``Δt`` = 5 s a periodic check
first *resumes* paused programs (REASONING ones with a pending request first, then new programs,
then ACTING ones; smallest context first within a group; while the cumulative demand fits, then
best-fit-decreasing placement), then *pauses* until ``used <= capacity``: ACTING programs
smallest first (a logical pause at the tool boundary: their KV is released, their next request
waits), then REASONING ones smallest first are *marked* and paused when their request finishes
(no decode is preempted). For the resume, ACTING tokens decay as ``f(t) = 2^(-t/h)`` with ``t`` the
seconds since the tool call began (paper Eq. 7, §5.1: ``f(t) = 2^-t``), so programs in long tool
calls make room first. A program whose request waited ``max_wait_s`` = 1800 s is admitted by
force. Shortest-first follows from the recompute cost being quadratic in the context (Lemma 4.1).

Port notes (where this differs from the public router, and why):

* Contexts are the engine's exact token counts (the router estimates a new request's tokens from
  its JSON length at a learned chars-per-token ratio; here ``num_prompt_tokens``, and
  ``num_tokens`` while it decodes, as the router's streaming updates do).
* ``shared_tokens`` (prefix-cache savings) is 0: the router computes it only in
  ``update_shared_tokens``, which nothing calls at that commit.
* The pause loop stops once the tokens of marked REASONING programs cover the overflow
  (``capacity_overflow(include_future_release=True)``, the router's own helper "for checking if
  more programs need to be paused"); the released loop re-tests ``remaining_capacity() < 0``,
  which marking never changes, so it marks every REASONING program once the ACTING ones are
  exhausted.
* The decay clock starts at the tool's ``tool_start`` event when the gateway forwards one (paper:
  "tq is the tool execution time"), else at the request's finish (the router's ``acting_since``);
  decay on by default as the paper ran it (the router's ``--use-acting-token-decay`` is off by
  default); only the resume uses it, as in the router.
* One engine is one backend: the multi-backend BFD placement reduces to one bin.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Annotated

from pydantic import BaseModel, ConfigDict, Field

__all__ = [
    "PausedProgramView",
    "ProgramView",
    "ThunderAgentParams",
    "acting_decay",
    "can_admit_new_program",
    "remaining_capacity_tokens",
    "select_pauses",
    "select_resumes",
]

PositiveFloat = Annotated[float, Field(gt=0.0)]

RESUME_GROUP_REASONING = 0
"""Paused program with a pending request and an earlier one served (resumed first)."""
RESUME_GROUP_NEW = 1
"""Program that has made one request so far (router: ``step_count == 1``)."""
RESUME_GROUP_ACTING = 2
"""Paused program without a pending request (resumed last)."""


class ThunderAgentParams(BaseModel):
    """Parameters of the ThunderAgent baseline (``--additional-config`` key ``mars.thunderagent``)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    scheduler_interval_s: PositiveFloat = 5.0
    """``Δt``: seconds between periodic resume/pause checks (paper §5.1; code
    ``Config.scheduler_interval`` = 5.0)."""
    acting_token_weight: Annotated[float, Field(ge=0.0)] = 1.0
    """``w``: weight of ACTING programs' tokens in the capacity check (code
    ``--acting-token-weight``, ``tool_coefficient`` = 1.0)."""
    acting_decay_half_life_s: PositiveFloat | None = 1.0
    """``h`` in ``f(t) = 2^(-t/h)`` applied to ACTING tokens when resuming, seconds; 1.0 is the
    paper's ``f(t) = 2^-t`` (§5.1; ``x^-t`` is ``h = 1/log2(x)``); None: no decay (the code's
    default, ``--use-acting-token-decay`` off)."""
    buffer_per_program_tokens: Annotated[int, Field(ge=0)] = 100
    """Decode headroom reserved per active program, tokens (code ``BUFFER_PER_PROGRAM``)."""
    max_wait_s: PositiveFloat = 1800.0
    """A request that waited this long for its program's resume is admitted by force, seconds
    (code ``_wait_for_resume(timeout=1800.0)``; paper: 30 min)."""
    pin_acting_kv: bool = True
    """Keep an admitted ACTING program's KV ahead of other cached blocks (pinned until its next
    turn is scheduled, its program is paused or an allocation needs the blocks): the reservation
    the paper's capacity check implies (§4.3.1). False: the router on stock vLLM, where that KV
    sits in the prefix-cache LRU like any finished request's."""


@dataclass(frozen=True, slots=True)
class ProgramView:
    """Snapshot of one ACTIVE (admitted) program for a capacity decision.

    Attributes:
        program_id: the session id (or the request id of a session-less request).
        num_tokens: its context ``c``: the live request's tokens while REASONING, the last
            finished request's prompt + output while ACTING.
        is_reasoning: it has a request in the engine.
        acting_s: seconds since its current tool call began (0.0 while REASONING).
        is_marked: marked to pause when its request finishes (REASONING only).
    """

    program_id: str
    num_tokens: int
    is_reasoning: bool
    acting_s: float = 0.0
    is_marked: bool = False


@dataclass(frozen=True, slots=True)
class PausedProgramView:
    """Snapshot of one program in the global paused pool.

    Attributes:
        program_id: as in :class:`ProgramView`.
        num_tokens: its context now (a pending request's prompt, if any).
        paused_tokens: its context when it entered the pool (the router sorts by this).
        group: ``RESUME_GROUP_*`` (resume priority, smallest first).
    """

    program_id: str
    num_tokens: int
    paused_tokens: int
    group: int


def acting_decay(acting_s: float, params: ThunderAgentParams) -> float:
    """``f(t) = 2^(-t/h)`` for an ACTING program ``t`` seconds into its tool call; 1.0 without
    decay. Pure.

    >>> p = ThunderAgentParams()
    >>> acting_decay(0.0, p), acting_decay(1.0, p), acting_decay(3.0, p.model_copy(update={"acting_decay_half_life_s": None}))
    (1.0, 0.5, 1.0)
    """
    h = params.acting_decay_half_life_s
    return 1.0 if h is None else math.pow(2.0, -max(0.0, acting_s) / h)


def remaining_capacity_tokens(
    capacity_tokens: int, programs: Iterable[ProgramView], params: ThunderAgentParams,
    *, with_decay: bool = False,
) -> int:
    """KV tokens left for more programs: ``capacity - (Σ tokens + 100 · count)``; may be < 0. Pure.

    Without decay ACTING tokens count ``acting_token_weight`` times (router
    ``remaining_capacity``); with decay each counts ``f(t)`` times (router
    ``remaining_capacity_with_decay``, which applies no weight). REASONING tokens count once.

    Args:
        capacity_tokens: ``block_size * num_gpu_blocks``.
        programs: the ACTIVE programs.
        params: ThunderAgent parameters.
        with_decay: use ``f(t)`` (the resume's view) instead of the weight (the pause's view).

    Returns:
        Tokens (an int, truncated as the router does).

    >>> p = ThunderAgentParams()
    >>> views = [ProgramView("a", 1000, True), ProgramView("b", 800, False, acting_s=1.0)]
    >>> remaining_capacity_tokens(4000, views, p), remaining_capacity_tokens(4000, views, p, with_decay=True)
    (2000, 2400)
    """
    reasoning = acting = 0.0
    count = 0
    for p in programs:
        count += 1
        if p.is_reasoning:
            reasoning += p.num_tokens
        elif with_decay and params.acting_decay_half_life_s is not None:
            acting += p.num_tokens * acting_decay(p.acting_s, params)
        else:
            acting += p.num_tokens * params.acting_token_weight
    used = int(reasoning + acting) + count * params.buffer_per_program_tokens
    return capacity_tokens - used


def can_admit_new_program(
    num_tokens: int, remaining_tokens: int, has_paused_programs: bool, params: ThunderAgentParams,
) -> bool:
    """Admit a new program at its first request? Only when no program is paused (fairness) and
    its context plus the buffer fits (router ``_select_backend_for_new_program``). Pure.

    >>> p = ThunderAgentParams()
    >>> can_admit_new_program(900, 1000, False, p), can_admit_new_program(901, 1000, False, p)
    (True, False)
    >>> can_admit_new_program(10, 10**6, True, p)
    False
    """
    return not has_paused_programs and remaining_tokens >= num_tokens + params.buffer_per_program_tokens


def select_resumes(
    paused: Sequence[PausedProgramView], remaining_tokens: int, params: ThunderAgentParams,
) -> list[str]:
    """Programs to resume now, in resume order (router ``_greedy_resume``, one backend). Pure.

    1. Nothing if ``remaining_tokens <= buffer`` (the backend is full).
    2. Candidates by ``(group, paused_tokens)``; each is selected if the cumulative
       ``num_tokens + buffer`` of the selection stays within ``remaining_tokens`` (a program
       that does not fit is skipped, smaller ones after it may still fit).
    3. Best-fit-decreasing placement into the one bin: largest first, stop when the bin's room
       falls to the buffer or below.

    Args:
        paused: the global paused pool.
        remaining_tokens: :func:`remaining_capacity_tokens` with decay (the resume's view).
        params: ThunderAgent parameters.

    Returns:
        Program ids, largest first (the order they are placed in).

    Examples:
        >>> p = ThunderAgentParams()
        >>> pool = [PausedProgramView("big", 5000, 5000, 0), PausedProgramView("new", 300, 300, 1),
        ...         PausedProgramView("act", 100, 100, 2), PausedProgramView("r", 400, 400, 0)]
        >>> select_resumes(pool, 1000, p)  # r (500) + new (400) fit; act (200) would pass 1000
        ['r', 'new']
    """
    buffer = params.buffer_per_program_tokens
    if remaining_tokens <= buffer:
        return []
    chosen: list[PausedProgramView] = []
    cumulative = 0
    for view in sorted(paused, key=lambda v: (v.group, v.paused_tokens)):
        need = view.num_tokens + buffer
        if cumulative + need <= remaining_tokens:
            chosen.append(view)
            cumulative += need
    placed: list[str] = []
    room = remaining_tokens
    for view in sorted(chosen, key=lambda v: -v.num_tokens):
        if room <= buffer:
            break
        need = view.num_tokens + buffer
        if need > room:
            continue
        placed.append(view.program_id)
        room -= need
    return placed


def select_pauses(
    active: Sequence[ProgramView], capacity_tokens: int, marked_tokens: int,
    params: ThunderAgentParams,
) -> tuple[list[str], list[str]]:
    """Programs to pause now and REASONING programs to mark, until the pool fits (router
    ``_pause_until_safe``). Pure.

    While ``remaining + marked_tokens < 0`` (without decay; ``marked_tokens`` = tokens of
    programs already marked, released when their requests finish): pause the smallest ACTING
    program, or if none is left mark the smallest unmarked REASONING one.

    Args:
        active: the ACTIVE programs.
        capacity_tokens: ``block_size * num_gpu_blocks``.
        marked_tokens: tokens of the programs already marked.
        params: ThunderAgent parameters.

    Returns:
        ``(pause_ids, mark_ids)``, each smallest first.

    Examples:
        >>> p = ThunderAgentParams(buffer_per_program_tokens=0)
        >>> views = [ProgramView("a1", 300, False), ProgramView("a2", 200, False),
        ...          ProgramView("r1", 500, True), ProgramView("r2", 400, True)]
        >>> select_pauses(views, 1000, 0, p)      # 400 over: a2, a1 free 500
        (['a2', 'a1'], [])
        >>> select_pauses(views, 500, 0, p)       # 900 over: both acting, then r2 (400)
        (['a2', 'a1'], ['r2'])
    """
    remaining = remaining_capacity_tokens(capacity_tokens, active, params)
    buffer = params.buffer_per_program_tokens
    acting = sorted((v for v in active if not v.is_reasoning), key=lambda v: v.num_tokens)
    reasoning = sorted((v for v in active if v.is_reasoning and not v.is_marked),
                       key=lambda v: v.num_tokens)
    pauses: list[str] = []
    marks: list[str] = []
    while remaining + marked_tokens < 0:
        if acting:
            view = acting.pop(0)
            pauses.append(view.program_id)
            remaining += int(view.num_tokens * params.acting_token_weight) + buffer
        elif reasoning:
            view = reasoning.pop(0)
            marks.append(view.program_id)
            marked_tokens += view.num_tokens
        else:
            break
    return pauses, marks
