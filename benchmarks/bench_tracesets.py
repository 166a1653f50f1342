"""mars against the unbounded-KV limit and the best baseline on trace sets beyond the bundled one (issue 30).

Scenario: every other mini-swe-agent trace folder under ``../shared/data/traces/mini-swe-agent/``
(different runs, models and subsets of SWE-bench Lite: 23, 23, 23 and 15 sessions; the bundled
``deepseek_chat_test_1-100`` is left out unless ``--sets`` names it), each at full length with the
whole GPU's KV, for seeds 0–2, at 1.0× and 1.2× of *its own* FCFS knee, on one H100 SXM; every
baseline, ``mars`` (with its control plane: ``mars+adm``) and the unbounded-KV reference
(docs/compare.md "Headroom"). One ``mars-openhands compare`` per (set, seed), driven as a
subprocess through its CLI only, so this script does not depend on ``eval.compare``'s internals.

Verdict per (set, seed, load), the issue's "Done when": mars's mean and P95 E2E within
``--limit-within`` (1.05×) of the limit, its goodput (α = 3) at least ``--tie`` (0.98×) of the best
baseline's, its P99 no worse than the best baseline's (``--p99-slack`` 1.0), every session done.

Reruns after a change to ``mars`` need not repeat the baselines: ``--baselines-from DIR`` reads a
previous grid's results (same sets and seeds), runs only ``--policies`` (default ``mars``) at the
base rate that grid found (``compare --base-rate``: no knee search) without the reference, and
judges the new rows against the old baselines and limit. ``--report-only`` prints the table of an
existing grid. A (set, seed) whose results already hold every wanted run is not run again.

``--smoke`` checks the script end to end in about a minute: one set (``deepseek_reasoner_dev``), seed
0, its first 3 sessions cut to 4 turns (``compare --sessions 3 --max-turns 4``), fcfs, thunderagent
and mars, into ``runs/tracesets-smoke``; its verdicts mean nothing (a trimmed slice).

The exit status is 0 when every (set, seed, load) point meets the verdict, 1 otherwise (also with
``--report-only``), so a grid can gate a change.

Usage::

    .venv/bin/python benchmarks/bench_tracesets.py --smoke
    nice -n 19 .venv/bin/python benchmarks/bench_tracesets.py --out runs/tracesets --jobs 2
    .venv/bin/python benchmarks/bench_tracesets.py --out runs/after --baselines-from runs/tracesets
    .venv/bin/python benchmarks/bench_tracesets.py --out runs/tracesets --report-only

Measured: docs/schedulers.md, "Beyond the bundled set".
"""

from __future__ import annotations

import argparse
import math
import subprocess
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import pandas as pd

from mars_openhands.cli_signals import run_child, sigterm_exits

REPO = Path(__file__).resolve().parents[1]
TRACES_ROOT = REPO.parent / "shared" / "data" / "traces" / "mini-swe-agent"
BUNDLED = "deepseek_chat_test_1-100"
"""The folder ``compare`` uses by default: judged by the main job, left out here unless named."""
ALL_POLICIES = "fcfs,vllm-tuned,autellix,infercept,continuum,continuum-dy,thunderagent,mars"
"""Every baseline (``PolicySpec.is_baseline``) and mars; ``compare`` adds the reference."""
REFERENCE = "unbounded-kv"
SMOKE = dict(sets="deepseek_reasoner_dev", seeds="0", sessions=3, max_turns=4,
             policies="fcfs,thunderagent,mars", out="runs/tracesets-smoke")
"""What ``--smoke`` sets (explicit flags still win, as for ``compare --quick``)."""


@dataclass(frozen=True)
class Verdict:
    """mars at one (set, seed, load) against the limit and the best baseline (ratios, > 1 = mars worse
    for E2E; goodput is mars ÷ best, < 1 = mars worse)."""

    mean_to_limit: float
    p95_to_limit: float
    p99_to_limit: float
    goodput_to_best: float
    p99_to_best: float
    best_by_goodput: str
    num_incomplete: int
    is_ok: bool
    best_mean_to_limit: float
    """The best baseline's mean E2E ÷ the limit's: how close any baseline came (the room)."""
    best_p95_to_limit: float


def default_sets(root: Path) -> list[str]:
    """Every trace folder under ``root`` but the bundled one, sorted. Pure w.r.t. the tree."""
    return sorted(p.name for p in root.iterdir() if p.is_dir() and p.name != BUNDLED)


