"""``mars-openhands serve`` on a private single-node Ray: 2 CPU vLLM replicas with MarsScheduler.

One test function (each vLLM start costs a minute or two on this machine), in phases, all through
the command's gateway (the same HTTP API as ``mars-openhands gateway``):

1. six multi-turn sessions with tool events; the admission window is pinned at 2 sessions per
   replica (min = max), so the fifth session waits until one ends;
2. each session's turns stay on one replica; the CPU-plane events (``tool_start``,
   ``session_end``) reach the replica that holds the session (its scheduler's ``kv_retained`` /
   ``kv_released`` with a ``tool_start:*`` / ``session_end`` reason, recorded in the stream);
3. the vLLM server of one replica is killed: its sessions' next turns run on the other replica,
   Ray Serve replaces the replica (health check), the gateway sees it back and routes a new
   session to it;
4. every session ends: no slot held, no session bound, and each replica's last ``engine_step``
   holds no block (used or retained);
5. SIGTERM: the command stops Ray Serve, the engines and Ray; no process of it is left.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from pathlib import Path
from typing import Any

import httpx
import pytest

from mars_openhands.engine.harness.launch import find_free_port
from mars_openhands.stream.reader import iter_events
from tests.proc_tree import reap_with_this_process

pytestmark = pytest.mark.integration

ADMIN_KEY = "admin-of-the-serve-test"
ADMIN = {"authorization": f"Bearer {ADMIN_KEY}"}
NUM_GPU_BLOCKS = 128
WINDOW = 2
"""Sessions per replica (the window's counts are per replica): 4 in front of the two."""
OWNER_VAR = "MARS_SERVE_TEST_RUN"
"""Set in the command's environment; Ray's processes and the engines inherit it (leak check)."""


def wait_until(predicate, timeout_s: float, what: str, proc: subprocess.Popen | None = None,
               log: Path | None = None) -> Any:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if value := predicate():
            return value
        if proc is not None and proc.poll() is not None:
            pytest.fail(f"serve exited ({proc.returncode}) waiting for {what}:\n{_tail(log)}")
        time.sleep(0.1)
    pytest.fail(f"timed out after {timeout_s} s waiting for {what}:\n{_tail(log)}")


def _tail(log: Path | None) -> str:
    return "\n".join(log.read_text(errors="replace").splitlines()[-30:]) if log else ""


def owned_pids(token: str) -> list[int]:
    """Live processes whose environment carries ``OWNER_VAR=token``."""
    needle = f"{OWNER_VAR}={token}".encode()
    pids = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            if needle not in Path(f"/proc/{entry}/environ").read_bytes().split(b"\0"):
                continue
            status = Path(f"/proc/{entry}/stat").read_text()
        except OSError:
            continue
        if status.rsplit(")", 1)[1].split()[0] != "Z":
            pids.append(int(entry))
    return pids


def vllm_pgid(port: int) -> int:
    """The process group of the vLLM server listening on ``port`` (from /proc)."""
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            argv = Path(f"/proc/{entry}/cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if b"vllm.entrypoints.openai.api_server" in argv and str(port).encode() in argv:
            return os.getpgid(int(entry))
    raise AssertionError(f"no vLLM server on port {port}")


def chat(session: str, turn: int) -> dict[str, Any]:
    """An agent turn (tools present; tool_choice none: no tool-call parser needed)."""
    return {"model": "tiny-llama", "max_tokens": 4, "mars_session": session,
            "messages": [{"role": "user", "content": f"{session} turn {turn} " + "x" * 200}],
            "tool_choice": "none", "tools": [{"type": "function", "function": {
                "name": "bash", "parameters": {"type": "object", "properties": {}}}}]}


def event(kind: str, session: str, **extra: Any) -> dict[str, Any]:
    return {"kind": kind, "t_mono_ns": time.monotonic_ns(), "t_wall": "2026-01-01T00:00:00Z",
            "source": "agent", "session_id": session, **extra}


class Worker(threading.Thread):
    """A thread whose exception reaches the test (``result``)."""

    def __init__(self, target: Any, *args: Any) -> None:
        super().__init__(daemon=True)
        self.call, self.args, self.error = target, args, None
        self.start()

    def run(self) -> None:
        try:
            self.call(*self.args)
        except BaseException as e:  # re-raised by result()
            self.error = e

    def result(self, timeout_s: float = 180.0) -> None:
        self.join(timeout_s)
        assert not self.is_alive(), f"{self.call} still running after {timeout_s} s"
        if self.error is not None:
            raise self.error


class Agent:
    """One session's calls through the gateway, with its session token."""

    def __init__(self, client: httpx.Client, session: str) -> None:
        self.client, self.session, self.turn = client, session, 0
        self.replicas: list[str] = []
        self.headers = {"x-mars-session-token": f"token-of-{session}-0123456789abcdef"}

    def step(self) -> str:
        """One turn; returns the replica that served it."""
        r = self.client.post("/v1/chat/completions", json=chat(self.session, self.turn),
                             headers=self.headers)
        assert r.status_code == 200, (self.session, self.turn, r.status_code, r.text)
        assert r.headers["x-mars-turn"] == str(self.turn), r.headers
        self.replicas.append(r.headers["x-mars-replica"])
        self.turn += 1
        return self.replicas[-1]

    def tool(self) -> None:
        """A tool call between turns: enqueued, started, ended."""
        call = {"tool_name": "bash", "tool_call_id": f"{self.session}-{self.turn}"}
        for kind, extra in (("tool_enqueued", {}), ("tool_start", {"queue_wait_s": 0.01}),
                            ("tool_end", {"duration_s": 0.2})):
            self.post([event(kind, self.session, turn=self.turn, **call, **extra)])
            time.sleep(0.15)  # the engine applies tool_start before tool_end marks the turn near

    def end(self) -> None:
        self.post([event("session_end", self.session)])

    def post(self, events: list[dict[str, Any]]) -> None:
        r = self.client.post("/mars/v1/events", json=events, headers=self.headers)
        assert r.status_code == 200, r.text


def start_serve(tmp_path: Path, token: str) -> tuple[subprocess.Popen, Path, str, Path, str]:
    port = find_free_port()
    stream = tmp_path / "stream.jsonl"
    gateway = {"admin_key": ADMIN_KEY, "num_tool_workers": 8, "poll_interval_s": 0.2,
               "replica_failure_threshold": 1, "stream_path": str(stream),
               "admission": {"window_min": WINDOW, "window_max": WINDOW, "window_init": WINDOW,
                             "update_interval_s": 0.05}}
    (tmp_path / "gateway.json").write_text(json.dumps(gateway))
    mars = {"residency": {"enabled": False},  # tool_start re-decides retention (an event)
            # a first turn's KV stays retained until its tool_start arrives, however busy the box
            "retention": {"cold_start_ttl_s": 60.0},
            "telemetry": {"engine_step_interval_ms": 0.0}}
    log = tmp_path / "serve.log"
    ray_dir = tempfile.mkdtemp(prefix="mray-", dir="/tmp")  # Ray's AF_UNIX paths: <= 107 bytes
    cmd = [str(Path(sys.executable).parent / "mars-openhands"), "serve", "--replicas", "2", "--scheduler", "mars",
           "--port", str(port), "--gateway-config", str(tmp_path / "gateway.json"),
           "--ray-temp-dir", ray_dir, "--max-model-len", "2048",
           "--block-size", "32", "--num-gpu-blocks-override", str(NUM_GPU_BLOCKS),
           "--health-check-period-s", "1", "--engine-startup-timeout-s", "1500", "--additional-config", json.dumps({"mars": mars}),
           # The worker in the engine-core process: one process fewer to start (twice as fast
           # under load), slower decoding that 4-token turns do not feel.
           "--engine-env", json.dumps({"VLLM_ENABLE_V1_MULTIPROCESSING": "0"})]
    env = {**os.environ, OWNER_VAR: token, "RAY_AUTH_MODE": "disabled",
           "RAY_USAGE_STATS_ENABLED": "0"}
    with open(log, "wb") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=env,
                                start_new_session=True, cwd=Path(__file__).resolve().parents[2])
    reap_with_this_process(proc.pid, timeout_s=60.0)  # a killed pytest: serve, Ray and engines go
    return proc, log, f"http://127.0.0.1:{port}", stream, ray_dir


@pytest.mark.timeout(2400)  # three vLLM starts (two, then a replacement); see the waits' bounds
def test_serve_two_mars_replicas_on_ray(tmp_path: Path) -> None:
    token = uuid.uuid4().hex
    t0 = time.monotonic()
    proc, log, url, stream, ray_dir = start_serve(tmp_path, token)
    placement: dict[str, str] = {}
    try:
        wait_until(lambda: "gateway listening on" in log.read_text(errors="replace"), 1500,
                   "the serve command to come up", proc, log)
        t_ready = time.monotonic()
        with httpx.Client(base_url=url, timeout=120) as client:
            placement = run_phases(client, log)
        t_phases = time.monotonic()
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)  # the command only: Ray's processes share its group
        try:
            rc = proc.wait(timeout=120)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            rc = None
        time.sleep(1.0)
        left = owned_pids(token)
        for pid in left:
            os.kill(pid, signal.SIGKILL)
        shutil.rmtree(ray_dir, ignore_errors=True)
    print(f"\n  serve: ready {t_ready - t0:.0f} s, phases {t_phases - t_ready:.0f} s, "
          f"shutdown {time.monotonic() - t_phases:.0f} s")
    assert rc == 0, _tail(log)
    assert not left, f"processes of the serve command left after shutdown (killed now): {left}"
    victim = placement.pop("victim")
    check_stream(stream, placement, victim)


