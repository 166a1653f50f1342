"""``openhands run`` killed while a task's tool runs leaves no task process behind.

A child process plays the runner (``run_tasks``: one ``run-one`` process per task, each in a
session of its own) with the playback engine scripting one ``terminal`` call that sleeps. Once the
command runs, the runner gets the signal; every process it had started (its descendants then, by
pid and start time) must be gone within ``BOUND_S``. SIGTERM: the runner unwinds
(``sigterm_exits``) and stops its tasks' groups; SIGKILL: each task ends its own group once
the runner is gone (``run-one --exit-with-parent``, ``mars_openhands/cli_signals.py``). Before, the task
and its tool ran on.

The runner starts with SIGHUP ignored, as under ``nohup`` (inherited down to the tool): the
terminal's shell and its job then do not die of the pty's hangup when the task process dies, which
was all that ended them once the task's own cleanup missed its grace (CI under load). Before the
task's whole tree was ended (``mars_openhands/process_tree.py``) both cases failed that way, idle:
the tool's ``sleep 300`` ran on, re-parented to pid 1.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

pytest.importorskip("openhands.sdk", reason="needs the OpenHands env (.venv-openhands)")

from tests.proc_tree import (  # noqa: E402
    assert_ends_with_owner,
    command_line,
    descendants,
    kill_leftovers,
    wait_until,
)

pytestmark = [pytest.mark.openhands, pytest.mark.timeout(300)]

REPO = Path(__file__).resolve().parents[2]
BOUND_S = 30.0
"""The task's 0.5 s poll, its SIGTERM, and SIGKILL after 10 s if it does not end."""

RUNNER = textwrap.dedent("""
    import signal, sys, uuid
    from pathlib import Path
    from mars_openhands.cli_signals import sigterm_exits
    from mars_openhands.openhands.llm import LLMSettings
    from mars_openhands.openhands.playback import RecordedToolCall, RecordedTurn, Script, build_playback_app
    from mars_openhands.openhands.runner import RunConfig, TaskSpec, run_tasks
    from tests.openhands._helpers import serve_app

    signal.signal(signal.SIGHUP, signal.SIG_IGN)  # as under nohup: the tools inherit it
    tmp = Path(sys.argv[1])
    (tmp / "ws").mkdir()
    session_id = str(uuid.uuid4())
    sleep = RecordedToolCall(name="terminal", arguments={"command": "touch started && sleep 300"})
    script = Script(name="sleeper", session_id=session_id,
                    turns=(RecordedTurn(content="sleeping", tool_calls=(sleep,)),))
    with sigterm_exits(), serve_app(build_playback_app([script])) as url:
        config = RunConfig(llm=LLMSettings(backend="mars", base_url=f"{url}/v1", model="playback",
                                           temperature=0.0), out_dir=str(tmp / "out"))
        task = TaskSpec(task_id="t0", problem_statement="sleep", workspace=str(tmp / "ws"),
                        session_id=session_id)
        run_tasks([task], config, rps=1.0, check_endpoint=False)
""")


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGKILL], ids=lambda s: s.name)
def test_a_killed_runner_leaves_no_task_process(sig: signal.Signals, tmp_path: Path) -> None:
    runner = subprocess.Popen([sys.executable, "-c", RUNNER, str(tmp_path)], cwd=REPO,
                              stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                              env={**os.environ, "PYTHONPATH": str(REPO)})
    started: dict[int, int] = {}
    try:
        assert wait_until(lambda: runner.poll() is not None or (tmp_path / "ws" / "started").exists(),
                          180.0, 0.2)
        assert runner.poll() is None, runner.communicate()[1][-3000:]
        assert wait_until(lambda: any(command_line(pid).startswith("sleep 300")
                                      for pid in descendants(runner.pid)), 60.0, 0.2)
        started = descendants(runner.pid)
        assert len(started) >= 3, "the task process, its shell and the shell's job"
        assert_ends_with_owner(runner, started, sig, BOUND_S, owner_timeout_s=60)
    finally:
        kill_leftovers(runner, started)
