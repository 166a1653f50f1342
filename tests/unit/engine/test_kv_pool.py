"""Several in-process engines on one KV block pool (the simulator's pooled-KV bound,
mars_openhands/engine/harness/kv_pool.py): one free count, prefix hits across engines, no
preemption where one engine's own KV would overflow, nothing leaked."""

from __future__ import annotations

import pytest

pytest.importorskip("vllm")

from mars_openhands.engine.harness.inproc_engine import (  # noqa: E402
    InprocEngine,
    InprocEngineParams,
)
from mars_openhands.engine.harness.kv_pool import pooled_params  # noqa: E402
from mars_openhands.engine.schedulers.mars import MarsScheduler  # noqa: E402
from tests.unit.engine.harness import add_stream_turn  # noqa: E402

BS = 16


def _pooled(policy: str = "fcfs", n: int = 2, blocks: int = 64,
            memoize: bool = True) -> list[InprocEngine]:
    params = pooled_params([InprocEngineParams(num_gpu_blocks=blocks, max_model_len=4096)] * n)
    engines: list[InprocEngine] = []
    for p in params:
        engines.append(InprocEngine(policy, p, memoize_prefix_hits=memoize,
                                    kv_pool_of=engines[0] if engines else None))
    return engines


def _drain(*engines: InprocEngine) -> list:
    """Step every engine with work, round robin, until none has any; returns the records."""
    records = []
    for _ in range(10_000):
        busy = [e for e in engines if e.has_work()]
        if not busy:
            return records
        records += [e.step() for e in busy]
    raise AssertionError("engines did not drain")


def test_pooled_params_sum_the_usable_blocks_and_keep_one_null_block() -> None:
    shapes = [InprocEngineParams(num_gpu_blocks=b, max_model_len=4096) for b in (64, 100)]
    assert [p.num_gpu_blocks for p in pooled_params(shapes)] == [1 + 63 + 99] * 2
    with pytest.raises(ValueError, match="one block size"):
        pooled_params([shapes[0], shapes[1].model_copy(update={"block_size": 32})])


@pytest.mark.parametrize("policy", ["fcfs", "MarsScheduler"])
def test_the_engines_share_one_free_count(policy: str) -> None:
    a, b = _pooled(policy)
    assert a.is_kv_pooled and b.is_kv_pooled and a.pool_peers is b.pool_peers
    assert a.num_gpu_blocks() == b.num_gpu_blocks() == 1 + 2 * 63
    add_stream_turn(a, a.stream("s"), "s#0", 600, 10)
    a.step()
    free, _, used = b.kv_block_counts()
    assert used == 600 // BS + 1 and a.kv_block_counts() == b.kv_block_counts()
    assert free == 2 * 63 - used


@pytest.mark.parametrize("policy", ["fcfs", "MarsScheduler"])
def test_a_prefix_computed_on_one_engine_is_a_hit_on_the_other(policy: str) -> None:
    a, b = _pooled(policy)
    stream = a.stream("s")
    p0 = add_stream_turn(a, stream, "s#0", 500, 20)
    _drain(a)
    add_stream_turn(b, stream, "s#1", 100, 10, t_s=1.0)
    rec = b.step()
    cached = rec.new_request_cached_tokens["s#1"]
    assert cached == (p0 + 20) // BS * BS > 0, "turn 1 on engine b must hit turn 0's KV from a"
    _drain(a, b)
    counts = b.assert_no_leaks()
    assert counts["used"] == 0


def test_separate_pools_give_no_hit_across_engines() -> None:
    """The control: two engines built apart miss the other's prefix (so the test above can fail)."""
    shape = InprocEngineParams(num_gpu_blocks=64, max_model_len=4096)
    a, b = InprocEngine("fcfs", shape), InprocEngine("fcfs", shape)
    stream = a.stream("s")
    add_stream_turn(a, stream, "s#0", 500, 20)
    _drain(a)
    add_stream_turn(b, stream, "s#1", 100, 10, t_s=1.0)
    assert b.step().new_request_cached_tokens["s#1"] == 0


@pytest.mark.parametrize("policy", ["fcfs", "MarsScheduler"])
def test_load_over_one_engines_kv_completes_without_preemption_in_the_pool(policy: str) -> None:
    def load(engine: InprocEngine) -> tuple[int, int]:
        """(preemptions, most requests scheduled in one step)"""
        for i in range(3):  # 3 x (400 + 200) tokens = 3 x 38 blocks: over 63, under 126
            add_stream_turn(engine, engine.stream(f"s{i}"), f"s{i}#0", 400, 200)
        records = _drain(engine)
        return (sum(len(r.preempted_ids) for r in records),
                max(len(r.num_scheduled_tokens) for r in records))

    alone = InprocEngine(policy, InprocEngineParams(num_gpu_blocks=64, max_model_len=4096))
    preempted, most = load(alone)
    # The control: one engine's own 63 blocks preempt (vLLM) or hold one back (MARS).
    assert preempted > 0 or most < 3, (preempted, most)
    a, b = _pooled(policy)
    assert load(a) == (0, 3)
    a.shutdown()
    b.shutdown()
    counts = a.assert_no_leaks()
    assert counts["used"] == 0 and counts["free"] == a.num_gpu_blocks() - 1
    assert a.kv_block_counts() == (2 * 63, 0, 0)


