"""One execution of a task's workflow: LLM and tool steps, the gate, approvals, budget, undo.

A driver (the ``chat`` loop in ``agent.py``, or the OpenHands adapter) calls :meth:`TaskRun.llm`
for each model call and :meth:`TaskRun.tool` for each tool call, in the workflow's thread. Each is a
DBOS step: on a restart DBOS re-runs the workflow function, and every step already recorded returns
its recorded output (a completed LLM response or tool observation) instead of running again, so the
driver rebuilds its context (messages, conversation) from the log and goes on live after the last
recorded step.

The tool protocol (mental model):

1. classify the action and take its digest and key (pure);
2. the gate's verdict (a step, so a replay reuses it); deny → the agent is told (or the task
   ends); needs approval → wait for a person's decision on this digest (``DBOS.recv``);
3. the execution step: if the key's effect row says done, return its outcome (ran, but DBOS lost
   the record); if it says started (in doubt): reads and idempotent writes run again with the same
   key, a compensable write is undone first, a local write or an irreversible one is *not* run
   and escalates to a person (its effect may have happened, and repeating it is not provably a
   no-op); otherwise commit the intent, run (with retries for reads and idempotent writes), record
   the outcome.

Budget and deadline are checked from totals accumulated over step outputs (replayed or live), so
the same decision is reached after a restart; a task ended by budget, deadline or policy undoes its
compensable writes (newest first) and records why.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, Literal

from dbos import DBOS
from pydantic import BaseModel, ConfigDict

from mars_openhands.process_host import run_hosted
from mars_openhands.runtime import crash
from mars_openhands.runtime.config import RuntimeConfig
from mars_openhands.runtime.effects import (
    DEFAULT_RULES,
    Action,
    Effect,
    EffectClass,
    classify,
    idempotency_key,
)
from mars_openhands.runtime.gate import Verdict, decide
from mars_openhands.runtime.store import Store
from mars_openhands.runtime.task import TaskSpec

__all__ = ["AgentOutcome", "ExecContext", "TaskEndedError", "TaskRun", "Usage"]


class AgentOutcome(BaseModel):
    """How a driver's agent stopped (a driver returns it; ``runtime.engine`` re-exports it)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    status: Literal["finished", "max_iterations", "stuck", "error"]
    message: str = ""


_MAX_RETRIES = 2  # a read or idempotent write that times out or raises runs at most 3 times
_DONE_STATUSES = ("done", "failed", "not_repeated", "compensated")


class TaskEndedError(Exception):
    """Raised inside a driver when the task must end (budget, deadline, policy)."""

    def __init__(self, status: str, reason: str) -> None:
        super().__init__(reason)
        self.status = status
        self.reason = reason


class ExecContext(BaseModel):
    """What a tool executor gets: the call's key, timeout and whether it repeats a call in doubt."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    key: str
    timeout_s: float
    attempt: int
    is_retry: bool
    """True when an earlier attempt of this key started and recorded no outcome."""


class Usage(BaseModel):
    """Totals over the task's steps (replayed and live). Mutable; owned by one :class:`TaskRun`."""

    model_config = ConfigDict(extra="forbid")

    num_turns: int = 0
    num_llm_tokens: int = 0
    cost_usd: float = 0.0
    tool_s: float = 0.0
    llm_s: float = 0.0


