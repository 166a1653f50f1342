"""Schema-based fuzzing of the gateway's HTTP surface on loopback (issue 16, "Fuzz").

Bodies start from valid ones (an agent turn, one event of each CPU-plane kind) and have one field
replaced by an arbitrary JSON value, dropped, or joined by an unknown one; raw bodies are arbitrary
bytes. Every answer must be < 500; every rejection a 4xx whose message names the field (or says the
body is not JSON / not an object); a rejected events batch records nothing and nothing already
recorded is lost. Bounded: a fixed number of examples per surface, a few seconds each.

Forgery (issue 33 item 6): an attacker on the machine (an agent's terminal) posts valid events for
sessions bound to other clients' tokens (no token, a random one, its own, the victim's altered,
the token in the wrong header, batches mixing its own session with a victim's) and LLM calls
naming them: 0 may be accepted, and nothing of the victims changes.
"""

from __future__ import annotations

import json
from typing import Any

import httpx
import pytest
from gateway_helpers import ADMIN, chat, event, owner, token_for

from tests.unit.stream.stream_samples import sample_dict

hypothesis = pytest.importorskip("hypothesis")
from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

_SETTINGS = settings(max_examples=120, deadline=None, derandomize=True,
                     suppress_health_check=[HealthCheck.function_scoped_fixture,
                                            HealthCheck.too_slow])

JSON = st.recursive(
    st.none() | st.booleans() | st.integers(-2**70, 2**70)
    | st.floats(allow_nan=False, allow_infinity=False) | st.text(max_size=12),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=6), inner,
                                                                max_size=3),
    max_leaves=6,
)
CHAT_FIELDS = ("mars_session", "session_id", "prompt_cache_key", "mars_last_step", "mars_side",
               "vllm_xargs", "stream", "tools", "messages", "model")
CPU_KINDS = ("session_start", "session_end", "tool_enqueued", "tool_start", "tool_end")
_NAMES_IT = ("json", "object", "body")
"""Words a rejection of a whole body may use instead of a field name."""

STATS: dict[str, int] = {"requests": 0, "5xx": 0, "4xx": 0, "forged": 0, "forged_accepted": 0}
VICTIMS = ("fz-victim-a", "fz-victim-b")
ATTACKER = "fz-attacker"


@pytest.fixture(scope="module")
def fuzz_gateway(fakes):
    from gateway_helpers import fast_config

    from mars_openhands.control.server import GatewayServer
    from mars_openhands.stream.transport import ListSink

    for fake in fakes:
        fake.configure(delay_s=0.0, num_chunks=2, chunk_delay_s=0.0, fail_status=0, kv_usage=0.0)
    sink = ListSink()
    server = GatewayServer(fast_config([fakes[0].url]), sink).start()
    with httpx.Client(base_url=server.url, timeout=10) as client:
        for victim in VICTIMS:  # two sessions of other clients, bound to their tokens
            assert client.post("/v1/chat/completions", json=chat(victim),
                               headers=owner(victim)).status_code == 200
            started = event("tool_start", victim, tool_name="terminal", tool_call_id="v1")
            assert client.post("/mars/v1/events", json=[started],
                               headers=owner(victim)).status_code == 200
        yield client, sink
    server.stop()


def _check(response: httpx.Response, field: str | None) -> None:
    STATS["requests"] += 1
    STATS["5xx"] += response.status_code >= 500
    assert response.status_code < 500, (response.status_code, response.text[:300])
    if response.status_code >= 400 and "x-mars-replica" not in response.headers:
        STATS["4xx"] += 1
        error = response.json()["error"]
        message = (error if response.status_code == 401 else error["message"]).lower()
        assert message, response.text
        if field is not None:
            assert field.lower() in message or any(w in message for w in _NAMES_IT), (field, message)


@_SETTINGS
@given(field=st.sampled_from(CHAT_FIELDS), value=JSON, path=st.sampled_from(
    ["/v1/chat/completions", "/v1/completions"]))
def test_completions_reject_bad_fields_with_a_4xx_naming_them(fuzz_gateway, field: str,
                                                              value: Any, path: str) -> None:
    client, _ = fuzz_gateway
    body = chat("fuzz-s")
    body[field] = value
    r = client.post(path, content=json.dumps(body), headers={"content-type": "application/json"})
    _check(r, field)


@_SETTINGS
@given(raw=st.binary(max_size=64) | JSON.map(lambda v: json.dumps(v).encode()))
def test_completions_survive_arbitrary_bodies(fuzz_gateway, raw: bytes) -> None:
    client, _ = fuzz_gateway
    _check(client.post("/v1/chat/completions", content=raw), None)


@st.composite
def mutated_events(draw: Any) -> tuple[list[dict[str, Any]], str | None]:
    kind = draw(st.sampled_from(CPU_KINDS))
    good = {**sample_dict(kind), "session_id": "fuzz-ev", "t_wall": "2026-01-01T00:00:00Z"}
    bad = dict(good)
    how = draw(st.sampled_from(["replace", "drop", "add"]))
    field = draw(st.sampled_from(sorted(set(bad) - {"kind"}))) if how != "add" else "nope_field"
    if how == "replace":
        bad[field] = draw(JSON)
    elif how == "drop":
        bad.pop(field)
    else:
        bad[field] = draw(JSON)
    batch = [event("session_start", "fuzz-ev"), bad]
    return batch, field


