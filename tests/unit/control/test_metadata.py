"""Session metadata extraction and the engine body (control/metadata.py; design.md §2)."""

from __future__ import annotations

import json

import pytest

from mars_openhands.control import metadata
from mars_openhands.control.metadata import (
    BadRequestError,
    body_fingerprint,
    build_engine_body,
    estimate_prompt_tokens,
    extract_last_step,
    extract_session_id,
)


@pytest.mark.parametrize(
    "headers, body, expected",
    [
        ({"x-mars-session": "h"}, {"mars_session": "m", "prompt_cache_key": "p"}, ("h", "header x-mars-session")),
        ({}, {"mars_session": "m", "session_id": "s"}, ("m", "body mars_session")),
        ({"x-litellm-session-id": "l"}, {"session_id": "s"}, ("s", "body session_id")),
        ({"x-litellm-session-id": "l"}, {"prompt_cache_key": "p"}, ("l", "header x-litellm-session-id")),
        ({}, {"prompt_cache_key": "p"}, ("p", "body prompt_cache_key")),
        ({}, {"model": "x"}, (None, None)),
    ],
)
def test_session_sources_in_priority_order(headers, body, expected) -> None:
    assert extract_session_id(headers, body) == expected


@pytest.mark.parametrize(
    "body, field",
    [({"mars_session": 5}, "body mars_session"), ({"session_id": ""}, "body session_id"),
     ({"prompt_cache_key": "x" * 300}, "body prompt_cache_key"),
     ({"mars_session": "a\nb"}, "body mars_session")],
)
def test_bad_session_ids_name_the_field(body, field) -> None:
    with pytest.raises(BadRequestError, match=field) as info:
        extract_session_id({}, body)
    assert info.value.status_code == 400


@pytest.mark.parametrize(
    "headers, body, expected",
    [({}, {}, None), ({}, {"mars_last_step": True}, 1), ({}, {"mars_last_step": 0}, 0),
     ({"x-mars-last-step": "1"}, {}, 1), ({"x-mars-last-step": "false"}, {}, 0)],
)
def test_last_step(headers, body, expected) -> None:
    assert extract_last_step(headers, body) == expected


def test_bad_last_step() -> None:
    with pytest.raises(BadRequestError, match="header x-mars-last-step"):
        extract_last_step({"x-mars-last-step": "maybe"}, {})


def test_engine_body_sets_native_session_and_xargs_without_mutating() -> None:
    body = {"model": "m", "messages": [], "mars_session": "s", "mars_last_step": 1,
            "vllm_xargs": {"user_key": "v", "mars_turn": 99}}
    out = build_engine_body(body, "s", 3, last_step=1, prev_tool=("bash", 1.5))
    assert out["session_id"] == "s"
    assert out["vllm_xargs"] == {"user_key": "v", "mars_turn": 3, "mars_last_step": 1,
                                 "mars_prev_tool": "bash", "mars_prev_tool_s": 1.5}
    assert "mars_session" not in out and "mars_last_step" not in out
    assert body["vllm_xargs"]["mars_turn"] == 99  # input untouched


def test_only_the_gateway_dates_a_session() -> None:
    """An agent's own ``mars_session_age_s`` never reaches the engine (it would make its session
    the oldest on a replica it moves to); the gateway's does, on side requests too."""
    body = {"model": "m", "vllm_xargs": {"mars_session_age_s": 1e6, "k": "v"}}
    assert build_engine_body(body, "s", 2)["vllm_xargs"] == {"k": "v", "mars_turn": 2}
    assert build_engine_body(body, "s", 2, session_age_s=7.5)["vllm_xargs"] == {
        "k": "v", "mars_turn": 2, "mars_session_age_s": 7.5}
    assert build_engine_body(body, "s", None, session_age_s=7.5)["vllm_xargs"] == {
        "k": "v", "mars_side": 1, "mars_session_age_s": 7.5}


def test_one_turn_body_has_no_session_id() -> None:
    out = build_engine_body({"model": "m"}, None, 0)
    assert "session_id" not in out and out["vllm_xargs"] == {"mars_turn": 0}


@pytest.mark.parametrize("xargs", [[1, 2], {"k": {"nested": 1}}, {"k": True}, {"mars_turn": True},
                                   {"mars_turn": "3"}, {"mars_turn": 2.0}, {"mars_side": "title"}])
def test_bad_vllm_xargs(xargs) -> None:
    with pytest.raises(BadRequestError, match="vllm_xargs"):
        build_engine_body({"vllm_xargs": xargs}, "s", 0)


def test_xargs_flags_may_be_bools() -> None:
    """mars_side / mars_last_step are 0/1 or true/false, as the engine reads them (a bool was a
    400 for every key)."""
    xargs = {"mars_side": True, "mars_last_step": False}
    assert metadata.check_xargs(xargs) == xargs


def test_estimate_prompt_tokens() -> None:
    assert estimate_prompt_tokens({"prompt": "x" * 400}, 10_000, 4.0) == 100
    chat = {"messages": [{"role": "user", "content": "y" * 800}]}
    assert 200 <= estimate_prompt_tokens(chat, 10_000, 4.0) <= 215
    assert estimate_prompt_tokens({}, 4000, 4.0) == 1000


@pytest.mark.parametrize("path, fields, expected", [
    ("/v1/chat/completions", {"has_tools": False}, True),
    ("/v1/chat/completions", {"has_tools": True}, False),
    ("/v1/chat/completions", {"tools": [{"type": "function"}]}, False),
    ("/v1/chat/completions", {"tools": []}, True),
    ("/v1/chat/completions", {}, True),
    ("/v1/completions", {"has_tools": False}, False),
    ("/v1/chat/completions", {"has_tools": False, "mars_side": 0}, False),
    ("/v1/chat/completions", {"has_tools": True, "mars_side": True}, True),
])
def test_side_requests_are_chat_requests_without_tools(path, fields, expected) -> None:
    assert metadata.is_side_request(path, fields) is expected


def test_a_bad_mars_side_names_the_field() -> None:
    with pytest.raises(BadRequestError, match="body mars_side"):
        metadata.is_side_request("/v1/chat/completions", {"mars_side": "yes"})


def test_a_side_request_carries_mars_side_instead_of_a_turn() -> None:
    body = {"messages": [], "mars_side": 1, "vllm_xargs": {"mars_turn": 5, "k": "v"}}
    out = metadata.build_engine_body(body, "s", None, prev_tool=("bash", 1.0))
    assert out["vllm_xargs"] == {"k": "v", "mars_side": 1} and "mars_side" not in out
    assert metadata.build_engine_body(body, "s", 2)["vllm_xargs"] == {"k": "v", "mars_turn": 2}


def test_body_fingerprint_tells_a_retry_from_the_next_turn() -> None:
    def body(messages: list[str], temperature: float = 0.0) -> bytes:
        return json.dumps({"model": "m", "messages": [{"role": "user", "content": m}
                                                      for m in messages],
                           "tools": [], "temperature": temperature}).encode()

    history = [f"observation {i} " + "x" * 3000 for i in range(100)]  # ~300 KB, stride > 1
    turn = body(history)
    assert body_fingerprint(turn) == body_fingerprint(bytes(turn))  # a retry: the same bytes
    assert body_fingerprint(turn) != body_fingerprint(body([*history, "next"]))  # grown
    condensed = body(["summary " + "y" * (len(h) - 8) for h in history])  # same length
    assert len(condensed) == len(turn) and body_fingerprint(condensed) != body_fingerprint(turn)
    assert body_fingerprint(b"{}") != body_fingerprint(b"[]")
