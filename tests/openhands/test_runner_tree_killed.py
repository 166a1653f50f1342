"""A killed ``openhands run`` leaves nothing its tasks started, also what left their process
group, their session or their tree, and also while the CPUs are busy.

The launcher is the real runner (``run_tasks`` in a child process, as in test_runner_killed.py);
each task process is a stand-in (``run_tasks(python=...)``) with the real task's shape: it runs
``end_with_parent`` and ``sigterm_exits`` as ``run-one`` does, and starts a tool the way the
OpenHands terminal starts its shell, in a session of its own. The tool is the worst case of its
class: a shell that ignores SIGHUP and SIGTERM (an interactive ``bash`` ignores SIGTERM; under a
``nohup``'d launcher it ignores SIGHUP too, so the pty's hangup does not end it), running a job,
and a daemon that ``setsid``s away from it in a subshell that exits (a double fork, as a tmux
server's), re-parented out of the tree at once. Two busy-looping processes hold both cores of
the CI machine through the test. SIGTERM, SIGINT or SIGKILL to the runner: every process of that
tree, found by parent pid and by the test's unique path in its command line, must be gone within
``BOUND_S``.

Before (the task's process group SIGTERMed, then SIGKILLed, by the runner; ``end_with_parent``
signalling its own group), each case failed: the shell, its job and the daemon ran on.
"""

from __future__ import annotations

import os
import signal
import stat
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

pytest.importorskip("openhands.sdk", reason="needs the OpenHands env (.venv-openhands)")

from tests.proc_tree import (  # noqa: E402
    alive,
    busy_cpus,
    command_line,
    descendants,
    kill_alive,
    wait_until,
    with_marker,
)

pytestmark = [pytest.mark.openhands, pytest.mark.timeout(300)]

REPO = Path(__file__).resolve().parents[2]
BOUND_S = 30.0
"""The runner's 5 s grace, or the task's 10 s (its parent's pidfd, then SIGTERM, then the tree's
SIGKILL), with room for a loaded machine."""

TASK = textwrap.dedent("""
    import subprocess, sys, time
    from pathlib import Path
    from mars_openhands.cli_signals import end_with_parent, sigterm_exits

    args = sys.argv[1:]
    end_with_parent(int(args[args.index("--exit-with-parent") + 1]))
    out = Path(args[args.index("--task") + 1]).parent
    daemon = f"touch {out}/daemon; sleep 301; : {out}"
    tool = f"trap '' HUP TERM; (setsid bash -c '{daemon}' &); touch {out}/tool; sleep 300; : {out}"
    subprocess.Popen(["bash", "-c", tool], start_new_session=True)
    with sigterm_exits():
        while True:
            time.sleep(1)
""")

RUNNER = textwrap.dedent("""
    import signal, sys
    from pathlib import Path
    from mars_openhands.cli_signals import sigterm_exits
    from mars_openhands.openhands.llm import LLMSettings
    from mars_openhands.openhands.runner import RunConfig, TaskSpec, run_tasks

    signal.signal(signal.SIGINT, signal.default_int_handler)  # as in a terminal
    tmp, task_python = Path(sys.argv[1]), sys.argv[2]
    config = RunConfig(llm=LLMSettings(backend="mars", base_url="http://127.0.0.1:9/v1",
                                       model="none"), out_dir=str(tmp / "out"))
    task = TaskSpec(task_id="t0", problem_statement="none", workspace=str(tmp / "ws"))
    with sigterm_exits():
        run_tasks([task], config, rps=1.0, python=task_python, check_endpoint=False)
""")


def _task_python(tmp_path: Path) -> str:
    """An executable that ``run_tasks`` runs as ``PYTHON -m mars_openhands.openhands.cli run-one
    ...``: the stand-in task (arguments after the module name are the task's)."""
    path = tmp_path / "task_python"
    path.write_text(f"#!{sys.executable}\n{TASK}")
    path.chmod(path.stat().st_mode | stat.S_IXUSR)
    return str(path)


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT, signal.SIGKILL], ids=lambda s: s.name)
def test_a_killed_runner_leaves_no_tool_of_its_tasks_under_load(sig: signal.Signals,
                                                                  tmp_path: Path) -> None:
    out = tmp_path / "out" / "t0"
    started: dict[int, int] = {}
    with busy_cpus(2):
        runner = subprocess.Popen([sys.executable, "-c", RUNNER, str(tmp_path), _task_python(tmp_path)],
                                  cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                                  env={**os.environ, "PYTHONPATH": str(REPO)})
        try:
            assert wait_until(lambda: runner.poll() is not None or (
                (out / "tool").exists() and (out / "daemon").exists()), 120.0, 0.2)
            assert runner.poll() is None, runner.communicate()[1][-3000:]
            assert wait_until(lambda: len(with_marker(str(out))) >= 4, 30.0), with_marker(str(out))
            started = {**descendants(runner.pid), **with_marker(str(out))}
            runner.send_signal(sig)
            runner.wait(timeout=60)
            assert wait_until(lambda: not alive(started) and not with_marker(str(out)), BOUND_S), (
                f"{sig.name} to the runner: still running "
                + "; ".join(f"{pid} {command_line(pid)!r}" for pid in alive(started)))
        finally:
            runner.kill()
            runner.wait()
            kill_alive({**started, **with_marker(str(out))})
