"""The command guard: deny dangerous agent actions before they run (design.md §10, §11).

One rule set of the runtime's policy gate (``gate.py``); also the pre-tool check of the OpenHands
tool wrapper and hook (``openhands/policy_check.py`` re-exports it).

Four rules, each a switch in :class:`PolicyConfig`:

* ``kill_outside_session``: ``pkill`` / ``killall`` (match by name, reach other sessions' processes),
  ``kill`` of pid 1, 0, -1 or a negative process group, and ``kill`` of a numeric pid that is not a
  descendant of this agent process. Job specs (``%1``) and ``$!`` / ``$VAR`` are allowed.
* ``privilege_escalation``: ``sudo``, ``su``, ``doas``, ``pkexec``, ``runuser``, ``setpriv``, setuid /
  setgid bits (``chmod u+s``, ``chmod 4755``), ``chown`` to root.
* ``write_outside_workspace``: output redirections and the path arguments of writing commands
  (``rm``, ``mv``, ``cp``, ``tee``, ``touch``, ``mkdir``, ``ln``, ``sed -i``, ``dd of=``, ``chmod``,
  ``truncate``, ...), files named by an option, an operand or a script (``sort -o``, ``curl -o``,
  ``wget -O``, ``cp -t``, ``find -fprint``, ``uniq IN OUT``, sed's ``w FILE``, awk's
  ``print > "FILE"``) and the file editor's non-``view`` commands that resolve outside the workspace
  (``allowed_write_paths`` adds roots; ``/dev/null`` and friends are always allowed).
* ``environment_mutation``: system package managers (``apt``, ``apt-get``, ``yum``, ``dnf``, ``apk``,
  ``brew``, ``snap``), ``pip install --user`` / ``--break-system-packages``, ``export`` / ``unset`` of
  process-wide variables (``PATH``, ``LD_PRELOAD``, ``LD_LIBRARY_PATH``, ``HOME``, ``SHELL``,
  ``PYTHONPATH``), ``git config --global|--system``, ``crontab``, ``systemctl``, ``service``,
  ``shutdown``, ``reboot``.

Mental model: this is a guard against accidents of an autonomous agent on an unisolated host
(``LocalWorkspace`` runs tools on the host), not a sandbox: it parses the command text (``shlex``,
split at ``;``, ``&&``, ``||``, ``|``, ``&``, newlines, ``$(``...; here-document bodies are data
and skipped), resolves relative paths against the
workspace (following ``cd`` within the same command) and cannot see through ``eval``, scripts the
agent writes and runs, or variables. Use a container for isolation.

Decisions are pure functions of the action and the config (plus ``/proc`` for the pid rule). The
same check runs in two places: inside the tool wrapper (``executor.py``: the action is not executed,
the agent gets an error observation, the stream gets ``tool_end`` with ``status="denied"``), and as
an OpenHands ``PreToolUse`` command hook (``python -m mars_openhands.openhands.policy_check --hook``:
reads the hook event JSON on stdin, exits 2 to deny) for the app and agent-server. Under the
durable runtime (``runtime/``) the policy gate runs these rules before every tool call as its
``guard`` rule set.
"""

from __future__ import annotations

import os
import re
import shlex
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict

__all__ = [
    "PolicyConfig",
    "PolicyDecision",
    "check_action",
    "check_command",
    "check_file_edit",
    "command_words",
    "is_safe_to_replay",
    "redirections",
    "sed_effects",
    "split_commands",
    "written_paths",
]

_ALWAYS_WRITABLE = ("/dev/null", "/dev/stdout", "/dev/stderr", "/dev/tty", "/dev/zero")
_ESCALATION = {"sudo", "su", "doas", "pkexec", "runuser", "setpriv"}
_PACKAGE_MANAGERS = {"apt", "apt-get", "aptitude", "dpkg", "yum", "dnf", "apk", "brew", "snap",
                     "zypper", "pacman"}
_SYSTEM_COMMANDS = {"crontab", "systemctl", "service", "shutdown", "reboot", "halt", "poweroff",
                    "init", "mount", "umount", "sysctl", "modprobe"}
