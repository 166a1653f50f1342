"""Admission under injected pressure, and replica failures, against fake replicas.

The window must shrink when the tool backlog or KV usage crosses its set threshold, hold while the
signal sits between the thresholds (hysteresis), and grow back once it clears; the recorded stream
(``admission_update`` events) must show it. A killed replica must leave no hung request and no
leaked slot.
"""

from __future__ import annotations

import threading
import time

import httpx
from gateway_helpers import chat, event, post_events, state, wait_until

from mars_openhands.control.fake_engine import FakeEngineProcess

WINDOW = {"window_max": 8, "window_init": 8, "window_min": 2}


def updates(sink) -> list:
    return [e for e in sink.events if e.kind == "admission_update"]


def test_tool_backlog_shrinks_window_with_hysteresis(clean_fakes, gateway_factory) -> None:
    server, sink = gateway_factory([clean_fakes[0].url], admission={**WINDOW, "cpu_set_backlog_ratio": 4.0},
                                        num_tool_workers=4)  # the preview's H = 4
    with httpx.Client(base_url=server.url, timeout=10) as client:
        client.post("/v1/chat/completions", json=chat("cpu-a"))
        # rho = 16 in-flight tool calls / 4 workers >= 4: overload (C_cpu = ceil(4 * 2.5) = 10).
        post_events(client, [
            event("tool_enqueued", "cpu-a", tool_name="bash", tool_call_id=f"c{i}")
            for i in range(16)])
        wait_until(lambda: state(server)["window"] == 2, what="window at W_min")
        assert state(server)["is_cpu_overloaded"]
        # rho = 2: between clear (1) and set (4): stays overloaded, window stays at W_min.
        post_events(client, [
            event("tool_end", "cpu-a", tool_name="bash", tool_call_id=f"c{i}", duration_s=0.1)
            for i in range(8)])
        wait_until(lambda: any(u.tool_backlog_ratio == 2.0 for u in updates(sink)),
                   what="rho = 2 recorded (the signal moved: an update even though W holds)")
        time.sleep(0.5)  # ~10 ticks in the band
        band = [u for u in updates(sink) if u.tool_backlog_ratio == 2.0]
        assert band and all(u.cpu_overloaded and u.window == 2 for u in band)
        assert state(server)["is_cpu_overloaded"] and state(server)["window"] == 2
        assert len(band) <= 2  # nothing changed in the band: no update per tick
        # rho = 0: cleared; the window grows back one per tick to W_max.
        post_events(client, [
            event("tool_end", "cpu-a", tool_name="bash", tool_call_id=f"c{i}", duration_s=0.1)
            for i in range(8, 16)])
        wait_until(lambda: state(server)["window"] == 8, what="window back at W_max")
    windows = [u.window for u in updates(sink)]
    first_min = windows.index(2)
    assert windows[:first_min + 1] == sorted(windows[:first_min + 1], reverse=True)
    shrink = [w for i, w in enumerate(windows[:first_min + 1]) if i == 0 or windows[i - 1] != w]
    assert shrink == [8, 5, 3, 2]  # x0.7 per tick: floor(5.6), floor(3.5), max(W_min, 2)
    regrow = windows[windows.index(2, first_min):]
    steps = [b - a for a, b in zip(regrow, regrow[1:], strict=False) if b != a]
    assert steps and all(s == 1 for s in steps)  # additive increase, +1 per tick


def test_tool_wait_ema_sets_cpu_overload(clean_fakes, gateway_factory) -> None:
    server, _ = gateway_factory([clean_fakes[0].url], admission=WINDOW, num_tool_workers=100,
                                tool_wait_idle_decay=False)
    with httpx.Client(base_url=server.url, timeout=10) as client:
        client.post("/v1/chat/completions", json=chat("wait-a"))
        post_events(client, [
            event("tool_start", "wait-a", tool_name="bash", tool_call_id="w", queue_wait_s=9.0),
            event("tool_end", "wait-a", tool_name="bash", tool_call_id="w", duration_s=0.1)])
        wait_until(lambda: state(server)["is_cpu_overloaded"], what="overload from queue wait")
        assert state(server)["tool_wait_ema_s"] == 9.0


def test_the_cpu_cap_follows_the_share_of_time_in_tool_calls(clean_fakes, gateway_factory) -> None:
    """Two admitted sessions, one always in a tool call: f -> 1/2, so with 2 tool workers
    C_cpu = ceil(2 x 1.25 / f) = 5 (the preview's f = 1 would give 3); state and /metrics show f."""
    server, _ = gateway_factory([clean_fakes[0].url], admission=WINDOW, num_tool_workers=2)
    with httpx.Client(base_url=server.url, timeout=10) as client:
        for sid in ("frac-a", "frac-b"):
            assert client.post("/v1/chat/completions", json=chat(sid)).status_code == 200
        post_events(client, event("tool_start", "frac-a", tool_name="bash", tool_call_id="t"))
        wait_until(lambda: abs((state(server)["tool_fraction"] or 0.0) - 0.5) < 0.05,
                   what="tool fraction near 1/2")
        assert state(server)["cpu_cap"] in (5, 6)  # f just under 1/2: both were admitted before the call
        gauge = next(line for line in client.get("/metrics").text.splitlines()
                     if line.startswith("mars_tool_fraction "))
        assert abs(float(gauge.split()[1]) - 0.5) < 0.05


