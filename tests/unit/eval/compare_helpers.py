"""Shared by the compare tests: a small in-memory workload (the ``sim`` fixture is in conftest)."""

from __future__ import annotations

from eval.workloads.format import Session, Turn, Workload, WorkloadMeta


def small_workload(n: int = 4, turns: int = 3) -> Workload:
    """``n`` sessions arriving at 0 s, ``turns`` turns each (bash tools of 0.2-0.4 s between)."""
    sessions = []
    for i in range(n):
        spec = [Turn(prompt_tokens_appended=200 + 30 * i + 5 * k, output_tokens=12 + i + k,
                     tool_name="bash", tool_duration_s=0.2 + 0.1 * ((i + k) % 3)) for k in range(turns - 1)]
        spec.append(Turn(prompt_tokens_appended=40, output_tokens=8))
        sessions.append(Session(session_id=f"s{i}", arrival_s=0.0, turns=tuple(spec)))
    return Workload(meta=WorkloadMeta(source="test"), sessions=tuple(sessions))

