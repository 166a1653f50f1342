"""Effect classes of tool actions, their digests and idempotency keys (design.md §11).

Every tool action is classified as a pure read, an idempotent write, a compensable write, a local
write or an irreversible action, by ordered, configurable :class:`EffectRule` s over OpenHands'
tool names and arguments (``terminal``: ``{"command": ...}``; ``file_editor``: ``{"command",
"path", ...}``). A terminal command line is split into simple commands (the guard's parser); each
is classified by the first rule whose pattern it matches, and the line takes the riskiest class of
its parts.

Mental model: the class decides what happens when a call fails or its runner dies mid-call. Reads
are re-run; idempotent writes are re-run with the same key (the target, or the content check of a
file edit, makes the repeat a no-op); compensable writes have an undo command, run when the task
aborts (and before re-running one that was in doubt); local and irreversible actions are never
re-run on their own, and one in doubt (started, no recorded outcome) waits for a person. *Idempotent
only when provably so*: a write is an idempotent write only if a rule says its repeat is a no-op
(``mkdir -p``, ``rm -f``, ``cp`` of files, ``git add``, ``touch``, a file edit by content) or it is a
read whose output, the same on every run, replaces a file (``echo x > f``: ``>`` on a
deterministic producer). Everything else that stays inside the workspace is a *local write*: an
append (``>>``, ``tee -a``), ``sed -i``, ``mv``, ``rm`` / ``mkdir`` / ``ln`` without ``-f`` / ``-p``,
package installs, git history edits other than ``git commit``, and every command no rule knows
(``make``, ``python x.py``: the runtime cannot see what a program writes). Test runners
(``pytest``, ``go test``, ``npm test``, ``make test``) are idempotent writes by a default rule. A local
write runs without approval by default (it stays in the workspace) but, in doubt after a crash, is
escalated like an irreversible one. A write outside the workspace is irreversible.

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

from mars_openhands.runtime.guard import (
    command_words,
    redirections,
    sed_effects,
    split_commands,
    written_paths,
)

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
    """What repeating an action would do, in increasing order of risk.

    ``local_write`` ranks above ``compensable_write``: a line with both (``git commit -m x && echo
    done >> log``) cannot be undone and run again, so it is not compensable.
    """

    READ = "read"
    IDEMPOTENT_WRITE = "idempotent_write"
    """Provably a no-op when repeated: re-run with the same key when in doubt."""
    COMPENSABLE_WRITE = "compensable_write"
    LOCAL_WRITE = "local_write"
    """A write inside the workspace that is not provably idempotent (``>>``, ``sed -i``, ``mv``,
    unknown programs): not retried; in doubt after a crash, escalated to a person."""
    IRREVERSIBLE = "irreversible"

    @property
    def risk(self) -> int:
        """0 (read) .. 4 (irreversible)."""
        return list(EffectClass).index(self)

    @property
    def is_repeatable(self) -> bool:
        """Whether a call of this class may run again on its own (retried after a failure, re-run
        when in doubt after a crash): reads and idempotent writes only."""
        return self in (EffectClass.READ, EffectClass.IDEMPOTENT_WRITE)


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


_R, _I, _C, _L, _X = (EffectClass.READ, EffectClass.IDEMPOTENT_WRITE, EffectClass.COMPENSABLE_WRITE,
                      EffectClass.LOCAL_WRITE, EffectClass.IRREVERSIBLE)
_WRITE_METHOD = r"(-X\s*|--request[= ])['\"]?(POST|PUT|PATCH|DELETE)|\s(-d|--data\S*|-F|--form|-T|--upload-file)(\s|=)"


def _has_option(short: str, long: str) -> str:
    """Lookahead: an option ``-<letters with short>`` (``-rf``) or ``--long`` anywhere after the name."""
    return rf"(?=.*\s(-[A-Za-z]*[{short}][A-Za-z]*|--{long})(\s|=|$))"


DEFAULT_RULES: tuple[EffectRule, ...] = (
    _rule("git-push", r"^git\s+push\b", _X, is_network=True),
    _rule("publish", r"^(npm|yarn|pnpm)\s+publish\b|^twine\s+upload\b|^gh\s+(pr|release|issue)\s+create\b",
          _X, is_network=True),
    _rule("remote-shell", r"^(ssh|scp|sftp|rsync\s+.*\S+:)", _X, is_network=True),
    _rule("keyed-http-write", r"^curl\b(?=.*(" + _WRITE_METHOD + r"))(?=.*Idempotency-Key)", _I,
          is_network=True),
    _rule("http-write", r"^curl\b.*(" + _WRITE_METHOD + r")|^wget\b.*--post", _X, is_network=True),
    _rule("http-read", r"^(curl|wget)\b", _R, is_network=True),
    # Installs and fetches download code: the scope's `network` switch decides them like curl.
    _rule("package-install", r"^(python3?\s+-m\s+)?(pip3?|uv\s+pip)\s+(install|download|wheel)\b|"
          r"^uv\s+(add|sync|lock)\b|^(npm|pnpm)\s+(install|i|ci|add|update)\b|"
          r"^yarn(\s+(install|add|upgrade)\b|\s*$)|^cargo\s+(install|fetch|update)\b|"
          r"^go\s+(get|install|mod\s+download)\b|^(gem|conda|mamba|poetry)\s+(install|add|update)\b",
          _L, is_network=True),
    # Queries of what is installed read the environment; the package index is read over the network.
    _rule("package-query", r"^(python3?\s+-m\s+)?(pip3?|uv\s+pip)\s+(list|show|freeze|check)\b|"
          r"^(npm|pnpm)\s+(ls|list|outdated)\b|^(python3?|pip3?|node|npm|go|cargo|rustc|gcc|java)\s+"
          r"(--version|-V|version)\s*$", _R),
    _rule("package-index-read", r"^(python3?\s+-m\s+)?pip3?\s+index\b|^(npm|pnpm|yarn)\s+(view|info)\b", _R,
          is_network=True),
    _rule("git-fetch", r"^git\s+(clone|fetch|pull|submodule\s+update)\b", _L, is_network=True),
    _rule("git-remote-read", r"^git\s+ls-remote\b", _R, is_network=True),
    _rule("git-commit", r"^git\s+commit\b", _C, probe="git rev-parse HEAD",
          compensation="git reset --soft {before}"),
    _rule("git-read", r"^git\s+(diff|status|log|show|rev-parse|ls-files|ls-tree|blame|grep|describe|"
          r"rev-list|cat-file|shortlog|show-ref|merge-base|name-rev|branch\s*$|tag\s*$|remote(\s+-v)?\s*$|"
          r"stash\s+list|config\s+(--get|--list|-l)\b)", _R),
    # Repeats that are no-ops. Everything else git does (checkout -b, mv, rm, stash, merge,
    # rebase, cherry-pick, apply, tag NAME, clone) fails or acts again when repeated: a local write.
    _rule("git-idempotent", r"^git\s+(add|restore|init)\b|^git\s+(checkout|switch)\b(?!.*\s-[bcB]\b)", _I),
    # Test runners are made to be run again: what they write (caches, reports) a rerun rewrites.
    # The most common call in doubt after a crash; escalating it would stall every recovery.
    _rule("test-runner", r"^(python3?\s+-m\s+)?(pytest|unittest)\b|^(tox|nox)(\s|$)|^go\s+(test|vet)\b|"
          r"^cargo\s+(test|check|clippy)\b|^(npm|yarn|pnpm)\s+(run\s+)?test\b|^make\s+(test|check)\s*$", _I),
    _rule("tee-append", r"^tee\b" + _has_option("a", "append"), _L),
    _rule("find-acting", r"^find\b.*\s-(exec|execdir|ok|okdir|delete|fprint\w*|fls)\b", _L),
    _rule("sort-output", r"^sort\b" + _has_option("o", "output"), _L),
    _rule("awk-program", r"^awk\b.*(>|\bsystem\s*\(|\|)", _L),  # awk's own redirections and pipes
    _rule("shell-read", r"^(ls|cat|head|tail|grep|egrep|fgrep|rg|find|wc|pwd|echo|printf|stat|file|"
          r"du|df|which|type|tree|sort|uniq|diff|cut|awk|less|more|true|false|test|\[|cd|sleep|"
          r"date|env|id|whoami|uname|nl|basename|dirname|realpath|readlink|tee|tr|tac|rev|seq|"
          r"comm|paste|column|jq|md5sum|sha1sum|sha256sum|cksum)(\s|$)", _R),
    _rule("sed-print", r"^sed\b(?!.*(\s-[A-Za-z]*i|--in-place))", _R),
    # Writing commands whose repeat is a no-op (the same state, the same exit status).
    _rule("mkdir-p", r"^mkdir\b" + _has_option("p", "parents"), _I),
    _rule("rm-force", r"^rm\b" + _has_option("f", "force"), _I),
    # ln -sf DIR LINK repeated follows LINK into DIR and makes DIR/DIR: symbolic needs -n / -T.
    _rule("ln-force", r"^ln\b" + _has_option("f", "force") + r"(?:(?!.*\s(-[A-Za-z]*s[A-Za-z]*|--symbolic)"
          r"(\s|$))|" + _has_option("nT", "no-dereference") + ")", _I),
    _rule("cp-files", r"^cp\b(?!.*\s(-[A-Za-z]*[rRa][A-Za-z]*|--recursive|--archive)(\s|$))", _I),
    _rule("touch-chmod", r"^(touch|chmod|chown|chgrp)\b", _I),
    EffectRule(name="file-view", tool="file_editor", pattern=r"^view$", effect=_R),
    EffectRule(name="file-edit", tool="file_editor", effect=_I),
    EffectRule(name="task-tracker", tool="task_tracker", effect=_R),
    EffectRule(name="agent-internal", tool="*", pattern=r"^(finish|think)$", effect=_R),
)
"""The default rules, in order (a task's ``effect_rules`` come first). A terminal command no rule
matches is a local write (irreversible if it writes outside the workspace)."""

_NONDETERMINISTIC = re.compile(
    r"^(date|env|printenv|du|df|stat|uptime|ps|free|uuidgen|shuf|od|hexdump|ls\b.*\s-[A-Za-z]*[lt])\b"
    r"|/dev/u?random|\$\{?(RANDOM|SRANDOM|BASHPID|SECONDS|EPOCHSECONDS|EPOCHREALTIME)\b|\$\$")
"""A simple command whose output may differ from one run to the next (the clock, the host's state,
randomness): ``>`` of its output is no idempotent write."""


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
        The riskiest class over the command's parts. A terminal part is a local write when no rule
        matches it, when it appends (``>>``, ``&>>``), and when a read's output replaces a file
        (``>``, ``tee``) but some part of the line may print something else on another run (the
        clock, randomness, the network, ``$(...)``); otherwise its rule's class (a read that
        writes a file with output the same on every run is an idempotent write). A part writing
        outside the workspace is irreversible; another tool no rule matches is irreversible. Two
        compensable parts in one command are irreversible (one undo command cannot be chosen for
        both).
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
    segments = split_commands(command) or [[""]]
    matched = [_first_match(rules, "terminal", " ".join(tokens)) for tokens in segments]
    is_deterministic = _is_deterministic(command, segments, matched)
    parts: list[tuple[EffectClass, EffectRule | None]] = []
    paths: list[str] = []
    cwd = workspace
    for tokens, rule in zip(segments, matched, strict=True):
        written = [_resolve(p, cwd) for p in written_paths(tokens)] if tokens != [""] else []
        paths += [str(p) for p in written]
        effect = _part_effect(tokens, rule, written, is_deterministic)
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


def _is_deterministic(command: str, segments: list[list[str]],
                      matched: Sequence[EffectRule | None]) -> bool:
    """Whether every part of the line prints the same on every run (so ``>`` of its output
    writes the same file again). Command substitution and network reads count as not. Pure."""
    if "$(" in command or "`" in command or "<(" in command:
        return False
    return not any(_NONDETERMINISTIC.search(" ".join(tokens)) or (rule is not None and rule.is_network)
                   for tokens, rule in zip(segments, matched, strict=True))


def _part_effect(tokens: list[str], rule: EffectRule | None, written: list[Path],
                 is_deterministic: bool) -> EffectClass:
    """The class of one simple command inside the workspace (see :func:`classify`). Pure."""
    if tokens == [""]:
        return EffectClass.READ  # an empty command (OpenHands: "show more output") runs nothing
    is_append = any(is_append and not target.startswith("/dev/")
                    for target, is_append in redirections(tokens))
    files = [p for p in written if not str(p).startswith("/dev/")]
    if rule is None:
        # `> f` alone truncates f to empty, the same every time (but `echo $(date) > f` splits
        # into `echo`, `date` and `> f`); a program no rule knows may write anything (the
        # runtime cannot see into `python x.py`, `make`, `pytest`).
        is_truncate_only = not command_words(tokens) and not is_append and is_deterministic
        return EffectClass.IDEMPOTENT_WRITE if is_truncate_only else EffectClass.LOCAL_WRITE
    effect = rule.effect
    words = command_words(tokens)
    if words and os.path.basename(words[0]) == "sed" and sed_effects(words)[1]:
        return EffectClass.LOCAL_WRITE  # `sed 'e CMD'`, `s///e`, `sed -f SCRIPT`: runs commands
    if effect == EffectClass.READ and files:  # `echo x > f`, `tee f`: a read that writes a file
        effect = EffectClass.IDEMPOTENT_WRITE if is_deterministic else EffectClass.LOCAL_WRITE
    if is_append and effect.risk < EffectClass.LOCAL_WRITE.risk:
        effect = EffectClass.LOCAL_WRITE  # a repeat appends again
    return effect


def _default_timeout(effect: EffectClass) -> float:
    # 120 s lets a read (grep over a repo) finish on a slow disk; writes (tests, builds) get 600 s.
    return 120.0 if effect == EffectClass.READ else 600.0
