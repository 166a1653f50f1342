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



def growing_sessions(num_sessions: int = 7, num_turns: int = 5, *, output_tokens: tuple[int, int] = (60, 11),
                     tool_s: tuple[float, float] = (0.05, 0.07)) -> Workload:
    """``num_sessions`` sessions 0.15 s apart whose contexts grow by 180-420 tokens a turn (KV-bound
    on a small pool): turn ``k`` of session ``i`` decodes ``base + step * ((i + k) % 5)`` tokens
    (``output_tokens = (base, step)``) and calls a bash tool of ``base + step * ((i * k) % 4)``
    seconds (``tool_s``); the last turn is short."""
    sessions = []
    for i in range(num_sessions):
        turns = [Turn(prompt_tokens_appended=180 + 37 * i + 23 * k,
                      output_tokens=output_tokens[0] + output_tokens[1] * ((i + k) % 5),
                      tool_name="bash", tool_duration_s=tool_s[0] + tool_s[1] * ((i * k) % 4))
                 for k in range(num_turns - 1)]
        turns.append(Turn(prompt_tokens_appended=40, output_tokens=30 + i))
        sessions.append(Session(session_id=f"s{i}", arrival_s=0.15 * i, turns=tuple(turns)))
    return Workload(meta=WorkloadMeta(source="test"), sessions=tuple(sessions))
