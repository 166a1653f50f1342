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