def test_the_leak_check_covers_every_engine_of_the_pool() -> None:
    a, b = _pooled()
    add_stream_turn(b, b.stream("s"), "s#0", 300, 5)
    b.step()
    a.assert_no_leaks()  # b's references count: no false leak from a's side
    block = next(x for x in b.scheduler.kv_cache_manager.block_pool.blocks if x.ref_cnt == 1)
    block.ref_cnt += 1  # a reference nobody holds
    with pytest.raises(AssertionError, match="pooled KV block leak over 2 engines"):
        a.assert_no_leaks()
    block.ref_cnt -= 1


def test_a_second_engine_must_share_before_it_holds_blocks_and_match_the_shape() -> None:
    a, _ = _pooled()
    other = InprocEngineParams(num_gpu_blocks=64, max_model_len=4096)
    with pytest.raises(ValueError, match="different layouts"):
        InprocEngine("fcfs", other, kv_pool_of=a)


# ---------------------------------------------------------------- one pool, one reclaim
def _pooled_harnesses(linked: bool, residency: bool = False, num_blocks: int = 40):
    """Two MarsSchedulers (value-model retention, or ``residency``) on one pool of
    ``num_blocks`` blocks and one clock; ``linked``: the second joins the first's
    ``kv_pool_peers`` as InprocEngine joins them."""
    from mars_openhands.engine import seams
    from tests.unit.engine.harness import Harness
    from tests.unit.engine.test_mars_retention import value_model_harness

    def make() -> Harness:
        if residency:
            return Harness(MarsScheduler, num_blocks=num_blocks)
        return value_model_harness(num_blocks=num_blocks)

    h1, h2 = make(), make()
    seams.blocks.share_block_pool(h2.scheduler, h1.scheduler)
    h2.clock = h1.clock  # one virtual clock, as in the simulator
    h2.rng = h1.rng  # one token source: distinct prompts share no block by accident
    h2.scheduler.set_clock(h1.clock)
    if linked:
        h2.scheduler.join_kv_pool_of(h1.scheduler)
    return h1, h2


def _request(h, sid, n, out, rid, turn=0):
    return h.make_request(sid, h.tokens(n), out, {"mars_turn": turn, "mars_last_step": 0},
                          request_id=rid)


@pytest.mark.parametrize("linked", [True, False])
def test_a_replica_short_of_blocks_reclaims_another_replicas_pins(linked: bool) -> None:
    """In one pool, KV pinned by replica 1 is the pool's: replica 2's allocation takes it before
    anyone is preempted (as one engine of the pool's size does, test_mars_retention's
    test_reclaimed_before_any_running_request_is_preempted). The control (pins reclaimable only
    by their own replica) leaves the big turn unscheduled while replica 2 runs."""
    from mars_openhands.stream.transport import ListSink

    h1, h2 = _pooled_harnesses(linked)
    sink = ListSink()
    h1.scheduler.set_telemetry_sink(sink)
    for sid, n in (("a", 200), ("b", 100)):  # 12 + 6 blocks pinned on replica 1
        r = h1.add(_request(h1, sid, n, 4, f"1-{sid}"))
        h1.run_until_finished(r.request_id)
    assert set(h1.scheduler.retained) == {"a", "b"}
    runner = h2.add(_request(h2, "r", 64, 40, "2-r"))
    h2.step()
    big = h2.add(_request(h2, "big", 400, 4, "2-big"))  # 26 blocks: needs replica 1's pins
    scheduled = preempted = False
    for _ in range(5):
        res = h2.step()
        scheduled |= big.request_id in res.num_scheduled_tokens
        preempted |= bool(res.preempted_ids)
    assert not runner.is_finished()
    assert scheduled == linked and not preempted
    reasons = [e.reason for e in sink.events if e.kind == "kv_released"]
    assert ("reclaimed" in reasons) == linked
    assert (h1.scheduler.num_reclaimed_blocks >= 6) == linked
    if linked:
        h2.run_until_done()
        assert big.is_finished() and runner.is_finished()


