"""``mars-openhands plan``: a capacity planner for one deployment, before buying or configuring it
(issue 31, item 3).

Given a GPU, a model with its weight and KV cache dtypes, vLLM's memory utilization, the number of
tool workers and a workload (a trace folder, a workload file or a synthetic family), it answers, per
policy and next to the unbounded-KV limit:

* **capacity at SLO**: the largest Poisson arrival rate (sessions/s) at which every session
  completes and the mean slowdown (E2E / the session's ideal E2E alone) is at most ``--slo-slowdown``
  (default 2), exactly as ``compare --capacity`` defines and searches it (:mod:`eval.knee`);
* **P95 (and mean) session E2E at a chosen rate**: ``--load`` × FCFS's capacity (default 1.0, the
  rate stock vLLM just sustains) or ``--rate`` sessions/s.

It is ``compare``'s sweep (:func:`eval.sweep.run_sweep`, one GPU, one load, ``--capacity``) with the
``unbounded-kv`` reference always on, summarized as one table (``plan.md``, printed) and one plot
(``capacity.png``); the sweep's own files (``summary.md``, ``results.parquet``, ``capacity.parquet``,
the E2E plots) are in the same folder. Why a subcommand rather than ``compare --capacity`` with a
summary: a planner has other inputs (one GPU, one rate, a synthetic family) and one answer, and its
``--help`` can explain each input without compare's forty flags; the sweep, the search, the pool and
the cache underneath are compare's, unchanged.

Mental model of the cost: FCFS's knee search (~5-8 probes), then one capacity search per other run
label started at that knee (~4-6 probes each, interleaved on the worker pool), then the runs at the
chosen rate. FCFS's knee search is its capacity search only if it bracketed the knee; if its budget
ran out first, FCFS searches again from that rate like the others, so that the same runs give the
same lower bound ("≥") whichever policy they belong to. A probe that the guard proves unstable stops early; with ``--load 1.0`` every search's
first probe is the run at the chosen rate, so a stable one is not simulated again
(docs/compare.md "Planning capacity" has the measured wall time).
"""

from __future__ import annotations

import argparse
import functools
import logging
import math
import os
import shlex
import sys
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import pandas as pd
from pydantic import ValidationError
from rich.console import Console

from eval.argtypes import (
    config_error_lines,
    count_or_zero,
    finite_float,
    json_object,
    long_flags,
    non_negative_int,
    positive_float,
    positive_int,
)
from eval.cache import ResultCache, default_cache_dir
from eval.compare import checked_mars_config, host_kv_note, interrupted_exit, mars_config_note
from eval.compare_setup import (
    DEFAULT_TRACES,
    TRACES_ENV,
    check_profile_keys,
    clear_previous_results,
    default_traces_dir,
    gpu_setup,
    skipped_traces_note,
    trim_note,
)
from eval.deployment import add_deployment_flags, deployment_from_args
from eval.policies import (
    OFFLOAD_VARIANTS,
    POLICIES,
    REFERENCE,
    parse_policies,
    reference_tag,
    with_host_kv_policies,
)
from eval.pool import default_jobs, start_worker_server
from eval.progress import progress_display
from eval.provenance import source_commit, utc_date
from eval.report import format_figure
from eval.sweep import run_sweep
from eval.sweep_options import CompareOptions
from eval.workloads import Workload, load_trace_dir, load_workload, trim_workload
from eval.workloads.synth import SYNTH_KINDS, synthesize
from mars_openhands.cli_signals import Terminated
from mars_openhands.cli_style import CliParser, cli_error
from mars_openhands.engine.harness.executor.profiles import GPUS

__all__ = ["DEFAULT_PLAN_POLICIES", "add_plan_subcommand", "plan_table", "render_plan", "write_capacity_plot"]

DEFAULT_PLAN_POLICIES: tuple[str, ...] = ("fcfs", "vllm-tuned", "thunderagent", "continuum", "mars")
"""Stock vLLM (as shipped and as vLLM's agentic benchmark tunes it), the two strongest program-level
baselines of the full-workload measurements (docs/compare.md) and mars; the unbounded-KV limit is
always added."""
DEFAULT_GPU = "h100_sxm"
"""The paper's tighter-KV GPU (design.md §7)."""
DEFAULT_SYNTHETIC_SESSIONS = 74
"""As many sessions as the bundled trace folder has usable ones, so the two compare."""
_PROG = "mars-openhands plan"

