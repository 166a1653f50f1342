"""CpuEventInbox: thread-safe FIFO of CPU-plane events, drained in bounded batches."""

from __future__ import annotations

import threading

import pytest

from mars_openhands.engine.schedulers.inbox import CpuEventInbox


def test_drain_is_fifo_and_bounded() -> None:
    inbox = CpuEventInbox(max_events_per_drain=2)
    assert not inbox and len(inbox) == 0 and list(inbox.drain()) == []
    for i in range(5):
        inbox.post(i)
    assert inbox and len(inbox) == 5
    assert inbox.drain() == [0, 1] and inbox.drain() == [2, 3] and inbox.drain() == [4]
    assert not inbox


def test_posts_from_many_threads_are_all_drained() -> None:
    inbox = CpuEventInbox(max_events_per_drain=1000)
    threads = [threading.Thread(target=lambda t=t: [inbox.post((t, i)) for i in range(500)])
               for t in range(4)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    got = []
    while inbox:
        got.extend(inbox.drain())
    assert len(got) == 2000
    for t in range(4):  # per-thread order is kept
        assert [i for tt, i in got if tt == t] == list(range(500))


def test_bad_bound_names_the_setting() -> None:
    with pytest.raises(ValueError, match="max_inbox_events_per_step"):
        CpuEventInbox(0)


def test_close_without_listening_is_a_no_op() -> None:
    inbox = CpuEventInbox(1)
    assert not inbox.is_listening
    inbox.close()
    inbox.close()