def run_dir(out: Path, trace_set: str, seed: int) -> Path:
    return out / trace_set / f"s{seed}"


def mars_row(frame: pd.DataFrame) -> pd.Series | None:
    """The mars row of one load: ``mars+adm`` (mars with its control plane) if present, else ``mars``."""
    for label in ("mars+adm", "mars"):
        rows = frame[frame["label"] == label]
        if not rows.empty:
            return rows.iloc[0]
    return None


def judge(frame: pd.DataFrame, limit_within: float, tie: float, p99_slack: float) -> Verdict | None:
    """The verdict for one load's rows (baselines, the reference, mars); None if one is missing. Pure."""
    frame = frame[frame["status"] == "ok"] if "status" in frame else frame
    mars = mars_row(frame)
    base = frame[frame["is_baseline"].astype(bool)]
    ref = frame[frame["label"] == REFERENCE]
    if mars is None or base.empty or ref.empty:
        return None
    r = ref.iloc[0]
    best_goodput = max(float(base["goodput_a3_per_s"].max()), 1e-12)
    best_p99 = float(base["e2e_p99_s"].min())
    v = dict(mean_to_limit=mars["e2e_mean_s"] / r["e2e_mean_s"],
             p95_to_limit=mars["e2e_p95_s"] / r["e2e_p95_s"],
             p99_to_limit=mars["e2e_p99_s"] / r["e2e_p99_s"],
             goodput_to_best=mars["goodput_a3_per_s"] / best_goodput,
             p99_to_best=mars["e2e_p99_s"] / best_p99)
    incomplete = int(mars["num_sessions"] - mars["num_completed"])
    is_ok = (v["mean_to_limit"] <= limit_within and v["p95_to_limit"] <= limit_within
             and v["goodput_to_best"] >= tie and v["p99_to_best"] <= p99_slack and incomplete == 0)
    best = str(base.loc[base["goodput_a3_per_s"].idxmax(), "label"])
    return Verdict(**{k: float(x) for k, x in v.items()}, best_by_goodput=best,
                   num_incomplete=incomplete, is_ok=is_ok,
                   best_mean_to_limit=float(base["e2e_mean_s"].min() / r["e2e_mean_s"]),
                   best_p95_to_limit=float(base["e2e_p95_s"].min() / r["e2e_p95_s"]))


def load_results(out: Path, trace_set: str, seed: int, baselines_from: Path | None) -> pd.DataFrame | None:
    """One (set, seed)'s rows: its own results, plus the baselines and reference of
    ``baselines_from`` for the runs it lacks. None when nothing is there."""
    path = run_dir(out, trace_set, seed) / "results.parquet"
    own = pd.read_parquet(path) if path.exists() else None
    if baselines_from is None:
        return own
    old_path = run_dir(baselines_from, trace_set, seed) / "results.parquet"
    if not old_path.exists():
        return own
    old = pd.read_parquet(old_path)
    if own is None:
        return old
    keep = old[~old["label"].isin(set(own["label"]))]
    return pd.concat([keep, own], ignore_index=True)


def base_rate(results: Path) -> float:
    """The base rate (sessions/s at load 1.0) a previous grid's ``results.parquet`` recorded.

    Raises:
        ValueError: no run at load 1.0 (rerun that grid with ``--loads`` including 1.0).
    """
    df = pd.read_parquet(results)
    at_one = df[(df["load_x"] - 1.0).abs() < 1e-9]
    if at_one.empty:
        raise ValueError(f"{results} has no run at load 1.0; the base rate cannot be read from it")
    return float(at_one["rate_per_s"].iloc[0])


def wanted_labels(policies: str, with_reference: bool) -> set[str]:
    labels = {("mars+adm" if p == "mars" else p) for p in policies.split(",") if p}
    return labels | ({REFERENCE} if with_reference else set())


def is_done(path: Path, labels: set[str], loads: Sequence[float]) -> bool:
    """The results at ``path`` hold every wanted label at every load, all ok."""
    if not path.exists():
        return False
    df = pd.read_parquet(path)
    df = df[df["status"] == "ok"]
    have = {(str(r.label), round(float(r.load_x), 6)) for r in df.itertuples()}
    return all((label, round(x, 6)) in have for label in labels for x in loads)


