"""The gateway's ZeroMQ channels (docs/gateway.md, "Engine contract"), over real sockets.

* CPU-plane events of a session reach the scheduler plugin of the replica holding it: the engine
  side is a ``ZmqEventCollector`` bound at the replica's ``events_address``, drained like the
  plugin does (a deque).
* GPU-plane events from engines reach the gateway's collector, are recorded, and ``engine_step``
  drives the KV usage the admission window sees.
"""

from __future__ import annotations

import collections

import httpx
from gateway_helpers import chat, event, fast_config, post_events, state, wait_until

from mars_openhands.control.config import ReplicaConfig
from mars_openhands.control.server import GatewayServer
from mars_openhands.stream.events import EngineStep, now_stamps
from mars_openhands.stream.transport import ListSink, ZmqEventCollector, ZmqEventPublisher


def test_cpu_events_are_forwarded_to_the_replica_holding_the_session(clean_fakes, tmp_path) -> None:
    inboxes = [collections.deque(), collections.deque()]
    addresses = [f"ipc://{tmp_path}/r{i}.sock" for i in range(2)]
    collectors = [ZmqEventCollector(a, inboxes[i].append) for i, a in enumerate(addresses)]
    try:
        config = fast_config([f.url for f in clean_fakes]).model_copy(update={"replicas": tuple(
            ReplicaConfig(url=f.url, events_address=a) for f, a in zip(clean_fakes, addresses,
                                                                         strict=True))})
        with GatewayServer(config, ListSink()) as server:
            with httpx.Client(base_url=server.url, timeout=10) as client:
                where = {sid: client.post("/v1/chat/completions", json=chat(sid)).headers[
                    "x-mars-replica"] for sid in ("fw-a", "fw-b")}
                assert sorted(where.values()) == ["r0", "r1"]
                r = post_events(client, [
                    event("tool_start", "fw-a", tool_name="pytest", tool_call_id="1"),
                    event("tool_end", "fw-a", tool_name="pytest", tool_call_id="1",
                          duration_s=3.0),
                    event("session_end", "fw-a")])
                assert r.status_code == 200
                r = post_events(client, [event("tool_start", "fw-b", tool_name="ls",
                                               tool_call_id="2")])
                assert r.status_code == 200
            index = {name: int(name[1]) for name in where.values()}
            a_inbox, b_inbox = inboxes[index[where["fw-a"]]], inboxes[index[where["fw-b"]]]
            wait_until(lambda: len(a_inbox) == 3 and len(b_inbox) == 1, what="forwarded events")
            assert [e.kind for e in a_inbox] == ["tool_start", "tool_end", "session_end"]
            assert all(e.session_id == "fw-a" for e in a_inbox)
            assert b_inbox[0].tool_name == "ls" and b_inbox[0].session_id == "fw-b"
    finally:
        for c in collectors:
            c.stop()


def test_engine_step_events_drive_kv_usage_and_are_recorded(clean_fakes) -> None:
    sink = ListSink()
    # One /metrics poll at start (KV 0.0), then none for 30 s: the steps are the newer samples.
    config = fast_config([clean_fakes[0].url], engine_events_address="tcp://127.0.0.1:*",
                         admission={"window_max": 8, "window_init": 8, "window_min": 2},
                         engine_step_max_age_s=30.0, poll_interval_s=30.0)
    with GatewayServer(config, sink) as server:
        address = server.gateway.engine_events_address
        assert address is not None and not address.endswith("*")
        with ZmqEventPublisher(address, flush_interval_s=0.01) as publisher:
            def step(used: int) -> EngineStep:
                return EngineStep(**now_stamps(), source="engine:0", num_gpu_blocks=100,
                                  num_used_blocks=used, num_free_blocks=100 - used,
                                  num_running=1, num_waiting=0)

            wait_until(lambda: (publisher.emit(step(95)), state(server)["is_kv_overloaded"])[1],
                       what="engine_step KV overload")
            assert state(server)["kv_usage"] == 0.95
            wait_until(lambda: state(server)["window"] == 2, what="window at W_min")
            publisher.emit(step(10))
            wait_until(lambda: state(server)["window"] == 8, what="window regrown")
    steps = [e for e in sink.events if e.kind == "engine_step"]
    assert steps and steps[0].source == "engine:0"


def test_an_idle_released_session_ends_on_its_replica_too(clean_fakes, tmp_path) -> None:
    """Issue 16 kind 1, engine side: a dead agent's session that idles out gets a recorded
    ``session_end`` (status ``idle_timeout``, from the gateway) forwarded to the replica holding
    it, so the engine's scheduler releases the KV it keeps for that session's next turn."""
    inbox: collections.deque = collections.deque()
    address = f"ipc://{tmp_path}/r0.sock"
    collector = ZmqEventCollector(address, inbox.append)
    sink = ListSink()
    try:
        config = fast_config([clean_fakes[0].url], session_idle_timeout_s=0.3).model_copy(update={
            "replicas": (ReplicaConfig(url=clean_fakes[0].url, events_address=address),)})
        with GatewayServer(config, sink) as server:
            assert httpx.post(f"{server.url}/v1/chat/completions", json=chat("idle-a"),
                              timeout=10).status_code == 200
            # The agent dies here: no more requests or events, no session_end.
            wait_until(lambda: any(e.kind == "session_end" for e in inbox), what="forwarded end")
            assert "idle-a" not in state(server)["sessions"]
    finally:
        collector.stop()
    ends = [e for e in sink.events if e.kind == "session_end"]
    assert [(e.session_id, e.source, e.status) for e in ends] == [("idle-a", "gateway", "idle_timeout")]
    assert "session_idle_timeout_s" in (ends[0].error or "")
    assert [(e.kind, e.session_id, e.status) for e in inbox] == [("session_end", "idle-a", "idle_timeout")]
