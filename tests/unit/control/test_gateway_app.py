"""The gateway end to end against fake vLLM replicas (subprocesses): proxying, metadata, failures.

Real HTTP on loopback, real uvicorn for the gateway, fake engines that behave like vLLM's OpenAI
server (including aborting a request whose client disconnects).
"""

from __future__ import annotations

import json
import time

import httpx
import pytest
from gateway_helpers import chat, event, owner, post_events, state, wait_until

from mars_openhands.control.proxy import DISCONNECT_WATCH_DELAY_S


def test_sessions_stick_to_a_replica_and_carry_metadata(clean_fakes, gateway_factory) -> None:
    server, _ = gateway_factory([f.url for f in clean_fakes])
    with httpx.Client(base_url=server.url, timeout=10) as client:
        replica_of: dict[str, set[str]] = {}
        for turn in range(3):
            for sid in ("stick-a", "stick-b", "stick-c"):
                r = client.post("/v1/chat/completions", json=chat(sid))
                assert r.status_code == 200, r.text
                assert r.json()["choices"][0]["message"]["content"] == "ok"
                assert r.headers["x-mars-turn"] == str(turn)
                replica_of.setdefault(sid, set()).add(r.headers["x-mars-replica"])
        assert all(len(v) == 1 for v in replica_of.values()), replica_of
        assert len(set().union(*replica_of.values())) == 2  # new sessions spread over both
        # The other session sources: OpenHands' header and prompt_cache_key.
        r = client.post("/v1/completions", json={"model": "fake", "prompt": "x"},
                        headers={"x-litellm-session-id": "stick-litellm"})
        assert r.status_code == 200 and r.headers["x-mars-session"] == "stick-litellm"
        r = client.post("/v1/chat/completions", json={**chat(), "prompt_cache_key": "stick-pck"})
        assert r.headers["x-mars-session"] == "stick-pck"
        # A tool that ended since the previous turn travels with the next turn.
        post_events(client, [  # binds stick-a to its token: its calls carry it from now on
            event("tool_start", "stick-a", tool_name="pytest", tool_call_id="t1"),
            event("tool_end", "stick-a", tool_name="pytest", tool_call_id="t1", duration_s=2.5)])
        client.post("/v1/chat/completions", json=chat("stick-a", mars_last_step=True),
                    headers=owner("stick-a"))
        one_turn = client.post("/v1/chat/completions", json=chat())
        assert one_turn.headers["x-mars-session"].startswith("one-turn-")
    seen = [r for f in clean_fakes for r in f.seen()["requests"]]
    a_turns = [r["vllm_xargs"] for r in seen if r["session_id"] == "stick-a"]
    assert [x["mars_turn"] for x in a_turns] == [0, 1, 2, 3]
    # From turn 1 on, the session's age since its first turn travels too (non-decreasing).
    ages = [x.pop("mars_session_age_s", None) for x in a_turns]
    assert ages[0] is None and all(a is not None for a in ages[1:])
    assert 0.0 <= ages[1] <= ages[2] <= ages[3] < 60.0
    assert a_turns[-1] == {"mars_turn": 3, "mars_last_step": 1, "mars_prev_tool": "pytest",
                           "mars_prev_tool_s": 2.5}
    assert all("mars_session" not in r["body"] for r in seen)
    assert seen[-1]["session_id"] is None and seen[-1]["vllm_xargs"] == {"mars_turn": 0}
    assert state(server)["num_admitted"] == 5  # one-turn sessions released their slots


