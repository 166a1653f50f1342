"""A task: immutable id, budget, deadline, permission scope and acceptance criteria (design.md §11).

A :class:`TaskSpec` is what a person submits (a JSON object; a file may hold one object or JSON
lines). It is stored once, with its digest: submitting the same ``task_id`` again with the same spec
attaches to the existing task, and with a different spec is refused. Nothing in it changes after
submission; the deadline becomes an absolute time at the first submission.
"""

from __future__ import annotations

import hashlib
import json
import re
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from mars_openhands.runtime.effects import EffectClass, EffectRule

__all__ = [
    "Acceptance",
    "AgentSpec",
    "Budget",
    "PermissionScope",
    "TaskSpec",
    "load_task_specs",
]

_TASK_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.:-]{0,127}")


class Budget(BaseModel):
    """Limits over the whole task, across restarts. ``None``: no limit."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    max_llm_tokens: int | None = Field(None, ge=1)
    """Prompt + completion tokens over all LLM calls."""
    max_cost_usd: float | None = Field(None, gt=0)
    """Model cost, USD (reported by the model, else tokens × ``RuntimeConfig.cost_per_1k_tokens_usd``)."""
    max_tool_s: float | None = Field(None, gt=0)
    """Tool execution time, seconds (also caps each call's timeout)."""
    max_turns: int | None = Field(None, ge=1)
    """LLM calls."""


class PermissionScope(BaseModel):
    """What the task may do without asking: paths, command (effect) classes, network."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    workspace_paths: tuple[str, ...] = ()
    """Absolute directories writes may target besides the task's workspace."""
    allowed_effects: tuple[EffectClass, ...] = (
        EffectClass.READ, EffectClass.IDEMPOTENT_WRITE, EffectClass.COMPENSABLE_WRITE,
        EffectClass.LOCAL_WRITE)
    """Command classes that run without approval. A list that allows ``idempotent_write`` and
    names ``local_write`` in neither list allows ``local_write`` too: those writes (``pytest``,
    ``sed -i``, appends) were idempotent writes before the class existed, so task files written
    then keep their meaning."""
    approval_effects: tuple[EffectClass, ...] = (EffectClass.IRREVERSIBLE,)
    """Command classes that run only after a person approves the exact action (its digest);
    a class in neither tuple is denied."""
    network: bool = False
    """Whether actions that reach the network (``curl``, ``git push``, ...) may run at all."""
    guard: bool = True
    """Apply the command guard (``guard.py``: foreign kills, privilege escalation, writes outside
    the workspace, host mutation)."""
    end_on_deny: bool = False
    """End the task (status ``ended_policy``) when the gate or a person denies an action; default:
    the agent is told and goes on."""

    @model_validator(mode="before")
    @classmethod
    def _local_writes_as_before(cls, data: Any) -> Any:
        if not isinstance(data, dict) or not isinstance(data.get("allowed_effects"), list | tuple):
            return data  # the default, or a bad value the field's own check reports
        allowed = list(data["allowed_effects"])  # StrEnum members equal their values
        approval = data.get("approval_effects", ())
        named = [*allowed, *(approval if isinstance(approval, list | tuple) else ())]
        if EffectClass.IDEMPOTENT_WRITE in allowed and EffectClass.LOCAL_WRITE not in named:
            return {**data, "allowed_effects": (*allowed, EffectClass.LOCAL_WRITE)}
        return data

    @model_validator(mode="after")
    def _disjoint(self) -> PermissionScope:
        both = set(self.allowed_effects) & set(self.approval_effects)
        if both:
            raise ValueError(f"scope: {sorted(e.value for e in both)} are in both allowed_effects "
                             "and approval_effects; put each class in one")
        return self


class Acceptance(BaseModel):
    """How the result is accepted: a shell command in the workspace whose exit code 0 accepts."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    command: str | None = None
    """E.g. ``"python -m pytest -q tests/test_calc.py"``; ``None``: the agent finishing accepts."""
    timeout_s: float = Field(600.0, gt=0)


class AgentSpec(BaseModel):
    """Which agent runs the task and against which model endpoint."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    kind: Literal["chat", "openhands"] = "chat"
    """``chat``: the runtime's own tool-calling loop (terminal + file editor; any env);
    ``openhands``: an OpenHands conversation (needs the OpenHands env, ``.venv-openhands``)."""
    base_url: str
    """OpenAI-compatible endpoint including ``/v1`` (``http://127.0.0.1:8000/v1``)."""
    model: str
    api_key: str = "EMPTY"
    max_iterations: int = Field(50, ge=1)
    """Agent steps per run before it stops (OpenHands' ``max_iteration_per_run``; the chat loop's
    turns)."""
    temperature: float | None = Field(None, ge=0.0)
    request_timeout_s: float = Field(600.0, gt=0)


class TaskSpec(BaseModel):
    """One durable task. Frozen; unknown keys are an error."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    task_id: str
    """Immutable id; also the DBOS workflow id. Letters, digits, ``_ . : -``; at most 128."""
    problem_statement: str = Field(min_length=1)
    workspace: str
    """Existing directory the agent works in (its root for the gate's path rules)."""
    agent: AgentSpec
    budget: Budget = Budget()
    deadline_s: float | None = Field(None, gt=0)
    """Seconds from the first submission to the deadline (wall clock, survives restarts)."""
    scope: PermissionScope = PermissionScope()
    acceptance: Acceptance = Acceptance()
    effect_rules: tuple[EffectRule, ...] = ()
    """Extra classification rules, tried before the defaults (``effects.DEFAULT_RULES``)."""
    session_id: str | None = None
    """UUID for the OpenHands conversation / gateway session (default: derived from ``task_id``)."""

    @field_validator("task_id")
    @classmethod
    def _task_id_ok(cls, value: str) -> str:
        if not _TASK_ID.fullmatch(value):
            raise ValueError(f"task_id {value!r}: use 1-128 letters, digits or '_.:-', starting "
                             "with a letter or digit")
        return value

    @field_validator("workspace")
    @classmethod
    def _workspace_absolute(cls, value: str) -> str:
        return str(Path(value).expanduser().resolve())

    def digest(self) -> str:
        """SHA-256 hex of the canonical JSON of this spec (what 'the same task' means). Pure."""
        body = json.dumps(self.model_dump(mode="json"), sort_keys=True, separators=(",", ":"))
        return hashlib.sha256(body.encode()).hexdigest()


def load_task_specs(path: Path, overrides: dict[str, Any] | None = None) -> list[TaskSpec]:
    """Read a task file: one JSON object, a JSON list, or JSON lines.

    Args:
        path: the file.
        overrides: fields set on every task (e.g. ``{"workspace": ...}`` from a flag).

    Raises:
        ValueError: unreadable file, bad JSON or an invalid task; the message names the file, the
            task (line or index) and the field.
    """
    try:
        text = path.read_text()
    except OSError as e:
        raise ValueError(f"{path}: cannot read ({e.strerror or e})") from None
    items = _json_items(path, text)
    specs = []
    for where, item in items:
        if not isinstance(item, dict):
            raise ValueError(f"{path} {where}: a task must be a JSON object, got {type(item).__name__}")
        try:
            specs.append(TaskSpec.model_validate({**item, **(overrides or {})}))
        except ValueError as e:
            errors = getattr(e, "errors", lambda: [])()
            detail = "; ".join(f"{'.'.join(map(str, x['loc'])) or 'task'}: {x['msg']}"
                               for x in errors) or str(e)
            raise ValueError(f"{path} {where}: invalid task: {detail}") from None
    if not specs:
        raise ValueError(f"{path}: no tasks in the file")
    ids = [s.task_id for s in specs]
    if len(set(ids)) != len(ids):
        raise ValueError(f"{path}: task_id values repeat ({sorted({i for i in ids if ids.count(i) > 1})})")
    return specs


def _json_items(path: Path, text: str) -> list[tuple[str, Any]]:
    try:
        whole = json.loads(text)
    except json.JSONDecodeError:
        whole = None
    if isinstance(whole, dict):
        return [("task", whole)]
    if isinstance(whole, list):
        return [(f"item {i}", x) for i, x in enumerate(whole)]
    items = []
    for i, line in enumerate(text.split("\n"), start=1):
        if not line.strip():
            continue
        try:
            items.append((f"line {i}", json.loads(line)))
        except json.JSONDecodeError as e:
            raise ValueError(f"{path} line {i}: not JSON ({e.msg} at column {e.colno})") from None
    return items
