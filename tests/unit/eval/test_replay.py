"""Replay driver against a fake in-process OpenAI-compatible endpoint (:class:`FakeEndpoint`).

The fake's output ids depend on the whole prompt it received, so any prefix drift would change
later outputs too; the prefix test rebuilds each expected prompt independently from the workload,
:func:`observation_token_ids` and the outputs the fake actually sent back.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import hashlib
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import pytest

from eval.replay import (
    EXIT_BAD_INPUT,
    ReplayConfig,
    ReplayResult,
    add_replay_subcommand,
    check_fits,
    observation_token_ids,
    replay,
    run_replay,
)
from eval.workloads.format import Session, Turn, Workload, WorkloadMeta, save_workload
from mars_openhands.stream.reader import read_stream
from mars_openhands.stream.transport import ListSink

MODEL = "fake-model"


# ----------------------------------------------------------------------------- the fake endpoint
# It runs in-process behind httpx.MockTransport: it records every request (path, headers, JSON
# body), answers /v1/models with a max_model_len, /v1/completions whole or as SSE chunks (vLLM 0.32
# shapes: one token per chunk, prompt_token_ids in the first, usage last) with max_tokens output
# ids derived from the whole prompt, and /mars/v1/events like the gateway. Failures are injected
# per (session_id, mars_turn).
@dataclass
class FakeEndpoint:
    """State of one fake server. ``fail`` maps (session_id, turn) → HTTP status or "hang"."""

    max_model_len: int | None = 100_000
    model: str = "fake-model"
    delay_s: float = 0.0
    text: str = "x"
    """Each token's text; written raw (``ensure_ascii=False``), as vLLM does."""
    fail: dict[tuple[str, int], int | str] = field(default_factory=dict)
    requests: list[dict[str, Any]] = field(default_factory=list)
    posted_events: list[dict[str, Any]] = field(default_factory=list)
    event_posts: list[tuple[str | None, list[dict[str, Any]]]] = field(default_factory=list)
    """(X-Mars-Session-Token, events) of each POST /mars/v1/events."""
    api_key: str | None = None
    """When set, every request without ``Authorization: Bearer <api_key>`` gets vLLM's 401."""
    authorizations: list[tuple[str, str | None]] = field(default_factory=list)
    """(path, Authorization header) of every request."""

    def transport(self) -> httpx.MockTransport:
        return httpx.MockTransport(self.handle)

    def completions(self) -> list[dict[str, Any]]:
        """Recorded ``/v1/completions`` requests: {"body", "headers", "output_ids"}."""
        return [r for r in self.requests if r["path"] == "/v1/completions"]

    def by_session(self) -> dict[str, list[dict[str, Any]]]:
        out: dict[str, list[dict[str, Any]]] = {}
        for r in self.completions():
            out.setdefault(r["body"]["session_id"], []).append(r)
        for rows in out.values():
            rows.sort(key=lambda r: r["body"]["vllm_xargs"]["mars_turn"])
        return out

    async def handle(self, request: httpx.Request) -> httpx.Response:
        path = request.url.path
        self.authorizations.append((path, request.headers.get("authorization")))
        if self.api_key is not None and request.headers.get("authorization") != f"Bearer {self.api_key}":
            return httpx.Response(401, json={"error": "Unauthorized"})
        if path == "/v1/models":
            card = {"id": self.model, "object": "model", "max_model_len": self.max_model_len}
            return httpx.Response(200, json={"object": "list", "data": [card]})
        if path == "/mars/v1/events":
            self.event_posts.append((request.headers.get("x-mars-session-token"),
                                     json.loads(request.content)["events"]))
            self.posted_events.extend(json.loads(request.content)["events"])
            return httpx.Response(200, json={"accepted": len(json.loads(request.content)["events"])})
        if path != "/v1/completions":
            return httpx.Response(404, json={"error": f"no route {path}"})
        body = json.loads(request.content)
        record = {"path": path, "headers": dict(request.headers), "body": body}
        self.requests.append(record)
        failure = self.fail.get((body["session_id"], body["vllm_xargs"]["mars_turn"]))
        if failure == "hang":
            await asyncio.sleep(3600)
        if isinstance(failure, int):
            return httpx.Response(failure, json={"error": {"message": "injected failure"}})
        await asyncio.sleep(self.delay_s)
        record["output_ids"] = output_ids = fake_output_ids(body["prompt"], body["max_tokens"])
        if body.get("stream"):
            return httpx.Response(200, content=_sse(body, output_ids, self.text),
                                  headers={"content-type": "text/event-stream"})
        choice = {"index": 0, "text": "x" * len(output_ids), "finish_reason": "length",
                  "token_ids": output_ids, "prompt_token_ids": body["prompt"]}
        return httpx.Response(200, json={"id": "cmpl-1", "object": "text_completion",
                                         "model": body["model"], "choices": [choice],
                                         "usage": _usage(body, output_ids)})


