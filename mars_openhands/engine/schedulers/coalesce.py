"""Merged runs: what a scheduler promises so that one ``schedule()`` may stand for ``k`` steps.

Source: the simulator's speed (design.md §9; ``eval/sim.py``, "fast paths"). Past the KV knee
most steps are pure decodes while the waiting requests stay blocked on KV, and every single step
asks vLLM the same question and gets the same "no". The harness's run planner
(:mod:`mars_openhands.engine.harness.runs`) merges ``k`` such steps into one ``schedule()`` call
when it can prove the ``k`` single steps would do the same. vLLM's part it proves itself (the
waiting head stays blocked, nobody finishes or is preempted); a scheduler's own per-step
decisions (its timers, its counters, the clocks it stamps) only the scheduler knows. This module
is the contract between the two, in plain data both ways::

    planner ── run_limits(max_steps, now_s, step_tokens) ──▶ scheduler: RunLimits, or None (not now)
    planner ── prefill_run_chunk_tokens(request) ──────────▶ scheduler: each running prefill's chunk
    planner ── head_rule() ────────────────────────────────▶ scheduler: HeadRule
    harness ── schedule(run=MergedRun(k, last_step_s)) ────▶ scheduler: the k steps, in one call

A scheduler class allows merged runs by implementing :class:`MergesRuns`; our classes do it by
listing :class:`CertifiedRuns` before :class:`~.base.MarsBaseScheduler` (``class
InferceptScheduler(CertifiedRuns, MarsBaseScheduler)``) and overriding the parts their hooks need.
A class that does not (``FcfsScheduler``) is always stepped one step at a time. ``MarsScheduler``
certifies its runs with vLLM's host KV tier (``mars-offload``; GPU-only only with
``merges_gpu_only_runs``): its residency plan must do nothing in any step of a run, which it
proves without reading the plan's clocks (``MarsScheduler._is_residency_quiet``), and its held
turns stay held (:meth:`MergesRuns.run_limits_cover_held`). Stock vLLM schedulers need no
contract: they have no per-step decisions of their own. Nothing here runs in a vLLM server:
``schedule()`` is called there without ``run``.
"""

from __future__ import annotations

import enum
import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

from mars_openhands.engine.schedulers.sessions import SESSION_GC_INTERVAL_S

if TYPE_CHECKING:
    from vllm.v1.request import Request

__all__ = ["CertifiedRuns", "HeadRule", "MergedRun", "MergesRuns", "RunLimits"]

RUN_MARGIN_S = 1e-6
"""A merged run ends this much before a timer tested as ``now - t0 >= interval`` (rounding of
``t0 + interval`` must not let a step past it)."""


@dataclass(frozen=True, slots=True)
class RunLimits:
    """How far a merged run starting now may go, as the scheduler's own decisions allow. Frozen."""

    max_steps: int
    """Most single steps (at most the planner's ``max_steps``) before a per-step counter of the
    policy would change a decision (1: no merged run)."""
    until_s: float
    """Scheduler-clock time by which the run must have ended: the next of the scheduler's timers
    (retained-KV expiry, session GC, periodic re-sort, the policy's own), each acted on at the
    first step past it."""
    max_prefill_step_s: float = math.inf
    """Longest single step a merged chunked-prefill run may hold (a clock the policy reads between
    two steps, e.g. the preview's aging interval)."""


@dataclass(frozen=True, slots=True)
class MergedRun:
    """What one ``schedule()`` call stands for: ``num_steps`` single steps with the waiting queue
    hidden (the caller proved each of them leaves every waiting request waiting). Frozen."""

    num_steps: int
    """Single steps (``k >= 2``); each running prefill gets ``k`` of its chunks."""
    last_step_s: float
    """Scheduler-clock start of the run's last single step: the per-step clocks the scheduler
    stamps (``on_scheduled``'s ``now_s``) get it, as that step would have."""


class HeadRule(enum.Enum):
    """Which evictions keep the blocked waiting head blocked during a merged run (the planner's
    head proof, ``harness/head.py``, has the block arithmetic)."""

    STOCK = "stock"
    """vLLM's own rule: the head's chunk does not depend on its prefix hit, so evicting its hit
    from the end only raises what it needs (stock vLLM; a chunk cap that ignores the hit)."""
    KEEP_HIT = "keep_hit"
    """No block holding one of the head's prefix-cache keys may be evicted."""
    KEEP_HIT_AND_CHUNK = "keep_hit_and_chunk"
    """As ``KEEP_HIT``, and the free blocks stay at or above what the head's unshrunk chunk needs
    (a chunk shrunk to fit the free blocks must stay the one it was refused)."""


@runtime_checkable
class MergesRuns(Protocol):
    """A scheduler that allows merged runs (the harness checks ``isinstance`` once, at build)."""

    def run_limits(self, max_steps: int, now_s: float,
                   step_tokens: int | None = None) -> RunLimits | None:
        """The limits of a merged run of at most ``max_steps`` steps starting at ``now_s``
        (``step_tokens``: tokens each step schedules in all; default one per running request), or
        None when none may start now. Pure."""
        ...

    def prefill_run_chunk_tokens(self, request: Request) -> int | None:
        """The chunk the running prefill ``request`` gets in each of the next single steps, or
        None when it may change after one step. Pure."""
        ...

    def head_rule(self) -> HeadRule:
        """Which evictions keep a blocked waiting head blocked. Pure."""
        ...

    def run_limits_cover_held(self) -> bool:
        """Whether :meth:`run_limits` also proves that no request the scheduler holds outside
        vLLM's queues enters them during the run (else the planner merges no steady run while
        one is held). Pure."""
        ...

    def schedule(self, *args: Any, run: MergedRun | None = None, **kwargs: Any) -> Any:
        """vLLM's ``schedule()``; with ``run``, the run's steps in one call."""
        ...


