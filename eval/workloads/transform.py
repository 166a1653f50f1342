"""Trim and rescale workloads, e.g. for smoke runs or engines with little KV (design.md §8).

Every function is pure (returns a new :class:`Workload`) and appends what it did to ``meta.notes``,
so a result file says how it differs from its source.
"""

from __future__ import annotations

import numpy as np

from eval.workloads.format import Session, Turn, Workload

__all__ = ["cap_session", "mix_workloads", "scale_workload", "trim_workload"]


def _as_final(turn: Turn) -> Turn:
    return turn.model_copy(update={"tool_name": None, "tool_duration_s": 0.0})


def cap_session(session: Session, *, max_turns: int | None = None,
                max_context_tokens: int | None = None) -> Session:
    """Cut ``session`` to at most ``max_turns`` turns whose KV fits ``max_context_tokens``. Pure.

    A turn k fits when ``num_prompt_tokens(k) + output_tokens(k) <= max_context_tokens``; the session
    ends at the last fitting turn, which becomes final (its tool is dropped). If even turn 0 does not
    fit, its output is cut to at most half the cap and its prompt to the rest, so every session keeps
    at least one turn.

    Raises:
        ValueError: ``max_turns < 1`` or ``max_context_tokens < 2``.
    """
    if max_turns is not None and max_turns < 1:
        raise ValueError(f"max_turns must be >= 1, got {max_turns}")
    if max_context_tokens is not None and max_context_tokens < 2:
        raise ValueError(f"max_context_tokens must be >= 2 (1 prompt + 1 output token), "
                         f"got {max_context_tokens}")
    turns = list(session.turns[: max_turns or len(session.turns)])
    if max_context_tokens is not None:
        kept, context_tokens = [], 0
        for turn in turns:
            context_tokens += turn.prompt_tokens_appended
            if context_tokens + turn.output_tokens > max_context_tokens:
                break
            kept.append(turn)
            context_tokens += turn.output_tokens
        if not kept:
            output_tokens = min(turns[0].output_tokens, max_context_tokens // 2)
            kept = [turns[0].model_copy(update={
                "output_tokens": output_tokens,
                "prompt_tokens_appended": max_context_tokens - output_tokens})]
        turns = kept
    if len(turns) == len(session.turns) and turns == list(session.turns):
        return session
    turns[-1] = _as_final(turns[-1])
    return session.model_copy(update={"turns": tuple(turns)})


def trim_workload(workload: Workload, *, num_sessions: int | None = None, max_turns: int | None = None,
                  max_context_tokens: int | None = None) -> Workload:
    """Keep the first ``num_sessions`` sessions, each capped with :func:`cap_session`. Pure.

    Raises:
        ValueError: ``num_sessions < 1`` or an invalid cap (see :func:`cap_session`).
    """
    if num_sessions is not None and num_sessions < 1:
        raise ValueError(f"num_sessions must be >= 1, got {num_sessions}")
    sessions = tuple(
        cap_session(s, max_turns=max_turns, max_context_tokens=max_context_tokens)
        for s in workload.sessions[: num_sessions or len(workload.sessions)]
    )
    note = (f"trimmed: num_sessions={num_sessions} max_turns={max_turns} "
            f"max_context_tokens={max_context_tokens}")
    meta = workload.meta.model_copy(update={"notes": (*workload.meta.notes, note)})
    return workload.model_copy(update={"sessions": sessions, "meta": meta})


def scale_workload(workload: Workload, *, token_factor: float = 1.0, tool_time_factor: float = 1.0,
                   arrival_factor: float = 1.0) -> Workload:
    """Multiply token counts, tool durations and arrival times by constant factors. Pure.

    Token counts are rounded to the nearest integer (half to even, Python's ``round``), with at
    least 1 output token and at least 1 prompt token on turn 0. Use ``token_factor < 1`` to fit long traces into a small engine, and
    ``tool_time_factor < 1`` to shorten wall time of a smoke run.

    Raises:
        ValueError: a factor is not > 0 (``arrival_factor`` may be 0: everything at ``t = 0``).
    """
    if token_factor <= 0 or tool_time_factor <= 0 or arrival_factor < 0:
        raise ValueError(f"factors must be > 0 (arrival_factor >= 0), got token_factor={token_factor} "
                         f"tool_time_factor={tool_time_factor} arrival_factor={arrival_factor}")

    def scale_turn(k: int, turn: Turn) -> Turn:
        return Turn(
            prompt_tokens_appended=max(int(round(turn.prompt_tokens_appended * token_factor)),
                                       1 if k == 0 else 0),
            output_tokens=max(int(round(turn.output_tokens * token_factor)), 1),
            tool_name=turn.tool_name,
            tool_duration_s=turn.tool_duration_s * tool_time_factor,
        )

    sessions = tuple(
        s.model_copy(update={"arrival_s": s.arrival_s * arrival_factor,
                             "turns": tuple(scale_turn(k, t) for k, t in enumerate(s.turns))})
        for s in workload.sessions
    )
    note = (f"scaled: token_factor={token_factor} tool_time_factor={tool_time_factor} "
            f"arrival_factor={arrival_factor}")
    meta = workload.meta.model_copy(update={"notes": (*workload.meta.notes, note)})
    return workload.model_copy(update={"sessions": sessions, "meta": meta})


def draw_sessions(workload: Workload, num_sessions: int, seed: int = 0) -> Workload:
    """``num_sessions`` sessions drawn with replacement from ``workload``'s, in the drawn order.
    Pure.

    Each draw is a copy of a session under the id ``<id>~<k>`` (``k``: the draw's position), so
    every copy is its own session (its own token stream in the simulator: no KV is shared between
    copies). Used for N replicas (``compare --replicas``), whose runs need more sessions than the
    traces hold.

    Args:
        workload: the sessions to draw from (at least one).
        num_sessions: how many to draw (>= 1).
        seed: the draws (``numpy.random.default_rng([seed, 3])``).

    Raises:
        ValueError: an empty workload or ``num_sessions`` < 1.
    """
    if not workload.sessions or num_sessions < 1:
        raise ValueError(f"draw_sessions needs a non-empty workload and num_sessions >= 1, got "
                         f"{len(workload.sessions)} sessions and num_sessions={num_sessions}")
    picks = np.random.default_rng([seed, 3]).integers(0, len(workload.sessions), num_sessions)
    sessions = tuple(workload.sessions[i].model_copy(
        update={"session_id": f"{workload.sessions[i].session_id}~{k}"}) for k, i in enumerate(picks))
    note = f"{num_sessions} sessions drawn with replacement from {len(workload.sessions)} (seed {seed})"
    meta = workload.meta.model_copy(update={"notes": (*workload.meta.notes, note)})
    return Workload(meta=meta, sessions=sessions)


def mix_workloads(workloads: list[Workload], seed: int = 0) -> Workload:
    """Interleave the sessions of several workloads in a seeded random order. Pure.

    An arrival process applied afterwards (:func:`eval.workloads.with_arrivals`, in session order)
    then spreads every workload's sessions over the whole run, e.g. RepoBench-like long prompts
    arriving among agent sessions (MARS §6's long-prefill mix). Arrival times are kept as they
    are until then.

    Args:
        workloads: two or more workloads; their session ids must be distinct.
        seed: order of the interleaving (``numpy.random.default_rng([seed, 2])``).

    Raises:
        ValueError: fewer than two workloads, or a session id in more than one.
    """
    if len(workloads) < 2:
        raise ValueError(f"mix needs at least two workloads, got {len(workloads)}")
    sessions = [s for w in workloads for s in w.sessions]
    ids = [s.session_id for s in sessions]
    if len(set(ids)) != len(ids):
        dup = sorted({i for i in ids if ids.count(i) > 1})[:3]
        raise ValueError(f"session ids must be distinct across the mixed workloads, repeated: {dup}")
    order = np.random.default_rng([seed, 2]).permutation(len(sessions))
    sources = " + ".join(f"{w.meta.source} ({len(w.sessions)})" for w in workloads)
    meta = workloads[0].meta.model_copy(update={
        "source": f"mix: {sources}", "seed": seed,
        "notes": (*workloads[0].meta.notes, f"mixed {sources} in a random order (seed {seed})")})
    return Workload(meta=meta, sessions=tuple(sessions[i] for i in order))