def test_the_pool_reclaims_the_lowest_value_pin_of_any_replica() -> None:
    """Across replicas the requester's order holds: the lower-value entry goes first, whichever
    replica pinned it."""
    h1, h2 = _pooled_harnesses(linked=True)
    old = h1.add(_request(h1, "old", 20, 2, "old-0"))  # the oldest session: a and b are younger,
    h1.run_until_finished(old.request_id)            # so either entry may go (session_fifo)
    for h, sid in ((h1, "a"), (h2, "b")):  # 12 blocks pinned on each replica
        r = h.add(_request(h, sid, 200, 4, f"{sid}-0"))
        h.run_until_finished(r.request_id)
    h1.scheduler.retained["a"].value_s = 100.0
    h2.scheduler.retained["b"].value_s = 0.001
    runner = h1.add(_request(h1, "r", 64, 40, "r-0"))
    h1.step()
    big = h1.add(_request(h1, "old", 280, 4, "old-1", turn=1))  # 18 blocks: one entry short
    h1.step()
    h1.step()
    assert big.num_computed_tokens > 0 and not runner.is_finished()
    assert "a" in h1.scheduler.retained and "b" not in h2.scheduler.retained
    assert h2.scheduler.num_reclaimed_blocks == 12 and h1.scheduler.num_reclaimed_blocks == 0


def test_pooled_engines_share_one_retention_peer_list() -> None:
    a, b = _pooled("MarsScheduler", n=3)[:2]
    c = a.pool_peers[2]
    assert a.plugin.kv_pool_peers is b.plugin.kv_pool_peers
    assert a.plugin.kv_pool_peers == [a.plugin, b.plugin, c.plugin]
    alone = InprocEngine("MarsScheduler", InprocEngineParams(num_gpu_blocks=64, max_model_len=4096))
    assert alone.plugin.kv_pool_peers == [alone.plugin]


def test_pooled_residency_plans_one_pools_budget_between_the_replicas() -> None:
    """MARS's residency plan on a shared pool counts the other replicas' residents: a replica's
    budget is the pool's less their demand (without it every replica planned the whole pool)."""
    a, b = _pooled("MarsScheduler", blocks=64)
    total = int((a.num_gpu_blocks() - 1) * a.plugin.params.residency.budget_usage)
    assert a.plugin._residency_budget_blocks() == b.plugin._residency_budget_blocks() == total
    add_stream_turn(a, a.stream("s"), "s#0", 600, 10)
    a.step()
    demand = a.plugin.resident_demand_blocks()
    assert "s" in a.plugin.resident and demand >= 600 // BS
    assert b.plugin._residency_budget_blocks() == total - demand
    assert a.plugin._residency_budget_blocks() == total  # its own residents are its plan's
    alone = InprocEngine("MarsScheduler", InprocEngineParams(num_gpu_blocks=64, max_model_len=4096))
    assert alone.plugin._residency_budget_blocks() == int(63 * alone.plugin.params.residency.budget_usage)


@pytest.mark.parametrize("linked", [True, False])
def test_a_session_moving_within_the_pool_takes_its_record_residency_and_pins(linked: bool) -> None:
    """MARS residency on: a session's turn 0 on replica 1 leaves it resident with its KV pinned;
    its turn 1 routed to replica 2 (the pooled router moves sessions at turn boundaries) moves the
    whole session: record, pins, residency. Turn 1 runs at once from the prefix. Unlinked (the
    control, and the bound before 2026-12-07): replica 2 holds turn 1 as a new session's while
    replica 1 keeps the pins of a session it will not see again."""
    h1, h2 = _pooled_harnesses(linked, residency=True, num_blocks=256)
    busy = h2.add(_request(h2, "other", 300, 200, "o-0"))  # replica 2 has a resident session
    h2.step()
    r0 = h1.add(_request(h1, "s", 200, 4, "s-0"))
    h1.run_until_finished(r0.request_id)
    s1, s2 = h1.scheduler, h2.scheduler
    assert "s" in s1.resident and "s" in s1.retained
    first_arrival = s1.sessions["s"].first_arrival_s
    s1.past_held_s["s"] = 42.0  # waits for residency on replica 1 (count_past_waits)
    h1.clock.advance(1.0)
    r1 = h2.add(h2.next_turn(r0, 20, 4, {"mars_turn": 1, "mars_last_step": 0}))
    assert ("s" in s2.held) != linked  # a resident's turn is not held for the next plan
    res = h2.step()
    if linked:
        assert "s" not in s1.sessions and "s" not in s1.retained and "s" not in s1.resident
        assert s2.sessions["s"].first_arrival_s == first_arrival
        assert "s" in s2.resident
        assert s2.past_held_s["s"] == 42.0 and "s" not in s1.past_held_s
        hit = r1.num_computed_tokens - res.num_scheduled_tokens[r1.request_id]
        assert hit >= 192  # turn 0's 200 prompt tokens + outputs: 12 full blocks, from the pool
    else:
        assert "s" in s1.retained and "s" in s1.resident  # pins nobody will resume
        assert s2.sessions["s"].first_arrival_s > first_arrival  # a new session to replica 2
    h2.run_until_done()
    assert busy.is_finished() and r1.is_finished()
