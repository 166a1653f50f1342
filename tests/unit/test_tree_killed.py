"""A killed launcher leaves no process its children started, whatever group, session or parent
those ended up with, also while the CPUs are busy (``mars_openhands/process_tree.py``,
``cli_signals.end_with_parent`` / ``run_child``).

The tool in each case is the worst of its class: a shell in a session of its own that ignores
SIGHUP and SIGTERM (the OpenHands terminal's ``bash -i`` under a ``nohup``'d launcher), running a
job, and a daemon that ``setsid``s away in a subshell that exits (a double fork, as a tmux
server's), so that it leaves the tree at once. What must end is found by parent pid and by the
test's unique temporary path in the command line (never by name: the machine is shared).

The runner's own case, with the real ``run_tasks``, is tests/openhands/test_runner_tree_killed.py;
before this change each of its signals left the shell, its job and the daemon running.
"""

from __future__ import annotations

import os
import signal
import stat
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from mars_openhands.cli_signals import EXIT_TERMINATED
from mars_openhands.process_tree import kill_tree
from tests.proc_tree import alive, busy_cpus, command_line, kill_alive, wait_until, with_marker

REPO = Path(__file__).resolve().parents[2]
BOUND_S = 30.0
"""The task's 10 s grace after its parent's death, with room for a loaded 2-core machine."""


def _tool(marker: Path) -> str:
    """The worst-case tool as a ``bash -c`` script; touches ``marker/tool`` and ``marker/daemon``."""
    daemon = f"touch {marker}/daemon; sleep 301; : {marker}"
    return f"trap '' HUP TERM; (setsid bash -c '{daemon}' &); touch {marker}/tool; sleep 300; : {marker}"


TASK = textwrap.dedent("""
    import subprocess, sys, time
    from mars_openhands.cli_signals import end_with_parent, sigterm_exits

    parent, tool = int(sys.argv[1]), sys.argv[2]
    end_with_parent(parent)
    subprocess.Popen(["bash", "-c", tool], start_new_session=True)
    with sigterm_exits():
        while True:
            time.sleep(1)
""")

SUBREAPER_ROOT = textwrap.dedent("""
    import subprocess, sys
    from mars_openhands.process_tree import become_subreaper

    assert become_subreaper()
    subprocess.Popen(["bash", "-c", sys.argv[1]], start_new_session=True).wait()
""")

LAUNCHER = textwrap.dedent("""
    import os, signal, sys
    from mars_openhands.cli_signals import run_child, sigterm_exits

    signal.signal(signal.SIGINT, signal.default_int_handler)  # as in a terminal
    task, tool = sys.argv[1:3]
    with sigterm_exits():
        run_child([sys.executable, "-c", task, str(os.getpid()), tool], grace_s=5.0,
                  start_new_session=True)
""")


def _start(cmd: list[str], marker: Path) -> subprocess.Popen[bytes]:
    """Start ``cmd`` in the repository, its stderr in ``marker/owner.log`` (a file, not a pipe: a
    process left running would hold a pipe open)."""
    with (marker / "owner.log").open("wb") as log:
        return subprocess.Popen(cmd, cwd=REPO, stdout=subprocess.DEVNULL, stderr=log,
                                env={**os.environ, "PYTHONPATH": str(REPO)})


def _wait_for_tool(marker: Path, owner: subprocess.Popen[bytes]) -> dict[int, int]:
    """Wait until the tool and its daemon run; returns the marked processes and their trees."""
    assert wait_until(lambda: owner.poll() is not None or (
        (marker / "tool").exists() and (marker / "daemon").exists()), 60.0, 0.1)
    assert owner.poll() is None, (marker / "owner.log").read_text()[-3000:]
    assert wait_until(lambda: len(with_marker(str(marker))) >= 4, 30.0), with_marker(str(marker))
    return with_marker(str(marker))


