"""The scheduler's GPU-plane telemetry at step boundaries: a request's first schedule (its queue
delay) and first token, and the rate-limited ``engine_step`` snapshot of KV and queue counts
(design.md §5; the events themselves: :mod:`mars_openhands.engine.telemetry`).

A mixin of :class:`~.base.MarsBaseScheduler` that reads its ``telemetry``, ``req_state``,
``queue_delay`` and KV counts (:class:`~.integrity.KvIntegrity`).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from mars_openhands.engine import seams

if TYPE_CHECKING:
    from mars_openhands.engine.schedulers.request_state import RequestState

__all__ = ["StepTelemetry"]


class StepTelemetry:
    """Mixin of :class:`~.base.MarsBaseScheduler`: step-boundary telemetry (module docstring)."""

    def _on_first_scheduled(self, rid: str, state: RequestState, num_tokens: int, now: float) -> None:
        delay = now - state.arrival_s
        self.queue_delay.observe(delay)
        if self.telemetry.enabled:
            request = self.requests.get(rid)
            # vLLM already advanced num_computed_tokens by this step's tokens: the rest was a hit.
            cached = request.num_computed_tokens - num_tokens if request is not None else 0
            self.telemetry.first_scheduled(rid, state.session_id, state.meta.turn, delay,
                                           max(0, cached))

    def _first_tokens(self, outputs: Any) -> None:
        now = self.clock()
        for eco in outputs.values():
            for o in eco.outputs:
                if not o.new_token_ids:
                    continue
                state = self.req_state.get(o.request_id)
                if state is not None and state.first_token_s is None:
                    state.first_token_s = now
                    self.telemetry.first_token(o.request_id, state.session_id, state.meta.turn,
                                               now - state.arrival_s)

    def _emit_engine_step(self) -> None:
        free, retained, used = self.kv_block_counts()
        num_running, num_waiting = self.get_request_counts()
        self._last_step_counts = (free, retained, used, num_running, num_waiting)
        self.telemetry.engine_step(
            num_gpu_blocks=seams.blocks.num_gpu_blocks(self), num_used_blocks=used,
            num_free_blocks=free, num_retained_blocks=retained, num_running=num_running,
            num_waiting=num_waiting, num_host_blocks=self.num_host_blocks,
        )

    def _is_idle_snapshot_due(self) -> bool:
        """Whether this step leaves the engine idle (nothing running or waiting) with KV counts
        other than the last ``engine_step`` showed. Such a snapshot is emitted whatever the rate
        limit, so an engine's last ``engine_step`` is its idle state (0 used blocks, what is still
        retained), not its last busy step 1-100 ms earlier. O(retained blocks), idle steps only."""
        if self.running or self.waiting or not self.telemetry.emits_steps:
            return False
        num_running, num_waiting = self.get_request_counts()
        if num_running or num_waiting:
            return False
        free, retained, used = self.kv_block_counts()
        return self._last_step_counts != (free, retained, used, 0, 0)