def fake_output_ids(prompt: list[int], num_tokens: int) -> list[int]:
    """Output ids that depend on the whole prompt (so a wrong prefix shows up downstream)."""
    seed = hashlib.sha256(json.dumps(prompt).encode()).digest()
    return [seed[i % len(seed)] ^ (i % 7) for i in range(num_tokens)]


def _usage(body: dict[str, Any], output_ids: list[int]) -> dict[str, Any]:
    n = len(body["prompt"])
    return {"prompt_tokens": n, "completion_tokens": len(output_ids),
            "total_tokens": n + len(output_ids)}


def _sse(body: dict[str, Any], output_ids: list[int], text: str = "x") -> bytes:
    lines = []
    for i, token_id in enumerate(output_ids):
        choice: dict[str, Any] = {"index": 0, "text": text, "token_ids": [token_id],
                                  "finish_reason": "length" if i == len(output_ids) - 1 else None}
        if i == 0:
            choice["prompt_token_ids"] = body["prompt"]
        lines.append({"id": "cmpl-1", "object": "text_completion", "choices": [choice]})
    lines.append({"id": "cmpl-1", "object": "text_completion", "choices": [],
                  "usage": _usage(body, output_ids)})
    return (b"".join(f"data: {json.dumps(x, ensure_ascii=False)}\n\n".encode() for x in lines)
            + b"data: [DONE]\n\n")



def _session(session_id: str, arrival_s: float, turns: list[tuple[int, int, str | None, float]]
             ) -> Session:
    return Session(session_id=session_id, arrival_s=arrival_s, turns=tuple(
        Turn(prompt_tokens_appended=a, output_tokens=o, tool_name=t, tool_duration_s=d)
        for a, o, t, d in turns))


def _workload(*sessions: Session) -> Workload:
    return Workload(meta=WorkloadMeta(source="test"), sessions=sessions)


WORKLOAD = _workload(
    _session("A", 0.0, [(40, 5, "bash", 0.05), (7, 3, "pytest", 0.1), (0, 4, "edit", 0.0),
                        (12, 2, None, 0.0)]),
    _session("B", 0.02, [(25, 6, "grep", 0.02), (30, 1, None, 0.0)]),
    _session("C", 0.05, [(9, 8, None, 0.0)]),
)


def _config(**overrides: object) -> ReplayConfig:
    fields: dict[str, object] = {"endpoint_url": "http://fake:8000", "model": MODEL,
                                 "show_progress": False, "request_timeout_s": 5.0}
    fields.update(overrides)
    return ReplayConfig(**fields)  # type: ignore[arg-type]


def _replay(workload: Workload, fake: FakeEndpoint, **overrides: object
            ) -> tuple[ReplayResult, ListSink]:
    sink = ListSink()
    result = asyncio.run(replay(workload, _config(**overrides), sink=sink,
                                transport=fake.transport()))
    return result, sink


# ----------------------------------------------------------------------------- prompts
@pytest.mark.parametrize("stream", [True, False])
def test_each_turn_prompt_is_previous_prompt_plus_output_plus_observation(stream: bool) -> None:
    fake = FakeEndpoint(model=MODEL)
    result, _ = _replay(WORKLOAD, fake, stream=stream, seed=7)
    assert [s.status for s in result.sessions] == ["ok", "ok", "ok"]
    received = fake.by_session()
    for session in WORKLOAD.sessions:
        requests = received[session.session_id]
        assert len(requests) == session.num_turns
        expected: list[int] = []
        for k, (turn, request) in enumerate(zip(session.turns, requests, strict=True)):
            observation = observation_token_ids(7, session.session_id, k,
                                                turn.prompt_tokens_appended)
            assert len(observation) == turn.prompt_tokens_appended
            expected = expected + observation
            prompt = request["body"]["prompt"]
            assert prompt == expected, f"{session.session_id} turn {k}"
            assert len(prompt) == session.num_prompt_tokens(k)
            if k > 0:  # extends the previous prompt by exactly its output + the observation
                previous = requests[k - 1]
                assert prompt[: len(previous["body"]["prompt"])] == previous["body"]["prompt"]
                assert prompt[len(previous["body"]["prompt"]):] == (
                    previous["output_ids"] + observation)
            assert len(request["output_ids"]) == turn.output_tokens
            expected = expected + request["output_ids"]
        records = result.sessions[[s.session_id for s in WORKLOAD.sessions].index(
            session.session_id)].turns
        assert [t.num_prompt_tokens for t in records] == [
            session.num_prompt_tokens(k) for k in range(session.num_turns)]
        assert [t.num_output_tokens for t in records] == [t.output_tokens for t in session.turns]


def test_observation_ids_are_deterministic_in_range_and_depend_on_seed_session_turn() -> None:
    ids = observation_token_ids(1, "s", 2, 500, 10, 20)
    assert ids == observation_token_ids(1, "s", 2, 500, 10, 20)
    assert all(10 <= t < 20 for t in ids) and len(set(ids)) == 10
    assert ids != observation_token_ids(2, "s", 2, 500, 10, 20)
    assert ids != observation_token_ids(1, "t", 2, 500, 10, 20)
    assert ids != observation_token_ids(1, "s", 3, 500, 10, 20)
    assert observation_token_ids(1, "s", 2, 0) == []


