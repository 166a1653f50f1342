"""The OpenHands terminal, in step with its shell before the agent's first command.

The SDK's ``SubprocessTerminal`` starts ``bash -i`` (at ``nice 10``), writes its prompt setup, sleeps
a fixed 1 s and drops what the shell printed so far. On a loaded machine the shell has not run the
setup by then; its prompts arrive after the agent's first command was sent, the terminal takes
one of them for that command's end and returns at once (the observation: the echoed command line,
"exit code 0"), and the command runs seconds later, during a later tool call. Seen under load in
tests/openhands/test_gateway_engine_integration.py: each task's first ``terminal`` call ended
(``tool_end``) 1.9 to 3.6 s before its command wrote its own start time, so the stream's tool
interval did not hold the command, and the agent read an empty observation.

:func:`wait_until_ready` runs a handshake through the tool's own executor when the tool is created
(before any event or agent call): ``echo`` of a value the shell computes, repeated, with a pause
that grows to 2 s, until one round's output comes back in its own observation and the shell's
prompt after that output is on the screen: every input has then been run and every prompt printed,
so the terminal is in step with the shell (it stays so: one command, one prompt).
"""

from __future__ import annotations

import time
import uuid
from typing import Any

__all__ = ["CLEAN_ROUNDS", "QUIET_S", "READY_TIMEOUT_S", "wait_until_ready"]

READY_TIMEOUT_S = 120.0
"""Seconds to wait for the shell (a busy 2-core machine: a nice-10 shell may wait seconds)."""
CLEAN_ROUNDS = 2
"""Clean rounds in a row that make the terminal ready."""
QUIET_S = 0.3
"""Seconds the screen must rest on a complete prompt after a round."""
_ROUND_TIMEOUT_S = 10.0
"""Hard timeout of one handshake command, seconds."""


def wait_until_ready(executor: Any, timeout_s: float = READY_TIMEOUT_S) -> int:
    """Run ``echo MARS_READY_<token>_$((n))`` through a terminal tool's ``executor`` (n = 1, 2,
    ...) until :data:`CLEAN_ROUNDS` rounds in a row came back clean: the round's observation holds
    ``MARS_READY_<token>_n`` (the echoed command line holds only the expression; a round returned
    on a stale prompt holds an older value or none) and then the screen rests on a complete prompt
    for :data:`QUIET_S` (a prompt still in flight would end the next command). Mutates: runs
    shell commands.

    Returns:
        The number of rounds it took (:data:`CLEAN_ROUNDS` on an idle machine).

    Raises:
        RuntimeError: no such run of rounds within ``timeout_s`` seconds.
    """
    from openhands.tools.terminal import TerminalAction

    token = uuid.uuid4().hex[:12]
    deadline = time.monotonic() + timeout_s
    rounds = clean = 0
    while clean < CLEAN_ROUNDS:
        rounds += 1
        action = TerminalAction(command=f"echo MARS_READY_{token}_$(({rounds}))",
                                timeout=_ROUND_TIMEOUT_S)
        text = str(getattr(executor(action), "text", ""))
        if f"MARS_READY_{token}_{rounds}" in text and _rests_on_prompt(executor, deadline):
            clean += 1
            continue
        clean = 0
        if time.monotonic() > deadline:
            raise RuntimeError(f"the terminal's shell did not answer within {timeout_s} s "
                               f"({rounds} handshakes); last output: {text[-300:]!r}")
        # The shell lags: let it catch up before the next round.
        time.sleep(min(0.25 * 2 ** (rounds - 1), 2.0))
    return rounds


def _rests_on_prompt(executor: Any, deadline: float) -> bool:
    """Whether the screen of the executor's single session ends with a complete prompt and stays
    unchanged for :data:`QUIET_S` (polled until ``deadline``). ``True`` where the screen cannot
    be read (the tmux pane pool)."""
    try:
        read_screen = executor.session.terminal.read_screen
        from openhands.tools.terminal.constants import CMD_OUTPUT_PS1_END
    except (AttributeError, ImportError):
        return True
    prompt_end = CMD_OUTPUT_PS1_END.strip()
    screen, since = read_screen(), time.monotonic()
    while time.monotonic() < deadline:
        time.sleep(0.05)
        now = read_screen()
        if now != screen:
            screen, since = now, time.monotonic()
        elif screen.rstrip().endswith(prompt_end) and time.monotonic() - since >= QUIET_S:
            return True
    return False
