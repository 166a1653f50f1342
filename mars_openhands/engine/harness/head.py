"""The waiting head's proof: a merged run's evictions leave the blocked waiting head blocked.

Mental model: vLLM stops at the first waiting request it cannot allocate, so during a merged run
(:mod:`.runs`) only the waiting head is asked, step after step, and the answer stays "no" while
what it needs stays above what is free. The run takes blocks off the free queue (vLLM's
``get_new_blocks`` pops from its head, evicting their prefix-cache entries), so the free blocks
only shrink; what the head needs changes only when the run evicts a block of its prefix hit.
:meth:`HeadProof.keep_blocked` finds the longest run whose evictions keep the head blocked, under
the scheduler's :class:`~mars_openhands.engine.schedulers.coalesce.HeadRule` (stock vLLM:
``HeadRule.STOCK``). Harness only: it reads vLLM's free queue and prefix-cache map through
:mod:`mars_openhands.engine.seams.fast_paths`.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Sequence
from typing import Any

from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.request import Request

from mars_openhands.engine import seams
from mars_openhands.engine.schedulers.coalesce import HeadRule
from mars_openhands.engine.seams import fast_paths

__all__ = ["HeadProof"]

_HASH_KEY_SESSIONS = 32
"""Sessions whose waiting heads' pool keys :class:`HeadProof` keeps (the least recent goes)."""


