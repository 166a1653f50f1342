"""Autellix PLAS: program-level attained service scheduling (Autellix, arXiv 2502.13965, §4).

Autellix ranks each LLM call by the service its *program* (agent session) has already attained,
so that short programs are not stuck behind long ones (least-attained-service first, at program
granularity). It discretizes priority into the levels of a multi-level feedback queue (MLFQ) and
adds anti-starvation. This module ports the variant that MARS ran as a baseline (design.md §5;
MARS preview ``vllm-continuum/vllm/v1/core/sched/scheduler.py`` ``_autellix_*``, commit 7e649f3):

* service is counted in **scheduled tokens** (prefill chunks and decode tokens alike);
* a call's **arrival level** is the bucket of its program's attained service::

      program service (tokens) | [0, 2048) | [2048, 8192) | [8192, 32768) | [32768, inf)
      level                    |     0     |      1       |       2       |      3

* each level has a token **quantum** (2048, 1024, 512, 256); a call may schedule at most its
  remaining quantum per step, and once it uses its quantum up with work left it is **demoted**
  one level (at most to the last level) and gets that level's quantum;
* **anti-starvation**: a call above level 0 is promoted to level 0 when
  ``(W_program + W_call) / (S_program + S_call) >= beta`` (beta = 2.0), where ``W`` is waiting
  counted as tokens scheduled for *other* requests while this one was not scheduled, and ``S`` is
  attained service in tokens; promotion resets the call's own wait and service counters;
* the preemption **victim** is the running request with the largest ``(level, KV blocks,
  arrival_time)``.

Mental model: a program's attained service only grows, so a long-running agent drifts to the low
levels and fresh agents overtake it; the quantum/demotion pair does the same inside one long call,
and the wait/service ratio caps how long any call can starve (it is promoted once it has waited
beta times the service it got).

Everything here is pure: state objects are frozen and each function returns a new one.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Annotated

from pydantic import BaseModel, ConfigDict, Field, model_validator

__all__ = [
    "PlasCall",
    "PlasParams",
    "PlasProgram",
    "accrue_wait",
    "arrival_level",
    "level_quantum_tokens",
    "new_call",
    "on_call_finished",
    "on_scheduled",
    "promote",
    "running_order_key",
    "should_promote",
    "step_token_cap",
    "victim_key",
]

PosInt = Annotated[int, Field(gt=0)]


class PlasParams(BaseModel):
    """Parameters of the Autellix PLAS baseline (``--additional-config`` key ``mars.autellix``).

    Defaults are MARS's baseline settings (design.md §5; MARS preview ``_autellix_*``).
    """

    model_config = ConfigDict(frozen=True, extra="forbid")

    service_thresholds_tokens: tuple[PosInt, ...] = (2048, 8192, 32768)
    """Program attained-service boundaries between arrival levels, tokens, strictly increasing.
    A call whose program has attained ``s`` tokens arrives at the number of thresholds ``<= s``."""
    level_quanta_tokens: tuple[PosInt, ...] = (2048, 1024, 512, 256)
    """Token quantum of each level (one more entry than thresholds); level 0 first."""
    starvation_beta: Annotated[float, Field(gt=0.0)] = 2.0
    """Anti-starvation ratio beta: promote to level 0 when wait / service >= beta (unitless)."""

    @model_validator(mode="after")
    def _check_shapes(self) -> PlasParams:
        thresholds = self.service_thresholds_tokens
        if any(b <= a for a, b in zip(thresholds, thresholds[1:], strict=False)):
            raise ValueError(
                f"mars.autellix.service_thresholds_tokens must be strictly increasing, got "
                f"{list(thresholds)} (from --additional-config mars.autellix)"
            )
        if len(self.level_quanta_tokens) != len(thresholds) + 1:
            raise ValueError(
                f"mars.autellix.level_quanta_tokens needs len(service_thresholds_tokens) + 1 = "
                f"{len(thresholds) + 1} entries, got {len(self.level_quanta_tokens)} "
                f"({list(self.level_quanta_tokens)}); one quantum per level"
            )
        return self

    @property
    def max_level(self) -> int:
        """The lowest-priority level index (``len(level_quanta_tokens) - 1``)."""
        return len(self.level_quanta_tokens) - 1


@dataclass(frozen=True, slots=True)
class PlasProgram:
    """Attained service and accumulated wait of one program (agent session), across its calls.

    Attributes:
        service_tokens: tokens scheduled for the program's finished calls (its attained service).
        wait_tokens: tokens scheduled for other requests while the program's calls waited.
    """

    service_tokens: int = 0
    wait_tokens: int = 0


@dataclass(frozen=True, slots=True)
class PlasCall:
    """PLAS state of one LLM call (one vLLM request).

    Attributes:
        level: MLFQ level, 0 = highest priority.
        quantum_left_tokens: tokens the call may still schedule before demotion.
        service_tokens: tokens scheduled for this call since arrival (or since its last promotion).
        wait_tokens: tokens scheduled for others while this call was not scheduled (same reset).
        program_service_at_arrival_tokens: the program's attained service when the call arrived.
    """

    level: int
    quantum_left_tokens: int
    service_tokens: int = 0
    wait_tokens: int = 0
    program_service_at_arrival_tokens: int = 0


def arrival_level(program_service_tokens: int, params: PlasParams) -> int:
    """Level of a call whose program has attained ``program_service_tokens``. Pure.

    Args:
        program_service_tokens: attained service of the program, tokens (>= 0).
        params: PLAS parameters.

    Returns:
        The number of service thresholds that are ``<= program_service_tokens``
        (0 .. ``params.max_level``).

    Examples:
        >>> p = PlasParams()
        >>> [arrival_level(s, p) for s in (0, 2047, 2048, 8192, 40000)]
        [0, 0, 1, 2, 3]
    """
    return sum(1 for threshold in params.service_thresholds_tokens if program_service_tokens >= threshold)


def level_quantum_tokens(level: int, params: PlasParams, max_num_scheduled_tokens: int) -> int:
    """Token quantum of ``level`` (clamped to the valid levels), capped at the step budget. Pure.

    Args:
        level: MLFQ level; values outside ``0..max_level`` are clamped.
        params: PLAS parameters.
        max_num_scheduled_tokens: vLLM's per-step token budget, tokens (> 0).

    Returns:
        ``min(level_quanta_tokens[level], max_num_scheduled_tokens)``, tokens.
    """
    clamped = max(0, min(level, params.max_level))
    return min(params.level_quanta_tokens[clamped], max_num_scheduled_tokens)


def new_call(program: PlasProgram, params: PlasParams, max_num_scheduled_tokens: int) -> PlasCall:
    """State of a call arriving for ``program``: arrival level from the program's service. Pure."""
    level = arrival_level(program.service_tokens, params)
    return PlasCall(
        level=level,
        quantum_left_tokens=level_quantum_tokens(level, params, max_num_scheduled_tokens),
        program_service_at_arrival_tokens=program.service_tokens,
    )


