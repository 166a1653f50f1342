"""The host tier's copies as two FIFO streams sharing the PCIe link, on a caller's clock. Pure
Python (no vLLM).

Mental model: one copy stream per direction (GPU→host stores, host→GPU loads). A stream copies
its jobs one after the other at its one-way bandwidth while the other stream is idle; while both
copy, each gets half of the duplex bandwidth (at most its one-way rate). Time only moves when the
caller says so (:meth:`CopyStreams.advance`), so the same model runs on the simulator's virtual
clock and the emulated executor's scaled wall clock. Jobs finish at exact fluid times; the engine
sees a finish at the end of the step it falls in (vLLM's ``get_finished`` runs once per step).

A step's slowdown (:func:`slowed_step_s`): its work runs ``slowdown`` times slower while a copy is
in flight::

    copies busy for c seconds after the step starts, work w seconds, slowdown s:
        c >= s·w   ->  t = s·w               (the whole step overlaps copies)
        c <  s·w   ->  t = c + (w - c / s)   (slow until the copies end, then full speed)
"""

from __future__ import annotations

import copy
import math
from collections import deque
from dataclasses import dataclass, field
from enum import Enum

__all__ = ["CopyDone", "CopyStreams", "Direction", "slowed_step_s"]

GB = 1e9


class Direction(Enum):
    """A copy's direction."""

    STORE = "store"
    """GPU → host (vLLM ``submit_store``)."""
    LOAD = "load"
    """Host → GPU (vLLM ``submit_load``)."""


@dataclass(frozen=True, slots=True)
class CopyDone:
    """A finished copy: its job id, bytes, direction, and submit / finish times (seconds)."""

    job_id: int
    num_bytes: int
    direction: Direction
    submit_s: float
    done_s: float


@dataclass
class _Job:
    job_id: int
    num_bytes: int
    submit_s: float
    remaining_bytes: float


@dataclass
class CopyStreams:
    """Two copy streams (store, load) over one link; see the module docstring.

    Args:
        d2h_bytes_per_s: store bandwidth alone, bytes/s.
        h2d_bytes_per_s: load bandwidth alone, bytes/s.
        duplex_bytes_per_s: both directions' sum while both copy, bytes/s.
    """

    d2h_bytes_per_s: float
    h2d_bytes_per_s: float
    duplex_bytes_per_s: float
    now_s: float = 0.0
    queues: dict[Direction, deque[_Job]] = field(
        default_factory=lambda: {Direction.STORE: deque(), Direction.LOAD: deque()})
    done: list[CopyDone] = field(default_factory=list)
    """Finished copies not yet taken (:meth:`take_done`)."""

    def submit(self, direction: Direction, job_id: int, num_bytes: int, now_s: float) -> None:
        """Queue a copy at ``now_s`` (after advancing to it). Mutates."""
        self.advance(now_s)
        self.queues[direction].append(_Job(job_id, num_bytes, self.now_s, float(num_bytes)))

    def is_busy(self) -> bool:
        """True while a copy is queued or running. Pure."""
        return any(self.queues.values())

    def pending(self, direction: Direction) -> int:
        """Copies queued or running in ``direction``. Pure."""
        return len(self.queues[direction])

    def _rates(self) -> dict[Direction, float]:
        active = [d for d, q in self.queues.items() if q]
        alone = {Direction.STORE: self.d2h_bytes_per_s, Direction.LOAD: self.h2d_bytes_per_s}
        if len(active) < 2:
            return {d: alone[d] for d in active}
        return {d: min(alone[d], self.duplex_bytes_per_s / 2) for d in active}

    def advance(self, to_s: float, *, until_job: int | None = None) -> None:
        """Run the copies up to ``to_s`` (a time already passed only settles copies due by now);
        with ``until_job``, run until that job finishes instead. Mutates."""
        while True:
            rates = self._rates()
            if not rates:
                self.now_s = max(self.now_s, to_s)
                return
            dt = min(self.queues[d][0].remaining_bytes / r for d, r in rates.items())
            is_partial = until_job is None and self.now_s + dt > to_s
            if is_partial:
                dt = max(0.0, to_s - self.now_s)
            for d, r in rates.items():
                self.queues[d][0].remaining_bytes -= r * dt
            self.now_s = to_s if is_partial else self.now_s + dt
            if self._pop_finished(until_job) or is_partial:
                return

    def _pop_finished(self, until_job: int | None) -> bool:
        """Move the streams' finished heads to :attr:`done`; True if ``until_job`` was one."""
        is_target_done = False
        for d, q in self.queues.items():
            # Half a byte left is a finished copy (float rounding of bytes / rate).
            if q and q[0].remaining_bytes <= 0.5:
                job = q.popleft()
                self.done.append(CopyDone(job.job_id, job.num_bytes, d, job.submit_s, self.now_s))
                is_target_done = is_target_done or job.job_id == until_job
        return is_target_done

    def take_done(self) -> list[CopyDone]:
        """The copies finished so far, once each. Mutates."""
        out, self.done = self.done, []
        return out

    def busy_until_s(self) -> float:
        """When every queued copy will have finished (``now_s`` if none). Pure."""
        probe = copy.deepcopy(self)
        while probe.is_busy():
            probe.advance(probe.next_done_s())
        return probe.now_s

    def next_done_s(self) -> float:
        """When the next queued copy finishes (``inf`` if none). Pure."""
        if not self.is_busy():
            return math.inf
        return min(self.now_s + q[0].remaining_bytes / r for q, r in
                   ((self.queues[d], r) for d, r in self._rates().items()))

    def done_s(self, job_id: int) -> float:
        """When copy ``job_id`` finishes (``now_s`` if it is not queued). Pure."""
        if not any(j.job_id == job_id for q in self.queues.values() for j in q):
            return self.now_s
        probe = copy.deepcopy(self)
        probe.advance(probe.now_s, until_job=job_id)
        return probe.now_s


def slowed_step_s(work_s: float, copies_busy_s: float, slowdown: float) -> float:
    """Seconds a step of ``work_s`` takes when copies stay in flight ``copies_busy_s`` after its
    start and slow its work ``slowdown`` times (module docstring). Pure.

    >>> slowed_step_s(0.01, 0.0, 2.0), slowed_step_s(0.01, 1.0, 2.0), slowed_step_s(0.01, 0.004, 2.0)
    (0.01, 0.02, 0.012)
    """
    if work_s <= 0.0 or copies_busy_s <= 0.0:
        return work_s
    if copies_busy_s >= slowdown * work_s:
        return slowdown * work_s
    return copies_busy_s + (work_s - copies_busy_s / slowdown)
