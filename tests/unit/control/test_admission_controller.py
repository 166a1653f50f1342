"""The gateway's admission controller over the pure policies (control/admission.py)."""

from __future__ import annotations

import asyncio

import pytest

from mars_openhands.control.admission import AdmissionController, AdmissionTimeoutError
from mars_openhands.policy.admission import AdmissionParams, PressureSnapshot
from mars_openhands.policy.reorder import ReorderParams

PARAMS = AdmissionParams(window_max=3, window_init=2, window_min=1)
HEALTHY = PressureSnapshot(num_tool_workers=100)
OVERLOADED = PressureSnapshot(tool_backlog_ratio=10.0, num_tool_workers=100)


def run(coro):
    return asyncio.run(coro)


def test_fast_path_then_wait_then_release_admits_shortest() -> None:
    async def scenario() -> None:
        ac = AdmissionController(PARAMS, ReorderParams(fcfs_when_unpressured=False))
        await ac.acquire("a", 0.0, 100, None, 1.0)
        await ac.acquire("b", 0.0, 100, None, 1.0)
        assert ac.admitted == {"a", "b"} and not ac.can_admit_now()
        long = asyncio.create_task(ac.acquire("long", 1.0, 10_000, None, 5.0))
        short = asyncio.create_task(ac.acquire("short", 2.0, 10, None, 5.0))
        await asyncio.sleep(0)
        assert ac.num_waiting == 2
        ac.release("a", 3.0)
        await asyncio.wait_for(short, 1.0)
        await asyncio.sleep(0.01)
        assert not long.done()
        assert ac.admitted == {"b", "short"}
        ac.release("b", 4.0)
        await asyncio.wait_for(long, 1.0)
        assert ac.admitted == {"short", "long"} and ac.num_waiting == 0

    run(scenario())


def test_tick_grows_window_and_admits_waiters() -> None:
    async def scenario() -> None:
        ac = AdmissionController(PARAMS, ReorderParams())
        for sid in ("a", "b"):
            await ac.acquire(sid, 0.0, 1, None, 1.0)
        waiter = asyncio.create_task(ac.acquire("c", 0.0, 1, None, 5.0))
        await asyncio.sleep(0)
        assert not waiter.done()
        d = ac.tick(HEALTHY, 1.0)
        assert d.state.window == 3
        await asyncio.wait_for(waiter, 1.0)
        d = ac.tick(OVERLOADED, 2.0)  # shrinking never evicts admitted sessions
        assert d.state.window == 2 and len(ac.admitted) == 3

    run(scenario())


def test_timeout_and_cancel_leave_no_waiter() -> None:
    async def scenario() -> None:
        ac = AdmissionController(PARAMS, ReorderParams())
        for sid in ("a", "b"):
            await ac.acquire(sid, 0.0, 1, None, 1.0)
        with pytest.raises(AdmissionTimeoutError, match="waited 0.1 s"):
            await ac.acquire("c", 0.0, 1, None, 0.1)
        assert ac.num_waiting == 0
        task = asyncio.create_task(ac.acquire("d", 0.0, 1, None, 5.0))
        await asyncio.sleep(0)
        assert ac.num_waiting == 1
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        assert ac.num_waiting == 0 and "d" not in ac.admitted

    run(scenario())


def test_disabled_admits_everyone_but_still_computes_window() -> None:
    async def scenario() -> None:
        ac = AdmissionController(PARAMS, ReorderParams(), enabled=False)
        for i in range(10):
            await ac.acquire(f"s{i}", 0.0, 1, None, 0.1)
        assert len(ac.admitted) == 10
        assert ac.tick(OVERLOADED, 1.0).state.window == 1

    run(scenario())
