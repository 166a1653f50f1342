"""``mars-openhands openhands bench``: the command line of :mod:`eval.ohbench`.

Registered under ``openhands`` by the top-level CLI (``NESTED_SUBCOMMANDS``), so it exists where
the OpenHands SDK does (``.venv-openhands``); the engines run in the engine env
(``--engine-python``, default ``.venv/bin/python``). Bad input (a task file, a flag) is one line
on stderr and exit code 2, before any server starts.
"""

from __future__ import annotations

import argparse
import functools
import os
import sys
from pathlib import Path
from typing import Any

from pydantic import ValidationError

from eval.argtypes import (
    config_error_lines,
    long_flags,
    non_negative_int,
    positive_float,
    positive_int,
)
from eval.deployment import add_deployment_flags, deployment_from_args
from eval.policies import parse_policies
from eval.task_sources import SOURCES, load_tasks
from mars_openhands.cli_style import CliParser, cli_error

__all__ = ["add_bench_subcommand", "bench_from_args", "main"]


def _add_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("--source", required=True, choices=tuple(SOURCES),
                   help="; ".join(f"{k}: {v}" for k, v in SOURCES.items()))
    p.add_argument("--tasks", type=Path, required=True,
                   help="the source's local file or folder (see --source)")
    p.add_argument("--repos-dir", type=Path, default=None,
                   help="swebench: folder of git clones (<owner>__<name>, <owner>/<name> or <name>)")
    p.add_argument("--limit", type=positive_int, default=None, help="the first N tasks only")
    p.add_argument("--out", type=Path, required=True, help="results directory")
    p.add_argument("--policies", default="fcfs,mars",
                   help="comma-separated policies of 'mars-openhands compare' (default fcfs,mars)")
    p.add_argument("--backend", choices=("emulated", "gpu"), default="emulated",
                   help="emulated: emulated-GPU vLLM + playback of recorded turns (no GPU); "
                        "gpu: vLLM with --real-model")
    load = p.add_mutually_exclusive_group()
    load.add_argument("--rps", type=positive_float, default=0.2,
                      help="task arrivals per second (default 0.2)")
    load.add_argument("--concurrency", type=positive_int, default=None,
                      help="closed loop: this many tasks in flight instead of --rps")
    p.add_argument("--arrival", choices=("fixed", "poisson"), default="fixed",
                   help="gaps between task arrivals at --rps: fixed (default) or Poisson")
    p.add_argument("--seed", type=non_negative_int, default=0,
                   help="seed of the arrivals, the session ids and the playback (default 0)")
    p.add_argument("--admission", choices=("auto", "on", "off"), default="auto",
                   help="auto: the gateway's window for mars/mars-preview only (as deployed)")
    p.add_argument("--gpu", default="h100_sxm", help="emulated GPU profile")
    # --model NAME[/DTYPE], --kv-cache-dtype, --gpu-memory-utilization: the emulated deployment, as
    # in compare (the gpu backend's real server takes vLLM's own flags through --engine-arg)
    add_deployment_flags(p)
    p.add_argument("--kv-blocks", type=positive_int, default=None,
                   help="emulated KV blocks of 16 tokens (default: the profile's capacity)")
    p.add_argument("--max-model-len", type=positive_int, default=32_768,
                   help="the engine's --max-model-len, tokens (default 32768)")
    p.add_argument("--engine-python", default=None,
                   help="python of the engine env (default <repo>/.venv/bin/python)")
    p.add_argument("--traces", type=Path, default=None,
                   help="recorded runs to play back (default: the bundled mini-swe-agent traces)")
    p.add_argument("--max-turns", type=positive_int, default=20, help="recorded turns per task")
    p.add_argument("--max-prompt-tokens", type=positive_int, default=30_000,
                   help="emulated: cap on a played-back turn's prompt, tokens; keep it below "
                        "--max-model-len minus --max-completion-tokens (default 30000)")
    p.add_argument("--max-completion-tokens", type=positive_int, default=1024,
                   help="cap on one completion, tokens (default 1024)")
    p.add_argument("--max-iterations", type=positive_int, default=100, help="agent steps per task")
    p.add_argument("--tool-workers", type=positive_int, default=16,
                   help="the gateway's tool-worker count (its CPU backlog signal)")
    p.add_argument("--task-timeout", type=positive_float, default=1800.0, help="seconds per task")
    p.add_argument("--startup-timeout", type=positive_float, default=900.0,
                   help="seconds a vLLM server may take to start")
    p.add_argument("--real-model", default=None, help="gpu: model name or directory")
    p.add_argument("--tool-call-parser", default="qwen3_coder", help="gpu: vLLM's parser")
    p.add_argument("--engine-arg", action="append", default=[],
                   help="gpu: one more vLLM argument (repeatable), e.g. --engine-arg=--gpu-memory-utilization=0.9")
    p.add_argument("--temperature", type=float, default=None,
                   help="gpu: sampling temperature of every LLM call (default: the server's)")
    p.add_argument("--top-p", type=float, default=None,
                   help="gpu: nucleus sampling top_p of every LLM call (default: the server's)")


