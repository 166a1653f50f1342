"""Merged runs with vLLM's host KV tier are exact: a KV-bound tier workload (stores, host hits and
loads) run one ``schedule()`` per step (``MARS_SIM_FAST_PATHS=0``, ``coalesce_max_steps=1``) and
with merged runs makes the same decisions at the same virtual times, to the last bit, and moves
the same copies at the same times (eval/sim.py, engine/harness/inproc_engine.py ``plan_run``)."""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Any

import pytest
from compare_helpers import growing_sessions, sim_fingerprint

pytest.importorskip("vllm")

from eval.policies import POLICIES  # noqa: E402
from eval.sim import FAST_PATHS_ENV, LinearStepTimeModel, SimConfig, SimResult, Simulator  # noqa: E402
from eval.workloads.format import Workload  # noqa: E402
from mars_openhands.engine.harness.inproc_engine import InprocEngineParams  # noqa: E402
from mars_openhands.engine.harness.offload.copies import Direction  # noqa: E402
from mars_openhands.engine.harness.offload.params import HostKvParams  # noqa: E402
from mars_openhands.policy.admission import AdmissionParams  # noqa: E402
from mars_openhands.stream.transport import ListSink  # noqa: E402

NUM_BLOCKS = 160
"""2,560 tokens of KV for sessions that grow to ~1,800 tokens each: requests wait, are preempted,
and sessions' prefixes leave the GPU (stored to the host, loaded back)."""

ORIGIN = datetime(2026, 1, 1, tzinfo=UTC)


def _workload() -> Workload:
    """Sessions with long decodes (merged decode runs) and tool gaps (their prefixes go to the host
    while they wait)."""
    return growing_sessions(output_tokens=(90, 13), tool_s=(0.2, 0.15))


def _config(policy: str, mars: dict[str, Any] | None = None, **tier: Any) -> SimConfig:
    spec = POLICIES[policy]
    assert spec.host_kv is not None
    host_kv = HostKvParams(size_gib=1.0, kv_bytes_per_block=16 * 98_304, **{**spec.host_kv, **tier})
    additional = {"mars": mars} if mars is not None else dict(spec.additional_config)
    return SimConfig(policy=spec.scheduler, num_tool_workers=3, is_admission_enabled=spec.has_control_plane,
                     admission=AdmissionParams(cpu_set_backlog_ratio=4.0, **spec.admission),
                     engine=InprocEngineParams(num_gpu_blocks=NUM_BLOCKS, max_model_len=4096, host_kv=host_kv,
                                               additional_config=additional, **spec.engine))


def _fingerprint(sim: Simulator, result: SimResult, sink: ListSink) -> tuple[Any, ...]:
    host_kv = sim.engine.host_kv
    assert host_kv is not None
    return (*sim_fingerprint(result, sink.events), list(host_kv.worker.history))


def _run(monkeypatch: pytest.MonkeyPatch, config: SimConfig, *, merged: bool,
         workload: Workload | None = None) -> tuple[Simulator, SimResult, Any]:
    monkeypatch.setenv(FAST_PATHS_ENV, "1" if merged else "0")
    if not merged:
        config = config.model_copy(update={"coalesce_max_steps": 1})
    sink = ListSink()
    sim = Simulator(workload or _workload(), config, LinearStepTimeModel(), sink, ORIGIN)
    result = sim.run()
    return sim, result, _fingerprint(sim, result, sink)