def test_kv_usage_shrinks_window_with_hysteresis(clean_fakes, gateway_factory) -> None:
    fake = clean_fakes[0]
    server, sink = gateway_factory([fake.url], admission=WINDOW)
    fake.configure(kv_usage=0.95)
    wait_until(lambda: state(server)["window"] == 2, what="window at W_min under KV pressure")
    assert state(server)["is_kv_overloaded"]
    fake.configure(kv_usage=0.87)  # between 0.85 and 0.90: stays overloaded
    wait_until(lambda: any(u.kv_usage == 0.87 for u in updates(sink)), what="0.87 observed")
    time.sleep(0.5)  # ~10 ticks in the band
    band = [u for u in updates(sink) if u.kv_usage == 0.87]
    assert band and all(u.kv_overloaded and u.window == 2 for u in band)
    assert state(server)["is_kv_overloaded"] and state(server)["window"] == 2
    fake.configure(kv_usage=0.5)
    wait_until(lambda: state(server)["window"] == 8, what="window back at W_max")
    assert not state(server)["is_kv_overloaded"]
    assert 'mars_replica_kv_usage{replica="r0"} 0.5' in httpx.get(f"{server.url}/metrics").text


def test_idle_gateway_records_only_heartbeats(clean_fakes, gateway_factory) -> None:
    server, sink = gateway_factory([clean_fakes[0].url], admission=WINDOW,
                                   admission_update_heartbeat_s=0.5)
    wait_until(lambda: updates(sink), what="first admission_update")
    time.sleep(1.6)  # ~32 ticks of 0.05 s, nothing changes
    idle = updates(sink)
    assert 3 <= len(idle) <= 6, [u.t_mono_ns for u in idle]  # first + a heartbeat per 0.5 s
    gaps_s = [(b.t_mono_ns - a.t_mono_ns) / 1e9 for a, b in zip(idle, idle[1:], strict=False)]
    assert all(g >= 0.45 for g in gaps_s), gaps_s
    # A change is recorded at the next tick, not at the next heartbeat.
    httpx.post(f"{server.url}/v1/chat/completions", json=chat("hb-1"), timeout=10)
    wait_until(lambda: any(u.num_admitted == 1 for u in updates(sink)), timeout_s=0.4,
               what="admission_update for the new session within a few ticks")


def test_killed_replica_reroutes_sessions_and_their_in_flight_requests(gateway_factory) -> None:
    with FakeEngineProcess() as a, FakeEngineProcess() as b:
        server, _ = gateway_factory([a.url, b.url], replica_failure_threshold=1)
        with httpx.Client(base_url=server.url, timeout=30) as client:
            placed = {sid: client.post("/v1/chat/completions", json=chat(sid)).headers[
                "x-mars-replica"] for sid in ("kill-1", "kill-2")}
            victim_sid = next(s for s, r in placed.items() if r == "r0")
            a.configure(delay_s=60.0)
            results: dict[str, httpx.Response] = {}
            t = threading.Thread(target=lambda: results.setdefault(
                "r", client.post("/v1/chat/completions", json=chat(victim_sid))))
            t.start()
            wait_until(lambda: a.seen()["num_active"] == 1, what="request in flight on r0")
            a.kill()
            t.join(timeout=10)
            assert not t.is_alive(), "request hung after its replica was killed"
            r = results["r"]  # re-run on the surviving replica: nothing had reached the agent
            assert r.status_code == 200, r.text
            assert r.headers["x-mars-replica"] == "r1" and r.headers["x-mars-turn"] == "1"
            # The session continues on the surviving replica with its next turn.
            r = client.post("/v1/chat/completions", json=chat(victim_sid))
            assert r.status_code == 200 and r.headers["x-mars-replica"] == "r1"
            assert r.headers["x-mars-turn"] == "2"
            st = state(server)
            assert not st["replicas"][0]["healthy"]
            assert all(s["in_flight"] == 0 for s in st["sessions"].values())
            assert st["replicas"][0]["in_flight"] == 0 and st["replicas"][1]["in_flight"] == 0
            b.kill()
            r = client.post("/v1/chat/completions", json=chat("kill-3"))
            assert r.status_code == 503 and "no healthy vLLM replica" in r.json()["error"]["message"]
            assert httpx.get(f"{server.url}/healthz").status_code == 503
            assert state(server)["num_admitted"] == 3  # kill-3 keeps its slot until idle/end
            assert state(server)["sessions"]["kill-3"]["in_flight"] == 0


