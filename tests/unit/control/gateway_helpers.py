"""Helpers for the gateway tests (fake-engine configs, polling, request/event bodies)."""

from __future__ import annotations

import hashlib
import itertools
import time
from collections.abc import Callable
from typing import Any

import httpx
import pytest

from mars_openhands.control.config import GatewayConfig, ReplicaConfig
from mars_openhands.control.server import GatewayServer

ADMIN_KEY = "test-admin-key"
"""The admin key of every test gateway (:func:`state` reads the view with session ids)."""
ADMIN = {"authorization": f"Bearer {ADMIN_KEY}"}

FAKE_DEFAULTS = {"kv_usage": 0.0, "delay_s": 0.0, "num_chunks": 3, "chunk_delay_s": 0.0, "fail_status": 0,
                 "api_key": None}


def fast_config(urls: list[str], **overrides: Any) -> GatewayConfig:
    """A gateway config with fast polling and ticks, for tests."""
    admission = {"update_interval_s": 0.05, **overrides.pop("admission", {})}
    values: dict[str, Any] = {
        "port": 0, "replicas": [ReplicaConfig(url=u) for u in urls], "poll_interval_s": 0.05,
        "num_tool_workers": 100, "admission": admission,
        "upstream_connect_timeout_s": 1.0, "admin_key": ADMIN_KEY,
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
    """``GET /mars/v1/state`` with the admin key (every session)."""
    return httpx.get(f"{server.url}/mars/v1/state", headers=ADMIN, timeout=5.0).json()


def token_for(session: str) -> str:
    """The session token a test client makes for ``session`` (≥ 128 bits, stable per id)."""
    return "tok-" + hashlib.sha256(session.encode()).hexdigest()[:32]


def owner(session: str) -> dict[str, str]:
    """The headers of ``session``'s own client: its ``X-Mars-Session-Token``."""
    return {"x-mars-session-token": token_for(session)}


def post_events(client: httpx.Client, events: list[dict[str, Any]] | dict[str, Any],
                **kwargs: Any) -> httpx.Response:
    """POST one session's events with that session's token (as its own client does)."""
    first = events[0] if isinstance(events, list) else events
    return client.post("/mars/v1/events", json=events,
                       headers={**owner(first["session_id"]), **kwargs.pop("headers", {})}, **kwargs)


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