def test_requests_without_tools_are_side_requests_not_turns(clean_fakes, gateway_factory) -> None:
    """The OpenHands app's title request (no tools, same session) takes no turn: the agent's turns
    stay 0, 1, 2 and the previous tool travels with the next agent turn, not with the title."""
    server, _ = gateway_factory([clean_fakes[0].url])
    sid = "side-a"
    with httpx.Client(base_url=server.url, timeout=10) as client:
        title = client.post("/v1/chat/completions", json=chat(sid, tools=None),
                            headers={"x-litellm-session-id": sid})
        assert title.status_code == 200 and title.headers["x-mars-side"] == "1"
        assert "x-mars-turn" not in title.headers
        assert client.post("/v1/chat/completions", json=chat(sid)).headers["x-mars-turn"] == "0"
        post_events(client, [
            event("tool_start", sid, tool_name="terminal", tool_call_id="t1"),
            event("tool_end", sid, tool_name="terminal", tool_call_id="t1", duration_s=1.5)])
        summary = client.post("/v1/chat/completions", json=chat(sid, tools=[], stream=True),
                              headers=owner(sid))
        assert summary.headers["x-mars-side"] == "1"
        assert client.post("/v1/chat/completions", json=chat(sid),
                           headers=owner(sid)).headers["x-mars-turn"] == "1"
        forced = client.post("/v1/chat/completions", json=chat(sid, tools=None, mars_side=0),
                             headers=owner(sid))
        assert forced.headers["x-mars-turn"] == "2"  # the agent's explicit mars_side wins
        bad = client.post("/v1/chat/completions", json=chat(sid, mars_side="maybe"),
                          headers=owner(sid))
        assert bad.status_code == 400 and "mars_side" in bad.json()["error"]["message"]
        raw = client.post("/v1/completions", json={"model": "fake", "prompt": "x"},
                          headers={"x-mars-session": sid, **owner(sid)})
        assert raw.headers["x-mars-turn"] == "3"  # a raw prompt carries no tools to judge by
        assert state(server)["sessions"][sid]["side_requests"] == 2
    xargs = [r["vllm_xargs"] for r in clean_fakes[0].seen()["requests"] if r["session_id"] == sid]
    # Every request after the first turn carries the session's age, side requests included.
    ages = [x.pop("mars_session_age_s", None) for x in xargs]
    assert [a is not None for a in ages] == [False, False, True, True, True, True]
    assert ages[2] <= ages[3] <= ages[4] <= ages[5]
    assert xargs == [{"mars_side": 1}, {"mars_turn": 0}, {"mars_side": 1},
                     {"mars_turn": 1, "mars_prev_tool": "terminal", "mars_prev_tool_s": 1.5},
                     {"mars_turn": 2}, {"mars_turn": 3}]
    assert all("mars_side" not in r["body"] for r in clean_fakes[0].seen()["requests"])


def test_replica_headers_are_relayed_and_a_refused_turn_is_not_counted(clean_fakes, gateway_factory) -> None:
    server, _ = gateway_factory([clean_fakes[0].url])
    with httpx.Client(base_url=server.url, timeout=10) as client:
        ok = client.post("/v1/chat/completions", json=chat("hdr"), headers={"x-request-id": "req-7"})
        assert ok.headers["x-request-id"] == "req-7" and ok.headers["x-mars-turn"] == "0"
        assert ok.headers["content-type"] == "application/json"
        assert len(ok.headers.get_list("date")) == 1 and len(ok.headers.get_list("server")) <= 1
        clean_fakes[0].configure(fail_status=400)
        refused = client.post("/v1/chat/completions", json=chat("hdr"))
        assert refused.status_code == 400 and refused.headers["x-mars-turn"] == "1"
        clean_fakes[0].configure(fail_status=0)
        assert client.post("/v1/chat/completions", json=chat("hdr")).headers["x-mars-turn"] == "1"


def test_streaming_is_relayed_chunk_for_chunk(clean_fakes, gateway_factory) -> None:
    server, _ = gateway_factory([clean_fakes[0].url])
    clean_fakes[0].configure(num_chunks=5)
    direct = httpx.post(f"{clean_fakes[0].url}/v1/chat/completions", json=chat("x", stream=True))
    aborted_before = clean_fakes[0].seen()["num_aborted"]
    with httpx.Client(base_url=server.url, timeout=10) as client:
        for _ in range(3):
            with client.stream("POST", "/v1/chat/completions",
                               json=chat("stream-1", stream=True)) as r:
                assert r.status_code == 200
                assert r.headers["content-type"].startswith("text/event-stream")
                body = b"".join(r.iter_raw())
            assert body == direct.content and body.endswith(b"data: [DONE]\n\n")
    wait_until(lambda: state(server)["sessions"]["stream-1"]["in_flight"] == 0, what="in-flight 0")
    # A stream that simply finished is not a client disconnect, and nothing was aborted upstream.
    metrics = httpx.get(f"{server.url}/metrics").text
    assert "mars_client_disconnects_total 0" in metrics
    assert clean_fakes[0].seen()["num_aborted"] == aborted_before


