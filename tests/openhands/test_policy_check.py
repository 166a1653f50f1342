"""The pre-tool policy check: table-driven verdicts per rule, the hook entry point."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from mars_openhands.openhands.policy_check import (
    PolicyConfig,
    check_action,
    check_command,
    is_safe_to_replay,
)

pytestmark = pytest.mark.openhands

WS = Path("/tmp/mars-policy-ws")

ALLOWED = [
    "ls -la",
    "cd src && grep -rn foo . | head -20",
    "python -m pytest tests/test_x.py -q 2>&1 | tail -5",
    "echo hi > out.txt && cat out.txt >> log.txt",
    "sed -i 's/a/b/' src/x.py",
    "cat a > /dev/null",
    "pip install -e .",
    "kill %1",
    "git diff",
    "mkdir -p build/tmp && touch build/tmp/x",
    "find . -name '*.py' | xargs grep -l foo",
    "cat > notes.md << 'EOF'\nrun sudo make install, then export PATH=/opt/bin\nEOF\ncat notes.md",
    "echo 'a>/etc/passwd' && grep '->' a.py",  # quoted: text, not a redirection
    "make 2>&1 | tee build.log",  # `2>&1` duplicates a descriptor: no separator, no file
]

DENIED = [
    ("pkill -f python", "kill_outside_session"),
    ("killall bash", "kill_outside_session"),
    ("kill -9 1", "kill_outside_session"),
    ("kill -9 -1", "kill_outside_session"),
    ("kill -- -4242", "kill_outside_session"),
    ("sudo rm x", "privilege_escalation"),
    ("su -c id", "privilege_escalation"),
    ("chmod u+s ./a.out", "privilege_escalation"),
    ("chmod 4755 ./a.out", "privilege_escalation"),
    ("echo x > /etc/passwd", "write_outside_workspace"),
    ("cat a >> ~/.bashrc", "write_outside_workspace"),
    ("rm -rf ../other", "write_outside_workspace"),
    ("cd / && rm -rf tmp", "write_outside_workspace"),
    ("cp a.txt /usr/local/bin/a", "write_outside_workspace"),
    ("ls; tee /tmp/elsewhere.txt < a", "write_outside_workspace"),
    ("dd if=/dev/zero of=/dev/sda", "write_outside_workspace"),
    ("apt-get install -y curl", "environment_mutation"),
    ("export PATH=/evil:$PATH", "environment_mutation"),
    ("unset LD_PRELOAD", "environment_mutation"),
    ("pip install --user requests", "environment_mutation"),
    ("git config --global user.name x", "environment_mutation"),
    ("FOO=1 sudo id", "privilege_escalation"),
    ("echo ok && $(sudo id)", "privilege_escalation"),
    ("cat > a.txt << EOF\nhello\nEOF\nsudo id", "privilege_escalation"),
    ("cat << EOF > /etc/motd\nhello\nEOF", "write_outside_workspace"),
    ("echo x>/etc/passwd", "write_outside_workspace"),  # a redirection attached to a word
    ("echo x>>~/.bashrc", "write_outside_workspace"),
    ("ls 2>/etc/err", "write_outside_workspace"),
    ("echo x >|/etc/passwd", "write_outside_workspace"),
]


@pytest.mark.parametrize("command", ALLOWED)
def test_ordinary_commands_are_allowed(command: str) -> None:
    decision = check_command(command, WS)
    assert decision.is_allowed, decision.reason


@pytest.mark.parametrize(("command", "rule"), DENIED)
def test_dangerous_commands_are_denied_by_their_rule(command: str, rule: str) -> None:
    decision = check_command(command, WS)
    assert not decision.is_allowed
    assert decision.rule == rule
    assert rule in decision.reason


def test_kill_of_own_child_is_allowed_and_of_a_foreign_pid_is_denied() -> None:
    child = subprocess.Popen(["sleep", "30"])
    try:
        assert check_command(f"kill {child.pid}", WS).is_allowed
    finally:
        child.kill()
        child.wait()
    assert not check_command(f"kill {os.getppid()}", WS).is_allowed  # our parent is not ours


def test_switches_turn_rules_off_and_allowed_paths_extend_the_workspace() -> None:
    assert check_command("sudo ls", WS, PolicyConfig(privilege_escalation=False)).is_allowed
    assert check_command("echo > /tmp/x", WS, PolicyConfig(allowed_write_paths=("/tmp",))).is_allowed
    assert not check_command("echo > /var/x", WS, PolicyConfig(allowed_write_paths=("/tmp",))).is_allowed


def test_file_editor_writes_outside_the_workspace_are_denied_views_are_not() -> None:
    assert not check_action("file_editor", {"command": "create", "path": "/etc/x"}, WS).is_allowed
    assert check_action("file_editor", {"command": "view", "path": "/etc/hosts"}, WS).is_allowed
    assert check_action("file_editor", {"command": "str_replace", "path": f"{WS}/a.py"}, WS).is_allowed
    assert check_action("task_tracker", {"command": "plan"}, WS).is_allowed
    assert check_action("terminal", {"command": "C-c", "is_input": True}, WS).is_allowed


def test_replay_filter_uses_the_same_rules() -> None:
    assert is_safe_to_replay("cd . && grep -rn foo src")
    assert not is_safe_to_replay("sudo pip install x")


@pytest.mark.parametrize(("tool_input", "exit_code"), [
    ({"command": "ls"}, 0), ({"command": "sudo ls"}, 2)])
def test_hook_entry_point_exits_2_to_deny(tool_input: dict[str, str], exit_code: int) -> None:
    event = {"event_type": "PreToolUse", "tool_name": "terminal", "tool_input": tool_input,
             "working_dir": str(WS)}
    proc = subprocess.run([sys.executable, "-m", "mars_openhands.openhands.policy_check", "--hook"],
                          input=json.dumps(event), capture_output=True, text=True, timeout=60)
    assert proc.returncode == exit_code, proc.stderr
    if exit_code == 2:
        assert "privilege_escalation" in proc.stderr
