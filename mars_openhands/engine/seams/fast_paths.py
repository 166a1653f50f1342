"""The simulator's exact speed-ups over vLLM's own data structures (harness only).

Audience: :mod:`mars_openhands.engine.harness` (the in-process engine the simulator drives). The
plugin never imports this module (``tests/unit/test_layering.py``): nothing here runs in a vLLM
server. Each speed-up gives the same state, in the same order, as vLLM's own code
(``tests/compat/test_seams.py`` and ``tests/unit/eval/test_sim_fast_paths.py`` compare them):

* reading ahead: the blocks the next allocations take from the free queue
  (:func:`next_evicted_blocks`, :func:`first_free_block_holding`), how many cached blocks hold a
  prefix-cache key (:func:`num_cached_copies`), the pool-side keys of a request's blocks;
* watching: the prefix-cache map reports its inserts and pops (:func:`watch_prefix_cache`), so the
  harness memoizes prefix-hit lookups exactly (its ``PrefixHitMemo``, installed by
  :func:`install_prefix_lookup`);
* fused bookkeeping: block allocation, caching, touch and free, the prefix walk and a decode run's
  token append inline (``install_*``);
* one ``schedule()`` standing for several steps: the waiting queue hidden (:func:`hidden_waiting`)
  and the step budget scaled (:func:`scaled_step_budget`).
"""

from __future__ import annotations

import functools
import itertools
import math
import operator
from collections.abc import Callable, Iterable, Iterator, Sequence
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any

from vllm.v1.core.block_pool import BlockHashToBlockMap
from vllm.v1.core.sched.request_queue import create_request_queue
from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.core.single_type_kv_cache_manager import FullAttentionManager

from mars_openhands.engine.seams import compat
from mars_openhands.engine.seams.blocks import _IS_NULL, _RAW_BLOCK_HASH, _REF_CNT, block_pool

if TYPE_CHECKING:
    from vllm.v1.core.kv_cache_utils import KVCacheBlock
    from vllm.v1.request import Request

__all__ = [
    "eagle_drop_group_ids",
    "first_free_block_holding",
    "has_full_sequence_gate",
    "has_one_plain_kv_group",
    "hidden_waiting",
    "host_tier_store_horizons",
    "install_batched_token_append",
    "install_fused_block_allocation",
    "install_fused_prefix_lookup",
    "install_prefix_lookup",
    "is_kv_holding_waiting",
    "new_kv_cache_blocks",
    "next_evicted_blocks",
    "num_cached_copies",
    "num_kv_cache_groups",
    "pool_block_hash_key",
    "pool_block_hash_keys",
    "prefix_cache_map",
    "raw_block_key",
    "scaled_step_budget",
    "set_eagle_drop_group_ids",
    "watch_prefix_cache",
]

_IS_NOT_NONE = functools.partial(operator.is_not, None)
raw_block_key = _RAW_BLOCK_HASH
"""``block -> its prefix-cache key or None`` (vLLM's ``KVCacheBlock._block_hash``, without the
property call: one C-level call per block in a walk)."""


def next_evicted_blocks(sched: Scheduler, num_blocks: int) -> list[KVCacheBlock]:
    """The first ``num_blocks`` blocks of the free queue: the blocks the next allocations take (and
    evict from the prefix cache), in order (vLLM's ``get_new_blocks`` pops from the head). Pure."""
    queue = block_pool(sched).free_block_queue
    out: list[KVCacheBlock] = []
    append = out.append
    block = queue.fake_free_list_head.next_free_block
    # The queue holds num_free_blocks blocks before its fake tail: no end test per block.
    for _ in range(max(0, min(num_blocks, queue.num_free_blocks))):
        append(block)
        block = block.next_free_block
    return out


def first_free_block_holding(sched: Scheduler, num_blocks: int, keys: Any) -> int | None:
    """Index, among :func:`next_evicted_blocks` ``(sched, num_blocks)``, of the first block whose
    prefix-cache key (``KVCacheBlock.block_hash``) is in ``keys``, or None. One walk that stops
    there, without building the list. Pure."""
    queue = block_pool(sched).free_block_queue
    block = queue.fake_free_list_head.next_free_block
    for i in range(max(0, min(num_blocks, queue.num_free_blocks))):
        if block._block_hash in keys:
            return i
        block = block.next_free_block
    return None