@pytest.mark.parametrize(
    "content, headers, status, needle",
    [
        (b"{not json", {}, 400, "not valid JSON"),
        (b"[1, 2]", {}, 400, "must be a JSON object"),
        (json.dumps(chat(session=None, mars_session=7)).encode(), {}, 400, "body mars_session"),
        (json.dumps(chat()).encode(), {"x-mars-session": ""}, 400, "header x-mars-session"),
        (json.dumps(chat("bad-x", vllm_xargs=[1])).encode(), {}, 400, "vllm_xargs"),
        (json.dumps(chat("bad-l", mars_last_step="perhaps")).encode(), {}, 400, "mars_last_step"),
        (json.dumps(chat("bad-x2", vllm_xargs={"mars_last_step": 5})).encode(), {}, 400,
         "vllm_xargs.mars_last_step"),
        (json.dumps(chat("bad-x3", vllm_xargs={"mars_prev_tool_s": -1.0})).encode(), {}, 400,
         "vllm_xargs.mars_prev_tool_s"),
        (json.dumps(chat("bad-x4", vllm_xargs={"mars_prev_tool": 3})).encode(), {}, 400,
         "vllm_xargs.mars_prev_tool"),
        (json.dumps(chat("bad-x5", vllm_xargs={"mars_trun": 1})).encode(), {}, 400,
         "vllm_xargs.mars_trun is not a MARS key"),
        (json.dumps(chat("bad-x6", vllm_xargs={"mars_turn": "first"})).encode(), {}, 400,
         "vllm_xargs.mars_turn"),
        (json.dumps(chat(None, vllm_xargs={"mars_last_step": "2"})).encode(), {}, 400,
         "vllm_xargs.mars_last_step"),
        (json.dumps(chat()).encode(), {"x-mars-last-step": "2"}, 400, "header x-mars-last-step"),
        (b"x" * 5000, {}, 413, "max_body_bytes=4096"),
    ],
)
def test_bad_requests_get_4xx_naming_the_problem(clean_fakes, gateway_factory, content, headers,
                                                 status, needle) -> None:
    server, _ = gateway_factory([clean_fakes[0].url], max_body_bytes=4096)
    num_seen = len(clean_fakes[0].seen()["requests"])
    r = httpx.post(f"{server.url}/v1/chat/completions", content=content,
                   headers={"content-type": "application/json", **headers})
    assert r.status_code == status
    assert needle in r.json()["error"]["message"]
    assert len(clean_fakes[0].seen()["requests"]) == num_seen  # nothing was forwarded
    st = state(server)
    assert st["num_admitted"] == 0 and not st["sessions"]  # and no slot was taken


@pytest.mark.parametrize(
    "payload, status, needle",
    [
        (b"{oops", 400, "not valid JSON"),
        (json.dumps(event("teleport", "s")).encode(), 400, "unknown event kind 'teleport'"),
        (json.dumps(event("tool_end", "s", tool_name="x")).encode(), 400, "tool_call_id"),
        (json.dumps(event("session_end", "nobody")).encode(), 404, "unknown session 'nobody'"),
        (json.dumps([event("session_start", "s"), event("session_start", "t")]).encode(), 403,
         "a batch carries the events of one session"),
        (json.dumps({"events": [event("session_start", "s")] * 3}).encode(), 413, "max_events"),
        (b"[" + b" " * 5000 + b"]", 413, "max_body_bytes"),
    ],
)
def test_bad_events_get_4xx_naming_the_problem(clean_fakes, gateway_factory, payload, status,
                                               needle) -> None:
    server, _ = gateway_factory([clean_fakes[0].url], max_events_per_post=2, max_body_bytes=4096)
    r = httpx.post(f"{server.url}/mars/v1/events", content=payload, headers=owner("s"))
    assert r.status_code == status, r.text
    assert needle in r.json()["error"]["message"]


def test_events_are_recorded_and_session_end_frees_the_slot(clean_fakes, gateway_factory) -> None:
    server, sink = gateway_factory([clean_fakes[0].url])
    with httpx.Client(base_url=server.url, timeout=10) as client:
        assert client.post("/v1/chat/completions", json=chat("ev-1")).status_code == 200
        assert state(server)["num_admitted"] == 1
        r = post_events(client, {"events": [
            event("tool_enqueued", "ev-1", tool_name="bash", tool_call_id="c"),
            event("tool_start", "ev-1", tool_name="bash", tool_call_id="c", queue_wait_s=0.2),
            event("tool_end", "ev-1", tool_name="bash", tool_call_id="c", duration_s=0.1),
            event("session_end", "ev-1")]}["events"])
        assert r.json() == {"accepted": 4}
        st = state(server)
        assert st["num_admitted"] == 0 and "ev-1" not in st["sessions"]
        # The session is gone: more events for it are a 404.
        r = post_events(client, event("tool_start", "ev-1", tool_name="b", tool_call_id="d"))
        assert r.status_code == 404
    kinds = [e.kind for e in sink.events if e.session_id == "ev-1"]
    assert kinds == ["tool_enqueued", "tool_start", "tool_end", "session_end"]


