"""ZeroMQ transport: delivery over ipc, never blocking without a collector, loopback only."""

from __future__ import annotations

import threading
import time
from pathlib import Path

import pytest
from stream_samples import sample_dict, sample_events

from mars_openhands.stream.events import EVENT_TYPES, Event, parse_event
from mars_openhands.stream.reader import iter_events
from mars_openhands.stream.recorder import StreamRecorder
from mars_openhands.stream.transport import (
    EventSink,
    ListSink,
    ZmqEventCollector,
    ZmqEventPublisher,
    check_address,
)

pytest.importorskip("zmq")
pytestmark = pytest.mark.timeout(120)  # a blocking send would hang; fail instead


def _wait_until(predicate, timeout_s: float) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.01)
    return predicate()


def _many_events(num_events: int) -> list[Event]:
    kinds = list(EVENT_TYPES)
    return [parse_event(sample_dict(kinds[i % len(kinds)], i)) for i in range(num_events)]


_PROBE = parse_event({**sample_dict("session_start"), "source": "probe"})


def _await_connection(publisher: ZmqEventPublisher, num_arrived) -> None:
    """Emit probe events until one arrives: PUSH with IMMEDIATE drops until it is connected."""

    def probe() -> bool:
        if num_arrived() > 0:
            return True
        publisher.emit(_PROBE)
        publisher.flush()
        time.sleep(0.02)
        return num_arrived() > 0

    assert _wait_until(probe, 5.0), "publisher never connected to the collector"


def test_publisher_to_collector_over_ipc(tmp_path: Path) -> None:
    events = _many_events(5000)
    sink = ListSink()
    with ZmqEventCollector(f"ipc://{tmp_path}/stream.sock", sink.emit) as collector:
        with ZmqEventPublisher(collector.address, batch_size_events=128) as publisher:
            _await_connection(publisher, lambda: len(sink.events))
            for event in events:
                publisher.emit(event)
        received = lambda: [e for e in sink.events if e.source != "probe"]  # noqa: E731
        assert _wait_until(lambda: len(received()) == len(events), 10.0), len(received())
    assert publisher.num_sent == publisher.num_emitted - publisher.num_dropped
    assert received() == events  # one publisher: order kept
    assert collector.num_invalid == 0


def test_two_publishers_into_a_recorder_over_tcp(tmp_path: Path) -> None:
    events = _many_events(1000)
    with StreamRecorder(tmp_path / "stream.jsonl") as recorder:
        with ZmqEventCollector("tcp://127.0.0.1:*", recorder.record) as collector:
            assert collector.address.startswith("tcp://127.0.0.1:")
            publishers = [ZmqEventPublisher(collector.address) for _ in range(2)]
            for publisher in publishers:
                _await_connection(publisher, lambda p=publisher: p.num_sent)
            for i, event in enumerate(events):
                publishers[i % 2].emit(event)
            for publisher in publishers:
                publisher.close()
            num_sent = sum(p.num_sent for p in publishers)
            assert _wait_until(lambda: recorder.num_events == num_sent, 10.0)
    received = [e for e in iter_events(tmp_path / "stream.parquet") if e.source != "probe"]
    assert sorted(e.t_mono_ns for e in received) == sorted(e.t_mono_ns for e in events)


def test_publisher_without_collector_never_blocks(tmp_path: Path) -> None:
    event = sample_events()[0]
    publisher = ZmqEventPublisher(f"ipc://{tmp_path}/nobody.sock", batch_size_events=64,
                                  max_buffered_events=1000, flush_interval_s=0.005, linger_s=0.0)
    start = time.perf_counter()
    for _ in range(20000):
        publisher.emit(event)
    emit_s = time.perf_counter() - start
    assert _wait_until(lambda: publisher.num_dropped == 20000, 5.0), publisher.num_dropped
    close_start = time.perf_counter()
    publisher.close()
    assert time.perf_counter() - close_start < 2.0
    assert publisher.num_sent == 0 and publisher.num_emitted == 20000
    assert emit_s < 5.0  # a blocking send would hang here forever, not merely be slow
    publisher.emit(event)  # after close: dropped, not raised
    assert publisher.num_dropped == 20001


def test_full_buffer_drops_instead_of_growing(tmp_path: Path) -> None:
    publisher = ZmqEventPublisher(f"ipc://{tmp_path}/x.sock", max_buffered_events=10,
                                  batch_size_events=1000, flush_interval_s=60.0, linger_s=0.0)
    try:
        for event in _many_events(25):
            publisher.emit(event)
        assert publisher.num_dropped == 15  # the sender thread sleeps; 10 fit in the buffer
    finally:
        publisher.close()
    assert publisher.num_dropped == 25


def test_collector_skips_invalid_lines_and_callback_errors(tmp_path: Path) -> None:
    import zmq

    received: list[Event] = []

    def on_event(event: Event) -> None:
        if event.kind == "tool_end":
            raise RuntimeError("boom")
        received.append(event)

    by_kind = {e.kind: e for e in sample_events()}
    first, tool_end, last = by_kind["queued"], by_kind["tool_end"], by_kind["admission_update"]
    with ZmqEventCollector(f"ipc://{tmp_path}/c.sock", on_event) as collector:
        context = zmq.Context()
        push = context.socket(zmq.PUSH)
        push.connect(collector.address)
        batch = "\n".join([first.model_dump_json(), '{"kind": "nope"}',
                           tool_end.model_dump_json(), last.model_dump_json()])
        push.send(batch.encode())
        assert _wait_until(lambda: collector.num_received == 3, 5.0)
        push.close(linger=0)
        context.term()
    assert received == [first, last]
    assert collector.num_invalid == 1 and collector.num_callback_errors == 1


@pytest.mark.parametrize("address", ["tcp://0.0.0.0:5555", "tcp://10.0.0.1:1", "ipc://", "inproc://x",
                                     "tcp://127.0.0.2:1"])
def test_non_loopback_addresses_are_refused(address: str) -> None:
    with pytest.raises(ValueError, match="loopback"):
        check_address(address)
    with pytest.raises(ValueError, match="loopback"):
        ZmqEventCollector(address, print)


def test_bind_conflict_raises_in_constructor(tmp_path: Path) -> None:
    import zmq

    with ZmqEventCollector("tcp://127.0.0.1:*", print) as first:
        with pytest.raises(zmq.ZMQError):
            ZmqEventCollector(first.address, print)


def test_sinks_satisfy_the_protocol(tmp_path: Path) -> None:
    sink = ListSink()
    threads = [threading.Thread(target=lambda: [sink.emit(e) for e in sample_events()])
               for _ in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert len(sink.events) == 4 * len(EVENT_TYPES)
    assert isinstance(sink, EventSink)
    with StreamRecorder(tmp_path / "s.jsonl", write_parquet=False) as recorder:
        assert isinstance(recorder, EventSink)


def test_an_ipc_inbox_is_connectable_by_its_owner_only(tmp_path: Path) -> None:
    """Connecting to a Unix socket needs write permission on its file: mode 0600 keeps other
    users (a group-writable umask included) from pushing forged events into an inbox."""
    import os

    old = os.umask(0o002)
    try:
        with ZmqEventCollector(f"ipc://{tmp_path}/inbox.sock", ListSink().emit):
            assert (tmp_path / "inbox.sock").stat().st_mode & 0o777 == 0o600
    finally:
        os.umask(old)