class _WatchedBlockHashToBlockMap(BlockHashToBlockMap):
    """vLLM's prefix-cache map (hash + group id -> block) that reports every insert and pop."""

    def __init__(self, on_change: Any, watched: Any) -> None:
        super().__init__()
        self._on_change = on_change
        self._watched = watched

    def insert(self, key: Any, block: KVCacheBlock) -> None:
        super().insert(key, block)
        if key in self._watched:
            self._on_change(key, False)

    def pop(self, key: Any, block_id: int) -> KVCacheBlock | None:
        block = super().pop(key, block_id)
        if key in self._watched:
            self._on_change(key, self._cache.get(key) is None)
        return block


class _Everything:
    def __contains__(self, key: object) -> bool:
        return True


def watch_prefix_cache(sched: Scheduler, on_change: Any, keys: Any = None) -> Any:
    """Make ``on_change(key, is_gone)`` run after every insert into or pop from the pool's
    prefix-cache map (``key``: a ``KVCacheBlock.block_hash``; ``is_gone``: a pop left no block
    under it). Mutates the pool (its entries are kept).

    Args:
        sched: the scheduler whose pool is watched.
        on_change: the callback.
        keys: a live container (e.g. a dict the caller mutates): only keys in it are reported,
            tested inline (the pool inserts and evicts one key per KV block, millions per run).
            ``None``: every key.

    Returns:
        The watched map (the pool replaces it on ``reset_prefix_cache``: compare identities).
    """
    pool = block_pool(sched)
    watched = _WatchedBlockHashToBlockMap(on_change, _Everything() if keys is None else keys)
    watched._cache = pool.cached_block_hash_to_block._cache
    pool.cached_block_hash_to_block = watched
    return watched


def _inline_map(cache: Any) -> tuple[dict[Any, Any], Any, Any] | None:
    """``(entries, watched keys, on_change)`` of a prefix-cache map whose insert / pop the fused
    allocation may do inline (vLLM's map, or :func:`watch_prefix_cache`'s with its callback);
    ``None`` for any other map class (its own methods are called). Pure."""
    if type(cache) is _WatchedBlockHashToBlockMap:
        return cache._cache, cache._watched, cache._on_change
    if type(cache) is BlockHashToBlockMap:
        return cache._cache, (), None
    return None


@functools.cache
def _group_key_suffix(group_id: int) -> bytes | None:
    """The bytes vLLM's ``make_block_hash_with_group_id`` appends to a block hash for ``group_id``,
    or ``None`` if it builds keys some other way (the caller then calls it). Pure."""
    from vllm.v1.core.kv_cache_utils import make_block_hash_with_group_id

    suffix = group_id.to_bytes(4, "big", signed=False)
    return suffix if make_block_hash_with_group_id(b"h", group_id) == b"h" + suffix else None


def install_fused_block_allocation(sched: Scheduler) -> bool:
    """Simulator speed: the pool's ``get_new_blocks`` evicts each block's prefix-cache entry in one
    inline step instead of vLLM's four calls per block (``_maybe_evict_cached_block`` ->
    ``_remove_cached_block_hashes`` -> pop, ``reset_hash``), with the same effects in the same
    order; ``cache_full_blocks``, ``touch`` and ``free_blocks`` likewise
    (:func:`_fused_cache_full_blocks`, :func:`_fused_touch_and_free`). Past the KV knee
    every turn re-prefills its context: millions of block allocations per run. Falls back to
    vLLM's method whenever a feature it would handle is on (metrics collector, KV cache events,
    no prefix caching, blocks with extra hashes, reuse watchers of ``unpin_blocks``, another map
    class). Mutates the pool
    (an instance attribute; the class is untouched).

    Returns:
        False (nothing installed) if the pool lacks an attribute the fused path reads.
    """
    pool = block_pool(sched)
    needed = ("free_block_queue", "_reuse_watchers", "metrics_collector", "enable_kv_cache_events",
              "cached_block_hashes_by_block", "cached_block_hash_to_block", "enable_caching")
    if not all(hasattr(pool, name) for name in needed) or not hasattr(pool.null_block, "_block_hash"):
        return False
    original = pool.get_new_blocks

    def get_new_blocks(num_blocks: int) -> list[KVCacheBlock]:
        cache = pool.cached_block_hash_to_block
        inline = _inline_map(cache)
        if (pool.metrics_collector or pool.enable_kv_cache_events or not pool.enable_caching
                or pool.cached_block_hashes_by_block or pool._reuse_watchers or inline is None
                or num_blocks <= 0):
            return original(num_blocks)
        if num_blocks > pool.get_num_free_blocks():
            raise ValueError(f"Cannot get {num_blocks} free blocks from the pool")
        return _pop_and_evict(pool.free_block_queue, num_blocks, cache, *inline)

    pool.get_new_blocks = get_new_blocks
    pool.cache_full_blocks = _fused_cache_full_blocks(pool, pool.cache_full_blocks)
    pool.touch, pool.free_blocks = _fused_touch_and_free(pool, pool.touch, pool.free_blocks)
    return True


