"""The policy gate: allow, deny or ask a person, from scope, risk class and target (design.md §11).

Rule sets, in order; the first that does not pass decides:

1. ``guard``: the command guard (``guard.py``: foreign kills, privilege escalation, writes outside
   the workspace, host mutation) → deny.
2. ``scope.network``: an action that reaches the network while the scope forbids it → deny.
3. ``scope.paths``: a write outside the workspace and ``scope.workspace_paths`` → deny (catches what
   the guard's parser reports for file edits and commands even with the guard off).
4. ``scope.effects``: the effect class is in ``allowed_effects`` → allow; in ``approval_effects`` →
   needs approval (a person approves the action's digest); else → deny.

Pure except for the guard's ``/proc`` reads (its pid rule); the runtime records every decision with
its rule and reason in the task's event log, so a replay reuses the recorded verdict.
"""

from __future__ import annotations

from enum import StrEnum
from pathlib import Path

from pydantic import BaseModel, ConfigDict

from mars_openhands.runtime.effects import Action, Effect
from mars_openhands.runtime.guard import PolicyConfig, check_action
from mars_openhands.runtime.task import PermissionScope

__all__ = ["GateDecision", "Verdict", "decide"]


class Verdict(StrEnum):
    """The gate's answer."""

    ALLOW = "allow"
    DENY = "deny"
    NEEDS_APPROVAL = "needs_approval"


class GateDecision(BaseModel):
    """A verdict with the rule that gave it and why."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    verdict: Verdict
    rule: str
    """``guard.<rule>``, ``scope.network``, ``scope.paths`` or ``scope.effects``."""
    reason: str


def decide(action: Action, effect: Effect, scope: PermissionScope, workspace: Path) -> GateDecision:
    """Decide one action.

    Args:
        action: the call.
        effect: its classification (``effects.classify``).
        scope: the task's permission scope.
        workspace: the task's workspace root (absolute).

    Returns:
        The first failing rule set's verdict, else ``scope.effects``' verdict.
    """
    roots = [workspace, *(Path(p) for p in scope.workspace_paths)]
    if scope.guard:
        guard = check_action(action.tool, action.arguments, workspace,
                             PolicyConfig(allowed_write_paths=tuple(scope.workspace_paths)))
        if not guard.is_allowed:
            return GateDecision(verdict=Verdict.DENY, rule=f"guard.{guard.rule}", reason=guard.reason)
    if effect.is_network and not scope.network:
        return GateDecision(verdict=Verdict.DENY, rule="scope.network",
                            reason=f"{effect.effect.value} reaches the network ({', '.join(effect.rules)}) "
                                   "and the task's scope has network: false")
    outside = [p for p in effect.written_paths
               if not p.startswith("/dev/") and not any(Path(p) == r or r in Path(p).parents for r in roots)]
    if outside:
        return GateDecision(verdict=Verdict.DENY, rule="scope.paths",
                            reason=f"writes {outside[0]!r}, outside the workspace {str(workspace)!r} "
                                   "and scope.workspace_paths")
    if effect.effect in scope.allowed_effects:
        return GateDecision(verdict=Verdict.ALLOW, rule="scope.effects",
                            reason=f"{effect.effect.value} is in the scope's allowed_effects")
    if effect.effect in scope.approval_effects:
        return GateDecision(verdict=Verdict.NEEDS_APPROVAL, rule="scope.effects",
                            reason=f"{effect.effect.value} needs a person's approval of digest "
                                   f"{action.digest()}")
    return GateDecision(verdict=Verdict.DENY, rule="scope.effects",
                        reason=f"{effect.effect.value} is neither allowed nor approvable in this "
                               "task's scope")