def test_two_runs_send_identical_prompts() -> None:
    first, second = FakeEndpoint(model=MODEL), FakeEndpoint(model=MODEL)
    _replay(WORKLOAD, first)
    _replay(WORKLOAD, second)
    prompts = [[r["body"]["prompt"] for r in rows] for rows in first.by_session().values()]
    assert prompts == [[r["body"]["prompt"] for r in rows]
                       for rows in second.by_session().values()]


def test_token_id_range_is_used_and_validated() -> None:
    fake = FakeEndpoint(model=MODEL)
    _replay(_workload(_session("A", 0.0, [(300, 1, None, 0.0)])), fake,
            token_id_low=100, token_id_high=104)
    assert set(fake.completions()[0]["body"]["prompt"]) == {100, 101, 102, 103}
    with pytest.raises(ValueError, match="token_id_high"):
        _config(token_id_low=5, token_id_high=5)
    with pytest.raises(ValueError, match="endpoint_url must be an http"):
        _config(endpoint_url="127.0.0.1:8000")
    with pytest.raises(ValueError, match="extra"):
        _config(num_tool_worker=3)  # a typo is an error, never silently dropped


# ----------------------------------------------------------------------------- request fields
def test_requests_force_length_and_carry_session_id_and_vllm_xargs() -> None:
    fake = FakeEndpoint(model=MODEL)
    result, _ = _replay(WORKLOAD, fake, temperature=0.5)
    a_requests = fake.by_session()["A"]
    a_record = result.sessions[0]
    for k, request in enumerate(a_requests):
        body = request["body"]
        assert body["model"] == MODEL and body["session_id"] == "A"
        assert body["max_tokens"] == WORKLOAD.sessions[0].turns[k].output_tokens
        assert body["ignore_eos"] is True and body["return_token_ids"] is True
        assert body["temperature"] == 0.5
        xargs = body["vllm_xargs"]
        assert xargs["mars_turn"] == k
        assert xargs["mars_last_step"] == (1 if k == 3 else 0)
        if k == 0:
            assert "mars_prev_tool" not in xargs and "mars_prev_tool_s" not in xargs
        else:
            previous = a_record.turns[k - 1]
            assert xargs["mars_prev_tool"] == WORKLOAD.sessions[0].turns[k - 1].tool_name
            assert xargs["mars_prev_tool_s"] == pytest.approx(previous.tool_duration_s, abs=1e-5)
            assert xargs["mars_prev_tool_s"] >= WORKLOAD.sessions[0].turns[k - 1].tool_duration_s
        assert all(isinstance(v, (str, int, float)) for v in xargs.values())
        assert "x-mars-session" not in request["headers"]  # engine mode: no gateway header
    assert fake.posted_events == []


def test_gateway_mode_adds_headers_and_posts_every_cpu_event_in_order() -> None:
    """Through the gateway every LLM call and every events batch carries the session's token (one
    per session, ≥ 128 bits, the same on both), and each batch holds one session's events, in
    their order."""
    fake = FakeEndpoint(model=MODEL)
    result, sink = _replay(WORKLOAD, fake, endpoint_kind="gateway", event_batch_size=3)
    assert all(r["headers"]["x-mars-session"] == r["body"]["session_id"]
               for r in fake.completions())
    token_of = {r["body"]["session_id"]: r["headers"]["x-mars-session-token"]
                for r in fake.completions()}
    assert len(set(token_of.values())) == len(token_of) == len(WORKLOAD.sessions)
    assert all(len(t) >= 22 for t in token_of.values())
    assert all(r["headers"]["x-mars-session-token"] == token_of[r["body"]["session_id"]]
               for r in fake.completions())
    for token, events in fake.event_posts:
        assert len({e["session_id"] for e in events}) == 1 and 1 <= len(events) <= 3
        assert token == token_of[events[0]["session_id"]]
    local = [json.loads(e.model_dump_json()) for e in sink.events]
    for session_id in token_of:
        assert [e for e in fake.posted_events if e["session_id"] == session_id] == [
            e for e in local if e["session_id"] == session_id]
    assert len(fake.posted_events) == len(local)
    assert result.num_events_posted == len(local) == result.num_events
    assert result.num_events_post_failed == 0