class CertifiedRuns:
    """Mixin: the :class:`MergesRuns` contract for a :class:`~.base.MarsBaseScheduler` subclass
    whose hooks were checked for merged runs (its docstring says why each is safe).

    Listing it first is the declaration. A run may start when the base scheduler has no per-step
    work due (:meth:`can_merge_run`), ends before its next timer (:meth:`run_until_s`), and the
    class bounds it by its own counters (:meth:`run_max_steps`) and clocks
    (:meth:`run_max_prefill_step_s`); a class that keeps each running prefill's chunk constant
    says so per request (:meth:`prefill_run_chunk_tokens`).

    Reads the base scheduler's state: the inbox, the rejected requests, the window's overflow,
    the waiting order and its last sort, the last session sweep, the retained pool's next expiry.
    """

    def run_limits(self: Any, max_steps: int, now_s: float,
                   step_tokens: int | None = None) -> RunLimits | None:
        """See :meth:`MergesRuns.run_limits`. Pure."""
        if not self.can_merge_run():
            return None
        return RunLimits(self.run_max_steps(max_steps, step_tokens), self.run_until_s(now_s),
                         self.run_max_prefill_step_s())

    def can_merge_run(self: Any) -> bool:
        """Whether the next steps would do no per-step work of the base scheduler's own: nothing
        in the CPU-event inbox (nor listening for more), no request to reject, no admission from
        the window's overflow due, no re-sort of a changed waiting queue due. Pure."""
        return (not self.inbox and not self.inbox.is_listening and not self._rejected
                and not self._is_overflow_admission_due() and not self._is_resort_due())

    def _is_overflow_admission_due(self: Any) -> bool:
        """Whether the next step admits from the window's overflow queue (a slot is free). Pure.

        In a merged run nobody finishes, arrives or is admitted, so the window's count of
        running and waiting requests stays where it is: a full window stays full."""
        return bool(self.overflow) and (self.window_size is None
                                        or len(self.running) + len(self.waiting) < self.window_size)

    def _is_resort_due(self: Any) -> bool:
        """Whether the next step re-sorts the waiting queue because it changed. Pure."""
        return self._has_waiting_key and len(self.waiting) > 1 and self.waiting.is_dirty

    def run_max_steps(self: Any, limit: int, step_tokens: int | None = None) -> int:
        """Most steps (<= ``limit``) before a per-step counter of the policy would change a
        decision (default: none). Pure."""
        return limit

    def run_until_s(self: Any, now_s: float) -> float:
        """Scheduler-clock seconds by which a run must have ended: the next retained-KV expiry,
        the next session GC and, with a waiting order over several requests, the next periodic
        re-sort (unless :meth:`is_waiting_order_timeless`). Pure."""
        t = min(self.retained.next_expiry_s, self._last_gc_s + SESSION_GC_INTERVAL_S - RUN_MARGIN_S)
        if self._has_waiting_key and len(self.waiting) > 1 and not self.is_waiting_order_timeless():
            t = min(t, self._last_waiting_sort_s + self.params.reorder_interval_s - RUN_MARGIN_S)
        return t

    def run_max_prefill_step_s(self: Any) -> float:
        """Longest single step a merged prefill run may hold (default: any). Pure."""
        return math.inf

    def is_waiting_order_timeless(self: Any) -> bool:
        """Whether the waiting key reads no clock and puts the requests vLLM prepends (preempted
        or skipped) where vLLM put them, so the queue is always in key order and the periodic
        re-sort leaves it as it is: a run need not end before one (default: no). Pure."""
        return False

    def run_limits_cover_held(self: Any) -> bool:
        """See :meth:`MergesRuns.run_limits_cover_held` (default: no; a class whose holds are
        released only at its timers, bounded by :meth:`run_until_s`, may say yes). Pure."""
        return False

    def prefill_run_chunk_tokens(self: Any, request: Request) -> int | None:
        """See :meth:`MergesRuns.prefill_run_chunk_tokens` (default: None, no merged prefill
        runs). Pure."""
        return None

    def head_rule(self: Any) -> HeadRule:
        """Default: the class's chunk cap may read the head's hit, so no hit block may go; with
        chunk shrinking the free blocks also stay above the head's unshrunk chunk. A class whose
        cap ignores the hit (or that has none) returns :func:`head_rule_without_hit_cap`. Pure."""
        return HeadRule.KEEP_HIT_AND_CHUNK if self.chunk_shrinking else HeadRule.KEEP_HIT


def head_rule_without_hit_cap(chunk_shrinking: bool) -> HeadRule:
    """The head rule of a class whose chunk cap (if any) ignores the request's prefix hit: a
    waiting request is admitted by vLLM's own allocation of ``min(rest of the prompt, cap)``
    tokens, as under stock vLLM, unless chunks are shrunk to fit (their size then depends on the
    hit and the free blocks). Pure."""
    return HeadRule.KEEP_HIT_AND_CHUNK if chunk_shrinking else HeadRule.STOCK
