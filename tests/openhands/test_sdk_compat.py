"""Facts about the OpenHands SDK that the adapter relies on (design.md §10), checked in its own env.

Runs in `.venv-openhands` (Python >= 3.12) via `make openhands-test`.
"""

from __future__ import annotations

import inspect
import sys

import pytest

pytestmark = pytest.mark.openhands

sdk = pytest.importorskip("openhands.sdk", reason="needs the OpenHands env (.venv-openhands)")


def test_python_is_new_enough_for_openhands() -> None:
    assert sys.version_info >= (3, 12), sys.version


def test_tool_executor_is_called_with_action_and_conversation() -> None:
    """Exact tool timing wraps `ToolExecutor.__call__(action, conversation)`."""
    from openhands.sdk.tool import ToolExecutor

    params = list(inspect.signature(ToolExecutor.__call__).parameters)
    assert params[:3] == ["self", "action", "conversation"], params


def test_llm_accepts_session_metadata_fields() -> None:
    """Per-conversation LLM copies carry headers and extra body fields (session id, vllm_xargs)."""
    from openhands.sdk import LLM

    fields = set(LLM.model_fields)
    assert {"model", "base_url", "extra_headers", "litellm_extra_body"} <= fields, sorted(fields)


def test_stream_events_round_trip_in_the_openhands_env() -> None:
    """The stream layer (pydantic only) works under the OpenHands env's pydantic."""
    from mars_openhands.stream.events import ToolEnd, now_stamps, parse_event

    e = ToolEnd(**now_stamps(), source="agent", session_id="s1", turn=2, tool_name="terminal",
                tool_call_id="c", duration_s=0.25, status="ok")
    assert parse_event(e.model_dump_json()) == e


def test_the_sdks_cipher_takes_every_secret_key() -> None:
    """The agent-server encrypts a conversation's secrets with the SDK's ``Cipher``, keyed by the
    session API key (``OH_SECRET_KEY``). The SDK derives the Fernet key with standard base64, and
    cryptography 51's Fernet refuses one with '+' or '/' (~3 keys in 4): every conversation start
    then fails with a 500. pyproject pins ``cryptography<51`` in the ``openhands`` extra for it."""
    import secrets

    from openhands.sdk.utils.cipher import Cipher
    from pydantic import SecretStr

    for _ in range(64):  # P(64 keys all url-safe by chance) ~ 0.25**64
        key = secrets.token_urlsafe(32)
        cipher = Cipher(key)
        assert cipher.decrypt(cipher.encrypt(SecretStr("v"))).get_secret_value() == "v", key
