"""``compare --jobs 2``: the sweep in worker processes (forkserver) gives the in-process results.

Worker processes are real processes that import vLLM (~10-30 s on this 2-core box), hence an
integration test; the workload is tiny (3 sessions x 3 turns, linear step times, given ideals).
"""

from __future__ import annotations

import sys
from pathlib import Path

import pandas as pd
import pytest

sys.path.insert(0, str(Path(__file__).parents[1] / "unit" / "eval"))
from compare_helpers import small_workload  # noqa: E402

from eval.sweep import run_sweep  # noqa: E402
from eval.sweep_options import CompareOptions, GpuSetup  # noqa: E402

pytestmark = [pytest.mark.integration, pytest.mark.timeout(600)]


def test_worker_processes_give_the_serial_results(tmp_path: Path) -> None:
    sim = pytest.importorskip("eval.sim", reason="needs the engine env")

    workload = small_workload(3, 3)
    ideal = {s.session_id: 1.0 for s in workload.sessions}
    options = CompareOptions(policies=("fcfs", "continuum"), loads=(1.0, 2.0), num_gpu_blocks=512,
                             base_rate_per_s=1.0)
    setup = (GpuSetup("g", sim.LinearStepTimeModel(), 512),)
    serial = run_sweep(workload, options, setup, tmp_path / "serial", ideal_s=ideal, jobs=1)
    parallel = run_sweep(workload, options, setup, tmp_path / "parallel", ideal_s=ideal, jobs=2)
    columns = ["run_id", "status", "e2e_mean_s", "e2e_p99_s", "num_preemptions", "reprefill_tokens"]
    assert (parallel["status"] == "ok").all(), parallel["error"].tolist()
    pd.testing.assert_frame_equal(serial[columns], parallel[columns])
    assert sorted(p.name for p in (tmp_path / "parallel").glob("*__load*.parquet")) == sorted(
        f"{r}.parquet" for r in serial["run_id"])
