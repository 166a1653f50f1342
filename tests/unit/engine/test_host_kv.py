"""The host-memory KV tier: vLLM's OffloadingConnector (scheduler side unchanged) over emulated
copies, driven by the in-process engine on a virtual clock.

Each scenario is small and built by hand: session ``a`` runs a turn, session ``b`` pushes ``a``'s
blocks out of the GPU's prefix cache, and ``a``'s next turn finds its prefix on the host. The three
tests issue 31 asks for fail when a copy is free, when copies do not slow a step, or when a host
hit is loaded before vLLM schedules the request.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import pytest

pytest.importorskip("vllm")

from mars_openhands.engine.harness.inproc_engine import (  # noqa: E402
    EngineStepRecord,
    InprocEngine,
    InprocEngineParams,
    SessionTokenStream,
)
from mars_openhands.engine.harness.offload.copies import (  # noqa: E402
    CopyStreams,
    Direction,
    slowed_step_s,
)
from mars_openhands.engine.harness.offload.params import HostKvParams  # noqa: E402

BS = 16
BLOCK_BYTES = 1 << 20
"""Bytes of one GPU block in these scenarios (1 MiB: a 20-block prefix copies in ~0.42 ms)."""
WORK_S = 0.01
"""Every step's modelled GPU work (seconds)."""


@dataclass
class _Clock:
    """The virtual clock, the steps run (start, end, record) and the sessions' token streams."""

    now_s: float = 0.0
    steps: list[tuple[float, float, EngineStepRecord]] = field(default_factory=list)
    streams: dict[str, SessionTokenStream] = field(default_factory=dict)

    def __call__(self) -> float:
        return self.now_s


def _engine(clock: _Clock, *, max_num_batched_tokens: int = 8192, **host: object) -> InprocEngine:
    params = HostKvParams(**{"size_gib": 1.0, "kv_bytes_per_block": BLOCK_BYTES, **host})
    return InprocEngine("fcfs", InprocEngineParams(
        num_gpu_blocks=40, max_model_len=4096, max_num_batched_tokens=max_num_batched_tokens,
        host_kv=params), clock=clock)


def _drive(engine: InprocEngine, clock: _Clock, until_rid: str | None = None) -> None:
    """Step as the simulator does (empty steps poll the copies; an idle engine waits for the next
    copy) until the engine is idle or ``until_rid`` finished."""
    for _ in range(10_000):
        if not engine.has_work():
            return
        start_s = clock.now_s
        record = engine.schedule()
        if record.is_empty:
            engine.update(record)
            if not record.loaded_ids:
                done_s = engine.next_copy_done_s()
                if math.isinf(done_s):
                    return
                clock.now_s = max(clock.now_s, done_s)
            continue
        clock.now_s = start_s + engine.step_s(WORK_S)
        engine.update(record)
        clock.steps.append((start_s, clock.now_s, record))
        if until_rid is not None and until_rid in record.finished_ids:
            return
    raise AssertionError("the engine did not go idle in 10,000 steps")


def _turn(engine: InprocEngine, clock: _Clock, session: str, rid: str, new_tokens: int,
          output_tokens: int) -> None:
    stream = clock.streams.setdefault(session, engine.stream(session))
    stream.append(new_tokens)
    prompt = len(stream)
    stream.append(output_tokens)
    engine.add_request(rid, stream, prompt, output_tokens, arrival_time_s=clock.now_s)


def _first_step(clock: _Clock, rid: str) -> tuple[float, float, EngineStepRecord]:
    return next(s for s in clock.steps if rid in s[2].num_scheduled_tokens)


def _copies(engine: InprocEngine, direction: Direction) -> list:
    assert engine.host_kv is not None
    return [d for d in engine.host_kv.worker.history if d.direction is direction]


def _evicting_scenario(clock: _Clock, engine: InprocEngine, b_output: int = 2) -> None:
    """a1 (320-token prompt) runs and is stored; b1 (560 tokens) takes the GPU's blocks."""
    _turn(engine, clock, "a", "a1", 320, 2)
    _drive(engine, clock)
    _turn(engine, clock, "b", "b1", 560, b_output)


