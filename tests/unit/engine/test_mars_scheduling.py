"""Ordering, victims, promotion and chunk shrinking of the MARS schedulers on real vLLM objects."""

from __future__ import annotations

import pytest

pytest.importorskip("vllm")

from vllm.v1.core.sched.scheduler import Scheduler  # noqa: E402
from vllm.v1.request import RequestStatus  # noqa: E402

from mars_openhands.engine import MarsPreviewScheduler, MarsScheduler  # noqa: E402
from mars_openhands.engine.schedulers.coalesce import MergedRun  # noqa: E402
from mars_openhands.engine.seams import fast_paths  # noqa: E402
from tests.unit.engine.harness import Harness  # noqa: E402


def _first_admitted(h: Harness) -> str:
    res = h.step(0.01)
    assert len(res.num_scheduled_tokens) == 1, res.num_scheduled_tokens
    return next(iter(res.num_scheduled_tokens))


MLFQ = {"mars": {"mlfq": True}}
"""MarsScheduler with its MLFQ priority coordinator on (``mars.mlfq``; off by default)."""


@pytest.mark.parametrize(("cls", "mars", "first"), [
    (Scheduler, None, "long"), (MarsPreviewScheduler, None, "short"),
    (MarsScheduler, None, "long"),  # no levels by default: arrival order
    (MarsScheduler, MLFQ, "short")])
def test_waiting_order_short_prompt_first(cls, mars, first: str) -> None:
    h = Harness(cls, num_blocks=512, max_num_seqs=1, mars=mars)
    h.add(h.make_request(None, h.tokens(3000), 2, request_id="long"))  # level 1
    h.add(h.make_request(None, h.tokens(100), 2, request_id="short"))  # level 0
    assert _first_admitted(h) == first
    h.run_until_done()
    h.assert_no_leaks()


@pytest.mark.parametrize(("cls", "first"), [(MarsPreviewScheduler, "fresh"), (MarsScheduler, "s1")])
def test_cached_continuation_ranks_by_uncached_remainder(cls, first: str) -> None:
    """The preview buckets the full prompt; ours the uncached remainder (design.md §4)."""
    h = Harness(cls, num_blocks=1024, max_num_seqs=1)
    r0 = h.add(h.make_request("s1", h.tokens(3000), 4, {"mars_turn": 0}))
    h.run_until_finished(r0.request_id)
    h.add(h.make_request(None, h.tokens(3000), 2, request_id="fresh"))
    r1 = h.add(h.next_turn(r0, 20, 2, {"mars_turn": 1}))
    admitted = _first_admitted(h)
    assert admitted == (r1.request_id if first == "s1" else "fresh")
    h.run_until_done()
    h.assert_no_leaks()


@pytest.mark.parametrize(("cls", "decode_preempted"), [(Scheduler, True), (MarsPreviewScheduler, False),
                                                       (MarsScheduler, False)])
def test_victim_is_the_prefill_not_the_decodes(cls, decode_preempted: bool) -> None:
    h = Harness(cls, num_blocks=14, max_num_batched_tokens=128, long_prefill_token_threshold=32)
    h.add(h.make_request(None, h.tokens(160), 4, request_id="P"))
    h.add(h.make_request(None, h.tokens(32), 40, request_id="D1"))
    h.add(h.make_request(None, h.tokens(32), 40, request_id="D2"))
    preempted: set[str] = set()
    for res in h.run_until_done(max_steps=500):
        preempted |= res.preempted_ids
        h.assert_no_leaks()
    assert preempted, "the scenario must run out of KV"
    assert bool(preempted & {"D1", "D2"}) == decode_preempted
    if not decode_preempted:
        assert preempted == {"P"}


def test_bounded_promotion_levels() -> None:
    mars = {"levels": {"aging_interval_s": 30.0}, "mars": {"mlfq": True, "max_promotion_levels": 1}}
    h = Harness(MarsScheduler, num_blocks=4096, max_num_seqs=1, mars=mars)
    big = h.add(h.make_request(None, h.tokens(40000), 2))
    now = h.clock()
    assert h.scheduler.level(big, now) == 3
    assert h.scheduler.level(big, now + 29.0) == 3
    assert h.scheduler.level(big, now + 31.0) == 2
    assert h.scheduler.level(big, now + 1000.0) == 2  # bounded: at most one level of promotion
    h.run_until_done()
    h.assert_no_leaks()


