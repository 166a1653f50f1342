"""The simulator with vLLM's host KV tier: a KV-bound synthetic workload runs to the end, host hits
are loaded (the simulator waits for a load's copy while nothing else can run), and the tier changes
the run (the same workload on GPU KV only re-prefills more)."""

from __future__ import annotations

import pytest

pytest.importorskip("vllm")

from eval.sim import LinearStepTimeModel, SimConfig, Simulator  # noqa: E402
from eval.workloads import PoissonArrivals, with_arrivals  # noqa: E402
from eval.workloads.synth import WorkloadCaps, synthesize  # noqa: E402
from mars_openhands.engine.harness.inproc_engine import InprocEngineParams  # noqa: E402
from mars_openhands.engine.harness.offload.copies import Direction  # noqa: E402
from mars_openhands.engine.harness.offload.params import HostKvParams  # noqa: E402


def _run(host_kv: HostKvParams | None) -> Simulator:
    workload = with_arrivals(synthesize("swebench", 6, 0, caps=WorkloadCaps(max_turns=8)),
                             PoissonArrivals(rate_per_s=0.5), seed=0)
    engine = InprocEngineParams(num_gpu_blocks=700, host_kv=host_kv)
    sim = Simulator(workload, SimConfig(policy="fcfs", engine=engine), LinearStepTimeModel())
    result = sim.run()
    assert all(s.end_s is not None for s in result.sessions.values())
    return sim


def test_a_kv_bound_run_loads_host_hits_and_differs_from_gpu_only() -> None:
    tier = HostKvParams(size_gib=4.0, kv_bytes_per_block=16 * 98_304)
    with_tier = _run(tier)
    assert with_tier.engine.host_kv is not None
    copies = with_tier.engine.host_kv.worker.history
    loads = [c for c in copies if c.direction is Direction.LOAD]
    assert loads and any(c.direction is Direction.STORE for c in copies)
    for c in loads:
        assert c.done_s - c.submit_s >= c.num_bytes / 50e9 * (1 - 1e-9)
    gpu_only = _run(None)
    assert with_tier.now_s != gpu_only.now_s


@pytest.mark.parametrize("name", ["thunderagent-offload", "continuum-offload", "mars-offload"])
def test_each_offload_variant_runs_with_the_connector_and_loads_host_hits(name: str) -> None:
    # The policy's own scheduler over vLLM's OffloadingConnector: every session ends, and a
    # session whose prefix left the GPU (unpinned, displaced or preempted) loads it from the host.
    from eval.policies import POLICIES

    spec = POLICIES[name]
    assert spec.host_kv is not None
    tier = HostKvParams(size_gib=4.0, kv_bytes_per_block=16 * 98_304, **spec.host_kv)
    workload = with_arrivals(synthesize("swebench", 6, 0, caps=WorkloadCaps(max_turns=8)),
                             PoissonArrivals(rate_per_s=0.5), seed=0)
    engine = InprocEngineParams(num_gpu_blocks=700, host_kv=tier, additional_config=dict(spec.additional_config))
    sim = Simulator(workload, SimConfig(policy=spec.scheduler, engine=engine), LinearStepTimeModel())
    result = sim.run()
    assert all(s.end_s is not None for s in result.sessions.values())
    assert sim.engine.scheduler.connector is not None
    assert sim.engine.host_kv is not None
    loads = [c for c in sim.engine.host_kv.worker.history if c.direction is Direction.LOAD]
    assert loads