def test_a_host_hit_costs_bytes_over_the_load_bandwidth() -> None:
    clock = _Clock()
    engine = _engine(clock)
    _evicting_scenario(clock, engine)
    _drive(engine, clock)
    _turn(engine, clock, "a", "a2", 32, 2)
    _drive(engine, clock)

    start_s, _, record = _first_step(clock, "a2")
    assert record.new_request_cached_tokens["a2"] == 320  # the host hit: a1's whole prompt
    (load,) = _copies(engine, Direction.LOAD)
    # The blocks b1 evicted from the GPU come from the host (the rest are still GPU-cached).
    assert load.num_bytes % BLOCK_BYTES == 0 and load.num_bytes >= 15 * BLOCK_BYTES
    expected_s = load.num_bytes / 50e9
    assert load.done_s - load.submit_s == pytest.approx(expected_s)
    # A free copy would let a2 run at once; it waits for the bytes to cross the link.
    assert start_s >= load.submit_s + expected_s
    stores = _copies(engine, Direction.STORE)
    assert stores and stores[0].done_s - stores[0].submit_s == pytest.approx(
        stores[0].num_bytes / 50e9)


def test_copies_slow_the_steps_they_overlap() -> None:
    clock = _Clock()
    engine = _engine(clock, copy_slowdown=2.0)
    _turn(engine, clock, "a", "a1", 320, 3)
    _drive(engine, clock)

    # a1's prompt blocks are stored at the start of the step after its prefill (vLLM defers
    # stores to the next step): that decode step overlaps the 20-block copy.
    (store,) = _copies(engine, Direction.STORE)
    (prefill, decode, last) = clock.steps
    busy_s = 20 * BLOCK_BYTES / 50e9
    assert store.submit_s == decode[0]
    assert prefill[1] - prefill[0] == pytest.approx(WORK_S)
    assert decode[1] - decode[0] == pytest.approx(slowed_step_s(WORK_S, busy_s, 2.0))
    assert decode[1] - decode[0] > WORK_S + busy_s / 4
    assert last[1] - last[0] == pytest.approx(WORK_S)


def test_copies_with_no_slowdown_leave_steps_alone() -> None:
    clock = _Clock()
    engine = _engine(clock, copy_slowdown=1.0)
    _turn(engine, clock, "a", "a1", 320, 3)
    _drive(engine, clock)
    assert [pytest.approx(end - start) for start, end, _ in clock.steps] == [WORK_S] * 3


def test_a_host_hit_loads_only_once_the_scheduler_schedules_the_request() -> None:
    clock = _Clock()
    engine = _engine(clock)
    _evicting_scenario(clock, engine, b_output=40)
    # b1 decodes for 40 steps holding ~37 of the 39 blocks; a2 arrives meanwhile and must wait.
    for _ in range(5):
        record = engine.schedule()
        clock.now_s += engine.step_s(WORK_S)
        engine.update(record)
    _turn(engine, clock, "a", "a2", 32, 2)
    _drive(engine, clock)

    b_end_s = next(end for _, end, r in clock.steps if "b1" in r.finished_ids)
    (load,) = _copies(engine, Direction.LOAD)
    # No prefetch (vllm#41784): the load starts when vLLM gives a2 GPU blocks, after b1 freed them.
    assert load.submit_s >= b_end_s
    start_s, _, record = _first_step(clock, "a2")
    assert start_s >= load.done_s
    assert record.new_request_cached_tokens["a2"] == 320


@pytest.mark.parametrize("eviction", ["lru", "arc"])
def test_host_capacity_evicts_and_a_small_tier_loses_the_hit(eviction: str) -> None:
    # 25 blocks of host memory: b1's 35 prompt blocks, stored 16 per prefill chunk, push a1's
    # 20 out (a store larger than the whole tier would be dropped instead).
    clock = _Clock()
    engine = _engine(clock, size_gib=25 * BLOCK_BYTES / (1 << 30), eviction=eviction,
                     max_num_batched_tokens=256)
    assert engine.scheduler.connector.scheduler.manager is not None  # vLLM's own manager
    _evicting_scenario(clock, engine)
    _drive(engine, clock)
    _turn(engine, clock, "a", "a2", 32, 2)
    _drive(engine, clock)
    _, _, record = _first_step(clock, "a2")
    assert record.new_request_cached_tokens["a2"] < 320  # with 1 GiB: 320 (the first test)
    assert not _copies(engine, Direction.LOAD) or _copies(engine, Direction.LOAD)[0].num_bytes < 20 * BLOCK_BYTES


