"""Schema-based fuzzing of the gateway's HTTP surface on loopback (issue 16, "Fuzz").

Bodies start from valid ones (an agent turn, one event of each CPU-plane kind) and have one field
replaced by an arbitrary JSON value, dropped, or joined by an unknown one; raw bodies are arbitrary
bytes. Every answer must be < 500; every rejection a 4xx whose message names the field (or says the
body is not JSON / not an object); a rejected events batch records nothing and nothing already
recorded is lost. Bounded: a fixed number of examples per surface, a few seconds each.
"""

from __future__ import annotations

import json
from typing import Any

import httpx
import pytest
from gateway_helpers import chat, event

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

STATS: dict[str, int] = {"requests": 0, "5xx": 0, "4xx": 0}


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
        yield client, sink
    server.stop()


def _check(response: httpx.Response, field: str | None) -> None:
    STATS["requests"] += 1
    STATS["5xx"] += response.status_code >= 500
    assert response.status_code < 500, (response.status_code, response.text[:300])
    if response.status_code >= 400 and "x-mars-replica" not in response.headers:
        STATS["4xx"] += 1
        message = response.json()["error"]["message"].lower()
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
    r = client.post("/mars/v1/events", json=batch)
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
    r = client.get(path, params={"q": query})
    _check(r, None)
    assert r.status_code == 200


def test_fuzz_figures(fuzz_gateway) -> None:
    """Runs last in this module: the figures the docs quote (requests sent, 4xx, 5xx = 0)."""
    print(f"gateway fuzz: {STATS['requests']} requests, {STATS['4xx']} rejected with a 4xx, "
          f"{STATS['5xx']} 5xx")
    assert STATS["5xx"] == 0
