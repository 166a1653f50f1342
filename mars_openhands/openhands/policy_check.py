"""Pre-tool policy check for OpenHands tools, and its ``PreToolUse`` hook (design.md §10, §11).

The rules live in :mod:`mars_openhands.runtime.guard` (the command guard, one rule set of the
runtime's policy gate); this module re-exports them for the tool wrapper (``executor.py``) and runs
them as an OpenHands command hook: ``python -m mars_openhands.openhands.policy_check --hook`` reads
the hook event JSON on stdin and exits 2 to deny.
"""

from __future__ import annotations

import json
import os
import sys
from collections.abc import Sequence
from pathlib import Path

from mars_openhands.runtime.guard import (
    PolicyConfig,
    PolicyDecision,
    check_action,
    check_command,
    check_file_edit,
    is_safe_to_replay,
)

__all__ = [
    "PolicyConfig",
    "PolicyDecision",
    "check_action",
    "check_command",
    "check_file_edit",
    "is_safe_to_replay",
    "main",
]


def main(argv: Sequence[str] | None = None) -> int:
    """OpenHands ``PreToolUse`` command hook: read the hook event JSON on stdin, exit 2 to deny.

    Usage in a hook config (app / agent-server ``hooks.json``)::

        {"PreToolUse": [{"matcher": "*", "hooks": [
            {"type": "command", "command": "python -m mars_openhands.openhands.policy_check --hook"}]}]}

    The workspace is the event's ``working_dir`` (else ``$MARS_WORKSPACE``, else the cwd).
    """
    args = list(sys.argv[1:] if argv is None else argv)
    if args != ["--hook"]:
        print("usage: python -m mars_openhands.openhands.policy_check --hook < event.json",
              file=sys.stderr)
        return 1
    event = json.loads(sys.stdin.read() or "{}")
    workspace = Path(event.get("working_dir") or os.environ.get("MARS_WORKSPACE") or os.getcwd())
    decision = check_action(str(event.get("tool_name") or ""), event.get("tool_input") or {},
                            workspace)
    if decision.is_allowed:
        print(json.dumps({"decision": "allow"}))
        return 0
    print(decision.reason, file=sys.stderr)
    return 2


if __name__ == "__main__":
    raise SystemExit(main())
