"""Effect classes of tool actions, their digests and idempotency keys (design.md §11).

Every tool action is classified as a pure read, an idempotent write, a compensable write or an
irreversible action, by ordered, configurable :class:`EffectRule` s over OpenHands' tool names and
arguments (``terminal``: ``{"command": ...}``; ``file_editor``: ``{"command", "path", ...}``). A
terminal command line is split into simple commands (the guard's parser); each is classified by the
first rule whose pattern it matches, and the line takes the riskiest class of its parts.

Mental model: the class decides what happens when a call fails or its runner dies mid-call. Reads
are re-run; idempotent writes are re-run with the same key (the target, or the content check of a
file edit, makes the repeat a no-op); compensable writes have an undo command, run when the task
aborts (and before re-running one that was in doubt); an irreversible action is never re-run, and
one in doubt (started, no recorded outcome) waits for a person. Unknown commands that write only
inside the workspace count as idempotent writes (a coding agent's ``pytest``, ``make``, ``sed -i``
can be re-run); a write outside the workspace is irreversible.

The action digest is SHA-256 over the canonical JSON of ``{tool, arguments, target}``: approvals
bind to it, and the idempotency key is ``task/step/digest[:16]``.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
from collections.abc import Mapping, Sequence
from enum import StrEnum
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from mars_openhands.runtime.guard import split_commands, written_paths

__all__ = [
    "DEFAULT_RULES",
    "Action",
    "Effect",
    "EffectClass",
    "EffectRule",
    "classify",
    "idempotency_key",
]

# Arguments that describe a call but do not change what it does (OpenHands adds them).
_VOLATILE_ARGUMENTS = frozenset({"summary", "security_risk", "kind"})
_URL = re.compile(r"https?://[^\s'\"]+")


class EffectClass(StrEnum):
    """What repeating an action would do, in increasing order of risk."""

    READ = "read"
    IDEMPOTENT_WRITE = "idempotent_write"
    COMPENSABLE_WRITE = "compensable_write"
    IRREVERSIBLE = "irreversible"

    @property
    def risk(self) -> int:
        """0 (read) .. 3 (irreversible)."""
        return list(EffectClass).index(self)


class EffectRule(BaseModel):
    """One classification rule. Frozen; unknown keys are an error."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    name: str
    """Shown in the event log and the gate's reasons."""
    tool: str = "terminal"
    """Tool name the rule applies to (``terminal``, ``file_editor``, ...; ``*``: any)."""
    pattern: str = ""
    """Regular expression searched in one simple command (terminal) or in ``command`` (other
    tools); empty: every call of ``tool``."""
    effect: EffectClass
    is_network: bool = False
    """The action reaches the network (the scope's ``network`` switch must allow it)."""
    probe: str | None = None
    """Compensable writes: shell command run before the action; its stdout fills ``{before}``."""
    compensation: str | None = None
    """Compensable writes: shell command that undoes the action (``{before}`` = the probe's output)."""
    timeout_s: float | None = Field(None, gt=0)
    """Per-call timeout, seconds (default: 120 s for reads, 600 s otherwise)."""


def _rule(name: str, pattern: str, effect: EffectClass, **kw: Any) -> EffectRule:
    return EffectRule(name=name, pattern=pattern, effect=effect, **kw)


_R, _I, _C, _X = (EffectClass.READ, EffectClass.IDEMPOTENT_WRITE, EffectClass.COMPENSABLE_WRITE,
                  EffectClass.IRREVERSIBLE)
