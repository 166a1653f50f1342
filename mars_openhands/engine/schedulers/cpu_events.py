"""CPU-plane events in the engine: the gateway's ``tool_enqueued`` / ``tool_start`` / ``tool_end`` /
``session_end`` (design.md §5), applied to the scheduler's sessions and retained KV.

Events are posted (thread-safe) or received by the inbox thread (:class:`~.inbox.CpuEventInbox`)
and applied at the next step or request arrival, oldest first. A mixin of
:class:`~.base.MarsBaseScheduler` that reads its ``inbox``, ``sessions``, ``retained``,
``tool_durations``, ``tool_queue_wait``, ``params``, ``telemetry`` and ``clock``; the policy's
part is its ``refine_retention`` hook (:class:`~.hooks.PolicyHooks`).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from mars_openhands.engine.schedulers.retained import RetainedKv
    from mars_openhands.policy.session import SessionState

__all__ = ["CpuEvents"]



class CpuEvents:
    """Mixin of :class:`~.base.MarsBaseScheduler`: the CPU-plane event inbox and what each event
    kind does to the sessions and their retained KV (module docstring). Mutates."""

    def post_event(self, event: Any) -> None:
        """Thread-safe: queue a CPU-plane event, applied at the next step or request arrival."""
        self.inbox.post(event)

    def _drain_inbox(self, now: float) -> None:
        """Apply up to ``max_inbox_events_per_step`` queued CPU-plane events (posted, or received
        by the inbox thread from ``mars.inbox_addr``), oldest first. Mutates."""
        for event in self.inbox.drain():
            self.on_stream_event(event, now)

    def on_stream_event(self, event: Any, now_s: float | None = None) -> None:
        """Consume one CPU-plane event of this engine's sessions. Mutates.

        ``tool_enqueued`` names the tool and starts its queue wait, ``tool_start`` refines the
        retained KV's TTL with that tool's durations (and feeds the tool queue-wait EMA), ``tool_end``
        records the duration and keeps retained KV for the imminent next turn, ``session_end``
        releases everything of the session. Other kinds are ignored.
        """
        now = self.clock() if now_s is None else now_s
        sid = event.session_id
        if sid is None:
            return
        kind = event.kind
        if kind == "session_end":
            self._on_session_end(sid, now)
            return
        if kind == "tool_start":  # CPU-plane congestion, whichever session it comes from
            self.tool_queue_wait.observe(event.queue_wait_s)
        session = self.sessions.get(sid)
        if session is None:
            return
        session.last_activity_s = now
        if kind == "tool_enqueued":
            session.pending_tool = event.tool_name
            session.tool_enqueued_s = now
        elif kind == "tool_start":
            self._on_tool_start(session, event.tool_name, now)
        elif kind == "tool_end":
            self._on_tool_end(session, event.tool_name, event.duration_s, now)

    def _on_session_end(self, sid: str, now: float) -> None:
        """Release the session's retained KV; forget it unless a request of it is still in."""
        self.release_retained(sid, "session_end", now)
        session = self.sessions.get(sid)
        if session is not None and not session.active_request_ids:
            self.sessions.forget(sid)

    def _on_tool_start(self, session: SessionState, tool_name: str, now: float) -> None:
        """The tool is named: refine the retained KV's TTL with its durations."""
        session.pending_tool = tool_name
        session.tool_started_s = now
        entry = self.retained.get(session.session_id)
        if entry is not None:
            self._apply_refinement(entry, session, tool_name, now)

    def _on_tool_end(self, session: SessionState, tool_name: str, duration_s: float, now: float) -> None:
        """Record the duration (once per tool phase); keep retained KV for the imminent turn."""
        if not session.tool_ended:
            self.tool_durations.observe(tool_name, duration_s)
        session.tool_ended = True
        entry = self.retained.get(session.session_id)
        if entry is not None:
            self.retained.extend_expiry(entry, now + self.params.retention.imminent_grace_s)

    def _apply_refinement(self, entry: RetainedKv, session: SessionState, tool: str, now: float) -> None:
        decision = self.refine_retention(entry, session, tool, now)
        if decision is None:
            return
        if decision.ttl_s <= 0:
            self.release_retained(entry.session_id, "tool_start:cut", now)
            return
        entry.expires_s = now + decision.ttl_s
        entry.value_s = decision.value_s
        entry.reason = decision.reason
        self.retained.update_next_expiry()
        if self.telemetry.enabled:
            self.telemetry.kv_retained(entry.request_id, entry.session_id, entry.turn,
                                       entry.num_blocks, decision.ttl_s, decision.reason)