_PROCESS_WIDE_VARS = {"PATH", "LD_PRELOAD", "LD_LIBRARY_PATH", "HOME", "SHELL", "PYTHONPATH",
                      "PYTHONHOME"}
# Writing commands: every non-option argument is a written path (cp/mv/ln/install: the last one).
_WRITES_ALL_ARGS = {"rm", "rmdir", "touch", "mkdir", "tee", "truncate", "shred", "unlink", "chmod",
                    "chown", "chgrp"}
_WRITES_LAST_ARG = {"cp", "mv", "ln", "install", "rsync"}
_SEPARATORS = re.compile(r"\|\||&&|[;\n]|(?<!>)\||(?<![<>])&(?!>)|\$\(|`|\)")
"""Where a command line splits into simple commands; the ``&`` of ``2>&1`` and ``&>`` and the
``|`` of ``>|`` are parts of a redirection, not separators."""


class PolicyConfig(BaseModel):
    """Which rules the pre-tool policy check applies. Frozen; unknown keys are an error."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    kill_outside_session: bool = True
    """Deny killing processes that are not this session's (pkill/killall, pid 1/0/-1, foreign pids)."""
    privilege_escalation: bool = True
    """Deny sudo/su/doas/pkexec, setuid/setgid bits and chown to root."""
    write_outside_workspace: bool = True
    """Deny writes (redirections, writing commands, file edits) outside the workspace."""
    environment_mutation: bool = True
    """Deny system package managers, user/system pip installs, process-wide env vars, global git
    config and service control."""
    allowed_write_paths: tuple[str, ...] = ()
    """Extra absolute directories writes may target besides the workspace (e.g. ``"/tmp"``)."""


