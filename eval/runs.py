"""One run of a sweep: what it is (:class:`Run`, :func:`plan`), what a worker does for it (a knee
probe, a chunk of ideal times, a simulated run) and the metrics row it yields.

The worker-side tasks (:func:`probe_task`, :func:`ideal_task`, :func:`run_task`,
:func:`probe_run_task`) are module-level functions of picklable arguments, so :class:`eval.pool.Pool`
can run them in other processes; they build the simulator's config themselves, so the parent never
imports vLLM. A knee probe runs under :class:`_SlowdownGuard`, which stops it once its mean slowdown
must exceed the bound. :func:`one_run` turns a run's events into its per-session Parquet and its row
of ``results.parquet`` (:data:`eval.report.RESULT_COLUMNS`).
"""

from __future__ import annotations

import logging
import math
import os
import time
import traceback
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pandas as pd

from eval.metrics import admission_wait_s, compute_metrics, session_table
from eval.policies import POLICIES, admission_modes, policy_additional_config
from eval.report import RESULT_COLUMNS, goodput_column, ttft_share_column
from eval.sweep_options import CompareOptions, real_timer
from eval.workloads import PoissonArrivals, Workload, with_arrivals
from mars_openhands.policy.admission import AdmissionParams
from mars_openhands.stream.reader import events_to_frame
from mars_openhands.stream.transport import ListSink

__all__ = [
    "METRIC_KINDS",
    "Run",
    "ideal_task",
    "live_execute",
    "one_run",
    "plan",
    "probe_run_task",
    "probe_task",
    "replica_fields",
    "results_frame",
    "run_task",
    "sim_config",
    "slowdown_text",
]

METRIC_KINDS = frozenset({"session_start", "session_end", "finished", "first_token", "first_scheduled", "preempted",
                          "tool_start", "tool_end", "kv_released", "kv_retained"})
"""Event kinds the metrics read (``engine_step``/``admission_update`` are dropped before framing)."""


@dataclass(frozen=True)
class Run:
    """One run of a sweep: ``policy`` with or without the admission window at one load on one GPU."""

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


def sim_config(options: CompareOptions, policy: str, is_admission_enabled: bool,
               num_gpu_blocks: int | None = None) -> Any:
    """The ``eval.sim.SimConfig`` of ``policy``'s runs (its scheduler, engine settings and admission
    window; KV ``num_gpu_blocks``, default ``options.num_gpu_blocks``)."""
    from eval.sim import SimConfig  # vLLM (~20 s): imported only where runs are simulated
    from mars_openhands.engine.harness.inproc_engine import InprocEngineParams  # vLLM, as above
    from mars_openhands.engine.harness.offload.params import HostKvParams

    spec = POLICIES[policy]
    host_kv = None
    if spec.host_kv is not None:
        host_kv = HostKvParams(size_gib=options.host_kv_gib, kv_bytes_per_block=options.host_kv_bytes_per_block,
                               **spec.host_kv)
    blocks = num_gpu_blocks or options.num_gpu_blocks
    engine = InprocEngineParams(num_gpu_blocks=blocks,
                                additional_config=policy_additional_config(policy, options.mars_config),
                                host_kv=host_kv, **spec.engine)
    # A mix of GPU profiles: each replica its own KV (at least ``blocks``: the unbounded reference's)
    replica_engines = tuple(engine.model_copy(update={"num_gpu_blocks": max(b, blocks)})
                            for b in options.replica_blocks) if options.num_replicas > 1 else ()
    return SimConfig(policy=spec.scheduler, engine=engine, replica_engines=replica_engines,
                     num_tool_workers=options.num_tool_workers,
                     is_admission_enabled=is_admission_enabled, seed=options.seed,
                     admission=AdmissionParams(**spec.admission),
                     max_virtual_s=options.max_virtual_s, num_replicas=options.num_replicas,
                     router=options.router, lose_replica=options.lose_replica,
                     kv_transfer_gb_s=options.kv_transfer_gb_s,
                     kv_bytes_per_token=options.kv_bytes_per_token if options.kv_transfer_gb_s else None)