_DESCRIPTION = """\
A capacity planner: for one deployment (GPU, model and dtypes, memory utilization, tool workers) and
one workload, how many agent sessions per second each scheduling policy sustains at the SLO, and the
P95 session E2E at a chosen arrival rate, next to the unbounded-KV limit (the same arrivals on KV for
every session at once: what no KV policy can beat). Simulated: vLLM's real schedulers in virtual time
on the GPU's modelled step times and KV capacity (the same simulator as compare)."""

_EPILOG = """\
what it answers (one row per policy, and the unbounded-kv limit):
  capacity at SLO  the largest Poisson arrival rate (sessions/s, and per hour) at which every session
                   completes and the mean slowdown (E2E / the session's ideal E2E alone) is at most
                   --slo-slowdown: compare's knee search (bracket, then bisect to --knee-tolerance),
                   run for every policy; x limit = capacity / the unbounded-kv limit's
  P95 at the rate  P95 and mean session E2E (s) and mean slowdown at --load x FCFS's capacity (default
                   1.0) or at --rate; x limit = P95 / the limit's P95 at the same arrivals
  >= X             the search's --search-runs probes were all stable: X is a lower bound. Every search
                   that ran out starts at the same rate with the same budget (FCFS's too: a knee search
                   that ran out makes the load's base rate, then FCFS searches again from there), so
                   ">= X" rows reach the same X and are not ranked against each other

examples:
  mars-openhands plan                                             # H100 SXM, Qwen3-Coder bf16, the bundled traces
  mars-openhands plan --gpu h200_sxm --kv-cache-dtype fp8 --gpu-memory-utilization 0.95
  mars-openhands plan --model gpt-oss-120b --tool-workers 32 --traces DIR --out runs/plan-oss
  mars-openhands plan --synthetic terminalbench --synthetic-sessions 64 --rate 0.01

Writes --out: plan.md (the table, also printed), capacity.png (capacity and P95 as x the limit, one
bar per policy), and compare's files of the same sweep (summary.md, results.parquet,
capacity.parquet, one Parquet per run, e2e_vs_load.png, e2e_cdf.png, goodput_vs_alpha.png).
Ideal times and searches are cached by content (--cache-dir, --no-cache): a rerun with the same
inputs and code skips them. --sessions and --max-turns trim the workload for a quick look; the
output then says TRIMMED. --host-kv-gib G adds vLLM's host-memory KV tier (G GiB of host memory per
GPU, vLLM's native offload; copies over PCIe modelled, docs/timing.md §9): each policy then also runs
with it as its offload variant (fcfs -> vllm-offload-lru, thunderagent -> thunderagent-offload,
continuum -> continuum-offload, mars -> mars-offload), and the scope line names the tier. The limit
stays GPU-only KV for every session, so the tier's rows divide by the same limit.
docs/compare.md "Planning capacity" has a measured run.
"""


