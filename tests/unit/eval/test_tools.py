"""The replay's tool pool: bounded concurrency, FIFO queue waits, events, real CPU burn.

Queue waits are hand-computed for 2 workers and five calls enqueued together at t = 0 with
durations (0.3, 0.1, 0.2, 0.2, 0.1) s, served first-in first-out::

    worker 1: c0 [0.0, 0.3)                c3 [0.3, 0.5)
    worker 2: c1 [0.0, 0.1)  c2 [0.1, 0.3)  c4 [0.3, 0.4)

    queue waits: c0 0, c1 0, c2 0.1, c3 0.3, c4 0.3; everything done at 0.5 s.
"""

from __future__ import annotations

import asyncio
import os
import time
from pathlib import Path

import pytest

from eval.tools import ToolPool
from mars_openhands.stream.transport import ListSink

# Long enough that scheduling jitter on a loaded 2-core machine (tens of ms) stays inside the
# tolerance while a wrong queue order (>= 0.4 s off) does not.
DURATIONS_S = (1.2, 0.4, 0.8, 0.8, 0.4)
EXPECTED_WAITS_S = (0.0, 0.0, 0.4, 1.2, 1.2)
TOLERANCE_S = 0.15


async def _run_five(sink: ListSink) -> tuple[list, float, int]:
    async with ToolPool(2, "sleep", emit=sink.emit) as pool:
        t0 = time.monotonic()
        results = await asyncio.gather(
            *(pool.run(f"s{i}", 3, "pytest", d) for i, d in enumerate(DURATIONS_S)))
        return results, time.monotonic() - t0, pool.max_num_running


def test_sleep_mode_queue_waits_match_the_hand_computed_fifo_schedule() -> None:
    sink = ListSink()
    results, makespan_s, max_running = asyncio.run(_run_five(sink))
    assert max_running == 2
    for result, wait_s, duration_s in zip(results, EXPECTED_WAITS_S, DURATIONS_S, strict=True):
        assert result.queue_wait_s == pytest.approx(wait_s, abs=TOLERANCE_S)
        assert result.duration_s == pytest.approx(duration_s, abs=TOLERANCE_S)
        assert result.duration_s >= duration_s - 0.005
        assert result.status == "ok" and result.cpu_time_s == 0.0
    assert makespan_s == pytest.approx(2.0, abs=2 * TOLERANCE_S)


def test_events_per_call_are_enqueued_start_end_with_matching_fields() -> None:
    sink = ListSink()
    results, _, _ = asyncio.run(_run_five(sink))
    for i, result in enumerate(results):
        events = [e for e in sink.events if e.session_id == f"s{i}"]
        assert [e.kind for e in events] == ["tool_enqueued", "tool_start", "tool_end"]
        assert all(e.turn == 3 and e.tool_name == "pytest" and e.tool_call_id == f"s{i}:3"
                   and e.source == "replay" for e in events)
        enqueued, start, end = events
        assert start.queue_wait_s == result.queue_wait_s
        assert end.duration_s == result.duration_s and end.status == "ok"
        assert enqueued.t_mono_ns <= start.t_mono_ns <= end.t_mono_ns
        # The timestamps agree with the measured wait and duration.
        assert (start.t_mono_ns - enqueued.t_mono_ns) / 1e9 == pytest.approx(result.queue_wait_s,
                                                                              abs=0.01)
        assert (end.t_mono_ns - start.t_mono_ns) / 1e9 == pytest.approx(result.duration_s,
                                                                         abs=0.01)


def test_in_flight_counts_queued_and_running_calls() -> None:
    async def scenario() -> tuple[int, int, int]:
        async with ToolPool(1, "sleep") as pool:
            calls = [asyncio.create_task(pool.run(f"s{i}", 0, "t", 0.2)) for i in range(3)]
            await asyncio.sleep(0.05)
            in_flight, running = pool.num_in_flight, pool.num_running
            await asyncio.gather(*calls)
            return in_flight, running, pool.num_in_flight

    assert asyncio.run(scenario()) == (3, 1, 0)


def _cpu_s_of(pid: int) -> float:
    """utime + stime of ``pid`` from /proc, in seconds (independent of what the worker reports)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


@pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="needs Linux /proc")
def test_cpu_mode_burns_cpu_in_worker_processes() -> None:
    duration_s = 0.4

    async def scenario() -> tuple[list, list[int], list[float], list[float]]:
        # burn_clock="cpu" makes the check robust on a loaded machine: each call must use
        # duration_s of CPU time, which /proc confirms independently of the worker's own report.
        async with ToolPool(2, "cpu", burn_clock="cpu") as pool:
            pids = pool.worker_pids
            before = [_cpu_s_of(p) for p in pids]
            results = await asyncio.gather(*(pool.run(f"s{i}", 0, "pytest", duration_s)
                                             for i in range(2)))
            after = [_cpu_s_of(p) for p in pids]
        return results, pids, before, after

    results, pids, before, after = asyncio.run(scenario())
    assert len(set(pids)) == 2 and os.getpid() not in pids
    for result in results:
        assert result.cpu_time_s >= 0.8 * duration_s
        assert result.duration_s >= 0.8 * duration_s
    burned_s = sum(a - b for a, b in zip(after, before, strict=True))
    assert burned_s >= 0.8 * 2 * duration_s, (before, after)


def test_cpu_mode_wall_clock_ends_on_time_and_close_kills_the_workers() -> None:
    async def scenario() -> tuple[list, list[int]]:
        async with ToolPool(2, "cpu", burn_clock="wall") as pool:
            pids = pool.worker_pids
            results = await asyncio.gather(*(pool.run(f"s{i}", 0, "t", 0.2) for i in range(3)))
        return results, pids

    results, pids = asyncio.run(scenario())
    for result in results:
        assert result.duration_s == pytest.approx(0.2, abs=0.15) and result.status == "ok"
        assert result.cpu_time_s > 0.0
    assert results[2].queue_wait_s >= 0.15  # the third call waited for a worker
    for pid in pids:
        assert not Path(f"/proc/{pid}").exists() or "Z" in Path(f"/proc/{pid}/stat").read_text()


def test_close_cancels_queued_calls_and_stops_a_running_burn_at_once() -> None:
    async def scenario() -> tuple[bool, float]:
        pool = await ToolPool(1, "cpu").start()
        running = asyncio.create_task(pool.run("a", 0, "t", 30.0))
        queued = asyncio.create_task(pool.run("b", 0, "t", 30.0))
        await asyncio.sleep(0.2)
        t0 = time.monotonic()
        await pool.close()
        await asyncio.gather(running, queued, return_exceptions=True)
        return queued.cancelled(), time.monotonic() - t0

    queued_cancelled, close_s = asyncio.run(scenario())
    assert queued_cancelled
    assert close_s < 5.0


def test_run_before_start_and_bad_arguments_raise() -> None:
    with pytest.raises(ValueError, match="num_workers must be >= 1"):
        ToolPool(0)
    with pytest.raises(ValueError, match="unknown tool mode 'gpu'"):
        ToolPool(1, "gpu")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="unknown burn_clock"):
        ToolPool(1, "cpu", burn_clock="cycles")  # type: ignore[arg-type]

    async def not_started() -> None:
        await ToolPool(1).run("s", 0, "t", 0.1)

    with pytest.raises(RuntimeError, match="not running"):
        asyncio.run(not_started())

    async def negative() -> None:
        async with ToolPool(1) as pool:
            await pool.run("s", 0, "t", -1.0)

    with pytest.raises(ValueError, match="duration_s must be >= 0"):
        asyncio.run(negative())
