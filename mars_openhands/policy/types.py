"""Session metadata of one LLM call, as the engine receives it (design.md §2).

The session identity is vLLM's native ``Request.session_id``. The MARS extras travel in
``vllm_xargs`` and arrive as ``request.sampling_params.extra_args``:

======================  =========  ==================================================
key                     type       meaning
======================  =========  ==================================================
``mars_turn``           int >= 0   0-based LLM call index within the session
``mars_last_step``      0 / 1      1 when this is known to be the session's last call
``mars_prev_tool``      str        tool that ran since the previous turn
``mars_prev_tool_s``    float >=0  its measured duration, seconds
``mars_side``           0 / 1      1 for a side request (a title or summary call without
                                   tools): not the session's next turn, so it does not
                                   advance ``mars_turn`` and does not end a tool phase,
                                   release or consume the session's retained KV
======================  =========  ==================================================

Other ``extra_args`` keys (e.g. vLLM's ``kv_transfer_params``) are ignored; an unknown key that
starts with ``mars_`` is an error (a typo would otherwise be dropped silently).

Example:
    >>> parse_turn_meta({"mars_turn": "3", "mars_last_step": 0, "other": 1})
    TurnMeta(turn=3, is_last_step=False, prev_tool=None, prev_tool_s=None, is_side=False)
    >>> parse_turn_meta({"mars_turn": -1})
    Traceback (most recent call last):
    ...
    ValueError: invalid vllm_xargs mars_turn=-1: must be an int >= 0 (send vllm_xargs {"mars_turn": 0, ...})
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

__all__ = ["MARS_EXTRA_KEYS", "TurnMeta", "parse_turn_meta"]

MARS_EXTRA_KEYS = ("mars_turn", "mars_last_step", "mars_prev_tool", "mars_prev_tool_s", "mars_side")
"""The ``vllm_xargs`` keys the engine reads."""


@dataclass(frozen=True, slots=True)
class TurnMeta:
    """Parsed MARS extras of one request. ``None`` means unknown."""

    turn: int | None = None
    is_last_step: bool | None = None
    prev_tool: str | None = None
    prev_tool_s: float | None = None
    is_side: bool = False
    """A side request (``mars_side=1``): not one of the session's agent turns."""


_EMPTY = TurnMeta()
_HINT = '(send vllm_xargs {"mars_turn": 0, ...})'


def _bad(key: str, value: Any, expected: str) -> ValueError:
    return ValueError(f"invalid vllm_xargs {key}={value!r}: must be {expected} {_HINT}")


def _as_int(key: str, value: Any, lo: int, hi: int | None = None) -> int:
    if isinstance(value, bool):
        value = int(value)
    if isinstance(value, float) and value.is_integer():
        value = int(value)
    if isinstance(value, str):
        try:
            value = int(value.strip())
        except ValueError:
            raise _bad(key, value, _range_text(lo, hi)) from None
    if not isinstance(value, int) or value < lo or (hi is not None and value > hi):
        raise _bad(key, value, _range_text(lo, hi))
    return value


def _range_text(lo: int, hi: int | None) -> str:
    return f"an int >= {lo}" if hi is None else f"{lo} or {hi}" if hi == lo + 1 else f"in [{lo}, {hi}]"


def _as_seconds(key: str, value: Any) -> float:
    try:
        seconds = float(value)
    except (TypeError, ValueError):
        raise _bad(key, value, "a number of seconds >= 0") from None
    if isinstance(value, bool) or not math.isfinite(seconds) or seconds < 0:
        raise _bad(key, value, "a number of seconds >= 0")
    return seconds


def parse_turn_meta(extra_args: Mapping[str, Any] | None) -> TurnMeta:
    """Parse the MARS keys of ``sampling_params.extra_args``. Pure.

    Args:
        extra_args: the request's ``extra_args`` (may be None).

    Returns:
        The parsed metadata (all fields None when no MARS key is present).

    Raises:
        ValueError: a MARS key with a bad value, or an unknown ``mars_*`` key; the message names
            the key and the value.
    """
    if not extra_args:
        return _EMPTY
    unknown = [k for k in extra_args if k.startswith("mars_") and k not in MARS_EXTRA_KEYS]
    if unknown:
        raise ValueError(
            f"unknown vllm_xargs key(s) {sorted(unknown)}; supported: {list(MARS_EXTRA_KEYS)}"
        )
    if not any(k in extra_args for k in MARS_EXTRA_KEYS):
        return _EMPTY
    turn = extra_args.get("mars_turn")
    last = extra_args.get("mars_last_step")
    tool = extra_args.get("mars_prev_tool")
    tool_s = extra_args.get("mars_prev_tool_s")
    side = extra_args.get("mars_side")
    if tool is not None and (not isinstance(tool, str) or not tool):
        raise _bad("mars_prev_tool", tool, "a non-empty tool name")
    return TurnMeta(
        turn=None if turn is None else _as_int("mars_turn", turn, 0),
        is_last_step=None if last is None else bool(_as_int("mars_last_step", last, 0, 1)),
        prev_tool=tool,
        prev_tool_s=None if tool_s is None else _as_seconds("mars_prev_tool_s", tool_s),
        is_side=side is not None and bool(_as_int("mars_side", side, 0, 1)),
    )
