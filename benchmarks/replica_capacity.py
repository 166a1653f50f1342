"""Capacity at SLO per GPU of every routing policy on N replicas (issue 32 items 5-6, "Done when").

For each N and seed: one ``compare --replicas N --router R --capacity`` per router (``mars`` in
every engine, the whole GPU's KV, full sessions unless trimming flags are passed through), the
pooled-KV bound among them (``--router pooled-kv``: the N engines share one KV block pool, so a
prefix computed on one replica is a hit on every other and no placement can beat it on KV), and the
looser bound ``unbounded-kv`` (KV for every session's whole context on every replica, routed by
``least-sessions``). Then, at 0.9x the best anchor router's capacity, one run per router (the
pooled bound included) for mean and P95 E2E. Prints, per N and seed, each router's capacity per
GPU (``kind``: anchor, ours or bound) and its ratio to the best anchor, to the pooled bound, to the
unbounded one and to sticky-hash, and the mean / P95 at 0.9x; writes
``<out>/replica_capacity.parquet``.

The full grid (issue 32: H100 SXM, N = 4 and 8, seeds 0 and 1)::

    .venv/bin/python benchmarks/replica_capacity.py --out runs/replicas --replicas 4,8 --seeds 0,1

``--kv-transfer-gbps G`` adds a row ``<router>+kv`` for each router that moves sessions off a live
replica (``mars-placement`` at its re-homes, ``llm-d`` and ``prefix-affinity`` per turn), run with
``compare --kv-transfer-gbps G`` (a moved session's KV goes along instead of being re-prefilled);
the sticky routers never move a session, so their rows stand for both deployments.

Anything after ``--`` goes to every ``compare`` call (e.g. ``-- --sessions-per-replica 10
--max-turns 30 --kv-scale auto`` for a reduced run, labelled TRIMMED). ``--dry-run`` prints the
commands only.
"""

from __future__ import annotations

import argparse
import math
import shlex
import subprocess
import sys
import time
from pathlib import Path

import pandas as pd

from mars_openhands.cli_signals import run_child, sigterm_exits
from mars_openhands.policy.placement import ROUTING_POLICIES

ANCHORS = ("sticky-hash", "least-sessions", "llm-d", "prefix-affinity", "thunderagent")
"""The anchor routers (mars_openhands/policy/placement.py names their sources)."""
OURS = "mars-placement"
POOLED = "pooled-kv"
"""The pooled-KV bound: a ``--router`` whose replicas share one KV pool (simulator only)."""
BOUND = "unbounded-kv"
"""The loose upper bound: compare's unbounded-KV reference, on every replica."""


KV_SUFFIX = "+kv"
"""A row's name suffix for a router run with ``--kv-transfer-gbps``."""


def _router(row: str) -> str:
    """The ``--router`` of a row (``llm-d+kv`` -> ``llm-d``)."""
    return row.removesuffix(KV_SUFFIX)


def _kind(row: str) -> str:
    router = _router(row)
    return "bound" if router in (POOLED, BOUND) else "ours" if router == OURS else "anchor"


def _rows(routers: list[str], kv_transfer_gbps: float | None) -> list[str]:
    """The grid's rows: every router, then ``<router>+kv`` for those that move sessions off a live
    replica (per turn, or re-homing; not the pooled bound) when a KV transfer is given. Pure."""
    moving = [r for r in routers if kv_transfer_gbps and r in ROUTING_POLICIES
              and not ROUTING_POLICIES[r].pools_kv
              and (not ROUTING_POLICIES[r].is_sticky or ROUTING_POLICIES[r].rehomes)]
    return [*routers, *(r + KV_SUFFIX for r in moving)]


def _compare(args: argparse.Namespace, out: Path, n: int, seed: int, row: str,
             policy: str, extra: list[str], rate: float | None = None) -> list[str]:
    router = _router(row)
    if row.endswith(KV_SUFFIX):
        extra = ["--kv-transfer-gbps", f"{args.kv_transfer_gbps:g}", *extra]
    cmd = [sys.executable, "-m", "eval.compare", "--replicas", str(n), "--router", router,
           "--policies", policy, "--gpu", args.gpu, "--seed", str(seed), "--no-reference",
           "--out", str(out)]
    if args.jobs:
        cmd += ["--jobs", str(args.jobs)]
    if rate is None:
        cmd += ["--capacity", "--loads", "1", "--base-rate", str(args.start_rate)]
    else:
        cmd += ["--absolute-rates", "--loads", f"{rate:.6g}"]
    return cmd + extra


def _run(cmd: list[str], dry_run: bool, done: bool = False) -> None:
    print(("# done: " if done else "$ ") + shlex.join(cmd), flush=True)
    if not dry_run and not done:
        t0 = time.monotonic()
        run_child(cmd, stdout=subprocess.DEVNULL)  # killed, this script ends it first
        print(f"  ({time.monotonic() - t0:.0f} s)", flush=True)


def _capacity(out: Path, label: str) -> float:
    path = out / "capacity.parquet"
    if not path.exists():
        return math.nan
    table = pd.read_parquet(path)
    rows = table.loc[table["policy"] == label, "capacity_per_s"]
    return float(rows.max()) if len(rows) else math.nan


