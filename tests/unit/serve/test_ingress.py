"""The ingress's links to Ray: CPU-plane events to an engine in order, engine poll answers applied."""

from __future__ import annotations

import time
from typing import Any

from mars_openhands.control.app import Gateway
from mars_openhands.serve.config import ServeConfig
from mars_openhands.serve.ingress import GatewayIngress, HandlePublisher, gateway_config
from mars_openhands.stream.events import EngineStep, ToolStart, now_stamps


class FakeResponse:
    def __init__(self, handle: FakeHandle, events: list[Any]) -> None:
        self.handle, self.events, self.is_cancelled = handle, events, False

    def result(self, timeout_s: float) -> int:
        if self.handle.is_down:
            raise TimeoutError("replica being replaced")
        time.sleep(0.01)  # a slow call: later events queue behind it
        self.handle.batches.append(self.events)
        return len(self.events)

    def cancel(self) -> None:
        self.is_cancelled = True
        self.handle.num_cancelled += 1


class FakeHandle:
    """A deployment handle's ``post_events.remote(events)``."""

    def __init__(self) -> None:
        self.batches: list[list[Any]] = []
        self.is_down = False
        self.num_cancelled = 0
        self.post_events = self

    def remote(self, events: list[Any]) -> FakeResponse:
        return FakeResponse(self, events)


def tool_start(i: int) -> ToolStart:
    return ToolStart(**now_stamps(), source="agent", session_id="s", tool_name="bash",
                     tool_call_id=f"t{i}", queue_wait_s=0.0)


def _wait(predicate: Any) -> None:
    deadline = time.monotonic() + 10
    while not predicate():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.01)


def test_events_reach_the_engine_in_order_in_batches() -> None:
    handle = FakeHandle()
    publisher = HandlePublisher(handle, "engine-0")
    for i in range(50):
        publisher.emit(tool_start(i))
    _wait(lambda: sum(map(len, handle.batches)) == 50)
    sent = [e.tool_call_id for batch in handle.batches for e in batch]
    assert sent == [f"t{i}" for i in range(50)]
    assert len(handle.batches) < 50  # queued events travel together
    publisher.close()


def test_a_replica_being_replaced_drops_and_cancels() -> None:
    handle = FakeHandle()
    handle.is_down = True
    publisher = HandlePublisher(handle, "engine-0")
    publisher.emit(tool_start(0))
    _wait(lambda: publisher.num_dropped == 1)
    assert handle.num_cancelled == 1 and not handle.batches  # never delivered to the successor
    publisher.close()


def test_a_poll_answer_moves_the_replica_and_feeds_its_events() -> None:
    config = ServeConfig(num_replicas=2)
    ingress = GatewayIngress.__new__(GatewayIngress)  # no threads: only _deliver is exercised
    ingress.gateway = Gateway(gateway_config(config, ["http://10.0.0.1:8001",
                                                      "http://10.0.0.2:8001"], None))
    step = EngineStep(**now_stamps(), source="engine:1", num_gpu_blocks=100, num_used_blocks=40,
                      num_free_blocks=60, num_running=1, num_waiting=0)
    ingress._deliver(1, {"url": "http://10.0.0.3:9000", "events": [step]})
    replica = ingress.gateway.router.replicas[1]
    assert replica.url == "http://10.0.0.3:9000"
    assert replica.kv_usage_step == 0.4
    assert ingress.gateway.router.replicas[0].url == "http://10.0.0.1:8001"


def test_a_replica_ray_replaced_is_an_event_in_the_stream() -> None:
    from mars_openhands.control.hub import EventHub
    from mars_openhands.stream.transport import ListSink

    config = ServeConfig(num_replicas=2)
    ingress = GatewayIngress.__new__(GatewayIngress)  # no threads: only _deliver is exercised
    ingress.gateway = gateway = Gateway(gateway_config(config, ["http://10.0.0.1:8001",
                                                                "http://10.0.0.2:8001"], None))
    sink = ListSink()
    gateway.hub = EventHub(gateway.config, sink)
    info = {"url": "http://10.0.0.3:9000", "events": [], "incarnation": "new0000000ab"}
    ingress._deliver(1, info)  # a poll answer of the same actor: no event
    assert sink.events == []
    ingress._deliver(1, info, replaced_incarnation="old0000000ab")
    [event] = sink.events
    assert event.kind == "replica_replaced" and event.source == "gateway"
    assert (event.replica, event.url) == ("engine-1", "http://10.0.0.3:9000")
    assert (event.previous_incarnation, event.incarnation) == ("old0000000ab", "new0000000ab")
