"""The KV blocks as the schedulers see them: block tables, counts, pinning, the prefix hit.

Audience: the schedulers (retention pins a finished turn's blocks and unpins them, the integrity
check counts references, chunk shrinking and the resume test read the free blocks, MARS reads the
pool's usage) and the harness (free / used counts for the simulator's snapshots).
"""

from __future__ import annotations

import itertools
import operator
from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING, Any

from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.core.single_type_kv_cache_manager import FullAttentionManager

if TYPE_CHECKING:
    from vllm.v1.core.kv_cache_utils import KVCacheBlock
    from vllm.v1.request import Request

__all__ = [
    "AllocateSlotsWrapper",
    "all_blocks",
    "block_pool",
    "block_ref_count",
    "cached_blocks",
    "cached_prefix_blocks",
    "free_pinned",
    "import_cached_prefix",
    "is_cached_block",
    "kv_usage",
    "num_block_table_entries",
    "num_blocks_referenced_once",
    "num_free_blocks",
    "num_gpu_blocks",
    "num_request_blocks",
    "pin_blocks",
    "pin_finishing_request_blocks",
    "prefix_hit_tokens",
    "referenced_block_counts",
    "request_blocks",
    "share_block_pool",
    "watermark_blocks",
    "wrap_allocate_slots",
]

_REF_CNT = operator.attrgetter("ref_cnt")
_IS_NULL = operator.attrgetter("is_null")
_RAW_BLOCK_HASH = operator.attrgetter("_block_hash")


def block_pool(sched: Scheduler) -> Any:
    """The scheduler's ``BlockPool`` (one pool for all KV cache groups)."""
    return sched.kv_cache_manager.block_pool


def num_gpu_blocks(sched: Scheduler) -> int:
    """Total KV blocks of the pool, including vLLM's reserved null block."""
    return block_pool(sched).num_gpu_blocks


def num_free_blocks(sched: Scheduler) -> int:
    """Blocks with no reference (free or evictable prefix-cache blocks)."""
    return block_pool(sched).get_num_free_blocks()


def request_blocks(sched: Scheduler, request_id: str) -> list[KVCacheBlock]:
    """Blocks held by ``request_id`` over all KV cache groups (allocation order per group)."""
    out: list[KVCacheBlock] = []
    for manager in sched.kv_cache_manager.coordinator.single_type_managers:
        out.extend(manager.req_to_blocks.get(request_id, ()))
    return out


def num_request_blocks(sched: Scheduler, request_id: str) -> int:
    """Number of non-null blocks held by ``request_id`` over all KV cache groups.

    O(1) per full-attention group (vLLM never puts the null block in a full-attention block
    table), O(blocks) for the others (sliding window and Mamba tables hold null blocks)."""
    total = 0
    for manager in sched.kv_cache_manager.coordinator.single_type_managers:
        blocks = manager.req_to_blocks.get(request_id, ())
        if type(manager) is FullAttentionManager:
            total += len(blocks)
        else:
            total += sum(1 for b in blocks if not b.is_null)
    return total


def num_block_table_entries(sched: Scheduler, request_id: str, group_id: int = 0) -> int:
    """Length of ``request_id``'s block table in one KV cache group, O(1) (with full attention,
    which never puts the null block in a table, the blocks it holds there)."""
    manager = sched.kv_cache_manager.coordinator.single_type_managers[group_id]
    return len(manager.req_to_blocks.get(request_id, ()))


def is_cached_block(block: KVCacheBlock) -> bool:
    """True for a real block with a prefix-cache hash (a later request can hit it)."""
    return not block.is_null and block.block_hash is not None


def cached_blocks(blocks: Iterable[KVCacheBlock]) -> list[KVCacheBlock]:
    """The blocks of ``blocks`` that :func:`is_cached_block` accepts, in order (C-level passes:
    a finished turn's whole context). Pure."""
    blocks = list(blocks)
    if any(map(_IS_NULL, blocks)):
        return [b for b in blocks if not b.is_null and b.block_hash is not None]
    # A hash is a non-empty bytes key (hash + group id), so truthy exactly when it is not None.
    return list(itertools.compress(blocks, map(_RAW_BLOCK_HASH, blocks)))


def pin_blocks(sched: Scheduler, blocks: Sequence[KVCacheBlock]) -> None:
    """Take one reference on each block so it is neither freed nor evicted. Mutates the pool."""
    block_pool(sched).touch(blocks)


