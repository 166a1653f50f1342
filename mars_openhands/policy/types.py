"""Session metadata of one LLM call, as the engine receives it (design.md §2).

The session identity is vLLM's native ``Request.session_id``. The MARS extras travel in
``vllm_xargs`` and arrive as ``request.sampling_params.extra_args``:

======================  ==============  ================================================
key                     type            meaning
======================  ==============  ================================================
``mars_turn``           int >= 0        0-based LLM call index within the session
``mars_last_step``      0 / 1 or bool   1 when this is known to be the session's last call
``mars_prev_tool``      str             tool that ran since the previous turn
``mars_prev_tool_s``    number >= 0     its measured duration, seconds
``mars_side``           0 / 1 or bool   1 for a side request (a title or summary call
                                        without tools): not the session's next turn, so
                                        it does not advance ``mars_turn`` and does not
                                        end a tool phase, release or consume the
                                        session's retained KV
``mars_session_age_s``  number >= 0     seconds since the session's first turn was sent
                                        (set by the gateway only, on every request after
                                        it): an engine that has no record of the session
                                        (it moved here from another replica) dates its
                                        first arrival back by this much
======================  ==============  ================================================

The types are strict: a string (``"3"``), a float (``2.0``, ``1e300``) or a bool is no turn, and
a flag is 0, 1, true or false, nothing else. vLLM's request model has already turned a JSON
``true`` into ``1`` when the engine sees it (``vllm_xargs`` holds str/int/float/list values), so
the engine cannot refuse ``{"mars_turn": true}``; the gateway, which reads the JSON itself, does
(:func:`mars_openhands.control.metadata.check_xargs`, HTTP 400). On the engine a bad value fails
its request: vLLM answers HTTP 500 and the reason is in the server log.

Other ``extra_args`` keys (e.g. vLLM's ``kv_transfer_params``) are ignored; an unknown key that
starts with ``mars_`` is an error (a typo would otherwise be dropped silently).

Example:
    >>> parse_turn_meta({"mars_turn": 3, "mars_last_step": 0, "other": 1})
    TurnMeta(turn=3, is_last_step=False, prev_tool=None, prev_tool_s=None, is_side=False, session_age_s=None)
    >>> parse_turn_meta({"mars_turn": "3"})
    Traceback (most recent call last):
    ...
    ValueError: invalid vllm_xargs mars_turn='3': must be an int in [0, 2147483647], not a string, float or bool (send vllm_xargs {"mars_turn": 0, ...})
    >>> parse_turn_meta({"mars_side": "title"})
    Traceback (most recent call last):
    ...
    ValueError: invalid vllm_xargs mars_side='title': must be 0, 1, true or false (send vllm_xargs {"mars_side": 1} for a side request)
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

__all__ = ["MARS_EXTRA_KEYS", "MAX_TURN", "TurnMeta", "parse_turn_meta"]

MARS_EXTRA_KEYS = ("mars_turn", "mars_last_step", "mars_prev_tool", "mars_prev_tool_s", "mars_side",
                   "mars_session_age_s")
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
    session_age_s: float | None = None
    """Seconds since the session's first turn was sent (``mars_session_age_s``): an engine that
    opens the session's record at this turn dates its first arrival back by it."""


_EMPTY = TurnMeta()

MAX_TURN = 2**31 - 1
"""The largest ``mars_turn``: a turn is a count of LLM calls; the bound keeps it within the
stream's integer columns (Parquet int64) and refuses a JSON ``1e300`` read as an integer."""

_EXAMPLES = {
    "mars_turn": '{"mars_turn": 0, ...}',
    "mars_last_step": '{"mars_last_step": 1, ...} on the session\'s last call',
    "mars_prev_tool": '{"mars_prev_tool": "bash", "mars_prev_tool_s": 1.5, ...}',
    "mars_prev_tool_s": '{"mars_prev_tool": "bash", "mars_prev_tool_s": 1.5, ...}',
    "mars_side": '{"mars_side": 1} for a side request',
    "mars_session_age_s": '{"mars_session_age_s": 12.5, ...} (the gateway sets it)',
}
"""Each key's own example, for the hint of its error."""


def _bad(key: str, value: Any, expected: str) -> ValueError:
    shown = repr(value)
    shown = shown if len(shown) <= 40 else shown[:37] + "..."  # a 4000-digit JSON number
    return ValueError(f"invalid vllm_xargs {key}={shown}: must be {expected} "
                      f"(send vllm_xargs {_EXAMPLES[key]})")


def _as_turn(value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= MAX_TURN:
        raise _bad("mars_turn", value, f"an int in [0, {MAX_TURN}], not a string, float or bool")
    return value


def _as_flag(key: str, value: Any) -> bool:
    if isinstance(value, bool):
        return value
    if isinstance(value, int) and value in (0, 1):
        return bool(value)
    raise _bad(key, value, "0, 1, true or false")


def _as_seconds(key: str, value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise _bad(key, value, "a number of seconds >= 0, not a string or bool")
    try:
        seconds = float(value)
    except OverflowError:  # an int past float's range
        raise _bad(key, value, "a number of seconds >= 0") from None
    if not math.isfinite(seconds) or seconds < 0:
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
    age = extra_args.get("mars_session_age_s")
    if tool is not None and (not isinstance(tool, str) or not tool):
        raise _bad("mars_prev_tool", tool, "a non-empty tool name")
    return TurnMeta(
        turn=None if turn is None else _as_turn(turn),
        is_last_step=None if last is None else _as_flag("mars_last_step", last),
        prev_tool=tool,
        prev_tool_s=None if tool_s is None else _as_seconds("mars_prev_tool_s", tool_s),
        is_side=side is not None and _as_flag("mars_side", side),
        session_age_s=None if age is None else _as_seconds("mars_session_age_s", age),
    )