def step_token_cap(call: PlasCall, params: PlasParams, max_num_scheduled_tokens: int) -> int:
    """Most tokens ``call`` may schedule this step: its remaining quantum (>= 1). Pure.

    A quantum left at 0 (the call was preempted after being charged) is refilled from its level,
    because vLLM cannot allocate zero new tokens.
    """
    if call.quantum_left_tokens <= 0:
        return level_quantum_tokens(call.level, params, max_num_scheduled_tokens)
    return min(call.quantum_left_tokens, max_num_scheduled_tokens)


def on_scheduled(
    call: PlasCall,
    num_scheduled_tokens: int,
    num_remaining_tokens: int,
    params: PlasParams,
    max_num_scheduled_tokens: int,
) -> PlasCall:
    """Charge one step's tokens to ``call`` and demote it if it used its quantum. Pure.

    Region diagram of the call's tokens at this step::

        | computed before | scheduled now (num_scheduled_tokens) | remaining (num_remaining_tokens) |
                          |<-- quantum_left_tokens (cap) ------->|

    Demotion (Autellix §4, MLFQ): if ``num_scheduled_tokens`` reached the step cap
    (:func:`step_token_cap`) and work remains, the level grows by one (at most ``max_level``)
    and the quantum is refilled from the new level.

    Args:
        call: the call's state before the step.
        num_scheduled_tokens: tokens scheduled for the call this step (> 0).
        num_remaining_tokens: tokens still to compute after this step (>= 0; 0 for a call that
            just produced its last known token).
        params: PLAS parameters.
        max_num_scheduled_tokens: vLLM's per-step token budget, tokens.

    Returns:
        The call's state after the step.
    """
    cap = step_token_cap(call, params, max_num_scheduled_tokens)
    quantum_left = call.quantum_left_tokens
    if quantum_left <= 0:
        quantum_left = level_quantum_tokens(call.level, params, max_num_scheduled_tokens)
    # The constructor, not dataclasses.replace: this runs per scheduled request per step.
    service = call.service_tokens + num_scheduled_tokens
    if num_scheduled_tokens >= cap and num_remaining_tokens > 0:
        level = min(call.level + 1, params.max_level)
        return PlasCall(level, level_quantum_tokens(level, params, max_num_scheduled_tokens),
                        service, call.wait_tokens, call.program_service_at_arrival_tokens)
    return PlasCall(call.level, quantum_left - num_scheduled_tokens, service, call.wait_tokens,
                    call.program_service_at_arrival_tokens)


