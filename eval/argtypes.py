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
import re
from collections.abc import Mapping
from typing import Any

__all__ = ["config_error_lines", "count_or_zero", "finite_float", "json_object", "long_flags", "non_negative_float",
           "positive_float", "positive_floats", "positive_int", "positive_ints"]


def finite_float(text: str) -> float:
    """A finite number (``nan`` and ``inf`` rejected)."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
    if not math.isfinite(value):
        raise argparse.ArgumentTypeError(f"expected a finite number, got {text!r}")
    return value


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


def positive_float(text: str) -> float:
    """A finite number > 0."""
    value = finite_float(text)
    if value <= 0:
        raise argparse.ArgumentTypeError(f"expected a number > 0, got {text!r}")
    return value


def positive_floats(text: str) -> tuple[float, ...]:
    """Comma-separated finite numbers > 0 (at least one), e.g. ``"0.5,1,1.2"``."""
    try:
        values = tuple(float(v) for v in text.split(",") if v.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated numbers, got {text!r}") from None
    if not values or not all(math.isfinite(v) and v > 0 for v in values):
        raise argparse.ArgumentTypeError(f"expected finite positive numbers, got {text!r}")
    return values


def non_negative_float(text: str) -> float:
    """A finite number >= 0."""
    value = finite_float(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"expected a number >= 0, got {text!r}")
    return value


def positive_ints(text: str) -> tuple[int, ...]:
    """Comma-separated integers >= 1 (at least one), e.g. ``"1,2,4,8"``."""
    try:
        values = tuple(int(v) for v in text.split(",") if v.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError(f"expected integers >= 1, got {text!r}")
    return values


def _integer(text: str) -> int:
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None


def positive_int(text: str) -> int:
    """An integer >= 1."""
    value = _integer(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected an integer >= 1, got {text!r}")
    return value


def non_negative_int(text: str) -> int:
    """An integer >= 0 (e.g. a random seed)."""
    value = _integer(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"expected an integer >= 0, got {text!r}")
    return value


def count_or_zero(text: str) -> int:
    """An integer >= 0, where 0 means no limit."""
    value = _integer(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"expected an integer >= 0 (0 = no limit), got {text!r}")
    return value


def long_flags(parser: argparse.ArgumentParser) -> dict[str, str]:
    """``dest -> long option`` of every optional flag of ``parser`` (``--help`` left out)."""
    return {action.dest: next(o for o in action.option_strings if o.startswith("--"))
            for action in parser._actions
            if action.dest != "help" and any(o.startswith("--") for o in action.option_strings)}


def config_error_lines(error: Any, flags: Mapping[str, str]) -> list[str]:
    """One ``--flag: <msg> (got <value>)`` line per problem of a config built from flags. Pure.

    Args:
        error: a pydantic ``ValidationError``.
        flags: field name → flag, e.g. ``{"num_tool_workers": "--num-tool-workers"}``; a field not
            in it prints as ``--<field with dashes>``. Errors of a model-level check (no field
            location) are assigned to the first field their message names.

    Returns:
        The lines, without pydantic's input dump and documentation URL (no ``error:`` prefix).
    """
    lines = []
    for item in error.errors(include_url=False):
        message = str(item["msg"]).removeprefix("Value error, ")
        loc, got = tuple(item["loc"]), item.get("input")
        if not loc and isinstance(got, dict):  # the model validator: find the field it names
            named = [w for w in re.findall(r"[a-z][a-z0-9_]*", message) if w in flags]
            loc, got = ((named[0],), got.get(named[0])) if named else ((), got)
        flag = flags.get(str(loc[0]), "--" + str(loc[0]).replace("_", "-")) if loc else "config"
        message = message.removesuffix(f" ({flag})")
        if item["type"] == "missing":
            lines.append(f"{flag}: required; pass {flag} VALUE")
        elif "got " in message or isinstance(got, dict):
            lines.append(f"{flag}: {message}")
        else:
            lines.append(f"{flag}: {message} (got {got!r})")
    return lines