def test_a_batch_rejected_for_one_unknown_session_loses_no_other_sessions_events() -> None:
    async def handler(request: httpx.Request) -> httpx.Response:
        if request.url.path == "/mars/v1/events":
            events = json.loads(request.content)["events"]
            if any(e["session_id"] == "B" for e in events):  # as if B had expired in the gateway
                return httpx.Response(404, json={"error": "unknown session 'B'"})
        return await fake.handle(request)

    fake = FakeEndpoint(model=MODEL)
    sink = ListSink()
    result = asyncio.run(replay(WORKLOAD, _config(endpoint_kind="gateway", event_batch_size=1000,
                                                  event_flush_interval_s=1.0),
                                sink=sink, transport=httpx.MockTransport(handler)))
    not_b = [json.loads(e.model_dump_json()) for e in sink.events if e.session_id != "B"]
    for session_id in ("A", "C"):  # each session's events arrive, in their order
        assert [e for e in fake.posted_events if e["session_id"] == session_id] == [
            e for e in not_b if e["session_id"] == session_id]
    assert len(fake.posted_events) == len(not_b)
    num_b = sum(1 for e in sink.events if e.session_id == "B")
    assert result.num_events_posted == len(not_b) and result.num_events_post_failed == num_b


def test_gateway_event_post_failures_are_counted_not_fatal() -> None:
    async def handler(request: httpx.Request) -> httpx.Response:
        if request.url.path == "/mars/v1/events":
            return httpx.Response(404, json={"error": "unknown session"})
        return await fake.handle(request)

    fake = FakeEndpoint(model=MODEL)
    sink = ListSink()
    result = asyncio.run(replay(WORKLOAD, _config(endpoint_kind="gateway"), sink=sink,
                                transport=httpx.MockTransport(handler)))
    assert [s.status for s in result.sessions] == ["ok", "ok", "ok"]
    assert result.num_events_posted == 0
    assert result.num_events_post_failed == len(sink.events) > 0


# ----------------------------------------------------------------------------- events
def _kinds(sink: ListSink, session_id: str) -> list[tuple[str, int | None]]:
    return [(e.kind, e.turn) for e in sink.events if e.session_id == session_id]


def test_events_per_session_come_in_lifecycle_order() -> None:
    fake = FakeEndpoint(model=MODEL)
    result, sink = _replay(WORKLOAD, fake)
    assert _kinds(sink, "A") == [
        ("session_start", 0),
        ("tool_enqueued", 0), ("tool_start", 0), ("tool_end", 0),
        ("tool_enqueued", 1), ("tool_start", 1), ("tool_end", 1),
        ("tool_enqueued", 2), ("tool_start", 2), ("tool_end", 2),
        ("session_end", 3),
    ]
    assert _kinds(sink, "C") == [("session_start", 0), ("session_end", 0)]
    ends = [e for e in sink.events if e.kind == "session_end"]
    assert {e.session_id: e.status for e in ends} == {"A": "ok", "B": "ok", "C": "ok"}
    assert all(e.source == "replay" for e in sink.events)
    tool_ends = [e for e in sink.events if e.kind == "tool_end" and e.session_id == "A"]
    assert [e.tool_name for e in tool_ends] == ["bash", "pytest", "edit"]
    assert tool_ends[1].duration_s >= 0.1
    assert result.num_events == len(sink.events)


def test_session_start_is_emitted_at_arrival_before_the_admission_wait() -> None:
    workload = _workload(_session("first", 0.0, [(10, 2, "sleep", 0.4), (1, 1, None, 0.0)]),
                         _session("second", 0.05, [(10, 2, None, 0.0)]))
    result, sink = _replay(workload, FakeEndpoint(model=MODEL), max_active_sessions=1)
    first, second = result.sessions
    start_second = next(e for e in sink.events
                        if e.kind == "session_start" and e.session_id == "second")
    end_first = next(e for e in sink.events if e.kind == "session_end" and e.session_id == "first")
    assert start_second.t_mono_ns < end_first.t_mono_ns  # started on arrival, not on admission
    assert second.start_s == pytest.approx(0.05, abs=0.05)
    assert second.admitted_s >= first.end_s - 0.01  # waited for the only slot
    assert second.turns[0].send_s >= first.turns[-1].finish_s
    assert second.e2e_s is not None and second.e2e_s > 0.4 - 0.05  # includes the slot wait


def test_arrivals_are_respected_and_times_are_recorded() -> None:
    fake = FakeEndpoint(model=MODEL, delay_s=0.01)
    result, _ = _replay(WORKLOAD, fake)
    for session, record in zip(WORKLOAD.sessions, result.sessions, strict=True):
        assert record.start_s >= session.arrival_s - 1e-3
        assert record.start_s == pytest.approx(session.arrival_s, abs=0.05)
        for turn in record.turns:
            assert turn.send_s <= turn.first_token_s <= turn.finish_s
            assert turn.finish_s - turn.send_s >= 0.01
        assert record.end_s >= record.turns[-1].finish_s
    assert result.duration_s >= max(r.end_s for r in result.sessions) - 1e-3


# ----------------------------------------------------------------------------- failures
def test_http_500_ends_that_session_with_error_and_the_run_finishes() -> None:
    fake = FakeEndpoint(model=MODEL, fail={("A", 1): 500})
    result, sink = _replay(WORKLOAD, fake)
    statuses = {s.session_id: s.status for s in result.sessions}
    assert statuses == {"A": "error", "B": "ok", "C": "ok"}
    a = result.sessions[0]
    assert "HTTP 500" in a.error and "turn 1" in a.error
    assert _kinds(sink, "A")[-1] == ("session_end", 1)
    assert [e.status for e in sink.events if e.kind == "session_end" and e.session_id == "A"] == [
        "error"]
    assert len(fake.by_session()["A"]) == 2  # no turn after the failure
    assert result.num_with_status("ok") == 2 and a.e2e_s is None