_WRITE_METHOD = r"(-X\s*|--request[= ])['\"]?(POST|PUT|PATCH|DELETE)|\s(-d|--data\S*|-F|--form|-T|--upload-file)(\s|=)"
DEFAULT_RULES: tuple[EffectRule, ...] = (
    _rule("git-push", r"^git\s+push\b", _X, is_network=True),
    _rule("publish", r"^(npm|yarn|pnpm)\s+publish\b|^twine\s+upload\b|^gh\s+(pr|release|issue)\s+create\b",
          _X, is_network=True),
    _rule("remote-shell", r"^(ssh|scp|sftp|rsync\s+.*\S+:)", _X, is_network=True),
    _rule("keyed-http-write", r"^curl\b(?=.*(" + _WRITE_METHOD + r"))(?=.*Idempotency-Key)", _I,
          is_network=True),
    _rule("http-write", r"^curl\b.*(" + _WRITE_METHOD + r")|^wget\b.*--post", _X, is_network=True),
    _rule("http-read", r"^(curl|wget)\b", _R, is_network=True),
    _rule("git-commit", r"^git\s+commit\b", _C, probe="git rev-parse HEAD",
          compensation="git reset --soft {before}"),
    _rule("git-read", r"^git\s+(diff|status|log|show|rev-parse|ls-files|blame|grep|branch\s*$)", _R),
    _rule("shell-read", r"^(ls|cat|head|tail|grep|egrep|fgrep|rg|find|wc|pwd|echo|printf|stat|file|"
          r"du|df|which|type|tree|sort|uniq|diff|cut|awk|less|more|true|false|test|\[|cd|sleep|"
          r"date|env|id|whoami|uname|nl|basename|dirname|realpath|readlink)(\s|$)", _R),
    _rule("sed-print", r"^sed\b(?!.*(\s-i|--in-place))", _R),
    EffectRule(name="file-view", tool="file_editor", pattern=r"^view$", effect=_R),
    EffectRule(name="file-edit", tool="file_editor", effect=_I),
    EffectRule(name="task-tracker", tool="task_tracker", effect=_R),
    EffectRule(name="agent-internal", tool="*", pattern=r"^(finish|think)$", effect=_R),
)


class Action(BaseModel):
    """One tool call as the runtime sees it. Frozen."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    tool: str
    """OpenHands tool name (``terminal``, ``file_editor``, ...)."""
    arguments: dict[str, Any]
    """The call's arguments (JSON values); volatile ones (``summary``, ...) are dropped."""
    target: str
    """What it acts on: the resolved file path (file editor), ``shell:<workspace>`` plus any URLs
    in the command (terminal)."""

    @classmethod
    def build(cls, tool: str, arguments: Mapping[str, Any], workspace: Path) -> Action:
        """Canonical action for ``tool(arguments)`` run in ``workspace``. Pure."""
        args = {k: v for k, v in arguments.items() if v is not None and k not in _VOLATILE_ARGUMENTS}
        args = json.loads(json.dumps(args, default=str))  # JSON values only
        if tool == "file_editor" and args.get("path"):
            target = str(_resolve(str(args["path"]), workspace))
        else:
            urls = sorted(set(_URL.findall(str(args.get("command", "")))))
            target = " ".join([f"shell:{workspace}", *urls])
        return cls(tool=tool, arguments=args, target=target)

    def canonical_json(self) -> str:
        """The bytes the digest is taken over: sorted keys, no spaces, UTF-8. Pure."""
        return json.dumps({"tool": self.tool, "arguments": self.arguments, "target": self.target},
                          sort_keys=True, separators=(",", ":"), ensure_ascii=False)

    def digest(self) -> str:
        """SHA-256 hex digest of :meth:`canonical_json` (64 characters). Pure."""
        return hashlib.sha256(self.canonical_json().encode()).hexdigest()


