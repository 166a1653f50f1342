"""``mars-openhands workload ...``: build, synthesize and inspect workload files.

Wiring (in ``eval/cli.py``)::

    from eval.workloads.cli import add_workload_subcommand
    add_workload_subcommand(subparsers)        # subparsers = parser.add_subparsers(...)
    args = parser.parse_args(argv)
    return args.func(args)                     # every subcommand sets func(args) -> exit code

Subcommands::

    workload from-traces DIR -o out.json [--no-skip-malformed] [arrival/caps/scale options]
    workload synth --kind swebench --sessions N --seed S -o out.json [arrival/caps options]
    workload mix A.json B.json [...] -o out.json [--seed S]    # interleave (e.g. RepoBench among agents)
    workload stats FILE [--top N]

Errors in input files print one line naming the file and field and exit with status 2; nothing is
written unless the whole workload was built.
"""

from __future__ import annotations

import argparse
import sys
import types
from typing import Any

from pydantic import ValidationError

from eval.argtypes import (
    config_error_lines,
    count_or_zero,
    non_negative_float,
    non_negative_int,
    positive_float,
    positive_int,
)
from eval.workloads.arrivals import BurstArrivals, FixedRateArrivals, PoissonArrivals, with_arrivals
from eval.workloads.format import Workload, WorkloadFormatError, load_workload, save_workload
from eval.workloads.stats import Distribution, WorkloadStats, workload_stats
from eval.workloads.synth import SYNTH_KINDS, WorkloadCaps, synthesize
from eval.workloads.traces import load_trace_dir
from eval.workloads.transform import mix_workloads, scale_workload, trim_workload
from mars_openhands.cli_style import EXIT_USAGE, cli_error

__all__ = ["add_workload_subcommand"]

EXIT_BAD_INPUT = EXIT_USAGE


# Field of an arrival process or of the caps -> the flag that sets it, for one-line errors.
_FLAGS = types.MappingProxyType({
    "rate_per_s": "--rate", "burst_size": "--burst-size", "burst_interval_s": "--burst-interval-s",
    "max_turns": "--max-turns", "max_context_tokens": "--max-context-tokens", "num_sessions": "--sessions",
})