class PolicyDecision(BaseModel):
    """The verdict on one action. ``rule`` is ``None`` when allowed."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    is_allowed: bool
    rule: str | None = None
    """The rule that denied it: one of the :class:`PolicyConfig` switch names."""
    reason: str = ""
    """Human-readable reason, shown to the agent and in the stream."""


_ALLOW = PolicyDecision(is_allowed=True)


def _deny(rule: str, reason: str) -> PolicyDecision:
    return PolicyDecision(is_allowed=False, rule=rule, reason=f"denied by policy ({rule}): {reason}")


def _is_inside(path: str, cwd: Path, roots: Sequence[Path]) -> bool:
    if path in _ALWAYS_WRITABLE or path.startswith("/proc/self/fd/"):
        return True
    expanded = os.path.expanduser(path)
    resolved = Path(os.path.normpath(cwd / expanded))
    return any(resolved == root or root in resolved.parents for root in roots)


_HEREDOC = re.compile(r"<<-?\s*(['\"]?)([A-Za-z_][A-Za-z0-9_]*)\1")


def _strip_heredocs(command: str) -> str:
    """Drop here-document bodies (data, not commands); keep the line that opens each. Pure."""
    kept: list[str] = []
    delimiter: str | None = None
    for line in command.split("\n"):
        if delimiter is not None:
            if line.strip() == delimiter:
                delimiter = None
            continue
        kept.append(line)
        match = _HEREDOC.search(line)
        if match:
            delimiter = match.group(2)
    return "\n".join(kept)


def _spaced_redirections(text: str) -> str:
    """``text`` with a space before each unquoted ``>`` / ``<`` that ends a word, so that
    ``echo one>>log.txt`` tokenizes as ``echo one >>log.txt`` (bash reads it so: the word ``one``,
    then an append to ``log.txt``). A word of digits before it is a file descriptor and stays
    attached (``2>err``). Quoted and backslash-escaped characters are left alone. Pure."""
    out: list[str] = []
    quote: str | None = None
    is_escaped = False
    word = ""  # the current word so far (quoted parts included: they make it no descriptor)
    for ch in text:
        if is_escaped:
            is_escaped, word = False, word + ch
        elif quote is not None:
            is_escaped = ch == "\\" and quote == '"'
            quote = None if ch == quote else quote
            word += ch
        elif ch == "\\" or ch in "'\"":
            is_escaped, quote = ch == "\\", (ch if ch != "\\" else None)
            word += ch
        elif ch in "<>":
            if word and not word.isdigit() and word[-1] not in "<>&":
                out.append(" ")
            word = ""
        else:
            word = "" if ch.isspace() else word + ch
        out.append(ch)
    return "".join(out)


def _split_segments(command: str) -> list[list[str]]:
    """Split a shell command into simple commands (token lists); unparsable text yields words."""
    segments = []
    for raw in _SEPARATORS.split(_strip_heredocs(command)):
        part = _spaced_redirections(raw)
        try:
            tokens = shlex.split(part, comments=True)
        except ValueError:  # unbalanced quotes: fall back to whitespace words
            tokens = part.split()
        if tokens:
            segments.append(tokens)
    return segments


def _is_session_pid(pid: int) -> bool:
    """Whether ``pid`` is a descendant of this process (walks ``/proc/<pid>/stat`` parents)."""
    me = os.getpid()
    for _ in range(64):
        if pid == me:
            return True
        try:
            stat = Path(f"/proc/{pid}/stat").read_text()
        except OSError:
            return False
        pid = int(stat.rsplit(")", 1)[1].split()[1])
        if pid <= 1:
            return False
    return False


def _strip_env_prefix(tokens: list[str]) -> list[str]:
    """Drop leading ``VAR=value`` assignments and ``env``/``nohup``/``time``/``exec`` wrappers."""
    i = 0
    while i < len(tokens) and (re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*=.*", tokens[i])
                               or tokens[i] in ("env", "nohup", "time", "exec", "command", "nice")):
        i += 1
    return tokens[i:]


def _check_kill(tokens: list[str]) -> PolicyDecision | None:
    name = os.path.basename(tokens[0])
    if name in ("pkill", "killall"):
        return _deny("kill_outside_session", f"{name} matches processes by name across sessions")
    if name != "kill":
        return None
    args = tokens[1:]
    if args[:1] in (["-s"], ["-n"]):
        args = args[2:]  # kill -s SIG / -n NUM
    elif args[:1] == ["-l"] or args[:1] == ["-L"]:
        return None  # list signals
    elif len(args) > 1 and args[0].startswith("-") and args[0] != "--":
        args = args[1:]  # kill -9 / -KILL / -SIGTERM: the first option is the signal
    if args[:1] == ["--"]:
        args = args[1:]
    for target in args:
        if target.startswith(("%", "$")):
            continue  # job spec or the shell's own $! / variable: this session's processes
        if not re.fullmatch(r"-?\d+", target):
            continue
        pid = int(target)
        if pid <= 1:
            return _deny("kill_outside_session", f"kill {target} targets init, a process group or "
                         "every process")
        if not _is_session_pid(pid):
            return _deny("kill_outside_session", f"pid {pid} is not a process of this session")
    return None


def _check_escalation(tokens: list[str]) -> PolicyDecision | None:
    name = os.path.basename(tokens[0])
    if name in _ESCALATION:
        return _deny("privilege_escalation", f"{name} runs commands as another user")
    if name == "chmod" and any(re.fullmatch(r"[ugoa]*[+=][rwxXt]*s[rwxXts]*|0?[2467]\d{3}", t)
                               for t in tokens[1:]):
        return _deny("privilege_escalation", "chmod sets a setuid/setgid bit")
    if name in ("chown", "chgrp") and any(t.split(":")[0] in ("root", "0") for t in tokens[1:2]):
        return _deny("privilege_escalation", f"{name} gives files to root")
    return None


def _check_environment(tokens: list[str]) -> PolicyDecision | None:
    name = os.path.basename(tokens[0])
    if name in _PACKAGE_MANAGERS or name in _SYSTEM_COMMANDS:
        return _deny("environment_mutation", f"{name} changes the host system")
    if name in ("pip", "pip3") or (name.startswith("python") and tokens[1:3] == ["-m", "pip"]):
        if "install" in tokens and ({"--user", "--break-system-packages"} & set(tokens)):
            return _deny("environment_mutation", "pip install outside a project environment")
    if name in ("export", "unset", "setenv"):
        for t in tokens[1:]:
            if t.split("=", 1)[0] in _PROCESS_WIDE_VARS:
                return _deny("environment_mutation", f"{name} {t.split('=', 1)[0]} changes the "
                             "shell every later command runs in")
    if name == "git" and "config" in tokens and ({"--global", "--system"} & set(tokens)):
        return _deny("environment_mutation", "git config --global/--system changes the host's git")
    return None


_REDIRECT = re.compile(r"\d*(>>|&>>|>\||&>|>)(.*)")


def redirections(tokens: list[str]) -> list[tuple[str, bool]]:
    """The output redirections of one simple command (tokens), in order: ``(target, is_append)``
    (``>>`` and ``&>>`` append; ``>``, ``>|``, ``&>`` truncate). Duplications of a descriptor
    (``2>&1``) are not files and are left out. Pure."""
    found = []
    for i, t in enumerate(tokens):
        match = _REDIRECT.fullmatch(t)
        if match:
            target = match.group(2) or (tokens[i + 1] if i + 1 < len(tokens) else "")
            if target and not target.startswith("&"):
                found.append((target, match.group(1) in (">>", "&>>")))
    return found


def command_words(tokens: list[str]) -> list[str]:
    """The tokens of one simple command without its output redirections and their targets
    (``echo hi > f`` → ``echo hi``). Pure."""
    words: list[str] = []
    is_target = False
    for t in tokens:
        match = _REDIRECT.fullmatch(t)
        if match:
            is_target = not match.group(2)  # `> f`: the next token is the target
        elif is_target:
            is_target = False
        else:
            words.append(t)
    return words


def _option_values(words: Sequence[str], short: str, long: Sequence[str]) -> list[str]:
    """The values of an option that takes one, as getopt reads them: ``-o F``, ``-oF``, a cluster
    ending in it (``-so F``), ``--output F``, ``--output=F``; ``short`` is its letter ("" for
    none; ``long`` may hold single-dash names such as find's ``-fprint``). Pure."""
    values = []
    for i, word in enumerate(words):
        nxt = words[i + 1] if i + 1 < len(words) else None
        if word in long:
            values.append(nxt)
        elif any(word.startswith(f"{name}=") for name in long if name.startswith("--")):
            values.append(word.split("=", 1)[1])
        elif short and word.startswith("-") and not word.startswith("--"):
            at = word.find(short, 1)
            if at == 1 or (at > 1 and word[1:at].isalnum()):  # flags before it in the cluster
                values.append(word[at + 1:] or nxt)
    return [v for v in values if v and v != "-"]


def _to_line_end(script: str, at: int) -> tuple[str, int]:
    """The text from ``at`` to the end of the line (sed's file names and texts), and past it."""
    end = script.find("\n", at)
    end = len(script) if end < 0 else end
    return script[at:end].strip(), end + 1


def _delimited(script: str, at: int, parts: int) -> int:
    """Past ``parts`` texts delimited by ``script[at]`` (``s/a/b/``: 2), escapes skipped."""
    delimiter, at = script[at], at + 1
    while parts and at < len(script):
        if script[at] == "\\":
            at += 1
        elif script[at] == delimiter:
            parts -= 1
        at += 1
    return at


def _parse_sed_script(script: str) -> tuple[list[str], bool]:
    """``(files its w/W commands and s///w flags write, whether an e command or s///e flag runs
    a shell command)`` of one sed script (GNU sed's syntax). Pure."""
    written, runs, at = [], False, 0
    while at < len(script):
        ch = script[at]
        if ch in " \t\n;{}!,0123456789$~+":
            at += 1
        elif ch == "/":  # an address /RE/
            at = _delimited(script, at, 1)
        elif ch == "\\" and at + 1 < len(script):  # an address \cREc
            at = _delimited(script, at + 1, 1)
        elif ch in "sy" and at + 1 < len(script):
            at = _delimited(script, at + 1, 2)
            if ch == "s":
                while at < len(script) and script[at] in "gpiImMe0123456789":
                    runs, at = runs or script[at] == "e", at + 1
                if at < len(script) and script[at] == "w":
                    target, at = _to_line_end(script, at + 1)
                    written.append(target)
        elif ch in "wW":
            target, at = _to_line_end(script, at + 1)
            written.append(target)
        elif ch == "e":
            runs, at = True, _to_line_end(script, at + 1)[1]
        elif ch in "aicrRbtT:":  # text, a file read or a label to the end of the line
            at = _to_line_end(script, at + 1)[1] if ch in "aicrR" else at + 1
            if ch in "btT:":
                while at < len(script) and script[at] not in ";\n}":
                    at += 1
        else:  # p d n N g G h H x l L q Q = z D P F ...: one letter
            at += 1
    return [w for w in written if w], runs


def _sed_scripts(words: Sequence[str]) -> list[str] | None:
    """The script texts of a sed call (``-e S``, ``--expression=S``, else the first operand);
    ``None`` when a script comes from a file (``-f``: not visible). Pure."""
    scripts, has_expression = [], False
    for i, word in enumerate(words[1:], 1):
        if word == "--file" or word.startswith("--file="):
            return None
        if word[:1] == "-" and word[1:2] not in ("-", "i", "") and "f" in word[1:]:  # -f, -nf
            return None
        if word in ("-e", "--expression") and i + 1 < len(words):
            scripts.append(words[i + 1])
            has_expression = True
        elif word.startswith("--expression="):
            scripts.append(word.split("=", 1)[1])
            has_expression = True
    if not has_expression:
        operands = [w for w in words[1:] if not w.startswith("-")]
        scripts = operands[:1]
    return scripts


def sed_effects(words: Sequence[str]) -> tuple[list[str], bool]:
    """What a sed call's script does beyond printing: ``(written files, runs a command)`` from its
    ``w``/``W`` commands and ``s///w`` flags, and its ``e`` command or ``s///e`` flag (GNU);
    a script read from a file (``-f``) runs commands as far as the guard can tell;
    ``--sandbox`` refuses all of them. Pure.

    Args:
        words: the command's words (:func:`command_words`), ``words[0]`` the program.
    """
    if "--sandbox" in words:
        return [], False
    scripts = _sed_scripts(words)
    if scripts is None:
        return [], True
    written, runs = [], False
    for script in scripts:
        files, executes = _parse_sed_script(script)
        written += files
        runs = runs or executes
    return written, runs


_AWK_WRITE = re.compile(r">>?\s*\"([^\"]+)\"")
"""An awk ``print > "file"`` / ``>> "file"`` in an awk program."""
_OUTPUT_OPTIONS: dict[str, tuple[str, tuple[str, ...]]] = {
    "sort": ("o", ("--output",)),
    "curl": ("o", ("--output",)),
    "wget": ("O", ("--output-document", "--directory-prefix", "-P")),
    "find": ("", ("-fprint", "-fprint0", "-fprintf", "-fls")),
    **{name: ("t", ("--target-directory",)) for name in ("cp", "mv", "ln", "install")},
}
"""Commands that name a written path in an option: name -> (short letter, long names)."""


def _written_paths(tokens: list[str]) -> list[str]:
    """Paths a simple command writes: redirection targets, writing commands' arguments, output
    options (``sort -o``, ``curl -o``, ``cp -t``, ...), ``uniq``'s second operand and the
    ``w FILE`` of sed and the ``> "file"`` of awk programs."""
    paths = [target for target, _ in redirections(tokens)]
    words = command_words(tokens)
    name = os.path.basename(words[0]) if words else ""
    args = [t for t in words[1:] if not t.startswith("-")]
    named = _option_values(words[1:], *_OUTPUT_OPTIONS[name]) if name in _OUTPUT_OPTIONS else []
    paths += named
    if name == "uniq":  # uniq [OPTION]... [INPUT [OUTPUT]]; -f, -s, -w take a number
        rest = words[1:]
        operands = [t for i, t in enumerate(rest) if not t.startswith("-") and not (
            i and rest[i - 1] in ("-f", "-s", "-w", "--skip-fields", "--skip-chars", "--check-chars"))]
        paths += operands[1:2]
    elif name == "sed":
        paths += sed_effects(words)[0]
    elif name in ("awk", "gawk", "mawk", "nawk"):
        paths += [m for t in words[1:] for m in _AWK_WRITE.findall(t)]
    if name in _WRITES_ALL_ARGS:
        paths += args[1:] if name in ("chmod", "chown", "chgrp") else args
    elif name in _WRITES_LAST_ARG and args and not named:  # `cp -t DIR a b`: DIR, named above
        paths.append(args[-1])
    elif name == "sed" and any(t.startswith("-i") or t == "--in-place" for t in words):
        paths += args[1:]
    elif name == "dd":
        paths += [t[3:] for t in words if t.startswith("of=")]
    return paths


def split_commands(command: str) -> list[list[str]]:
    """The simple commands of a shell command line, each as tokens with leading ``VAR=value`` and
    ``env``/``nohup``/... wrappers removed; here-document bodies skipped. Pure."""
    return [tokens for raw in _split_segments(command) if (tokens := _strip_env_prefix(raw))]


def written_paths(tokens: list[str]) -> list[str]:
    """Paths one simple command (tokens) writes: redirection targets, writing commands' arguments
    (``rm``, ``mv``, ``cp``, ``tee``, ``sed -i``, ``dd of=``, ...). Pure."""
    return _written_paths(tokens)


def check_command(command: str, workspace: Path, config: PolicyConfig | None = None) -> PolicyDecision:
    """Check one terminal command against the policy. Pure except for ``/proc`` reads (pid rule).

    Args:
        command: the shell command text the agent asked for.
        workspace: the session's workspace root (absolute); relative paths resolve against it,
            following ``cd`` inside the same command.
        config: which rules apply (default: all).

    Returns:
        The first rule the command breaks, or an allowing decision.
    """
    config = config or PolicyConfig()
    roots = [workspace.resolve()] + [Path(p) for p in config.allowed_write_paths]
    cwd = workspace.resolve()
    for raw in _split_segments(command):
        tokens = _strip_env_prefix(raw)
        if not tokens:
            continue
        for enabled, rule in ((config.kill_outside_session, _check_kill),
                              (config.privilege_escalation, _check_escalation),
                              (config.environment_mutation, _check_environment)):
            decision = rule(tokens) if enabled else None
            if decision is not None:
                return decision
        if tokens[0] == "cd" and len(tokens) > 1:
            cwd = Path(os.path.normpath(cwd / os.path.expanduser(tokens[1])))
        if config.write_outside_workspace:
            for path in _written_paths(tokens):
                if not _is_inside(path, cwd, roots):
                    return _deny("write_outside_workspace", f"{path!r} is outside the workspace "
                                 f"{str(workspace)!r}")
    return _ALLOW


def check_file_edit(command: str, path: str, workspace: Path,
                    config: PolicyConfig | None = None) -> PolicyDecision:
    """Check a file-editor action: any command but ``view`` writes ``path``. Pure."""
    config = config or PolicyConfig()
    if command == "view" or not config.write_outside_workspace:
        return _ALLOW
    roots = [workspace.resolve()] + [Path(p) for p in config.allowed_write_paths]
    if _is_inside(path, workspace.resolve(), roots):
        return _ALLOW
    return _deny("write_outside_workspace", f"file_editor {command} of {path!r} is outside the "
                 f"workspace {str(workspace)!r}")


def check_action(tool_name: str, arguments: Mapping[str, Any], workspace: Path,
                 config: PolicyConfig | None = None) -> PolicyDecision:
    """Check a tool call by tool name and arguments (``terminal``, ``file_editor``; others pass).

    Args:
        tool_name: OpenHands tool name (``"terminal"``, ``"file_editor"``, ...). The legacy names
            ``execute_bash`` / ``bash`` / ``str_replace_editor`` are treated the same.
        arguments: the action's fields (``action.model_dump()`` or the hook's ``tool_input``).
        workspace: the session's workspace root.
        config: which rules apply.
    """
    if tool_name in ("terminal", "execute_bash", "bash") and arguments.get("command"):
        if arguments.get("is_input"):
            return _ALLOW  # keystrokes to a running process, not a new command
        return check_command(str(arguments["command"]), workspace, config)
    if tool_name in ("file_editor", "str_replace_editor") and arguments.get("path"):
        return check_file_edit(str(arguments.get("command", "")), str(arguments["path"]),
                               workspace, config)
    return _ALLOW


def is_safe_to_replay(command: str) -> bool:
    """Whether a recorded (trace) command passes every rule in a pseudo-workspace. Pure."""
    return check_command(command, Path("/__playback_workspace__")).is_allowed
