"""``FcfsScheduler``: stock vLLM scheduling plus MARS telemetry (design.md §5, baseline FCFS).

The reference point of every comparison: first-come-first-served waiting queue, stock preemption
(the last running request, recompute), prefix caching as configured, no retention, no reordering.
It overrides no policy hook, so :class:`MarsBaseScheduler` leaves vLLM's order and victim untouched
and only adds session tracking and the GPU-plane telemetry of design.md §3.

``--scheduler-cls mars_openhands.engine.schedulers.fcfs.FcfsScheduler`` (or
``mars_openhands.engine.FcfsScheduler``). No ``--additional-config`` keys of its own.
"""

from __future__ import annotations

from mars_openhands.engine.schedulers.base import MarsBaseScheduler

__all__ = ["FcfsScheduler"]


class FcfsScheduler(MarsBaseScheduler):
    """Stock vLLM FCFS behaviour with the base class's telemetry; no hook is overridden."""
