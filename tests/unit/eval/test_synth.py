"""Synthetic generators: reproducibility, caps, and calibration against design.md §8."""

from __future__ import annotations

import math

import numpy as np
import pytest

from eval.workloads.arrivals import PoissonArrivals
from eval.workloads.format import load_workload, save_workload
from eval.workloads.synth import (
    HEAVY_TAIL_TOOL_TIME,
    SYNTH_KINDS,
    GitTaskBenchParams,
    LogNormal,
    RepoBenchParams,
    SweBenchParams,
    ToolTimeParams,
    WorkloadCaps,
    synthesize,
)


@pytest.fixture(scope="module")
def swebench():
    return synthesize("swebench", 300, seed=11)


def test_same_seed_same_workload_and_arrivals_do_not_change_sessions() -> None:
    a = synthesize("swebench", 5, seed=3)
    assert a == synthesize("swebench", 5, seed=3)
    assert a.sessions != synthesize("swebench", 5, seed=4).sessions
    shaped = synthesize("swebench", 5, seed=3, arrival=PoissonArrivals(rate_per_s=1.0))
    assert [s.turns for s in shaped.sessions] == [s.turns for s in a.sessions]
    assert shaped.sessions[-1].arrival_s > 0
    assert shaped.meta.arrival["process"]["kind"] == "poisson"


def test_meta_records_kind_params_and_round_trips(tmp_path) -> None:
    workload = synthesize("terminalbench", 3, seed=1, caps=WorkloadCaps(max_turns=4))
    assert workload.meta.source == "synth:terminalbench"
    assert workload.meta.generator["caps"] == {"max_turns": 4, "max_context_tokens": None}
    assert workload.meta.generator["params"]["tool_time"]["tail_min_s"] == 60.0
    assert [s.session_id for s in workload.sessions] == [f"terminalbench-{i:05d}" for i in range(3)]
    assert load_workload(save_workload(workload, tmp_path / "w.jsonl")) == workload


def test_calls_per_session_match_design(swebench) -> None:
    log_calls = np.log([s.num_turns for s in swebench.sessions])
    assert log_calls.mean() == pytest.approx(4.32, abs=0.06)  # lognormal(4.32, 0.34)
    assert log_calls.std() == pytest.approx(0.34, abs=0.05)


def test_token_distributions_match_design(swebench) -> None:
    first = [s.turns[0].prompt_tokens_appended for s in swebench.sessions]
    assert min(first) >= 1600 and max(first) <= 2000
    outputs = np.log([t.output_tokens for s in swebench.sessions for t in s.turns])
    assert outputs.mean() == pytest.approx(4.90, abs=0.05)  # lognormal(4.90, 0.94)
    growth = np.log([s.num_prompt_tokens(k) - s.num_prompt_tokens(k - 1)
                     for s in swebench.sessions for k in range(1, s.num_turns)])
    assert growth.mean() == pytest.approx(5.83, abs=0.1)    # design: lognormal(5.83, 0.76)
    assert growth.std() == pytest.approx(0.76, abs=0.08)


def test_swebench_tool_times(swebench) -> None:
    durations = np.array([t.tool_duration_s for s in swebench.sessions for t in s.turns[:-1]])
    assert durations.max() <= 60.0                           # capped at the env timeout
    assert np.median(durations) == pytest.approx(math.exp(-1.19), rel=0.1)
    assert 0.001 < (durations > 10).mean() < 0.006           # design: ~0.4% over 10 s


def test_heavy_tail_reproduces_the_published_shares() -> None:
    names, durations = HEAVY_TAIL_TOOL_TIME.sample(np.random.default_rng(0), 400_000)
    long = durations > 60.0
    assert long.mean() == pytest.approx(0.0397, abs=0.002)           # 3.97% of calls > 1 min
    assert durations[long].sum() / durations.sum() == pytest.approx(0.847, abs=0.02)  # hold 84.7%
    assert len(names) == 400_000
    workload = synthesize("gittaskbench", 3, seed=0)
    tail_names = set(GitTaskBenchParams().tool_time.tail_tools)
    for turn in (t for s in workload.sessions for t in s.turns[:-1] if t.tool_duration_s > 60):
        assert turn.tool_name in tail_names


def test_lognormal_from_median_p90() -> None:
    dist = LogNormal.from_median_p90(2.0, 10.0)
    x = dist.sample(np.random.default_rng(0), 200_000)
    assert np.percentile(x, [50, 90]) == pytest.approx([2.0, 10.0], rel=0.03)


def test_caps_bound_turns_and_context() -> None:
    caps = WorkloadCaps(max_turns=10, max_context_tokens=4096)
    workload = synthesize("swebench", 20, seed=2, caps=caps)
    assert all(s.num_turns <= 10 and s.max_context_tokens <= 4096 for s in workload.sessions)
    assert all(s.turns[-1].tool_name is None for s in workload.sessions)


def test_repobench_is_single_turn_long_prefill() -> None:
    workload = synthesize("repobench", 200, seed=0)
    params = RepoBenchParams()
    prompts = [s.turns[0].prompt_tokens_appended for s in workload.sessions]
    assert all(s.num_turns == 1 for s in workload.sessions)
    assert min(prompts) >= params.prompt_min_tokens and max(prompts) <= params.prompt_max_tokens
    assert np.median(prompts) == pytest.approx(8192, rel=0.15)
    assert max(s.turns[0].output_tokens for s in workload.sessions) <= params.output_max_tokens


def test_errors_name_the_problem() -> None:
    with pytest.raises(ValueError, match="unknown synthetic workload kind 'swe'; expected one of"):
        synthesize("swe", 1, seed=0)
    with pytest.raises(ValueError, match="params are for kind 'swebench'"):
        synthesize("repobench", 1, seed=0, params=SweBenchParams())
    with pytest.raises(ValueError, match="num_sessions must be >= 1"):
        synthesize("swebench", 0, seed=0)
    with pytest.raises(ValueError, match="first_prompt_min_tokens"):
        SweBenchParams(first_prompt_min_tokens=10, first_prompt_max_tokens=5)
    with pytest.raises(ValueError, match="extra"):
        ToolTimeParams(tail_fractoin=0.1)
    assert set(SYNTH_KINDS) == {"swebench", "gittaskbench", "terminalbench", "repobench"}