@pytest.mark.parametrize("stream", [True, False])
def test_request_timeout_and_connection_errors_end_the_session(stream: bool) -> None:
    fake = FakeEndpoint(model=MODEL, fail={("B", 0): "hang"})

    async def handler(request: httpx.Request) -> httpx.Response:
        if (request.url.path == "/v1/completions"
                and json.loads(request.content)["session_id"] == "C"):
            raise httpx.ConnectError("connection refused")
        return await fake.handle(request)

    sink = ListSink()
    result = asyncio.run(replay(WORKLOAD, _config(request_timeout_s=0.3, stream=stream),
                                sink=sink, transport=httpx.MockTransport(handler)))
    a, b, c = result.sessions
    assert (a.status, b.status, c.status) == ("ok", "error", "error")
    assert "request_timeout_s" in b.error and "ConnectError" in c.error
    assert result.duration_s < 3.0


def test_missing_token_ids_is_an_error_naming_the_fix() -> None:
    async def handler(request: httpx.Request) -> httpx.Response:
        if request.url.path == "/v1/models":
            return httpx.Response(404)
        choice = {"index": 0, "text": "hi", "finish_reason": "length"}
        return httpx.Response(200, json={"choices": [choice], "usage": {}})

    result = asyncio.run(replay(WORKLOAD, _config(stream=False),
                                transport=httpx.MockTransport(handler)))
    assert all(s.status == "error" for s in result.sessions)
    assert "return_token_ids" in result.sessions[0].error
    assert result.max_model_len_tokens is None  # /v1/models unavailable: unchecked


def test_run_timeout_stops_sessions_and_emits_their_end() -> None:
    workload = _workload(_session("slow", 0.0, [(5, 1, "sleep", 30.0), (1, 1, None, 0.0)]),
                         _session("late", 30.0, [(5, 1, None, 0.0)]))
    result, sink = _replay(workload, FakeEndpoint(model=MODEL), run_timeout_s=0.3)
    slow, late = result.sessions
    assert result.is_timed_out and result.duration_s < 3.0
    assert slow.status == "timeout" and late.status == "not_started"
    assert _kinds(sink, "slow")[-1] == ("session_end", 0)
    assert [e.status for e in sink.events if e.kind == "session_end"] == ["timeout"]
    assert _kinds(sink, "late") == []


def test_cancellation_ends_started_sessions_then_propagates() -> None:
    sink = ListSink()
    workload = _workload(_session("s", 0.0, [(5, 1, "sleep", 30.0), (1, 1, None, 0.0)]))

    async def scenario() -> None:
        task = asyncio.create_task(replay(workload, _config(), sink=sink,
                                          transport=FakeEndpoint(model=MODEL).transport()))
        await asyncio.sleep(0.3)
        task.cancel()
        await task

    with pytest.raises(asyncio.CancelledError):
        asyncio.run(scenario())
    assert [(e.kind, getattr(e, "status", None)) for e in sink.events][-1] == (
        "session_end", "cancelled")


# ----------------------------------------------------------------------------- length limits
def test_sessions_longer_than_max_model_len_are_refused_up_front() -> None:
    fake = FakeEndpoint(model=MODEL, max_model_len=50)
    with pytest.raises(ValueError, match=r"2 of 3 sessions .* max_model_len = 50.*trim_workload"):
        _replay(WORKLOAD, fake)
    assert fake.completions() == []
    check_fits(WORKLOAD, 100)  # A needs 40+5+7+3+0+4+12+2 = 73 tokens


def test_overflow_end_session_plays_turns_that_fit() -> None:
    fake = FakeEndpoint(model=MODEL)
    result, sink = _replay(WORKLOAD, fake, overflow="end_session", max_model_len_tokens=60)
    a, b, c = result.sessions
    # A: turn 2 needs 40+5+7+3+0 = 55 prompt + 4 output = 59 <= 60; turn 3 needs 59+12+2 = 73.
    assert a.status == "truncated" and len(a.turns) == 3 and "turn 3" in a.error
    # B: turn 1 needs 25+6+30 = 61 prompt + 1 = 62 > 60.
    assert b.status == "truncated" and len(b.turns) == 1
    assert c.status == "ok"
    ends = {e.session_id: e.status for e in sink.events if e.kind == "session_end"}
    assert ends == {"A": "truncated", "B": "truncated", "C": "ok"}