def pin_finishing_request_blocks(sched: Scheduler, request_id: str, blocks: Sequence[KVCacheBlock]) -> None:
    """Pin ``blocks`` of a finished request whose blocks vLLM frees next (``Scheduler._free_blocks``):
    as :func:`pin_blocks`, or, when ``blocks`` are the first blocks of the request's one block
    table (one full-attention group, the usual case), by moving the request's own references to
    the pin: its table is cut to the blocks after them, which vLLM then frees. Mutates the table or
    the pool.

    Same reference counts and free-queue order as a touch followed by vLLM's free of the whole
    table: the pinned blocks hold two references between the two, so neither path frees them, and
    the rest are freed in the same (reversed) order. Saves two passes over a finished turn's
    whole context (a touch, and the pinned part of the free) on every retained turn.

    Only valid right before vLLM frees ``request_id``'s blocks. A pin by touch (as
    :func:`pin_blocks`) with deferred frees (``Scheduler.defer_block_free``) or a KV metrics
    collector on the pool.
    """
    managers = sched.kv_cache_manager.coordinator.single_type_managers
    # Not with deferred frees (a KV connector's in-flight writes: the table returns to the pool
    # steps later, and the touch keeps the prefix referenced until then) or a KV metrics
    # collector (vLLM's touch reports each access to it).
    if (len(managers) == 1 and type(managers[0]) is FullAttentionManager
            and not getattr(sched, "defer_block_free", False) and not block_pool(sched).metrics_collector):
        table = managers[0].req_to_blocks.get(request_id)
        num = len(blocks)
        if table is not None and num <= len(table) and all(map(operator.is_, blocks, table)):
            managers[0].req_to_blocks[request_id] = table[num:]
            return
    pin_blocks(sched, blocks)


def free_pinned(sched: Scheduler, blocks: Sequence[KVCacheBlock]) -> None:
    """Drop the references taken by :func:`pin_blocks`.

    Blocks are freed tail-first (vLLM's convention, ``free_blocks(reversed(...))``) so that, once
    unreferenced, the end of a context is evicted before its shared beginning.
    """
    block_pool(sched).free_blocks(reversed(list(blocks)))


def referenced_block_counts(sched: Scheduler) -> dict[int, int]:
    """block_id -> number of request references (from every manager's ``req_to_blocks``)."""
    counts: dict[int, int] = {}
    for manager in sched.kv_cache_manager.coordinator.single_type_managers:
        for blocks in manager.req_to_blocks.values():
            for b in blocks:
                if not b.is_null:
                    counts[b.block_id] = counts.get(b.block_id, 0) + 1
    return counts


def share_block_pool(sched: Scheduler, owner: Scheduler) -> None:
    """Make ``sched``'s KV cache manager allocate from ``owner``'s ``BlockPool`` (the simulator's
    pooled-KV bound: one free queue and one prefix-cache map for several schedulers).

    vLLM keeps no per-request state in the pool (a request's blocks live in each single-type
    manager's ``req_to_blocks``, keyed by request id), so schedulers whose request ids never
    collide can share one: a block cached by one is a prefix hit for the others, a block freed by
    one is free for all. The pool is read through three references (the manager's, the
    coordinator's, each single-type manager's, plus that manager's null block), all rebound
    here; ``sched``'s own pool is dropped. Call it right after building ``sched``, before it sees
    a request or anything wraps its pool's methods. Mutates ``sched``.

    Raises:
        ValueError: the two KV layouts differ (block size, groups, pool size), or ``sched``
            already holds blocks.
    """
    pool = block_pool(owner)
    mine = sched.kv_cache_manager.coordinator.single_type_managers
    theirs = owner.kv_cache_manager.coordinator.single_type_managers
    layout = [(type(m), m.block_size) for m in mine]
    if (layout != [(type(m), m.block_size) for m in theirs]
            or num_gpu_blocks(sched) != pool.num_gpu_blocks):
        raise ValueError(f"cannot share a KV block pool between different layouts: {layout} of "
                         f"{num_gpu_blocks(sched)} blocks vs {[(type(m), m.block_size) for m in theirs]} "
                         f"of {pool.num_gpu_blocks}; build every pooled engine with the same shape")
    if any(m.req_to_blocks for m in mine):
        raise ValueError("share_block_pool must run before the scheduler holds blocks; call it "
                         "right after building the scheduler")
    sched.kv_cache_manager.block_pool = pool
    sched.kv_cache_manager.coordinator.block_pool = pool
    for manager in mine:
        manager.block_pool = pool
        manager._null_block = pool.null_block


def block_ref_count(block: KVCacheBlock) -> int:
    """References held on ``block`` (requests + our pins). Pure."""
    return int(block.ref_cnt)


def num_blocks_referenced_once(blocks: Iterable[KVCacheBlock]) -> int:
    """How many of ``blocks`` hold exactly one reference. Pure."""
    return list(map(_REF_CNT, blocks)).count(1)


def all_blocks(sched: Scheduler) -> list[KVCacheBlock]:
    """Every block of the pool (index = block_id)."""
    return block_pool(sched).blocks


def prefix_hit_tokens(sched: Scheduler, request: Request) -> int:
    """Tokens of ``request`` the prefix cache would serve now (0 if caching is off). Pure.

    A lookup memo installed as ``get_computed_blocks`` (the simulator's ``PrefixHitMemo``) is
    asked through its ``peek``: this look does not count toward building a memo."""
    lookup = sched.kv_cache_manager.get_computed_blocks
    peek = getattr(lookup, "peek", None)
    if peek is not None:
        return int(peek(request))
    _, num_tokens, *_ = lookup(request)
    return int(num_tokens)