def add_bench_subcommand(sub: Any) -> argparse.ArgumentParser:
    """Add ``bench`` to the ``openhands`` sub-parsers ``sub``."""
    p = sub.add_parser("bench", help="task completion time of OpenHands tasks across schedulers",
                       description=(sys.modules["eval.ohbench_cli"].__doc__ or "").split("\n")[0])
    _add_flags(p)
    p.set_defaults(func=functools.partial(bench_from_args, flags=long_flags(p)))
    return p


def options_from_args(args: argparse.Namespace) -> Any:
    """:class:`eval.ohbench.BenchOptions` of the flags.

    Raises:
        ValueError: an unknown policy (names the supported ones), ``--backend gpu`` without
            ``--real-model``, an unknown ``--model`` (names the profiles), or a value the options reject.
    """
    from eval.ohbench import BenchOptions  # pandas (the eval extra): see bench_from_args

    if args.backend == "gpu" and not args.real_model:
        raise ValueError("--backend gpu needs --real-model (e.g. Qwen/Qwen3-Coder-30B-A3B-Instruct)")
    deployment = deployment_from_args(args)  # ValueError naming --model
    return BenchOptions(
        policies=parse_policies(args.policies), backend=args.backend,
        rps=None if args.concurrency else args.rps, concurrency=args.concurrency,
        arrival=args.arrival, seed=args.seed, admission=args.admission, gpu=args.gpu,
        model=deployment.model, dtype=deployment.dtype, kv_cache_dtype=deployment.kv_cache_dtype,
        gpu_memory_utilization=deployment.gpu_memory_utilization, num_gpu_blocks=args.kv_blocks,
        max_model_len_tokens=args.max_model_len,
        engine_python=args.engine_python, traces_dir=args.traces, max_turns=args.max_turns,
        max_prompt_tokens=args.max_prompt_tokens, max_completion_tokens=args.max_completion_tokens,
        max_iterations=args.max_iterations, num_tool_workers=args.tool_workers,
        task_timeout_s=args.task_timeout, startup_timeout_s=args.startup_timeout,
        real_model=args.real_model, tool_call_parser=args.tool_call_parser,
        engine_args=tuple(args.engine_arg), temperature=args.temperature, top_p=args.top_p)


_PROG = "mars-openhands openhands bench"

_FLAG_OF_FIELD = {
    "num_gpu_blocks": "--kv-blocks", "max_model_len_tokens": "--max-model-len", "traces_dir": "--traces",
    "num_tool_workers": "--tool-workers", "task_timeout_s": "--task-timeout",
    "startup_timeout_s": "--startup-timeout", "engine_args": "--engine-arg",
}
"""Options fields whose flag is not ``--<field with dashes>``."""


def bench_from_args(args: argparse.Namespace, flags: dict[str, str] | None = None) -> int:
    """Run the benchmark; exit 0 when every policy ran, 1 when one failed, 2 on bad input (one
    line; ``flags``: dest -> flag, for the options' range errors)."""
    os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")
    # Not at module level: eval.ohbench needs pandas (the eval extra), which the OpenHands app env
    # lacks, and there `openhands bench` is still listed (the top-level CLI skips a module that fails).
    from eval.ohbench import DEFAULT_PLAYBACK_TRACES, assign_traces, find_traces, run_bench

    try:
        options = options_from_args(args)
        tasks = load_tasks(args.source, args.tasks, args.repos_dir, args.limit)
        if not tasks:
            raise ValueError(f"--tasks {args.tasks}: no tasks in it")
        if options.backend == "emulated":
            assign_traces(tasks, find_traces(options.traces_dir or DEFAULT_PLAYBACK_TRACES))
    except ValidationError as e:  # a flag out of the options' range: one line per flag
        return max(cli_error(_PROG, line) for line in config_error_lines(e, {**(flags or {}), **_FLAG_OF_FIELD}))
    except ValueError as e:  # TaskSourceError too
        return cli_error(_PROG, str(e).splitlines()[0])
    frame = run_bench(tasks, options, args.out,
                      log=lambda line: print(line, file=sys.stderr, flush=True))
    ran = set(frame["policy"]) if not frame.empty else set()
    print((args.out / "summary.md").read_text() if ran else "no policy ran")
    return 0 if ran == set(options.policies) else 1


def main(argv: list[str] | None = None) -> int:
    """``python -m eval.ohbench_cli --source ... --tasks ... --out ...``."""
    parser = CliParser(prog=_PROG)
    _add_flags(parser)
    return bench_from_args(parser.parse_args(argv), long_flags(parser))


if __name__ == "__main__":
    sys.exit(main())