def accrue_wait(call: PlasCall, num_tokens_scheduled_for_others: int) -> PlasCall:
    """Add a step's tokens scheduled for *other* requests to the call's wait. Pure."""
    return PlasCall(call.level, call.quantum_left_tokens, call.service_tokens,
                    call.wait_tokens + num_tokens_scheduled_for_others,
                    call.program_service_at_arrival_tokens)


def should_promote(call: PlasCall, program: PlasProgram, params: PlasParams) -> bool:
    """Autellix anti-starvation test. Pure.

    ``(W_program + W_call) / (S_program + S_call) >= beta`` for a call above level 0, with
    ``W``/``S`` in tokens (see the module docstring). A call with no service yet (``S = 0``) is
    never promoted: its ratio is undefined and its arrival level already reflects its program.

    Examples:
        >>> p = PlasParams()
        >>> should_promote(PlasCall(level=2, quantum_left_tokens=512, service_tokens=100,
        ...                         wait_tokens=100), PlasProgram(900, 1900), p)
        True
        >>> should_promote(PlasCall(level=2, quantum_left_tokens=512, service_tokens=100,
        ...                         wait_tokens=100), PlasProgram(1000, 1900), p)
        False
    """
    if call.level <= 0:
        return False
    service = program.service_tokens + call.service_tokens
    if service <= 0:
        return False
    return (program.wait_tokens + call.wait_tokens) / service >= params.starvation_beta


def promote(call: PlasCall, params: PlasParams, max_num_scheduled_tokens: int) -> PlasCall:
    """Move ``call`` to level 0 with a fresh quantum and zeroed call counters. Pure.

    Zeroing follows the MARS preview (``promote`` in ``_autellix_apply_antistarvation``): the
    call's service since promotion is what the program is charged for on top of its
    service at arrival (see :func:`on_call_finished`).
    """
    return replace(
        call,
        level=0,
        quantum_left_tokens=level_quantum_tokens(0, params, max_num_scheduled_tokens),
        service_tokens=0,
        wait_tokens=0,
    )


def on_call_finished(program: PlasProgram, call: PlasCall) -> PlasProgram:
    """Fold a finished call into its program's attained service and wait. Pure.

    ``service = max(service, service_at_arrival + call service)`` (parallel calls of one program
    each start from the service at their arrival, so the maximum does not double count them);
    ``wait += call wait``.
    """
    service = max(program.service_tokens, call.program_service_at_arrival_tokens + call.service_tokens)
    return PlasProgram(service_tokens=service, wait_tokens=program.wait_tokens + call.wait_tokens)


def running_order_key(call: PlasCall, arrival_time_s: float) -> tuple[int, float]:
    """Sort key for the running queue: level first, then arrival (earliest first). Pure."""
    return (call.level, arrival_time_s)


def victim_key(call: PlasCall, num_blocks: int, arrival_time_s: float) -> tuple[int, int, float]:
    """Preemption victim key: the running request with the **largest** key is preempted. Pure.

    ``(level, KV blocks held, arrival_time)``: lowest priority first, then the largest KV holder,
    then the latest arrival (design.md §5).
    """
    return (call.level, num_blocks, arrival_time_s)