# ----------------------------------------------------------------------------- sync wrapper
def test_run_replay_writes_a_closed_readable_stream(tmp_path: Path) -> None:
    fake = FakeEndpoint(model=MODEL)
    path = tmp_path / "run" / "stream.jsonl"
    result = run_replay(WORKLOAD, _config(), stream_path=path, transport=fake.transport())
    assert result.num_with_status("ok") == 3
    frame = read_stream(path)
    assert len(frame) == result.num_events
    assert set(frame["kind"]) == {"session_start", "session_end", "tool_enqueued", "tool_start",
                                  "tool_end"}
    assert path.with_suffix(".parquet").exists()  # written on close
    rows = result.turn_rows()
    assert len(rows) == WORKLOAD.num_turns and rows[0]["session_id"] == "A"
    extra = ListSink()  # a recorder and another sink together: both get every event
    result = run_replay(WORKLOAD, _config(), stream_path=tmp_path / "second.jsonl", sink=extra,
                        transport=fake.transport())
    assert len(extra.events) == result.num_events == len(read_stream(tmp_path / "second.jsonl"))


# ----------------------------------------------------------------------------- CLI
def _cli(argv: list[str]) -> int:
    parser = argparse.ArgumentParser()
    add_replay_subcommand(parser.add_subparsers())
    args = parser.parse_args(argv)
    return args.func(args)


def test_cli_flags_come_from_the_config_model() -> None:
    parser = argparse.ArgumentParser()
    add_replay_subcommand(parser.add_subparsers())
    args = parser.parse_args(["replay", "w.json", "-o", "s.jsonl", "--endpoint-url", "http://e",
                              "--model", "m", "--num-tool-workers", "3", "--tool-mode", "cpu",
                              "--no-stream", "--run-timeout-s", "9.5"])
    fields = {k: v for k, v in vars(args).items() if k in ReplayConfig.model_fields}
    assert fields == {"endpoint_url": "http://e", "model": "m", "num_tool_workers": 3,
                      "tool_mode": "cpu", "stream": False, "run_timeout_s": 9.5}
    with pytest.raises(SystemExit):
        parser.parse_args(["replay", "w.json", "-o", "s.jsonl", "--endpoint-url", "http://e",
                           "--model", "m", "--tool-mode", "gpu"])


def _replay_cli(tmp_path: Path, output: Path, url: str) -> int:
    """``replay -o output`` of WORKLOAD against ``url``; the exit code."""
    workload_path = tmp_path / "w.json"
    save_workload(WORKLOAD, workload_path)
    return _cli(["replay", str(workload_path), "-o", str(output), "--endpoint-url", url, "--model", "m",
                 "--no-show-progress", "--max-model-len-tokens", "1000", "--request-timeout-s", "5"])


@pytest.mark.parametrize("is_max_len_given", [True, False])
def test_cli_against_a_closed_port_is_refused_in_one_line_and_writes_nothing(
        tmp_path: Path, closed_port_url: str, capsys: pytest.CaptureFixture[str], is_max_len_given: bool) -> None:
    """It recorded every session as a ConnectError, wrote the stream and its records, and exited 1."""
    stream_path = tmp_path / "run" / "stream.jsonl"
    workload_path = tmp_path / "w.json"
    save_workload(WORKLOAD, workload_path)
    argv = ["replay", str(workload_path), "-o", str(stream_path), "--endpoint-url", closed_port_url,
            "--model", "m", "--no-show-progress", "--request-timeout-s", "5"]
    assert _cli([*argv, *(["--max-model-len-tokens", "1000"] if is_max_len_given else [])]) == EXIT_BAD_INPUT
    err = capsys.readouterr().err
    assert err.startswith(f"mars-openhands replay: error: nothing answers at {closed_port_url} (GET /v1/models: "
                          "ConnectError") and err.count("\n") == 1, err
    assert err.rstrip().endswith("start the server there, or give endpoint_url (--endpoint-url) the root of a "
                                 "running one")
    assert not (tmp_path / "run").exists()  # no stream, no records, not even the folder


def test_an_endpoint_urls_password_is_not_printed(tmp_path: Path, closed_port_url: str,
                                                 capsys: pytest.CaptureFixture[str]) -> None:
    """``--endpoint-url http://user:pass@host`` (httpx sends it as basic auth): the refusal names the
    URL with its password hidden; it printed it whole. ``compare --backend URL``'s check too."""
    from eval.backends import first_served_model

    url = closed_port_url.replace("http://", "http://me:hunter2@")
    shown = closed_port_url.replace("http://", "http://me:***@")
    assert _replay_cli(tmp_path, tmp_path / "run" / "stream.jsonl", url) == EXIT_BAD_INPUT
    err = capsys.readouterr().err
    assert f"nothing answers at {shown} (GET /v1/models" in err and "hunter2" not in err, err
    with pytest.raises(ValueError) as info:
        first_served_model(url)
    assert f"cannot list models at {shown}/v1/models" in str(info.value) and "hunter2" not in str(info.value)


