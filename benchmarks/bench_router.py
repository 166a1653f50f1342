"""Routing decisions per second: the session router + admission alone (no engines), against Ray's default.

One scenario (issue 32): agent sessions of several turns each arrive at a deployment of N replicas.
Per request, *ours* is what ``mars-openhands serve`` does before sending: the control plane's
admission (open the session, take a slot, start and end the turn: ``ControlPlane``) and the choice
of replica (:class:`mars_openhands.serve.router.SessionRequestRouter.choose_replicas`, the gateway's
``Router.route``: affinity, then least loaded). *pow2* is Ray Serve's built-in
``PowerOfTwoChoicesRequestRouter.choose_replicas`` on the same replicas, in the same run (its queue
length probes are RPCs to replicas, left out here as the engines are). The ratio ours / pow2 says
what session routing costs over Ray's default choice; ``--actor`` also measures the control plane
behind a Ray actor (one call per decision), the bound of a deployment-scoped admission actor.

Rates are per wall-clock second and per CPU second of the process (what one core sustains when
the machine is shared: the wall rate then measures the neighbours). Seeded, with a warm-up; one
line per replica count, and a row per count appended to
``benchmarks/results/bench_router.parquet`` (git sha, machine, parameters, median and p99 of the
per-batch rates).

    .venv/bin/python benchmarks/bench_router.py                 # 2, 10, 100, 1000 replicas
    .venv/bin/python benchmarks/bench_router.py --smoke         # CI size
"""

from __future__ import annotations

import argparse
import asyncio
import os
import platform
import random
import statistics
import subprocess
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

REPO_ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO_ROOT))

from ray.serve._private.common import (  # noqa: E402
    DeploymentHandleSource,
    DeploymentID,
    ReplicaID,
    RequestMetadata,
)
from ray.serve._private.request_router.pow_2_router import (  # noqa: E402
    PowerOfTwoChoicesRequestRouter,
)
from ray.serve.request_router import PendingRequest  # noqa: E402

from mars_openhands.control.config import GatewayConfig, ReplicaConfig  # noqa: E402
from mars_openhands.control.plane import ControlPlane  # noqa: E402
from mars_openhands.serve.router import SessionRequestRouter  # noqa: E402

RESULTS = REPO_ROOT / "benchmarks" / "results" / "bench_router.parquet"
TARGET_DECISIONS_PER_S = 1_000


class FakeReplica:
    """What a ``RequestRouter`` reads of a running replica (no actor behind it)."""

    def __init__(self, index: int, deployment_id: DeploymentID) -> None:
        self.replica_id = ReplicaID(f"r{index}", deployment_id)
        self.node_id = f"node-{index % 8}"
        self.availability_zone = None
        self.multiplexed_model_ids: set[str] = set()
        self.routing_stats = {"kv_usage": (index % 10) / 20}
        self.max_ongoing_requests = 64
        self.is_cross_language = False

    async def get_queue_len(self, *, deadline_s: float) -> int:
        """Ray's queue-length probe (not part of ``choose_replicas``): always empty."""
        return 0


@dataclass
class Cell:
    num_replicas: int
    num_sessions: int
    num_turns: int
    ours_per_s: float
    """Median over batches of decisions per wall-clock second."""
    ours_p99_batch_per_s: float
    pow2_per_s: float
    ratio: float
    """ours / pow2, wall clock (same process, same run)."""
    ours_per_cpu_s: float
    """Median of decisions per CPU second of this process: what one core sustains, whatever
    else shares the machine."""
    pow2_per_cpu_s: float
    plane_actor_per_s: float | None
    num_on_one_replica: int
    """Sessions whose turns all went to one replica (ours): all of them."""


def _router(cls: type, deployment_id: DeploymentID, replicas: list[FakeReplica]) -> Any:
    router = cls(deployment_id=deployment_id, handle_source=DeploymentHandleSource.UNKNOWN,
                 self_actor_id="bench", use_replica_queue_len_cache=False)
    router.update_replicas(replicas)
    return router


