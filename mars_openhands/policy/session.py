"""Per-session state the engine keeps between turns (MARS §4.3; Continuum's gap inference).

Mental model: a session is a sequence of LLM calls (turns) separated by tool runs. The engine sees
turn k finish, then (maybe) ``tool_start``/``tool_end`` events, then turn k+1 arrive. Between turns
the only thing worth keeping is what makes the next turn cheaper or fairer: its attained service
(Autellix PLAS, for levels) and the moment its last turn finished (to infer the tool duration from
the gap when no event reports it).

Timeline of one gap (seconds on the engine's monotonic clock)::

    turn k finished ──── tool_start ────────── tool_end ──── turn k+1 arrives
    |<-------------- inferred gap = arrival - finished ------------------->|
                      |<-- duration_s (event, preferred) -->|

Measured reuse: how much of turn k's context turn k+1's prompt kept. vLLM's block hashes are
chained (block i's hash covers every token of blocks 0..i), so equal hashes at block i mean an
equal prefix through block i; turn k's hashes at :data:`NUM_REUSE_CHECKPOINTS` evenly spaced
blocks are enough to measure the kept prefix to 1/8 of the context, in O(1) memory per session::

    turn k context  |b0|b1|b2|b3|b4|b5|b6|b7|      (checkpoints at b0, b1, ..., b7)
    turn k+1 prompt |b0|b1|b2|b3|x4|x5|x6|x7|x8|   (same through b3: reuse 4/8 = 0.5)
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

__all__ = ["NUM_REUSE_CHECKPOINTS", "SessionState", "context_checkpoints",
           "inferred_tool_duration_s", "measured_reuse_fraction", "tool_sample_at_arrival"]

NUM_REUSE_CHECKPOINTS = 8
"""Blocks of a finished turn's context whose hashes are kept to measure the next turn's reuse."""


@dataclass(slots=True)
class SessionState:
    """Mutable per-session record. Owned by one scheduler instance.

    Attributes:
        session_id: vLLM's ``Request.session_id``.
        attained_service_tokens: tokens scheduled for this session so far (prefill + decode).
        num_turns_finished: turns that finished in this engine.
        last_turn: the ``mars_turn`` of the latest request, if sent.
        last_finish_s: monotonic time the latest turn finished; None while a turn is in flight.
        last_activity_s: monotonic time of the latest request, finish or event (idle eviction).
        pending_tool: tool named by the latest ``tool_start``, cleared at the next arrival.
        tool_started_s: monotonic time of that ``tool_start``.
        tool_enqueued_s: monotonic time of the latest ``tool_enqueued`` (the call waits for a
            tool worker until its ``tool_start``).
        tool_ended: a ``tool_end`` arrived since the last finish (next turn imminent).
        active_request_ids: requests of this session inside the engine.
        last_context_tokens: prompt + output tokens of the session's latest finished turn (the
            context its next turn extends).
        first_arrival_s: monotonic time the session's first request reached this engine (its
            program-level arrival, for session-level FIFO order); for a session that moved here
            from another replica, when its first request reached that one (``mars_session_age_s``).
    """

    session_id: str
    attained_service_tokens: int = 0
    num_turns_finished: int = 0
    last_turn: int | None = None
    last_finish_s: float | None = None
    last_activity_s: float = 0.0
    pending_tool: str | None = None
    tool_started_s: float | None = None
    tool_enqueued_s: float | None = None
    tool_ended: bool = False
    active_request_ids: set[str] = field(default_factory=set)
    first_arrival_s: float = 0.0
    last_context_tokens: int = 0
    reuse_checkpoints: tuple[tuple[int, object], ...] = ()
    """(block index, block hash) of the latest finished turn's context (:func:`context_checkpoints`),
    consumed by the next turn's arrival."""
    num_context_blocks: int = 0
    """Full blocks of that context."""
    reuse_fraction_ema: float | None = None
    """EMA of the measured share of its context each next turn reused; None: never measured."""
    program: Any = None
    """The scheduling policy's per-program state (Autellix's PLAS program, Continuum's program
    arrival and turn counts); None: none yet. It lives and dies with this record."""


def inferred_tool_duration_s(
    last_finish_s: float | None, arrival_s: float, reported_s: float | None
) -> float | None:
    """Duration of the tool run between two turns. Pure.

    Args:
        last_finish_s: when the previous turn finished (monotonic s), None if unknown.
        arrival_s: when the next turn arrived (same clock).
        reported_s: ``mars_prev_tool_s`` sent by the client, preferred when present.

    Returns:
        Seconds, or None when neither a report nor a previous finish exists.
    """
    if reported_s is not None:
        return reported_s
    if last_finish_s is None:
        return None
    return max(0.0, arrival_s - last_finish_s)


def tool_sample_at_arrival(
    session: SessionState, arrival_s: float, prev_tool: str | None, prev_tool_s: float | None
) -> tuple[str | None, float] | None:
    """The tool-duration sample a session's next turn brings, if any. Pure (reads ``session``).

    A ``tool_end`` event already reported the tool since the last finish: no sample (it was
    counted then). Otherwise, after a finished turn, the duration is ``mars_prev_tool_s`` if sent,
    else the gap since the finish (:func:`inferred_tool_duration_s`), for ``mars_prev_tool`` or
    the tool a ``tool_start`` named; before any finished turn in this engine, only a reported
    ``mars_prev_tool_s`` counts.

    Args:
        session: the session's state before the arrival.
        arrival_s: when the next turn arrived (monotonic s).
        prev_tool: ``mars_prev_tool`` of the request, if sent.
        prev_tool_s: ``mars_prev_tool_s`` of the request, if sent.

    Returns:
        ``(tool name or None for unknown, seconds)``, or None.

    >>> s = SessionState("s", num_turns_finished=1, last_finish_s=10.0, pending_tool="bash")
    >>> tool_sample_at_arrival(s, 12.5, None, None)
    ('bash', 2.5)
    """
    if session.tool_ended:
        return None
    if session.num_turns_finished:
        duration = inferred_tool_duration_s(session.last_finish_s, arrival_s, prev_tool_s)
        return None if duration is None else (prev_tool or session.pending_tool, duration)
    if prev_tool_s is not None:
        return prev_tool, prev_tool_s
    return None


def context_checkpoints(block_hashes: list[object],
                        num: int = NUM_REUSE_CHECKPOINTS) -> tuple[tuple[int, object], ...]:
    """``(index, hash)`` of ``num`` evenly spaced blocks of a context, the last block included.
    Pure."""
    n = len(block_hashes)
    if n == 0:
        return ()
    indices = sorted({-(-n * j // num) - 1 for j in range(1, num + 1)})
    return tuple((i, block_hashes[i]) for i in indices)


def measured_reuse_fraction(checkpoints: tuple[tuple[int, object], ...], num_context_blocks: int,
                            block_hashes: list[object]) -> float | None:
    """Share of the previous context (``num_context_blocks`` blocks, its ``checkpoints``) the new
    prompt (``block_hashes``) keeps: (last checkpoint block it matches + 1) / context blocks, so a
    lower bound within 1/len(checkpoints). ``None`` without checkpoints. Pure."""
    if not checkpoints or num_context_blocks <= 0:
        return None
    for index, block_hash in reversed(checkpoints):
        if index < len(block_hashes) and block_hashes[index] == block_hash:
            return (index + 1) / num_context_blocks
    return 0.0
