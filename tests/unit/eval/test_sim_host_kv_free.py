"""``mars-offload-free``, the tier bound (eval/policies.py ``is_tier_bound``): its registry place (a
reference: not a baseline, not in ``--policies all``, never added as an offload variant) and, in the
simulator, that its copies are free (each takes ~0 s, no step slows) while everything else is
mars-offload's, so on a KV-bound run it is at least as fast."""

from __future__ import annotations

import statistics

import pytest

from eval.policies import (
    DEFAULT_POLICIES,
    OFFLOAD_VARIANTS,
    POLICIES,
    TIER_BOUNDS,
    parse_policies,
    reference_tag,
    with_host_kv_policies,
)

FREE = "mars-offload-free"


def test_the_tier_bound_is_a_reference_not_a_policy() -> None:
    spec, priced = POLICIES[FREE], POLICIES["mars-offload"]
    assert TIER_BOUNDS == (FREE,) and spec.is_tier_bound and not spec.is_kv_unbounded
    assert not spec.is_baseline and FREE not in DEFAULT_POLICIES and FREE not in parse_policies("all")
    assert FREE not in OFFLOAD_VARIANTS.values() and OFFLOAD_VARIANTS["mars"] == "mars-offload"
    assert FREE not in with_host_kv_policies(("fcfs", "mars")) and parse_policies(FREE) == (FREE,)
    # mars-offload but for the copies: the same scheduler, settings, control plane and eviction.
    assert (spec.scheduler, dict(spec.additional_config), spec.has_control_plane, dict(spec.admission)) == (
        priced.scheduler, dict(priced.additional_config), priced.has_control_plane, dict(priced.admission))
    assert spec.host_kv is not None and priced.host_kv is not None
    assert spec.host_kv["eviction"] == priced.host_kv["eviction"]
    assert (reference_tag(FREE), reference_tag("unbounded-kv"), reference_tag("mars-offload")) == (
        "free copies (tier bound)", "limit", None)


def test_plan_and_compare_accept_it_and_the_scope_names_free_copies() -> None:
    from eval.compare import host_kv_note
    from eval.plan import _policies
    from eval.sweep_options import CompareOptions

    assert _policies(f"mars,{FREE}", has_host_kv=True) == ("mars", "mars-offload", FREE, "unbounded-kv")
    note = host_kv_note(CompareOptions(policies=("mars-offload", FREE), num_gpu_blocks=2, host_kv_gib=256.0))
    assert note.startswith("Host KV tier: 256 GiB for mars-offload (vLLM native offload; copies 50 GB/s")
    assert f"; {FREE} with free copies (tier bound: 1e+06 GB/s each way, steps x1)." in note


def _run(policy: str):  # -> (eval.sim.Simulator, its mean session E2E in s)
    pytest.importorskip("vllm")
    from eval.runs import sim_config
    from eval.sim import LinearStepTimeModel, Simulator
    from eval.sweep_options import CompareOptions
    from eval.workloads import PoissonArrivals, with_arrivals
    from eval.workloads.synth import WorkloadCaps, synthesize

    # KV-bound (700 blocks for six sessions of up to 8 turns), as test_sim_host_kv.py: sessions'
    # prefixes leave the GPU and come back from the host.
    options = CompareOptions(policies=(policy,), num_gpu_blocks=700, host_kv_gib=4.0,
                             host_kv_bytes_per_block=16 * 98_304)
    workload = with_arrivals(synthesize("swebench", 6, 0, caps=WorkloadCaps(max_turns=8)),
                             PoissonArrivals(rate_per_s=0.5), seed=0)
    sim = Simulator(workload, sim_config(options, policy, False), LinearStepTimeModel())
    result = sim.run()
    assert all(s.end_s is not None for s in result.sessions.values())
    return sim, statistics.fmean(result.e2e_s())


def test_its_copies_are_free_and_it_is_no_slower_than_mars_offload() -> None:
    from mars_openhands.engine.harness.offload.copies import Direction

    (free, free_e2e_s), (priced, priced_e2e_s) = _run(FREE), _run("mars-offload")
    assert free.engine.host_kv is not None and priced.engine.host_kv is not None
    copies = free.engine.host_kv.worker.history
    assert any(c.direction is Direction.LOAD for c in copies) and any(c.direction is Direction.STORE for c in copies)
    total_bytes = sum(c.num_bytes for c in copies)
    # Every copy at >= 10^5 GB/s (the priced tier's are at <= 50 GB/s), all of them within 1 ms.
    assert all(c.done_s - c.submit_s <= c.num_bytes / 1e14 + 1e-12 for c in copies)
    assert sum(c.done_s - c.submit_s for c in copies) < 1e-3, f"{len(copies)} copies of {total_bytes:,} bytes"
    assert free.engine.host_kv.params.copy_slowdown == 1.0  # no step runs slower while copying
    priced_s = sum(c.done_s - c.submit_s for c in priced.engine.host_kv.worker.history)
    assert priced_s > 1e-3, "the priced tier's copies take time: the workload must move KV"
    assert free_e2e_s <= priced_e2e_s, (free_e2e_s, priced_e2e_s)
