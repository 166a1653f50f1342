"""Async-scheduling property of every shipped scheduler, over many seeds (issue 33, item 1).

The unit test ``tests/unit/engine/test_async_scheduling.py`` runs 1,000 random workloads per
policy; this runs as many as asked (default 10,000), seeds ``--start`` onwards, for each policy
of ``eval.policies.POLICIES`` and stock vLLM's ``AsyncScheduler`` (``vllm-stock``). Each seed is a
small multi-turn agent workload under vLLM's async-scheduling engine loop with preemption by KV
pressure, aborts at any point, stop tokens and ``max_tokens`` on in-flight tokens, invalid
extras, tool events and session ends; the property (no scheduler call raises, every request
finishes exactly once, nothing is left) is in ``tests/unit/engine/async_property.py``.

Usage::

    nice .venv/bin/python benchmarks/bench_async_property.py                 # 10,000 seeds each
    nice .venv/bin/python benchmarks/bench_async_property.py --seeds 200 --policies mars fcfs
    nice .venv/bin/python benchmarks/bench_async_property.py --smoke         # 20 seeds each

Prints one line per policy (failures, ms per seed, steps, preemptions, requests stopped by a
token in flight at their preemption, requests finished while held outside vLLM's queues) and
the first failing seeds; appends a row per policy to
``benchmarks/results/bench_async_property.parquet``. Exit status 1 if any seed failed.
"""

from __future__ import annotations

import argparse
import platform
import subprocess
import sys
import time
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO_ROOT))

from vllm import __version__ as vllm_version  # noqa: E402

from tests.unit.engine.async_property import SeedResult, policy_names, run_seed  # noqa: E402


def _git_sha() -> str | None:
    try:
        out = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO_ROOT,
                             capture_output=True, text=True, check=False).stdout.strip()
    except OSError:
        return None
    return out or None


def _append_rows(rows: list[dict]) -> None:
    try:
        import pandas as pd
    except ImportError:
        return
    path = REPO_ROOT / "benchmarks" / "results" / "bench_async_property.parquet"
    path.parent.mkdir(parents=True, exist_ok=True)
    frame = pd.DataFrame(rows)
    if path.exists():
        frame = pd.concat([pd.read_parquet(path), frame], ignore_index=True)
    frame.to_parquet(path, index=False)


def run_policy(name: str, seeds: range) -> tuple[dict, list[SeedResult]]:
    """All ``seeds`` of one policy: (summary row, failures)."""
    totals = {"steps": 0, "preemptions": 0, "requests": 0, "aborts": 0, "finished_preempted": 0,
              "finished_held": 0}
    failures = []
    t0 = time.perf_counter()
    for seed in seeds:
        r = run_seed(name, seed)
        totals["steps"] += r.num_steps
        totals["preemptions"] += r.num_preemptions
        totals["requests"] += r.num_requests
        totals["aborts"] += r.num_aborts
        totals["finished_preempted"] += r.num_finished_preempted
        totals["finished_held"] += r.num_finished_held
        if r.error is not None:
            failures.append(r)
    elapsed = time.perf_counter() - t0
    row = {"bench": "bench_async_property", "policy": name, "seeds": len(seeds),
           "seed_start": seeds.start, "failures": len(failures),
           "ms_per_seed": 1e3 * elapsed / max(1, len(seeds)), **totals}
    return row, failures


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--seeds", type=int, default=10_000, help="seeds per policy")
    parser.add_argument("--start", type=int, default=0, help="first seed")
    parser.add_argument("--policies", nargs="+", default=None,
                        help=f"default: all ({' '.join(policy_names())})")
    parser.add_argument("--smoke", action="store_true", help="20 seeds per policy")
    args = parser.parse_args()
    names = args.policies or list(policy_names())
    unknown = [n for n in names if n not in policy_names()]
    if unknown:
        parser.error(f"unknown policies {unknown}; supported: {', '.join(policy_names())}")
    seeds = range(args.start, args.start + (20 if args.smoke else args.seeds))
    common = {"git_sha": _git_sha(), "vllm": vllm_version, "machine": platform.node()}
    rows, num_failed = [], 0
    for name in names:
        row, failures = run_policy(name, seeds)
        rows.append({**common, **row})
        num_failed += len(failures)
        print(f"{name}: {row['failures']}/{row['seeds']} seeds failed, {row['ms_per_seed']:.1f} ms/seed, "
              f"{row['steps']} steps, {row['requests']} requests, {row['preemptions']} preemptions, "
              f"{row['aborts']} aborts, {row['finished_preempted']} stopped by an in-flight token "
              f"after preemption, {row['finished_held']} finished while held", flush=True)
        for f in failures[:5]:
            print(f"  seed {f.seed}: {f.error}", flush=True)
    _append_rows(rows)
    return 1 if num_failed else 0


if __name__ == "__main__":
    sys.exit(main())