def _assert_all_end(started: dict[int, int], marker: Path, what: str) -> None:
    assert wait_until(lambda: not alive(started) and not with_marker(str(marker)), BOUND_S), (
        f"{what}: still running "
        + "; ".join(f"{pid} {command_line(pid)!r}" for pid in sorted(with_marker(str(marker)))))


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT, signal.SIGKILL], ids=lambda s: s.name)
def test_a_killed_launcher_leaves_no_process_of_its_child_under_load(sig: signal.Signals,
                                                                     tmp_path: Path) -> None:
    started: dict[int, int] = {}
    with busy_cpus(2):
        launcher = _start([sys.executable, "-c", LAUNCHER, TASK, _tool(tmp_path)], tmp_path)
        try:
            started = _wait_for_tool(tmp_path, launcher)
            launcher.send_signal(sig)
            launcher.wait(timeout=60)
            _assert_all_end(started, tmp_path, f"{sig.name} to the launcher")
        finally:
            launcher.kill()
            launcher.wait()
            kill_alive({**started, **with_marker(str(tmp_path))})


def test_kill_tree_ends_what_left_the_group_and_the_tree(tmp_path: Path) -> None:
    """``kill_tree`` on a root (a subreaper: the daemon is re-parented to it) whose tool ignores
    SIGTERM: SIGTERM ends the root at once, which re-parents the rest to pid 1, out of its tree;
    they still get SIGKILL (by identity, with what is below them)."""
    root = _start([sys.executable, "-c", SUBREAPER_ROOT, _tool(tmp_path)], tmp_path)
    started: dict[int, int] = {}
    try:
        started = _wait_for_tool(tmp_path, root)
        t0 = time.monotonic()
        killed = kill_tree(root.pid, grace_s=1.0)
        assert time.monotonic() - t0 < 10.0
        _assert_all_end(started, tmp_path, "kill_tree")
        assert killed, "the tool ignores SIGTERM: SIGKILL was needed"
        assert root.wait(timeout=10) is not None
    finally:
        root.kill()
        root.wait()
        kill_alive({**started, **with_marker(str(tmp_path))})


COMPARE_STAND_IN = textwrap.dedent("""
    import os, signal, sys, time
    from pathlib import Path

    out = Path(os.environ["STAND_IN_OUT"])
    def on_term(*_):
        (out / "terminated").touch()
        sys.exit(143)
    signal.signal(signal.SIGTERM, on_term)
    (out / "compare").write_text(str(os.getpid()))
    time.sleep(300)
""")


@pytest.mark.parametrize("script,args", [
    ("bench_tracesets.py", ["--sets", "x", "--seeds", "0"]),
    ("replica_capacity.py", ["--replicas", "1", "--seeds", "0", "--routers", "sticky-hash"]),
])
def test_a_benchmark_sigtermed_ends_its_compare(script: str, args: list[str], tmp_path: Path) -> None:
    """The benchmark runs as a script (its ``__main__``); its ``compare`` is a stand-in (the
    benchmark's ``sys.executable``) that notes SIGTERM. Before, SIGTERM ended the benchmark at
    once and the compare ran on."""
    fake_python = tmp_path / "python"
    fake_python.write_text(f"#!{sys.executable}\n{COMPARE_STAND_IN}")
    fake_python.chmod(fake_python.stat().st_mode | stat.S_IXUSR)
    run = (f"import runpy, sys; sys.executable = {str(fake_python)!r}; "
           f"sys.argv = [{script!r}, '--out', {str(tmp_path / 'out')!r}, *{args!r}]; "
           f"runpy.run_path({str(REPO / 'benchmarks' / script)!r}, run_name='__main__')")
    log = tmp_path / "bench.log"  # a file, not a pipe: a compare left running would hold a pipe open
    with log.open("wb") as stderr:
        bench = subprocess.Popen([sys.executable, "-c", run], cwd=tmp_path, stdout=subprocess.DEVNULL,
                                 stderr=stderr, env={**os.environ, "PYTHONPATH": str(REPO),
                                                     "STAND_IN_OUT": str(tmp_path)})
    compare: dict[int, int] = {}
    try:
        assert wait_until(lambda: bench.poll() is not None or (tmp_path / "compare").exists(), 60.0)
        assert bench.poll() is None, log.read_text()[-3000:]
        compare = with_marker(str(fake_python))
        bench.send_signal(signal.SIGTERM)
        assert bench.wait(timeout=60) == EXIT_TERMINATED, log.read_text()[-3000:]
        assert (tmp_path / "terminated").exists(), "the compare got no SIGTERM"
        assert not alive(compare), [command_line(pid) for pid in alive(compare)]
    finally:
        bench.kill()
        bench.wait()
        kill_alive(compare)
