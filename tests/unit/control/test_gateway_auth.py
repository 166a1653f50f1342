"""Who may call the gateway (control/auth.py; issue 33 item 6): API key, admin key, session tokens.

An agent's terminal can ``curl`` the gateway. These tests call it as such an agent would: without
the keys, with another session's id, with a token of its own, and check that every refused call
gets its 401/400/403 and changes nothing (no session, turn, tool call, slot or stream event).
"""

from __future__ import annotations

import time

import httpx
import pytest
from gateway_helpers import ADMIN, chat, event, owner, post_events, state, token_for, wait_until

from mars_openhands.control.auth import AuthError, SessionTokens
from mars_openhands.control.config import ReplicaConfig

API_KEY = "k-api-0123456789"
AGENT = {"authorization": f"Bearer {API_KEY}"}


def _recorded(sink, session: str) -> list[str]:
    return [e.kind for e in sink.events if e.session_id == session]


def test_the_api_key_guards_the_openai_routes_and_events(clean_fakes, gateway_factory) -> None:
    fake = clean_fakes[0]
    server, sink = gateway_factory([fake.url], api_key=API_KEY)
    with httpx.Client(base_url=server.url, timeout=10) as client:
        for path, body in (("/v1/chat/completions", chat("k-1")), ("/v1/completions", chat("k-1")),
                           ("/mars/v1/events", [event("session_start", "k-1")])):
            for headers in ({}, {"authorization": "Bearer wrong"}, {"authorization": API_KEY}):
                r = client.post(path, json=body, headers={**headers, **owner("k-1")})
                assert r.status_code == 401 and r.json() == {"error": "Unauthorized"}, (path, r.text)
        assert client.get("/v1/models").status_code == 401
        assert client.get("/v1/anything").status_code == 401  # the whole /v1 prefix, as vLLM
        assert state(server)["num_sessions"] == 0 and not _recorded(sink, "k-1")
        assert not [r for r in fake.seen()["requests"] if r["session_id"] == "k-1"]
        ok = client.post("/v1/chat/completions", json=chat("k-1"), headers=AGENT)
        assert ok.status_code == 200 and ok.headers["x-mars-turn"] == "0"
        assert client.get("/v1/models", headers=AGENT).json()["data"][0]["id"] == "fake"
        assert post_events(client, [event("tool_start", "k-1", tool_name="t", tool_call_id="c")],
                           headers=AGENT).status_code == 200
        assert client.get("/healthz").status_code == 200  # open, as vLLM's /health
        metrics = client.get("/metrics").text
        assert "mars_unauthorized_total 11" in metrics and "k-1" not in metrics
    # Without its own key the replica gets the agent's header, as it came.
    seen = [r["authorization"] for r in fake.seen()["requests"] if r["session_id"] == "k-1"]
    assert seen == [f"Bearer {API_KEY}"]


def test_a_replica_key_replaces_the_agents_header(clean_fakes, gateway_factory) -> None:
    """A replica started with an internal key the gateway holds: agents reach it only through the
    gateway (their own key, or none, never reaches it)."""
    fake = clean_fakes[0]
    fake.configure(api_key="internal-key")
    assert httpx.post(f"{fake.url}/v1/chat/completions", json=chat()).status_code == 401
    replica = ReplicaConfig(url=fake.url, api_key="internal-key")
    server, _ = gateway_factory([fake.url], api_key=API_KEY, replicas=[replica])
    with httpx.Client(base_url=server.url, timeout=10) as client:
        r = client.post("/v1/chat/completions", json=chat("rk"), headers=AGENT)
        assert r.status_code == 200, r.text
        streamed = client.post("/v1/chat/completions", json=chat("rk", stream=True), headers=AGENT)
        assert streamed.status_code == 200 and streamed.text.endswith("data: [DONE]\n\n")
        assert client.get("/v1/models", headers=AGENT).status_code == 200
        assert "internal-key" not in client.get("/mars/v1/state", headers=ADMIN).text
    seen = [r["authorization"] for r in fake.seen()["requests"] if r["session_id"] == "rk"]
    assert seen == ["Bearer internal-key"] * 2
    assert "internal-key" not in repr(server.gateway.router.replicas[0])


