"""Cost of our scheduler hooks: ``schedule()`` time per step, stock vs MARS (style.md "Benchmarks").

Scenario: ``N`` requests (N = 32 / 128 / 512) of 512-token prompts, each in its own session with
MARS ``vllm_xargs``, all prefilled first (untimed), then decoding; we time only ``schedule()`` over
``--steps`` steps after ``--warmup`` steps (``perf_counter_ns``), for stock vLLM ``AsyncScheduler``,
``MarsPreviewScheduler`` and ``MarsScheduler``, built in-process on the same fake KV cache
(:mod:`mars_openhands.engine.harness.inproc_engine`). The three schedulers are stepped round-robin (shuffled each
step, GC frozen) in one run so that machine noise hits them alike; the ratios (median MARS /
median stock) come from that run.
Target (style.md): MarsScheduler <= 1.10x stock at 512 running.

Usage::

    .venv/bin/python benchmarks/bench_schedule.py            # 32, 128, 512
    .venv/bin/python benchmarks/bench_schedule.py --smoke    # tiny CI size

Prints one line per size and appends rows to ``benchmarks/results/bench_schedule.parquet`` (when
pandas/pyarrow are installed): git sha, vLLM version, machine, parameters, median, p99.
"""

from __future__ import annotations

import argparse
import gc
import platform
import random
import statistics
import subprocess
import time
from pathlib import Path

from vllm import __version__ as vllm_version
from vllm.sampling_params import SamplingParams
from vllm.utils.hashing import get_hash_fn_by_name
from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
from vllm.v1.core.sched.async_scheduler import AsyncScheduler
from vllm.v1.outputs import ModelRunnerOutput
from vllm.v1.request import Request

from mars_openhands.engine import MarsPreviewScheduler, MarsScheduler
from mars_openhands.engine.harness.inproc_engine import InprocEngineParams, build_scheduler

REPO_ROOT = Path(__file__).resolve().parents[1]
PROMPT_TOKENS = 512
CLASSES = {"stock": AsyncScheduler, "mars-preview": MarsPreviewScheduler, "mars": MarsScheduler}


def _build(cls: type, num_running: int, num_steps: int, seed: int) -> tuple[object, list[Request]]:
    blocks = num_running * ((PROMPT_TOKENS + num_steps + 64) // 16 + 2) + 64  # never tight
    # The preview's in-engine window (30) would cap the running count: off, so all run alike.
    params = InprocEngineParams(num_gpu_blocks=blocks, max_num_seqs=num_running,
                                max_num_batched_tokens=max(8192, num_running),
                                additional_config={"mars": {"window": {"enabled": False}}})
    sched = build_scheduler(cls, params)
    hash_fn = get_hash_fn_by_name("sha256")
    init_none_hash(hash_fn)
    hasher = get_request_block_hasher(16, hash_fn)
    rng = random.Random(seed)
    reqs = []
    for i in range(num_running):
        sp = SamplingParams(max_tokens=num_steps * 4, ignore_eos=True)
        sp.extra_args = {"mars_turn": 0, "mars_last_step": 0}
        r = Request(f"r{i}", [rng.randrange(10, 500) for _ in range(PROMPT_TOKENS)], sp, None,
                    block_hasher=hasher, session_id=f"s{i}")
        sched.add_request(r)
        reqs.append(r)
    return sched, reqs


def _timed_step(sched) -> int:
    t0 = time.perf_counter_ns()
    out = sched.schedule()
    elapsed = time.perf_counter_ns() - t0
    ids = list(out.num_scheduled_tokens)
    sampled = [[] if sched.requests[r].is_prefill_chunk else [7] for r in ids]
    sched.update_from_output(out, ModelRunnerOutput(
        req_ids=ids, req_id_to_index={r: i for i, r in enumerate(ids)}, sampled_token_ids=sampled))
    return elapsed


def run(num_running: int, warmup: int, steps: int, seed: int) -> dict[str, list[int]]:
    """Step every scheduler round-robin; returns name -> schedule() ns per measured step."""
    admission_steps = num_running * PROMPT_TOKENS // 8192 + 2
    total = admission_steps + warmup + steps
    built = {name: _build(cls, num_running, total, seed)[0] for name, cls in CLASSES.items()}
    for sched in built.values():  # prefill everything first: we time steady decode steps
        while any(r.num_computed_tokens < r.num_prompt_tokens for r in sched.requests.values()):
            _timed_step(sched)
    times: dict[str, list[int]] = {name: [] for name in CLASSES}
    order = list(built.items())
    rng = random.Random(seed)
    gc.collect()
    gc.freeze()  # as vLLM's engine does after startup: no GC pause lands in one scheduler's step
    gc.disable()
    try:
        for i in range(warmup + steps):
            rng.shuffle(order)  # no scheduler always runs right after another's garbage
            for name, sched in order:
                ns = _timed_step(sched)
                if i >= warmup:
                    times[name].append(ns)
    finally:
        gc.enable()
        gc.unfreeze()
    for name, sched in built.items():
        assert len(sched.running) == num_running, f"{name}: only {len(sched.running)} running"
    return times


def _p99(values: list[int]) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(0.99 * len(ordered)))]


def _append_rows(rows: list[dict]) -> None:
    try:
        import pandas as pd
    except ImportError:
        return
    path = REPO_ROOT / "benchmarks" / "results" / "bench_schedule.parquet"
    path.parent.mkdir(parents=True, exist_ok=True)
    frame = pd.DataFrame(rows)
    if path.exists():
        frame = pd.concat([pd.read_parquet(path), frame], ignore_index=True)
    frame.to_parquet(path, index=False)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--sizes", type=int, nargs="+", default=[32, 128, 512])
    parser.add_argument("--warmup", type=int, default=20)
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--smoke", action="store_true", help="tiny CI size")
    args = parser.parse_args()
    if args.smoke:
        args.sizes, args.warmup, args.steps = [8], 3, 10
    try:
        sha = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO_ROOT,
                             capture_output=True, text=True, check=False).stdout.strip()
    except OSError:
        sha = ""
    rows = []
    for n in args.sizes:
        times = run(n, args.warmup, args.steps, args.seed)
        med = {name: statistics.median(t) / 1e3 for name, t in times.items()}
        line = " ".join(f"{name}={med[name]:.0f}us" for name in CLASSES)
        ratios = " ".join(f"{name}/stock={med[name] / med['stock']:.2f}x"
                          for name in CLASSES if name != "stock")
        print(f"schedule() median at {n} running: {line} | {ratios}")
        for name, t in times.items():
            rows.append({"bench": "bench_schedule", "git_sha": sha or None, "vllm": vllm_version,
                         "machine": platform.node(), "scheduler": name, "num_running": n,
                         "steps": args.steps, "median_us": med[name], "p99_us": _p99(t) / 1e3,
                         "ratio_vs_stock": med[name] / med["stock"]})
    _append_rows(rows)


if __name__ == "__main__":
    main()