def test_cli_against_a_server_that_answers_errors_records_them_and_exits_1(
        tmp_path: Path, not_found_endpoint: str) -> None:
    """A server that is up is replayed against, whatever it answers: each session ends in error."""
    stream_path = tmp_path / "run" / "stream.jsonl"
    assert _replay_cli(tmp_path, stream_path, not_found_endpoint) == 1
    frame = read_stream(stream_path)
    ends = frame[frame["kind"] == "session_end"]
    assert sorted(ends["session_id"]) == ["A", "B", "C"] and set(ends["status"]) == {"error"}
    records = json.loads(stream_path.with_suffix(".result.json").read_text())
    assert [s["status"] for s in records["sessions"]] == ["error", "error", "error"]
    assert "404" in records["sessions"][0]["error"]


def test_cli_output_parquet_records_jsonl_next_to_it_and_keeps_both(tmp_path: Path, not_found_endpoint: str) -> None:
    """-o x.parquet used to record JSONL *into* x.parquet and fail converting it at the very end."""
    out = tmp_path / "run" / "s.parquet"
    assert _replay_cli(tmp_path, out, not_found_endpoint) == 1  # every session errors, recorded
    parquet, jsonl = read_stream(out), read_stream(out.with_suffix(".jsonl"))
    assert len(parquet) == len(jsonl) > 0
    assert out.with_suffix(".result.json").is_file()