def _pop_and_evict(queue: Any, num_blocks: int, cache: Any, raw: dict[Any, Any], watched: Any,
                   on_change: Any) -> list[KVCacheBlock]:
    """``popleft_n`` and the eviction loop of :func:`install_fused_block_allocation`'s
    ``get_new_blocks`` in one pass over the ``0 < num_blocks <= free`` blocks: each block is
    unlinked, evicted from the prefix-cache map (``cache``; ``raw``, its entries; ``on_change`` for
    ``watched`` keys, after the block's own pop, as before) and referenced, in queue order; the
    fake head is linked to the next free block at the end (``on_change`` must not read the free
    queue: :class:`PrefixHitMemo`'s does not). No reuse watchers. Mutates."""
    queue.num_free_blocks -= num_blocks
    head = queue.fake_free_list_head
    block = head.next_free_block
    blocks: list[KVCacheBlock] = []
    append = blocks.append
    for _ in range(num_blocks):
        append(block)
        following = block.next_free_block
        block.prev_free_block = block.next_free_block = None
        key = block._block_hash
        if key is not None:
            entry = raw.pop(key, None)
            if entry is not block and entry is not None:  # shared key or another block: vLLM's pop
                raw[key] = entry
                BlockHashToBlockMap.pop(cache, key, block.block_id)
            if key in watched:
                on_change(key, key not in raw)
            block._block_hash = None
            block._block_hash_num_tokens = None
        block.ref_cnt += 1
        block = following
    head.next_free_block = block  # the fake tail when the queue is now empty
    block.prev_free_block = head
    return blocks


def _fused_touch_and_free(pool: Any, original_touch: Any, original_free: Any) -> tuple[Any, Any]:
    """``BlockPool.touch`` and ``.free_blocks`` with the free queue's unlink inline and the block's
    hash read directly (vLLM: a ``remove`` call and two properties per block): same references,
    same free-queue order (freed blocks without a hash to the front, with one to the back, each in
    the given order; other pools' blocks to their pool). A metrics collector: vLLM's methods.
    The null block: vLLM 0.32 counts its references, 0.33 skips it in both (never pooled)."""
    skip_null = compat.vllm_release() >= (0, 33)

    def touch(blocks: Sequence[KVCacheBlock]) -> None:
        if pool.metrics_collector:
            original_touch(blocks)
            return
        queue = pool.free_block_queue
        for block in blocks:
            if skip_null and block.is_null:
                continue
            if block.ref_cnt == 0 and not block.is_null:
                prev_block, next_block = block.prev_free_block, block.next_free_block
                if prev_block is None or next_block is None:
                    raise RuntimeError(f"remove() called on an invalid block: {block}")
                prev_block.next_free_block = next_block
                next_block.prev_free_block = prev_block
                block.prev_free_block = block.next_free_block = None
                queue.num_free_blocks -= 1
            block.ref_cnt += 1

    def free_blocks(ordered_blocks: Iterable[KVCacheBlock]) -> None:
        if pool.metrics_collector:
            original_free(ordered_blocks)
            return
        caching = pool.enable_caching
        evict_first: list[KVCacheBlock] = []
        evict_last: list[KVCacheBlock] = []
        other_pools: dict[Any, list[KVCacheBlock]] = {}
        for block in ordered_blocks:
            if skip_null and block.is_null:
                continue
            owner = block.pool
            if owner is not None and owner is not pool:
                other_pools.setdefault(owner, []).append(block)
                continue
            block.ref_cnt -= 1
            if block.ref_cnt == 0 and not block.is_null:
                if block._block_hash is None or not caching:
                    evict_first.append(block)
                else:
                    evict_last.append(block)
        pool.free_block_queue.prepend_n(evict_first)
        pool.free_block_queue.append_n(evict_last)
        for owner, blocks in other_pools.items():
            owner.free_blocks(blocks)

    return touch, free_blocks