def _requests(num_sessions: int, num_turns: int, seed: int) -> list[tuple[str, int]]:
    """(session id, turn) in an interleaved order: each session's turns in order."""
    rng = random.Random(seed)
    left = {f"s{i}": 0 for i in range(num_sessions)}
    order = []
    while left:
        sid = rng.choice(list(left)) if len(left) < 64 else f"s{rng.randrange(num_sessions)}"
        if sid not in left:
            continue
        order.append((sid, left[sid]))
        left[sid] += 1
        if left[sid] == num_turns:
            del left[sid]
    return order


def _pending(session_id: str, i: int) -> PendingRequest:
    meta = RequestMetadata(request_id=str(i), internal_request_id=str(i), session_id=session_id)
    return PendingRequest(args=[], kwargs={}, metadata=meta, future=None)  # type: ignore[arg-type]


def _plane(num_sessions: int) -> ControlPlane:
    config = GatewayConfig(replicas=[ReplicaConfig(url="http://127.0.0.1:1")],
                           admission={"window_max": num_sessions + 1, "window_init": num_sessions + 1,
                                      "window_min": 1})
    return ControlPlane(config)


def admit(plane: ControlPlane, session_id: str, is_last: bool) -> None:
    """The control plane's calls for one request (admission, turn, end)."""
    session = plane.open_session(session_id)
    plane.begin_request(session)
    assert plane.request_slot(session, 512), "the window holds every session"
    turn, _ = plane.start_turn(session)
    plane.end_turn(session, turn, True)
    plane.end_request(session)
    if is_last:
        plane.end_session(session)


async def run_ours(router: SessionRequestRouter, replicas: list[FakeReplica], plane: ControlPlane,
                   requests: list[tuple[str, int]], num_turns: int,
                   placement: dict[str, set[str]]) -> tuple[float, float]:
    """(decisions per wall second, per CPU second of this process)."""
    t0, c0 = time.perf_counter_ns(), time.process_time_ns()
    for i, (sid, turn) in enumerate(requests):
        admit(plane, sid, turn == num_turns - 1)
        chosen = await router.choose_replicas(replicas, _pending(sid, i))
        placement.setdefault(sid, set()).add(chosen[0][0].replica_id.unique_id)
    return _rates(len(requests), t0, c0)


def _rates(num: int, t0_ns: int, c0_ns: int) -> tuple[float, float]:
    wall_s = (time.perf_counter_ns() - t0_ns) / 1e9
    cpu_s = max(1e-9, (time.process_time_ns() - c0_ns) / 1e9)
    return num / wall_s, num / cpu_s


async def run_pow2(router: Any, replicas: list[FakeReplica],
                   requests: list[tuple[str, int]]) -> tuple[float, float]:
    t0, c0 = time.perf_counter_ns(), time.process_time_ns()
    for i, (sid, _) in enumerate(requests):
        await router.choose_replicas(replicas, _pending(sid, i))
    return _rates(len(requests), t0, c0)


def run_actor(num_sessions: int, requests: list[tuple[str, int]], num_turns: int) -> float:
    """The control plane in a Ray actor: one call per decision, awaited one after another."""
    import ray

    @ray.remote(num_cpus=0)
    class Admission:
        def __init__(self) -> None:
            self.plane = _plane(num_sessions)

        def admit(self, session_id: str, is_last: bool) -> None:
            admit(self.plane, session_id, is_last)

    actor = Admission.remote()
    ray.get(actor.admit.remote("warm-up", True))
    t0 = time.perf_counter_ns()
    for sid, turn in requests:
        ray.get(actor.admit.remote(sid, turn == num_turns - 1))
    return len(requests) / ((time.perf_counter_ns() - t0) / 1e9)