def compare_command(args: argparse.Namespace, trace_dir: Path, seed: int, out: Path,
                    rate: float | None) -> list[str]:
    """The ``mars-openhands compare`` command line for one (set, seed). Pure."""
    cmd = [sys.executable, "-m", "eval.cli", "compare", "--traces", str(trace_dir),
           "--gpu", args.gpu, "--loads", args.loads, "--seed", str(seed), "--policies", args.policies,
           "--jobs", str(args.jobs), "--out", str(out)]
    if args.cache_dir:
        cmd += ["--cache-dir", args.cache_dir]
    if args.sessions:
        cmd += ["--sessions", str(args.sessions)]
    if args.max_turns:
        cmd += ["--max-turns", str(args.max_turns)]
    if rate is not None:
        cmd += ["--base-rate", repr(rate), "--no-reference"]
    return cmd


def run_grid(args: argparse.Namespace, sets: Sequence[str], seeds: Sequence[int]) -> None:
    """Run every (set, seed) not yet done, one ``compare`` at a time (each uses ``--jobs``).

    Raises:
        FileNotFoundError: ``--baselines-from`` lacks a (set, seed) this grid needs.
        RuntimeError: a ``compare`` failed (its log, ``OUT/<set>/s<seed>.log``, says why).
    """
    root = Path(args.traces_root)
    loads = [float(x) for x in args.loads.split(",")]
    labels = wanted_labels(args.policies, args.baselines_from is None)
    for seed in seeds:
        for trace_set in sets:
            out = run_dir(Path(args.out), trace_set, seed)
            if is_done(out / "results.parquet", labels, loads):
                continue
            rate = None
            if args.baselines_from is not None:
                prior = run_dir(Path(args.baselines_from), trace_set, seed) / "results.parquet"
                if not prior.exists():
                    raise FileNotFoundError(f"--baselines-from has no results for {trace_set} seed "
                                            f"{seed} ({prior}); run the full grid there first")
                rate = base_rate(prior)
            out.mkdir(parents=True, exist_ok=True)
            cmd = compare_command(args, root / trace_set, seed, out, rate)
            print(f"[tracesets] {trace_set} seed {seed}: {' '.join(cmd[2:])}", flush=True)
            log_path = out.parent / f"s{seed}.log"
            with open(log_path, "w") as log:
                rc = run_child(cmd, cwd=REPO, stdout=log, stderr=subprocess.STDOUT)
            if rc != 0:
                raise RuntimeError(f"compare for {trace_set} seed {seed} exited {rc}; see {log_path} "
                                   "(rerun: finished (set, seed) pairs are not run again)")


def _fmt(x: float) -> str:
    return "–" if math.isnan(x) else f"{x:.3f}"


def report(args: argparse.Namespace, sets: Sequence[str], seeds: Sequence[int]) -> int:
    """Print one table per set (rows: seed × load) and the overall count; returns the failures."""
    baselines = Path(args.baselines_from) if args.baselines_from else None
    loads = [float(x) for x in args.loads.split(",")]
    num_fail = num_rows = 0
    summary: list[tuple[str, float, Verdict]] = []
    print("mars ÷ limit (mean, P95, P99 E2E), goodput α=3 mars ÷ best baseline, P99 mars ÷ best baseline's; "
          f"ok = mean, P95 ≤ {args.limit_within}× limit, goodput ≥ {args.tie}× best, "
          f"P99 ≤ {args.p99_slack}× best, all complete")
    for trace_set in sets:
        print(f"\n### {trace_set}\n")
        print("| seed | load | mean ÷ limit | P95 ÷ limit | P99 ÷ limit | goodput ÷ best | P99 ÷ best "
              "| best by goodput | best baseline mean, P95 ÷ limit | incomplete | verdict |")
        print("|---|---|---|---|---|---|---|---|---|---|---|")
        for seed in seeds:
            df = load_results(Path(args.out), trace_set, seed, baselines)
            for x in loads:
                v = None if df is None else judge(df[(df["load_x"] - x).abs() < 1e-9],
                                                  args.limit_within, args.tie, args.p99_slack)
                num_rows += 1
                if v is None:
                    num_fail += 1
                    print(f"| {seed} | {x:g}× | – | – | – | – | – | – | – | – | missing |")
                    continue
                num_fail += not v.is_ok
                summary.append((trace_set, x, v))
                print(f"| {seed} | {x:g}× | {_fmt(v.mean_to_limit)} | {_fmt(v.p95_to_limit)} | "
                      f"{_fmt(v.p99_to_limit)} | {_fmt(v.goodput_to_best)} | {_fmt(v.p99_to_best)} | "
                      f"{v.best_by_goodput} | {_fmt(v.best_mean_to_limit)}, {_fmt(v.best_p95_to_limit)} | "
                      f"{v.num_incomplete} | {'ok' if v.is_ok else 'SHORT'} |")
    print_summary(summary)
    print(f"\n{num_rows - num_fail} of {num_rows} (set, seed, load) points ok")
    return num_fail