def test_copy_streams_share_the_link_both_ways() -> None:
    streams = CopyStreams(50e9, 50e9, 83e9)
    streams.submit(Direction.STORE, 1, 50_000_000, 0.0)
    streams.submit(Direction.LOAD, 2, 50_000_000, 0.0)
    # Both at once: 41.5 GB/s each (83 both ways), not 50.
    assert streams.done_s(1) == pytest.approx(50e6 / 41.5e9)
    streams.advance(1.0)
    assert [d.job_id for d in streams.take_done()] == [1, 2]
    alone = CopyStreams(50e9, 50e9, 83e9)
    alone.submit(Direction.LOAD, 3, 50_000_000, 0.0)
    assert alone.done_s(3) == pytest.approx(1e-3)


def test_the_default_engine_has_no_host_tier() -> None:
    engine = InprocEngine("fcfs", InprocEngineParams(num_gpu_blocks=40))
    assert engine.host_kv is None and engine.scheduler.connector is None
    assert engine.step_s(0.25) == 0.25 and math.isinf(engine.next_copy_done_s())


@pytest.mark.parametrize("prompt_only", [True, False])
def test_a_decode_run_merges_only_while_the_tier_is_idle_and_ends_before_a_stored_chunk(
        prompt_only: bool) -> None:
    """A merged decode run with the tier: none while a1's prompt store is in flight; then, with
    vLLM's default (prompt blocks only), as long as the request allows; with every computed block
    stored, it ends at the step before the one whose tokens fill the next block (that step's
    ``build_connector_meta`` creates a store job)."""
    clock = _Clock()
    engine = _engine(clock, offload_prompt_only=prompt_only)
    _turn(engine, clock, "a", "a1", 320, 60)
    record = engine.schedule()  # the whole prompt: its 20 blocks are stored from the next step
    clock.now_s += engine.step_s(WORK_S)
    engine.update(record)
    assert engine.max_decode_run(64) == 1, "a store job is pending: no run"
    while engine.max_decode_run(64) == 1:
        assert engine.host_kv is not None and (engine.host_kv.is_busy() or clock.steps == [])
        record = engine.schedule()
        clock.now_s += engine.step_s(WORK_S)
        engine.update(record)
        clock.steps.append((0.0, clock.now_s, record))
    request = engine.request("a1")
    assert request is not None
    c = request.num_computed_tokens
    # keep_last with the tier: the finishing token takes a single step.
    by_request = request.max_tokens - request.num_output_tokens - 1
    expected = min(64, by_request) if prompt_only else min(64, by_request, 21 * BS - 1 - c)
    assert engine.max_decode_run(64) == expected
    assert prompt_only or c + expected == 21 * BS - 1


def test_a_step_proves_a_blocked_wait_only_while_the_tier_is_quiet() -> None:
    """A blocked run hides the waiting queue on the proof of the last single step (the probe).
    With the tier that step's host lookups must be the run's: a step with a store job pending or
    created proves nothing; once the copies are done, a blocked step is a probe again."""
    clock = _Clock()
    engine = _engine(clock)
    _evicting_scenario(clock, engine, b_output=40)
    _turn(engine, clock, "a", "a2", 32, 2)  # waits behind b1 (b1 holds ~37 of the 39 blocks)
    record = engine.schedule()  # b1's prefill: a store job of its prompt blocks is created
    clock.now_s += engine.step_s(WORK_S)
    engine.update(record)
    assert engine.probe is None
    assert engine.host_kv is not None
    num_busy = 0
    while engine.host_kv.is_busy() or num_busy == 0:
        record = engine.schedule()  # b1 decodes while its store copies; a2 waits
        assert "a2" not in record.num_scheduled_tokens
        assert engine.probe is None, "a step with a copy in flight proved a wait"
        clock.now_s += engine.step_s(WORK_S)
        engine.update(record)
        num_busy += 1
    record = engine.schedule()
    assert "a2" not in record.num_scheduled_tokens and engine.probe is not None
