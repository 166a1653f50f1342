"""argparse ``type=`` callables shared by the eval CLIs (compare, workload, replay).

Each returns the parsed value or raises :class:`argparse.ArgumentTypeError`, which argparse turns
into one ``error: argument --flag: <message>`` line and exit status 2. Range checks that belong to
a config model stay in the model (its errors are reported per flag by the CLI).
"""

from __future__ import annotations

import argparse
import math

__all__ = ["count_or_zero", "finite_float", "positive_float", "positive_floats", "positive_int"]


def finite_float(text: str) -> float:
    """A finite number (``nan`` and ``inf`` rejected)."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
    if not math.isfinite(value):
        raise argparse.ArgumentTypeError(f"expected a finite number, got {text!r}")
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


def count_or_zero(text: str) -> int:
    """An integer >= 0, where 0 means no limit."""
    value = _integer(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"expected an integer >= 0 (0 = no limit), got {text!r}")
    return value
