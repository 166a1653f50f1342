"""``RequestState``: what the scheduler tracks per request, beside vLLM's ``Request``.

Policy state lives here, not on vLLM's objects (they are vLLM's to change): the request's session
and MARS metadata, its arrival on the scheduler clock, its MLFQ feedback level and aging clock,
and the telemetry timestamps. One per request from ``add_request`` to its blocks being freed;
owned by one scheduler. The helpers below are the state transitions more than one policy shares.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from mars_openhands.policy.levels import feedback_after_scheduled
from mars_openhands.policy.params import LevelParams
from mars_openhands.policy.types import TurnMeta

__all__ = ["RequestState", "finished_request_ids", "reset_mlfq", "update_mlfq_feedback"]


@dataclass(slots=True)
class RequestState:
    """What the plugin tracks per request (policy state lives here, not on vLLM's Request)."""

    session_id: str | None
    meta: TurnMeta
    arrival_s: float
    """Scheduler clock when the request entered the engine."""
    user_priority: int = 0
    first_scheduled_s: float | None = None
    first_token_s: float | None = None
    feedback_level: int = 0
    """MLFQ feedback level (policies that use one)."""
    mlfq_last_scheduled_s: float | None = None
    """When an MLFQ policy last counted this request as scheduled (its aging clock)."""
    cached_at_arrival_tokens: int = 0
    """Prefix-cache hit length when the request arrived (only measured if a policy asks)."""
    quantum_tokens: int | None = None
    """Quantum applied by the chunk hook in the current step (MLFQ feedback)."""
    session_context_tokens: int = 0
    """Context of the session's previous turn (prompt + output tokens) when this request
    arrived: the part of the prompt the session already had, as opposed to new work."""


def finished_request_ids(engine_outputs: dict[int, Any]) -> list[str]:
    """Request ids that finished in one ``update_from_output`` result (vLLM's public outputs)."""
    return [o.request_id for eco in engine_outputs.values() for o in eco.outputs
            if o.finish_reason is not None]


def update_mlfq_feedback(
    state: RequestState, request: Any, num_tokens: int, now_s: float, params: LevelParams
) -> None:
    """Apply one scheduled step to the request's MLFQ feedback (preview's ``_mars_on_scheduled``;
    the rule is :func:`~mars_openhands.policy.levels.feedback_after_scheduled`).

    Called after ``schedule()``, when vLLM has already advanced ``request.num_computed_tokens``
    by ``num_tokens``. Mutates ``state``.
    """
    state.mlfq_last_scheduled_s = now_s
    state.feedback_level = feedback_after_scheduled(
        state.feedback_level, state.quantum_tokens, num_tokens, request.num_prompt_tokens,
        request.num_computed_tokens, request.num_tokens, params)


def reset_mlfq(state: RequestState) -> None:
    """Back to MLFQ level 0 with no aging clock (the preview's rule at preemption and at
    admission from the overflow window). Mutates ``state``."""
    state.feedback_level = 0
    state.mlfq_last_scheduled_s = None
