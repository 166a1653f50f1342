"""In-process real vLLM scheduler: building, token streams, prefix hits, coalesced decode."""

from __future__ import annotations

import math

import pytest

pytest.importorskip("vllm")

from vllm.sampling_params import SamplingParams  # noqa: E402
from vllm.v1.core.sched.async_scheduler import AsyncScheduler  # noqa: E402
from vllm.v1.core.sched.scheduler import Scheduler  # noqa: E402
from vllm.v1.request import Request  # noqa: E402

from mars_openhands.engine.harness.inproc_engine import (  # noqa: E402
    InprocEngine,
    InprocEngineParams,
    SessionTokenStream,
    resolve_scheduler_cls,
)
from mars_openhands.engine.schedulers.coalesce import HeadRule  # noqa: E402
from mars_openhands.engine.seams import fast_paths  # noqa: E402
from tests.unit.engine.harness import add_stream_turn  # noqa: E402

BS = 16


def _engine(policy: str = "fcfs", num_gpu_blocks: int = 512, **kw: object) -> InprocEngine:
    return InprocEngine(policy, InprocEngineParams(num_gpu_blocks=num_gpu_blocks,
                                                   max_model_len=8192, **kw))


class _UnitTimer:
    """One millisecond per step, whatever its shape."""

    def step_time_s(self, prefill: object = (), decode_context_tokens: object = ()) -> float:
        return 0.001


def _drain(engine: InprocEngine, coalesce: int = 1) -> list:
    records = []
    for _ in range(10_000):
        if not engine.has_work():
            return records
        records.append(engine.step(engine.max_decode_run(coalesce)))
    raise AssertionError("engine did not drain")


def test_resolve_scheduler_cls_names() -> None:
    assert resolve_scheduler_cls("fcfs") is AsyncScheduler
    assert resolve_scheduler_cls("fcfs-sync") is Scheduler
    assert resolve_scheduler_cls("vllm.v1.core.sched.scheduler:Scheduler") is Scheduler
    with pytest.raises(ValueError, match="unknown scheduler policy 'nope'.*fcfs"):
        resolve_scheduler_cls("nope")
    with pytest.raises(ValueError, match="not a vLLM Scheduler"):
        resolve_scheduler_cls("collections:OrderedDict")


def test_stream_ids_are_deterministic_and_distinct_per_session() -> None:
    a1, a2, b = SessionTokenStream("a", 0), SessionTokenStream("a", 0), SessionTokenStream("b", 0)
    for s in (a1, a2, b):
        assert s.append(40) == (0, 40)
    assert a1.ids(0, 40) == a2.ids(0, 40)
    assert a1.ids(0, BS) != b.ids(0, BS), "first blocks of two sessions must differ"
    other_seed = SessionTokenStream("a", 1)
    other_seed.append(40)
    assert other_seed.ids(0, BS) != a1.ids(0, BS)
    assert a1.append(5) == (40, 45) and len(a1) == 45
    with pytest.raises(ValueError, match="outside the 45 ids"):
        a1.ids(0, 46)


def test_prefix_cache_hits_on_next_turn_and_memo_matches_vllm_hashes() -> None:
    engine = _engine()
    stream = engine.stream("s")
    p0 = add_stream_turn(engine, stream, "s#0", 1000, 50)
    first = engine.step()
    assert first.new_request_cached_tokens == {"s#0": 0}
    assert first.prefill == [(1000, 0)]
    _drain(engine)
    p1 = add_stream_turn(engine, stream, "s#1", 300, 20, t_s=1.0)
    req = engine.request("s#1")
    fresh = Request("x", stream.ids(0, p1), SamplingParams(max_tokens=1), None,
                    block_hasher=engine.hasher._inner)
    assert req.block_hashes == fresh.block_hashes
    rec = engine.step()
    cached = rec.new_request_cached_tokens["s#1"]
    assert cached == (p0 + 50) // BS * BS > 0, "turn 2 must hit the prefix cache of turn 1"
    assert rec.prefill == [(p1 - cached, cached)]
    _drain(engine)
    assert engine.assert_no_leaks()["used"] == 0
    assert engine.kv_block_counts() == (511, 0, 0)