def add_plan_subcommand(subparsers: Any) -> argparse.ArgumentParser:
    """Add ``plan`` to an argparse subparsers object; ``func`` runs it and returns an exit code."""
    p = subparsers.add_parser("plan", help="capacity at SLO and P95 per policy for one deployment and workload",
                              description=_DESCRIPTION, epilog=_EPILOG,
                              formatter_class=argparse.RawDescriptionHelpFormatter)
    hw = p.add_argument_group("deployment")
    hw.add_argument("--gpu", default=DEFAULT_GPU,
                    help=f"GPU profile, one of {', '.join(sorted(GPUS))} (default {DEFAULT_GPU}); its memory "
                         "and step times (NVIDIA AIConfigurator data) set the KV pool and the speed")
    add_deployment_flags(hw)  # --model, --kv-cache-dtype, --gpu-memory-utilization
    hw.add_argument("--tool-workers", type=positive_int, default=16, metavar="N",
                    help="tool calls that run at once on the agents' side (default 16); more wait in a "
                         "queue, which the policies that watch the CPU plane (mars) see")
    src = p.add_argument_group("workload (one of; default: the bundled traces)")
    source = src.add_mutually_exclusive_group()
    source.add_argument("--traces", default=None, metavar="DIR",
                        help=f"a folder of mini-swe-agent trajectories (*.traj.json[.gz]): each one a "
                             f"session with its recorded turns, token counts and tool times (default: "
                             f"${TRACES_ENV}, else {DEFAULT_TRACES} next to the checkout)")
    source.add_argument("--workload", default=None, metavar="FILE",
                        help="a workload file (.json/.jsonl[.gz]) of `mars-openhands workload`")
    source.add_argument("--synthetic", default=None, choices=tuple(SYNTH_KINDS), metavar="FAMILY",
                        help=f"a synthetic family calibrated on real traces and published numbers: "
                             f"{', '.join(SYNTH_KINDS)} (docs/workloads.md)")
    src.add_argument("--synthetic-sessions", type=positive_int, default=DEFAULT_SYNTHETIC_SESSIONS, metavar="N",
                     help=f"sessions of --synthetic (default {DEFAULT_SYNTHETIC_SESSIONS}, as many as the "
                          "bundled traces)")
    src.add_argument("--sessions", type=count_or_zero, default=0, metavar="N",
                     help="keep the first N sessions (default 0 = all; any other value is TRIMMED)")
    src.add_argument("--max-turns", type=count_or_zero, default=0, metavar="N",
                     help="cap turns per session (default 0 = none; any other value is TRIMMED)")
    q = p.add_argument_group("question")
    q.add_argument("--policies", default=",".join(DEFAULT_PLAN_POLICIES), metavar="LIST",
                   help=f"comma-separated policies (default {','.join(DEFAULT_PLAN_POLICIES)}; any of "
                        f"{', '.join(n for n in POLICIES if n != REFERENCE)}); the {REFERENCE} limit is always "
                        "added. mars runs behind the gateway's admission window (its control plane)")
    q.add_argument("--host-kv-gib", type=positive_float, default=None, metavar="G",
                   help="vLLM's host-memory KV tier (--kv-offloading-backend native --kv-offloading-size G, "
                        "GiB of host memory): every policy with an offload variant also runs with it "
                        f"({', '.join(f'{k} -> {v}' for k, v in OFFLOAD_VARIANTS.items())}); "
                        "default: none (GPU KV only)")
    q.add_argument("--mars-config", type=json_object, default=None, metavar="JSON",
                   help="scheduler keys merged into every mars policy's 'mars' settings, e.g. "
                        "'{\"residency\": {\"order\": \"response-ratio\"}}' (compare's flag; "
                        "docs/compare.md 'Scheduler keys'); the baselines are unchanged")
    rate = q.add_mutually_exclusive_group()
    rate.add_argument("--load", type=positive_float, default=None, metavar="X",
                      help="the rate of the P95 column as a multiple of FCFS's capacity at SLO (default 1.0)")
    rate.add_argument("--rate", type=positive_float, default=None, metavar="R",
                      help="the rate of the P95 column in sessions/s (then no FCFS knee comes first; "
                           "each capacity search starts near one session at a time)")
    q.add_argument("--slo-slowdown", type=finite_float, default=2.0, metavar="S",
                   help="the SLO: mean slowdown at most this, every session completing (default 2, "
                        "compare's --knee-slowdown)")
    q.add_argument("--knee-tolerance", type=finite_float, default=1.1, metavar="T",
                   help="stop a capacity search once its stable/unstable bracket is within this ratio "
                        "(default 1.1: finer than one arrival seed's noise)")
    q.add_argument("--search-runs", type=positive_int, default=8, metavar="N",
                   help="at most this many simulations per capacity search (default 8)")
    q.add_argument("--seed", type=non_negative_int, default=0, metavar="N", help="seed of the arrivals and the simulator (default 0)")
    run = p.add_argument_group("running")
    run.add_argument("--jobs", type=positive_int, default=None, metavar="N",
                     help=f"worker processes (default: the CPUs this process may use, here {default_jobs()})")
    run.add_argument("--cache-dir", default=None, metavar="DIR",
                     help="cache of ideal times and capacity searches (default $XDG_CACHE_HOME/mars-openhands/compare)")
    run.add_argument("--no-cache", action="store_true", help="neither read nor write the cache")
    run.add_argument("--out", default="runs/plan", metavar="DIR", help="results folder (default runs/plan)")
    flags = {**long_flags(p), "num_tool_workers": "--tool-workers", "search_max_runs": "--search-runs",
             "knee_slowdown": "--slo-slowdown", "base_rate_per_s": "--rate"}
    p.set_defaults(func=functools.partial(_main, flags=flags), argv=None)
    return p


