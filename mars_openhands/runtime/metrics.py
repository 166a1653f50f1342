"""Task-level metrics (design.md §11): per task, then over tasks.

Per task (one row, :data:`TASK_COLUMNS`): E2E time (first start → end, wall clock, downtime between
a crash and its resume included: the person waits through it), LLM / tool / approval-wait time,
tool-wait share (tool seconds / E2E), runs and recoveries, tokens and cost, duplicate side effects,
denials and escalations, and why it ended.

Over tasks (:func:`summarize`): E2E mean / P50 / P95, tool-wait share (Σ tool s / Σ E2E s),
recovery success rate (tasks restarted at least once that still reached a final status other than
``error``, over tasks restarted), duplicate side effects (total), cost per successful task
(Σ cost / successes), and the shares of tasks ended by budget, deadline or policy.

Duplicate side effects: an execution beyond the first, that nobody allowed, of an action whose
repeat is not provably a no-op (a compensable write, a local write, an irreversible action; or a
call recorded as a read or idempotent write that today's rules no longer prove idempotent, such as
``echo x >> f`` classed before appends were local writes). A person's approved re-run of an
in-doubt action, and a re-run after the in-doubt attempt was undone by its compensation, are
allowed; reads and provably idempotent writes never count (the target drops a repeat of a key).
An extra execution is a *known* duplicate (``num_duplicate_effects``) when more attempts recorded
an outcome than were allowed: the effect ran that often for sure. It is a *possible* duplicate
(``num_possible_duplicate_effects``) when the attempt before it was in doubt (killed with no
recorded outcome): its effect may or may not have happened before the repeat, and the runtime
cannot tell which; check the target.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

from mars_openhands.runtime.effects import DEFAULT_RULES, Action, EffectClass, classify
from mars_openhands.runtime.store import TERMINAL_STATUSES, Store
from mars_openhands.runtime.task import TaskSpec

__all__ = ["TASK_COLUMNS", "duplicate_effects", "summarize", "task_rows"]

TASK_COLUMNS: tuple[str, ...] = (
    "task_id", "kind", "status", "end_reason", "e2e_s", "queue_s", "llm_s", "tool_s",
    "approval_wait_s", "tool_wait_share", "num_runs", "num_recoveries", "num_llm_calls",
    "num_tool_calls", "num_llm_tokens", "cost_usd", "num_duplicate_effects",
    "num_possible_duplicate_effects", "num_denied",
    "num_escalations", "is_succeeded", "is_ended_by_budget", "is_ended_by_deadline",
    "is_ended_by_policy",
)
"""Columns of one task's metrics row (also what ``compare`` reports for OpenHands task runs)."""


def _is_repeatable(row: dict[str, Any], spec: TaskSpec | None) -> bool:
    """Whether the call of effect ``row`` may run again as a no-op: its recorded class *and* its
    class under today's rules (``spec``'s, then the defaults) are a read or an idempotent write."""
    if not EffectClass(row["effect"]).is_repeatable:
        return False
    action = (row["intent"] or {}).get("action")
    if spec is None or not action:
        return True
    workspace = Path(spec.workspace)
    now = classify(Action.model_validate(action), workspace, (*spec.effect_rules, *DEFAULT_RULES),
                   tuple(Path(p) for p in spec.scope.workspace_paths))
    return now.effect.is_repeatable


def duplicate_effects(effects: list[dict[str, Any]], events: list[dict[str, Any]],
                      spec: TaskSpec | None = None) -> tuple[int, int]:
    """Known and possible duplicate side effects of one task (module doc). Pure.

    Args:
        effects: the task's effect rows (``Store.effects``).
        events: the task's event log (``Store.events``): ``tool_call`` events (one per attempt
            with a recorded outcome) and ``compensated`` events.
        spec: the task, to classify recorded calls again under today's rules (``None``: trust
            the recorded classes).

    Returns:
        ``(known, possible)`` counts of executions beyond those allowed.
    """
    undone: dict[str, int] = {}
    finished: dict[str, int] = {}
    for e in events:
        if e["kind"] == "compensated" and "in doubt" in str(e["payload"].get("why", "")):
            undone[e["payload"]["key"]] = undone.get(e["payload"]["key"], 0) + 1
        elif e["kind"] == "tool_call":
            finished[e["payload"]["key"]] = finished.get(e["payload"]["key"], 0) + 1
    known = possible = 0
    for row in effects:
        if _is_repeatable(row, spec):
            continue
        allowed = 1 + int(bool((row["outcome"] or {}).get("is_rerun"))) + undone.get(row["key"], 0)
        extra = max(0, int(row["num_attempts"]) - allowed)
        sure = min(extra, max(0, finished.get(row["key"], 0) - allowed))
        known, possible = known + sure, possible + extra - sure
    return known, possible


def _approval_wait_s(approvals: list[dict[str, Any]], now: float) -> float:
    return sum((a["decided_at"] or now) - a["created_at"] for a in approvals)


