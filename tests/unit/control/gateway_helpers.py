"""Helpers for the gateway tests (fake-engine configs, polling, request/event bodies)."""

from __future__ import annotations

import itertools
import time
from collections.abc import Callable
from typing import Any

import httpx
import pytest

from mars_openhands.control.config import GatewayConfig, ReplicaConfig
from mars_openhands.control.server import GatewayServer

FAKE_DEFAULTS = {"kv_usage": 0.0, "delay_s": 0.0, "num_chunks": 3, "chunk_delay_s": 0.0, "fail_status": 0}


def fast_config(urls: list[str], **overrides: Any) -> GatewayConfig:
    """A gateway config with fast polling and ticks, for tests."""
    admission = {"update_interval_s": 0.05, **overrides.pop("admission", {})}
    values: dict[str, Any] = {
        "port": 0, "replicas": [ReplicaConfig(url=u) for u in urls], "poll_interval_s": 0.05,
        "num_tool_workers": 100, "admission": admission,
        "upstream_connect_timeout_s": 1.0,
    }
    values.update(overrides)
    return GatewayConfig.model_validate(values)


def wait_until(predicate: Callable[[], Any], timeout_s: float = 10.0, what: str = "") -> Any:
    """Poll ``predicate`` until truthy; fail the test with ``what`` after ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(0.02)
    pytest.fail(f"timed out after {timeout_s} s waiting for {what}")


def state(server: GatewayServer) -> dict[str, Any]:
    return httpx.get(f"{server.url}/mars/v1/state", timeout=5.0).json()


AGENT_TOOLS = [{"type": "function", "function": {"name": "terminal", "parameters": {
    "type": "object", "properties": {"command": {"type": "string"}}}}}]
"""What an agent's turn carries (a chat request without tools is a side request)."""


_NUM_BODIES = itertools.count()
"""Each ``chat()`` body differs (a new turn; the same body again is a retry of the same turn)."""


def chat(session: str | None = None, stream: bool = False, **extra: Any) -> dict[str, Any]:
    """An agent turn (with ``tools``); pass ``tools=None`` for a side request (title, summary).

    Every call's ``messages`` differ, as an agent's conversation grows from turn to turn (the
    gateway takes a body equal to the session's last turn for a retry of that turn)."""
    message = {"role": "user", "content": f"hi {next(_NUM_BODIES)}"}
    body: dict[str, Any] = {"model": "fake", "messages": [message],
                            "stream": stream, "tools": AGENT_TOOLS, **extra}
    if body["tools"] is None:
        del body["tools"]
    if session is not None:
        body["mars_session"] = session
    return body


def event(kind: str, session: str, **extra: Any) -> dict[str, Any]:
    return {"kind": kind, "t_mono_ns": time.monotonic_ns(), "t_wall": "2026-01-01T00:00:00Z",
            "source": "agent", "session_id": session, **extra}