def run_phases(client: httpx.Client, log: Path) -> dict[str, str]:
    """The phases of the module docstring; returns each session's replica before the kill."""
    PLACEMENT: dict[str, str] = {}  # noqa: N806
    def state() -> dict[str, Any]:
        return client.get("/mars/v1/state", headers=ADMIN).json()

    agents = [Agent(client, f"s{i}") for i in range(6)]
    # 1. Admission: four sessions fill the window; the fifth waits until one ends.
    for agent in agents[:4]:
        agent.step()
    waiter = Worker(agents[4].step)
    wait_until(lambda: state()["num_waiting"] == 1, 30, "the 5th session waiting for a slot")
    time.sleep(0.5)
    assert waiter.is_alive() and agents[4].turn == 0, "the 5th session ran past a full window"
    agents[0].tool()
    agents[0].step()
    agents[0].end()  # frees a slot: the waiting session is admitted
    waiter.result()
    assert agents[4].turn == 1
    # Sessions s1..s5 to two turns each, with tool calls; s5 waits for a slot until s1 or s2 ends.
    def run(agent: Agent, num_turns: int) -> None:
        while agent.turn < num_turns:
            if agent.turn:
                agent.tool()
            agent.step()
    threads = [Worker(run, a, 2) for a in agents[1:]]
    for a in agents[1:3]:
        wait_until(lambda a=a: a.turn >= 2 or threads[0].error or threads[1].error, 120,
                   f"{a.session}'s second turn")
        a.tool()
    for t in threads[:2]:
        t.result()
    # 2. Stickiness: every turn of a session on one replica; both replicas used.
    for a in agents[:3]:
        assert len(set(a.replicas)) == 1, (a.session, a.replicas)
        PLACEMENT[a.session] = a.replicas[0]
    agents[1].end()
    agents[2].end()
    for t in threads[2:]:
        t.result()
    for a in agents[3:]:
        assert len(set(a.replicas)) == 1, (a.session, a.replicas)
        PLACEMENT[a.session] = a.replicas[0]
    assert set(PLACEMENT.values()) == {"engine-0", "engine-1"}, PLACEMENT
    # 3. Kill the vLLM server of the replica holding s3 (s3, s4, s5 are live, between turns).
    victim = PLACEMENT["s3"]
    index = int(victim.rsplit("-", 1)[1])
    st = state()
    port = int(st["replicas"][index]["url"].rsplit(":", 1)[1])
    os.killpg(vllm_pgid(port), signal.SIGKILL)
    for a in agents[3:]:  # the victim's sessions move on; the others stay
        a.tool()
        served = a.step()
        assert served != victim, (a.session, a.replicas)
        assert PLACEMENT[a.session] == victim or served == PLACEMENT[a.session], a.replicas
    # Ray Serve replaces the replica; the gateway polls the new server and takes it back.
    # A new Ray worker, then a new vLLM server: ~1 min on an idle 2-core machine, minutes when
    # it is shared; the generous bound keeps a busy CI runner from failing (it returns at once).
    wait_until(lambda: (r := state()["replicas"][index])["healthy"] and r["restarts"] >= 1, 600,
               f"{victim} replaced by Ray and healthy again", log=log)
    fresh = Agent(client, "s6")
    for a in agents[3:5]:
        a.end()
    assert fresh.step() == victim, "a new session goes to the least loaded (restarted) replica"
    fresh.tool()
    fresh.step()
    # 4. Everything ends: nothing held by the gateway.
    for a in (agents[5], fresh):
        a.end()
    wait_until(lambda: state()["num_admitted"] == 0, 30, "every slot back")
    st = state()
    assert st["num_waiting"] == 0 and st["num_in_flight"] == 0 and not st["sessions"], st
    assert [r["sessions"] for r in st["replicas"]] == [0, 0], st["replicas"]
    # No block held on either engine: vLLM's own KV gauge (/metrics, polled every 0.2 s; retained
    # blocks are referenced, so they count) is back to 0 once the session_ends are applied.
    wait_until(lambda: [r["kv_usage"] for r in state()["replicas"]] == [0.0, 0.0], 60,
               "both engines' KV usage back to 0 (no block used or retained)")
    PLACEMENT["s6"] = fresh.replicas[0]
    PLACEMENT["victim"] = victim
    time.sleep(1.5)  # the engines' last steps reach the stream (polled every 0.25 s)
    return PLACEMENT