def _error(message: str) -> int:
    return cli_error(_PROG, message)


def _policies(text: str, has_host_kv: bool = False) -> tuple[str, ...]:
    """The run labels' policies: ``--policies`` (each followed by its offload variant with
    ``--host-kv-gib``) plus the limit, last. Raises ValueError naming the flag."""
    try:
        names = parse_policies(text)
    except ValueError as e:
        raise ValueError(f"--policies: {e}") from None
    if has_host_kv:
        names = with_host_kv_policies(names, with_stock=False)
    return tuple(dict.fromkeys((*(n for n in names if n != REFERENCE), REFERENCE)))


def _check_inputs(args: argparse.Namespace) -> tuple[tuple[str, ...], CompareOptions]:
    """Check every flag before anything is loaded; the policies and the sweep's options.

    Raises:
        ValueError: an unknown GPU, model or policy, a bad SLO (one line naming the flag).
        ValidationError: a value :class:`CompareOptions` rejects.
    """
    check_profile_keys((args.gpu,), args.model)
    if not args.slo_slowdown > 1.0:
        raise ValueError(f"--slo-slowdown: must be > 1 (a mean slowdown of 1 is the physical limit), "
                         f"got {args.slo_slowdown:g}")
    if not args.knee_tolerance > 1.0:
        raise ValueError(f"--knee-tolerance: must be > 1, got {args.knee_tolerance:g}")
    policies = _policies(args.policies, args.host_kv_gib is not None)
    tier = {"host_kv_gib": args.host_kv_gib} if args.host_kv_gib is not None else {}
    options = CompareOptions(**tier,
        policies=policies, loads=(args.rate if args.rate is not None else (args.load or 1.0),),
        is_absolute_rates=args.rate is not None, admission="auto", num_gpu_blocks=2,
        num_tool_workers=args.tool_workers, seed=args.seed, knee_slowdown=args.slo_slowdown,
        search_max_runs=args.search_runs, knee_tolerance=args.knee_tolerance, is_capacity=True,
        mars_config=checked_mars_config(args.mars_config, policies))
    return policies, options


def _workload(args: argparse.Namespace) -> tuple[Workload, Workload, str, str | None]:
    """The workload to plan for, the workload as loaded (untrimmed), its name and a skipped-files note.

    Raises:
        FileNotFoundError: no such trace folder or file, and no default trace folder.
        ValueError: a folder with no usable trajectory, a bad workload file (one line each).
    """
    skipped = None
    if args.synthetic:
        loaded = synthesize(args.synthetic, args.synthetic_sessions, args.seed)
        name = f"synthetic {args.synthetic} ({args.synthetic_sessions} sessions, seed {args.seed})"
    elif args.workload:
        try:
            loaded, name = load_workload(args.workload), str(args.workload)
        except (OSError, ValueError) as e:
            raise ValueError(f"--workload {args.workload}: {str(e).splitlines()[0]}") from None
    else:
        traces = args.traces or str(default_traces_dir(os.environ, Path.cwd()))
        flag = "--traces" if args.traces else f"the default trace folder {traces}"
        try:
            loaded = load_trace_dir(traces, on_error="skip")
        except (FileNotFoundError, ValueError) as e:
            raise ValueError(f"{flag}: {str(e).splitlines()[0]}") from None
        args.traces, name, skipped = traces, traces, skipped_traces_note(loaded)
    if not loaded.sessions:
        raise ValueError(f"{name}: the workload has no sessions; give a folder or file with at least one")
    full = trim_workload(loaded, num_sessions=args.sessions or None)
    workload = trim_workload(full, max_turns=args.max_turns or None)
    return workload, loaded, name, skipped


def _main(args: argparse.Namespace, flags: Mapping[str, str] | None = None) -> int:
    """Run ``plan``; returns 0 (all runs ok), 1 (a run failed), 2 (bad input), 130 (Ctrl-C), 143 (SIGTERM)."""
    logging.getLogger("vllm").setLevel(logging.ERROR)
    out = Path(args.out)
    if out.exists() and not out.is_dir():
        return _error(f"--out {out}: is a file; give a folder")
    try:
        policies, options = _check_inputs(args)
    except ValidationError as e:
        return max(_error(line) for line in config_error_lines(e, flags or {}))
    except ValueError as e:
        return _error(str(e))
    existed = out.exists()
    try:
        return _load_and_plan(args, policies, options)
    except (KeyboardInterrupt, Terminated) as e:
        return interrupted_exit(e, None, out, is_out_new=not existed)