def test_no_starvation_under_a_stream_of_short_requests() -> None:
    """A level-3 request waits at most ~3 aging intervals behind an endless short stream."""
    h = Harness(MarsScheduler, num_blocks=4096, max_num_seqs=1, max_num_batched_tokens=8192, mars=MLFQ)
    big = h.add(h.make_request(None, h.tokens(40000), 1, request_id="big"))
    arrival = h.clock()
    admitted_at = None
    for _ in range(400):
        h.add(h.make_request(None, h.tokens(64), 1))  # a new short request every second
        res = h.step(1.0)
        if "big" in res.num_scheduled_tokens:
            admitted_at = h.clock()
            break
    assert admitted_at is not None, "the long request starved"
    assert 85.0 <= admitted_at - arrival <= 95.0  # 3 levels x 30 s, then FIFO at level 0
    assert big.status == RequestStatus.RUNNING
    h.run_until_done()
    h.assert_no_leaks()


def _steal_all_but(h: Harness, num_free_blocks: int) -> list:
    pool = h.scheduler.kv_cache_manager.block_pool
    return pool.get_new_blocks(pool.get_num_free_blocks() - num_free_blocks)


@pytest.mark.parametrize(("cls", "shrinks"), [(Scheduler, False), (MarsScheduler, True),
                                              (MarsPreviewScheduler, True)])
def test_chunk_shrinking_progresses_where_stock_preempts(cls, shrinks: bool) -> None:
    h = Harness(cls, num_blocks=80, max_num_batched_tokens=256)
    p = h.add(h.make_request(None, h.tokens(800), 2, request_id="P"))
    assert h.step().num_scheduled_tokens == {"P": 256}
    stolen = _steal_all_but(h, 8)  # someone else took the memory: 8 blocks = 128 tokens left
    res = h.step()
    if shrinks:
        assert res.num_scheduled_tokens == {"P": 128} and not res.preempted_ids
        assert p.num_computed_tokens == 384
    else:
        assert res.preempted_ids == {"P"} and p.status == RequestStatus.PREEMPTED
    h.scheduler.kv_cache_manager.block_pool.free_blocks(stolen)
    h.run_until_done()
    assert p.is_finished()
    h.assert_no_leaks()


@pytest.mark.parametrize("cls", [MarsScheduler, MarsPreviewScheduler])
def test_no_raise_under_kv_exhaustion_with_one_running_request(cls) -> None:
    h = Harness(cls, num_blocks=80, max_num_batched_tokens=256)
    p = h.add(h.make_request(None, h.tokens(600), 40, request_id="P"))
    h.step()
    stolen = _steal_all_but(h, 0)
    for _ in range(20):
        res = h.step(0.01)  # must neither raise nor leak, whatever vLLM decides
        assert not res.num_scheduled_tokens  # nothing fits
        assert h.num_free_blocks() + len(stolen) + 1 == 80  # everything else was given back
    assert p.status == RequestStatus.PREEMPTED  # it gave up its own blocks, then waits
    h.scheduler.kv_cache_manager.block_pool.free_blocks(stolen)
    h.run_until_done()
    assert p.is_finished()
    h.assert_no_leaks()


def test_preview_window_overflow_is_fcfs_and_counted() -> None:
    h = Harness(MarsPreviewScheduler, num_blocks=512, mars={"window": {"size": 2}})
    reqs = [h.add(h.make_request(None, h.tokens(50), 3, request_id=f"r{i}")) for i in range(4)]
    assert [r.request_id for r in h.scheduler.overflow] == ["r2", "r3"]
    assert h.scheduler.get_request_counts() == (0, 4)
    h.scheduler.finish_requests("r3", RequestStatus.FINISHED_ABORTED)
    assert [r.request_id for r in h.scheduler.overflow] == ["r2"]
    h.run_until_done()
    assert all(r.is_finished() for r in reqs)
    h.assert_no_leaks()


def test_a_step_with_the_waiting_queue_hidden_admits_nothing_from_the_overflow() -> None:
    """The simulator's merged blocked run hides the waiting queue (its requests stay blocked): the
    window is as full as before, so the overflow must stay where it is (it did not, once: the
    hidden queue's length made room)."""
    h = Harness(MarsPreviewScheduler, num_blocks=512, mars={"window": {"size": 2}})
    for i in range(4):
        h.add(h.make_request(None, h.tokens(50), 3, request_id=f"r{i}"))
    s = h.scheduler
    with fast_paths.hidden_waiting(s):
        s.schedule(run=MergedRun(num_steps=2, last_step_s=0.0))
    assert [r.request_id for r in s.overflow] == ["r2", "r3"]
    assert [r.request_id for r in s.waiting] == ["r0", "r1"]