def _add_shaping_options(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("arrivals (default: every session at t = 0)")
    group.add_argument("--arrival", choices=["fixed", "poisson", "burst"], default=None,
                       help="arrival process (design.md §8): fixed and poisson need --rate, burst needs "
                            "--burst-size and --burst-interval-s")
    group.add_argument("--rate", type=positive_float, default=None, metavar="R",
                       help="sessions/s (> 0) of --arrival fixed or poisson; an error without one of "
                            "them (which of the two is meant cannot be guessed)")
    group.add_argument("--burst-size", type=positive_int, default=None, metavar="N",
                       help="sessions per burst (>= 1), with --arrival burst")
    group.add_argument("--burst-interval-s", type=non_negative_float, default=None, metavar="S",
                       help="seconds between bursts (>= 0), with --arrival burst")
    group.add_argument("--seed", type=non_negative_int, default=0,
                       help="seed of the generator and arrivals (default 0)")
    caps = parser.add_argument_group("caps (fit small engines)")
    # 0 = no cap, as compare's --max-turns / --max-context-tokens / --sessions read it
    caps.add_argument("--max-turns", type=count_or_zero, default=None, metavar="N",
                      help="at most N turns/session (default, or 0: all)")
    caps.add_argument("--max-context-tokens", type=count_or_zero, default=None, metavar="N",
                      help="end each session at its last turn whose prompt + output fits in N >= 2 "
                           "tokens (that turn becomes final); a first turn that does not fit "
                           "is shrunk to it (output at most half, prompt the rest), so every "
                           "session keeps one turn (default, or 0: no cap)")


def add_workload_subcommand(subparsers: Any) -> argparse.ArgumentParser:
    """Add ``workload`` (``from-traces``, ``synth``, ``mix``, ``stats``) to an argparse subparsers object.

    Mutates: ``subparsers``. Each leaf parser sets ``func(args) -> int`` (exit status).

    Returns:
        The ``workload`` parser.
    """
    workload = subparsers.add_parser("workload", help="build, synthesize and inspect workloads")
    commands = workload.add_subparsers(dest="workload_command", required=True)

    traces = commands.add_parser("from-traces", help="convert mini-swe-agent trajectories")
    traces.add_argument("directory", help="folder of *.traj.json[.gz] files (searched recursively)")
    traces.add_argument("-o", "--output", required=True, help="workload file (.json/.jsonl[.gz])")
    traces.add_argument("--skip-malformed", action=argparse.BooleanOptionalAction, default=True,
                        help="skip a malformed trajectory with a warning naming it (noted in meta.notes; "
                             "an error when every file is); --no-skip-malformed fails on the first "
                             "(default: skip)")
    traces.add_argument("--sessions", type=count_or_zero, default=None, metavar="N",
                        help="keep the first N sessions (default, or 0: all)")
    traces.add_argument("--tool-time-factor", type=positive_float, default=1.0,
                        help="multiply tool durations (e.g. 0.1 for a fast smoke run; default: %(default)s)")
    _add_shaping_options(traces)
    traces.set_defaults(func=_guarded(_from_traces))

    synth = commands.add_parser("synth", help="generate a calibrated synthetic workload")
    synth.add_argument("--kind", choices=sorted(SYNTH_KINDS), required=True,
                       help="which benchmark's statistics to draw from (docs/workloads.md)")
    synth.add_argument("--sessions", type=positive_int, required=True, metavar="N", help="number of sessions")
    synth.add_argument("-o", "--output", required=True, help="workload file (.json/.jsonl[.gz])")
    _add_shaping_options(synth)
    synth.set_defaults(func=_guarded(_synth))

    mix = commands.add_parser("mix", help="interleave several workloads (e.g. long prompts among agents)")
    mix.add_argument("files", nargs="+", help="two or more workload files")
    mix.add_argument("-o", "--output", required=True, help="workload file (.json/.jsonl[.gz])")
    mix.add_argument("--seed", type=non_negative_int, default=0, help="order of the interleaving (default: 0)")
    mix.set_defaults(func=_guarded(_mix))

    stats = commands.add_parser("stats", help="print a workload's distributions")
    stats.add_argument("file", help="workload file")
    stats.add_argument("--top", type=positive_int, default=12, metavar="N",
                       help="list the N most-called tools (N >= 1; default: %(default)s)")
    stats.set_defaults(func=_guarded(_stats))
    return workload


def _guarded(handler: Any) -> Any:
    def run(args: argparse.Namespace) -> int:
        prog = f"mars-openhands workload {args.workload_command}"
        try:
            return handler(args)
        except ValidationError as e:  # an arrival process or cap out of range: one line per flag
            return max(cli_error(prog, line) for line in config_error_lines(e, _FLAGS))
        except (WorkloadFormatError, ValueError, FileNotFoundError) as e:
            return cli_error(prog, str(e))
    return run


def _arrival(args: argparse.Namespace) -> FixedRateArrivals | PoissonArrivals | BurstArrivals | None:
    """The arrival process of the flags; ``None`` without ``--arrival``.

    Raises:
        ValueError: a flag the chosen process (or no process) would ignore, or one it needs is
            missing (one line naming them).
        ValidationError: a value the process model rejects.
    """
    burst = [f for f, v in (("--burst-size", args.burst_size), ("--burst-interval-s", args.burst_interval_s))
             if v is not None]
    if args.arrival in (None, "burst") and args.rate is not None:
        raise ValueError(f"--rate {args.rate:g}: is the rate of --arrival fixed or poisson, and "
                         f"{'no --arrival is given' if args.arrival is None else '--arrival burst has none'}; "
                         "add --arrival fixed (evenly spaced) or --arrival poisson")
    if args.arrival != "burst" and burst:
        raise ValueError(f"{burst[0]}: needs --arrival burst (got "
                         f"{'no --arrival' if args.arrival is None else '--arrival ' + args.arrival})")
    if args.arrival is None:
        return None
    if args.arrival in ("fixed", "poisson"):
        if args.rate is None:
            raise ValueError(f"--arrival {args.arrival} needs --rate (sessions per second)")
        cls = FixedRateArrivals if args.arrival == "fixed" else PoissonArrivals
        return cls(rate_per_s=args.rate)
    if args.burst_size is None or args.burst_interval_s is None:
        raise ValueError("--arrival burst needs --burst-size and --burst-interval-s")
    return BurstArrivals(burst_size=args.burst_size, burst_interval_s=args.burst_interval_s)


def _no_zero_caps(args: argparse.Namespace) -> None:
    """``--max-turns 0`` / ``--max-context-tokens 0`` (no cap) as ``None``. Mutates ``args``."""
    for name in ("max_turns", "max_context_tokens"):
        if getattr(args, name) == 0:
            setattr(args, name, None)


def _from_traces(args: argparse.Namespace) -> int:
    _no_zero_caps(args)
    args.sessions = args.sessions or None  # 0: every session
    arrival = _arrival(args)  # the flags first: a mistake there costs no trace parsing
    WorkloadCaps(max_turns=args.max_turns, max_context_tokens=args.max_context_tokens)  # its bounds
    workload = load_trace_dir(args.directory, on_error="skip" if args.skip_malformed else "raise")
    skipped = [n.removeprefix("skipped ") for n in workload.meta.notes if n.startswith("skipped ")]
    if skipped:
        names = ", ".join(n.split(" (", 1)[0] for n in skipped)
        print(f"warning: {args.directory}: skipped {len(skipped)} trajectory file(s): {names}; first: "
              f"{skipped[0]}; --no-skip-malformed fails on them instead", file=sys.stderr)
    if any(v is not None for v in (args.sessions, args.max_turns, args.max_context_tokens)):
        workload = trim_workload(workload, num_sessions=args.sessions, max_turns=args.max_turns,
                                 max_context_tokens=args.max_context_tokens)
    if args.tool_time_factor != 1.0:
        workload = scale_workload(workload, tool_time_factor=args.tool_time_factor)
    if arrival is not None:
        workload = with_arrivals(workload, arrival, args.seed)
    return _save(workload, args.output)


def _synth(args: argparse.Namespace) -> int:
    _no_zero_caps(args)
    caps = WorkloadCaps(max_turns=args.max_turns, max_context_tokens=args.max_context_tokens)
    workload = synthesize(args.kind, args.sessions, args.seed, caps=caps, arrival=_arrival(args))
    return _save(workload, args.output)


def _mix(args: argparse.Namespace) -> int:
    return _save(mix_workloads([load_workload(f) for f in args.files], args.seed), args.output)


def _save(workload: Workload, output: str) -> int:
    path = save_workload(workload, output)
    print(f"wrote {path}: {len(workload.sessions)} sessions, {workload.num_turns} turns")
    return 0


def _stats(args: argparse.Namespace) -> int:
    from rich.console import Console

    stats = workload_stats(load_workload(args.file))
    console = Console()
    for table in _tables(args.file, stats, args.top):
        console.print(table)
    return 0


def _tables(title: str, stats: WorkloadStats, top: int) -> list[Any]:
    from rich.table import Table

    table = Table(title=f"{title}: {stats.num_sessions} sessions, {stats.num_turns} turns, "
                        f"arrivals over {stats.arrival_span_s:.1f} s")
    for column in ("quantity", "count", "mean", "p50", "p90", "p99", "max"):
        table.add_column(column, justify="left" if column == "quantity" else "right")
    rows: dict[str, Distribution] = {
        "turns / session": stats.turns_per_session,
        "first prompt (tokens)": stats.first_prompt_tokens,
        "prompt / turn (tokens)": stats.prompt_tokens,
        "appended / turn (tokens)": stats.appended_tokens,
        "context growth / turn (tokens)": stats.context_growth_tokens,
        "output / turn (tokens)": stats.output_tokens,
        "peak context / session (tokens)": stats.max_context_tokens,
        "tool duration (s)": stats.tool_duration_s,
    }
    for name, d in rows.items():  # no value (one-turn sessions have no appended tokens): "–", not nan
        table.add_row(name, str(d.count), *(f"{v:,.2f}" if d.count else "–" for v in (d.mean, d.p50, d.p90,
                                                                                     d.p99, d.max)))
    tools = Table(title=(f"tools (> 10 s: {stats.tool_over_10s_fraction:.2%} of calls, "
                         f"{stats.tool_over_10s_time_share:.1%} of time; > 60 s: "
                         f"{stats.tool_over_60s_fraction:.2%}, {stats.tool_over_60s_time_share:.1%})")
                  if stats.tool_duration_s.count else "tools (no tool calls)")
    for column in ("tool", "calls", "p50 (s)", "total (s)"):
        tools.add_column(column, justify="left" if column == "tool" else "right")
    for t in stats.tools[:top]:
        tools.add_row(t.tool_name, str(t.num_calls), f"{t.p50_s:.2f}", f"{t.total_s:,.1f}")
    return [table, tools]