def arrivals(rate_per_s: float, options: CompareOptions) -> PoissonArrivals:
    """The Poisson arrivals of a run at ``rate_per_s`` per GPU: ``rate x num_replicas`` in all. Pure."""
    return PoissonArrivals(rate_per_s=rate_per_s * options.num_replicas)


def stream_frame(events: Sequence[Any]) -> pd.DataFrame:
    """The metric events (:data:`METRIC_KINDS`) of ``events`` as a stream frame. Pure."""
    return events_to_frame(e for e in events if e.kind in METRIC_KINDS)


def _metrics_row(run: Run, stream: pd.DataFrame, ideal_s: Mapping[str, float],
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
    kinds = METRIC_KINDS

    def __init__(self, ideal_s: Mapping[str, float], bound: float, *, is_keeping_events: bool = False,
                 cancel_path: str | None = None) -> None:
        self.events: list[Any] | None = [] if is_keeping_events else None
        """Every event seen, when kept (a stable probe's stream is a run's: the sweep's ``_runs``)."""
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


def probe_task(workload: Workload, options: CompareOptions, policy: str, is_admission_enabled: bool,
               rate_per_s: float, timer: Any, num_gpu_blocks: int, ideal_s: Mapping[str, float],
               simulate_fn: Callable[..., Any] | None = None, is_keeping_stream: bool = False,
               cancel_path: str | None = None) -> tuple[float, float, pd.DataFrame | None]:
    """One knee-search probe (worker side): ``(mean slowdown at rate_per_s, wall seconds, stream)``;
    the slowdown is ``inf`` if a session did not finish, the virtual clock passed ``max_virtual_s``
    or the guard proved it unstable (see :class:`_SlowdownGuard`). An engine that stalls raises
    (:class:`eval.sim.EngineStalled`): a bug or an impossible prompt is not an overloaded rate. ``stream``: with
    ``is_keeping_stream``, a stable probe's metric events (:func:`stream_frame`: the stream a
    sweep run with the same policy, rate and seed records); else ``None``. ``cancel_path``: stop
    early (slowdown ``inf``, to be discarded) once this file exists."""
    t0 = time.monotonic()
    slowdown, events = _probe_slowdown(workload, options, policy, is_admission_enabled, rate_per_s, timer,
                                       num_gpu_blocks, ideal_s, simulate_fn, is_keeping_stream, cancel_path)
    stream = (stream_frame(events) if events is not None and slowdown <= options.knee_slowdown else None)
    return slowdown, time.monotonic() - t0, stream


def slowdown_text(slowdown: float, bound: float) -> str:
    """A probe's mean slowdown for the summary; ``inf`` (stopped early, or a session never finished)
    reads as ``"> <bound> (stopped)"``. Pure.

    >>> slowdown_text(1.4271, 2.0), slowdown_text(math.inf, 2.0)
    ('1.43', '> 2 (stopped)')
    """
    return f"{slowdown:.3g}" if math.isfinite(slowdown) else f"> {bound:g} (stopped)"


def _probe_slowdown(workload: Workload, options: CompareOptions, policy: str, is_admission_enabled: bool,
                    rate_per_s: float, timer: Any, num_gpu_blocks: int, ideal_s: Mapping[str, float],
                    simulate_fn: Callable[..., Any] | None,
                    is_keeping_events: bool = False, cancel_path: str | None = None) -> tuple[float, list[Any] | None]:
    from eval import sim  # vLLM (~20 s): imported only where runs are simulated

    arrived = with_arrivals(workload, arrivals(rate_per_s, options), seed=options.seed)
    config = sim_config(options, policy, is_admission_enabled, num_gpu_blocks)
    guard = _SlowdownGuard(ideal_s, options.knee_slowdown, is_keeping_events=is_keeping_events,
                           cancel_path=cancel_path)
    try:
        result = (simulate_fn or sim.simulate)(arrived, config, real_timer(timer), guard)
    except _Unstable:
        return math.inf, None
    except sim.SimulationOverrun as e:  # overloaded: unstable, not an error (a stall raises on)
        logging.getLogger(__name__).debug("probe at %.4g/s: %s", rate_per_s, e)
        return math.inf, None
    e2e = {sid: rec.e2e_s for sid, rec in result.sessions.items()}
    if any(v is None for v in e2e.values()):
        return math.inf, None
    return sum(v / ideal_s[sid] for sid, v in e2e.items()) / len(e2e), guard.events


def ideal_task(workload: Workload, options: CompareOptions, num_gpu_blocks: int, timer: Any) -> dict[str, float]:
    """Ideal E2E of a chunk of sessions under FCFS without admission (worker side;
    :func:`eval.sim.ideal_times_s`). The config is built here: the parent need not import vLLM."""
    from eval import sim  # vLLM (~20 s): imported only where runs are simulated

    # Alone on an idle system a session runs on one replica: the ideal is one engine's (the
    # replicas share one GPU profile).
    alone = options.model_copy(update={"num_replicas": 1, "lose_replica": None, "replica_blocks": (),
                                       "kv_transfer_gb_s": None})
    if isinstance(timer, tuple):  # a mix of GPU profiles: alone on the first replica's
        timer, num_gpu_blocks = timer[0], (options.replica_blocks or (num_gpu_blocks,))[0]
    return sim.ideal_times_s(workload, sim_config(alone, "fcfs", False, num_gpu_blocks), real_timer(timer))


def run_task(run: Run, workload: Workload, options: CompareOptions, timer: Any, num_gpu_blocks: int,
             ideal_s: Mapping[str, float], out_dir: Path,
             simulate_fn: Callable[..., Any] | None = None) -> dict[str, Any]:
    """One sweep run (worker side): simulate, write its per-session Parquet, return the row's
    metrics and ``"_e2e"`` (completed sessions' E2E) or ``status: failed`` with the error."""
    from eval import sim  # vLLM (~20 s): imported only where runs are simulated

    results: list[Any] = []

    def execute(arrived: Workload) -> Sequence[Any]:
        sink = ListSink(kinds=METRIC_KINDS)
        config = sim_config(options, run.policy, run.is_admission_enabled, num_gpu_blocks)
        results.append((simulate_fn or sim.simulate)(arrived, config, real_timer(timer), sink))
        return sink.events

    row = one_run(run, workload, options, ideal_s, execute, out_dir)
    if results and row.get("status") != "failed" and options.num_replicas > 1:
        row.update(replica_fields(results[0]))
    return row


def replica_fields(result: Any) -> dict[str, Any]:
    """The routing and replica-loss counters of a several-replica :class:`~eval.sim.SimResult`, as
    results-table columns: ``num_rehomes`` (sessions the router moved off a live replica),
    ``kv_transfer_tokens`` (KV the moves sent along, ``--kv-transfer-gbps``; only when some) and,
    when a replica was lost (``--lose-replica``), ``lost_replica``, ``lost_at_s``,
    ``loss_sessions_replaced``, ``loss_turns_failed``, ``loss_reprefill_tokens`` (context prefilled
    again elsewhere) and ``loss_requests_aborted`` (its engine's requests, aborted and then checked
    for leaked KV blocks: a leak fails the run). Pure."""
    fields: dict[str, Any] = {"num_rehomes": getattr(result, "num_rehomes", 0)}
    if getattr(result, "num_kv_transfer_tokens", 0):
        fields["kv_transfer_tokens"] = result.num_kv_transfer_tokens
    loss = getattr(result, "replica_loss", None)
    if loss is not None:
        fields.update(lost_replica=loss.index, lost_at_s=loss.at_s,
                      loss_sessions_replaced=loss.num_sessions_replaced,
                      loss_turns_failed=loss.num_turns_failed,
                      loss_reprefill_tokens=loss.num_reprefill_tokens,
                      loss_requests_aborted=loss.num_requests_aborted)
    return fields


def probe_run_task(run: Run, workload: Workload, stream: pd.DataFrame, probe_wall_s: float,
                   options: CompareOptions, ideal_s: Mapping[str, float], out_dir: Path) -> dict[str, Any]:
    """A sweep run that a stable knee probe already ran (same policy, admission, GPU, rate and
    seed: the same simulation): its row and per-session Parquet from the probe's ``stream``;
    ``wall_s`` is the probe's."""
    row = one_run(run, workload, options, ideal_s, lambda _: stream, out_dir)
    if row.get("status") != "failed":
        row["wall_s"] = probe_wall_s + row["wall_s"]
    return row


def plan(options: CompareOptions, base_rate_per_s: float | None, gpu: str = "",
         is_gpu_in_id: bool = False) -> list[Run]:
    """Every run of ``options`` on one GPU, load by load (policies in order, then admission modes);
    a load is a multiple of ``base_rate_per_s`` (``nan`` rates when it is None), or sessions/s with
    ``options.is_absolute_rates``. Pure."""
    runs = []
    for load in options.loads:
        rate = load if options.is_absolute_rates else load * (base_rate_per_s or math.nan)
        runs += [Run(p, adm, load, rate, gpu, is_gpu_in_id) for p in options.policies
                 for adm in admission_modes(options.admission, p)]
    return runs


def live_execute(live: Any, run: Run, seed: int) -> Callable[[Workload], Sequence[Any]]:
    """Workload with arrivals -> the events (modelled time) of one run on a live backend."""
    return lambda arrived: live.run(run.policy, run.is_admission_enabled, arrived, seed)


def one_run(run: Run, workload: Workload, options: CompareOptions, ideal_s: Mapping[str, float],
            execute: Callable[[Workload], Sequence[Any] | pd.DataFrame], out_dir: Path) -> dict[str, Any]:
    """Execute one run, write its per-session Parquet; a raised error becomes a failed row.

    ``execute`` maps the workload with arrivals to the run's events, or to their metric-event
    frame (:func:`stream_frame`).

    Returns:
        The row's metric fields, ``wall_s`` and ``"_e2e"`` (completed sessions' E2E, for the CDF
        plot; popped by the caller), or ``status``/``error``/``wall_s`` of a failed run.
    """
    t0 = time.monotonic()
    try:
        arrived = with_arrivals(workload, arrivals(run.rate_per_s, options), seed=options.seed)
        stream = execute(arrived)
        if not isinstance(stream, pd.DataFrame):
            stream = stream_frame(stream)
        row, table = _metrics_row(run, stream, ideal_s, options.alphas)
        # through a temporary name: a worker stopped mid-write (Ctrl-C) leaves no partial Parquet
        tmp = out_dir / f"{run.run_id}.parquet.tmp"
        table.reset_index().to_parquet(tmp, index=False)
        tmp.replace(out_dir / f"{run.run_id}.parquet")
        row["_e2e"] = table.loc[table["is_complete"], "e2e_s"].tolist()
        row["wall_s"] = time.monotonic() - t0
        return row
    except Exception as e:  # noqa: BLE001 - record and continue with the other runs
        error = f"{type(e).__name__}: {e}\n{traceback.format_exc(limit=3)}"
        return {"status": "failed", "error": error, "wall_s": time.monotonic() - t0}


def results_frame(rows: list[dict[str, Any]], alphas: Sequence[float]) -> pd.DataFrame:
    """``rows`` as the results table: :data:`eval.report.RESULT_COLUMNS`, a goodput column per
    alpha, then any other keys of the rows. Pure."""
    columns = list(RESULT_COLUMNS) + [goodput_column(a) for a in sorted(set(alphas)) if
                                      goodput_column(a) not in RESULT_COLUMNS]
    extra = [c for c in dict.fromkeys(k for r in rows for k in r) if c not in columns]
    return pd.DataFrame(rows).reindex(columns=columns + extra)

