"""KV retention, the scheduler's side: pin a finishing turn's blocks for its session's next turn,
release them (resumed, expired, reclaimed, ...) and reclaim them when an allocation fails.

Source: design.md §3 (retention) and §4 (reclaim before preemption). The retained entries and
their counters live in :class:`~.retained.RetainedKvPool`; whether and how long to keep a turn's
KV is the policy's (``retention_decision``, ``refine_retention``, ``can_release_expired``,
``can_reclaim_for``: :class:`~.hooks.PolicyHooks`). This module is the machinery between the
two: a mixin of :class:`~.base.MarsBaseScheduler` that reads its ``retained``,
``kv_pool_peers``, ``sessions``, ``req_state``, ``telemetry`` and ``clock`` (set up by the
base's ``__init__``).

Where retention is decided: a turn finishes -> ``MarsBaseScheduler._free_blocks`` ->
:meth:`KvRetention._maybe_retain` -> the policy's ``retention_decision`` (a TTL and a value);
the next step past the TTL -> :meth:`KvRetention._expire_retained`; an allocation fails ->
vLLM's ``allocate_slots`` wrapper (``seams.blocks.wrap_allocate_slots``) ->
:meth:`KvRetention._reclaim_for` -> the entry of another session first in the policy's order
(``reclaim_key``; by default the lowest value per block) among those ``can_reclaim_for`` allows.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from mars_openhands.engine import seams
from mars_openhands.engine.schedulers.retained import RetainedKv

if TYPE_CHECKING:
    from vllm.v1.request import Request

    from mars_openhands.engine.schedulers.request_state import RequestState
    from mars_openhands.policy.session import SessionState

__all__ = ["KvRetention"]



class KvRetention:
    """Mixin of :class:`~.base.MarsBaseScheduler`: retained KV's pin, release, expiry and reclaim
    (module docstring). Mutates the host's retained pool and vLLM's block references.

    ``kv_pool_peers``: the schedulers whose retained KV a failed allocation here may reclaim,
    this one included; ``[self]`` unless several schedulers share one KV block pool (the
    simulator's pooled-KV bound, :mod:`mars_openhands.engine.harness.kv_pool`), where a block
    pinned by one replica is a block every replica could use."""

    kv_pool_peers: list[KvRetention]
    _allocate_wrapper: seams.blocks.AllocateSlotsWrapper

    def _release_aborted_after_finish(self, request_ids: str | list[str]) -> None:
        """An abort of a request that already finished (its final token raced the client's
        disconnect; vLLM ignores it): its client is gone, so the KV retained for its session's
        next turn is released now (reason ``"aborted"``) instead of at its TTL."""
        ids = {request_ids} if isinstance(request_ids, str) else set(request_ids)
        for sid, entry in list(self.retained.items()):
            if entry.request_id in ids and entry.request_id not in self.requests:
                self.release_retained(sid, "aborted")

    def _maybe_retain(
        self, request: Request, state: RequestState, session: SessionState, now: float
    ) -> int:
        decision = self.retention_decision(request, session, now)
        if decision is None or decision.ttl_s <= 0:
            return 0
        blocks = seams.blocks.cached_blocks(seams.blocks.request_blocks(self, request.request_id))
        if not blocks:
            return 0
        if session.session_id in self.retained:
            self._measure_reuse(self.retained[session.session_id], request.request_id)
            self.release_retained(session.session_id, "resumed", now)
        seams.blocks.pin_finishing_request_blocks(self, request.request_id, blocks)
        for peer in self.kv_pool_peers:  # any of them may now reclaim this entry
            peer._allocate_wrapper.enable()
        self.retained.add(RetainedKv(
            session.session_id, request.request_id, state.meta.turn, blocks,
            len(blocks) * self.block_size, now, now + decision.ttl_s, decision.value_s,
            decision.reason,
        ))
        if self.telemetry.enabled:
            self.telemetry.kv_retained(request.request_id, session.session_id, state.meta.turn,
                                       len(blocks), decision.ttl_s, decision.reason)
        return len(blocks)

    def release_retained(self, session_id: str, reason: str, now_s: float | None = None) -> int:
        """Unpin a session's retained KV (blocks return to the prefix-cache LRU). Mutates.

        Args:
            session_id: the session.
            reason: a ``KvReleased.reason`` ("resumed", "expired", "reclaimed", "session_end",
                "tool_start:cut", "shutdown", "reset").
            now_s: scheduler clock (default: now).

        Returns:
            Blocks released (0 when nothing was retained).
        """
        entry = self.retained.pop(session_id)
        if entry is None:
            return 0
        seams.blocks.free_pinned(self, entry.blocks)
        if not any(peer.retained for peer in self.kv_pool_peers):
            for peer in self.kv_pool_peers:
                peer._allocate_wrapper.disable()
        reused = self.retained.record_release(entry, reason)
        if self.telemetry.enabled:
            now = self.clock() if now_s is None else now_s
            self.telemetry.kv_released(session_id, entry.num_blocks, reason, now - entry.retained_s,
                                       reused)
        return entry.num_blocks

    def reclaim(self, session_id: str, now_s: float | None = None) -> int:
        """Release a session's retained KV for another's allocation (reason "reclaimed") and
        count it in :attr:`num_reclaimed_blocks`. Returns the blocks released. Mutates."""
        released = self.release_retained(session_id, "reclaimed", now_s)
        self.retained.num_reclaimed_blocks += released
        return released

    @property
    def num_reclaimed_blocks(self) -> int:
        """Retained blocks released because an allocation failed (:meth:`reclaim`)."""
        return self.retained.num_reclaimed_blocks

    @property
    def num_released_blocks(self) -> int:
        """Retained blocks released for any reason but shutdown (resolved retentions)."""
        return self.retained.num_released_blocks

    @property
    def num_reused_blocks(self) -> int:
        """Of those, blocks the session's next turn actually reused: the retention hit ratio is
        ``num_reused_blocks / num_released_blocks`` (tokens: times ``block_size``)."""
        return self.retained.num_reused_blocks

    def _measure_reuse(self, entry: RetainedKv, request_id: str) -> int:
        """Blocks of ``entry`` that ``request_id`` (the session's next turn, just allocated, or
        its finishing turn) holds (:meth:`RetainedKvPool.measure_reuse`). Mutates ``entry``."""
        return self.retained.measure_reuse(
            entry, seams.blocks.request_blocks(self, request_id))

    def _expire_retained(self, now: float) -> None:
        """Release every retained entry past its expiry, within the step it expires in, unless
        its own session's next turn waits (or ``can_release_expired`` says no): those are held
        and re-checked every step, O(held), without delaying anyone else's expiry."""
        pool = self.retained
        for sid in pool.expiry_candidates(now):
            if not pool.is_expired(sid, now):
                continue
            session = self.sessions.get(sid)
            if (session is not None and session.active_request_ids) or not self.can_release_expired(
                    pool[sid], now):
                pool.hold_expired(sid)  # the next turn is waiting: keep until scheduled
                continue
            self.release_retained(sid, "expired", now)
        pool.update_next_expiry()

    def join_kv_pool_of(self, owner: KvRetention) -> None:
        """Join ``owner``'s :attr:`kv_pool_peers` (its schedulers share one KV block pool,
        :func:`~mars_openhands.engine.seams.blocks.share_block_pool`): from now on a failed
        allocation on any of them may take any one's pinned KV, in the requester's reclaim
        order, as a single engine of the pool's size would. One list object for the whole pool.
        Mutates."""
        self.kv_pool_peers = owner.kv_pool_peers
        self.kv_pool_peers.append(self)

    def adopt_session(self, peer: KvRetention, session_id: str) -> None:
        """Take ``session_id`` over from ``peer``, a scheduler of the same shared KV pool that
        served its previous turn: its record (and program) and its retained KV move here, the
        pins with them (the blocks stay where they are, in the one pool), as one engine of the
        pool's size would keep them. Subclasses move their own per-session state too. Mutates
        both schedulers."""
        record = peer.sessions.forget(session_id)
        if record is not None:
            self.sessions.adopt(record)
        entry = peer.retained.pop(session_id)
        if entry is not None:
            self.retained.add(entry)

    def _adopt_from_pool(self, session_id: str) -> None:
        """A request of a session this scheduler has no record of: when a peer of a shared KV
        pool holds it, idle there (its previous turn done), it moves here
        (:meth:`adopt_session`). O(peers)."""
        for peer in self.kv_pool_peers:
            if peer is not self and session_id in peer.sessions:
                if not peer.sessions[session_id].active_request_ids:
                    self.adopt_session(peer, session_id)
                return

    def retention_owner(self, entry: RetainedKv) -> KvRetention:
        """The scheduler among :attr:`kv_pool_peers` that holds ``entry`` (this one when the
        KV pool is not shared): policy hooks read the entry's session from its owner's
        ``sessions``. Pure."""
        for peer in self.kv_pool_peers:
            if peer.retained.get(entry.session_id) is entry:
                return peer
        return self

    def _reclaimable_blocks(self, request: Request) -> int:
        """Retained blocks a failed allocation of ``request`` could get back: every other
        session's entry on this scheduler and on its :attr:`kv_pool_peers`. Pure."""
        own = self.req_state.get(request.request_id)
        sid = own.session_id if own else None
        return sum(p.retained.reclaimable_blocks(sid) for p in self.kv_pool_peers)

    def _reclaim_for(self, request: Request) -> bool:
        """Allocation for ``request`` failed: release the retained entry of another session that
        comes first in the policy's reclaim order (``reclaim_key``; default lowest value first),
        on this scheduler or on one of its :attr:`kv_pool_peers` (a shared KV pool: the entry
        first in this scheduler's order among them all). Returns True if something was released
        (vLLM then retries the allocation).

        Progress guarantee: with nothing running, every other session's entry is reclaimable
        whatever ``can_reclaim_for`` says (otherwise waiting turns whose sessions all hold
        retained KV, kept because those turns wait, would deadlock the engine)."""
        peers = [p for p in self.kv_pool_peers if p.retained]
        if not peers:
            return False
        own = self.req_state.get(request.request_id)
        sid = own.session_id if own else None
        now = self.clock()
        is_stuck = not self.running

        def key(e: RetainedKv) -> Any:
            return self.reclaim_key(e, request, now)

        victims = [(peer, victim) for peer in peers  # one peer (itself) unless the pool is shared
                   if (victim := peer.retained.reclaim_victim(
                       sid, lambda e: is_stuck or self.can_reclaim_for(e, request, now), key))]
        if not victims:
            return False
        owner, victim = min(victims, key=lambda pv: key(pv[1]))
        owner.reclaim(victim.session_id)
        return True