def check_stream(stream: Path, placement: dict[str, str], victim: str) -> None:
    """CPU-plane events reached the replica holding each session; every KV retention ended."""
    events = list(iter_events(stream))
    assert {"engine:0", "engine:1"} <= {e.source for e in events}
    killed = f"engine:{victim.rsplit('-', 1)[1]}"
    # Ray's replacement of the killed replica is in the stream, not only in the log.
    assert any(e.kind == "replica_replaced" and e.replica == victim for e in events), victim
    for session, replica in placement.items():
        holder = f"engine:{replica.rsplit('-', 1)[1]}"
        mine = [e for e in events if e.session_id == session
                and e.kind in ("kv_retained", "kv_released")]
        if holder == killed and session != "s6":  # moved: its KV died with the old server
            continue
        assert {e.source for e in mine} == {holder}, (session, holder, mine)
        if session in ("s0", "s1", "s2"):  # first turns on each engine: cold-start TTL (60 s)
            # tool_start reached the holder: its scheduler re-decided the retained KV's TTL.
            # (Later sessions' KV may be retained for less than the trip of their tool_start,
            # by the value model, and expire first.)
            assert any(e.reason.startswith("tool_start") for e in mine), (session, mine)
        # Nothing still pinned: the last retention event of the session is a release, and
        # session_end (a CPU-plane event) released it unless a tool_start cut it before.
        assert mine[-1].kind == "kv_released", (session, mine[-1])
