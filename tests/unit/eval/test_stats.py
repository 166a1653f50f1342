"""Workload statistics on a hand-made workload."""

from __future__ import annotations

import math

import pytest

from eval.workloads.format import Session, Turn, Workload, WorkloadMeta
from eval.workloads.stats import summarize, workload_stats


def test_stats_hand_computed() -> None:
    a = Session(session_id="a", arrival_s=0.0, turns=(
        Turn(prompt_tokens_appended=100, output_tokens=10, tool_name="pytest", tool_duration_s=20.0),
        Turn(prompt_tokens_appended=30, output_tokens=20),
    ))
    b = Session(session_id="b", arrival_s=5.0, turns=(
        Turn(prompt_tokens_appended=200, output_tokens=4, tool_name="cat", tool_duration_s=1.0),
        Turn(prompt_tokens_appended=6, output_tokens=2, tool_name="cat", tool_duration_s=3.0),
        Turn(prompt_tokens_appended=1, output_tokens=1),
    ))
    stats = workload_stats(Workload(meta=WorkloadMeta(source="t"), sessions=(a, b)))
    assert (stats.num_sessions, stats.num_turns, stats.arrival_span_s) == (2, 5, 5.0)
    assert stats.turns_per_session.mean == 2.5
    assert stats.first_prompt_tokens.p50 == 150.0
    # prompts: a: 100, 140; b: 200, 210, 213
    assert stats.prompt_tokens.mean == pytest.approx((100 + 140 + 200 + 210 + 213) / 5)
    assert stats.appended_tokens.count == 3 and stats.appended_tokens.max == 30
    assert stats.context_growth_tokens.mean == pytest.approx((40 + 10 + 3) / 3)
    assert stats.max_context_tokens.max == 214  # b: 213 + 1
    assert stats.tool_over_10s_fraction == pytest.approx(1 / 3)
    assert stats.tool_over_10s_time_share == pytest.approx(20 / 24)
    assert stats.tool_over_60s_fraction == 0.0
    assert [(t.tool_name, t.num_calls, t.p50_s, t.total_s) for t in stats.tools] == [
        ("cat", 2, 2.0, 4.0), ("pytest", 1, 20.0, 20.0)]


def test_summarize_percentiles_and_empty() -> None:
    d = summarize([1, 2, 3, 4, 5, 6, 7, 8, 9, 10])
    assert (d.count, d.mean, d.p50, d.p90, d.max) == (10, 5.5, 5.5, 9.1, 10.0)
    assert math.isnan(summarize([]).mean)
