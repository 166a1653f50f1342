"""Where tasks are stored and how the runtime behaves: :class:`RuntimeConfig` and its env variables.

Storage: one database holds DBOS's system tables (workflow status, step outputs, messages) and the
runtime's own tables (tasks, event log, effects, approvals). The default is an embedded SQLite file;
a PostgreSQL URL (``postgresql://user@host:5432/db``) lets several runner processes or machines share
tasks. Every environment variable the runtime reads is named here.
"""

from __future__ import annotations

import os
from pathlib import Path

from pydantic import BaseModel, ConfigDict, Field

__all__ = [
    "ENV_CRASH_AT",
    "ENV_CRASH_LOG",
    "ENV_TASKS_DB",
    "TASK_STATUSES",
    "RuntimeConfig",
    "default_db_url",
    "normalize_db_url",
]

ENV_TASKS_DB = "MARS_TASKS_DB"
"""Database URL or SQLite file path for tasks (default: ``runs/tasks/tasks.sqlite`` under the cwd)."""
ENV_CRASH_AT = "MARS_RUNTIME_CRASH_AT"
"""Test hook: comma-separated step boundaries (``before:tool:3``, ``executed:llm:0``, ``after:*``)
at which the runner SIGKILLs itself, each once (see :mod:`mars_openhands.runtime.crash`)."""
ENV_CRASH_LOG = "MARS_RUNTIME_CRASH_LOG"
"""Test hook: file listing the boundaries already crashed at (one per line), so each fires once."""

DEFAULT_DB_PATH = Path("runs") / "tasks" / "tasks.sqlite"

TASK_STATUSES = ("submitted", "running", "waiting_approval", "escalated", "succeeded", "failed", "error",
                 "ended_budget", "ended_deadline", "ended_policy")
"""Every status a task row takes, in lifecycle order (the choices of ``tasks list --status``); the
last six are ``store.TERMINAL_STATUSES``. Kept here, not in ``store``, so that building the command
line does not import SQLAlchemy."""


def normalize_db_url(value: str) -> str:
    """A SQLAlchemy URL from ``value``: URLs pass through, a file path becomes ``sqlite:///ABS``.

    Raises:
        ValueError: an empty value, or a scheme other than ``sqlite`` / ``postgresql``.
    """
    value = value.strip()
    if not value:
        raise ValueError(f"the tasks database is empty; give --db URL|PATH or set {ENV_TASKS_DB}")
    if "://" not in value:
        return "sqlite:///" + str(Path(value).expanduser().resolve())
    scheme = value.split("://", 1)[0].split("+", 1)[0]
    if scheme in ("postgres", "postgresql"):
        return "postgresql://" + value.split("://", 1)[1] if scheme == "postgres" else value
    if scheme != "sqlite":
        raise ValueError(f"tasks database {value!r}: unsupported scheme {scheme!r}; use a SQLite "
                         "file path, sqlite:///PATH or postgresql://user@host:port/db")
    return value


def default_db_url() -> str:
    """``$MARS_TASKS_DB`` if set, else ``sqlite:///<cwd>/runs/tasks/tasks.sqlite``."""
    return normalize_db_url(os.environ.get(ENV_TASKS_DB) or str(DEFAULT_DB_PATH))


class RuntimeConfig(BaseModel):
    """How one runner process stores and runs tasks. Frozen; unknown keys are an error."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    db_url: str = Field(default_factory=default_db_url)
    """SQLAlchemy URL of the tasks database (``sqlite:///...`` or ``postgresql://...``)."""
    approval_poll_s: float = Field(2.0, gt=0)
    """How long one wait for an approval message lasts before the runner re-checks the deadline
    and refreshes its heartbeat, seconds."""
    heartbeat_s: float = Field(2.0, gt=0)
    """Runner heartbeat period, seconds (lets ``tasks resume`` tell a dead runner from a live one
    on another machine)."""
    stale_after_s: float = Field(30.0, gt=0)
    """A runner on another host whose heartbeat is older than this is taken as dead, seconds."""
    max_output_chars: int = Field(20_000, ge=100)
    """Tool output kept in an observation and the event log, characters (the rest is cut)."""
    cost_per_1k_tokens_usd: float = Field(0.0, ge=0)
    """Price used for the cost budget and metrics when the model reports no cost, USD per 1000
    tokens (prompt + completion). 0: cost counts only what the model reports."""

    @property
    def is_postgres(self) -> bool:
        """Whether the database is PostgreSQL (else SQLite)."""
        return self.db_url.startswith("postgresql")
