"""A knee probe that meets a fault is a failed search, never an unstable rate (eval/runs.py,
eval/knee.py, eval/sweep.py, eval/plan.py).

The class of the bug: ``_probe_slowdown`` counted every ``RuntimeError`` of the simulator as "unstable",
so an engine stall (a scheduler or simulator bug; the host tier's false stall of December 2026
was one) silently lowered a policy's capacity at SLO. Only an overrun of ``max_virtual_s`` (or the
guard's proof) is a load effect; a stall must fail the search visibly and leave the other
policies' searches running.
"""

from __future__ import annotations

import math

import pandas as pd
import pytest
from compare_helpers import small_workload

import eval.runs as runs
from eval.knee import KneeSearch
from eval.plan import plan_table, render_plan
from eval.sweep import run_sweep
from eval.sweep_options import CompareOptions, GpuSetup
from eval.workloads.format import Session, Turn, Workload, WorkloadMeta


def _raising(sim, error: Exception, scheduler: str | None = None):
    """A simulate_fn that raises ``error`` for ``scheduler`` (every policy if ``None``)."""
    def simulate(w, config, timer, sink=None):
        if scheduler is None or config.policy == scheduler:
            raise error
        return sim.simulate(w, config, timer, sink)
    return simulate


def test_a_stalled_probe_raises_and_an_overrun_is_unstable(sim) -> None:
    workload = small_workload(3, 2)
    ideal = {s.session_id: 1.0 for s in workload.sessions}
    args = (workload, CompareOptions(num_gpu_blocks=512), "fcfs", False, 1.0, sim.LinearStepTimeModel(), 512, ideal)
    with pytest.raises(sim.EngineStalled, match="engine stalled"):
        runs.probe_task(*args, _raising(sim, sim.EngineStalled("engine stalled at t=9 s")))
    slowdown, _, stream = runs.probe_task(*args, _raising(sim, sim.SimulationOverrun("passed max_virtual_s")))
    assert slowdown == math.inf and stream is None
    with pytest.raises(RuntimeError, match="no pending event"):  # any other fault raises too
        runs.probe_task(*args, _raising(sim, RuntimeError("no pending event; this is a bug")))


def test_a_prompt_larger_than_the_kv_cache_is_a_stall_not_an_unstable_rate(sim) -> None:
    # A real stall of the simulator, no fake: 64 blocks of 16 tokens cannot hold a 4,000-token prompt.
    big = Workload(meta=WorkloadMeta(source="test"), sessions=(
        Session(session_id="big", arrival_s=0.0, turns=(Turn(prompt_tokens_appended=4000, output_tokens=4),)),))
    options = CompareOptions(num_gpu_blocks=64)
    with pytest.raises(sim.EngineStalled):
        runs.probe_task(big, options, "fcfs", False, 1.0, sim.LinearStepTimeModel(), 64, {"big": 1.0})


def test_a_failed_knee_search_is_done_has_no_capacity_and_says_why() -> None:
    search = KneeSearch(0.01, 2.0, 8, 1.05, "mars")
    (rate,) = search.next_rates(1)
    search.record(rate, 1.2)
    (rate,) = search.next_rates(1)
    search.fail(rate, "EngineStalled: engine stalled at t=40 s")
    assert search.is_done and search.next_rates(4) == []
    result = search.result()
    assert result.error == f"the probe at {rate:.4g}/s failed: EngineStalled: engine stalled at t=40 s"
    assert result.how.startswith("mars knee search FAILED after 1 runs: the probe at")


@pytest.mark.parametrize("jobs", [1, 2])  # in-process probes, and probes in worker processes
def test_a_stall_in_one_policys_search_fails_that_search_only_and_is_reported(tmp_path, sim, capsys, jobs) -> None:
    options = CompareOptions(policies=("fcfs", "continuum"), loads=(1.0,), num_gpu_blocks=512,
                             search_max_runs=3, is_capacity=True)
    stall = sim.EngineStalled("engine stalled at t=12.000 s: 1 running, 1 waiting")
    results = run_sweep(small_workload(3, 3), options, (GpuSetup("g", sim.LinearStepTimeModel(), 512),), tmp_path,
                        simulate_fn=_raising(sim, stall, "ContinuumScheduler"), jobs=jobs)
    capacity = pd.read_parquet(tmp_path / "capacity.parquet").set_index("label")
    assert math.isnan(capacity.at["continuum", "capacity_per_s"])
    assert "EngineStalled: engine stalled at t=12.000 s" in capacity.at["continuum", "error"]
    assert capacity.at["fcfs", "capacity_per_s"] > 0 and capacity.at["fcfs", "error"] == ""
    assert "continuum's the probe at" in capsys.readouterr().err
    assert "| continuum | FAILED: the probe at" in (tmp_path / "summary.md").read_text()
    assert (results.set_index("label")["status"].to_dict() == {"fcfs": "ok", "continuum": "failed"})
    # The plan's table and text carry it; the plan exits 1 on it (eval/plan.py)
    table = plan_table(results, capacity.reset_index(), ("fcfs", "continuum"))
    row = table.set_index("label").loc["continuum"]
    assert "engine stalled" in row["capacity_error"] and math.isnan(row["capacity_per_s"])
    assert "| continuum | FAILED: the probe at" in render_plan(table, {})


def test_a_stall_in_the_fcfs_base_rate_search_stops_the_sweep_with_the_reason(tmp_path, sim) -> None:
    options = CompareOptions(policies=("fcfs",), loads=(1.0,), num_gpu_blocks=512, search_max_runs=3)
    with pytest.raises(RuntimeError, match="FCFS knee search on g failed: the probe at .* engine stalled"):
        run_sweep(small_workload(3, 2), options, (GpuSetup("g", sim.LinearStepTimeModel(), 512),), tmp_path,
                  simulate_fn=_raising(sim, sim.EngineStalled("engine stalled at t=1 s")))