def test_client_disconnect_aborts_upstream_and_frees_the_slot(clean_fakes, gateway_factory) -> None:
    fake = clean_fakes[0]
    server, _ = gateway_factory([fake.url])
    fake.configure(delay_s=30.0)
    aborted_before = fake.seen()["num_aborted"]
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(f"{server.url}/v1/chat/completions", json=chat(), timeout=0.5)
    wait_until(lambda: fake.seen()["num_aborted"] == aborted_before + 1, what="upstream abort")
    wait_until(lambda: state(server)["num_admitted"] == 0, what="one-turn slot freed")
    assert fake.seen()["num_active"] == 0
    # Hang up before the disconnect watcher starts (it is deferred): still noticed, then aborted.
    wait_until(lambda: fake.seen()["num_active"] == 0, what="idle engine")
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(f"{server.url}/v1/chat/completions", json=chat(),
                   timeout=httpx.Timeout(5.0, read=DISCONNECT_WATCH_DELAY_S / 5))
    wait_until(lambda: fake.seen()["num_aborted"] == aborted_before + 2, what="early abort")
    wait_until(lambda: state(server)["num_admitted"] == 0, what="slot freed after early abort")
    aborted_before += 1
    # Streaming: read one chunk, hang up.
    fake.configure(delay_s=0.0, num_chunks=50, chunk_delay_s=0.2)
    with httpx.Client(base_url=server.url, timeout=10) as client:
        with client.stream("POST", "/v1/chat/completions", json=chat("dc-s", stream=True)) as r:
            next(r.iter_raw())
    wait_until(lambda: fake.seen()["num_aborted"] == aborted_before + 2, what="stream abort")
    wait_until(lambda: state(server)["sessions"]["dc-s"]["in_flight"] == 0, what="in-flight 0")
    metrics = httpx.get(f"{server.url}/metrics").text
    assert "mars_client_disconnects_total 3" in metrics


def test_a_hang_up_after_the_streams_last_event_is_an_answered_turn(clean_fakes, gateway_factory) -> None:
    # An agent that closes its connection on ``data: [DONE]``, before the engine closed the stream:
    # it got its whole answer, so the turn counts (the next one is turn 1) and nothing is aborted.
    # Before: recorded as a client_disconnect, the turn given back, the next request took turn 0
    # again (compare on the emulated backend then missed the last turn's engine 'finished').
    fake = clean_fakes[0]
    server, sink = gateway_factory([fake.url])
    fake.configure(delay_s=0.0, num_chunks=3, chunk_delay_s=0.0, done_linger_s=3.0)
    with httpx.Client(base_url=server.url, timeout=10) as client:
        with client.stream("POST", "/v1/chat/completions", json=chat("done-s", stream=True)) as r:
            assert r.headers["x-mars-turn"] == "0"
            body = b""
            for raw in r.iter_raw():
                body += raw
                if body.endswith(b"data: [DONE]\n\n"):
                    break  # hang up now, while the engine still holds the stream open
        wait_until(lambda: state(server)["sessions"]["done-s"]["in_flight"] == 0, what="in-flight 0")
        fake.configure(done_linger_s=0.0)
        assert client.post("/v1/chat/completions", json=chat("done-s")).headers["x-mars-turn"] == "1"
    assert not [e for e in sink.events if e.kind == "aborted" and e.session_id == "done-s"]
    assert "mars_client_disconnects_total 0" in httpx.get(f"{server.url}/metrics").text


