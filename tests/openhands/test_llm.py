"""Per-conversation LLM config: session metadata per backend, sampling parameters sent as asked."""

from __future__ import annotations

from pathlib import Path

import httpx
import pytest

pytest.importorskip("openhands.sdk", reason="needs the OpenHands env (.venv-openhands)")

from openhands.sdk import LLM, Message, TextContent  # noqa: E402

from mars_openhands.openhands.llm import (  # noqa: E402
    LLMSettings,
    TurnTracker,
    build_session_llm,
    model_name_for,
)
from mars_openhands.openhands.playback import (  # noqa: E402
    RecordedTurn,
    Script,
    build_playback_app,
)
from tests.openhands._helpers import serve_app  # noqa: E402

pytestmark = pytest.mark.openhands


def _settings(backend: str, base_url: str = "http://127.0.0.1:1/v1", **kw: object) -> LLMSettings:
    return LLMSettings(backend=backend, base_url=base_url, model="playback", **kw)


def test_model_name_gets_the_openai_prefix_once() -> None:
    assert model_name_for("Qwen/Qwen3-Coder-30B-A3B-Instruct") == "openai/Qwen/Qwen3-Coder-30B-A3B-Instruct"
    assert model_name_for("openai/gpt-4o") == "openai/gpt-4o"
    assert model_name_for("hosted_vllm/x") == "hosted_vllm/x"


@pytest.mark.parametrize(("backend", "body"), [
    ("mars", {"vllm_xargs": {"mars_turn": 0}}),
    ("vllm", {"session_id": "s-1", "vllm_xargs": {"mars_turn": 0}}),
    ("url", {}),
])
def test_session_metadata_per_backend(backend: str, body: dict) -> None:
    llm = build_session_llm(_settings(backend), "s-1")
    assert llm.extra_headers == {"X-Mars-Session": "s-1"}
    assert (llm.litellm_extra_body or {}) == body


def test_each_conversation_gets_its_own_copy() -> None:
    a = build_session_llm(_settings("vllm"), "a")
    b = build_session_llm(_settings("vllm"), "b")
    TurnTracker(a)(_FakeEvent("r1"))
    assert a.litellm_extra_body["vllm_xargs"]["mars_turn"] == 1
    assert b.litellm_extra_body["vllm_xargs"]["mars_turn"] == 0
    assert a.extra_headers != b.extra_headers


class _FakeEvent:
    def __init__(self, response_id: str, source: str = "agent") -> None:
        self.llm_response_id = response_id
        self.source = source


def test_turn_tracker_counts_distinct_agent_responses() -> None:
    llm = build_session_llm(_settings("mars"), "s")
    tracker = TurnTracker(llm)
    for event in [_FakeEvent("r1"), _FakeEvent("r1"), _FakeEvent("u", "user"), _FakeEvent("r2")]:
        tracker(event)
    assert tracker.num_responses == 2
    assert llm.litellm_extra_body["vllm_xargs"] == {"mars_turn": 2}


def test_sampling_parameters_and_session_reach_the_server(tmp_path: Path) -> None:
    app = build_playback_app([Script(name="s", turns=(RecordedTurn(content="hello"),))])
    with serve_app(app) as url:
        llm = build_session_llm(_settings("vllm", f"{url}/v1", temperature=0.3, top_p=0.9), "sess-9")
        llm.completion([Message(role="user", content=[TextContent(text="hi")])])
        seen = httpx.get(f"{url}/playback/requests").json()["requests"]
        if "capability_overrides" in LLM.model_fields:
            # What the SDK does without our overrides for an unknown model (design.md §10).
            plain = LLM(model="openai/playback", base_url=f"{url}/v1", api_key="x",
                        temperature=0.3, top_p=0.9, usage_id="plain")
            plain.completion([Message(role="user", content=[TextContent(text="hi")])])
            unpatched = httpx.get(f"{url}/playback/requests").json()["requests"][-1]
            assert unpatched["temperature"] is None and unpatched["has_reasoning_effort"]
    request = seen[0]
    assert request["temperature"] == 0.3 and request["top_p"] == 0.9
    assert not request["has_reasoning_effort"]
    assert request["header_session"] == "sess-9" and request["session_id"] == "sess-9"
    assert request["body_session_id"] == "sess-9" and request["vllm_xargs"] == {"mars_turn": 0}