def _e2e(out: Path) -> tuple[float, float]:
    path = out / "results.parquet"
    if not path.exists():
        return math.nan, math.nan
    row = pd.read_parquet(path).iloc[0]
    return float(row["e2e_mean_s"]), float(row["e2e_p95_s"])


def main() -> int:
    """Run (or print) the grid; returns 0."""
    argv = sys.argv[1:]
    extra = argv[argv.index("--") + 1:] if "--" in argv else []
    argv = argv[:argv.index("--")] if "--" in argv else argv
    p = argparse.ArgumentParser(
        usage="%(prog)s [options] [-- COMPARE FLAGS]", description=__doc__.split("\n\n")[0],
        epilog="Anything after -- goes to every compare call, e.g. -- --knee-tolerance 1.05 "
               "--knee-step 1.05 (a fine ladder from a --start-rate near the knee), or "
               "-- --sessions-per-replica 10 --max-turns 30 --kv-scale auto (a reduced run, labelled "
               "TRIMMED). Rates are sessions/s per GPU.")
    p.add_argument("--out", default="runs/replicas")
    p.add_argument("--replicas", default="4,8", help="comma-separated N (default 4,8)")
    p.add_argument("--seeds", default="0,1", help="comma-separated seeds (default 0,1)")
    p.add_argument("--routers", default=",".join((*ANCHORS, OURS, POOLED, BOUND)),
                   help="comma-separated --router names (default: the anchors, mars-placement, "
                        "the pooled-kv bound and unbounded-kv; its search is the slowest, as its "
                        "probes run at several times the others' rates)")
    p.add_argument("--gpu", default="h100_sxm")
    p.add_argument("--start-rate", type=float, default=0.01,
                   help="per-GPU rate (sessions/s) the capacity searches start from (default 0.01, "
                        "above one H100's knee of ~0.0087 with FCFS; full-length N = 4 routers "
                        "land at 0.013-0.016)")
    p.add_argument("--jobs", type=int, default=None)
    p.add_argument("--dry-run", action="store_true")
    p.add_argument("--skip-done", action="store_true",
                   help="skip a compare whose --out already holds its results (resume a grid)")
    p.add_argument("--no-e2e", action="store_true",
                   help="capacities only: no runs at 0.9x the best anchor's capacity")
    p.add_argument("--kv-transfer-gbps", type=float, default=None, metavar="G",
                   help="also run each router that moves sessions (mars-placement, llm-d, "
                        "prefix-affinity) with compare --kv-transfer-gbps G, as the row <router>+kv")
    args = p.parse_args(argv)
    if args.kv_transfer_gbps is not None and not args.kv_transfer_gbps > 0:
        p.error(f"--kv-transfer-gbps must be > 0 GB/s, got {args.kv_transfer_gbps:g}")
    routers = _rows([r for r in args.routers.split(",") if r != BOUND], args.kv_transfer_gbps)
    with_bound = BOUND in args.routers.split(",")
    rows = []
    for n in (int(x) for x in args.replicas.split(",")):
        for seed in (int(x) for x in args.seeds.split(",")):
            base = Path(args.out) / f"n{n}_seed{seed}"
            for router in routers:
                _run(_compare(args, base / router, n, seed, router, "mars", extra), args.dry_run,
                     args.skip_done and (base / router / "capacity.parquet").exists())
            if with_bound:
                _run(_compare(args, base / BOUND, n, seed, "least-sessions", BOUND, extra),
                     args.dry_run, args.skip_done and (base / BOUND / "capacity.parquet").exists())
            caps = {r: _capacity(base / r, "mars") for r in routers}
            caps[BOUND] = _capacity(base / BOUND, BOUND)
            anchors = {r: c for r, c in caps.items() if _router(r) in ANCHORS and not math.isnan(c)}
            best = max(anchors, key=anchors.__getitem__) if anchors else None
            rate = 0.9 * anchors[best] if best else args.start_rate
            for router in routers if not args.no_e2e else ():
                _run(_compare(args, base / f"{router}@0.9", n, seed, router, "mars", extra, rate),
                     args.dry_run, args.skip_done and (base / f"{router}@0.9" / "results.parquet").exists())
            for router in [*routers, *([BOUND] if with_bound else [])]:
                cap = caps[router]
                mean, p95 = _e2e(base / f"{router}@0.9") if router != BOUND else (math.nan, math.nan)
                rows.append({"replicas": n, "seed": seed, "router": router, "kind": _kind(router),
                             "capacity_per_gpu": cap,
                             "vs_best_anchor": cap / anchors[best] if best else math.nan,
                             "best_anchor": best, "vs_pooled": cap / caps.get(POOLED, math.nan),
                             "vs_unbounded": cap / caps[BOUND],
                             "vs_sticky_hash": cap / caps.get("sticky-hash", math.nan),
                             "e2e_mean_s_at_0.9": mean, "e2e_p95_s_at_0.9": p95})
    if args.dry_run:
        return 0
    table = pd.DataFrame(rows)
    Path(args.out).mkdir(parents=True, exist_ok=True)
    table.to_parquet(Path(args.out) / "replica_capacity.parquet", index=False)
    with pd.option_context("display.width", 200, "display.max_columns", 20):
        print(table.to_string(index=False, float_format=lambda v: f"{v:.4g}"))
    return 0


if __name__ == "__main__":
    with sigterm_exits():  # SIGTERM unwinds: the running compare gets it, then its tree ends
        sys.exit(main())