def test_admission_window_queues_sessions_and_can_be_switched_off(clean_fakes, gateway_factory) -> None:
    fake = clean_fakes[0]
    one = {"window_max": 1, "window_init": 1, "window_min": 1}
    server, _ = gateway_factory([fake.url], admission=one)
    with httpx.Client(base_url=server.url, timeout=10) as client:
        assert client.post("/v1/chat/completions", json=chat("q-a")).status_code == 200
        with httpx.Client(base_url=server.url, timeout=0.5) as impatient:
            with pytest.raises(httpx.ReadTimeout):  # q-b waits: q-a holds the only slot
                impatient.post("/v1/chat/completions", json=chat("q-b"))
        wait_until(lambda: state(server)["num_waiting"] == 0, what="waiter dropped on disconnect")
        post_events(client, event("session_end", "q-a"))
        r = client.post("/v1/chat/completions", json=chat("q-b"))
        assert r.status_code == 200
    server_off, _ = gateway_factory([fake.url], admission=one, is_admission_enabled=False)
    with httpx.Client(base_url=server_off.url, timeout=5) as client:
        for sid in ("off-a", "off-b", "off-c"):
            assert client.post("/v1/chat/completions", json=chat(sid)).status_code == 200
        assert state(server_off)["num_admitted"] == 3


def test_admission_waits_are_measured_per_session(clean_fakes, gateway_factory) -> None:
    """A request admitted after waiting adds its wait to its session's and to /metrics."""
    import threading

    one = {"window_max": 1, "window_init": 1, "window_min": 1}
    server, _ = gateway_factory([clean_fakes[0].url], admission=one)
    with httpx.Client(base_url=server.url, timeout=10) as client:
        assert client.post("/v1/chat/completions", json=chat("w-a")).status_code == 200
        answers: list[int] = []
        waiter = threading.Thread(target=lambda: answers.append(httpx.post(
            f"{server.url}/v1/chat/completions", json=chat("w-b"), timeout=10).status_code))
        waiter.start()
        wait_until(lambda: state(server)["num_waiting"] == 1, what="w-b waiting")
        time.sleep(0.4)
        post_events(client, event("session_end", "w-a"))
        waiter.join(timeout=10)
    assert answers == [200]
    waits = dict(server.gateway.admission_wait_s)
    assert set(waits) == {"w-b"} and 0.4 <= waits["w-b"] < 5.0  # w-a never waited
    text = httpx.get(f"{server.url}/metrics").text
    assert "mars_admission_waits_total 1" in text
    total = next(float(line.split()[-1]) for line in text.splitlines()
                 if line.startswith("mars_admission_wait_seconds_total"))
    assert total == pytest.approx(waits["w-b"])


def test_admission_wait_timeout_is_503(clean_fakes, gateway_factory) -> None:
    one = {"window_max": 1, "window_init": 1, "window_min": 1}
    server, _ = gateway_factory([clean_fakes[0].url], admission=one, admission_wait_timeout_s=0.3)
    with httpx.Client(base_url=server.url, timeout=10) as client:
        client.post("/v1/chat/completions", json=chat("to-a"))
        r = client.post("/v1/chat/completions", json=chat("to-b"))
        assert r.status_code == 503 and "admission slot" in r.json()["error"]["message"]


def test_idle_session_releases_its_slot(clean_fakes, gateway_factory) -> None:
    server, _ = gateway_factory([clean_fakes[0].url], session_idle_timeout_s=0.3)
    httpx.post(f"{server.url}/v1/chat/completions", json=chat("idle-1"))
    assert state(server)["num_admitted"] == 1
    wait_until(lambda: state(server)["num_admitted"] == 0, what="idle release")
    assert "idle-1" not in state(server)["sessions"]
    assert "mars_idle_releases_total 1" in httpx.get(f"{server.url}/metrics").text


def test_metrics_and_healthz(clean_fakes, gateway_factory) -> None:
    clean_fakes[1].configure(kv_usage=0.42)
    server, _ = gateway_factory([f.url for f in clean_fakes])
    wait_until(lambda: 'mars_replica_kv_usage{replica="r1"} 0.42'
               in httpx.get(f"{server.url}/metrics").text, what="polled KV usage")
    text = httpx.get(f"{server.url}/metrics").text
    for name in ("mars_admission_window", "mars_sessions_admitted", "mars_sessions_waiting",
                 "mars_tool_backlog_ratio", "mars_tool_wait_ema_seconds", "mars_tool_fraction", "mars_kv_usage",
                 'mars_replica_healthy{replica="r0"} 1.0'):
        assert name in text
    r = httpx.get(f"{server.url}/healthz")
    assert r.status_code == 200 and r.json()["healthy_replicas"] == ["r0", "r1"]
    models = httpx.get(f"{server.url}/v1/models")
    assert models.status_code == 200 and models.json()["data"][0]["id"] == "fake"


