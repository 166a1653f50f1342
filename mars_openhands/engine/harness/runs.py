"""The run planner: how many single steps the next ``schedule()`` stands for, and when they end.

Source: the simulator's speed (design.md §9; ``eval/sim.py``, "fast paths"). Every merged run is
exact: the ``k`` single steps it stands for would schedule the same requests, take the same
tokens and leave the same KV state, and it ends when the last of them would.

Kinds of run (:class:`RunKind`)::

    single           one step; its time is taken after schedule() (the scheduler decides it)
    steady           k pure-decode steps while nothing waits (vLLM's draft-token path); its time
                     is k steps at the mean context (exact for a linear model)
    blocked          k pure-decode steps while every waiting request stays blocked on KV: one
                     schedule() with the waiting queue hidden; its end is the single steps' chain
    prefill          k chunked-prefill steps (stock vLLM's long-prefill cap) while nothing waits
    blocked-prefill  the same while the waiting requests stay blocked, queue hidden

What one merged run passes through (who asks whom, with what)::

    Simulator._engine_step                                                    eval/sim.py
      └─ InprocEngine.plan_run(max_steps, now_s, bound_s, timer)                inproc_engine.py
           ├─ the engine's facts: steady length, chunks, the probe step         inproc_engine.py
           ├─ scheduler.run_limits(k, now_s, step_tokens) -> RunLimits         schedulers/coalesce.py
           ├─ plan_exact_run(...): chain of step ends <= bound, then           here
           │     the head proof (largest k that keeps the waiting head blocked) head.py
           └─ -> RunPlan(kind, num_steps, step_ends_s, step_tokens)
      └─ InprocEngine.schedule(plan)
           └─ with fast_paths.hidden_waiting(s): s.schedule(run=MergedRun(k, last_step_s))

A run never crosses an event the simulator says may change the engine's input (``bound_s``: an
arrival, a tool's end, an admission tick while a session waits for admission) nor, with the
waiting queue hidden, a timer of the scheduler's own (``RunLimits.until_s``).
"""

from __future__ import annotations

import enum
import itertools
import math
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import Protocol

__all__ = [
    "SINGLE_STEP",
    "RunKind",
    "RunKv",
    "RunPlan",
    "StepTimer",
    "decode_run_step_time_s",
    "decode_step_durations",
    "plan_exact_run",
    "steady_run",
]


class StepTimer(Protocol):
    """Step-time model: seconds of one engine step (H4's ``StepTimeModel`` satisfies it)."""

    def step_time_s(
        self, prefill: Sequence[tuple[int, int]] = (), decode_context_tokens: Sequence[int] = ()
    ) -> float:
        """Seconds for one step with these prefill ``(new, cached)`` chunks and decode contexts."""
        ...


class RunKind(enum.Enum):
    """What a :class:`RunPlan` stands for (module docstring)."""

    SINGLE = "single"
    STEADY = "steady"
    BLOCKED = "blocked"
    PREFILL = "prefill"
    BLOCKED_PREFILL = "blocked-prefill"


@dataclass(frozen=True, slots=True)
class RunPlan:
    """The next ``schedule()``: ``num_steps`` single steps of one kind. Frozen.

    Attributes:
        kind: the run's kind.
        num_steps: single steps (``k``; 1 for a single step).
        step_ends_s: end time of each single step (exact runs), seconds on the caller's clock; a
            steady run has its end only; empty for a single step (timed after it is scheduled).
        step_tokens: tokens each running request takes per step, in the running order (exact
            runs; for :class:`RunKv`).
    """

    kind: RunKind
    num_steps: int = 1
    step_ends_s: tuple[float, ...] = ()
    step_tokens: tuple[int, ...] = ()

    @property
    def end_s(self) -> float | None:
        """When the run ends, or None (a single step: timed after ``schedule()``)."""
        return self.step_ends_s[-1] if self.step_ends_s else None

    @property
    def is_exact(self) -> bool:
        """It has each single step's end (every run but a steady one timed at the mean context)."""
        return self.num_steps > 1 and len(self.step_ends_s) == self.num_steps

    @property
    def is_waiting_hidden(self) -> bool:
        """The waiting queue is hidden for it (a blocked run)."""
        return self.kind in (RunKind.BLOCKED, RunKind.BLOCKED_PREFILL)

    @property
    def is_prefill_run(self) -> bool:
        """It stands for chunked-prefill steps (the step budget is scaled)."""
        return self.kind in (RunKind.PREFILL, RunKind.BLOCKED_PREFILL)

    @property
    def last_step_s(self) -> float:
        """Start of its last single step (an exact run of two steps or more)."""
        return self.step_ends_s[-2]


SINGLE_STEP = RunPlan(RunKind.SINGLE)
"""One step, nothing merged."""