def test_killed_replica_mid_stream_ends_with_sse_error(gateway_factory) -> None:
    with FakeEngineProcess() as a:
        server, _ = gateway_factory([a.url], replica_failure_threshold=1)
        a.configure(num_chunks=100, chunk_delay_s=0.1)
        with httpx.Client(base_url=server.url, timeout=30) as client:
            with client.stream("POST", "/v1/chat/completions",
                               json=chat("kill-s", stream=True)) as r:
                chunks = r.iter_raw()
                first = next(chunks)
                assert first.startswith(b"data: ")
                a.kill()
                rest = b"".join(chunks)
        assert b'"upstream_error"' in rest and b"r0" in rest
        wait_until(lambda: state(server)["sessions"]["kill-s"]["in_flight"] == 0, what="cleanup")


def test_restarted_replica_comes_back(gateway_factory) -> None:
    a = FakeEngineProcess().start()
    try:
        server, _ = gateway_factory([a.url])
        with httpx.Client(base_url=server.url, timeout=30) as client:
            assert client.post("/v1/chat/completions", json=chat("rs-1")).status_code == 200
            a.kill()
            wait_until(lambda: not state(server)["replicas"][0]["healthy"], what="marked down")
            a = FakeEngineProcess(port=a.port).start()
            wait_until(lambda: state(server)["replicas"][0]["healthy"], what="back up")
            r = client.post("/v1/chat/completions", json=chat("rs-1"))
            assert r.status_code == 200 and r.headers["x-mars-turn"] == "1"
    finally:
        a.kill()


def _stream_in_thread(client: httpx.Client, body: dict) -> tuple[threading.Thread, dict]:
    """POST ``body`` as a stream in a thread; the result holds its status, headers and bytes."""
    result: dict = {}

    def run() -> None:
        with client.stream("POST", "/v1/chat/completions", json=body) as r:
            result["status"], result["headers"] = r.status_code, dict(r.headers)
            result["body"] = b"".join(r.iter_raw())

    thread = threading.Thread(target=run)
    thread.start()
    return thread, result


def test_a_stream_whose_replica_dies_before_its_first_token_is_rerun_elsewhere(gateway_factory) -> None:
    """vLLM sends a stream's 200 headers before its first token: the gateway holds them until the
    first chunk, so a replica that dies while the turn queues or prefills is invisible to the agent
    (one normal stream from the next replica, the same turn)."""
    with FakeEngineProcess() as a, FakeEngineProcess() as b:
        server, sink = gateway_factory([a.url, b.url], replica_failure_threshold=1)
        with httpx.Client(base_url=server.url, timeout=30) as client:
            placed = {sid: client.post("/v1/chat/completions", json=chat(sid)).headers[
                "x-mars-replica"] for sid in ("pre-1", "pre-2")}
            victim = next(s for s, r in placed.items() if r == "r0")
            a.configure(delay_s=60.0)  # headers now, first token in a minute
            thread, result = _stream_in_thread(client, chat(victim, stream=True))
            wait_until(lambda: a.seen()["num_active"] == 1, what="the stream in flight on r0")
            time.sleep(0.2)  # r0's 200 headers have reached the gateway
            a.kill()
            thread.join(timeout=15)
            assert not thread.is_alive(), "stream hung after its replica was killed"
        assert result["status"] == 200
        assert result["headers"]["x-mars-replica"] == "r1" and result["headers"]["x-mars-turn"] == "1"
        body = result["body"]
        assert b"upstream_error" not in body, body
        assert body.count(b"data: ") == 4 and body.endswith(b"data: [DONE]\n\n"), body
        rerun = [r for r in b.seen()["requests"] if r["session_id"] == victim]
        assert [r["vllm_xargs"]["mars_turn"] for r in rerun] == [1]  # the same turn, once
        assert not [e for e in sink.events if e.kind == "aborted"]


def test_a_stream_past_the_hold_bound_ends_with_an_sse_error(gateway_factory) -> None:
    """Past ``stream_hold_s`` without a chunk the headers go out; a failure after that is the SSE
    error chunk naming the replica (the agent has a response under way)."""
    with FakeEngineProcess() as a, FakeEngineProcess() as b:
        server, _ = gateway_factory([a.url, b.url], replica_failure_threshold=1, stream_hold_s=0.2)
        with httpx.Client(base_url=server.url, timeout=30) as client:
            placed = {sid: client.post("/v1/chat/completions", json=chat(sid)).headers[
                "x-mars-replica"] for sid in ("hold-1", "hold-2")}
            victim = next(s for s, r in placed.items() if r == "r0")
            a.configure(delay_s=60.0)
            with client.stream("POST", "/v1/chat/completions", json=chat(victim, stream=True)) as r:
                assert r.status_code == 200 and r.headers["x-mars-replica"] == "r0"  # after 0.2 s
                a.kill()
                rest = b"".join(r.iter_raw())
        assert b'"upstream_error"' in rest and b"r0" in rest