def _spec(task: dict[str, Any]) -> TaskSpec | None:
    """The task's spec, or ``None`` if it no longer validates (then recorded classes are used)."""
    try:
        return TaskSpec.model_validate_json(task["spec_json"])
    except ValueError:
        return None


def task_row(store: Store, task: dict[str, Any]) -> dict[str, Any]:
    """One task's metrics (keys: :data:`TASK_COLUMNS`). Reads the store; mutates nothing."""
    events = store.events(task["task_id"])
    effects = store.effects(task["task_id"])
    known, possible = duplicate_effects(effects, events, _spec(task))
    ended = next((e["payload"] for e in reversed(events) if e["kind"] == "task_ended"), {})
    usage = ended.get("usage") or {}
    tool_calls = [e for e in events if e["kind"] == "tool_call"]
    end_s = task["ended_at"] or (events[-1]["t_wall"] if events else task["submitted_at"])
    e2e_s = max(0.0, end_s - (task["started_at"] or task["submitted_at"]))
    status = task["status"]
    tool_s = float(usage.get("tool_s", sum(float(e["payload"].get("duration_s", 0)) for e in tool_calls)))
    return {
        "task_id": task["task_id"], "kind": task["kind"], "status": status,
        "end_reason": task["end_reason"], "e2e_s": e2e_s,
        "queue_s": max(0.0, (task["started_at"] or task["submitted_at"]) - task["submitted_at"]),
        "llm_s": float(usage.get("llm_s", 0.0)), "tool_s": tool_s,
        "approval_wait_s": _approval_wait_s(store.approvals(task["task_id"]), end_s),
        "tool_wait_share": tool_s / e2e_s if e2e_s > 0 else 0.0,
        "num_runs": int(task["num_runs"]), "num_recoveries": max(0, int(task["num_runs"]) - 1),
        "num_llm_calls": sum(1 for e in events if e["kind"] == "llm_call"),
        "num_tool_calls": len({e["payload"]["key"] for e in tool_calls}),
        "num_llm_tokens": int(usage.get("num_llm_tokens", 0)), "cost_usd": float(usage.get("cost_usd", 0.0)),
        "num_duplicate_effects": known,
        "num_possible_duplicate_effects": possible,
        "num_denied": sum(1 for e in events if e["kind"] == "gate" and e["payload"]["verdict"] == "deny")
        + sum(1 for e in events if e["kind"] == "approval_denied"),
        "num_escalations": sum(1 for e in events if e["kind"] == "escalated"),
        "is_succeeded": status == "succeeded", "is_ended_by_budget": status == "ended_budget",
        "is_ended_by_deadline": status == "ended_deadline", "is_ended_by_policy": status == "ended_policy",
    }


def task_rows(store: Store, task_ids: list[str] | None = None) -> list[dict[str, Any]]:
    """Metrics rows of all tasks (or ``task_ids``), in submission order."""
    tasks = store.tasks()
    if task_ids is not None:
        wanted = set(task_ids)
        tasks = [t for t in tasks if t["task_id"] in wanted]
    return [task_row(store, t) for t in tasks]


def _percentile(values: list[float], q: float) -> float | None:
    """Linear-interpolated percentile (numpy's default method), ``None`` for no values. Pure."""
    if not values:
        return None
    ordered = sorted(values)
    pos = (len(ordered) - 1) * q / 100.0
    low, high = math.floor(pos), math.ceil(pos)
    return ordered[low] + (ordered[high] - ordered[low]) * (pos - low)


def summarize(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """Aggregate task rows (see module doc). Only ended tasks enter latency and shares. Pure."""
    ended = [r for r in rows if r["status"] in TERMINAL_STATUSES]
    e2e = [r["e2e_s"] for r in ended]
    recovered = [r for r in ended if r["num_recoveries"] > 0]
    num_ok = sum(1 for r in ended if r["is_succeeded"])
    total_e2e = sum(e2e)

    def share(key: str) -> float | None:
        return sum(1 for r in ended if r[key]) / len(ended) if ended else None

    return {
        "num_tasks": len(rows), "num_ended": len(ended), "num_succeeded": num_ok,
        "e2e_mean_s": total_e2e / len(e2e) if e2e else None,
        "e2e_p50_s": _percentile(e2e, 50), "e2e_p95_s": _percentile(e2e, 95),
        "tool_wait_share": sum(r["tool_s"] for r in ended) / total_e2e if total_e2e > 0 else None,
        "num_recovered_tasks": len(recovered),
        "recovery_success_rate": (sum(1 for r in recovered if r["status"] != "error") / len(recovered)
                                  if recovered else None),
        "num_duplicate_effects": sum(r["num_duplicate_effects"] for r in rows),
        "num_possible_duplicate_effects": sum(r.get("num_possible_duplicate_effects", 0) for r in rows),
        "cost_per_successful_task_usd": (sum(r["cost_usd"] for r in ended) / num_ok if num_ok else None),
        "share_ended_by_budget": share("is_ended_by_budget"),
        "share_ended_by_deadline": share("is_ended_by_deadline"),
        "share_ended_by_policy": share("is_ended_by_policy"),
    }
