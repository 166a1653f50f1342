"""A prefix sent from one in-process engine to another (the simulator's KV transfer on a move,
``InprocEngine.import_prefix``): it is a prefix hit there, held for its request until the request
holds it, dropped when the engine is short of KV, never more than the free blocks, nothing leaked."""

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


def _computed_on(engine: InprocEngine, appended: int, output: int) -> tuple[object, list]:
    """Session ``s``'s first turn run to its end on ``engine``: its stream and the block hashes of
    the prefix ``engine`` holds cached (what a transfer sends)."""
    stream = engine.stream("s")
    add_stream_turn(engine, stream, "s#0", appended, output)
    _drain(engine)
    return stream, stream.block_hashes[:engine.cached_prefix_blocks(stream.block_hashes)]


@pytest.mark.parametrize("policy", ["fcfs", "MarsScheduler"])
def test_an_imported_prefix_is_a_hit_and_is_held_until_its_request_holds_it(policy: str) -> None:
    a, b = _pair(policy)
    stream, hashes = _computed_on(a, 500, 20)
    sent = len(hashes)
    assert sent == (500 + 20) // BS and b.cached_prefix_blocks(stream.block_hashes) == 0
    assert b.import_prefix("s#1", hashes) == sent
    free_before = b.kv_block_counts()[0]
    assert free_before == 63 - sent, "held for its request: not free, so not evictable"
    add_stream_turn(b, stream, "s#1", 100, 10, t_s=1.0)
    record = b.step()
    assert record.new_request_cached_tokens["s#1"] == sent * BS, "the whole import is a hit"
    _drain(b)
    assert b.kv_block_counts()[2] == 0 and b.assert_no_leaks()["used"] == 0
    assert b.cached_prefix_blocks(stream.block_hashes) >= sent, "and stays cached after the turn"


def test_an_import_takes_only_the_free_blocks_above_the_watermark_and_the_cached_head_is_reused() -> None:
    a, b = _pair("fcfs", blocks=200)
    _, hashes = _computed_on(a, 1500, 20)
    other = b.stream("o")
    add_stream_turn(b, other, "o#0", 1800, 50)  # b now holds 116+ blocks for a running request
    b.step()
    free, _, used = b.kv_block_counts()
    watermark = int(b.scheduler.kv_cache_manager.watermark_blocks)
    landed = b.import_prefix("s#1", hashes)
    assert landed == min(len(hashes), free - watermark) < len(hashes)
    assert b.kv_block_counts()[0] == free - landed
    b.step()  # s#1 was never added: its import is dropped at the next step (o#0 decodes on)
    assert b.kv_block_counts()[0] >= free - 1
    _drain(b)
    b.shutdown()
    assert b.assert_no_leaks()["used"] == 0


def test_held_imports_are_dropped_when_the_engine_is_short_of_kv_and_on_shutdown() -> None:
    a, b = _pair("fcfs", blocks=64)
    _, hashes = _computed_on(a, 600, 10)
    assert b.import_prefix("s#1", hashes) == len(hashes)
    with pytest.raises(ValueError, match="already has a KV import"):
        b.import_prefix("s#1", hashes)
    # A request too large to run now: the step schedules nothing, so the held import is freed
    # (still cached: a later request may hit it if nothing evicted it).
    big = b.stream("big")
    add_stream_turn(b, big, "big#0", 63 * BS - 8, 8)
    assert b.kv_block_counts()[0] == 63 - len(hashes)
    assert b.step().is_empty
    assert b.kv_block_counts() == (63, 0, 0)
    assert b.cached_prefix_blocks(hashes) == len(hashes)
    c = InprocEngine("fcfs", InprocEngineParams(num_gpu_blocks=64, max_model_len=4096))
    assert c.import_prefix("x#1", hashes) == len(hashes)
    c.shutdown()
    assert c.kv_block_counts()[0] == 63 and c.assert_no_leaks()["used"] == 0
