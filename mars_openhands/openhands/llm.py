"""One OpenHands LLM config per conversation, carrying the session id and turn metadata (design.md §2, §10).

``LLM.extra_headers`` and ``LLM.litellm_extra_body`` are fixed per LLM object, so each conversation
gets its own copy. What each backend sends:

=========  =======================================  ==============================================
backend    endpoint                                  session metadata
=========  =======================================  ==============================================
``mars``   the MARS gateway (``http://gw/v1``)        header ``X-Mars-Session``; the gateway derives
                                                      ``mars_turn`` / ``mars_prev_tool`` itself
``vllm``   a vLLM server directly                    header + body ``session_id`` (vLLM 0.32's
                                                      native field) + ``vllm_xargs.mars_turn``
``url``    any OpenAI-compatible endpoint            header ``X-Mars-Session`` only (strict
                                                      providers reject unknown body fields)
=========  =======================================  ==============================================

Every backend also sends the session's token (``X-Mars-Session-Token``,
:mod:`mars_openhands.openhands.credentials`) when one is given: a gateway started with
``--api-key`` binds the session to it.

Turn metadata: :class:`TurnTracker` is a conversation callback that counts the agent's LLM responses
and sets ``vllm_xargs.mars_turn`` (0-based index of the *next* call) in this conversation's own
``litellm_extra_body``, which the SDK reads at every call. It is only attached where the body may
carry it (``mars``, ``vllm``); the gateway overwrites it with its own count, which is authoritative.

Sampling: SDK 1.58 drops ``temperature`` / ``top_p`` / ``top_k`` and adds ``reasoning_effort`` for
models it does not know (``openai/<served-name>`` on vLLM) unless told otherwise; we set
``capability_overrides={"supports_reasoning_effort": False, "supports_sampling_params": True,
"thinking_mode": "none"}`` so the values asked for are sent as asked. SDK versions without
``capability_overrides`` (1.14) send them as given.
"""

from __future__ import annotations

import threading
from typing import Any, Literal

from openhands.sdk import LLM
from pydantic import BaseModel, ConfigDict, Field, SecretStr

from mars_openhands.openhands.credentials import TOKEN_HEADER

__all__ = ["ENV_API_KEY", "Backend", "LLMSettings", "TurnTracker", "build_session_llm", "model_name_for"]

Backend = Literal["mars", "vllm", "url"]

ENV_API_KEY = "MARS_API_KEY"
"""Environment variable holding the API key (the CLI's default, and how task processes get it)."""
SESSION_HEADER = "X-Mars-Session"
"""Our explicit session header (design.md §2); the gateway reads it first."""

_SAMPLING_OVERRIDES: dict[str, bool | str] = {
    "supports_reasoning_effort": False,
    "supports_sampling_params": True,
    "thinking_mode": "none",
}


class LLMSettings(BaseModel):
    """What the user asks of the model; one per run, turned into one LLM per conversation."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    backend: Backend = "mars"
    """Where requests go: the MARS gateway, a vLLM server directly, or any OpenAI-compatible URL."""
    base_url: str
    """Endpoint root including ``/v1`` (``http://127.0.0.1:8000/v1``)."""
    model: str
    """Served model name (``Qwen/Qwen3-Coder-30B-A3B-Instruct``); ``openai/`` is prefixed for LiteLLM
    unless a provider prefix is already there."""
    api_key: SecretStr = SecretStr("EMPTY")
    """Never written out: JSON dumps show ``**********``; task processes get it from
    ``MARS_API_KEY`` (:data:`ENV_API_KEY`)."""
    temperature: float | None = Field(None, ge=0.0)
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    top_k: int | None = Field(None, ge=1)
    max_output_tokens: int | None = Field(None, ge=1)
    """Cap on each completion, tokens."""
    timeout_s: int = Field(600, ge=1)
    """Per-request timeout, seconds."""
    num_retries: int = Field(3, ge=0)
    native_tool_calling: bool = True
    """Send tools as OpenAI function calls (vLLM needs ``--enable-auto-tool-choice
    --tool-call-parser <parser>``); ``False``: the SDK's prompt-based fallback."""


def model_name_for(model: str) -> str:
    """``openai/<model>`` unless ``model`` already starts with a LiteLLM provider prefix. Pure."""
    head = model.split("/", 1)[0]
    if head in ("openai", "hosted_vllm", "litellm_proxy", "anthropic", "gemini", "azure"):
        return model
    return f"openai/{model}"


def build_session_llm(settings: LLMSettings, session_id: str, usage_id: str = "agent",
                      session_token: str | None = None) -> LLM:
    """Return a new LLM for one conversation with its session metadata.

    Args:
        settings: backend, endpoint, model and sampling parameters.
        session_id: the conversation's session id (also the gateway/engine ``session_id``).
        usage_id: the SDK's usage id (metrics bucket).
        session_token: the session's token, sent on every call (``None``: none).

    Raises:
        pydantic.ValidationError: the SDK rejects a value (the message names the field).
    """
    fields = set(LLM.model_fields)
    kwargs: dict[str, Any] = {
        "model": model_name_for(settings.model),
        "base_url": settings.base_url,
        "api_key": settings.api_key,
        "usage_id": usage_id,
        "temperature": settings.temperature,
        "top_p": settings.top_p,
        "top_k": settings.top_k,
        "max_output_tokens": settings.max_output_tokens,
        "timeout": settings.timeout_s,
        "num_retries": settings.num_retries,
        "native_tool_calling": settings.native_tool_calling,
        "extra_headers": {SESSION_HEADER: session_id,
                          **({TOKEN_HEADER: session_token} if session_token else {})},
    }
    if settings.backend == "vllm":
        kwargs["litellm_extra_body"] = {"session_id": session_id, "vllm_xargs": {"mars_turn": 0}}
    elif settings.backend == "mars":
        kwargs["litellm_extra_body"] = {"vllm_xargs": {"mars_turn": 0}}
    if "capability_overrides" in fields:
        kwargs["capability_overrides"] = dict(_SAMPLING_OVERRIDES)
    return LLM(**{k: v for k, v in kwargs.items() if k in fields})


class TurnTracker:
    """Conversation callback keeping ``vllm_xargs.mars_turn`` equal to the next LLM call's index.

    Args:
        llm: this conversation's LLM (from :func:`build_session_llm`); mutated in place:
            ``llm.litellm_extra_body["vllm_xargs"]`` is replaced by a new dict after each response.

    Attributes:
        num_responses: LLM responses seen so far (distinct ``llm_response_id`` of agent events).
    """

    def __init__(self, llm: LLM) -> None:
        self.llm = llm
        self.num_responses = 0
        self._seen: set[str] = set()
        self._lock = threading.Lock()

    def __call__(self, event: Any) -> None:
        response_id = getattr(event, "llm_response_id", None)
        if response_id is None or getattr(event, "source", "agent") != "agent":
            return
        with self._lock:
            if response_id in self._seen:
                return
            self._seen.add(response_id)
            self.num_responses += 1
            body = self.llm.litellm_extra_body
            if isinstance(body, dict) and "vllm_xargs" in body:
                body["vllm_xargs"] = {**body["vllm_xargs"], "mars_turn": self.num_responses}
