"""Soak: many sessions through the gateway with dead clients and a replica crash (issue 16, "Soak").

Scenario (seeded): ``--sessions`` agent sessions (default 200), ``--concurrency`` at a time, through
one gateway (admission window 8) onto two replicas. Each session sends ``session_start``, 2-4 turns
(chat requests, every other one streamed), a tool call between turns (``tool_start`` / sleep /
``tool_end``) and ``session_end``. Faults, drawn per session:

* **kill** (12 %): the agent dies in the middle of a tool call: no ``tool_end``, no ``session_end``
  (what SIGKILL does to an OpenHands runner);
* **disconnect** (13 %): the client hangs up on one of its requests before the first byte (its
  read timeout is shorter than the replica's answer) and is never heard from again;
* one replica is SIGKILLed when 40 % of the sessions have finished and restarted 1 s later.

Replicas: the fake vLLM OpenAI servers of :mod:`mars_openhands.control.fake_engine` (answer after
``--engine-delay-ms``), not emulated-GPU vLLM: the machine rule is one vLLM server at a time, and
two are needed for a replica to die under load; so this soak checks the gateway's state, not the
engines' KV (the engine-side release of retained KV on abort and expiry is tested on the real
scheduler: tests/unit/engine/test_mars_retention.py).

Checked at the end, after the bounds ran out (tool bound 1.5 s, idle timeout 1 s): every session
completed or ended with a clear error (an HTTP error naming why) or is one of the injected deaths;
0 admission slots held, 0 sessions waiting or live, 0 tool calls in flight; stream consistency:
every ``tool_start`` closed by a ``tool_end`` (the agent's, or the gateway's ``"interrupted"``),
every disconnect the gateway saw recorded as an ``aborted`` event, and every request the clients
sent counted by the gateway (answered, or given up by its client: a hang-up after the last byte
was sent is an answer the client did not wait for).

Usage::

    .venv/bin/python benchmarks/bench_soak.py               # 200 sessions (~1 min)
    .venv/bin/python benchmarks/bench_soak.py --smoke       # 24 sessions, CI size

Prints one line of figures and appends a row to ``benchmarks/results/bench_soak.parquet``.
Exit status 1 if any check fails.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import json
import random
import sys
import threading
import time
from collections import Counter
from pathlib import Path
from typing import Any

import httpx

REPO_ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO_ROOT))

from mars_openhands.control.config import GatewayConfig, ReplicaConfig  # noqa: E402
from mars_openhands.control.fake_engine import FakeEngineProcess  # noqa: E402
from mars_openhands.control.server import GatewayServer  # noqa: E402
from mars_openhands.stream.transport import ListSink  # noqa: E402

RESULTS = REPO_ROOT / "benchmarks" / "results" / "bench_soak.parquet"
TOOLS = [{"type": "function", "function": {"name": "terminal", "parameters": {
    "type": "object", "properties": {"command": {"type": "string"}}}}}]


def _event(kind: str, sid: str, **extra: Any) -> dict[str, Any]:
    return {"kind": kind, "t_mono_ns": time.monotonic_ns(), "t_wall": "2026-01-01T00:00:00Z",
            "source": "agent", "session_id": sid, **extra}


def run_session(index: int, url: str, seed: int, delay_s: float, counts: Counter,
                lock: threading.Lock) -> str:
    """One agent session; returns its outcome: completed, error, killed or disconnected."""
    rng = random.Random(seed * 100_003 + index)
    sid = f"soak-{seed}-{index}"
    fate = rng.choices(["ok", "kill", "disconnect"], weights=[75, 12, 13])[0]
    num_turns = rng.randint(2, 4)
    fatal_turn = rng.randrange(num_turns)
    outcome = "completed"

    def note(key: str) -> None:
        with lock:
            counts[key] += 1

    with httpx.Client(base_url=url, timeout=30.0) as client:
        client.post("/mars/v1/events", json=_event("session_start", sid))
        for turn in range(num_turns):
            body = {"model": "fake", "messages": [{"role": "user", "content": f"turn {turn}"}],
                    "tools": TOOLS, "stream": turn % 2 == 1, "mars_session": sid}
            if fate == "disconnect" and turn == fatal_turn:
                try:
                    client.post("/v1/chat/completions", json=body,
                                timeout=httpx.Timeout(5.0, read=delay_s / 4))
                    note("responses")  # answered faster than the client gave up
                except httpx.ReadTimeout:
                    note("client_disconnects")
                return "disconnected"
            r = client.post("/v1/chat/completions", json=body)
            note("responses")
            if r.status_code != 200:
                note(f"http_{r.status_code}")
                message = r.json().get("error", {}).get("message", "")
                assert message, f"HTTP {r.status_code} without a message: {r.text[:200]}"
                outcome = "error"
                break
            if turn == num_turns - 1:
                break
            call_id = f"{sid}-c{turn}"
            client.post("/mars/v1/events", json=_event("tool_start", sid, tool_name="terminal",
                                                       tool_call_id=call_id))
            time.sleep(rng.uniform(0.005, 0.05))
            if fate == "kill" and turn == fatal_turn:
                return "killed"
            client.post("/mars/v1/events", json=_event(
                "tool_end", sid, tool_name="terminal", tool_call_id=call_id, duration_s=0.02))
        client.post("/mars/v1/events", json=_event(
            "session_end", sid, status="ok" if outcome == "completed" else "error"))
    return outcome


def _metric(text: str, name: str) -> float:
    for line in text.splitlines():
        if line.startswith(name + " "):
            return float(line.split()[1])
    raise KeyError(name)


def check_stream(events: list[Any], num_gateway_disconnects: int) -> dict[str, int]:
    """Stream consistency: every tool_start closed; every disconnect the gateway saw recorded as
    an ``aborted`` event (a client that hangs up after the last byte was answered: nothing to
    record)."""
    starts = {e.tool_call_id for e in events if e.kind == "tool_start"}
    ends = {e.tool_call_id for e in events if e.kind == "tool_end"}
    aborted = [e for e in events if e.kind == "aborted"]
    gone = sum(1 for e in aborted if e.reason == "client_disconnect")
    return {"tool_starts": len(starts), "unclosed_tool_starts": len(starts - ends),
            "interrupted": sum(1 for e in events if e.kind == "tool_end"
                               and e.status == "interrupted"),
            "interrupted_but_alive": len(
                {e.tool_call_id for e in events if e.kind == "tool_end" and e.status == "interrupted"}
                & {e.tool_call_id for e in events if e.kind == "tool_end" and e.source == "agent"}),
            "aborted_events": len(aborted),
            "unrecorded_disconnects": num_gateway_disconnects - gone}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--sessions", type=int, default=200)
    parser.add_argument("--concurrency", type=int, default=16)
    parser.add_argument("--engine-delay-ms", type=float, default=40.0)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--smoke", action="store_true", help="24 sessions (CI size)")
    parser.add_argument("--no-parquet", action="store_true")
    args = parser.parse_args()
    if args.smoke:
        args.sessions, args.concurrency = 24, 8
    delay_s = args.engine_delay_ms / 1000
    t0 = time.monotonic()
    replicas = [FakeEngineProcess(name=f"r{i}").start() for i in range(2)]
    for fake in replicas:
        fake.configure(delay_s=delay_s, num_chunks=3, chunk_delay_s=0.002)
    config = GatewayConfig(
        port=0, replicas=tuple(ReplicaConfig(url=f.url) for f in replicas), poll_interval_s=0.1,
        admission={"window_max": 8, "window_init": 8, "window_min": 2, "update_interval_s": 0.05},
        num_tool_workers=16, session_idle_timeout_s=1.0, tool_call_timeout_s=1.5,
        upstream_connect_timeout_s=1.0, admission_wait_timeout_s=60.0)
    sink = ListSink()
    server = GatewayServer(config, sink).start()
    counts: Counter = Counter()
    lock = threading.Lock()
    outcomes: Counter = Counter()
    num_replica_kills = 0
    try:
        with concurrent.futures.ThreadPoolExecutor(args.concurrency) as pool:
            futures = [pool.submit(run_session, i, server.url, args.seed, delay_s, counts, lock)
                       for i in range(args.sessions)]
            done = 0
            for future in concurrent.futures.as_completed(futures):
                outcomes[future.result()] += 1
                done += 1
                if done == int(0.4 * args.sessions) and num_replica_kills == 0:
                    victim = replicas[1]
                    victim.kill()
                    num_replica_kills += 1
                    restarted = FakeEngineProcess(port=victim.port, name="r1-restarted")
                    replicas.append(restarted)
                    restart = threading.Timer(1.0, restarted.start)
                    restart.start()
        deadline = time.monotonic() + 10.0
        while time.monotonic() < deadline:
            state = httpx.get(f"{server.url}/mars/v1/state", timeout=5).json()
            metrics = httpx.get(f"{server.url}/metrics", timeout=5).text
            if (state["num_admitted"] == 0 and not state["sessions"]
                    and _metric(metrics, "mars_tool_calls_in_flight") == 0):
                break
            time.sleep(0.2)
        metrics = httpx.get(f"{server.url}/metrics", timeout=5).text
        state = httpx.get(f"{server.url}/mars/v1/state", timeout=5).json()
    finally:
        server.stop()
        if num_replica_kills:
            restart.join()
        for fake in replicas:
            fake.kill()
    num_requests = int(_metric(metrics, "mars_requests_total"))
    num_gone = int(_metric(metrics, "mars_client_disconnects_total"))
    stream = check_stream(list(sink.events), num_gone)
    client_sent = counts["responses"] + counts["client_disconnects"]
    row = {
        "sessions": args.sessions, "concurrency": args.concurrency, "seed": args.seed,
        "completed": outcomes["completed"], "errors": outcomes["error"],
        "killed": outcomes["killed"], "disconnected": outcomes["disconnected"],
        "replica_kills": num_replica_kills, "requests": num_requests,
        "requests_sent": client_sent, "client_timeouts": counts["client_disconnects"],
        "client_disconnects_seen": num_gone,
        "leaked_slots": state["num_admitted"], "waiting": state["num_waiting"],
        "live_sessions": len(state["sessions"]),
        "tool_calls_in_flight": int(_metric(metrics, "mars_tool_calls_in_flight")),
        "idle_releases": int(_metric(metrics, "mars_idle_releases_total")),
        "client_gone_releases": int(_metric(metrics, "mars_client_gone_releases_total")),
        **stream, "http_errors": json.dumps({k: v for k, v in counts.items() if k.startswith("http_")}),
        "wall_s": round(time.monotonic() - t0, 1),
    }
    ok = (row["leaked_slots"] == row["waiting"] == row["live_sessions"] == 0
          and row["tool_calls_in_flight"] == 0 and row["unclosed_tool_starts"] == 0
          and row["unrecorded_disconnects"] == 0 and client_sent == num_requests
          and sum(outcomes.values()) == args.sessions)
    print("soak: " + ", ".join(f"{k} {v}" for k, v in row.items()) + f"; {'OK' if ok else 'FAILED'}")
    if not args.no_parquet:
        import pandas as pd

        frame = pd.DataFrame([row])
        if RESULTS.exists():
            frame = pd.concat([pd.read_parquet(RESULTS), frame], ignore_index=True)
        RESULTS.parent.mkdir(parents=True, exist_ok=True)
        frame.to_parquet(RESULTS, index=False)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