def test_coalesced_decode_equals_single_steps() -> None:
    results = []
    for coalesce in (1, 32):
        engine = _engine()
        streams = [engine.stream(f"s{i}") for i in range(3)]
        for i, st in enumerate(streams):
            add_stream_turn(engine, st, f"s{i}#0", 100 + 37 * i, 40 + 9 * i)
        records = _drain(engine, coalesce)
        tokens = {}
        for r in records:
            for rid, n, _ in r.outputs:
                tokens[rid] = tokens.get(rid, 0) + n
        results.append((engine.num_steps, engine.num_decode_substeps, tokens,
                        engine.kv_block_counts(), [len(s.block_hashes) for s in streams]))
    (calls1, steps1, tok1, kv1, h1), (calls32, steps32, tok32, kv32, h32) = results
    assert tok1 == tok32 == {"s0#0": 40, "s1#0": 49, "s2#0": 58}
    assert steps1 == steps32 == calls1, "a coalesced call stands for exactly k engine steps"
    assert calls32 < calls1 / 4
    assert kv1 == kv32 and h1 == h32


def test_max_decode_run_requires_steady_decode_and_bounds_k() -> None:
    engine = _engine(num_gpu_blocks=64)
    st = engine.stream("s")
    add_stream_turn(engine, st, "s#0", 100, 30)
    assert engine.max_decode_run(32) == 1, "a waiting request is not a steady decode"
    engine.step()  # prefill + first token
    assert engine.max_decode_run(32) == 29, "bounded by the 29 tokens left"
    assert engine.max_decode_run(8) == 8
    other = engine.stream("t")
    add_stream_turn(engine, other, "t#0", 50, 5)
    assert engine.max_decode_run(32) == 1
    with pytest.raises(ValueError, match="at most 1 coalesced"):
        engine.step(4)


