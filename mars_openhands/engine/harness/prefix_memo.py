"""An exact memo of vLLM's prefix-cache lookup (the simulator's speed; harness only)."""

from __future__ import annotations

import itertools
import operator
from collections.abc import Callable
from typing import Any

from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.request import Request

from mars_openhands.engine.seams import fast_paths

__all__ = ["PrefixHitMemo"]

_BLOCK_HASH = operator.attrgetter("block_hash")
_MEMO_AT_LOOKUP = 2
"""A request's lookup (in one state) at which :class:`PrefixHitMemo` builds its memo."""


class PrefixHitMemo:
    """Exact memo of vLLM's prefix-cache lookup (``KVCacheManager.get_computed_blocks``).

    A lookup walks the request's block hashes until the first one the cache misses: O(context
    blocks), ~5,000 for a 78k-token turn, repeated every step a request waits for KV and once
    more by our schedulers at arrival. Its answer is a function of the request (its token count
    and hashes) and of the cache entries for the keys it read: the hit blocks' keys and the
    first missed key. The pool's map reports every insert and pop
    (:func:`fast_paths.watch_prefix_cache`): a pop that leaves no block under hit ``j``'s key cuts the
    memo to its first ``j`` blocks (the walk now stops there), any other change to a key a memo
    read drops the memo. So a memo that is still there is what the walk would return now. A memo
    is built at a request's second lookup in the same state: building and dropping one costs about
    two walks, most requests are looked up once before their KV is allocated, and one waiting for
    KV is looked up every step. Our schedulers' look at arrival (:meth:`peek`) does not count.
    Installed on one scheduler's KV cache manager (an instance attribute, as our
    ``allocate_slots`` wrapper).

    Args:
        sched: the scheduler (one KV cache group with full attention).
    """

    def __init__(self, sched: Scheduler) -> None:
        self._sched = sched
        self._memo: dict[str, tuple[int, int, tuple[list[Any], ...], int, int, list[Any],
                                    dict[Any, int], int]] = {}
        """request id -> (num_tokens, len(block_hashes), blocks, hit tokens, boundary, keys,
        key -> its first index in the keys: ``keys.index`` in O(1), hit blocks ``h``). A cut
        leaves the lists as they were: the hit is ``blocks[0][:h]``, the keys read ``keys[:h + 1]``
        (a cut per evicted block, tail first, would copy O(context) each time)."""
        self._reader: dict[Any, str] = {}
        """pool key -> the request whose memo read it."""
        self._looked_up: dict[str, tuple[int, int, int]] = {}
        """request id -> (num_tokens, len(block_hashes), lookups in that state) while it has no
        memo."""
        self._map = fast_paths.watch_prefix_cache(sched, self._on_change, self._reader)
        self._inner: Callable[[Request], tuple[Any, int, int]] = fast_paths.install_prefix_lookup(
            sched, self)
        """vLLM's own lookup (a memo miss)."""
        self._block_size = sched.block_size
        self.num_hits = 0

    def _on_change(self, key: Any, is_gone: bool) -> None:
        rid = self._reader.get(key)
        if rid is None:
            return
        memo = self._memo.get(rid)
        hit = memo[7] if memo is not None else 0
        # The reader maps only keys still in this memo's (maybe cut) keys to it.
        j = memo[6][key] if is_gone and memo is not None and memo[4] == 0 else hit
        if j >= hit:  # an insert, a duplicate left, or the missed key: the walk may go further
            del self._reader[key]
            self.forget(rid)
            if memo is not None:  # a memo again at its next lookup
                self._looked_up[rid] = (memo[0], memo[1], _MEMO_AT_LOOKUP - 1)
            return
        # Hit block j left the cache and no other block has its key: the walk now stops at j
        # (blocks 0..j-1 are untouched, or their own change would have come first).
        for dropped in memo[5][j + 1:hit + 1]:  # the keys read past j (islice would walk from 0)
            if self._reader.get(dropped) == rid:
                del self._reader[dropped]
        self._memo[rid] = (*memo[:3], j * self._block_size, 0, memo[5], memo[6], j)

    def forget(self, request_id: str) -> None:
        """Drop ``request_id``'s memo (a finished request). Mutates."""
        self._looked_up.pop(request_id, None)
        memo = self._memo.pop(request_id, None)
        if memo is not None:
            for key in itertools.islice(memo[5], memo[7] + 1):
                if self._reader.get(key) == request_id:
                    del self._reader[key]

    def _check_map(self) -> None:
        """After ``reset_prefix_cache`` (a new, unwatched map): drop every memo, watch the new map."""
        if fast_paths.prefix_cache_map(self._sched) is not self._map:
            for rid in list(self._memo):
                self.forget(rid)
            self._looked_up.clear()
            self._map = fast_paths.watch_prefix_cache(self._sched, self._on_change, self._reader)

    def _valid_memo(self, request: Request) -> tuple[Any, ...] | None:
        """``request``'s memo if it is for the request's current state (token count and block
        hashes) and the current map, else None."""
        self._check_map()
        memo = self._memo.get(request.request_id)
        if memo is not None and memo[0] == request.num_tokens and memo[1] == len(request.block_hashes):
            return memo
        return None

    def peek(self, request: Request) -> int:
        """Tokens the prefix cache would serve ``request`` now (:func:`seams.blocks.prefix_hit_tokens`),
        from the memo when it is still valid; a walk does not count toward the memo."""
        memo = self._valid_memo(request)
        return memo[3] if memo is not None else self._inner(request)[1]

    def __call__(self, request: Request) -> tuple[Any, int, int]:
        """vLLM's ``get_computed_blocks(request)``, from the memo when it is still valid."""
        memo = self._valid_memo(request)
        if memo is not None:
            self.num_hits += 1
            hit = memo[7]
            return (fast_paths.new_kv_cache_blocks(self._sched, tuple(g[:hit] for g in memo[2])),
                    memo[3], memo[4])
        rid = request.request_id
        state = (request.num_tokens, len(request.block_hashes))
        seen = self._looked_up.get(rid)
        num_lookups = seen[2] + 1 if seen is not None and seen[:2] == state else 1
        self.forget(rid)
        blocks, num_tokens, boundary = self._inner(request)
        if num_lookups < _MEMO_AT_LOOKUP:
            self._looked_up[rid] = (*state, num_lookups)
            return blocks, num_tokens, boundary
        groups = tuple(list(g) for g in blocks.blocks)
        if len(groups) != 1:
            return blocks, num_tokens, boundary  # not a plain full-attention hit: no memo
        keys = list(map(_BLOCK_HASH, groups[0]))
        hit = len(keys)
        if hit < len(request.block_hashes):
            keys.append(fast_paths.pool_block_hash_key(request.block_hashes[hit]))
        if None in keys:
            return blocks, num_tokens, boundary
        # key -> its first index (assigned last-to-first, so the first occurrence wins)
        positions = dict(zip(reversed(keys), range(len(keys) - 1, -1, -1), strict=True))
        self._memo[rid] = (request.num_tokens, len(request.block_hashes), groups, num_tokens,
                           boundary, keys, positions, hit)
        self._reader.update(dict.fromkeys(keys, rid))
        return blocks, num_tokens, boundary