def _load_and_plan(args: argparse.Namespace, policies: tuple[str, ...], options: CompareOptions) -> int:
    """Load the workload and the GPU's profile, run the sweep, write and print the plan."""
    console = Console(stderr=True)
    t0 = time.monotonic()
    try:
        with console.status("loading the workload and the GPU profile"):
            workload, loaded, name, skipped = _workload(args)
            jobs = args.jobs or default_jobs()
            if jobs > 1:
                start_worker_server()  # the workers' vLLM import overlaps the set-up below
            args.kv_blocks, args.kv_scale = None, "1"  # the whole GPU's KV (gpu_setup's flags)
            setup, scale, profile_blocks = gpu_setup(args, args.gpu, workload, 1.0)
            deployment = deployment_from_args(args)
    except (ValueError, OSError) as e:
        return _error(str(e).splitlines()[0])
    scope = trim_note(loaded, workload, kv_scale=scale, profile_blocks=profile_blocks)
    options = options.model_copy(update={"num_gpu_blocks": setup.num_gpu_blocks,
                                         "host_kv_bytes_per_block": deployment.kv_bytes_per_token * 16})
    meta: dict[str, Any] = {
        "scope": f"{scope} {deployment.describe()} {host_kv_note(options)} {mars_config_note(options)}".rstrip(),
        "commit": source_commit(), "date": utc_date(),
        "command": f"{_PROG} " + shlex.join(getattr(args, "argv", None) or []), "backend": "sim",
        "workload": name, "timing": setup.timing, **deployment.facts(),
        "tool workers": args.tool_workers, "seed": args.seed, "admission": "auto", "jobs": jobs}
    if skipped:
        print(f"warning: {name}: {skipped}", file=sys.stderr)
        meta["skipped trace files"] = skipped
    if clear_previous_results(args.out):
        print(f"replacing the previous results in {args.out}", file=sys.stderr)
    cache = ResultCache(None if args.no_cache else (args.cache_dir or default_cache_dir()))
    with progress_display(console) as progress:
        results = run_sweep(workload, options, (setup,), args.out, meta=meta, progress=progress,
                            jobs=jobs, cache=cache)
    capacity = pd.read_parquet(Path(args.out) / "capacity.parquet")
    table = plan_table(results, capacity, policies)
    wall_s = time.monotonic() - t0
    facts = {"scope": meta["scope"], "GPU": f"{args.gpu}, KV {setup.num_gpu_blocks:,} blocks of 16 tokens",
             "workload": f"{name}: {len(workload.sessions)} sessions, {workload.num_turns} turns",
             "tool workers": args.tool_workers, "SLO": f"mean slowdown <= {args.slo_slowdown:g}, every session completes",
             "command": meta["command"], "commit": meta["commit"], "date": meta["date"],
             "wall": f"{wall_s:.0f} s on {jobs} worker process(es)"
                     + (f"; {cache.num_hits} cached ideal/search results reused" if cache.num_hits else "")}
    text = render_plan(table, facts)
    (Path(args.out) / "plan.md").write_text(text, encoding="utf-8")
    table.to_parquet(Path(args.out) / "plan.parquet", index=False)
    write_capacity_plot(Path(args.out), table, f"{args.gpu}, {deployment.model} ({deployment.kv_dtype} KV), "
                                               f"{Path(name).name}")
    print(text)
    console.print(f"wrote {args.out} in {wall_s:.0f} s ({scope.split(':')[0]})")
    for _, r in table.loc[table["capacity_error"] != ""].iterrows():
        print(f"error: {r['label']}'s capacity search: {r['capacity_error']}", file=sys.stderr)
    return 0 if (results["status"] == "ok").all() and (table["capacity_error"] == "").all() else 1


