"""InferCept: min-waste handling of intercepted (tool-calling) requests (arXiv 2402.01869, §4).

When an LLM call is intercepted by a tool (augmentation), InferCept chooses per request among
three ways to handle its context of ``C`` tokens, minimizing the GPU memory wasted, in
token-seconds of KV memory times ``M`` (bytes of KV per token):

* **discard** (recompute on resume): ``T_fwd(C) * (C + C_other) * M``, since recomputing ``C``
  tokens stalls the ``C_other`` tokens of the other running requests as well;
  **chunked** recompute ``~ T_fwd(C) * C * M / 2 + n * T_fwd(C / n) * C_other * M``;
* **preserve** (keep KV on the GPU through the tool call): ``T_tool * C * M``;
* **swap** (to host memory and back): ``2 * T_swap(C) * C_batch * M``.

MARS's port, which we follow (design.md §5; MARS preview ``_infercept_*``, commit 7e649f3): no
swap; at the end of a turn that is not the session's last, **preserve for the break-even TTL**
``T_fwd(C) * (C + C_other) / (2 C)``, the hold time at which preserving wastes as much as the
chunked-discard estimate ``T_fwd(C) * (C + C_other) / 2`` (``M`` cancels); requests run in FCFS
order, and preemption is vLLM's stock choice.

Why no swap here: vLLM 0.32's KV offloading connectors (``OffloadingConnector`` with its CPU
backend, ``SimpleCPUOffloadConnector``) copy blocks with CUDA/XPU streams and refuse other
platforms ("CPU Offloading is currently only supported on CUDA-alike and XPU GPUs"), and the
emulated executor of this project holds no KV tensors to copy; they also offload prefix-cache
blocks as they are computed and reload on a prefix hit, rather than swap one request out at
interception time. The swap waste formula is provided (:func:`swap_waste`) so that a GPU build
can compare all three, but no scheduler here acts on it.

Mental model: every second a request's KV sits idle wastes ``C`` token-seconds; discarding it
wastes the time everyone waits while it is recomputed. Preserve while the first is smaller.
"""

from __future__ import annotations

from typing import Annotated

from pydantic import BaseModel, ConfigDict, Field

from mars_openhands.policy.continuum import PrefillReloadModel

__all__ = [
    "InferceptParams",
    "break_even_ttl_s",
    "chunked_discard_waste",
    "discard_waste",
    "infercept_ttl_s",
    "preserve_waste",
    "swap_waste",
]

NonNegFloat = Annotated[float, Field(ge=0.0)]


class InferceptParams(BaseModel):
    """Parameters of the InferCept baseline (``--additional-config`` key ``mars.infercept``)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    prefill_reload: PrefillReloadModel = PrefillReloadModel()
    """``T_fwd(C)``: seconds to recompute ``C`` tokens (default 0.0002 s/token, MARS preview)."""
    min_pin_ttl_s: NonNegFloat = 0.01
    """TTLs at or below this are not retained at all, seconds (MARS preview: ``> 0.01``)."""


def discard_waste(
    t_fwd_s: float, context_tokens: int, other_tokens: int, kv_bytes_per_token: float = 1.0
) -> float:
    """Waste of discarding and recomputing: ``T_fwd(C) * (C + C_other) * M``. Pure.

    Args:
        t_fwd_s: seconds to recompute the context, ``T_fwd(C)``.
        context_tokens: ``C``, the intercepted request's context, tokens.
        other_tokens: ``C_other``, tokens of the other running requests, tokens.
        kv_bytes_per_token: ``M``; 1.0 gives token-seconds.

    Returns:
        Waste in byte-seconds (token-seconds when ``M = 1``).
    """
    return t_fwd_s * (context_tokens + other_tokens) * kv_bytes_per_token


def chunked_discard_waste(
    t_fwd_s: float,
    t_fwd_chunk_s: float,
    context_tokens: int,
    other_tokens: int,
    num_chunks: int,
    kv_bytes_per_token: float = 1.0,
) -> float:
    """Waste of chunked recompute: ``T_fwd(C) * C * M / 2 + n * T_fwd(C/n) * C_other * M``. Pure.

    Args:
        t_fwd_s: ``T_fwd(C)``, seconds.
        t_fwd_chunk_s: ``T_fwd(C / n)``, seconds for one chunk.
        context_tokens: ``C``, tokens.
        other_tokens: ``C_other``, tokens.
        num_chunks: ``n`` (>= 1).
        kv_bytes_per_token: ``M``.

    Raises:
        ValueError: ``num_chunks < 1``.
    """
    if num_chunks < 1:
        raise ValueError(f"num_chunks must be >= 1, got {num_chunks}")
    return (
        t_fwd_s * context_tokens * kv_bytes_per_token / 2.0
        + num_chunks * t_fwd_chunk_s * other_tokens * kv_bytes_per_token
    )


def preserve_waste(tool_s: float, context_tokens: int, kv_bytes_per_token: float = 1.0) -> float:
    """Waste of preserving KV through the tool call: ``T_tool * C * M``. Pure."""
    return tool_s * context_tokens * kv_bytes_per_token


def swap_waste(t_swap_s: float, batch_tokens: int, kv_bytes_per_token: float = 1.0) -> float:
    """Waste of swapping out and back in: ``2 * T_swap(C) * C_batch * M``. Pure.

    Args:
        t_swap_s: ``T_swap(C)``, seconds to move the context one way.
        batch_tokens: ``C_batch``, tokens of the running batch stalled by the transfer.
        kv_bytes_per_token: ``M``.
    """
    return 2.0 * t_swap_s * batch_tokens * kv_bytes_per_token


def break_even_ttl_s(t_fwd_s: float, context_tokens: int, other_tokens: int) -> float:
    """MARS's InferCept TTL: ``T_fwd(C) * (C + C_other) / (2 C)``, seconds. Pure.

    The hold time ``tau`` at which ``preserve_waste(tau, C) == T_fwd(C) * (C + C_other) / 2``.

    Returns:
        Seconds (>= 0); 0.0 when ``C <= 0``.

    Examples:
        >>> break_even_ttl_s(t_fwd_s=0.2, context_tokens=1000, other_tokens=3000)
        0.4
    """
    if context_tokens <= 0:
        return 0.0
    return max(0.0, t_fwd_s) * (context_tokens + max(0, other_tokens)) / (2.0 * context_tokens)


def infercept_ttl_s(context_tokens: int, other_tokens: int, params: InferceptParams) -> float:
    """Retention TTL at the end of a non-final turn (MARS port), seconds. Pure.

    Args:
        context_tokens: ``C``, the finished request's tokens (prompt + output), tokens.
        other_tokens: ``C_other``, the tokens of the other running requests, tokens.
        params: InferCept parameters.

    Returns:
        :func:`break_even_ttl_s` with ``T_fwd = params.prefill_reload.seconds(C)``, or 0.0 (do
        not retain) when that is at most ``params.min_pin_ttl_s``.

    Examples:
        >>> infercept_ttl_s(1000, 3000, InferceptParams())  # 0.2 s * 4000 / 2000
        0.4
    """
    t_fwd_s = params.prefill_reload.seconds(context_tokens)
    ttl_s = break_even_ttl_s(t_fwd_s, context_tokens, other_tokens)
    return ttl_s if ttl_s > params.min_pin_ttl_s else 0.0
