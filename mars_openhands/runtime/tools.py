"""The runtime's own tools for the ``chat`` agent: a terminal and a file editor, OpenHands-shaped.

Same names and arguments as OpenHands' ``terminal`` (``command``) and ``file_editor``
(``command`` = ``view|create|str_replace|insert``, ``path``, ``file_text``, ``old_str``,
``new_str``, ``insert_line``), so the effect rules and the gate treat both agents alike.

Keys at the target: each terminal command runs in a fresh ``bash -c`` in the workspace with
``MARS_IDEMPOTENCY_KEY`` (the call's key) and ``MARS_TASK_ID`` in its environment, so a command can
hand the key to the service it writes to (``curl -H "Idempotency-Key: $MARS_IDEMPOTENCY_KEY"``).
File edits are idempotent by content: ``create`` writes the whole text; a ``str_replace`` or
``insert`` repeated after a crash whose edit is already in the file (``old_str`` gone and
``new_str`` present once, or the inserted text at its line) reports success without editing again.
"""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Any

from mars_openhands.process_host import run_hosted

__all__ = ["TOOL_SCHEMAS", "run_file_editor", "run_terminal", "run_tool"]

TOOL_SCHEMAS: list[dict[str, Any]] = [
    {"type": "function", "function": {
        "name": "terminal", "description": "Run a bash command in the workspace.",
        "parameters": {"type": "object", "properties": {"command": {"type": "string"}},
                       "required": ["command"]}}},
    {"type": "function", "function": {
        "name": "file_editor", "description": "View, create or edit a file.",
        "parameters": {"type": "object", "properties": {
            "command": {"type": "string", "enum": ["view", "create", "str_replace", "insert"]},
            "path": {"type": "string"}, "file_text": {"type": "string"},
            "old_str": {"type": "string"}, "new_str": {"type": "string"},
            "insert_line": {"type": "integer"}}, "required": ["command", "path"]}}},
    {"type": "function", "function": {
        "name": "finish", "description": "Finish the task.",
        "parameters": {"type": "object", "properties": {"message": {"type": "string"}}}}},
]


def _cut(text: str, max_chars: int) -> str:
    return text if len(text) <= max_chars else text[:max_chars] + f"\n[... {len(text) - max_chars} characters cut]"


def run_terminal(command: str, workspace: Path, key: str, task_id: str, timeout_s: float,
                 max_chars: int) -> dict[str, Any]:
    """Run ``command`` with ``bash -c`` in ``workspace``, in a session of its own, stdin empty,
    under a host that ends its whole process tree once this process has exited, even by SIGKILL
    (:mod:`mars_openhands.process_host`: a killed runner leaves nothing of it running; the
    resumed task finds the call in doubt); at ``timeout_s`` the tree is killed.

    Returns:
        ``{"status": "ok"|"error"|"timeout", "exit_code", "text"}`` (stdout+stderr, cut to ``max_chars``).
    """
    env = {**os.environ, "MARS_IDEMPOTENCY_KEY": key, "MARS_TASK_ID": task_id}
    exit_code, out = run_hosted(["bash", "-c", command], timeout_s, cwd=workspace, env=env,
                                start_new_session=True)
    if exit_code is None:
        return {"status": "timeout", "exit_code": None,
                "text": _cut(out, max_chars) + f"\n[timed out after {timeout_s:g} s]"}
    return {"status": "ok" if exit_code == 0 else "error", "exit_code": exit_code, "text": _cut(out, max_chars)}


def _edit(path: Path, args: dict[str, Any], is_retry: bool) -> str:
    command = args.get("command")
    if command == "create":
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(str(args.get("file_text", "")))
        return f"created {path}"
    text = path.read_text()
    if command == "str_replace":
        old, new = str(args.get("old_str", "")), str(args.get("new_str", ""))
        count = text.count(old) if old else 0
        if count == 0 and is_retry and new and text.count(new) == 1:
            return f"edited {path} (already applied before the restart)"
        if count != 1:
            raise ValueError(f"old_str occurs {count} times in {path}; it must occur exactly once")
        path.write_text(text.replace(old, new, 1))
        return f"edited {path}"
    if command == "insert":
        lines = text.splitlines(keepends=True)
        at, new = int(args.get("insert_line", 0)), str(args.get("new_str", ""))
        block = new if new.endswith("\n") else new + "\n"
        if is_retry and "".join(lines[at:]).startswith(block):
            return f"inserted into {path} (already applied before the restart)"
        path.write_text("".join(lines[:at]) + block + "".join(lines[at:]))
        return f"inserted into {path} at line {at}"
    raise ValueError(f"unknown file_editor command {command!r}; use view, create, str_replace or insert")


def run_file_editor(args: dict[str, Any], workspace: Path, is_retry: bool, max_chars: int) -> dict[str, Any]:
    """Run one file-editor call (see module doc). ``is_retry``: a repeat after a crash in doubt.

    Returns:
        ``{"status": "ok"|"error", "text"}``.
    """
    path = Path(os.path.normpath(workspace / os.path.expanduser(str(args.get("path", "")))))
    try:
        if args.get("command") == "view":
            if path.is_dir():
                return {"status": "ok", "text": "\n".join(sorted(p.name for p in path.iterdir()))}
            return {"status": "ok", "text": _cut(path.read_text(), max_chars)}
        return {"status": "ok", "text": _edit(path, args, is_retry)}
    except (OSError, ValueError) as e:
        return {"status": "error", "text": f"file_editor failed: {e}"}


def run_tool(name: str, args: dict[str, Any], workspace: Path, key: str, task_id: str,
             timeout_s: float, is_retry: bool, max_chars: int) -> dict[str, Any]:
    """Dispatch a ``terminal`` / ``file_editor`` call; add ``duration_s``. Unknown tools are errors."""
    t0 = time.monotonic()
    if name == "terminal":
        result = run_terminal(str(args.get("command", "")), workspace, key, task_id, timeout_s, max_chars)
    elif name == "file_editor":
        result = run_file_editor(args, workspace, is_retry, max_chars)
    else:
        result = {"status": "error", "text": f"unknown tool {name!r}; this agent has terminal, "
                                             "file_editor and finish"}
    return {**result, "duration_s": time.monotonic() - t0}