def plan_table(results: pd.DataFrame, capacity: pd.DataFrame, policies: Sequence[str]) -> pd.DataFrame:
    """The planner's answer: one row per run label, in ``policies`` order, the limit last. Pure.

    Args:
        results: the sweep's results table at one load (:data:`eval.report.RESULT_COLUMNS`).
        capacity: its ``capacity.parquet`` (``label``, ``capacity_per_s``, ``is_bracketed``,
            ``first_unstable_per_s``, ``num_probes``).
        policies: the policy order (``fcfs`` ... ``unbounded-kv``).

    Returns:
        Columns ``label``, ``is_limit``, ``capacity_per_s``, ``capacity_per_h``,
        ``capacity_vs_limit`` (capacity / the limit's: <= 1 up to the search's tolerance; NaN where
        either search found no unstable rate: a lower bound is no capacity to divide),
        ``first_unstable_per_s``, ``is_bracketed``, ``num_probes``, ``rate_per_s``, ``e2e_p95_s``,
        ``p95_vs_limit`` (P95 / the limit's P95: >= 1 up to noise), ``e2e_mean_s``,
        ``mean_vs_limit``, ``slowdown_mean``, ``num_completed``, ``num_sessions``, ``status``,
        ``capacity_error`` (why the capacity search failed, e.g. an engine stall; ``""`` if it did
        not); NaN where a value is missing (a failed run or search, no limit).
    """
    order = {p: i for i, p in enumerate(policies)}
    cap = capacity.set_index("label")
    rows = []
    for _, r in results.iterrows():
        label = str(r["label"])
        c = cap.loc[label] if label in cap.index else None
        rows.append({
            "label": label, "is_limit": POLICIES[str(r["policy"])].is_kv_unbounded,
            "capacity_per_s": float(c["capacity_per_s"]) if c is not None else math.nan,
            "first_unstable_per_s": float(c.get("first_unstable_per_s", math.nan)) if c is not None else math.nan,
            "is_bracketed": bool(c["is_bracketed"]) if c is not None else False,
            "num_probes": int(c["num_probes"]) if c is not None else 0,
            "capacity_error": c.get("error") if c is not None and isinstance(c.get("error"), str) else "",
            "rate_per_s": float(r["rate_per_s"]), "e2e_p95_s": float(r["e2e_p95_s"]),
            "e2e_mean_s": float(r["e2e_mean_s"]), "slowdown_mean": float(r["slowdown_mean"]),
            "num_completed": r["num_completed"], "num_sessions": r["num_sessions"], "status": r["status"],
            "_order": order.get(str(r["policy"]), len(order))})
    table = pd.DataFrame(rows).sort_values(["_order", "label"], kind="stable").drop(columns="_order")
    table["capacity_per_h"] = table["capacity_per_s"] * 3600.0
    limit = table.loc[table["is_limit"]]
    for column, ratio in (("capacity_per_s", "capacity_vs_limit"), ("e2e_p95_s", "p95_vs_limit"),
                          ("e2e_mean_s", "mean_vs_limit")):
        ref = float(limit[column].iloc[0]) if len(limit) else math.nan
        table[ratio] = table[column] / ref if ref and not math.isnan(ref) else math.nan
    # A search that found no unstable rate within its budget gives only a lower bound: no ratio.
    if not (len(limit) and bool(limit["is_bracketed"].iloc[0])):
        table["capacity_vs_limit"] = math.nan
    table.loc[~table["is_bracketed"].astype(bool), "capacity_vs_limit"] = math.nan
    return table.reset_index(drop=True)