class TaskRun:
    """The durable operations of one task, for its driver. Use only inside the task's workflow.

    Args:
        spec: the task.
        store: the runtime's tables.
        config: runtime settings (approval poll period, output cap, price).
        deadline_at: absolute deadline (epoch seconds) or ``None``.
    """

    def __init__(self, spec: TaskSpec, store: Store, config: RuntimeConfig,
                 deadline_at: float | None) -> None:
        self.spec = spec
        self.task_id = spec.task_id
        self.store = store
        self.config = config
        self.deadline_at = deadline_at
        self.workspace = Path(spec.workspace)
        self.rules = (*spec.effect_rules, *DEFAULT_RULES)
        self.extra_roots = tuple(Path(p) for p in spec.scope.workspace_paths)
        self.usage = Usage()
        self._num_steps = 0
        self._session_token: str | None = None

    def session_token(self) -> str:
        """The task's gateway session token (``X-Mars-Session-Token``): the same in every run of
        the task, whichever process runs it (:meth:`Store.session_token`)."""
        if self._session_token is None:
            self._session_token = self.store.session_token(self.task_id)
        return self._session_token

    # ---- bookkeeping -------------------------------------------------------------------------
    def _next_step(self) -> int:
        self._num_steps += 1
        return self._num_steps - 1

    def record(self, event_key: str, kind: str, payload: dict[str, Any], step: int | None = None) -> None:
        """Append an event to the log (once per key; safe to call again on a replay)."""
        self.store.add_event(self.task_id, event_key, kind, payload, step)

    def checkpoint(self, label: str, state: dict[str, Any] | None = None) -> None:
        """Mark the cheapest resume point: every step before it is recorded, nothing is in flight."""
        self.record(f"checkpoint:{self._num_steps}", "checkpoint",
                    {"label": label, "next_step": self._num_steps,
                     "usage": self.usage.model_dump(), **(state or {})})

    def _past_deadline(self) -> bool:
        return self.deadline_at is not None and time.time() >= self.deadline_at

    def remaining_s(self) -> float | None:
        """Seconds left before the deadline (``None``: no deadline)."""
        return None if self.deadline_at is None else max(0.0, self.deadline_at - time.time())

    # ---- LLM calls ---------------------------------------------------------------------------
    def _check_llm_budget(self) -> None:
        budget, usage = self.spec.budget, self.usage
        for limit, used, name in ((budget.max_turns, usage.num_turns, "max_turns"),
                                  (budget.max_llm_tokens, usage.num_llm_tokens, "max_llm_tokens"),
                                  (budget.max_cost_usd, usage.cost_usd, "max_cost_usd")):
            if limit is not None and used >= limit:
                raise TaskEndedError("ended_budget", f"budget.{name} reached: used {used:g} of {limit:g}")

    def llm(self, request: Callable[[], dict[str, Any]], summary: dict[str, Any]) -> dict[str, Any]:
        """One model call as a step; returns the response dict ``request`` produced (or the recorded one).

        Args:
            request: does the call; returns ``{"message": ..., "usage": {"prompt_tokens",
                "completion_tokens", "cost_usd"?}, ...}`` (JSON values only).
            summary: what went in (input references: number of messages, their digest, ...).

        Raises:
            TaskEndedError: budget exhausted before the call, or the deadline passed.
        """
        self._check_llm_budget()
        step = self._next_step()
        out = DBOS.run_step({"name": "llm"}, self._llm_step, step, request, summary)
        crash.boundary(f"after:llm:{step}")
        if out.get("ended"):
            raise TaskEndedError("ended_deadline", out["ended"])
        usage = out["response"].get("usage") or {}
        tokens = int(usage.get("prompt_tokens", 0)) + int(usage.get("completion_tokens", 0))
        self.usage.num_turns += 1
        self.usage.num_llm_tokens += tokens
        self.usage.cost_usd += float(usage.get("cost_usd") or tokens * self.config.cost_per_1k_tokens_usd / 1000)
        self.usage.llm_s += float(out.get("llm_s", 0.0))
        return out["response"]

    def _llm_step(self, step: int, request: Callable[[], dict[str, Any]],
                  summary: dict[str, Any]) -> dict[str, Any]:
        crash.boundary(f"before:llm:{step}")
        recorded = self.store.event(self.task_id, f"llm:{step}")
        if recorded is not None:  # answered and logged; DBOS's checkpoint was lost in the crash
            return recorded
        if self._past_deadline():
            return {"ended": f"deadline passed before LLM call {step}"}
        t0 = time.monotonic()
        response = request()
        crash.boundary(f"executed:llm:{step}")
        out = {"response": response, "llm_s": time.monotonic() - t0, "input": summary}
        self.record(f"llm:{step}", "llm_call", out, step)
        return out

    # ---- tool calls --------------------------------------------------------------------------
    def tool(self, tool: str, arguments: dict[str, Any],
             execute: Callable[[ExecContext], dict[str, Any]]) -> dict[str, Any]:
        """One tool call through the gate, approvals and the effect protocol (module doc).

        Args:
            tool: tool name (``terminal``, ``file_editor``, ...).
            arguments: the call's arguments.
            execute: runs the call; returns ``{"status": "ok"|"error"|"timeout", "text", ...}``
                (JSON values); may raise (retried for reads and idempotent writes).

        Returns:
            The outcome dict, with ``status`` one of ``ok``, ``error``, ``timeout``, ``denied``,
            ``not_repeated``, and ``key``, ``digest``, ``effect``.

        Raises:
            TaskEndedError: deadline, tool budget, or a denial with ``scope.end_on_deny``.
        """
        action = Action.build(tool, arguments, self.workspace)
        effect = classify(action, self.workspace, self.rules, self.extra_roots)
        step = self._next_step()
        digest = action.digest()
        key = idempotency_key(self.task_id, step, digest)
        ids = {"key": key, "digest": digest, "effect": effect.effect.value, "step": step}
        gate = DBOS.run_step({"name": "gate"}, self._gate_step, step, key, action, effect)
        if gate["verdict"] == Verdict.DENY:
            return {**ids, **self._denied(gate["reason"])}
        if gate["verdict"] == Verdict.NEEDS_APPROVAL:
            approved, why = self.await_decision(step, key, digest, action, "approval", gate["reason"])
            if not approved:
                return {**ids, **self._denied(f"denied by a person: {why}")}
        self._check_tool_budget()
        out = self._execute(step, key, action, effect, execute, force=False)
        if out.get("in_doubt"):
            out = self._resolve_in_doubt(step, key, digest, action, effect, execute)
        if out.get("ended"):
            raise TaskEndedError("ended_deadline", out["ended"])
        self.usage.tool_s += float(out.get("duration_s", 0.0))
        return {**out, **ids}

    def _denied(self, reason: str) -> dict[str, Any]:
        if self.spec.scope.end_on_deny:
            raise TaskEndedError("ended_policy", reason)
        return {"status": "denied", "text": reason, "duration_s": 0.0}

    def _gate_step(self, step: int, key: str, action: Action, effect: Effect) -> dict[str, Any]:
        decision = decide(action, effect, self.spec.scope, self.workspace)
        out = {"verdict": decision.verdict.value, "rule": decision.rule, "reason": decision.reason}
        self.record(f"gate:{step}", "gate", {**out, "key": key, "action": action.model_dump(),
                                             "effect": effect.model_dump(mode="json")}, step)
        return out

    def _check_tool_budget(self) -> None:
        limit = self.spec.budget.max_tool_s
        if limit is not None and self.usage.tool_s >= limit:
            raise TaskEndedError("ended_budget", f"budget.max_tool_s reached: used "
                                 f"{self.usage.tool_s:.1f} of {limit:g} s")

    def _timeout_s(self, effect: Effect) -> float:
        limits = [effect.timeout_s]
        if self.spec.budget.max_tool_s is not None:
            limits.append(max(0.1, self.spec.budget.max_tool_s - self.usage.tool_s))
        remaining = self.remaining_s()
        if remaining is not None:
            limits.append(max(0.1, remaining))
        return min(limits)

    def _execute(self, step: int, key: str, action: Action, effect: Effect,
                 execute: Callable[[ExecContext], dict[str, Any]], force: bool) -> dict[str, Any]:
        out = DBOS.run_step({"name": "tool"}, self._tool_step, step, key, action, effect, execute, force)
        crash.boundary(f"after:tool:{step}:{effect.effect.value}")
        return out

    def _tool_step(self, step: int, key: str, action: Action, effect: Effect,
                   execute: Callable[[ExecContext], dict[str, Any]], force: bool) -> dict[str, Any]:
        crash.boundary(f"before:tool:{step}:{effect.effect.value}")
        row = self.store.effect(key)
        if row is not None and row["status"] in _DONE_STATUSES and (
                not force or (row["outcome"] or {}).get("is_rerun")):
            return row["outcome"]  # ran and recorded; DBOS's checkpoint was lost in the crash
        if self._past_deadline():
            return {"ended": f"deadline passed before tool call {step}"}
        is_retry = row is not None and row["status"] == "started"
        intent: dict[str, Any] = {"action": action.model_dump(), "effect": effect.model_dump(mode="json")}
        if is_retry and not force:
            if effect.effect in (EffectClass.LOCAL_WRITE, EffectClass.IRREVERSIBLE):
                return {"in_doubt": True, "num_attempts": row["num_attempts"]}
            if effect.effect == EffectClass.COMPENSABLE_WRITE:
                self._compensate_one(row, "in doubt after a restart; undone before running again")
        if effect.probe:
            intent["before"] = self._shell(effect.probe, 30.0)["text"].strip()
        attempt = self.store.start_effect(key, self.task_id, step, action.digest(), action.tool,
                                          effect.effect.value, intent)
        result = self._run_with_retries(execute, key, effect, attempt, is_retry or force)
        crash.boundary(f"executed:tool:{step}:{effect.effect.value}")
        outcome = {**result, "num_attempts": attempt, "is_rerun": force}
        self.store.finish_effect(key, "done" if result["status"] == "ok" else "failed", outcome)
        self.record(f"tool:{step}:{attempt}", "tool_call",
                    {"key": key, "tool": action.tool, "arguments": action.arguments,
                     "effect": effect.effect.value, **outcome}, step)
        return outcome

    def _run_with_retries(self, execute: Callable[[ExecContext], dict[str, Any]], key: str,
                          effect: Effect, attempt: int, is_retry: bool) -> dict[str, Any]:
        tries = 1 + (_MAX_RETRIES if effect.effect.is_repeatable else 0)
        result: dict[str, Any] = {}
        for i in range(tries):
            ctx = ExecContext(key=key, timeout_s=self._timeout_s(effect), attempt=attempt + i,
                              is_retry=is_retry or i > 0)
            try:
                result = execute(ctx)
            except Exception as e:  # the tool broke; retried if safe, else reported to the agent
                result = {"status": "error", "text": f"{type(e).__name__}: {e}", "duration_s": 0.0}
                if i + 1 < tries:
                    time.sleep(0.5 * (i + 1))
                    continue
            if result.get("status") != "timeout" or i + 1 == tries:
                break
        return {**result, "num_tries": i + 1}

    def _resolve_in_doubt(self, step: int, key: str, digest: str, action: Action, effect: Effect,
                          execute: Callable[[ExecContext], dict[str, Any]]) -> dict[str, Any]:
        why = ("its effect may have happened, and repeating it is not provably a no-op"
               if effect.effect == EffectClass.LOCAL_WRITE else "it cannot be undone")
        reason = (f"{effect.effect.value} {action.tool} call at step {step} started before a crash and "
                  f"has no recorded outcome ({why}); check the target, then approve to run it again "
                  "or deny to go on without repeating it")
        self.record(f"escalated:{step}", "escalated", {"key": key, "digest": digest, "reason": reason}, step)
        rerun, why = self.await_decision(step, key, digest, action, "in_doubt", reason)
        if rerun:
            return self._execute(step, key, action, effect, execute, force=True)
        outcome = {"status": "not_repeated", "duration_s": 0.0,
                   "text": f"[runtime] this action was in doubt after a restart and was NOT run "
                           f"again (a person decided: {why})"}
        DBOS.run_step({"name": "not_repeated"}, self.store.finish_effect, key, "not_repeated", outcome)
        return outcome

    # ---- approvals ---------------------------------------------------------------------------
    def await_decision(self, step: int, key: str, digest: str, action: Action, kind: str,
                       reason: str) -> tuple[bool, str]:
        """Ask a person and wait (durably) for a decision bound to ``digest``.

        A request row is created (``approval`` or ``in_doubt``), the task shows ``waiting_approval``
        or ``escalated``, and the workflow waits on the DBOS topic ``decision:<request id>``. A
        message counts only if it names this request and this digest and the request row was
        decided through ``tasks approve|deny`` (``store.decide``); an approval is consumed once.

        Returns:
            ``(approved, the person's reason)``.

        Raises:
            TaskEndedError: the deadline passed while waiting.
        """
        request_id = f"{key}:{kind}"
        status = "waiting_approval" if kind == "approval" else "escalated"
        DBOS.run_step({"name": "request_decision"}, self._request_step, request_id, step, digest,
                      kind, action, reason, status)
        while True:
            message = DBOS.recv(f"decision:{request_id}", timeout_seconds=self.config.approval_poll_s)
            verdict = DBOS.run_step({"name": "check_decision"}, self._check_decision, request_id,
                                    digest, message)
            if verdict["decision"] in ("approved", "denied"):
                return verdict["decision"] == "approved", verdict["reason"]
            if verdict["decision"] == "deadline":
                raise TaskEndedError("ended_deadline", f"deadline passed while waiting for a "
                                     f"decision on {digest[:12]}")

    def _request_step(self, request_id: str, step: int, digest: str, kind: str, action: Action,
                      reason: str, status: str) -> None:
        self.store.request_approval(request_id, self.task_id, step, digest, kind,
                                    action.model_dump(), reason)
        self.store.set_status(self.task_id, status)
        self.record(f"request:{request_id}", "approval_requested",
                    {"request_id": request_id, "digest": digest, "kind": kind, "reason": reason,
                     "action": action.model_dump()}, step)

    def _check_decision(self, request_id: str, digest: str, message: Any) -> dict[str, str]:
        row = self.store.approval(request_id)
        assert row is not None, f"approval request {request_id} missing from mars_approvals"
        if message is not None:
            named = (message.get("request_id"), message.get("digest")) if isinstance(message, dict) else None
            if named != (request_id, digest):
                self._refuse(request_id, f"message names {named!r}, not this request and digest")
                return {"decision": "waiting", "reason": ""}
        if row["status"] in ("approved", "consumed") and self.store.consume(request_id):
            return self._decided(request_id, "approved", row)
        if row["status"] == "denied":
            return self._decided(request_id, "denied", row)
        if message is not None:  # a well-formed message, but nobody decided through the CLI
            self._refuse(request_id, "no decision recorded for this request (forged or replayed message)")
        if self._past_deadline():
            return {"decision": "deadline", "reason": ""}
        return {"decision": "waiting", "reason": ""}

    def _decided(self, request_id: str, decision: str, row: dict[str, Any]) -> dict[str, str]:
        self.store.set_status(self.task_id, "running")
        why = row.get("decision_reason") or ""
        self.record(f"decision:{request_id}", f"approval_{decision}",
                    {"request_id": request_id, "by": row.get("decided_by"), "reason": why}, row["step"])
        return {"decision": decision, "reason": why}

    def _refuse(self, request_id: str, why: str) -> None:
        self.record(f"refused:{request_id}:{time.time_ns()}", "approval_refused",
                    {"request_id": request_id, "reason": why})

    # ---- ending ------------------------------------------------------------------------------
    def _shell(self, command: str, timeout_s: float) -> dict[str, Any]:
        """A compensation or acceptance command: ``bash -c`` in the workspace, ended with its
        whole tree at ``timeout_s`` or once this runner has exited (:mod:`mars_openhands.process_host`)."""
        exit_code, out = run_hosted(["bash", "-c", command], timeout_s, cwd=self.workspace)
        if exit_code is None:
            return {"exit_code": None, "text": f"timed out after {timeout_s:g} s"}
        return {"exit_code": exit_code, "text": out[-4000:]}

    def _compensate_one(self, row: dict[str, Any], why: str) -> dict[str, Any]:
        template = row["intent"]["effect"].get("compensation")
        before = row["intent"].get("before")
        if not template or before is None:
            return {"exit_code": None, "text": "no compensation recorded"}
        result = self._shell(template.format(before=before), 120.0)
        self.record(f"compensated:{row['key']}:{row['num_attempts']}", "compensated",
                    {"key": row["key"], "why": why, **result}, row["step"])
        return result

    def compensate_all(self, why: str) -> int:
        """Undo every done compensable write of this task, newest first (each once). Returns how many."""
        def undo() -> int:
            rows = [r for r in self.store.effects(self.task_id)
                    if r["effect"] == EffectClass.COMPENSABLE_WRITE.value and r["status"] == "done"]
            for row in reversed(rows):
                result = self._compensate_one(row, why)
                self.store.finish_effect(row["key"], "compensated", {**(row["outcome"] or {}),
                                                                     "compensation": result})
            return len(rows)
        return DBOS.run_step({"name": "compensate"}, undo)

    def accept(self) -> dict[str, Any]:
        """Run the acceptance command (a step); ``{"accepted": bool, ...}``."""
        command = self.spec.acceptance.command
        if command is None:
            return {"accepted": True, "command": None, "text": "no acceptance command; finishing accepts"}
        def check() -> dict[str, Any]:
            result = self._shell(command, self.spec.acceptance.timeout_s)
            out = {"accepted": result["exit_code"] == 0, "command": command, **result}
            self.record("acceptance", "acceptance", out)
            return out
        return DBOS.run_step({"name": "acceptance"}, check)