def test_a_dead_agent_mid_tool_frees_its_slot_after_the_tool_bound(clean_fakes, gateway_factory) -> None:
    """Issue 16 kind 1: an agent killed during a tool call sends no tool_end. Past the call's bound
    the gateway closes it (a recorded tool_end, status interrupted), the tool count drops to 0,
    the session idles out and another session's request is answered."""
    one = {"window_max": 1, "window_init": 1, "window_min": 1}
    server, sink = gateway_factory([clean_fakes[0].url], admission=one, session_idle_timeout_s=0.3)
    with httpx.Client(base_url=server.url, timeout=10) as client:
        assert client.post("/v1/chat/completions", json=chat("dead-a")).status_code == 200
        post_events(client, event("tool_start", "dead-a", tool_name="terminal",
                                                  tool_call_id="sleep30", timeout_s=0.6))
        # dead-a is killed here: no tool_end, no session_end. dead-b waits, then is answered.
        r = client.post("/v1/chat/completions", json=chat("dead-b"))
        assert r.status_code == 200, r.text
        metrics = client.get("/metrics").text
    assert "mars_tool_calls_in_flight 0" in metrics
    assert "mars_tool_calls_interrupted_total 1" in metrics
    assert "dead-a" not in state(server)["sessions"]
    ends = [e for e in sink.events if e.kind == "tool_end" and e.session_id == "dead-a"]
    assert [(e.status, e.tool_call_id, e.source) for e in ends] == [
        ("interrupted", "sleep30", "gateway")]
    assert ends[0].duration_s >= 0.6


def test_a_session_end_closes_its_open_tool_calls_in_the_stream(clean_fakes, gateway_factory) -> None:
    """An agent killed after a call's tool_start was posted and before its tool_end was, then
    resumed and ended: the stream still has a tool_end for every tool_start (interrupted, from
    the gateway, before the session_end), and the tool count drops to 0."""
    server, sink = gateway_factory([clean_fakes[0].url])
    with httpx.Client(base_url=server.url, timeout=10) as client:
        assert client.post("/v1/chat/completions", json=chat("cut")).status_code == 200
        r = post_events(client, [
            event("tool_start", "cut", tool_name="file_editor", tool_call_id="lost"),
            event("tool_start", "cut", tool_name="terminal", tool_call_id="done"),
            event("tool_end", "cut", tool_name="terminal", tool_call_id="done", duration_s=0.1)])
        assert r.json() == {"accepted": 3}
        assert post_events(client, event("session_end", "cut")).json() == {"accepted": 1}
        metrics = client.get("/metrics").text
    assert "mars_tool_calls_in_flight 0" in metrics
    assert "mars_tool_calls_interrupted_total 1" in metrics
    events = [e for e in sink.events if e.session_id == "cut"
              and e.kind in ("tool_start", "tool_end", "session_end")]
    ends = [(e.kind, e.tool_call_id, e.status, e.source) for e in events if e.kind == "tool_end"]
    assert ends == [("tool_end", "done", "ok", "agent"), ("tool_end", "lost", "interrupted", "gateway")]
    assert events[-1].kind == "session_end"


def test_a_client_gone_before_the_first_byte_frees_its_slot_and_is_in_the_stream(
        clean_fakes, gateway_factory) -> None:
    """Issue 16 kind 1: a client that hangs up before any byte of the answer gives its session's
    slot back at once (not at session_end or the idle timeout), and the stream says so."""
    fake = clean_fakes[0]
    one = {"window_max": 1, "window_init": 1, "window_min": 1}
    server, sink = gateway_factory([fake.url], admission=one)
    fake.configure(delay_s=30.0)
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(f"{server.url}/v1/chat/completions", json=chat("gone-a"), timeout=0.5,
                   headers={"x-request-id": "req-gone"})
    wait_until(lambda: state(server)["num_admitted"] == 0, timeout_s=3.0, what="slot released")
    assert state(server)["sessions"]["gone-a"]["turns"] == 0  # still known; its aborted turn 0
    # was given back (the agent's retry is turn 0 again)
    fake.configure(delay_s=0.0)
    r = httpx.post(f"{server.url}/v1/chat/completions", json=chat("gone-b"), timeout=5.0)
    assert r.status_code == 200
    aborted = [e for e in sink.events if e.kind == "aborted"]
    assert [(e.request_id, e.session_id, e.turn, e.reason, e.stage, e.is_slot_released)
            for e in aborted] == [("req-gone", "gone-a", 0, "client_disconnect", "upstream", True)]
    assert 0.4 < aborted[0].elapsed_s < 5.0
    assert "mars_client_gone_releases_total 1" in httpx.get(f"{server.url}/metrics").text


