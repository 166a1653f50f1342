"""``RetainedKvPool``: the KV blocks of finished turns pinned for their sessions' next turns.

Mental model (design.md §3 step 4; MARS §4.3 "retain only when warm resumption yields a latency
benefit"): at the end of a non-final turn a policy may keep the turn's cached blocks referenced
(one extra reference per block, a *pin*) so that the session's next turn hits them instead of
re-prefilling. Each session holds at most one entry. An entry ends in exactly one way, named by
its ``KvReleased.reason``: the next turn took it ("resumed"), it expired, an allocation reclaimed
it, the session ended, a refinement cut it, or the engine shut down.

This module is the bookkeeping only: which session holds which blocks until when, the earliest
expiry still to act on, the entries held past their expiry, the reclaim choice and the release
counters. It imports no vLLM: pinning and freeing the blocks themselves is the scheduler's
(:mod:`mars_openhands.engine.seams`), and the pool takes block reference counts as callables.

Life of an entry (scheduler clock, seconds)::

    retained_s ─────────────── expires_s ──── (held while its next turn waits) ──▶ released
        add()        refine / extend_expiry()      is_held_expired()                 pop()
"""

from __future__ import annotations

import itertools
import operator
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

from mars_openhands.policy.retention import reclaim_order_key

_BLOCK_ID = operator.attrgetter("block_id")

__all__ = ["RetainedKv", "RetainedKvPool"]


@dataclass(slots=True)
class RetainedKv:
    """KV blocks of a finished turn pinned for the session's next turn."""

    session_id: str
    request_id: str
    turn: int | None
    blocks: list[Any]
    """vLLM ``KVCacheBlock`` objects (anything with ``block_id``), one pin each."""
    num_tokens: int
    retained_s: float
    expires_s: float
    value_s: float
    reason: str
    extra: dict[str, Any] = field(default_factory=dict)
    """Free slot for subclasses (e.g. the baseline's own bookkeeping)."""

    @property
    def num_blocks(self) -> int:
        """Blocks pinned."""
        return len(self.blocks)


