"""EngineWaker: wakes at once on demand and once per expiry that comes due."""

from __future__ import annotations

import threading
import time

from mars_openhands.engine.schedulers.waker import EngineWaker


def _wait_until(cond, timeout_s: float = 5.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while not cond() and time.monotonic() < deadline:
        time.sleep(0.005)
    return cond()


def test_without_a_wake_function_nothing_happens() -> None:
    waker = EngineWaker(lambda: 0.0, lambda: 0.0)
    waker.wake()  # no-op
    waker.set(None)
    assert waker.wake_fn is None and waker._watcher is None
    waker.stop()


def test_wakes_once_per_due_expiry_and_on_demand() -> None:
    now = [0.0]
    due = [float("inf")]
    calls: list[float] = []
    lock = threading.Lock()

    def wake() -> None:
        with lock:
            calls.append(now[0])

    waker = EngineWaker(lambda: now[0], lambda: due[0], poll_s=0.01)
    waker.set(wake)
    assert waker.wake_fn is wake
    try:
        waker.wake()
        assert calls == [0.0]
        due[0] = 5.0
        time.sleep(0.05)
        assert len(calls) == 1  # not due yet
        now[0] = 5.0
        assert _wait_until(lambda: len(calls) == 2)
        time.sleep(0.05)
        assert len(calls) == 2  # the same expiry wakes once
        due[0] = 6.0
        now[0] = 6.5
        assert _wait_until(lambda: len(calls) == 3)  # a new expiry wakes again
    finally:
        waker.stop()
    assert _wait_until(lambda: not waker._watcher.is_alive())
