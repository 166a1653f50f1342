"""A prefix sent from one in-process engine to another (the simulator's KV transfer on a move,
``InprocEngine.import_prefix``): it is a prefix hit there, it stays free (nothing is held for the
request that will read it, so it never blocks or preempts one), its head already cached there is
kept, and nothing leaks."""

from __future__ import annotations

import pytest

pytest.importorskip("vllm")

from mars_openhands.engine.harness.inproc_engine import (  # noqa: E402
    InprocEngine,
    InprocEngineParams,
)
from tests.unit.engine.harness import add_stream_turn  # noqa: E402

BS = 16


def _pair(policy: str, blocks: int = 64) -> tuple[InprocEngine, InprocEngine]:
    shape = InprocEngineParams(num_gpu_blocks=blocks, max_model_len=4096)
    return InprocEngine(policy, shape), InprocEngine(policy, shape)


def _drain(engine: InprocEngine) -> None:
    for _ in range(10_000):
        if not engine.has_work():
            return
        engine.step()
    raise AssertionError("engine did not drain")


def _computed_on(engine: InprocEngine, appended: int, output: int, session: str = "s") -> tuple[object, list]:
    """Session ``session``'s first turn run to its end on ``engine``: its stream and the block
    hashes of the prefix ``engine`` holds cached (what a transfer sends)."""
    stream = engine.stream(session)
    add_stream_turn(engine, stream, f"{session}#0", appended, output)
    _drain(engine)
    return stream, stream.block_hashes[:engine.cached_prefix_blocks(stream.block_hashes)]


@pytest.mark.parametrize("policy", ["fcfs", "MarsScheduler"])
def test_an_imported_prefix_is_a_hit_and_stays_free_until_its_request_takes_it(policy: str) -> None:
    a, b = _pair(policy)
    stream, hashes = _computed_on(a, 500, 20)
    sent = len(hashes)
    assert sent == (500 + 20) // BS and b.cached_prefix_blocks(stream.block_hashes) == 0
    assert b.import_prefix(hashes) == sent
    assert b.kv_block_counts() == (63, 0, 0), "free: nothing held for the request"
    add_stream_turn(b, stream, "s#1", 100, 10, t_s=1.0)
    record = b.step()
    assert record.new_request_cached_tokens["s#1"] == sent * BS, "the whole import is a hit"
    _drain(b)
    assert b.kv_block_counts()[2] == 0 and b.assert_no_leaks()["used"] == 0
    assert b.cached_prefix_blocks(stream.block_hashes) >= sent


def test_an_import_evicts_the_least_recently_used_and_keeps_its_own_head() -> None:
    """The import takes free blocks from the queue's head (LRU first), as vLLM's allocation does,
    but never the part of its own prefix cached there already, wherever that sits in the queue."""
    a, b = _pair("fcfs", blocks=64)
    stream, hashes = _computed_on(a, 600, 10)
    # b holds the session's first 10 blocks (older: nearer the queue's head) and another
    # session's prefix (newer).
    assert b.import_prefix(hashes[:10]) == 10
    _, other = _computed_on(b, 40 * BS, 8, session="o")
    assert b.cached_prefix_blocks(hashes) == 10 and b.cached_prefix_blocks(other) == len(other)
    assert b.import_prefix(hashes) == len(hashes)
    assert b.cached_prefix_blocks(hashes) == len(hashes), "the head was not evicted for the tail"
    assert b.cached_prefix_blocks(other) < len(other), "the other session's LRU blocks went"
    assert b.kv_block_counts() == (63, 0, 0) and b.assert_no_leaks()["used"] == 0


def test_an_import_never_blocks_or_preempts_a_request() -> None:
    """A running request keeps its blocks and a waiting one is scheduled as without the import:
    the imported blocks are ordinary free (evictable) cached blocks."""
    a, _ = _pair("fcfs", blocks=128)
    _, hashes = _computed_on(a, 80 * BS, 8)
    runs = []
    for with_import in (False, True):
        b = InprocEngine("fcfs", InprocEngineParams(num_gpu_blocks=100, max_model_len=4096))
        run = b.stream("r")
        add_stream_turn(b, run, "r#0", 30 * BS, 200)
        b.step()
        if with_import:
            free = b.kv_block_counts()[0]
            assert b.import_prefix(hashes) == min(len(hashes), free) > 30
        wait = b.stream("w")
        add_stream_turn(b, wait, "w#0", 60 * BS, 4, t_s=0.5)
        records = [b.step() for _ in range(60)]
        runs.append(([sorted(r.num_scheduled_tokens) for r in records],
                     sum(len(r.preempted_ids) for r in records)))
        _drain(b)
        b.shutdown()
        assert b.assert_no_leaks()["used"] == 0
    assert runs[0] == runs[1] and runs[0][1] == 0


def test_a_pooled_engine_refuses_an_import_and_an_empty_one_changes_nothing() -> None:
    from mars_openhands.engine.harness.kv_pool import pooled_params

    pooled = pooled_params([InprocEngineParams(num_gpu_blocks=64, max_model_len=4096)] * 2)
    first = InprocEngine("fcfs", pooled[0])
    second = InprocEngine("fcfs", pooled[1], kv_pool_of=first)
    with pytest.raises(ValueError, match="pooled-KV engine"):
        second.import_prefix([])
    alone, _ = _pair("fcfs")
    assert alone.import_prefix([]) == 0 and alone.kv_block_counts() == (63, 0, 0)