@pytest.mark.parametrize(("policy", "tier", "merges"), [
    ("vllm-offload-lru", {}, True),
    ("vllm-offload-arc", {}, True),
    ("vllm-offload-lru", {"offload_prompt_only": False}, True),  # every block a decode fills is stored
    ("thunderagent-offload", {}, True),
    ("continuum-offload", {}, True),
    ("mars-offload", {}, True),  # more configurations below
])
def test_merged_runs_with_the_host_tier_are_exact(monkeypatch: pytest.MonkeyPatch, policy: str,
                                                  tier: dict[str, Any], merges: bool) -> None:
    """Every turn's submit, schedule, token and finish times, cached tokens and preemptions, every
    non-snapshot event, the KV at the end and every copy (bytes, direction, submit and finish
    times): equal one step at a time and merged; and merging saved ``schedule()`` calls."""
    config = _config(policy, **tier)
    slow_sim, slow, slow_print = _run(monkeypatch, config, merged=False)
    fast_sim, fast, fast_print = _run(monkeypatch, config, merged=True)
    assert all(r.end_s is not None for r in slow.sessions.values())
    copies = slow_print[-1]
    assert any(c.direction is Direction.STORE for c in copies), "no store: the tier is unused"
    assert any(c.direction is Direction.LOAD for c in copies), "no host hit loaded"
    assert fast_print[0] == slow_print[0], "per-turn times differ"
    first = next((i for i, (a, b) in enumerate(zip(slow_print[1], fast_print[1], strict=False)) if a != b), None)
    assert first is None, f"event {first} differs: {slow_print[1][first]} vs {fast_print[1][first]}"
    assert fast_print[-1] == copies, "the copies differ"
    assert fast_print == slow_print
    if merges:
        assert fast.num_schedule_calls < 0.7 * slow.num_schedule_calls, (
            f"merged runs unused with the tier: {fast.num_schedule_calls} vs {slow.num_schedule_calls} calls")


_MARS_CONFIGS: dict[str, dict[str, Any]] = {
    "response-ratio": {},
    "fifo": {"residency": {"order": "fifo"}},
    "mlfq": {"mars": {"mlfq": True}},
    # Held turns become overdue within a run's reach: forced activations (run_until_s's timer).
    "short-hold": {"residency": {"max_hold_s": 0.2}},
    "fifo-short-hold": {"residency": {"order": "fifo", "max_hold_s": 0.5}},
}
"""MarsScheduler's residency orders, its MLFQ levels, and a hold bound short enough to act."""

_MARS_WORKLOADS: dict[str, Workload] = {
    "long-decodes": _workload(),
    "nine-sessions": growing_sessions(9, 5, output_tokens=(70, 17), tool_s=(0.1, 0.25)),
}


@pytest.mark.parametrize("workload", list(_MARS_WORKLOADS))
@pytest.mark.parametrize("mars", list(_MARS_CONFIGS))
def test_mars_offload_merged_runs_are_exact(monkeypatch: pytest.MonkeyPatch, mars: str, workload: str) -> None:
    """MarsScheduler with the tier (``mars-offload``): its merged runs leave its residency plan
    nothing to do in any of their steps (MarsScheduler.run_limits), so every turn's times, every
    event and every copy equal one step at a time; and runs do merge (held sessions included)."""
    config = _config("mars-offload", _MARS_CONFIGS[mars])
    _, slow, slow_print = _run(monkeypatch, config, merged=False, workload=_MARS_WORKLOADS[workload])
    fast_sim, fast, fast_print = _run(monkeypatch, config, merged=True, workload=_MARS_WORKLOADS[workload])
    assert all(r.end_s is not None for r in slow.sessions.values())
    assert fast_sim.engine.scheduler.num_suspensions > 0, "not KV-bound"
    # Preemptions too (with the tier the response ratio's residency may suspend an idle younger
    # session by age instead, so the long-decodes workload preempts under fifo only).
    assert slow.num_preemptions > 0 or (workload == "long-decodes" and not mars.startswith("fifo")), "no preemption"
    assert fast_print[0] == slow_print[0], "per-turn times differ"
    first = next((i for i, (a, b) in enumerate(zip(slow_print[1], fast_print[1], strict=False)) if a != b), None)
    assert first is None, f"event {first} differs: {slow_print[1][first]} vs {fast_print[1][first]}"
    assert fast_print == slow_print
    assert fast.num_schedule_calls < 0.6 * slow.num_schedule_calls, (
        f"mars-offload's runs unused: {fast.num_schedule_calls} vs {slow.num_schedule_calls} calls")