class HeadProof:
    """Answers, for one scheduler, how long a merged run may be and keep its waiting head blocked.

    Args:
        sched: the scheduler.
        block_size: tokens per KV block.
        rule: the scheduler's head rule (stock vLLM: ``HeadRule.STOCK``); ``STOCK`` holds only with
            one plain KV cache group (else ``KEEP_HIT``).
    """

    def __init__(self, sched: Scheduler, block_size: int, rule: HeadRule) -> None:
        self._sched = sched
        self._block_size = block_size
        self._rule = rule
        self._hash_keys: dict[str, tuple[int, Any, dict[Any, int]]] = {}
        """session id -> (len(block_hashes), the last hash, pool key of each full block -> its
        index) of its last waiting head looked at; the last ``_HASH_KEY_SESSIONS`` sessions."""

    def rule(self) -> HeadRule:
        """The rule in force now: the scheduler's, ``STOCK`` only over one plain KV group. Pure."""
        if self._rule is HeadRule.STOCK and not fast_paths.has_one_plain_kv_group(self._sched):
            return HeadRule.KEEP_HIT
        return self._rule

    def keep_blocked(self, k: int, new_blocks: Callable[[int], int], probe_num_tokens: int) -> int:
        """Largest ``k' <= k`` whose run (taking ``new_blocks(k')`` blocks off the free queue)
        leaves the waiting head blocked, or 1. Pure (but for the pool-key memo).

        ``probe_num_tokens``: tokens the probe step scheduled (its waiting queue saw the step's
        budget less these). No running request of the head's session may cache one of its blocks
        (sessions' streams never share a block). Which evictions keep it blocked:

        * with vLLM's full-sequence gate (``scheduler_reserve_full_isl``, vLLM's default) any:
          a waiting request is admitted only if its whole context fits, ``R = blocks(context) -
          hit + evictable hit (+ 1 for a hit ending inside a block) <= F`` (its chunk's own
          check needs no more). ``hit - evictable`` are the hit blocks in use (ref count > 0),
          which no eviction touches: evicting a hit block from the free queue takes it off the
          hit and off the evictable hits (a cut inside the hit takes the blocks after it off
          both, and may drop in-use ones: ``R`` grows). ``R`` drops only by a block the run
          takes (the partial block of a cut hit; a free copy of a key whose pinned copy then
          serves the hit), while ``F`` loses every block the run takes::

              R = blocks(context) - (hit blocks in use) [+ 1]    F - taken
        * without the gate its chunk decides. ``HeadRule.STOCK``: evictions from the end of its
          hit (:meth:`first_unsafe_eviction`). Otherwise none of its blocks, and with
          ``KEEP_HIT_AND_CHUNK`` the free blocks also stay at or above the most its chunk can
          need (:meth:`_unshrunk_free_floor`), so the chunk it was refused stays what it is
          (without that floor a chunk halved to the fewer free blocks fits:
          ``test_blocked_run_ends_before_the_step_that_admits_the_head``)."""
        s = self._sched
        head = s.waiting.peek_request()
        if any(r.session_id == head.session_id for r in s.running):
            return 1
        if fast_paths.has_full_sequence_gate(s):
            return k  # vLLM's full-sequence gate: no eviction lets the head in (docstring)
        num_taken = new_blocks(k)
        rule = self.rule()
        if rule is HeadRule.STOCK:
            first_hit = self.first_unsafe_eviction(head, fast_paths.next_evicted_blocks(s, num_taken))
        else:  # the first block with one of the head's keys: one walk, no list
            first_hit = fast_paths.first_free_block_holding(s, num_taken, self.pool_hash_keys(head))
            if rule is HeadRule.KEEP_HIT_AND_CHUNK:
                floor = max(0, seams.blocks.num_free_blocks(s) - self._unshrunk_free_floor(probe_num_tokens))
                first_hit = floor if first_hit is None else min(first_hit, floor)
        if first_hit is None or num_taken <= first_hit:
            return k
        lo, hi = 1, k  # largest k' with new_blocks(k') <= first_hit (monotone in k')
        while lo < hi:
            mid = (lo + hi + 1) // 2
            if new_blocks(mid) <= first_hit:
                lo = mid
            else:
                hi = mid - 1
        return lo

    def _unshrunk_free_floor(self, probe_num_tokens: int) -> int:
        """Free blocks below which a waiting head's chunk may be shrunk further in a step of the
        run: the most new blocks a chunk of the step's leftover token budget can take, plus the
        watermark. Pure.

        Shrinking halves a chunk until its new blocks fit in the free blocks (minus the
        watermark): while those stay at or above the unshrunk chunk's blocks the chunk is the
        one the probe step was refused, which fewer free blocks still refuse."""
        s = self._sched
        budget = max(0, seams.hooks.max_num_scheduled_tokens(s) - probe_num_tokens)
        return -(-budget // self._block_size) + 1 + seams.blocks.watermark_blocks(s)

    def first_unsafe_eviction(self, head: Request, evicted: Sequence[Any]) -> int | None:
        """Index of the first of ``evicted`` (the blocks a run takes, in order) whose eviction
        may let the blocked waiting ``head`` in, or None, under ``HeadRule.STOCK`` without vLLM's
        full-sequence gate (:meth:`keep_blocked`). Pure.

        vLLM needs ``R = blocks(hit + chunk) - hit + evictable hit blocks`` free blocks; losing
        the last hit block takes one off ``R`` (or none, when the chunk is the prompt's rest and
        grows by a block), while the run took that block (and maybe more) off the free ones: the
        shortfall only grows. A block past the hit, or one whose key another cached block still
        holds, changes nothing. A block inside the hit cuts it short and may drop several
        evictable hits from ``R`` at once: the walk stops there. ::

            head's keys : | k0 | k1 | ... | k(h-2) | k(h-1) | k(h) miss ...
            evicted     :   stop  stop      stop     ok: h -> h - 1      ok (past the hit)
        """
        keys = self.pool_hash_keys(head)
        s = self._sched
        # C-level passes: each evicted block's position among the head's keys (none: past all).
        past = 1 << 62  # beyond any hit (an int: ``int.__gt__`` below)
        positions = list(map(keys.get, map(fast_paths.raw_block_key, evicted), itertools.repeat(past)))
        if positions.count(past) == len(positions):
            return None
        hit = seams.blocks.prefix_hit_tokens(s, head) // self._block_size  # a block of the head's
        copies: dict[Any, int] = {}
        # Blocks past the hit change nothing, and the hit only shrinks: only those inside it.
        for i in itertools.compress(range(len(positions)), map(hit.__gt__, positions)):
            position = positions[i]
            if position >= hit:
                continue  # past the (shortened) hit: the walk stopped before it
            key = fast_paths.raw_block_key(evicted[i])
            if key not in copies:
                copies[key] = fast_paths.num_cached_copies(s, key)
            copies[key] -= 1
            if copies[key] > 0:
                continue  # another cached block still serves this key
            if position != hit - 1:
                return i
            hit -= 1
        return None

    def pool_hash_keys(self, request: Request) -> dict[Any, int]:
        """:func:`fast_paths.pool_block_hash_keys` of a waiting request, memoized per session: a
        turn's context extends the session's previous one, so its keys extend the memo's. Block
        hashes are chained (each covers its whole prefix): the memo's ``m`` keys are the
        request's first ``m`` when its hash ``m - 1`` equals the memo's last; otherwise the keys
        are rebuilt. The returned dict is the memo's (callers read it). Mutates the memo."""
        hashes = request.block_hashes
        n = len(hashes)
        sid = request.session_id or request.request_id
        memo = self._hash_keys.pop(sid, None)  # re-inserted last: the most recent session
        keys = None
        if memo is not None and memo[0] <= n and (memo[0] == 0 or hashes[memo[0] - 1] == memo[1]):
            keys = memo[2]
            if memo[0] < n:
                groups = fast_paths.num_kv_cache_groups(self._sched)
                keys.update(fast_paths.pool_block_hash_keys(request, groups, start=memo[0]))
        if keys is None:
            groups = fast_paths.num_kv_cache_groups(self._sched)
            keys = fast_paths.pool_block_hash_keys(request, groups)
        self._hash_keys[sid] = (n, hashes[n - 1] if n else None, keys)
        if len(self._hash_keys) > _HASH_KEY_SESSIONS:
            del self._hash_keys[next(iter(self._hash_keys))]
        return keys