def _fused_cache_full_blocks(pool: Any, original: Any) -> Any:
    """``BlockPool.cache_full_blocks`` with the common case inline: a block with no hash yet whose
    key is not cached gets its hash and its map entry directly (vLLM: ``_insert_block_hash`` ->
    ``contain``, ``set_block_hash``, ``insert``); any other block takes vLLM's own steps, in the
    same order. KV cache events or a block mask: vLLM's method."""
    from vllm.v1.core.block_pool import resolve_block_hashes
    from vllm.v1.core.kv_cache_utils import make_block_hash_with_group_id

    def cache_full_blocks(request: Any, blocks: list[KVCacheBlock], num_cached_blocks: int,
                          num_full_blocks: int, block_size: int, kv_cache_group_id: int,
                          block_mask: list[bool] | None = None) -> None:
        if pool.enable_kv_cache_events or block_mask is not None:
            original(request, blocks, num_cached_blocks, num_full_blocks, block_size,
                     kv_cache_group_id, block_mask)
            return
        if num_cached_blocks >= num_full_blocks:
            return
        new_hashes = resolve_block_hashes(request.block_hashes, pool.hash_block_size,
                                          block_size)[num_cached_blocks:num_full_blocks]
        cache = pool.cached_block_hash_to_block
        inline = _inline_map(cache)
        raw, watched, on_change = inline if inline is not None else (cache._cache, (), None)
        suffix = _group_key_suffix(kv_cache_group_id)
        for i, block in enumerate(blocks[num_cached_blocks:num_full_blocks]):
            if block.is_null:
                continue
            key = (new_hashes[i] + suffix if suffix is not None
                   else make_block_hash_with_group_id(new_hashes[i], kv_cache_group_id))
            num_tokens = (num_cached_blocks + i + 1) * block_size
            if block._block_hash is None and key not in raw:
                block._block_hash = key
                block._block_hash_num_tokens = num_tokens
                if inline is None:
                    cache.insert(key, block)
                    continue
                raw[key] = block
                if key in watched:
                    on_change(key, False)
                continue
            if block._block_hash is not None:
                assert (block.block_hash_num_tokens is not None
                        and block.block_hash_num_tokens < num_tokens)
                pool._emit_block_removed_events(pool._remove_cached_block_hashes(block))
            pool._insert_block_hash(key, block, num_tokens=num_tokens)

    return cache_full_blocks