async def measure(num_replicas: int, num_sessions: int, num_turns: int, num_batches: int,
                  seed: int, with_actor: bool) -> Cell:
    deployment_id = DeploymentID(name="engine", app_name="bench")
    replicas = [FakeReplica(i, deployment_id) for i in range(num_replicas)]
    pow2 = _router(PowerOfTwoChoicesRequestRouter, deployment_id, replicas)
    ours_rates, pow2_rates, ours_cpu, pow2_cpu = [], [], [], []
    placement: dict[str, set[str]] = {}
    for batch in range(num_batches + 1):  # batch 0 is the warm-up
        ours = _router(SessionRequestRouter, deployment_id, replicas)
        ours.initialize_state()
        requests = [(f"b{batch}-{sid}", turn)
                    for sid, turn in _requests(num_sessions, num_turns, seed + batch)]
        plane = _plane(num_sessions)
        rate_ours, cpu_ours = await run_ours(ours, replicas, plane, requests, num_turns, placement)
        rate_pow2, cpu_pow2 = await run_pow2(pow2, replicas, requests)
        if batch:
            ours_rates.append(rate_ours)
            pow2_rates.append(rate_pow2)
            ours_cpu.append(cpu_ours)
            pow2_cpu.append(cpu_pow2)
    actor_rate = None
    if with_actor:
        actor_rate = run_actor(num_sessions, _requests(num_sessions, num_turns, seed), num_turns)
    ours_med, pow2_med = statistics.median(ours_rates), statistics.median(pow2_rates)
    return Cell(num_replicas, num_sessions, num_turns, ours_med,
                sorted(ours_rates)[max(0, int(0.01 * len(ours_rates)))], pow2_med,
                ours_med / pow2_med, statistics.median(ours_cpu), statistics.median(pow2_cpu),
                actor_rate, sum(len(v) == 1 for v in placement.values()))


def append_parquet(cells: list[Cell], args: argparse.Namespace) -> None:
    try:
        import pandas as pd
    except ImportError:
        return
    sha = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO_ROOT,
                         capture_output=True, text=True).stdout.strip()
    from importlib.metadata import version

    rows = [{**asdict(c), "git_sha": sha, "ray_version": version("ray"),
             "machine": platform.node(), "cpus": os.cpu_count(), "smoke": args.smoke,
             "seed": args.seed, "time": time.time()} for c in cells]
    frame = pd.DataFrame(rows)
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    if RESULTS.exists():
        frame = pd.concat([pd.read_parquet(RESULTS), frame], ignore_index=True)
    frame.to_parquet(RESULTS, index=False)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--replicas", default="2,10,100,1000",
                        help="comma-separated replica counts (default 2,10,100,1000)")
    parser.add_argument("--sessions", type=int, default=2000, help="sessions per batch")
    parser.add_argument("--turns", type=int, default=5, help="turns per session")
    parser.add_argument("--batches", type=int, default=5, help="measured batches (+1 warm-up)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--actor", action="store_true",
                        help="also time the control plane behind a Ray actor (starts Ray)")
    parser.add_argument("--smoke", action="store_true", help="tiny sizes (CI)")
    parser.add_argument("--no-record", action="store_true", help="do not append the Parquet rows")
    args = parser.parse_args(argv)
    if args.smoke:
        args.replicas, args.sessions, args.turns, args.batches = "2,10", 100, 3, 1
    cells = []
    if args.actor:
        import ray

        ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    try:
        for n in (int(x) for x in args.replicas.split(",")):
            cell = asyncio.run(measure(n, args.sessions, args.turns, args.batches, args.seed,
                                       args.actor))
            cells.append(cell)
            actor = (f", plane in a Ray actor {cell.plane_actor_per_s:,.0f}/s"
                     if cell.plane_actor_per_s is not None else "")
            print(f"replicas {n:5d}: ours (admission + session router) {cell.ours_per_s:,.0f} "
                  f"decisions/s, pow2 {cell.pow2_per_s:,.0f}/s, ratio {cell.ratio:.2f}; per CPU "
                  f"second: ours {cell.ours_per_cpu_s:,.0f}, pow2 {cell.pow2_per_cpu_s:,.0f}{actor}; "
                  f"sessions on one replica {cell.num_on_one_replica}/"
                  f"{args.sessions * (args.batches + 1)}", flush=True)
    finally:
        if args.actor:
            import ray

            ray.shutdown()
    if not args.no_record:
        append_parquet(cells, args)
    worst = min(c.ours_per_s for c in cells)
    worst_cpu = min(c.ours_per_cpu_s for c in cells)
    print(f"slowest: {worst:,.0f} decisions/s, {worst_cpu:,.0f} per CPU second "
          f"(target >= {TARGET_DECISIONS_PER_S:,})")
    return 0 if worst >= TARGET_DECISIONS_PER_S else 1


if __name__ == "__main__":
    sys.exit(main())