def decode_run_step_time_s(
    step_time_s: Callable[[Sequence[tuple[int, int]], Sequence[int]], float],
    decode_context_tokens: Sequence[int], num_decode_tokens: int,
) -> float:
    """Modelled time of ``k`` consecutive pure-decode steps, seconds. Pure.

    Decode time is close to linear in the context, so ``k`` steps take ``k`` times the step at
    the mean context (each request's context grows by one token per step)::

        t = k * step(contexts + (k - 1) / 2)

    Args:
        step_time_s: ``(prefill, decode_context_tokens) -> seconds`` of one step.
        decode_context_tokens: contexts at the first of the ``k`` steps.
        num_decode_tokens: ``k`` >= 1.
    """
    k = num_decode_tokens
    if k == 1:
        return step_time_s((), decode_context_tokens)
    mid = (k - 1) // 2
    return k * step_time_s((), [c + mid for c in decode_context_tokens])


def steady_run(now_s: float, k: int, contexts: Sequence[int], timer: StepTimer,
               bound_s: float) -> RunPlan:
    """A steady decode run of at most ``k`` steps that ends by ``bound_s``, timed at the mean
    context (:func:`decode_run_step_time_s`); shortened when it would pass the bound. Pure.

    Args:
        now_s: its start.
        k: steps the engine allows (>= 2).
        contexts: each running request's context at the first step, tokens.
        timer: the step-time model.
        bound_s: the next event that may change the engine's input.
    """
    dt_s = decode_run_step_time_s(timer.step_time_s, contexts, k)
    gap_s = bound_s - now_s
    if dt_s > gap_s:
        k = max(1, min(k - 1, int(gap_s / (dt_s / k))))
        dt_s = decode_run_step_time_s(timer.step_time_s, contexts, k)
    if k <= 1:
        return SINGLE_STEP
    return RunPlan(RunKind.STEADY, k, (now_s + dt_s,))


def decode_step_durations(contexts: Sequence[int], timer: StepTimer) -> Iterator[float]:
    """Seconds of each next pure-decode step (step ``i``: every context ``+ i``), lazily. Pure.

    A timer with ``decode_step_time_s(num_decode, sum of contexts)`` (the same value, by shape)
    is asked that way: no list of contexts per step."""
    by_shape = getattr(timer, "decode_step_time_s", None)
    num_decode, total = len(contexts), sum(contexts)
    i = 0
    while True:
        yield (by_shape(num_decode, total + i * num_decode) if by_shape is not None
               else timer.step_time_s((), [c + i for c in contexts]))
        i += 1


def plan_exact_run(kind: RunKind, now_s: float, max_steps: int, bound_s: float,
                   step_durations: Iterable[float], keep_head_blocked: Callable[[int], int] | None,
                   step_tokens: Sequence[int], max_step_s: float = math.inf) -> RunPlan | None:
    """The longest exact run of at most ``max_steps`` single steps, or None (one step at most).

    Its end is the single steps' chain of additions (``t += duration_i``, as the simulator adds
    one step's time after another), cut before the first step that would end past ``bound_s``
    or last ``max_step_s`` or more; then, when requests wait, cut to what keeps the waiting head
    blocked. Pure (but for the head proof's memo).

    Args:
        kind: the run's kind.
        now_s: its start.
        max_steps: steps the engine and the scheduler allow.
        bound_s: the time it must end by.
        step_durations: seconds of each single step, in order (lazily; at least ``max_steps``).
        keep_head_blocked: the waiting head's proof, ``k -> largest k' <= k`` that keeps it
            blocked (:class:`~.head.HeadProof`); None when nothing waits.
        step_tokens: tokens each running request takes per step (for :class:`RunKv`).
        max_step_s: longest single step allowed (``RunLimits.max_prefill_step_s``).
    """
    ends: list[float] = []
    t_s = now_s
    for duration in itertools.islice(step_durations, max(0, max_steps)):
        t_next = t_s + duration
        if t_next > bound_s or t_next - t_s >= max_step_s:
            break
        ends.append(t_next)
        t_s = t_next
    k = len(ends)
    if k > 1 and keep_head_blocked is not None:
        k = keep_head_blocked(k)
    if k <= 1:
        return None
    return RunPlan(kind, k, tuple(ends[:k]), tuple(step_tokens))


@dataclass(frozen=True, slots=True)
class RunKv:
    """The used KV blocks a merged run leaves after each of its single steps (a run frees
    nothing, and each running request holds the blocks of its computed tokens), for an
    admission tick that falls inside it. Frozen.

    Attributes:
        step_ends_s: the run's single steps' end times.
        used_blocks: used blocks before the run.
        requests: each running request's (computed tokens, tokens per step, blocks held).
        block_size: tokens per block.
    """

    step_ends_s: tuple[float, ...]
    used_blocks: int
    requests: tuple[tuple[int, int, int], ...]
    block_size: int

    def used_after(self, num_steps: int) -> int:
        """Used blocks after the first ``num_steps`` single steps. Pure."""
        bs = self.block_size
        return self.used_blocks + sum(max(0, -(-(c + num_steps * n) // bs) - held)
                                      for c, n, held in self.requests)
