"""What the OpenHands SDK and LiteLLM print on their own, kept out of our commands' output.

Run in ``.venv-openhands``, a command printed, before its own first line: LiteLLM's three failed
attempts to download its price map (it fetches it from GitHub at import; ~12 s of retries without
a network), the SDK's banner box, its INFO log lines (one per tool and conversation set-up), and
per model without a price "UserWarning: Cost calculation failed". None of it is about our work;
all of it hid it. Standard library only, so that any entry point can call it before the SDK is
imported:

* :func:`quiet_environment`: ``LITELLM_LOCAL_MODEL_COST_MAP=True`` (the price map bundled with
  LiteLLM) and ``OPENHANDS_SUPPRESS_BANNER=1``, as defaults (a value the user set wins). Must run
  before the SDK or LiteLLM is imported: both read them at import.
* :func:`quiet_sdk_logs`: the SDK's loggers at WARNING (``MARS_OPENHANDS_LOG_LEVEL`` to change it,
  e.g. ``INFO`` to see them again) and the cost warning ignored. After the SDK is imported (it
  configures logging at import).
"""

from __future__ import annotations

import contextlib
import logging
import os
import warnings
from collections.abc import Iterator, MutableMapping

__all__ = ["ENV_LOG_LEVEL", "QUIET_ENVIRONMENT", "quiet_environment", "quiet_sdk_logs", "replacing_stock_tool"]

QUIET_ENVIRONMENT = {"LITELLM_LOCAL_MODEL_COST_MAP": "True", "OPENHANDS_SUPPRESS_BANNER": "1"}
"""Defaults set by :func:`quiet_environment` (never over a value already set)."""

ENV_LOG_LEVEL = "MARS_OPENHANDS_LOG_LEVEL"
"""Level of the SDK's loggers under our commands (default ``WARNING``)."""


def quiet_environment(environ: MutableMapping[str, str] = os.environ) -> None:
    """Set :data:`QUIET_ENVIRONMENT` as defaults in ``environ``. Mutates: ``environ``."""
    for name, value in QUIET_ENVIRONMENT.items():
        environ.setdefault(name, value)


@contextlib.contextmanager
def replacing_stock_tool(name: str) -> Iterator[None]:
    """Around our ``register_tool(name, ...)`` over a stock tool name: the SDK registry's warning
    "Duplicate tool name registered: <name>" is dropped for that name while inside.

    Registering our evented tools under the stock names is how they reach agent specs written for
    stock OpenHands, so the replacement is intended; docs/openhands.md reads that warning,
    when the stock tools replace *ours*, as the symptom of a broken setup, so a sandbox log that
    carries it for every start misleads.

    Mutates: a filter on the ``openhands.sdk.tool.registry`` logger, removed on exit.
    """
    registry = logging.getLogger("openhands.sdk.tool.registry")
    expected = f"Duplicate tool name registered: {name}"

    def keep(record: logging.LogRecord) -> bool:
        return record.getMessage() != expected

    registry.addFilter(keep)
    try:
        yield
    finally:
        registry.removeFilter(keep)


def _is_not_in_memory_notice(record: logging.LogRecord) -> bool:
    return not record.getMessage().startswith("No persistence_dir provided")


def quiet_sdk_logs(environ: MutableMapping[str, str] = os.environ, in_memory_conversations: bool = False) -> None:
    """The SDK's loggers (``openhands.*``) at ``MARS_OPENHANDS_LOG_LEVEL`` (default WARNING), and
    LiteLLM's "Cost calculation failed" warning (a model it has no price for) ignored.

    Args:
        environ: where ``MARS_OPENHANDS_LOG_LEVEL`` is read.
        in_memory_conversations: the caller keeps no conversation on disk on purpose (the durable
            runtime logs every step itself): drop the SDK's warning that it falls back to memory.

    Mutates: the ``openhands`` logger's level (and, with ``in_memory_conversations``, a filter on
    the conversation-state logger) and the process's warning filters.

    Raises:
        ValueError: ``MARS_OPENHANDS_LOG_LEVEL`` is not a logging level name.
    """
    name = environ.get(ENV_LOG_LEVEL, "WARNING").upper()
    level = logging.getLevelName(name)
    if not isinstance(level, int):
        raise ValueError(f"{ENV_LOG_LEVEL} must be a logging level (DEBUG, INFO, WARNING, ERROR), got {name!r}")
    logging.getLogger("openhands").setLevel(level)
    if in_memory_conversations:
        state = logging.getLogger("openhands.sdk.conversation.state")
        if _is_not_in_memory_notice not in state.filters:
            state.addFilter(_is_not_in_memory_notice)
    warnings.filterwarnings("ignore", message="Cost calculation failed", category=UserWarning)