def test_retries_and_aborted_tries_of_a_turn_keep_its_number(clean_fakes, gateway_factory) -> None:
    """Issue 33 item 7: an attempt that ends without an answer (client gone, replica error) does
    not advance ``mars_turn``, and the same body sent again (a client's retry, even after an
    answer) is the same turn; the engine sees the turn numbers an agent would count."""
    fake = clean_fakes[0]
    server, sink = gateway_factory([fake.url])
    first, second, third, fourth = (chat("retry") for _ in range(4))
    with httpx.Client(base_url=server.url, timeout=10) as client:
        assert client.post("/v1/chat/completions", json=first).headers["x-mars-turn"] == "0"
        fake.configure(delay_s=5.0)
        num_aborted = fake.seen()["num_aborted"]
        with pytest.raises(httpx.ReadTimeout):  # the agent gives up on turn 1: aborted
            httpx.post(f"{server.url}/v1/chat/completions", json=second, timeout=0.3)
        wait_until(lambda: fake.seen()["num_aborted"] == num_aborted + 1,
                   what="the engine to abort it")
        fake.configure(delay_s=0.0)
        assert client.post("/v1/chat/completions", json=second).headers["x-mars-turn"] == "1"
        # The same body again after an answer (the client did not take it): still turn 1.
        assert client.post("/v1/chat/completions", json=second).headers["x-mars-turn"] == "1"
        fake.configure(fail_status=503)  # the engine fails turn 2; the agent moves on
        assert client.post("/v1/chat/completions", json=third).status_code == 503
        fake.configure(fail_status=0)
        assert client.post("/v1/chat/completions", json=fourth).headers["x-mars-turn"] == "2"
    turns = [r["vllm_xargs"].get("mars_turn") for r in fake.seen()["requests"]
             if r["session_id"] == "retry"]
    assert turns == [0, 1, 1, 1, 2, 2]
    aborted = [e for e in sink.events if e.kind == "aborted" and e.session_id == "retry"]
    assert [e.turn for e in aborted] == [1]
    assert state(server)["sessions"]["retry"]["turns"] == 3


def test_a_stream_slower_than_the_hold_bound_loses_no_byte(clean_fakes, gateway_factory) -> None:
    """Past ``stream_hold_s`` the held read is cancelled and the relay goes on from there: the
    headers come at the bound, every chunk after them, none lost or repeated."""
    fake = clean_fakes[0]
    server, _ = gateway_factory([fake.url], stream_hold_s=0.2)
    fake.configure(delay_s=1.0, num_chunks=3, chunk_delay_s=0.05)
    with httpx.Client(base_url=server.url, timeout=10) as client:
        t0 = time.monotonic()
        with client.stream("POST", "/v1/chat/completions", json=chat("slow", stream=True)) as r:
            headers_s = time.monotonic() - t0
            body = b"".join(r.iter_raw())
    assert r.status_code == 200 and 0.15 < headers_s < 0.9, headers_s
    assert body == b"".join(b'data: {"choices": [{"index": 0, "delta": {"content": "t%d"}}]}\n\n' % i
                            for i in range(3)) + b"data: [DONE]\n\n"


def test_a_replica_urls_password_is_never_shown(gateway_factory) -> None:
    """A replica URL with credentials (aiohttp sends them as basic auth) that cannot be reached:
    the 503 the agent gets, the next one (no healthy replica) and the admin state name it with
    its password hidden; each printed the URL whole."""
    import socket

    with socket.socket() as sock:  # a port nothing listens on
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    server, _ = gateway_factory([f"http://me:hunter2@127.0.0.1:{port}"], replica_failure_threshold=1)
    with httpx.Client(base_url=server.url, timeout=30) as client:
        messages = []
        for session in ("pw-1", "pw-2"):
            r = client.post("/v1/chat/completions", json=chat(session))
            assert r.status_code == 503, r.text
            messages.append(r.json()["error"]["message"])
    shown = json.dumps(state(server)["replicas"])
    assert f"me:***@127.0.0.1:{port}" in messages[0] + shown and "hunter2" not in messages[0] + shown
    assert "no healthy vLLM replica" in messages[1] and "hunter2" not in messages[1], messages