class RetainedKvPool(Mapping[str, RetainedKv]):
    """Session id -> its :class:`RetainedKv`, with the expiry timer and the release counters.

    A read-only mapping to its users (``sid in pool``, ``pool[sid]``, ``pool.items()``); it is
    changed only through :meth:`add`, :meth:`pop`, :meth:`extend_expiry` and the expiry methods,
    which keep :attr:`next_expiry_s` right. Owned by one scheduler; not thread-safe (the expiry
    watcher thread only reads :attr:`next_expiry_s`, a float rewritten whole).
    """

    def __init__(self) -> None:
        self._entries: dict[str, RetainedKv] = {}
        self._is_each_block_pinned_once: bool | None = True
        """Whether no block is in two entries (None: not known since a pop after False)."""
        self._pinned_ids: set[int] | None = set()
        """Every pinned block id while :attr:`_is_each_block_pinned_once` is True (kept by
        :meth:`add` and :meth:`pop` in C-level set passes over the one entry), else None."""
        self.held_expired: dict[str, None] = {}
        """Sessions whose entry expired but is kept: their next turn waits (or the policy's
        ``can_release_expired`` said no). Re-checked every step, in the order they were held (a dict
        as an ordered set: a set's order follows the per-process string hash, so runs differed
        between processes)."""
        self.next_expiry_s = float("inf")
        """Earliest expiry still to act on among the entries not held past theirs."""
        self.num_reclaimed_blocks = 0
        """Blocks released because an allocation failed (or a policy paused their session)."""
        self.num_released_blocks = 0
        """Retained blocks released for any reason but shutdown (resolved retentions)."""
        self.num_reused_blocks = 0
        """Of those, blocks the session's next turn actually reused: the retention hit ratio is
        ``num_reused_blocks / num_released_blocks`` (tokens: times ``block_size``)."""

    # ------------------------------------------------------------------ mapping (read-only)
    def __getitem__(self, session_id: str) -> RetainedKv:
        return self._entries[session_id]

    def __iter__(self) -> Iterator[str]:
        return iter(self._entries)

    def __len__(self) -> int:
        return len(self._entries)

    def __contains__(self, session_id: object) -> bool:
        return session_id in self._entries

    def get(self, session_id: str, default: Any = None) -> Any:
        """The session's entry, else ``default``. Pure."""
        return self._entries.get(session_id, default)

    # ------------------------------------------------------------------ changes
    def add(self, entry: RetainedKv) -> None:
        """Record a new entry (the caller has pinned its blocks). Mutates.

        Raises:
            ValueError: the session already holds an entry (release it first).
        """
        if entry.session_id in self._entries:
            raise ValueError(f"session {entry.session_id!r} already holds retained KV "
                             f"(request {self._entries[entry.session_id].request_id}); release it first")
        self._entries[entry.session_id] = entry
        if self._pinned_ids is not None:
            num_before = len(self._pinned_ids)
            self._pinned_ids.update(map(_BLOCK_ID, entry.blocks))  # one C-level pass
            if len(self._pinned_ids) != num_before + len(entry.blocks):  # a block pinned twice
                self._is_each_block_pinned_once, self._pinned_ids = False, None
        self.next_expiry_s = min(self.next_expiry_s, entry.expires_s)

    def pop(self, session_id: str) -> RetainedKv | None:
        """Remove and return the session's entry (None if it has none); the caller frees its
        pins. :attr:`next_expiry_s` may stay early (one harmless extra check). Mutates."""
        entry = self._entries.pop(session_id, None)
        if entry is not None:
            self.held_expired.pop(session_id, None)
            if self._pinned_ids is not None:
                self._pinned_ids.difference_update(map(_BLOCK_ID, entry.blocks))
            elif self._is_each_block_pinned_once is False:
                self._is_each_block_pinned_once = None
        return entry

    def record_release(self, entry: RetainedKv, reason: str) -> int | None:
        """Count a released entry; returns the blocks its next turn reused (None: unknown).

        ``entry.extra["num_reused_blocks"]`` is the measurement (:meth:`measure_reuse`); a
        "resumed" release without one is unknown, not a hit. "shutdown" is not counted. Mutates
        the counters.
        """
        reused: int | None = entry.extra.get("num_reused_blocks", 0)
        if reason == "resumed" and "num_reused_blocks" not in entry.extra:
            reused = None  # a subclass resumed it without a measurement: unknown, not a hit
        if reason != "shutdown":
            self.num_released_blocks += entry.num_blocks
            self.num_reused_blocks += reused or 0
        return reused

    @staticmethod
    def measure_reuse(entry: RetainedKv, request_blocks: Iterable[Any]) -> int:
        """Blocks of ``entry`` among ``request_blocks`` (the KV blocks the session's next turn
        holds, matched by ``block_id``): what the retention actually gave it. Recorded in
        ``entry.extra["num_reused_blocks"]`` for the release. O(blocks). Mutates ``entry``."""
        pinned = set(map(_BLOCK_ID, entry.blocks))
        reused = sum(map(pinned.__contains__, map(_BLOCK_ID, request_blocks)))  # C-level: a whole context
        entry.extra["num_reused_blocks"] = reused
        return reused

    def extend_expiry(self, entry: RetainedKv, until_s: float) -> None:
        """Keep ``entry`` at least until ``until_s`` (``tool_end``: the next turn is imminent).
        Mutates."""
        entry.expires_s = max(entry.expires_s, until_s)
        self.update_next_expiry()

    # ------------------------------------------------------------------ expiry
    def is_expiry_due(self, now_s: float) -> bool:
        """Whether :meth:`expiry_candidates` has anything to check at ``now_s``. Pure."""
        return now_s >= self.next_expiry_s or bool(self.held_expired)

    def expiry_candidates(self, now_s: float) -> list[str]:
        """Sessions to check for expiry now: every one once the earliest expiry is due, else only
        those held past theirs (O(held) per step). Pure."""
        return list(self._entries) if now_s >= self.next_expiry_s else list(self.held_expired)

    def is_expired(self, session_id: str, now_s: float) -> bool:
        """Whether the session holds an entry past its expiry; forgets a stale hold. Mutates
        :attr:`held_expired` only."""
        entry = self._entries.get(session_id)
        if entry is None or entry.expires_s > now_s:
            self.held_expired.pop(session_id, None)
            return False
        return True

    def hold_expired(self, session_id: str) -> None:
        """Keep an expired entry (its next turn waits); re-checked every step. Mutates."""
        self.held_expired[session_id] = None

    def update_next_expiry(self) -> None:
        """Recompute :attr:`next_expiry_s` over the entries not held past theirs. O(entries).
        Mutates."""
        self.next_expiry_s = min((e.expires_s for sid, e in self._entries.items()
                                  if sid not in self.held_expired), default=float("inf"))

    # ------------------------------------------------------------------ reclaim
    def reclaimable_blocks(self, own_session_id: str | None) -> int:
        """Blocks of every entry but ``own_session_id``'s: what a failed allocation of that
        session could get back. Pure."""
        return sum(e.num_blocks for sid, e in self._entries.items() if sid != own_session_id)

    def reclaim_victim(self, own_session_id: str | None, may_reclaim: Callable[[RetainedKv], bool],
                       key: Callable[[RetainedKv], Any] | None = None) -> RetainedKv | None:
        """The entry to release first for another session's failed allocation: the smallest
        ``key`` (default: lowest value per block,
        :func:`~mars_openhands.policy.retention.reclaim_order_key`, then the most recently
        retained; ties: insertion order) among the entries of other sessions ``may_reclaim``
        allows. None when there is none. Pure (``may_reclaim`` and ``key`` should be too)."""
        candidates = [e for sid, e in self._entries.items()
                      if sid != own_session_id and may_reclaim(e)]
        if not candidates:
            return None
        if key is None:
            return min(candidates, key=lambda e: (reclaim_order_key(e.value_s, e.num_blocks),
                                                  -e.retained_s))
        return min(candidates, key=key)

    # ------------------------------------------------------------------ integrity
    def pin_counts(self) -> dict[int, int]:
        """Block id -> pins this pool holds on it. O(pinned blocks). Pure."""
        pins: dict[int, int] = {}
        for entry in self._entries.values():
            for b in entry.blocks:
                pins[b.block_id] = pins.get(b.block_id, 0) + 1
        return pins

    def retained_only_blocks(self, num_referenced_once: Callable[[Iterable[Any]], int],
                             ref_count: Callable[[Any], int]) -> int:
        """Pinned blocks nothing but these pins references (vLLM ref count == pins). Pure.

        Args:
            num_referenced_once: blocks of an iterable whose ref count is 1
                (:func:`seams.blocks.num_blocks_referenced_once`).
            ref_count: a block's ref count (:func:`seams.blocks.block_ref_count`).

        Returns:
            A block count. O(pinned blocks); whether a block is pinned twice is kept by
            :meth:`add` and :meth:`pop` (an entry's blocks never change), and recomputed over
            every entry only after a pop once it was not so.
        """
        entries = self._entries.values()
        if self._is_each_block_pinned_once is None:
            num_pins = sum(len(e.blocks) for e in entries)
            ids = set(map(_BLOCK_ID, itertools.chain.from_iterable(e.blocks for e in entries)))  # C-level
            self._is_each_block_pinned_once = len(ids) == num_pins
            self._pinned_ids = ids if self._is_each_block_pinned_once else None
        if self._is_each_block_pinned_once:
            # Every block pinned once (the usual case): retained-only iff its one reference is ours.
            return num_referenced_once(itertools.chain.from_iterable(e.blocks for e in entries))
        pins: dict[int, int] = {}
        by_id: dict[int, Any] = {}
        for entry in entries:
            for b in entry.blocks:
                pins[b.block_id] = pins.get(b.block_id, 0) + 1
                by_id[b.block_id] = b
        return sum(1 for bid, n in pins.items() if ref_count(by_id[bid]) == n)