def test_cli_bad_input_exits_2(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert _cli(["replay", str(tmp_path / "missing.json"), "-o", str(tmp_path / "s.jsonl"),
                 "--endpoint-url", "http://e", "--model", "m"]) == 2
    assert "missing.json" in capsys.readouterr().err
    workload_path = tmp_path / "w.json"
    save_workload(WORKLOAD, workload_path)
    assert _cli(["replay", str(workload_path), "-o", str(tmp_path / "s2.jsonl"),
                 "--endpoint-url", "http://e", "--model", "m", "--token-id-high", "0"]) == 2
    assert "mars-openhands replay: error: --token-id-high: " in capsys.readouterr().err  # the flag, not the field


def test_cli_rejects_a_bad_stream_suffix_before_replaying(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    workload_path = tmp_path / "w.json"
    save_workload(WORKLOAD, workload_path)
    out = tmp_path / "out.txt"
    assert _cli(["replay", str(workload_path), "-o", str(out), "--endpoint-url",
                 "http://127.0.0.1:9", "--model", "m", "--no-show-progress"]) == 2
    assert ".jsonl or .parquet" in capsys.readouterr().err
    assert not out.exists()  # nothing was replayed or written


def test_response_json_may_carry_raw_control_characters() -> None:
    """A dummy-weight model generates arbitrary bytes; a raw control character inside the text
    must not fail the turn (json.loads is strict by default)."""
    from eval.replay import _json_object

    assert _json_object('{"choices": [{"text": "a\x01b\x1fc"}]}', "t")["choices"][0]["text"] == "a\x01b\x1fc"


@pytest.mark.parametrize("separator", ["\u2028", "\u2029", "\x85"])
def test_streamed_text_with_unicode_line_separators_is_one_event(separator: str) -> None:
    """JSON leaves U+2028/U+2029/U+0085 unescaped; str.splitlines() (httpx's aiter_lines) breaks
    a ``data:`` line at them, which failed 1 in 16 emulated-backend sessions ("not JSON"). SSE
    lines end only at CR/LF (WHATWG HTML, server-sent events §9.2.5)."""
    fake = FakeEndpoint(model=MODEL, text=f"a{separator}b")
    result, _ = _replay(WORKLOAD, fake, stream=True, seed=3)
    assert [(s.status, s.error) for s in result.sessions] == [("ok", None)] * 3
    for session, record in zip(WORKLOAD.sessions, result.sessions, strict=True):
        assert [t.num_output_tokens for t in record.turns] == [t.output_tokens for t in session.turns]


def test_a_failed_sessions_error_text_reaches_the_stream_and_session_table() -> None:
    from eval.metrics import session_table
    from mars_openhands.stream.reader import events_to_frame

    fake = FakeEndpoint(model=MODEL, fail={("A", 1): 503})
    result, sink = _replay(WORKLOAD, fake)
    table = session_table(events_to_frame(sink.events))
    assert [s.status for s in result.sessions] == ["error", "ok", "ok"]
    assert "HTTP 503" in table.loc["A", "error"] and "injected failure" in table.loc["A", "error"]
    assert table.loc["B", "error"] is None and table.loc["C", "error"] is None


# ----------------------------------------------------------------------------- API key
def test_the_api_key_goes_on_every_request_to_a_keyed_gateway() -> None:
    """replay could not send a gateway's API key: every turn got 401."""
    fake = FakeEndpoint(model=MODEL, api_key="s3cret-key")
    result, _ = _replay(WORKLOAD, fake, endpoint_kind="gateway", api_key="s3cret-key")
    assert [s.status for s in result.sessions] == ["ok", "ok", "ok"]
    paths = {path for path, _ in fake.authorizations}
    assert {"/v1/models", "/v1/completions", "/mars/v1/events"} <= paths
    assert {auth for _, auth in fake.authorizations} == {"Bearer s3cret-key"}
    assert result.num_events_post_failed == 0 and result.num_events_posted > 0
    assert "s3cret-key" not in repr(_config(api_key="s3cret-key"))  # a SecretStr: never printed


@pytest.mark.parametrize("api_key", [None, "wrong-key"], ids=["no key", "wrong key"])
def test_a_401_to_the_reachability_check_refuses_the_run_before_recording(tmp_path: Path,
                                                                           api_key: str | None) -> None:
    fake = FakeEndpoint(model=MODEL, api_key="s3cret-key")
    stream = tmp_path / "run" / "stream.jsonl"
    with pytest.raises(ValueError, match="answers 401") as info:
        run_replay(WORKLOAD, _config(endpoint_kind="gateway", api_key=api_key), stream_path=stream,
                   transport=fake.transport())
    message = str(info.value)
    assert "\n" not in message and "--api-key or MARS_API_KEY" in message
    assert ("was refused" in message) == (api_key is not None) and "wrong-key" not in message
    assert [path for path, _ in fake.authorizations] == ["/v1/models"]  # no LLM call, no event post
    assert not stream.exists()


def test_cli_sends_mars_api_key_or_the_flag_and_refuses_a_401_in_one_line(
        tmp_path: Path, keyed_endpoint: str, capsys: pytest.CaptureFixture[str],
        monkeypatch: pytest.MonkeyPatch) -> None:
    """The keyed server answers 401 without its key ("k3y"), 404 with it (the check passes, every
    session then ends in error: exit 1)."""
    workload_path = tmp_path / "w.json"
    save_workload(WORKLOAD, workload_path)
    monkeypatch.delenv("MARS_API_KEY", raising=False)

    def run(name: str, *extra: str) -> tuple[int, str]:
        code = _cli(["replay", str(workload_path), "-o", str(tmp_path / name / "s.jsonl"), "--endpoint-url",
                     keyed_endpoint, "--endpoint-kind", "gateway", "--model", "m", "--no-show-progress",
                     "--max-model-len-tokens", "1000", "--request-timeout-s", "5", *extra])
        return code, capsys.readouterr().err

    code, err = run("none")
    assert code == EXIT_BAD_INPUT and err.count("\n") == 1, err
    assert err.startswith(f"mars-openhands replay: error: {keyed_endpoint} answers 401 Unauthorized to GET "
                          "/v1/models: it needs an API key and none was sent; give the server's key with "
                          "--api-key or MARS_API_KEY")
    code, err = run("wrong", "--api-key", "not-it")
    assert code == EXIT_BAD_INPUT and "the API key sent was refused" in err and "not-it" not in err
    assert not (tmp_path / "none").exists() and not (tmp_path / "wrong").exists()
    monkeypatch.setenv("MARS_API_KEY", "k3y")
    assert run("env")[0] == 1  # past the check: the sessions reached the server (404s)
    monkeypatch.setenv("MARS_API_KEY", "wrong")
    assert run("flag", "--api-key", "k3y")[0] == 1  # the flag wins over the environment
    monkeypatch.setenv("MARS_API_KEY", "k3y\n")
    code, err = run("newline")
    assert code == EXIT_BAD_INPUT and err.startswith("mars-openhands replay: error: MARS_API_KEY has whitespace")


def test_compare_url_backend_sends_mars_api_key(keyed_endpoint: str, monkeypatch) -> None:
    """``compare --backend URL`` at a keyed server: its model check and every replay send
    ``MARS_API_KEY`` (they sent none: a keyed gateway refused the whole run); without a key or
    with a wrong one the check says which, in one line."""
    from eval import backends

    monkeypatch.delenv("MARS_API_KEY", raising=False)
    with pytest.raises(ValueError, match="answered 401: the server wants an API key; set MARS_API_KEY"):
        backends.first_served_model(keyed_endpoint)
    monkeypatch.setenv("MARS_API_KEY", "wrong")
    with pytest.raises(ValueError, match="the key in MARS_API_KEY was refused") as info:
        backends.first_served_model(keyed_endpoint)
    assert "wrong" not in str(info.value)
    monkeypatch.setenv("MARS_API_KEY", "k3y")
    with pytest.raises(ValueError, match="cannot list models .*404"):  # past the key: its 404
        backends.first_served_model(keyed_endpoint)

    sent = []
    monkeypatch.setattr(backends, "run_replay", lambda workload, config, sink: sent.append(config))
    live = backends.LiveBackend(backends.parse_backend(keyed_endpoint), backends.LiveOptions(
        num_gpu_blocks=100, max_model_len_tokens=1000, endpoint_kind="gateway"), {})
    live._server = backends.LiveServer("p", keyed_endpoint, "m", None, None, lambda: None)
    with contextlib.suppress(TypeError, AttributeError):  # the stand-in returns no result
        live._replay(keyed_endpoint, WORKLOAD, 0, "gateway")
    assert sent and sent[0].api_key is not None and sent[0].api_key.get_secret_value() == "k3y"
