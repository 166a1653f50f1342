"""Command-line helpers shared by the eval CLIs (compare, workload, replay).

The ``type=`` callables return the parsed value or raise :class:`argparse.ArgumentTypeError`, which
argparse turns into one ``error: argument --flag: <message>`` line and exit status 2. Range checks
that belong to a config model stay in the model; :func:`config_error_lines` reports its
``ValidationError`` per flag, using :func:`long_flags` of the parser.
"""

from __future__ import annotations

import argparse
import json
import math
from typing import Any

# The number types and the config error lines serve the mars_openhands layers' command lines too,
# which may not import eval: they live in mars_openhands.cli_style and are re-exported here.
from mars_openhands.cli_style import (
    config_error_lines,
    count_or_zero,
    finite_float,
    long_flags,
    non_negative_float,
    non_negative_int,
    port_number,
    positive_float,
    positive_int,
)

__all__ = ["config_error_lines", "count_or_zero", "finite_float", "json_object", "long_flags", "non_negative_float",
           "non_negative_int", "port_number", "positive_float", "positive_floats", "positive_int", "positive_ints"]


def json_object(text: str) -> dict[str, Any]:
    """A JSON object (e.g. ``'{"residency": {"order": "response-ratio"}}'``)."""
    try:
        value = json.loads(text)
    except json.JSONDecodeError as e:
        raise argparse.ArgumentTypeError(f"expected a JSON object, got {text!r} ({e.msg} at column "
                                         f"{e.colno})") from None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError(f"expected a JSON object {{...}}, got {text!r}")
    return value


def _items(text: str, what: str) -> list[str]:
    """The comma-separated items of ``text``, stripped; an empty one (``"1,,2"``, ``"1,"``) is an
    error rather than skipped, as it is more likely a typo than a wish."""
    items = [v.strip() for v in text.split(",")]
    if "" in items:
        raise argparse.ArgumentTypeError(f"expected comma-separated {what} with no empty item, got {text!r}")
    return items


def positive_floats(text: str) -> tuple[float, ...]:
    """Comma-separated finite numbers > 0 (at least one, none empty), e.g. ``"0.5,1,1.2"``."""
    try:
        values = tuple(float(v) for v in _items(text, "numbers"))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated numbers, got {text!r}") from None
    if not all(math.isfinite(v) and v > 0 for v in values):
        raise argparse.ArgumentTypeError(f"expected finite positive numbers, got {text!r}")
    return values


def positive_ints(text: str) -> tuple[int, ...]:
    """Comma-separated integers >= 1 (at least one, none empty), e.g. ``"1,2,4,8"``."""
    try:
        values = tuple(int(v) for v in _items(text, "integers"))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None
    if min(values) < 1:
        raise argparse.ArgumentTypeError(f"expected integers >= 1, got {text!r}")
    return values
