"""The admission window's KV signal with a host tier (control/routing.py ``kv_pool_usage``): a
session displaced from the GPU keeps its KV on the host and resumes by a copy, so the window reads
usage over the GPU + host pool; engines report their tier in ``engine_step.num_host_blocks``."""

from __future__ import annotations

import pytest

GPU_BLOCKS, HOST_GIB, BLOCK_BYTES = 700, 4.0, 16 * 98_304


def _run(policy: str):  # -> (engine_step events, admission_update events)
    pytest.importorskip("vllm")
    from eval.runs import sim_config
    from eval.sim import LinearStepTimeModel, Simulator
    from eval.sweep_options import CompareOptions
    from eval.workloads import PoissonArrivals, with_arrivals
    from eval.workloads.synth import WorkloadCaps, synthesize
    from mars_openhands.stream.transport import ListSink

    # KV-bound, as test_sim_host_kv_free.py: six sessions of up to 8 turns on 700 blocks.
    options = CompareOptions(policies=(policy,), num_gpu_blocks=GPU_BLOCKS, host_kv_gib=HOST_GIB,
                             host_kv_bytes_per_block=BLOCK_BYTES)
    workload = with_arrivals(synthesize("swebench", 6, 0, caps=WorkloadCaps(max_turns=8)),
                             PoissonArrivals(rate_per_s=0.5), seed=0)
    sink = ListSink(kinds=frozenset({"engine_step", "admission_update", "finished"}))
    result = Simulator(workload, sim_config(options, policy, True), LinearStepTimeModel(), sink).run()
    assert all(s.end_s is not None for s in result.sessions.values())
    steps = [e for e in sink.events if e.kind == "engine_step"]
    updates = [e for e in sink.events if e.kind == "admission_update"]
    return steps, updates


def test_the_window_reads_kv_usage_over_the_gpu_and_the_host_tier() -> None:
    host_blocks = int(HOST_GIB * 2**30 // BLOCK_BYTES)
    share = GPU_BLOCKS / (GPU_BLOCKS + host_blocks)
    steps, updates = _run("mars-offload")
    assert {e.num_host_blocks for e in steps} == {host_blocks}
    assert max(e.num_used_blocks for e in steps) / GPU_BLOCKS > 0.5  # the GPU pool is busy
    assert max(u.kv_usage for u in updates) <= share + 1e-9
    # The same run without the tier reads GPU usage alone: well above the pool's share.
    gpu_steps, gpu_updates = _run("mars")
    assert {e.num_host_blocks for e in gpu_steps} == {0}
    assert max(u.kv_usage for u in gpu_updates) > 2 * share
