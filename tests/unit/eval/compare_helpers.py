"""Shared by the compare tests: a small in-memory workload (the ``sim`` fixture is in conftest)."""

from __future__ import annotations

from typing import Any

from eval.workloads.format import Session, Turn, Workload, WorkloadMeta

SNAPSHOT_KINDS = frozenset({"engine_step", "admission_update"})
"""Telemetry snapshots: a merged (coalesced) run takes fewer of them (they report, never decide)."""


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


def sim_fingerprint(result: Any, events: Any) -> tuple[Any, ...]:
    """What two simulations of the same workload must share to be the same run: every turn's
    timings, cache hits, preemptions and tool times, every stream event but the snapshots
    (:data:`SNAPSHOT_KINDS`), steps, preemptions, KV at the end and the makespan."""
    sessions = {
        sid: (r.admitted_s, r.end_s, [
            (t.request_id, t.submit_s, t.first_scheduled_s, t.first_token_s, t.finish_s,
             t.num_cached_tokens, t.num_preemptions, t.tool_enqueue_s, t.tool_start_s, t.tool_end_s)
            for t in r.turns])
        for sid, r in result.sessions.items()}
    kept = [e.model_dump() for e in events if e.kind not in SNAPSHOT_KINDS]
    return (sessions, kept, result.num_engine_steps, result.num_preemptions,
            result.kv_blocks_at_end, result.makespan_s)


def benchmark_module(name: str):
    """Load ``benchmarks/<name>.py`` as module ``name`` (in ``sys.modules`` while a
    test module uses it: dataclasses resolve annotations through it); a generator for a
    module-scoped fixture: ``yield from``."""
    import sys

    from tests.load_file import ROOT, load_file

    yield load_file(ROOT / "benchmarks" / f"{name}.py")
    sys.modules.pop(name, None)
