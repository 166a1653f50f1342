"""``terminal_ready.wait_until_ready``: the terminal is in step with its shell before the agent's
first command (mars_openhands/openhands/terminal_ready.py says why: under load the SDK's terminal
returned each task's first command before it ran).

A stand-in executor plays a lagging terminal: it returns on a stale prompt, with the output of
the command before (none for the first), until the shell has caught up. With the real terminal,
the first command after the handshake gets its own output.
"""

from __future__ import annotations

import re
import time
from pathlib import Path
from types import SimpleNamespace

import pytest

pytest.importorskip("openhands.sdk", reason="needs the OpenHands env (.venv-openhands)")

from mars_openhands.openhands.terminal_ready import CLEAN_ROUNDS, wait_until_ready  # noqa: E402

pytestmark = pytest.mark.openhands


class LaggingTerminal:
    """Answers each command with the previous command's output until ``catch_up_at`` (monotonic
    seconds); after that a command sent gets its own output. Records what was sent."""

    def __init__(self, lag_s: float) -> None:
        self.catch_up_at = time.monotonic() + lag_s
        self.sent: list[str] = []

    def __call__(self, action, conversation=None):
        self.sent.append(action.command)
        if time.monotonic() < self.catch_up_at:
            previous = self.sent[-2] if len(self.sent) > 1 else ""
            return SimpleNamespace(text=f"{previous}\n" + _shell_echo(previous))
        return SimpleNamespace(text=f"{action.command}\n" + _shell_echo(action.command))


def _shell_echo(command: str) -> str:
    """What bash prints for ``echo WORD_$((n))``: the word with the expression evaluated."""
    match = re.fullmatch(r"echo (\S+?)\$\(\((\d+)\)\)", command)
    return f"{match[1]}{match[2]}" if match else ""


def test_a_lagging_terminal_is_waited_for_until_a_round_comes_back_in_its_own_observation() -> None:
    terminal = LaggingTerminal(lag_s=1.0)
    rounds = wait_until_ready(terminal, timeout_s=30.0)
    assert rounds > CLEAN_ROUNDS and len(terminal.sent) == rounds
    assert time.monotonic() >= terminal.catch_up_at  # it did not stop on a stale observation


def test_an_in_step_terminal_takes_the_clean_rounds_and_a_dead_one_raises() -> None:
    assert wait_until_ready(LaggingTerminal(lag_s=0.0)) == CLEAN_ROUNDS
    with pytest.raises(RuntimeError, match="did not answer within 0.5 s"):
        wait_until_ready(LaggingTerminal(lag_s=60.0), timeout_s=0.5)


def test_the_real_terminal_answers_the_first_command_with_its_output(tmp_path: Path) -> None:
    """Under load (another job on the 2 cores) the first command came back with no output: the
    handshake had stopped at a round that ended on a stale prompt while its own prompt, or the
    terminal's nudge, was still to come."""
    from openhands.tools.terminal import TerminalAction
    from openhands.tools.terminal.impl import TerminalExecutor

    executor = TerminalExecutor(str(tmp_path), terminal_type="subprocess")
    try:
        assert wait_until_ready(executor) >= 1
        assert "42" in executor(TerminalAction(command="echo $((6*7))")).text
    finally:
        executor.close()
