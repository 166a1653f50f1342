"""Workloads for replay and simulation (design.md §8): format, trace loader, generators, arrivals.

* :mod:`eval.workloads.format`: the versioned :class:`Workload` / :class:`Session` / :class:`Turn`
  models and atomic JSON/JSONL file I/O.
* :mod:`eval.workloads.traces`: mini-swe-agent trajectories → workload.
* :mod:`eval.workloads.synth`: calibrated SWE-bench-, GitTaskBench-, Terminal-Bench- and
  RepoBench-like generators.
* :mod:`eval.workloads.arrivals`: fixed-rate, Poisson and burst arrival processes.
* :mod:`eval.workloads.transform`: trim/scale helpers; :mod:`eval.workloads.stats`: distributions.
* :mod:`eval.workloads.cli`: the ``mars-openhands workload`` subcommand.
"""

from eval.workloads.arrivals import (
    ArrivalProcess,
    BurstArrivals,
    FixedRateArrivals,
    PoissonArrivals,
    arrival_times_s,
    with_arrivals,
)
from eval.workloads.format import (
    FORMAT_VERSION,
    Session,
    Turn,
    Workload,
    WorkloadFormatError,
    WorkloadMeta,
    load_workload,
    save_workload,
)
from eval.workloads.synth import SYNTH_KINDS, WorkloadCaps, synthesize
from eval.workloads.traces import load_trace_dir, load_trajectory
from eval.workloads.transform import cap_session, draw_sessions, scale_workload, trim_workload

__all__ = [
    "FORMAT_VERSION",
    "SYNTH_KINDS",
    "ArrivalProcess",
    "BurstArrivals",
    "FixedRateArrivals",
    "PoissonArrivals",
    "Session",
    "Turn",
    "Workload",
    "WorkloadCaps",
    "WorkloadFormatError",
    "WorkloadMeta",
    "arrival_times_s",
    "cap_session",
    "draw_sessions",
    "load_trace_dir",
    "load_trajectory",
    "load_workload",
    "save_workload",
    "scale_workload",
    "synthesize",
    "trim_workload",
    "with_arrivals",
]