def test_max_decode_run_respects_free_blocks() -> None:
    engine = _engine(num_gpu_blocks=10)  # 9 usable blocks = 144 tokens
    st = engine.stream("s")
    add_stream_turn(engine, st, "s#0", 120, 100)
    engine.step()
    k = engine.max_decode_run(64)
    assert 1 <= k < 64
    free, _, used = engine.kv_block_counts()
    assert -(-(121 + k) // BS) - -(-121 // BS) <= free


@pytest.mark.parametrize("policy", ["fcfs", "MarsScheduler", "AutellixScheduler"])
def test_the_simulators_engine_gets_every_exact_fast_path(policy: str) -> None:
    # Each install_* returns False when vLLM's layout differs; the simulator's engine must get them
    # all (a silent False would only make it slower), and an engine without them gets none.
    fast = InprocEngine(policy, InprocEngineParams(num_gpu_blocks=256, max_model_len=8192),
                        memoize_prefix_hits=True)
    plain = _engine(policy, 256)
    for eng, expected in ((fast, True), (plain, False)):
        s = eng.scheduler
        installed = {"_update_request_with_output" in vars(s), "get_new_blocks" in vars(s.kv_cache_manager.block_pool),
                     "find_longest_cache_hit" in vars(s.kv_cache_manager.coordinator)}
        assert installed == {expected}
        eng.shutdown()


def test_plugin_scheduler_gets_the_clock() -> None:
    from mars_openhands import engine as engine_pkg

    name = "FcfsScheduler" if "FcfsScheduler" in getattr(engine_pkg, "_LAZY", {}) else "MarsScheduler"
    now = [123.0]
    eng = InprocEngine(name, InprocEngineParams(num_gpu_blocks=256, max_model_len=8192),
                       clock=lambda: now[0])
    assert eng.is_plugin and eng.scheduler.clock() == 123.0
    st = eng.stream("s")
    add_stream_turn(eng, st, "s#0", 64, 4, t_s=123.0)
    _drain(eng, 8)
    eng.shutdown()
    eng.assert_no_leaks()
    assert eng.kv_block_counts()[1:] == (0, 0)


@pytest.mark.parametrize(("policy", "like_stock"), [
    ("fcfs", True), ("AutellixScheduler", True), ("ContinuumScheduler", True),
    ("MarsPreviewScheduler", False),  # chunks shrunk to fit: sized by the hit and the free blocks
])
def test_blocked_run_may_evict_the_waiting_heads_hit_from_its_end_only(policy: str, like_stock: bool) -> None:
    """A run that evicts the blocked head's prefix hit from its end keeps the head blocked (stock
    vLLM needs one block fewer, the run took at least one); a block inside the hit cuts it and
    may free the way: the run must stop before it."""
    from mars_openhands.engine import seams

    engine = _engine(policy)
    stream = engine.stream("a")
    add_stream_turn(engine, stream, "a#0", 480, 10)
    _drain(engine)
    add_stream_turn(engine, stream, "a#1", 100, 5, t_s=1.0)
    head = engine.scheduler.waiting.peek_request()
    hit = seams.blocks.prefix_hit_tokens(engine.scheduler, head) // BS
    assert hit == 30
    cache = seams.blocks.block_pool(engine.scheduler).cached_block_hash_to_block

    def block(i: int) -> object:
        return cache.get_one_block(fast_paths.pool_block_hash_key(head.block_hashes[i]))

    other = next(b for b in fast_paths.next_evicted_blocks(engine.scheduler, 512) if b.block_hash is None)
    assert (engine.head.rule() is HeadRule.STOCK) == like_stock
    if not like_stock:
        # The run's one-walk check: the first of the queue's blocks holding a key of the head's.
        queue = fast_paths.next_evicted_blocks(engine.scheduler, 10 ** 6)
        first = next(i for i, b in enumerate(queue) if b.block_hash in engine.head.pool_hash_keys(head))
        keys = engine.head.pool_hash_keys(head)
        assert fast_paths.first_free_block_holding(engine.scheduler, len(queue), keys) == first
        assert fast_paths.first_free_block_holding(engine.scheduler, first, keys) is None  # stops short
        assert fast_paths.first_free_block_holding(engine.scheduler, first + 1, keys) == first
        return
    assert engine.head.first_unsafe_eviction(head, [block(hit - 1), other, block(hit - 2)]) is None
    assert engine.head.first_unsafe_eviction(head, [other, block(hit - 2)]) == 1
    assert engine.head.first_unsafe_eviction(head, [block(hit - 1), block(0)]) == 1


def _preview_head_blocked_by_its_chunk() -> InprocEngine:
    """The preview (chunks shrunk to fit) with ``a#1`` blocked at the head: its 3-block hit and a
    304-token chunk (19 new blocks) need 22 of the 20 free blocks, while ``b#0`` decodes 400
    tokens and takes a block every 16. With 2 free blocks fewer the chunk halves (10 blocks)
    and fits; its whole context (22 blocks) does not."""
    engine = InprocEngine("MarsPreviewScheduler", InprocEngineParams(num_gpu_blocks=64, max_model_len=4096),
                          memoize_prefix_hits=True, clock=lambda: 0.0)
    a, b = engine.stream("a"), engine.stream("b")
    add_stream_turn(engine, a, "a#0", 50, 2)
    _drain(engine)
    add_stream_turn(engine, b, "b#0", 670, 400)
    for _ in range(6):  # b's prefill (256-token chunks at the preview's last level) and a decode
        engine.step()
    add_stream_turn(engine, a, "a#1", 300, 5)
    engine.step()  # the probe: a#1 asked and refused
    return engine


@pytest.mark.parametrize("full_sequence_gate", [True, False])
def test_blocked_run_ends_before_the_step_that_admits_the_head(full_sequence_gate: bool) -> None:
    """vLLM's full-sequence gate (``scheduler_reserve_full_isl``, its default) admits a waiting
    request only when its whole context fits: a run may take any free blocks, and every single
    step of it leaves the head waiting. Without the gate the head's chunk decides, and a chunk
    shrunk to the fewer free blocks lets it in: the run must end before that step."""
    from mars_openhands.engine import seams

    engine = _preview_head_blocked_by_its_chunk()
    s = engine.scheduler
    if not full_sequence_gate:
        s.scheduler_reserve_full_isl = False
        engine.step()  # a new probe under the chunk's check
    head = s.waiting.peek_request()
    assert head.request_id == "a#1" and engine.probe is not None
    assert seams.blocks.prefix_hit_tokens(s, head) == 3 * BS and seams.blocks.num_free_blocks(s) == 20
    k = engine.plan_run(1000, 0.0, math.inf, _UnitTimer()).num_steps
    admitted_at = None
    for i in range(1, 200):  # single steps: when is a#1 first scheduled?
        if "a#1" in engine.step().num_scheduled_tokens:
            admitted_at = i
            break
    if full_sequence_gate:
        assert admitted_at is None and k >= 100, (admitted_at, k)  # past 6 blocks taken
    else:
        assert admitted_at is not None and seams.blocks.num_free_blocks(s) < 20
        assert 1 <= k < admitted_at, (k, admitted_at)


def test_waiting_heads_pool_keys_extend_per_session_and_rebuild_when_the_prefix_differs() -> None:
    """A session's next turn extends its context: its pool keys extend the memo's (the same
    dict). A request whose hashes do not extend the memo's (shorter, or another last hash)
    gets its own keys. Every answer equals the keys built from scratch."""
    import hashlib
    from types import SimpleNamespace


    def hashes(tag: str, n: int) -> list[bytes]:
        return [hashlib.sha256(f"{tag}{i}".encode()).digest() for i in range(n)]

    def request(rid: str, block_hashes: list[bytes], session: str = "s") -> SimpleNamespace:
        return SimpleNamespace(request_id=rid, session_id=session, block_hashes=block_hashes)

    engine = _engine()
    first = request("s#0", hashes("a", 5))
    keys = engine.head.pool_hash_keys(first)
    assert keys == fast_paths.pool_block_hash_keys(first) and len(keys) == 5
    second = request("s#1", hashes("a", 9))  # the same 5 first hashes, 4 more
    assert engine.head.pool_hash_keys(second) is keys  # extended in place
    assert keys == fast_paths.pool_block_hash_keys(second) and len(keys) == 9
    shorter = request("s#2", hashes("a", 3))
    assert engine.head.pool_hash_keys(shorter) == fast_paths.pool_block_hash_keys(shorter)  # no key past 3
    other = request("s#3", hashes("b", 3) + hashes("a", 9)[3:])  # same length as a prefix, other hashes
    assert engine.head.pool_hash_keys(other) == fast_paths.pool_block_hash_keys(other)
    assert engine.head.pool_hash_keys(request("t#0", hashes("c", 2), session="t")) == \
        fast_paths.pool_block_hash_keys(request("t#0", hashes("c", 2), session="t"))
    assert fast_paths.pool_block_hash_keys(second, start=5) == {k: i for k, i in keys.items() if i >= 5}


def _memo_engine_with_waiting_turn(num_gpu_blocks: int) -> tuple[InprocEngine, object, Request, object]:
    """An fcfs engine with the prefix-hit memo, session "s" after a 20-block turn, and its next
    turn "s#1" waiting: (engine, memo, that request, the manager's lookup)."""
    eng = InprocEngine("fcfs", InprocEngineParams(num_gpu_blocks=num_gpu_blocks, max_model_len=8192),
                       memoize_prefix_hits=True)
    memo = eng.prefix_memo
    assert memo is not None
    st = eng.stream("s")
    add_stream_turn(eng, st, "s#0", 20 * BS, 4)
    _drain(eng)
    add_stream_turn(eng, st, "s#1", 3 * BS, 4)
    return eng, memo, eng.scheduler.waiting.peek_request(), eng.scheduler.kv_cache_manager.get_computed_blocks


def test_prefix_memo_cut_block_by_block_answers_as_vllms_walk_and_forgets_cleanly() -> None:
    """The waiting request's hit blocks leave the cache from the end, one allocation at a time
    (vLLM frees a finished request's blocks tail first): after every cut the memo answers as
    vLLM's own walk, and only the keys it still reads (hit + the missed one) map to it."""
    from mars_openhands.engine import seams

    eng, memo, request, lookup = _memo_engine_with_waiting_turn(num_gpu_blocks=64)
    lookup(request)
    lookup(request)  # the second lookup builds the memo
    hit = lookup(request)[1] // BS
    assert hit >= 20 and memo.num_hits == 1
    pool = seams.blocks.block_pool(eng.scheduler)
    cuts = memo_cuts = 0
    while hit > 0:
        pool.get_new_blocks(1)  # evicts the free queue's head
        answer, walk = lookup(request), memo._inner(request)
        assert [b.block_id for b in answer[0].blocks[0]] == [b.block_id for b in walk[0].blocks[0]]
        assert answer[1:] == walk[1:]
        if answer[1] // BS < hit:
            cuts += 1
            hit = answer[1] // BS
            entry = memo._memo.get("s#1")
            if entry is not None:
                memo_cuts += 1
                read = {k for k, rid in memo._reader.items() if rid == "s#1"}
                assert entry[7] == hit and read == set(entry[5][:hit + 1])
    assert cuts >= 2 and memo_cuts >= 2  # the memo was cut, not only dropped
    memo.forget("s#1")
    assert "s#1" not in memo._reader.values() and "s#1" not in memo._memo
    eng.shutdown()


def test_prefix_memo_is_built_at_a_requests_second_lookup_and_a_peek_does_not_count() -> None:
    """Building and dropping a memo costs about two walks: a request looked up once (its KV was
    there) gets none, one looked up again in the same state does, and our schedulers' look at
    arrival (``seams.blocks.prefix_hit_tokens``) neither counts nor changes what a lookup returns."""
    from mars_openhands.engine import seams

    eng, memo, request, lookup = _memo_engine_with_waiting_turn(num_gpu_blocks=256)
    hit_tokens = seams.blocks.prefix_hit_tokens(eng.scheduler, request)
    assert hit_tokens >= 20 * BS and "s#1" not in memo._memo  # a peek walks, builds nothing
    first = lookup(request)
    assert first[1] == hit_tokens and "s#1" not in memo._memo and memo.num_hits == 0
    second = lookup(request)
    assert second[1] == hit_tokens and "s#1" in memo._memo and memo.num_hits == 0
    third = lookup(request)
    assert memo.num_hits == 1 and [b.block_id for b in third[0].blocks[0]] == [
        b.block_id for b in first[0].blocks[0]]
    assert seams.blocks.prefix_hit_tokens(eng.scheduler, request) == hit_tokens and memo.num_hits == 1
    # A reset swaps in a new map that no memo watches: a peek must not serve the old memo.
    assert eng.scheduler.kv_cache_manager.block_pool.reset_prefix_cache()
    assert seams.blocks.prefix_hit_tokens(eng.scheduler, request) == 0 and "s#1" not in memo._memo
    assert lookup(request)[1] == 0 and memo.num_hits == 1
    _drain(eng)
    assert not memo._memo and not memo._looked_up  # a finished request leaves nothing behind
    eng.shutdown()
