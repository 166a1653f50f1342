"""The simulator gives the same run in every process: nothing may depend on Python's per-process
string hash (``PYTHONHASHSEED``), e.g. the iteration order of a ``set`` of session or request ids.
Two processes with different hash seeds once gave mars different makespans and preemption counts
on the same workload and seed."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("vllm", reason="the simulator needs vllm")

ROOT = Path(__file__).resolve().parents[3]
RUN = r"""
import hashlib
from datetime import UTC, datetime
from eval.policies import POLICIES
from eval.sim import LinearStepTimeModel, SimConfig, Simulator
from eval.workloads import PoissonArrivals, with_arrivals
from eval.workloads.synth import WorkloadCaps, synthesize
from mars_openhands.engine.harness.inproc_engine import InprocEngineParams
from mars_openhands.stream.transport import ListSink

workload = with_arrivals(synthesize("swebench", 12, 0, caps=WorkloadCaps(max_turns=30)),
                         PoissonArrivals(rate_per_s=0.25), seed=0)
for policy in ("mars", "vllm-tuned"):
    spec = POLICIES[policy]
    engine = InprocEngineParams(num_gpu_blocks=1200, additional_config=dict(spec.additional_config), **spec.engine)
    config = SimConfig(policy=spec.scheduler, engine=engine, seed=0, is_admission_enabled=spec.has_control_plane)
    sink = ListSink()
    result = Simulator(workload, config, LinearStepTimeModel(), sink,
                       wall_origin=datetime(2026, 1, 1, tzinfo=UTC)).run()
    digest = hashlib.sha256("\n".join(e.model_dump_json() for e in sink.events).encode()).hexdigest()
    print(policy, repr(result.makespan_s), result.num_preemptions, digest)
"""


def _run(hash_seed: int) -> str:
    env = {**os.environ, "PYTHONHASHSEED": str(hash_seed), "PYTHONPATH": str(ROOT)}
    done = subprocess.run([sys.executable, "-c", RUN], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=600, check=False)
    assert done.returncode == 0, done.stderr[-2000:]
    return done.stdout


def test_a_run_does_not_depend_on_the_string_hash_seed() -> None:
    first, second = _run(1), _run(2)
    assert len(first.splitlines()) == 2
    assert first == second