@_SETTINGS
@given(case=mutated_events())
def test_events_reject_bad_batches_whole_and_lose_nothing(fuzz_gateway, case) -> None:
    client, sink = fuzz_gateway
    batch, field = case

    def posted() -> list[Any]:  # the gateway's own admission updates are recorded meanwhile
        return [e for e in sink.events if e.source != "gateway"]

    before = posted()
    r = client.post("/mars/v1/events", json=batch, headers=owner("fuzz-ev"))
    _check(r, field)
    after = posted()
    assert after[:len(before)] == before  # nothing already recorded is lost
    if r.status_code >= 400:
        assert len(after) == len(before)  # a rejected batch records nothing


@_SETTINGS
@given(path=st.sampled_from(["/mars/v1/state", "/metrics", "/mars/v1/metrics", "/healthz",
                             "/v1/models"]),
       query=st.text(max_size=20))
def test_read_endpoints_always_answer(fuzz_gateway, path: str, query: str) -> None:
    client, _ = fuzz_gateway
    r = client.get(path, params={"q": query}, headers=ADMIN)
    _check(r, None)
    assert r.status_code == 200


_TOKENS = {
    "absent": None, "empty": "", "random": "r" * 24 + "-not-anyones-token",
    "attacker": token_for(ATTACKER), "truncated": token_for(VICTIMS[0])[:-1],
    "altered": token_for(VICTIMS[0])[:-1] + "0", "upper": token_for(VICTIMS[0]).upper(),
    "other victim": token_for(VICTIMS[1]), "doubled": token_for(VICTIMS[0]) * 2,
}
"""Tokens an attacker can try for victim A (it does not hold A's own)."""


@st.composite
def forged_calls(draw: Any) -> tuple[list[dict[str, Any]] | dict[str, Any], dict[str, str]]:
    """A body naming victim A (valid events of any CPU kind, possibly mixed with the attacker's
    own session's or victim B's) and the headers an attacker can send."""
    kinds = draw(st.lists(st.sampled_from(CPU_KINDS), min_size=1, max_size=4))
    victim = [{**sample_dict(kind, i), "session_id": VICTIMS[0], "t_wall": "2026-01-01T00:00:00Z",
               **({"timeout_s": 1e9} if kind.startswith("tool_") and kind != "tool_end" else {})}
              for i, kind in enumerate(kinds)]
    mix = draw(st.sampled_from(["alone", "attacker first", "attacker last", "with victim B"]))
    own = [event("session_start", ATTACKER)]
    other = [event("session_end", VICTIMS[1])]
    batch = {"alone": victim, "attacker first": own + victim, "attacker last": victim + own,
             "with victim B": victim + other}[mix]
    token = _TOKENS[draw(st.sampled_from(sorted(_TOKENS)))]
    headers = {} if token is None else {"x-mars-session-token": token}
    where = draw(st.sampled_from(["header", "authorization", "both"]))
    if where != "header" and token:  # the token where an API key would go
        headers["authorization"] = f"Bearer {token}"
        if where == "authorization":
            headers.pop("x-mars-session-token")
    shape = draw(st.sampled_from(["list", "object", "one"]))
    body = {"list": batch, "object": {"events": batch}, "one": victim[0]}[shape]
    return body, headers


def _victims(client: httpx.Client) -> dict[str, Any]:
    sessions = client.get("/mars/v1/state", headers=ADMIN).json()["sessions"]
    return {v: sessions.get(v) for v in VICTIMS}


@_SETTINGS
@given(case=forged_calls())
def test_forged_and_cross_session_events_are_never_accepted(fuzz_gateway, case) -> None:
    client, sink = fuzz_gateway
    body, headers = case
    before, num_recorded = _victims(client), len([e for e in sink.events if e.session_id in VICTIMS])
    r = client.post("/mars/v1/events", json=body, headers=headers)
    STATS["forged"] += 1
    STATS["forged_accepted"] += r.status_code < 400
    _check(r, None)
    assert r.status_code in (400, 403), (r.status_code, r.text, headers)
    assert _victims(client) == before
    assert len([e for e in sink.events if e.session_id in VICTIMS]) == num_recorded
    assert ATTACKER not in client.get("/mars/v1/state", headers=ADMIN).json()["sessions"]


@_SETTINGS
@given(token=st.sampled_from(sorted(_TOKENS)), path=st.sampled_from(
    ["/v1/chat/completions", "/v1/completions"]), where=st.sampled_from(
    ["x-mars-session", "mars_session", "session_id", "x-litellm-session-id", "prompt_cache_key"]))
def test_llm_calls_naming_a_bound_session_need_its_token(fuzz_gateway, token: str, path: str,
                                                        where: str) -> None:
    client, _ = fuzz_gateway
    body = chat()
    headers = {} if _TOKENS[token] is None else {"x-mars-session-token": _TOKENS[token]}
    if where.startswith("x-"):
        headers[where] = VICTIMS[0]
    else:
        body[where] = VICTIMS[0]
    before = _victims(client)
    r = client.post(path, json=body, headers=headers)
    STATS["forged"] += 1
    STATS["forged_accepted"] += r.status_code < 400
    _check(r, None)
    assert r.status_code in (400, 403) and "x-mars-turn" not in r.headers, (r.status_code, r.text)
    assert _victims(client) == before


def test_fuzz_figures(fuzz_gateway) -> None:
    """Runs last in this module: the figures the docs quote (requests sent, 4xx, 5xx = 0; forged
    calls sent, 0 accepted)."""
    print(f"gateway fuzz: {STATS['requests']} requests, {STATS['4xx']} rejected with a 4xx, "
          f"{STATS['5xx']} 5xx; {STATS['forged']} forged or cross-session calls, "
          f"{STATS['forged_accepted']} accepted")
    assert STATS["5xx"] == 0 and STATS["forged_accepted"] == 0
