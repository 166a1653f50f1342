"""Descriptive statistics of a workload (the numbers in ``docs/workloads.md`` come from here).

Percentiles use numpy's default (linear interpolation between order statistics).
"""

from __future__ import annotations

from collections import defaultdict

import numpy as np
from pydantic import BaseModel, ConfigDict

from eval.workloads.format import Workload

__all__ = ["Distribution", "ToolStats", "WorkloadStats", "summarize", "workload_stats"]


class Distribution(BaseModel):
    """Summary of a sample: count, mean, p50, p90, p99, max (NaN when empty)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    count: int
    mean: float
    p50: float
    p90: float
    p99: float
    max: float


def summarize(values: list[float] | np.ndarray) -> Distribution:
    """Summarize ``values`` (any shape, flattened). Pure."""
    x = np.asarray(values, dtype=np.float64).ravel()
    if x.size == 0:
        nan = float("nan")
        return Distribution(count=0, mean=nan, p50=nan, p90=nan, p99=nan, max=nan)
    p50, p90, p99 = np.percentile(x, [50, 90, 99])
    return Distribution(count=int(x.size), mean=float(x.mean()), p50=float(p50), p90=float(p90),
                        p99=float(p99), max=float(x.max()))


class ToolStats(BaseModel):
    """Per tool name: number of calls, median and total duration (seconds)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    tool_name: str
    num_calls: int
    p50_s: float
    total_s: float


class WorkloadStats(BaseModel):
    """Distributions over a workload's sessions and turns (token counts in tokens, times in s)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    num_sessions: int
    num_turns: int
    turns_per_session: Distribution
    first_prompt_tokens: Distribution
    """Turn 0's prompt (system + task)."""
    prompt_tokens: Distribution
    """Full prompt of every turn (see ``Session.num_prompt_tokens``)."""
    appended_tokens: Distribution
    """Observation tokens appended on turns k >= 1."""
    context_growth_tokens: Distribution
    """prompt(k) − prompt(k−1) = output(k−1) + appended(k), k >= 1."""
    output_tokens: Distribution
    max_context_tokens: Distribution
    """Per session: final prompt + final output (its peak KV footprint)."""
    tool_duration_s: Distribution
    tool_over_10s_fraction: float
    """Fraction of tool calls longer than 10 s."""
    tool_over_10s_time_share: float
    """Fraction of total tool time spent in calls longer than 10 s."""
    tool_over_60s_fraction: float
    tool_over_60s_time_share: float
    arrival_span_s: float
    """Last arrival − first arrival."""
    tools: tuple[ToolStats, ...]
    """Per tool name, most calls first."""


def _share(durations_s: np.ndarray, threshold_s: float) -> tuple[float, float]:
    if durations_s.size == 0:
        return float("nan"), float("nan")
    long = durations_s > threshold_s
    total_s = durations_s.sum()
    return float(long.mean()), float(durations_s[long].sum() / total_s) if total_s > 0 else 0.0


def workload_stats(workload: Workload) -> WorkloadStats:
    """Compute :class:`WorkloadStats` of ``workload``. Pure."""
    prompts, appended, growth, outputs, by_tool = [], [], [], [], defaultdict(list)
    for session in workload.sessions:
        prompt = 0
        for k, turn in enumerate(session.turns):
            new_prompt = prompt + turn.prompt_tokens_appended + (session.turns[k - 1].output_tokens if k else 0)
            if k:
                appended.append(turn.prompt_tokens_appended)
                growth.append(new_prompt - prompt)
            prompt = new_prompt
            prompts.append(prompt)
            outputs.append(turn.output_tokens)
            if turn.tool_name is not None:
                by_tool[turn.tool_name].append(turn.tool_duration_s)
    durations_s = np.array([d for ds in by_tool.values() for d in ds], dtype=np.float64)
    over_10, share_10 = _share(durations_s, 10.0)
    over_60, share_60 = _share(durations_s, 60.0)
    arrivals_s = [s.arrival_s for s in workload.sessions]
    tools = sorted(
        (ToolStats(tool_name=name, num_calls=len(ds), p50_s=float(np.median(ds)), total_s=float(sum(ds)))
         for name, ds in by_tool.items()),
        key=lambda t: (-t.num_calls, t.tool_name))
    return WorkloadStats(
        num_sessions=len(workload.sessions),
        num_turns=workload.num_turns,
        turns_per_session=summarize([s.num_turns for s in workload.sessions]),
        first_prompt_tokens=summarize([s.turns[0].prompt_tokens_appended for s in workload.sessions]),
        prompt_tokens=summarize(prompts),
        appended_tokens=summarize(appended),
        context_growth_tokens=summarize(growth),
        output_tokens=summarize(outputs),
        max_context_tokens=summarize([s.max_context_tokens for s in workload.sessions]),
        tool_duration_s=summarize(durations_s),
        tool_over_10s_fraction=over_10, tool_over_10s_time_share=share_10,
        tool_over_60s_fraction=over_60, tool_over_60s_time_share=share_60,
        arrival_span_s=float(max(arrivals_s) - min(arrivals_s)) if arrivals_s else 0.0,
        tools=tuple(tools),
    )