def test_the_state_needs_the_admin_key_and_without_one_names_no_session(clean_fakes,
                                                                      gateway_factory) -> None:
    server, _ = gateway_factory([clean_fakes[0].url])  # the test admin key is set
    with httpx.Client(base_url=server.url, timeout=10) as client:
        assert client.post("/v1/chat/completions", json=chat("secret-id")).status_code == 200
        assert client.get("/mars/v1/state").status_code == 401
        assert client.get("/mars/v1/state", headers=AGENT).status_code == 401
        assert "secret-id" in client.get("/mars/v1/state", headers=ADMIN).json()["sessions"]
    server, _ = gateway_factory([clean_fakes[0].url], admin_key=None, api_key=API_KEY)
    with httpx.Client(base_url=server.url, timeout=10) as client:
        assert client.post("/v1/chat/completions", json=chat("secret-id"),
                           headers=AGENT).status_code == 200
        assert client.get("/mars/v1/state").status_code == 401  # aggregate: behind the API key
        aggregate = client.get("/mars/v1/state", headers=AGENT)
        assert aggregate.json()["num_sessions"] == 1 and aggregate.json()["window"] == 30
        assert "secret-id" not in aggregate.text and clean_fakes[0].url not in aggregate.text
        for path in ("/metrics", "/mars/v1/metrics", "/healthz", "/mars/v1/healthz"):
            assert "secret-id" not in client.get(path).text


def test_a_bound_session_refuses_calls_without_its_token(clean_fakes, gateway_factory) -> None:
    """Trust on first use: the first token seen for a session binds it; then an LLM call or an
    event naming the session without that token is refused and changes nothing."""
    fake = clean_fakes[0]
    server, sink = gateway_factory([fake.url])
    with httpx.Client(base_url=server.url, timeout=10) as client:
        # A stock client (no token) keeps working; its session stays unbound.
        assert client.post("/v1/chat/completions", json=chat("stock")).status_code == 200
        assert client.post("/v1/chat/completions", json=chat("stock")).headers["x-mars-turn"] == "1"
        # Our client sends its token from the first call: the session is bound.
        r = client.post("/v1/chat/completions", json=chat("victim"), headers=owner("victim"))
        assert r.status_code == 200 and state(server)["sessions"]["victim"]["is_token_bound"]
        post_events(client, [event("tool_start", "victim", tool_name="t", tool_call_id="c1")])
        # The admission tick may answer the tool_start above at any time: count the other events.
        def recorded() -> int:
            return sum(e.kind != "admission_update" for e in sink.events)

        before = state(server)["sessions"]["victim"], len(fake.seen()["requests"]), recorded()
        thief = {"x-mars-session-token": token_for("thief")}
        for headers in ({}, thief, {"x-mars-session-token": token_for("victim")[:-1] + "x"}):
            r = client.post("/v1/chat/completions", json=chat("victim"), headers=headers)
            assert r.status_code == 403 and "X-Mars-Session-Token" in r.json()["error"]["message"]
            assert r.json()["error"]["type"] == "permission_error"
            r = client.post("/v1/completions", json={"model": "fake", "prompt": "x"},
                            headers={"x-mars-session": "victim", **headers})
            assert r.status_code == 403
        for batch in ([event("session_end", "victim")],
                      [event("tool_start", "victim", tool_name="t", tool_call_id=f"x{i}",
                             timeout_s=1e9) for i in range(50)],
                      [event("tool_end", "victim", tool_name="t", tool_call_id="c1",
                             duration_s=1.0)]):
            r = client.post("/mars/v1/events", json=batch, headers=thief)
            assert r.status_code == 403, r.text
            r = client.post("/mars/v1/events", json=batch)
            assert r.status_code == 400 and "X-Mars-Session-Token" in r.json()["error"]["message"]
        # A batch carries one session: the thief's own session plus the victim's is refused whole.
        mixed = [event("session_start", "thief"), event("session_end", "victim")]
        assert client.post("/mars/v1/events", json=mixed, headers=thief).status_code == 403
        short = client.post("/mars/v1/events", json=[event("session_start", "thief")],
                            headers={"x-mars-session-token": "short"})
        assert short.status_code == 400 and "22..256" in short.json()["error"]["message"]
        after = state(server)["sessions"]["victim"], len(fake.seen()["requests"]), recorded()
        assert after[0] == before[0] and after[1:] == before[1:]
        assert "thief" not in state(server)["sessions"] and state(server)["num_admitted"] == 2
        assert state(server)["tool_backlog_ratio"] == pytest.approx(1 / 100)
        assert "mars_forbidden_total 14" in client.get("/metrics").text
        # The owner goes on: its next turn is turn 1, its session_end frees the id.
        r = client.post("/v1/chat/completions", json=chat("victim"), headers=owner("victim"))
        assert r.headers["x-mars-turn"] == "1"
        assert post_events(client, [event("session_end", "victim")]).status_code == 200
        reused = client.post("/v1/chat/completions", json=chat("victim"), headers=thief)
        assert reused.status_code == 200 and reused.headers["x-mars-turn"] == "0"  # a new session