class Effect(BaseModel):
    """The classification of one action."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    effect: EffectClass
    rules: tuple[str, ...]
    """Names of the rules that decided (one per simple command)."""
    is_network: bool = False
    probe: str | None = None
    compensation: str | None = None
    timeout_s: float
    written_paths: tuple[str, ...] = ()
    """Absolute paths the action writes (for the gate's path rule)."""


def idempotency_key(task_id: str, step: int, digest: str) -> str:
    """The key of step ``step``'s action: ``task/step/digest[:16]``. Pure."""
    return f"{task_id}/{step}/{digest[:16]}"


def _resolve(path: str, cwd: Path) -> Path:
    return Path(os.path.normpath(cwd / os.path.expanduser(path)))


def _is_inside(path: Path, roots: Sequence[Path]) -> bool:
    return str(path).startswith("/dev/") or any(path == r or r in path.parents for r in roots)


def _first_match(rules: Sequence[EffectRule], tool: str, text: str) -> EffectRule | None:
    for rule in rules:
        if rule.tool in (tool, "*") and (not rule.pattern or re.search(rule.pattern, text)):
            return rule
    return None


def classify(action: Action, workspace: Path, rules: Sequence[EffectRule] = DEFAULT_RULES,
             extra_roots: Sequence[Path] = ()) -> Effect:
    """Classify one action. Pure.

    Args:
        action: the call (see :meth:`Action.build`).
        workspace: the task's workspace (writes inside it or ``extra_roots`` stay local).
        rules: ordered rules; a task's own rules come first, then :data:`DEFAULT_RULES`.
        extra_roots: further directories that count as inside.

    Returns:
        The riskiest class over the command's parts. A terminal part no rule matches is an
        idempotent write if everything it writes is inside, else irreversible; another tool no rule
        matches is irreversible. Two compensable parts in one command are irreversible (one undo
        command cannot be chosen for both).
    """
    roots = [workspace, *extra_roots]
    if action.tool != "terminal":
        rule = _first_match(rules, action.tool, str(action.arguments.get("command", action.tool)))
        effect = rule.effect if rule else EffectClass.IRREVERSIBLE
        paths = (str(_resolve(str(action.arguments["path"]), workspace)),) \
            if action.tool == "file_editor" and "path" in action.arguments else ()
        if effect != EffectClass.READ and paths and not _is_inside(Path(paths[0]), roots):
            effect = EffectClass.IRREVERSIBLE
        return Effect(effect=effect, rules=(rule.name if rule else "unknown-tool",),
                      timeout_s=(rule.timeout_s if rule and rule.timeout_s else _default_timeout(effect)),
                      written_paths=paths if effect != EffectClass.READ else ())
    return _classify_command(str(action.arguments.get("command", "")), workspace, rules, roots)


def _classify_command(command: str, workspace: Path, rules: Sequence[EffectRule],
                      roots: Sequence[Path]) -> Effect:
    parts: list[tuple[EffectClass, EffectRule | None]] = []
    paths: list[str] = []
    cwd = workspace
    for tokens in split_commands(command) or [[""]]:
        text = " ".join(tokens)
        written = [_resolve(p, cwd) for p in written_paths(tokens)] if tokens != [""] else []
        paths += [str(p) for p in written]
        rule = _first_match(rules, "terminal", text)
        effect = rule.effect if rule else EffectClass.IDEMPOTENT_WRITE
        if written and effect == EffectClass.READ:
            effect = EffectClass.IDEMPOTENT_WRITE  # `echo x > f`: a read command that writes
        if any(not _is_inside(p, roots) for p in written):
            effect = EffectClass.IRREVERSIBLE
        parts.append((effect, rule))
        if tokens[:1] == ["cd"] and len(tokens) > 1:
            cwd = _resolve(tokens[1], cwd)
    worst = max((e for e, _ in parts), key=lambda e: e.risk)
    compensable = [r for e, r in parts if e == EffectClass.COMPENSABLE_WRITE]
    if worst == EffectClass.COMPENSABLE_WRITE and len(compensable) > 1:
        worst = EffectClass.IRREVERSIBLE
    undo = compensable[0] if worst == EffectClass.COMPENSABLE_WRITE and compensable else None
    timeouts = [r.timeout_s for _, r in parts if r is not None and r.timeout_s]
    return Effect(
        effect=worst, rules=tuple(r.name if r else "unmatched" for _, r in parts),
        is_network=any(r is not None and r.is_network for _, r in parts),
        probe=undo.probe if undo else None, compensation=undo.compensation if undo else None,
        timeout_s=max(timeouts) if timeouts else _default_timeout(worst),
        written_paths=tuple(paths))


def _default_timeout(effect: EffectClass) -> float:
    # 120 s lets a read (grep over a repo) finish on a slow disk; writes (tests, builds) get 600 s.
    return 120.0 if effect == EffectClass.READ else 600.0