def install_fused_prefix_lookup(sched: Scheduler) -> bool:
    """Simulator speed: the prefix-cache lookup of a single full-attention group walks the request's
    block hashes against the pool's map inline (vLLM: ``get_cached_block`` ->
    ``make_block_hash_with_group_id`` + ``get_one_block`` per block; a whole context's walk for
    every new turn). Same blocks (the first of a shared key's blocks, as vLLM), same hit length,
    same EAGLE drop. The manager's count of evictable blocks in a hit (vLLM: a generator over
    the hit, for every allocation attempt of a waiting request) counts in one C-level pass.
    Installed only on vLLM's ``UnitaryKVCacheCoordinator`` with a ``FullAttentionManager``, no
    context parallelism, hashes at the block size, and vLLM's (or :func:`watch_prefix_cache`'s)
    map class; any other map at call time takes vLLM's method. Mutates the coordinator and the
    manager (instance attributes).

    Returns:
        False (nothing installed) when the layout is not that one.
    """
    from vllm.v1.core.kv_cache_coordinator import UnitaryKVCacheCoordinator
    from vllm.v1.core.kv_cache_utils import KVCacheBlock
    from vllm.v1.kv_cache_interface import FullAttentionSpec

    coordinator = sched.kv_cache_manager.coordinator
    if type(coordinator) is not UnitaryKVCacheCoordinator:
        return False
    manager = coordinator.single_type_managers[0]
    pool = coordinator.block_pool
    block_size = coordinator.block_size
    if (type(manager) is not FullAttentionManager or type(coordinator.kv_cache_spec) is not FullAttentionSpec
            or coordinator.dcp_world_size != 1 or coordinator.pcp_world_size != 1
            or pool.hash_block_size != block_size
            or _group_key_suffix(0) is None):
        return False
    original = coordinator.find_longest_cache_hit
    suffix = _group_key_suffix(0)

    def find_longest_cache_hit(block_hashes: Any, max_cache_hit_length: int) -> Any:
        cache = pool.cached_block_hash_to_block
        if _inline_map(cache) is None:
            return original(block_hashes, max_cache_hit_length)
        # One lazy C-level pass: keys, entries, cut at the first miss.
        hashes = list(itertools.islice(block_hashes, max_cache_hit_length // block_size))
        # Entries up to the first miss (None; never the blocks' Python ``__eq__``).
        keys = map(operator.add, hashes, itertools.repeat(suffix, len(hashes)))
        blocks = list(itertools.takewhile(_IS_NOT_NONE, map(cache._cache.get, keys)))
        if not all(map(KVCacheBlock.__instancecheck__, blocks)):  # a key shared by several blocks
            blocks = [e if type(e) is KVCacheBlock else next(iter(e.values())) for e in blocks]
        if blocks and 0 in eagle_drop_group_ids(coordinator):  # vLLM's drop_eagle_block
            blocks.pop()
        return (blocks,), len(blocks) * block_size, 0

    def num_evictable_blocks(blocks: Sequence[KVCacheBlock]) -> int:
        if any(map(_IS_NULL, blocks)):
            return original_evictable(blocks)
        return list(map(_REF_CNT, blocks)).count(0)

    original_evictable = manager._get_num_evictable_blocks
    coordinator.find_longest_cache_hit = find_longest_cache_hit
    manager._get_num_evictable_blocks = num_evictable_blocks
    return True


def eagle_drop_group_ids(coordinator: Any) -> set[int]:
    """The KV cache groups whose last hit block the prefix lookup drops for EAGLE (vLLM 0.32:
    ``eagle_group_ids``; 0.33: ``drop_eagle_group_ids``, empty with lookahead hashes). The live
    set: a test may assign to it through :func:`set_eagle_drop_group_ids`."""
    if compat.vllm_release() >= (0, 33):
        return coordinator.drop_eagle_group_ids
    return coordinator.eagle_group_ids


def set_eagle_drop_group_ids(coordinator: Any, group_ids: set[int]) -> None:
    """Make the prefix lookup drop the last hit block in ``group_ids`` (the attribute
    :func:`eagle_drop_group_ids` reads). Mutates the coordinator."""
    if compat.vllm_release() >= (0, 33):
        coordinator.drop_eagle_group_ids = group_ids
    else:
        coordinator.eagle_group_ids = group_ids


def install_batched_token_append(sched: Scheduler) -> bool:
    """Simulator speed: ``update_from_output`` appends a request's sampled tokens in one call and
    checks for a stop once, instead of vLLM's append + ``check_stop`` per token (a coalesced
    decode run hands each request its run's tokens in one update: 1.3 M tokens per full-workload
    run). Exact: the tokens kept are those before the first stop vLLM's loop would find (EOS, or
    the ``max_tokens`` / ``max_model_len`` cap), appended at once (the block hasher then sees the
    same tokens), and ``check_stop`` on the last one sets the same status. The rest follows the
    loaded release: vLLM 0.32's ``AsyncScheduler._update_request_with_output`` resolves the kept
    tokens' placeholders and caches the blocks; 0.33's ``Scheduler._update_request_with_output``
    (AsyncScheduler's override is gone) resolves every returned token's placeholder, moves
    ``num_computed_tokens`` back over the tokens cut at a stop, and leaves ``cache_blocks`` to
    ``update_from_output``. Requests with stop token ids, repetition detection or pooling take
    vLLM's loop. Mutates ``sched`` (an instance attribute; the class is untouched).

    Returns:
        False (nothing installed) unless ``sched``'s method is vLLM's own (``AsyncScheduler``'s
        or ``Scheduler``'s: a subclass that overrides it keeps its own).
    """
    from vllm.v1.core.sched.async_scheduler import AsyncScheduler
    from vllm.v1.core.sched.utils import check_stop
    from vllm.v1.request import RequestStatus

    if not isinstance(sched, AsyncScheduler) or any(
            "_update_request_with_output" in vars(c) for c in type(sched).__mro__
            if c not in (AsyncScheduler, Scheduler)):
        return False
    original = sched._update_request_with_output
    running = RequestStatus.RUNNING
    resolves_all = compat.vllm_release() >= (0, 33)

    def update(request: Request, new_token_ids: list[int], is_stale: bool = False) -> tuple[list[int], bool]:
        params = request.sampling_params
        if (len(new_token_ids) < 2 or request.pooling_params or params is None or params.stop_token_ids
                or params.repetition_detection is not None):
            return original(request, new_token_ids, is_stale)
        status_before = request.status
        max_model_len = sched.max_model_len
        num_returned = len(new_token_ids)
        # vLLM's loop stops after token k (1-based) at EOS or once num_tokens >= max_model_len or
        # num_output_tokens >= max_tokens; the length caps hold from k = their distance on.
        cut = max(1, min(num_returned, max_model_len - request.num_tokens,
                         request.max_tokens - request.num_output_tokens))
        eos = params.eos_token_id
        if eos is not None and eos in new_token_ids:
            cut = min(cut, new_token_ids.index(eos) + 1)
        request.append_output_token_ids(new_token_ids[:cut] if cut < num_returned else new_token_ids)
        stopped = check_stop(request, max_model_len)
        if stopped:
            if resolves_all and not is_stale:
                request.num_computed_tokens -= num_returned - cut
            del new_token_ids[cut:]
        if resolves_all:
            if not is_stale and request.num_output_placeholders > 0:
                request.num_output_placeholders -= num_returned
                assert request.num_output_placeholders >= 0
            return new_token_ids, stopped
        if not is_stale:
            request.num_output_placeholders -= len(new_token_ids)
            assert request.num_output_placeholders >= 0
        if status_before == running:
            sched.kv_cache_manager.cache_blocks(
                request, request.num_computed_tokens - request.num_output_placeholders)
        return new_token_ids, stopped

    sched._update_request_with_output = update
    return True


def prefix_cache_map(sched: Scheduler) -> Any:
    """The pool's current prefix-cache map (see :func:`watch_prefix_cache`)."""
    return block_pool(sched).cached_block_hash_to_block


def pool_block_hash_key(block_hash: Any, group_id: int = 0) -> Any:
    """The pool-side key (``KVCacheBlock.block_hash``) of a request block hash in one group. Pure."""
    from vllm.v1.core.kv_cache_utils import make_block_hash_with_group_id

    return make_block_hash_with_group_id(block_hash, group_id)


def pool_block_hash_keys(request: Request, num_groups: int = 1, start: int = 0) -> dict[Any, int]:
    """The pool-side keys (``KVCacheBlock.block_hash``: hash + group id) of ``request``'s full
    blocks from index ``start`` on, in KV cache groups ``0..num_groups-1``, each with its block's
    index in the request (a block whose key is here may serve its prefix hit up to that block).
    Pure."""
    from vllm.v1.core.kv_cache_utils import make_block_hash_with_group_id

    hashes = request.block_hashes[start:] if start else request.block_hashes
    indices = range(start, start + len(hashes))
    keys: dict[Any, int] = {}
    for g in range(num_groups):
        suffix = _group_key_suffix(g)
        if suffix is None:
            keys.update({make_block_hash_with_group_id(h, g): i for i, h in zip(indices, hashes, strict=True)})
        else:  # C-level passes (a whole context's blocks per waiting head)
            keys.update(zip(map(operator.add, hashes, itertools.repeat(suffix, len(hashes))), indices, strict=True))
    return keys


@contextmanager
def scaled_step_budget(sched: Scheduler, factor: int, budget_tokens: int) -> Iterator[None]:
    """While open, one step's token budget (``max_num_scheduled_tokens`` and the input budget
    ``max_num_batched_tokens``) is ``budget_tokens`` and vLLM's long-prefill chunk cap is
    ``factor`` times its value. Mutates ``sched`` and its ``scheduler_config``; restored on exit,
    even on error.

    The simulator's merged chunked-prefill run (``InprocEngine.plan_run``, kind ``prefill``): one
    ``schedule()`` that gives each capped prefill ``factor`` chunks and each decode ``factor``
    tokens (drafts), as ``factor`` single steps would; ``budget_tokens`` is exactly their sum
    (vLLM lifts the cap when one request is eligible, e.g. with the waiting queue hidden: the
    budget then cuts the chunk). ``schedule()`` reads all three afresh.
    """
    config = sched.scheduler_config
    saved = (sched.max_num_scheduled_tokens, config.max_num_batched_tokens,
             config.long_prefill_token_threshold)
    sched.max_num_scheduled_tokens = budget_tokens
    config.max_num_batched_tokens = budget_tokens
    config.long_prefill_token_threshold = saved[2] * factor
    try:
        yield
    finally:
        (sched.max_num_scheduled_tokens, config.max_num_batched_tokens,
         config.long_prefill_token_threshold) = saved


@contextmanager
def hidden_waiting(sched: Scheduler) -> Iterator[None]:
    """While open, ``sched`` sees an empty waiting queue (of its own policy's kind); on exit (even
    on error) its waiting queue and vLLM's ``prefill_capacity_bound`` are put back.

    The simulator's merged blocked run: the caller proved that every waiting request stays
    waiting in each of the single steps the ``schedule()`` inside stands for, so hiding them is
    exact, and a flag vLLM's step sets from the waiting queue is left as the single steps leave
    it. Mutates ``sched`` while open.
    """
    hidden, bound = sched.waiting, sched.prefill_capacity_bound
    sched.waiting = create_request_queue(sched.policy)
    try:
        yield
    finally:
        sched.waiting, sched.prefill_capacity_bound = hidden, bound


def is_kv_holding_waiting(sched: Scheduler) -> bool:
    """Whether vLLM holds waiting requests that already own KV blocks (a KV connector's loads in
    flight): a merged run is not exact then. Pure."""
    return bool(sched.kv_holding_waiting)


def has_full_sequence_gate(sched: Scheduler) -> bool:
    """vLLM's full-sequence gate (``scheduler_reserve_full_isl``, its default): a waiting request is
    admitted only when its whole context fits, not just its first chunk. Pure."""
    return bool(sched.scheduler_reserve_full_isl)


def has_one_plain_kv_group(sched: Scheduler) -> bool:
    """One KV cache group, and no block with extra prefix-cache keys: a block's key is its one
    ``_block_hash``. Pure."""
    return (len(sched.kv_cache_config.kv_cache_groups) == 1
            and not block_pool(sched).cached_block_hashes_by_block)


def host_tier_store_horizons(sched: Scheduler) -> dict[str, float] | None:
    """When vLLM's host KV tier (the scheduler side of its ``OffloadingConnector``) does nothing in
    a step but bookkeeping a merged run repeats: running request id -> the tokens computed by a
    step's end from which the connector would store that request's next chunk (``inf``: never).
    None when it may act in the next step whatever the run: a copy is queued or in flight (its
    job not yet reported done), a finished request's store is still to be built, a load or a
    flush is pending, or its KV layout is not one plain full-attention group. Without a host
    tier: an empty dict. Pure.

    Mental model (vLLM 0.32, ``offloading/scheduler.py``): each step's ``build_connector_meta``
    stores, per scheduled request, the chunks between ``next_stored_chunk_idx`` and the chunks its
    offloadable tokens fill, ``min(computed + scheduled, prompt if offload_prompt_only)`` (vLLM's
    default: only prompt blocks, so a decode never stores), and, per request finished since the
    last step, its last chunks. A step that fills no new chunk only extends the request's keys and
    block ids (the same after one merged step) and leaves ``next_stored_chunk_idx``. Loads start
    only when a waiting request is admitted (a step of its own). A chunk is stored once the step's
    offloadable tokens reach ``(next_stored_chunk_idx + 1) × tokens_per_chunk`` (an upper bound
    on what ``storable_chunks`` allows; a retention interval or a reachability mask only stores
    fewer)::

        | stored chunks (next_stored_chunk_idx) | chunk being filled | ...
                                                 ^ horizon = (next + 1) × tokens_per_chunk
    """
    connector = sched.connector
    if connector is None:
        return {}
    from vllm.distributed.kv_transfer.kv_connector.v1.offloading.scheduler import (
        OffloadingConnectorScheduler,
    )

    side = getattr(connector, "connector_scheduler", None)
    if not isinstance(side, OffloadingConnectorScheduler):
        return None
    config = side.config
    if (side._jobs or side._current_batch_load_jobs or side._current_batch_jobs_to_flush
            or side._block_id_to_pending_jobs or side.manager.has_pending_work()
            or side._sliding_window_groups or config.supports_partial_tail
            or any(g.is_eagle_group or g.requires_cow_source or g.sliding_window_size_in_chunks is not None
                   for g in config.kv_group_configs)):
        return None
    statuses = side._req_status
    for status in statuses.values():
        req = status.req
        if req.is_finished() and not status.finished_signaled and (
                _store_horizon(config, status) <= req.num_tokens):
            return None  # the next step builds its last store
    return {r.request_id: _store_horizon(config, statuses[r.request_id])
            for r in sched.running}


def _store_horizon(config: Any, status: Any) -> float:
    """Tokens computed from which the connector stores ``status``'s request's next chunk
    (:func:`host_tier_store_horizons`; vLLM's ``_calc_num_offloadable_tokens`` caps). Pure."""
    req = status.req
    cap = math.inf if status.max_offload_tokens is None else status.max_offload_tokens
    if config.offload_prompt_only:
        cap = min(cap, req.num_prompt_tokens)
    horizon = math.inf
    for group, state in zip(config.kv_group_configs, status.group_states, strict=True):
        next_tokens = (state.next_stored_chunk_idx + 1) * group.tokens_per_chunk
        if cap >= next_tokens:
            horizon = min(horizon, next_tokens)
    return horizon


def num_cached_copies(sched: Scheduler, key: Any) -> int:
    """How many cached blocks of the pool hold the prefix-cache ``key`` (0, 1, or a shared key's
    several). Pure."""
    entry = block_pool(sched).cached_block_hash_to_block._cache.get(key)
    return len(entry) if isinstance(entry, dict) else int(entry is not None)


def install_prefix_lookup(sched: Scheduler, lookup: Callable[[Request], Any]) -> Callable[[Request], Any]:
    """Make ``lookup`` ``sched``'s prefix-cache lookup (``KVCacheManager.get_computed_blocks``, an
    instance attribute; the class is untouched); it must answer as vLLM's does for the default
    cap (``request.num_tokens - 1``). vLLM 0.33 may pass a lower cap
    (``max_cache_hit_length``, an aux-output connector's): those calls go to vLLM's own lookup.
    Mutates the manager.

    Returns:
        vLLM's own lookup, for ``lookup`` to call.
    """
    manager = sched.kv_cache_manager
    original = manager.get_computed_blocks
    if compat.vllm_release() >= (0, 33):
        def capped_lookup(request: Request, max_cache_hit_length: int | None = None) -> Any:
            if max_cache_hit_length is None:
                return lookup(request)
            return original(request, max_cache_hit_length)

        peek = getattr(lookup, "peek", None)
        if peek is not None:  # seams.blocks.prefix_hit_tokens asks the memo through it
            capped_lookup.peek = peek  # type: ignore[attr-defined]
        manager.get_computed_blocks = capped_lookup
    else:
        manager.get_computed_blocks = lookup
    return original


def num_kv_cache_groups(sched: Scheduler) -> int:
    """KV cache groups of the scheduler's cache (one per attention kind). Pure."""
    return len(sched.kv_cache_config.kv_cache_groups)


def new_kv_cache_blocks(sched: Scheduler, groups: tuple[list[KVCacheBlock], ...]) -> Any:
    """vLLM's ``KVCacheBlocks`` of ``groups`` (one block list per KV cache group), as the prefix
    lookup returns them. Pure."""
    return sched.kv_cache_manager.create_kv_cache_blocks(groups)