def test_an_agent_cannot_record_events_as_the_gateway_or_an_engine(clean_fakes,
                                                                   gateway_factory) -> None:
    """A session's own client (right token) still may not post an event whose ``source`` is the
    gateway's or a replica's: it would read in the stream as, e.g., the gateway's idle release."""
    urls = [clean_fakes[0].url, clean_fakes[1].url]
    server, sink = gateway_factory(urls, replicas=[ReplicaConfig(url=urls[0]),
                                                   ReplicaConfig(url=urls[1], engine_source="gpu-b")])
    with httpx.Client(base_url=server.url, timeout=10) as client:
        assert client.post("/v1/chat/completions", json=chat("own"),
                           headers=owner("own")).status_code == 200
        before = state(server)["sessions"]["own"]
        for source in ("gateway", "engine:0", "engine:1", "gpu-b"):
            r = post_events(client, [event("session_end", "own", source=source,
                                           status="idle_timeout")])
            assert r.status_code == 400 and f"source '{source}'" in r.json()["error"]["message"]
        assert state(server)["sessions"]["own"] == before
        assert not [e for e in sink.events if e.kind == "session_end"]
        assert post_events(client, [event("session_end", "own")]).status_code == 200
        assert [e.source for e in sink.events if e.kind == "session_end"] == ["agent"]


def test_an_idle_released_binding_is_kept_for_its_client_to_resume(clean_fakes,
                                                                  gateway_factory) -> None:
    """A client that crashed comes back after its session idled out with the same persisted
    token and passes; another token is refused until ``session_token_keep_s`` passes."""
    server, _ = gateway_factory([clean_fakes[0].url], session_idle_timeout_s=0.2,
                                session_token_keep_s=1.0)
    thief = {"x-mars-session-token": token_for("thief")}
    with httpx.Client(base_url=server.url, timeout=10) as client:
        assert client.post("/v1/chat/completions", json=chat("durable"),
                           headers=owner("durable")).status_code == 200
        wait_until(lambda: "durable" not in state(server)["sessions"], what="idle release")
        assert client.post("/v1/chat/completions", json=chat("durable"),
                           headers=thief).status_code == 403
        assert client.post("/v1/chat/completions", json=chat("durable")).status_code == 403
        resumed = client.post("/v1/chat/completions", json=chat("durable"), headers=owner("durable"))
        assert resumed.status_code == 200 and state(server)["sessions"]["durable"]["is_token_bound"]
        wait_until(lambda: "durable" not in state(server)["sessions"], what="idle release again")
        time.sleep(1.2)  # past session_token_keep_s: the id is free for the first token again
        wait_until(lambda: state(server)["num_token_bindings"] == 0, what="the binding to expire")
        assert client.post("/v1/chat/completions", json=chat("durable"),
                           headers=thief).status_code == 200


@pytest.mark.parametrize("steps, expected", [
    # (call, session, token | None, is_required) ... -> the outcome of the last one
    ([("check", "s", "t" * 22, False)], "bind"),
    ([("check", "s", None, False)], None),
    ([("check", "s", None, True)], 400),
    ([("check", "s", "t" * 21, False)], 400),
    ([("check", "s", "t" * 22 + " ", False)], 400),
    ([("bind", "s", "t" * 22), ("check", "s", "t" * 22, True)], None),
    ([("bind", "s", "t" * 22), ("check", "s", "u" * 22, False)], 403),
    ([("bind", "s", "t" * 22), ("check", "s", None, False)], 403),
    ([("bind", "s", "t" * 22), ("check", "other", "t" * 22, False)], "bind"),
    ([("bind", "s", "t" * 22), ("forget", "s"), ("check", "s", "u" * 22, False)], "bind"),
    ([("bind", "s", "t" * 22), ("release", "s", 0.0), ("check", "s", "u" * 22, False)], 403),
    ([("bind", "s", "t" * 22), ("release", "s", 0.0), ("check", "s", "t" * 22, False)], "bind"),
    ([("bind", "s", "t" * 22), ("release", "s", 0.0), ("expire", 10.0),
      ("check", "s", "u" * 22, False)], "bind"),
])
def test_session_tokens_table(steps, expected) -> None:
    tokens = SessionTokens(keep_s=10.0)
    outcome: object = None
    for step in steps:
        if step[0] == "bind":
            tokens.bind(step[1], tokens.check(step[1], step[2], 0.0, is_required=True))
        elif step[0] == "forget":
            tokens.forget(step[1])
        elif step[0] == "release":
            tokens.release(step[1], step[2])
        elif step[0] == "expire":
            tokens.expire(step[1])
        else:
            try:
                outcome = "bind" if tokens.check(step[1], step[2], 5.0, step[3]) else None
            except AuthError as e:
                outcome = e.status_code
    assert outcome == expected
