"""The simulator's stall detector with vLLM's host KV tier: a turn that arrives after the engine sat
idle longer than ``stall_timeout_s`` and whose prefix must be loaded from the host is not a stall.

The class of the bug (``mars-offload`` on the Terminal-Bench-like family, "engine stalled at
t=6346.770 s: 0 running, 1 waiting"): the single-engine loop counted the time the engine had no
work at all towards the stall timeout, and with the tier the first step of such a turn schedules
nothing (vLLM only starts its host→GPU load, ``WAITING_FOR_REMOTE_KVS``); when any event (an
arrival, a tool end, an admission tick) came before that copy finished, the loop declared the
engine stalled while the copy was running. Every ``*-offload`` policy can hit it; GPU KV only
cannot (its first step prefills)."""

from __future__ import annotations

from datetime import UTC, datetime

import pytest

pytest.importorskip("vllm")

from eval.policies import POLICIES  # noqa: E402
from eval.sim import FAST_PATHS_ENV, LinearStepTimeModel, SimConfig, Simulator  # noqa: E402
from eval.workloads.format import Session, Turn, Workload, WorkloadMeta  # noqa: E402
from mars_openhands.engine.harness.inproc_engine import InprocEngineParams  # noqa: E402
from mars_openhands.engine.harness.offload.copies import Direction  # noqa: E402
from mars_openhands.engine.harness.offload.params import HostKvParams  # noqa: E402

ORIGIN = datetime(2026, 1, 1, tzinfo=UTC)
STALL_TIMEOUT_S = 5.0
TOOL_S = 40.0
"""Session a's tool call: the engine is idle for most of it (longer than the stall timeout)."""


def _workload() -> Workload:
    """a: a 1,000-token turn, a 40 s tool, a short last turn; b (during a's tool): one 2,300-token
    turn whose blocks push a's prefix off the 160-block GPU (vLLM stored it on the host); c: one
    short turn arriving while a's second turn loads its prefix back over a slow link."""
    a = Session(session_id="a", arrival_s=0.0, turns=(
        Turn(prompt_tokens_appended=1000, output_tokens=8, tool_name="bash", tool_duration_s=TOOL_S),
        Turn(prompt_tokens_appended=20, output_tokens=4)))
    b = Session(session_id="b", arrival_s=2.0, turns=(Turn(prompt_tokens_appended=2300, output_tokens=4),))
    c = Session(session_id="c", arrival_s=TOOL_S + 1.5, turns=(Turn(prompt_tokens_appended=64, output_tokens=4),))
    return Workload(meta=WorkloadMeta(source="test"), sessions=(a, b, c))


@pytest.mark.parametrize("merged", [True, False])
@pytest.mark.parametrize("policy", ["vllm-offload-lru", "thunderagent-offload", "continuum-offload",
                                    "mars-offload"])
def test_a_load_after_a_long_idle_stretch_is_not_a_stall(monkeypatch: pytest.MonkeyPatch, policy: str,
                                                         merged: bool) -> None:
    # Failed before the fix for every policy that loads a's prefix: "engine stalled at t=40.x s:
    # 0 running, 1 waiting" (idle since b's turn, ~2.5 s; the load of ~60 blocks at 0.01 GB/s
    # takes ~10 s and c arrives 1.5 s into it).
    monkeypatch.setenv(FAST_PATHS_ENV, "1" if merged else "0")
    spec = POLICIES[policy]
    assert spec.host_kv is not None
    tier = HostKvParams(size_gib=1.0, kv_bytes_per_block=16 * 98_304, h2d_gb_per_s=0.01,
                        **spec.host_kv)
    engine = InprocEngineParams(num_gpu_blocks=160, max_model_len=4096, host_kv=tier,
                                additional_config=dict(spec.additional_config), **spec.engine)
    config = SimConfig(policy=spec.scheduler, engine=engine, stall_timeout_s=STALL_TIMEOUT_S,
                       **({} if merged else {"coalesce_max_steps": 1}))
    sim = Simulator(_workload(), config, LinearStepTimeModel(), None, ORIGIN)
    result = sim.run()
    assert all(s.end_s is not None for s in result.sessions.values())
    assert sim.engine.host_kv is not None
    loads = [c for c in sim.engine.host_kv.worker.history if c.direction is Direction.LOAD]
    # The scenario is exercised: a's second turn loaded its prefix after the idle stretch, and the
    # copy outlasted c's arrival (the event that tripped the detector).
    assert any(c.submit_s > TOOL_S and c.done_s > TOOL_S + 1.5 for c in loads), loads
