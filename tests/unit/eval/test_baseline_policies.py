"""The two newest baselines as ``--policies`` names: registry, simulator and live-server wiring."""

from __future__ import annotations

from pathlib import Path

import pytest

pytest.importorskip("vllm")

from eval.backends import LiveBackend, LiveOptions, engine_flags, parse_backend  # noqa: E402
from eval.policies import POLICIES, live_policy_config  # noqa: E402
from eval.runs import sim_config  # noqa: E402
from eval.sim import LinearStepTimeModel, simulate  # noqa: E402
from eval.sweep_options import CompareOptions  # noqa: E402
from eval.workloads.format import Session, Turn, Workload, WorkloadMeta  # noqa: E402
from mars_openhands.engine.harness.inproc_engine import resolve_scheduler_cls  # noqa: E402
from mars_openhands.engine.schedulers.thunderagent import ThunderAgentScheduler  # noqa: E402


def test_both_are_baselines_without_the_gateway_window() -> None:
    for name in ("vllm-tuned", "thunderagent"):
        spec = POLICIES[name]
        assert spec.is_baseline and not spec.has_control_plane  # in compare's "best baseline"
    assert resolve_scheduler_cls(POLICIES["thunderagent"].scheduler) is ThunderAgentScheduler


def test_vllm_tuned_is_stock_vllm_with_the_512_token_prefill_cap() -> None:
    options = CompareOptions(num_gpu_blocks=512)
    tuned, stock = sim_config(options, "vllm-tuned", False), sim_config(options, "fcfs", False)
    assert tuned.policy == stock.policy == "fcfs"  # the stock AsyncScheduler in the simulator
    assert (tuned.engine.long_prefill_token_threshold, stock.engine.long_prefill_token_threshold) == (512, 0)
    assert tuned.engine.enable_prefix_caching


@pytest.mark.parametrize("backend", ["emulated", "cpu"])
def test_live_servers_get_the_flag_and_the_class(backend: str, tmp_path: Path) -> None:
    options = LiveOptions(num_gpu_blocks=900, max_model_len_tokens=4096)
    with LiveBackend(parse_backend(backend), options, live_policy_config()) as live:
        tuned = live.server_options("vllm-tuned", tmp_path)
        thunder = live.server_options("thunderagent", tmp_path)
        fcfs = live.server_options("fcfs", tmp_path)
    assert tuned.scheduler_cls == fcfs.scheduler_cls == "mars_openhands.engine.FcfsScheduler"
    assert tuned.extra_args == ("--long-prefill-token-threshold", "512") and fcfs.extra_args == ()
    assert tuned.enable_prefix_caching
    assert thunder.scheduler_cls == "mars_openhands.engine.ThunderAgentScheduler"
    assert thunder.additional_config["mars"]["inbox_addr"].startswith("ipc://")  # tool events in


def test_engine_flags_cap_at_max_model_len_and_reject_unknown_settings() -> None:
    assert engine_flags({"long_prefill_token_threshold": 512}, 300) == ("--long-prefill-token-threshold", "300")
    with pytest.raises(ValueError, match="max_num_seqs.*supported: long_prefill_token_threshold"):
        engine_flags({"max_num_seqs": 4}, 300)


def _three_sessions() -> Workload:
    sessions = tuple(
        Session(session_id=f"s{i}", arrival_s=0.1 * i, turns=(
            Turn(prompt_tokens_appended=600, output_tokens=20, tool_name="bash", tool_duration_s=0.5),
            Turn(prompt_tokens_appended=50, output_tokens=10)))
        for i in range(3))
    return Workload(meta=WorkloadMeta(source="test"), sessions=sessions)


def test_thunderagent_in_the_simulator_holds_a_program_until_the_admitted_ones_leave() -> None:
    """KV 128 blocks x 16 = 2048 tokens: two 600-token programs (+100 each) fit, the third waits
    outside vLLM while they run and call their tools, and is admitted at the step after they end
    (an idle engine holds nothing; it used to wait for the next periodic check, issue 33)."""
    options = CompareOptions(num_gpu_blocks=128)
    waits = {}
    for policy in ("fcfs", "thunderagent"):
        result = simulate(_three_sessions(), sim_config(options, policy, False), LinearStepTimeModel())
        assert all(r.e2e_s is not None for r in result.sessions.values())
        waits[policy] = [r.turns[0].first_scheduled_s - r.turns[0].submit_s for r in result.sessions.values()]
        ends = [r.end_s for r in result.sessions.values()]
        third = list(result.sessions.values())[2].turns[0]
    assert max(waits["fcfs"]) < 0.5
    assert waits["thunderagent"][:2] == pytest.approx([0.0, 0.0], abs=0.05)
    assert waits["thunderagent"][2] > 0.5  # held through the others' 0.5 s tool calls
    assert max(ends[:2]) <= third.first_scheduled_s < max(ends[:2]) + 0.1  # then admitted at once
