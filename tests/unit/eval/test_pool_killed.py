"""A killed sweep leaves no worker: the owner of an ``eval.pool.Pool`` with workers (``compare`` /
``plan --jobs 2``) killed by SIGTERM (as ``timeout`` or ``pkill`` send it, under the CLI's
``sigterm_exits``) or SIGKILL, with calls running, leaves none of its processes (the forkserver,
its workers, the resource tracker) behind. Processes are found by pid and start time, never by name."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from tests.proc_tree import assert_ends_with_owner, descendants, kill_leftovers

REPO = Path(__file__).resolve().parents[3]
_OWNER = textwrap.dedent("""
    import os, sys, time
    import eval.pool as pool
    from mars_openhands.cli_signals import sigterm_exits

    pool.WORKER_PRELOAD = ()  # the same pool without importing vLLM into the forkserver (~20 s)
    with sigterm_exits():
        with pool.Pool(2) as p:
            calls = [p.submit(time.sleep, 600) for _ in range(2)]  # both workers busy for good
            time.sleep(1.0)
            print("READY", flush=True)
            calls[0].result()
""")


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGKILL], ids=["SIGTERM", "SIGKILL"])
def test_a_killed_pool_owner_leaves_no_worker_or_forkserver(sig: signal.Signals) -> None:
    owner = subprocess.Popen([sys.executable, "-c", _OWNER], cwd=REPO, stdout=subprocess.PIPE,
                             env={**os.environ, "PYTHONPATH": str(REPO)})
    processes: dict[int, int] = {}
    try:
        assert owner.stdout is not None and owner.stdout.readline().strip() == b"READY"
        processes = descendants(owner.pid)
        assert len(processes) >= 3  # the forkserver and two workers (and the resource tracker)
        assert_ends_with_owner(owner, processes, sig, bound_s=20)
    finally:
        kill_leftovers(owner, processes)


_CALLS = textwrap.dedent("""
    import os, time

    def sleep_then_touch(path, delay_s):
        time.sleep(delay_s)
        open(path, "w").close()
""")
_STOPPED_OWNER = textwrap.dedent("""
    import os, signal, sys
    signal.signal(signal.SIGINT, signal.default_int_handler)  # as in a terminal, even if inherited ignored
    import eval.pool as pool
    from owner_calls import sleep_then_touch

    pool.WORKER_PRELOAD = ()
    out = sys.argv[1]
    with pool.Pool(2) as p:
        try:
            calls = [p.submit(sleep_then_touch, os.path.join(out, f"late{i}"), 3.0) for i in range(4)]
            print("READY", flush=True)
            calls[0].result()
        except KeyboardInterrupt:
            p.stop()
            open(os.path.join(out, "summary"), "w").close()  # as the sweep writes its summary now
            print("STOPPED", flush=True)
""")


def test_ctrl_c_reaches_the_owner_only_and_stop_ends_the_workers_before_it_returns(tmp_path: Path) -> None:
    """A terminal's Ctrl-C (SIGINT to the whole group): the workers ignore it, the owner stops them
    (Pool.stop) and only then writes its summary; no worker writes a file after it. Before, each
    worker took the SIGINT as its call's result and ran the next queued call, and the workers
    were stopped only after the summary was written: 4 run files came after it."""
    (tmp_path / "owner_calls.py").write_text(_CALLS)
    out = tmp_path / "out"
    out.mkdir()
    owner = subprocess.Popen([sys.executable, "-c", _STOPPED_OWNER, str(out)], cwd=REPO, stdout=subprocess.PIPE,
                             env={**os.environ, "PYTHONPATH": f"{REPO}{os.pathsep}{tmp_path}"},
                             start_new_session=True)
    processes: dict[int, int] = {}
    try:
        assert owner.stdout is not None and owner.stdout.readline().strip() == b"READY"
        time.sleep(1.0)  # both workers inside their first call
        processes = descendants(owner.pid)
        os.killpg(owner.pid, signal.SIGINT)
        assert owner.stdout.readline().strip() == b"STOPPED"
        assert owner.wait(timeout=20) == 0
        time.sleep(4.0)  # past the calls' 3 s: a worker still running would have written by now
        assert sorted(p.name for p in out.iterdir()) == ["summary"]
    finally:
        kill_leftovers(owner, processes)


_SLOW_PRELOAD_OWNER = textwrap.dedent("""
    import os, signal, sys, time
    from multiprocessing import forkserver
    import eval.pool as pool

    pool.WORKER_PRELOAD = ("slow_import",)
    pool.start_worker_server()
    time.sleep(0.5)  # the server is importing its preload
    os.kill(forkserver._forkserver._forkserver_pid, signal.SIGINT)  # a terminal's Ctrl-C reaches it too
    with pool.Pool(2) as p:
        print(p.submit(os.getpid).result(timeout=60) != os.getpid(), flush=True)
""")


def test_the_worker_server_ignores_ctrl_c_while_it_imports_its_preload(tmp_path: Path) -> None:
    """Ctrl-C in compare's first ~20 s (the server importing vLLM) printed the server's
    KeyboardInterrupt traceback under compare's one line, and left no server for the workers."""
    (tmp_path / "slow_import.py").write_text("import time\ntime.sleep(3)\n")
    proc = subprocess.run([sys.executable, "-c", _SLOW_PRELOAD_OWNER], cwd=REPO, capture_output=True, text=True,
                          env={**os.environ, "PYTHONPATH": f"{REPO}{os.pathsep}{tmp_path}"}, timeout=120)
    assert (proc.returncode, proc.stdout, proc.stderr) == (0, "True\n", "")
