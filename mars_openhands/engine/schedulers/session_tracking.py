"""Session bookkeeping in the engine: a turn's arrival opens or updates its session (the previous
tool's duration, the reuse of the previous turn's context), a side request joins it, idle
sessions are forgotten, and a session's attained service is summed on demand.

A mixin of :class:`~.base.MarsBaseScheduler` that reads its ``sessions``
(:class:`~.sessions.SessionTable`), ``tool_durations``, ``retained``, ``params`` and vLLM's
``requests``; the policy reads the result (``SessionState``) in its hooks.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from mars_openhands.policy.admission import ema
from mars_openhands.policy.session import measured_reuse_fraction, tool_sample_at_arrival

if TYPE_CHECKING:
    from vllm.v1.request import Request

    from mars_openhands.policy.session import SessionState
    from mars_openhands.policy.types import TurnMeta

__all__ = ["SessionTracking"]


class SessionTracking:
    """Mixin of :class:`~.base.MarsBaseScheduler`: the sessions' records at a turn's arrival and
    their periodic sweep (module docstring). Mutates the host's session table."""

    def _observe_reuse(self, session: SessionState, request: Request) -> None:
        """The session's next turn arrived: measure how much of the previous turn's context its
        prompt kept (block-hash checkpoints, policy/session.py) and fold it into the session's
        ``reuse_fraction_ema``, which the value model scales its gain by. Mutates ``session``."""
        fraction = measured_reuse_fraction(session.reuse_checkpoints, session.num_context_blocks,
                                           request.block_hashes)
        session.reuse_checkpoints = ()
        if fraction is not None:
            session.reuse_fraction_ema = ema(session.reuse_fraction_ema, fraction,
                                             self.params.retention.reuse_ema_alpha)

    def _on_session_request(self, sid: str, request_id: str, meta: TurnMeta, now: float) -> None:
        session = self.sessions.open(sid, now, meta.session_age_s)
        sample = tool_sample_at_arrival(session, now, meta.prev_tool, meta.prev_tool_s)
        if sample is not None:
            self.tool_durations.observe(*sample)
        session.pending_tool = None
        session.tool_started_s = None
        session.tool_enqueued_s = None
        session.tool_ended = False
        session.last_finish_s = None
        session.last_turn = meta.turn
        session.last_activity_s = now
        session.active_request_ids.add(request_id)

    def _on_side_request(self, sid: str, request_id: str, meta: TurnMeta, now: float) -> None:
        """A side request (``mars_side=1``) joins its session's requests and nothing else: the
        session's tool phase, turn count and retained KV stay as they are."""
        session = self.sessions.open(sid, now, meta.session_age_s)
        session.last_activity_s = now
        session.active_request_ids.add(request_id)

    def _gc_sessions(self, now: float) -> None:
        self._last_gc_s = now
        self.sessions.forget_idle(now, self.params.session_idle_timeout_s, self.retained)

    def session_service_tokens(self, session: SessionState) -> int:
        """Attained service of a session: computed tokens of its finished requests plus those of
        its requests in the engine (work lost to preemption is not counted). O(active requests)."""
        total = session.attained_service_tokens
        for rid in session.active_request_ids:
            request = self.requests.get(rid)
            if request is not None:
                total += request.num_computed_tokens
        return total