def cached_prefix_blocks(sched: Scheduler, block_hashes: Sequence[Any]) -> int:
    """How many leading blocks of ``block_hashes`` (a request's ``Request.block_hashes``, one full
    attention group) the pool's prefix cache holds now: the blocks a KV transfer could send. Pure.
    """
    return len(_cached_prefix(block_pool(sched), block_hashes))


def _cached_prefix(pool: Any, block_hashes: Sequence[Any]) -> list[KVCacheBlock]:
    """The blocks of the pool's prefix cache holding the leading ``block_hashes`` (group 0), up to
    the first miss. Pure."""
    blocks: list[KVCacheBlock] = []
    for block_hash in block_hashes:
        cached = pool.get_cached_block(block_hash, [0])
        if cached is None:
            break
        blocks.append(cached[0])
    return blocks


def import_cached_prefix(sched: Scheduler, block_hashes: Sequence[Any]) -> int:
    """Write a prefix another engine computed into this pool's prefix cache, as a KV transfer
    (NIXL, LMCache) leaves it: the leading blocks of ``block_hashes`` (a request's
    ``Request.block_hashes``, one full-attention group) not cached here yet are taken from the
    free queue (evicting its least recently used cached blocks, as vLLM's ``get_new_blocks``) and
    given their prefix-cache keys (``cache_full_blocks``); then the whole prefix, the part cached
    here already included, is freed to the queue's most recently used end, tail first (as vLLM
    frees a finished request). The blocks stay free: nothing is held for the request that will
    read them (vLLM allocates a transfer's blocks only when its scheduler reaches that request),
    so an import never blocks or preempts a request, and a full engine may evict it before its
    request is scheduled (that request then re-prefills what is gone). Takes at most the free
    blocks. Mutates the pool.

    Returns:
        Leading blocks of ``block_hashes`` cached here now.

    Raises:
        ValueError: the scheduler has several KV cache groups (a hybrid model's sliding-window
            groups would need their own tables), or the pool emits KV cache events.
    """
    managers = sched.kv_cache_manager.coordinator.single_type_managers
    if len(managers) != 1:
        raise ValueError(f"a KV import needs one KV cache group, got {len(managers)}")
    pool = block_pool(sched)
    if pool.enable_kv_cache_events:
        raise ValueError("a KV import does not emit KV cache events; build the engine without them")
    have = _cached_prefix(pool, block_hashes)
    pool.touch(have)  # out of the free queue while new blocks are taken: never evicted by them
    take = min(len(block_hashes) - len(have), pool.get_num_free_blocks())
    blocks = pool.get_new_blocks(take) if take else []
    if blocks:
        holder = _HashesOnly(list(block_hashes[:len(have) + take]))
        pool.cache_full_blocks(holder, have + blocks, len(have), len(have) + take,
                               managers[0].block_size, 0)
    pool.free_blocks(reversed(have + blocks))
    return len(have) + take


class _HashesOnly:
    """What ``BlockPool.cache_full_blocks`` reads of a request without KV cache events."""

    __slots__ = ("block_hashes",)

    def __init__(self, block_hashes: list[Any]) -> None:
        self.block_hashes = block_hashes


def watermark_blocks(sched: Scheduler) -> int:
    """Free blocks vLLM keeps back when it admits a waiting request (``--watermark`` of the pool)."""
    return int(sched.kv_cache_manager.watermark_blocks)


def kv_usage(sched: Scheduler) -> float:
    """Fraction of the pool's blocks in use, 0..1 (vLLM's ``KVCacheManager.usage``)."""
    return float(sched.kv_cache_manager.usage)


class AllocateSlotsWrapper:
    """Wraps one scheduler's ``kv_cache_manager.allocate_slots`` (an instance attribute; the class
    is untouched). While enabled, a failed allocation (``None``) calls ``on_failure(request)``;
    while that returns True (it freed something) the allocation is retried with the same
    arguments. vLLM's ``allocate_slots`` has no side effect when it fails, so a retry is safe.
    Disabled, the manager's own method is used (zero overhead on the hot path).
    """

    def __init__(self, sched: Scheduler, on_failure: Any) -> None:
        self._manager = sched.kv_cache_manager
        original = self._manager.allocate_slots

        def allocate_slots(request: Request, *args: Any, **kwargs: Any) -> Any:
            blocks = original(request, *args, **kwargs)
            while blocks is None and on_failure(request):
                blocks = original(request, *args, **kwargs)
            return blocks

        self._wrapped = allocate_slots
        self.is_enabled = False

    def enable(self) -> None:
        """Route allocations through the wrapper. Idempotent."""
        if not self.is_enabled:
            self._manager.allocate_slots = self._wrapped
            self.is_enabled = True

    def disable(self) -> None:
        """Back to vLLM's own ``allocate_slots``. Idempotent."""
        if self.is_enabled:
            del self._manager.allocate_slots
            self.is_enabled = False


def wrap_allocate_slots(sched: Scheduler, on_failure: Any) -> AllocateSlotsWrapper:
    """An enabled :class:`AllocateSlotsWrapper` around ``sched``'s ``allocate_slots``."""
    wrapper = AllocateSlotsWrapper(sched, on_failure)
    wrapper.enable()
    return wrapper
