"""RetainedKvPool: the retained-KV bookkeeping, without vLLM (fake blocks with ``block_id``)."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from mars_openhands.engine.schedulers.retained import RetainedKv, RetainedKvPool


@dataclass
class _Block:
    block_id: int
    ref_cnt: int = 1


def _entry(sid: str, block_ids: list[int], *, retained_s: float = 0.0, expires_s: float = 10.0,
           value_s: float = 1.0) -> RetainedKv:
    return RetainedKv(sid, f"{sid}-r", 0, [_Block(b) for b in block_ids], 16 * len(block_ids),
                      retained_s, expires_s, value_s, "test")


def test_add_pop_and_read_only_mapping() -> None:
    pool = RetainedKvPool()
    assert not pool and pool.next_expiry_s == math.inf and pool.get("a") is None
    pool.add(_entry("a", [1, 2], expires_s=5.0))
    pool.add(_entry("b", [3], expires_s=3.0))
    assert len(pool) == 2 and "a" in pool and list(pool) == ["a", "b"] and pool["b"].num_blocks == 1
    assert pool.next_expiry_s == 3.0
    with pytest.raises(ValueError, match="already holds retained KV"):
        pool.add(_entry("a", [9]))
    assert pool.pop("a").session_id == "a" and pool.pop("a") is None and "a" not in pool
    assert not hasattr(pool, "__setitem__")


def test_expiry_holds_and_recomputes() -> None:
    pool = RetainedKvPool()
    pool.add(_entry("a", [1], expires_s=2.0))
    pool.add(_entry("b", [2], expires_s=4.0))
    assert not pool.is_expiry_due(1.0) and pool.expiry_candidates(1.0) == []
    assert pool.is_expiry_due(2.0) and pool.expiry_candidates(2.0) == ["a", "b"]
    assert pool.is_expired("a", 2.0) and not pool.is_expired("b", 2.0)
    pool.hold_expired("a")
    pool.update_next_expiry()
    # the held entry no longer sets the timer, but is re-checked every step
    assert pool.next_expiry_s == 4.0 and pool.is_expiry_due(2.5) and pool.expiry_candidates(2.5) == ["a"]
    pool.extend_expiry(pool["a"], 9.0)  # tool_end: kept for the imminent turn
    assert not pool.is_expired("a", 2.5) and "a" not in pool.held_expired
    pool.update_next_expiry()
    assert pool.next_expiry_s == 4.0
    pool.pop("b")
    pool.update_next_expiry()
    assert pool.next_expiry_s == 9.0


def test_extend_expiry_never_shortens() -> None:
    pool = RetainedKvPool()
    pool.add(_entry("a", [1], expires_s=8.0))
    pool.extend_expiry(pool["a"], 3.0)
    assert pool["a"].expires_s == 8.0 and pool.next_expiry_s == 8.0


def test_reclaim_victim_lowest_value_per_block_then_latest_retained() -> None:
    pool = RetainedKvPool()
    pool.add(_entry("own", [1], value_s=0.0))
    pool.add(_entry("cheap", [2, 3], value_s=1.0, retained_s=1.0))  # 0.5 s per block
    pool.add(_entry("tie", [4, 5], value_s=1.0, retained_s=2.0))    # same, retained later
    pool.add(_entry("dear", [6], value_s=5.0))
    assert pool.reclaimable_blocks("own") == 5 and pool.reclaimable_blocks(None) == 6
    assert pool.reclaim_victim("own", lambda e: True).session_id == "tie"
    assert pool.reclaim_victim("own", lambda e: e.session_id == "dear").session_id == "dear"
    assert pool.reclaim_victim("own", lambda e: False) is None
    assert RetainedKvPool().reclaim_victim(None, lambda e: True) is None


def test_release_counters_and_reuse_measurement() -> None:
    pool = RetainedKvPool()
    measured = _entry("a", [1, 2, 3])
    assert RetainedKvPool.measure_reuse(measured, [_Block(b) for b in (2, 3, 7)]) == 2
    assert pool.record_release(measured, "resumed") == 2
    unmeasured = _entry("b", [4, 5])
    assert pool.record_release(unmeasured, "resumed") is None  # unknown, not a hit
    assert pool.record_release(_entry("c", [6]), "expired") == 0
    assert pool.record_release(_entry("d", [8, 9]), "shutdown") == 0  # not counted
    assert (pool.num_released_blocks, pool.num_reused_blocks) == (6, 2)


def test_retained_only_blocks_and_pin_counts() -> None:
    pool = RetainedKvPool()
    a, b = _entry("a", [1, 2]), _entry("b", [3])
    a.blocks[1].ref_cnt = 2  # also used by a running request
    pool.add(a)
    pool.add(b)

    def once(blocks: list[_Block]) -> int:
        return sum(1 for x in blocks if x.ref_cnt == 1)

    assert pool.retained_only_blocks(once, lambda x: x.ref_cnt) == 2
    shared = _entry("c", [3])  # block 3 pinned twice: retained-only iff ref count == 2 pins
    shared.blocks[0] = b.blocks[0]
    b.blocks[0].ref_cnt = 2
    pool.add(shared)
    assert pool.pin_counts() == {1: 1, 2: 1, 3: 2}
    assert pool.retained_only_blocks(once, lambda x: x.ref_cnt) == 2


@given(st.lists(st.tuples(st.booleans(), st.integers(0, 3),
                          st.lists(st.integers(0, 11), min_size=1, max_size=5), st.booleans()),
                max_size=25),
       st.lists(st.integers(1, 4), min_size=12, max_size=12))
@settings(max_examples=300, deadline=None)
def test_retained_only_blocks_matches_definition_over_adds_and_pops(
        ops: list[tuple[bool, int, list[int], bool]], ref_counts: list[int]) -> None:
    """The pinned-once bookkeeping kept across adds and pops (shared and repeated blocks, pops
    of absent sessions, counts asked at some steps only) counts what the definition counts:
    pinned blocks whose ref count is exactly their pins; its state is right whenever known."""
    blocks = [_Block(i, n) for i, n in enumerate(ref_counts)]
    pool = RetainedKvPool()

    def once(xs: Any) -> int:
        return sum(1 for x in xs if x.ref_cnt == 1)

    for is_add, sid, ids, is_counted in ops:
        if is_add and str(sid) not in pool:
            pool.add(RetainedKv(str(sid), "r", 0, [blocks[i] for i in ids], 16 * len(ids), 0.0, 10.0,
                                1.0, "test"))
        elif not is_add:
            pool.pop(str(sid))
        pins = pool.pin_counts()
        is_once = all(n == 1 for n in pins.values())
        assert pool._is_each_block_pinned_once in (None, is_once)
        assert pool._pinned_ids == (set(pins) if pool._is_each_block_pinned_once else None)
        if is_counted:
            expected = sum(1 for bid, n in pins.items() if blocks[bid].ref_cnt == n)
            assert pool.retained_only_blocks(once, lambda x: x.ref_cnt) == expected