def test_a_merged_run_leaves_no_state_of_its_own_in_the_scheduler() -> None:
    """The run reaches the scheduler as ``schedule()``'s argument (coalesce.py): after the call
    the scheduler holds no attribute it did not hold before, and its per-call step count is
    back to a real step's."""
    h = Harness(MarsPreviewScheduler, num_blocks=512)
    for i in range(3):
        h.add(h.make_request(None, h.tokens(50), 3, request_id=f"r{i}"))
    s = h.scheduler
    h.step()
    before = set(vars(s))
    with fast_paths.hidden_waiting(s):
        s.schedule(run=MergedRun(num_steps=3, last_step_s=0.5))
    assert set(vars(s)) == before and s._call_steps == 1


def test_mars_has_no_window_by_default() -> None:
    h = Harness(MarsScheduler, num_blocks=512)
    for _ in range(40):
        h.add(h.make_request(None, h.tokens(20), 1))
    assert h.scheduler.window_size is None and not h.scheduler.overflow
    h.run_until_done()
    h.assert_no_leaks()


@pytest.mark.parametrize(("from_new_work", "first"), [(True, "s1"), (False, "fresh")])
def test_lost_context_does_not_demote_a_continuation(from_new_work: bool, first: str) -> None:
    """Without a prefix cache the continuation re-prefills 3k tokens; its *new* work is 20 tokens,
    so (level_from_new_work) it ranks at level 0 ahead of a 2.5k-token fresh prompt, and the reload
    chunk does not demote it."""
    mars = {"mars": {"mlfq": True, "level_from_new_work": from_new_work, "session_fifo": False},
            "retention": {"enabled": False}}
    h = Harness(MarsScheduler, num_blocks=1024, max_num_seqs=1, max_num_batched_tokens=4096,
                enable_prefix_caching=False, mars=mars)
    r0 = h.add(h.make_request("s1", h.tokens(3000), 4, {"mars_turn": 0}))
    h.run_until_finished(r0.request_id)
    h.add(h.make_request(None, h.tokens(2500), 2, request_id="fresh"))
    h.clock.advance(0.01)
    r1 = h.add(h.next_turn(r0, 20, 2, {"mars_turn": 1}))
    assert _first_admitted(h) == (r1.request_id if first == "s1" else "fresh")
    if from_new_work:
        assert h.scheduler.req_state[r1.request_id].feedback_level == 0
        assert h.scheduler.level(r1, h.clock()) == 0
    h.run_until_done()
    h.assert_no_leaks()


@pytest.mark.parametrize(("session_fifo", "first"), [(True, "A"), (False, "B")])
def test_session_fifo_serves_the_older_session_first(session_fifo: bool, first: str) -> None:
    """Two continuations at the same level: program-level FIFO picks the session that arrived
    first even though its turn arrived last."""
    h = Harness(MarsScheduler, num_blocks=1024, max_num_seqs=1,
                mars={"mars": {"session_fifo": session_fifo}, "retention": {"enabled": False}})
    a0 = h.add(h.make_request("A", h.tokens(100), 2, {"mars_turn": 0}))
    h.run_until_finished(a0.request_id)
    h.clock.advance(1.0)
    b0 = h.add(h.make_request("B", h.tokens(100), 2, {"mars_turn": 0}))
    h.run_until_finished(b0.request_id)
    h.clock.advance(1.0)
    b1 = h.add(h.next_turn(b0, 30, 2, {"mars_turn": 1}))
    h.clock.advance(0.01)
    a1 = h.add(h.next_turn(a0, 30, 2, {"mars_turn": 1}))
    assert _first_admitted(h) == {"A": a1.request_id, "B": b1.request_id}[first]
    h.run_until_done()
    h.assert_no_leaks()


@pytest.mark.parametrize(("cls", "first_chunk"), [(MarsScheduler, 3000), (MarsPreviewScheduler, 2048)])
def test_level0_quantum_is_the_step_budget_for_mars(cls, first_chunk: int) -> None:
    """A level-0 prompt (bucket <= 4096 here): our level-0 quantum is 8192 (capped at the 4096
    budget), the preview's 2048."""
    h = Harness(cls, num_blocks=1024, max_num_batched_tokens=4096,
                mars={"levels": {"prompt_thresholds_tokens": [4096, 8192, 32768]}})
    r = h.add(h.make_request(None, h.tokens(3000), 2))
    assert h.step(0.01).num_scheduled_tokens[r.request_id] == first_chunk
    h.run_until_done()
    h.assert_no_leaks()
