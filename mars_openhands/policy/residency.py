"""KV residency: which sessions keep their KV on the GPU (working-set load control).

Source: Denning's working-set model (CACM 1968, "The working set model for program behavior"):
a system thrashes when the working sets of its active programs exceed memory, and the cure is load
control — deactivate programs until the working sets fit, instead of letting the pager evict
pages that are about to be used. An agent session's working set is its KV context: on the bundled
traces only ~3 sessions' final contexts fit an H100 SXM's KV, and once the active contexts overflow
it an LRU prefix cache evicts exactly the session whose tool returns next (design.md §7).

Mental model: sessions are ranked by priority (residents by arrival; held sessions by highest
response ratio, :func:`response_ratio_priority`, or oldest first under ``residency.order: fifo``).
The *resident set* is the highest-priority sessions whose KV demand fits the budget. A resident
session's KV stays pinned across its tool calls; a non-resident session's next turn is held
outside vLLM's waiting queue until it becomes resident. Sessions with a request in the engine
(busy) are never displaced by this plan — only vLLM's preemption can take their blocks — so a
plan only *suspends idle residents* (in a tool call) and *activates held sessions*::

    priority order:  s1(busy) s2(idle) s3(held) s4(idle) s5(held)
    budget:          |========================|
    kept:            s1 s2 .......... s4   -> s3 does not fit even with s4 suspended: s4 stays
    or, if s3 fits once s4 goes:  s1 s2 s3 (activate), s4 suspended, s5 waits (strict order)

Candidates are activated strictly in priority order (no bypass): under ``fifo`` nothing younger
can take the room a held session waits for; under the response ratio every wait raises a held
session's rank, and ``max_hold_s`` bounds it.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from mars_openhands.policy.estimators import EmpiricalCdf

if TYPE_CHECKING:
    from mars_openhands.policy.session import SessionState

__all__ = [
    "HostReload",
    "RESIDENT_FIRST",
    "ResidencyPlan",
    "SessionDemand",
    "displace_value_s",
    "output_reserve_tokens",
    "plan_residency",
    "response_ratio_priority",
    "resume_cost_s",
]


@dataclass(frozen=True, slots=True)
class HostReload:
    """What a cold resume costs with a host-memory KV tier (vLLM's native offload) underneath.

    Attributes:
        load_s_per_block: seconds to copy one GPU block host→GPU (its bytes / the H2D bandwidth).
        copy_slowdown: how much slower the other sessions' steps run while a copy is in flight
            (``HostKvParams.copy_slowdown``; 1 = copies are free for them).
    """

    load_s_per_block: float
    copy_slowdown: float = 1.0


@dataclass(frozen=True, slots=True)
class SessionDemand:
    """One session as the residency plan sees it.

    Attributes:
        session_id: the session.
        priority: sort key, smaller = more important (e.g. ``(first_arrival_s,)``).
        demand_blocks: KV blocks the session needs to be resident now (its context, plus the
            output reserve of its requests in the engine).
        is_resident: currently resident.
        is_busy: has a request inside vLLM (running or waiting): never suspended by a plan.
        is_held: not resident and has a request held outside vLLM (a candidate).
        can_suspend: an idle resident the plan may suspend (False pins it, e.g. its tool is
            about to return); ignored for busy or held sessions.
        displace_value_s: for an idle resident, seconds saved by giving its blocks to a waiting
            session until it is back (its expected idle time) minus what suspending it costs
            (re-prefilling its KV while the busy sessions wait); > 0 lets a held session of
            *any* priority displace it.
    """

    session_id: str
    priority: tuple[float, ...]
    demand_blocks: int
    is_resident: bool
    is_busy: bool = False
    is_held: bool = False
    can_suspend: bool = True
    displace_value_s: float = 0.0
    is_overdue: bool = False
    """A held session whose turn has waited past the hold bound: activated before every other
    held session and whether or not it fits (forced admission)."""


@dataclass(frozen=True, slots=True)
class ResidencyPlan:
    """What to change: sessions to activate (in order) and idle residents to suspend."""

    activate: tuple[str, ...] = ()
    suspend: tuple[str, ...] = ()
    used_blocks: int = 0
    """Demand of the resident set after the plan, blocks."""
    blocked: tuple[str, ...] = field(default=())
    """Held sessions left waiting, in priority order."""


def plan_residency(sessions: Sequence[SessionDemand], budget_blocks: int,
                   displaces_by_age: bool = False) -> ResidencyPlan:
    """Choose the resident set for ``budget_blocks`` KV blocks. Pure.

    1. Residents, in priority order: busy ones always stay; an idle one stays if it fits beside
       every higher-priority resident (busy or kept), else it is suspended. A younger busy
       session that then overflows the pool is vLLM's preemption victim (youngest first), not
       an older idle session.
    2. Held sessions, strictly in priority order: activated if they fit beside every resident;
       if not, idle residents are suspended to make room — those whose blocks are worth more to a
       waiting session (``displace_value_s > 0``, highest first), then residents younger than the
       held session (youngest first; by rank, or with ``displaces_by_age`` by first arrival) —
       but only if that makes it fit. The first held session
       that cannot fit stops all later activations (no bypass). Progress: when nothing is
       busy and every idle resident left may be displaced for it (no resident left, or only
       ones it may suspend), the first held session is activated whatever its size, after
       suspending them all: waiting frees nothing then (a preempted long request whose demand
       exceeds the budget waited forever behind finished sessions' pinned KV). Bound: overdue held
       sessions (``is_overdue``) go first and are activated even when they do not fit (after
       suspending what may be suspended for them); vLLM's preemption then takes the youngest.

    Args:
        sessions: every session the engine tracks that is resident or held.
        budget_blocks: KV blocks the resident set may use.
        displaces_by_age: an idle resident that arrived after a held session may be suspended
            for it whatever their ranks (the last element of ``priority`` is the first arrival).
            Under the response ratio residents rank first, so without it only a displacement
            that pays (``displace_value_s``) happens; with a host KV tier the displaced session
            resumes by a host load, and the engine sets it so that age protects old sessions as
            under ``fifo``.

    Returns:
        The plan; ``used_blocks`` is the resident set's demand after it (above the budget only
        through busy sessions, idle ones that cannot be suspended, or the progress rule).
    """
    ranked = sorted(sessions, key=lambda s: s.priority)
    used = 0
    kept: list[SessionDemand] = []  # idle residents kept, in priority order
    suspend: list[str] = []
    for s in ranked:
        if not s.is_resident:
            continue
        if s.is_busy or used + s.demand_blocks <= budget_blocks or not s.can_suspend:
            used += s.demand_blocks
            if not s.is_busy:
                kept.append(s)
        else:
            suspend.append(s.session_id)
    activate: list[str] = []
    held = [s for s in ranked if s.is_held and not s.is_resident]
    held = [s for s in held if s.is_overdue] + [s for s in held if not s.is_overdue]
    num_busy = sum(1 for s in ranked if s.is_resident and s.is_busy)
    for i, h in enumerate(held):
        if used + h.demand_blocks <= budget_blocks:
            activate.append(h.session_id)
            used += h.demand_blocks
            continue
        victims = _victims(kept, h, displaces_by_age)
        is_last_resort = num_busy == 0 and not activate and len(victims) == len(kept)
        if (not h.is_overdue and not is_last_resort
                and h.demand_blocks > budget_blocks - used + sum(v.demand_blocks for v in victims)):
            return ResidencyPlan(tuple(activate), tuple(suspend), used,
                                 tuple(x.session_id for x in held[i:]))
        for v in victims:
            if budget_blocks - used >= h.demand_blocks:
                break
            suspend.append(v.session_id)
            kept.remove(v)
            used -= v.demand_blocks
        activate.append(h.session_id)
        used += h.demand_blocks
    return ResidencyPlan(tuple(activate), tuple(suspend), used, ())


RESIDENT_FIRST = -math.inf
"""First element of a resident's priority under ``order: response-ratio``: residents rank above
every held session (kept in arrival order), so a held one displaces an idle resident only when
that pays (``displace_value_s``), never by rank."""


def response_ratio_priority(now_s: float, first_arrival_s: float, held_since_s: float | None,
                            prior_s: float, past_wait_s: float = 0.0) -> tuple[float, float]:
    """Priority key (smaller first) of one session under highest-response-ratio-next. Pure.

    Source: Brinch Hansen, "Short-term scheduling in multiprogramming systems" (SOSP 1971): the
    job with the highest (wait + E) / E runs next, E its expected service. An agent session's size
    is unknown when its turn is held, so E = ``prior_s`` + its age when the turn was held (time in
    the system as the estimate of what is left, as least-attained-service assumes): a new session
    doubles its ratio after ``prior_s`` seconds of waiting, one that has run for an hour after an
    hour; every wait raises a ratio, so no held session starves.

    Args:
        now_s: now, seconds (the engine's clock).
        first_arrival_s: when the session's first request reached the engine, seconds.
        held_since_s: when its held turn arrived, seconds; None for a resident (not held).
        prior_s: E of a session held at its first turn, seconds (> 0).
        past_wait_s: seconds the session waited held before its current turn
            (``residency.count_past_waits``): counted as wait, taken out of E.

    Returns:
        ``(-ratio, first_arrival_s)`` for a held session (ties: the older first);
        ``(RESIDENT_FIRST, first_arrival_s)`` for a resident.
    """
    if held_since_s is None:
        return (RESIDENT_FIRST, first_arrival_s)
    expected_s = prior_s + max(0.0, held_since_s - first_arrival_s - past_wait_s)
    return (-(max(0.0, now_s - held_since_s) + past_wait_s + expected_s) / expected_s,
            first_arrival_s)


def _victims(kept: list[SessionDemand], head: SessionDemand, by_age: bool = False) -> list[SessionDemand]:
    """Idle residents ``head`` may displace, in the order they go (``by_age``: younger by first
    arrival rather than by rank). Pure."""
    by_value = sorted((k for k in kept if k.displace_value_s > 0 and k.can_suspend),
                      key=lambda k: -k.displace_value_s)
    younger = [k for k in reversed(kept)
               if (k.priority[-1] > head.priority[-1] if by_age else k.priority > head.priority) and k.can_suspend
               and k.displace_value_s <= 0]
    return by_value + younger


def output_reserve_tokens(num_generated: int, mean_remaining: float | None, prior_tokens: int,
                          max_tokens: int | None) -> int:
    """Decode growth to reserve for a running or held request, tokens. Pure.

    The expected remaining output given what it has generated (``mean_remaining``: the mean
    remaining length of the engine's finished turns' outputs past ``num_generated``); before any,
    or once it has outlived every length seen (``None``), the rest of the prior ``prior_tokens``
    (``residency.output_reserve_tokens``) or as many again as it has generated, whichever is
    more (the tools' rule, policy.estimators: a request that outlived the prior used to reserve
    0, so the plan activated held sessions into room its growth was about to take, and each
    preemption made room for a re-prefill with a cold cache); never more than its ``max_tokens``
    allow.

    Args:
        num_generated: output tokens so far.
        mean_remaining: expected remaining output tokens, or None (no estimate).
        prior_tokens: the prior's whole output, tokens.
        max_tokens: the request's cap, or None.
    """
    remaining = mean_remaining
    if remaining is None:
        remaining = max(prior_tokens - num_generated, num_generated)
    if max_tokens is not None:
        remaining = min(remaining, max(0, max_tokens - num_generated))
    return int(remaining)


def resume_cost_s(demand_blocks: int, num_busy: int, *, block_size: int, prefill_s_per_token: float,
                  host: HostReload | None = None, num_host_blocks: int = 0) -> float:
    """Seconds a displaced idle session's cold resume costs it and the busy sessions. Pure.

    GPU KV only: re-prefilling its KV, which delays every busy session as well. With a host tier
    (``host``), the ``num_host_blocks`` blocks stored there are loaded instead (a copy that slows
    the busy sessions' steps ``copy_slowdown`` times while it runs), and only the rest (the blocks
    vLLM did not store: the last turn's output, ``offload_prompt_only``) is re-prefilled::

        demand_blocks:  |==== on the host (num_host_blocks) ====|== not stored ==|
        cost:              load_s_per_block × (1 + num_busy × (slowdown − 1))
                                                                + block_size × prefill_s_per_token × (1 + num_busy)

    >>> resume_cost_s(10, 1, block_size=16, prefill_s_per_token=0.01)
    3.2
    >>> round(resume_cost_s(10, 1, block_size=16, prefill_s_per_token=0.01,
    ...                     host=HostReload(0.001, 1.5), num_host_blocks=8), 6)
    0.652
    """
    if host is None:
        return demand_blocks * block_size * prefill_s_per_token * (1 + num_busy)
    stored = min(num_host_blocks, demand_blocks)
    load_s = stored * host.load_s_per_block * (1 + num_busy * (host.copy_slowdown - 1.0))
    return load_s + (demand_blocks - stored) * block_size * prefill_s_per_token * (1 + num_busy)


def displace_value_s(session: SessionState | None, demand_blocks: int, num_busy: int, now_s: float,
                     *, imminent_grace_s: float, tool_queue_wait_s: float,
                     tool_cdf: Callable[[str | None], EmpiricalCdf],
                     block_size: int, prefill_s_per_token: float,
                     host: HostReload | None = None, num_host_blocks: int = 0) -> float:
    """Seconds a held session gains from an idle resident's blocks minus what suspending it
    costs; at most 0 unless the resident's idle time left is more likely than not to outlast
    that cost. Pure.

    The idle time left is the resident's tool's remaining duration D − e given the e seconds it
    has run (its duration CDF, policy.estimators), plus, while the call still waits for a tool
    worker, the rest of the CPU plane's mean queue wait q (``tool_queue_wait_s``, from
    tool_enqueued/tool_start events). The cost is re-prefilling the resident's KV at the measured
    prefill rate, paid by it and by every busy session its prefill delays; with a host tier, loading
    the part of it stored on the host instead (:func:`resume_cost_s`), so displacement is cheap and
    mars keeps less idle KV on the GPU::

        cost  = demand_blocks × block_size × prefill_s_per_token × (1 + num_busy)   (no tier)
        value = E[D − e | D > e] + q − cost   if P(D − e + q > cost | D > e) ≥ 1/2,
                min(that, 0)                  otherwise

    Not the mean alone: tool durations are heavy-tailed (most calls end within a second, a few
    run a minute), so a call that has run a second has seconds left on average yet usually
    returns at once; a displacement whose call returns first costs the re-prefill, the displaced
    session's wait for room (it is older, so it then suspends a younger resident in turn) and
    that resident's re-prefill. The median test waits until the elapsed time shows the call is
    one of the long ones. A call past every sample (or a tool without any) is expected to last as
    long again, so a session that silently went away is displaced soon. A tool that has ended
    gains nothing for ``imminent_grace_s`` (the next turn is imminent); after that its next turn
    is expected as late again.

    Args:
        session: the resident's session (0 without one, or before its first finished turn).
        demand_blocks: its KV blocks.
        num_busy: busy resident sessions.
        now_s: the scheduler clock.
        imminent_grace_s: ``retention.imminent_grace_s``.
        tool_queue_wait_s: mean seconds a tool call waits for a worker.
        tool_cdf: ``tool name -> its duration CDF`` (pooled when it has too few samples).
        block_size: tokens per KV block.
        prefill_s_per_token: measured prefill seconds per token.
        host: the host tier's reload cost, or None (GPU KV only).
        num_host_blocks: the resident's blocks stored on the host (with ``host``).
    """
    if session is None or session.last_finish_s is None:
        return 0.0
    queue_s = 0.0
    if session.tool_ended:
        elapsed = now_s - session.last_activity_s  # since the tool_end (or a later event)
        if elapsed < imminent_grace_s:
            return 0.0
    elif session.tool_started_s is not None:
        elapsed = now_s - session.tool_started_s
    elif session.tool_enqueued_s is not None:  # waiting for a tool worker (CPU congestion)
        elapsed = 0.0
        queue_s = max(0.0, tool_queue_wait_s - (now_s - session.tool_enqueued_s))
    else:
        elapsed = now_s - session.last_finish_s
    elapsed = max(0.0, elapsed)
    cost_s = resume_cost_s(demand_blocks, num_busy, block_size=block_size,
                           prefill_s_per_token=prefill_s_per_token, host=host, num_host_blocks=num_host_blocks)
    cdf = None if session.tool_ended else tool_cdf(session.pending_tool)
    remaining = None if cdf is None else cdf.mean_remaining_s(elapsed)
    if remaining is None:  # past every sample, or ended: expected to last as long again
        return elapsed + queue_s - cost_s
    value = remaining + queue_s - cost_s
    need_s = cost_s - queue_s
    if need_s <= 0.0:
        return value
    assert cdf is not None
    ends_first = cdf.prob_le_given_gt(elapsed + need_s, elapsed)
    return value if ends_first <= 0.5 else min(value, 0.0)