def print_summary(rows: Sequence[tuple[str, float, Verdict]]) -> None:
    """One line per (set, load): the mean over seeds of each ratio, and the points ok."""
    print("\n### Mean over seeds\n")
    print("| set | load | mean ÷ limit | P95 ÷ limit | P99 ÷ limit | goodput ÷ best | P99 ÷ best "
          "| best baseline mean, P95 ÷ limit | ok |")
    print("|---|---|---|---|---|---|---|---|---|")
    keys = list(dict.fromkeys((s, x) for s, x, _ in rows))
    for trace_set, x in keys:
        vs = [v for s, lx, v in rows if (s, lx) == (trace_set, x)]

        def avg(name: str, vs: list[Verdict] = vs) -> str:
            return _fmt(sum(getattr(v, name) for v in vs) / len(vs))

        print(f"| {trace_set} | {x:g}× | {avg('mean_to_limit')} | {avg('p95_to_limit')} | "
              f"{avg('p99_to_limit')} | {avg('goodput_to_best')} | {avg('p99_to_best')} | "
              f"{avg('best_mean_to_limit')}, {avg('best_p95_to_limit')} | "
              f"{sum(v.is_ok for v in vs)}/{len(vs)} |")


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default=None, help="grid root: OUT/<set>/s<seed>/ (default runs/tracesets)")
    ap.add_argument("--traces-root", default=str(TRACES_ROOT), help="folder of trace sets (default %(default)s)")
    ap.add_argument("--sets", default=None, help="comma list of folder names (default: all but the bundled)")
    ap.add_argument("--seeds", default=None, help="arrival seeds (default 0,1,2)")
    ap.add_argument("--loads", default="1.0,1.2", help="multipliers of each set's own FCFS knee (default %(default)s)")
    ap.add_argument("--gpu", default="h100_sxm", help="compare --gpu (default %(default)s)")
    ap.add_argument("--policies", default=None,
                    help=f"compare --policies (default: {ALL_POLICIES}; with --baselines-from: mars)")
    ap.add_argument("--baselines-from", default=None,
                    help="a previous grid: reuse its base rates, baselines and reference; run only --policies")
    ap.add_argument("--jobs", type=int, default=2, help="compare --jobs (default %(default)s)")
    ap.add_argument("--cache-dir", default="", help="compare --cache-dir (default: compare's)")
    ap.add_argument("--sessions", type=int, default=None, help="compare --sessions (default 0: all)")
    ap.add_argument("--max-turns", type=int, default=None, help="compare --max-turns (default 0: all)")
    ap.add_argument("--smoke", action="store_true", help="a ~1 min end-to-end check on a trimmed slice "
                    f"({SMOKE['sets']}, seed 0, {SMOKE['sessions']} sessions × {SMOKE['max_turns']} turns)")
    ap.add_argument("--report-only", action="store_true", help="print the table of an existing grid")
    ap.add_argument("--limit-within", type=float, default=1.05,
                    help="mars mean and P95 E2E at most this × the limit's (default %(default)s)")
    ap.add_argument("--tie", type=float, default=0.98,
                    help="mars goodput (α = 3) at least this × the best baseline's (default %(default)s)")
    ap.add_argument("--p99-slack", type=float, default=1.0,
                    help="mars P99 E2E at most this × the best baseline's (default %(default)s)")
    args = ap.parse_args(argv)
    defaults = dict(out="runs/tracesets", sets="", seeds="0,1,2", sessions=0, max_turns=0,
                    policies="mars" if args.baselines_from else ALL_POLICIES)
    for key, value in defaults.items():
        if getattr(args, key) is None:
            setattr(args, key, SMOKE[key] if args.smoke and key in SMOKE else value)
    return args


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    sets = [s for s in args.sets.split(",") if s] or default_sets(Path(args.traces_root))
    seeds = [int(s) for s in args.seeds.split(",") if s]
    if not args.report_only:
        run_grid(args, sets, seeds)
    return 1 if report(args, sets, seeds) else 0


if __name__ == "__main__":
    with sigterm_exits():  # SIGTERM unwinds: the running compare gets it, then its tree ends
        sys.exit(main())