def render_plan(table: pd.DataFrame, facts: Mapping[str, Any]) -> str:
    """``plan.md``: the scope line, the facts, the table and how to read it. Pure.

    Args:
        table: :func:`plan_table`.
        facts: ``name -> value``; ``scope`` is printed in bold first.
    """
    f = format_figure

    def times(value: float) -> str:
        return "–" if math.isnan(value) else f"{f(value)}×"

    rate = table["rate_per_s"].dropna()
    rate_text = f"{rate.iloc[0]:.4g} sessions/s" if len(rate) else "the chosen rate"
    lines = ["# mars-openhands plan", ""]
    if facts.get("scope"):
        lines += [f"**{facts['scope']}**", ""]
    lines += [f"- **{k}**: {v}" for k, v in facts.items() if k != "scope"]
    lines += ["", f"## Capacity at SLO, and E2E at {rate_text}", "",
              "| policy | capacity at SLO (sessions/s) | sessions/h | × limit | first unstable (sessions/s) "
              f"| P95 E2E at {rate_text} (s) | × limit | mean E2E (s) | × limit | mean slowdown | completed |",
              "|---|---|---|---|---|---|---|---|---|---|---|"]
    for _, r in table.iterrows():
        tag = reference_tag(str(r["label"]))
        name = f"{r['label']} ({tag})" if tag else str(r["label"])
        capacity = f(r["capacity_per_s"], 4) if not math.isnan(r["capacity_per_s"]) else "none stable"
        if not r["is_bracketed"] and not math.isnan(r["capacity_per_s"]):
            capacity = f"≥ {capacity}"  # the search's budget ran out below the knee
        if r.get("capacity_error"):
            capacity = f"FAILED: {r['capacity_error']}"
        unstable = f(r["first_unstable_per_s"], 4) if r["is_bracketed"] else "not found (budget spent)"
        done = f"{int(r['num_completed'])}/{int(r['num_sessions'])}" if r["status"] == "ok" else "FAILED"
        lines.append(f"| {name} | {capacity} | {f(r['capacity_per_h'])} | {times(r['capacity_vs_limit'])} | {unstable} "
                     f"| {f(r['e2e_p95_s'])} | {times(r['p95_vs_limit'])} | {f(r['e2e_mean_s'])} "
                     f"| {times(r['mean_vs_limit'])} | {f(r['slowdown_mean'])} | {done} |")
    lines += ["", "How to read it: *capacity at SLO* is the largest arrival rate probed at which every session "
              "completed with mean slowdown within the SLO; the true knee lies between it and *first unstable*. "
              "*× limit* divides by the unbounded-KV limit (the same arrivals with KV for every session at once): "
              "a capacity below 1× and an E2E above 1× are what KV management still loses on this GPU. The E2E "
              "columns are one run at the rate above (Poisson arrivals, the seed above)."]
    bounds = table.loc[~table["is_bracketed"].astype(bool) & table["capacity_per_s"].notna()]
    if len(bounds):
        lines += ["", f"*≥ X* ({', '.join(map(str, bounds['label']))}): every probe of the search was stable, "
                  "so its budget (--search-runs) ran out below the knee and X is only a lower bound. Every "
                  "capacity search starts at the same rate with the same budget, so ≥ rows reach the same X "
                  "whatever their policies' knees: they are not ranked against each other (raise "
                  "--search-runs to bracket them)."]
    return "\n".join(lines) + "\n"


def write_capacity_plot(out_dir: Path, table: pd.DataFrame, title: str) -> Path:
    """``capacity.png``: per policy, capacity at SLO and P95 E2E as × the unbounded-KV limit, as bars
    with their value written on them (close policies stay apart: each has its own bar and figure).

    Returns the path. Mutates: writes the file under ``out_dir``.
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    tags = [reference_tag(str(x)) for x in table["label"]]
    labels = [f"{x} ({tag})" if tag else str(x) for x, tag in zip(table["label"], tags, strict=True)]
    fig, axes = plt.subplots(1, 2, figsize=(11, 0.5 * len(labels) + 1.8))
    panels = (("capacity_vs_limit", "capacity at SLO, × the limit (higher is better)"),
              ("p95_vs_limit", "P95 E2E at the rate, × the limit (lower is better)"))
    for ax, (column, xlabel) in zip(axes, panels, strict=True):
        values = table[column].astype(float).fillna(0.0).to_numpy()
        bars = ax.barh(range(len(labels)), values, color=["0.6" if lim else "C0" for lim in table["is_limit"]])
        ax.bar_label(bars, labels=[f"{format_figure(v)}×" for v in table[column]], fontsize=8, padding=3)
        ax.axvline(1.0, color="k", linewidth=0.8, linestyle="--")
        ax.set_yticks(range(len(labels)), labels)
        ax.invert_yaxis()
        ax.set_xlabel(xlabel)
        ax.set_xlim(0, max(1.0, float(values.max()) if len(values) else 1.0) * 1.2)
        ax.grid(axis="x", alpha=0.3)
    fig.suptitle(f"{title}: capacity and P95 vs the unbounded-KV limit")
    fig.tight_layout()
    path = Path(out_dir) / "capacity.png"
    fig.savefig(path, dpi=110, bbox_inches="tight", metadata={"Title": fig._suptitle.get_text()})
    plt.close(fig)
    return path


if __name__ == "__main__":
    parser = CliParser(prog="python -m eval.plan")
    add_plan_subcommand(parser.add_subparsers(dest="command"))
    parsed = parser.parse_args(["plan", *sys.argv[1:]])
    sys.exit(parsed.func(parsed))
