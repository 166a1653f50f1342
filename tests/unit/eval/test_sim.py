"""The virtual-time simulator over the real vLLM scheduler (eval/sim.py)."""

from __future__ import annotations

from collections import Counter, defaultdict
from dataclasses import dataclass
from datetime import UTC, datetime

import pytest

pytest.importorskip("vllm")

from eval.sim import (  # noqa: E402
    LinearStepTimeModel,
    SimConfig,
    SimResult,
    Simulator,
    ideal_times_s,
    simulate,
)
from eval.workloads.format import Session, Turn, Workload, WorkloadMeta  # noqa: E402
from mars_openhands.engine.harness.inproc_engine import InprocEngineParams  # noqa: E402
from mars_openhands.policy.admission import AdmissionParams  # noqa: E402
from mars_openhands.stream.transport import ListSink  # noqa: E402

ORIGIN = datetime(2026, 1, 1, tzinfo=UTC)
NUM_BLOCKS = 2048


@dataclass(frozen=True)
class ConstantTimer:
    """Every non-empty step takes ``step_s`` seconds."""

    step_s: float = 0.01

    def step_time_s(self, prefill=(), decode_context_tokens=()) -> float:
        return self.step_s if (prefill or decode_context_tokens) else 0.0


def _session(sid: str, arrival_s: float, turns: list[tuple[int, int, str | None, float]]) -> Session:
    return Session(session_id=sid, arrival_s=arrival_s, turns=tuple(
        Turn(prompt_tokens_appended=a, output_tokens=o, tool_name=t, tool_duration_s=d)
        for a, o, t, d in turns))


def _workload(*sessions: Session) -> Workload:
    return Workload(meta=WorkloadMeta(source="test"), sessions=tuple(sessions))


def _agentic(n: int, gap_s: float = 0.5, turns: int = 4) -> Workload:
    sessions = []
    for i in range(n):
        spec = [(300 + 40 * i + 7 * k, 20 + 3 * k + i, "bash", 0.2 + 0.1 * ((i + k) % 3))
                for k in range(turns - 1)]
        sessions.append(_session(f"s{i}", i * gap_s, [*spec, (50, 10, None, 0.0)]))
    return _workload(*sessions)


def _config(**kw: object) -> SimConfig:
    engine = kw.pop("engine", InprocEngineParams(num_gpu_blocks=NUM_BLOCKS, max_model_len=16384))
    return SimConfig(engine=engine, **kw)


def _run(workload: Workload, timer=None, sink=None, **kw: object) -> SimResult:
    return simulate(workload, _config(**kw), timer or LinearStepTimeModel(), sink, ORIGIN)


@pytest.fixture(scope="module")
def streamed() -> tuple[SimResult, ListSink]:
    sink = ListSink()
    result = _run(_agentic(5), sink=sink, num_tool_workers=2)
    return result, sink


def test_runs_every_turn_and_frees_all_kv(streamed: tuple[SimResult, ListSink]) -> None:
    result, _ = streamed
    assert len(result.sessions) == 5
    for record in result.sessions.values():
        assert record.end_s is not None and len(record.turns) == 4
        assert all(t.finish_s is not None and t.first_token_s is not None for t in record.turns)
    assert result.kv_blocks_at_end == (NUM_BLOCKS - 1, 0, 0)
    assert result.num_engine_steps >= result.num_schedule_calls > 0


def test_prefix_cache_hits_across_turns(streamed: tuple[SimResult, ListSink]) -> None:
    result, _ = streamed
    for record in result.sessions.values():
        first, *later = record.turns
        assert first.num_cached_tokens == 0
        for prev, turn in zip(record.turns, later, strict=False):
            # KV exists for the prompt and all outputs but the last (never fed back).
            expected = (prev.num_prompt_tokens + prev.num_output_tokens - 1) // 16 * 16
            assert turn.num_cached_tokens == expected > 0


def test_event_stream_kinds_and_per_session_order(streamed: tuple[SimResult, ListSink]) -> None:
    result, sink = streamed
    kinds = Counter(e.kind for e in sink.events)
    assert kinds["session_start"] == kinds["session_end"] == 5
    for kind in ("queued", "first_scheduled", "first_token", "finished"):
        assert kinds[kind] == 20, kind
    for kind in ("tool_enqueued", "tool_start", "tool_end"):
        assert kinds[kind] == 15, kind
    assert kinds["engine_step"] > 0 and kinds["admission_update"] > 0
    assert result.num_events == len(sink.events)
    per_session = defaultdict(list)
    for e in sink.events:
        if e.session_id is not None:
            per_session[e.session_id].append(e)
    lifecycle = ["queued", "first_scheduled", "first_token", "finished"]
    tool = ["tool_enqueued", "tool_start", "tool_end"]
    for sid, events in per_session.items():
        stamps = [e.t_mono_ns for e in events]
        assert stamps == sorted(stamps), f"{sid}: events out of time order"
        expected = ["session_start"]
        for k in range(4):
            expected += lifecycle + (tool if k < 3 else [])
        assert [e.kind for e in events] == [*expected, "session_end"]
        assert all(e.turn == k for e in events for k in [e.turn] if e.kind in lifecycle + tool)
        start = events[0]
        assert start.t_wall == ORIGIN + (start.t_wall - ORIGIN)  # aware, on the virtual origin
        assert start.t_mono_ns == round(result.sessions[sid].arrival_s * 1e9)


def test_metrics_from_stream_match_records(streamed: tuple[SimResult, ListSink]) -> None:
    pytest.importorskip("pandas")
    from eval.metrics import session_table
    from mars_openhands.stream.reader import events_to_frame

    result, sink = streamed
    table = session_table(events_to_frame(sink.events))
    for sid, record in result.sessions.items():
        assert table.loc[sid, "e2e_s"] == pytest.approx(record.e2e_s, abs=1e-5)


def test_deterministic_for_a_seed() -> None:
    runs = []
    for _ in range(2):
        sink = ListSink()
        result = _run(_agentic(3, turns=3), sink=sink, seed=7)
        runs.append(([e.model_dump() for e in sink.events],
                     {s: [(t.submit_s, t.finish_s, t.num_cached_tokens) for t in r.turns]
                      for s, r in result.sessions.items()}))
    assert runs[0] == runs[1]


@pytest.mark.parametrize("policy", ["fcfs", "fcfs-sync"])
def test_coalescing_changes_calls_not_results(policy: str) -> None:
    # fcfs-sync: vLLM's sync Scheduler caches full blocks only at the next allocate_slots(), so a
    # coalesced run that ended a request would lose its last block's prefix-cache entry.
    workload = _agentic(3, turns=3)
    plain = _run(workload, coalesce_max_steps=1, policy=policy)
    fast = _run(workload, coalesce_max_steps=64, policy=policy)
    assert fast.num_schedule_calls < plain.num_schedule_calls / 2
    assert fast.num_engine_steps == plain.num_engine_steps == plain.num_schedule_calls
    for sid, record in plain.sessions.items():
        other = fast.sessions[sid]
        assert other.end_s == pytest.approx(record.end_s, rel=1e-3)
        assert [t.num_cached_tokens for t in other.turns] == [t.num_cached_tokens for t in record.turns]


def test_idle_time_is_skipped() -> None:
    far_s = 50_000.0
    sink = ListSink()
    workload = _workload(_session("early", 0.0, [(64, 4, None, 0.0)]),
                         _session("late", far_s, [(64, 4, "bash", 1.0), (16, 4, None, 0.0)]))
    sim = Simulator(workload, _config(), ConstantTimer(0.01), sink, ORIGIN)
    result = sim.run()
    late = result.sessions["late"]
    assert late.turns[0].submit_s == far_s and late.end_s == pytest.approx(far_s + 1.0 + 0.08)
    assert result.makespan_s == late.end_s
    ticks = sum(1 for e in sink.events if e.kind == "admission_update")
    assert ticks < 300, f"{ticks} admission ticks: idle time was not skipped"
    assert result.num_engine_steps < 20


def test_tool_pool_queues_fifo_with_hand_computed_waits() -> None:
    durations = [1.0, 2.0, 3.0]
    workload = _workload(*(_session(f"s{i}", 0.0, [(32, 1, "t", d), (16, 1, None, 0.0)])
                           for i, d in enumerate(durations)))
    for workers, waits in ((1, [0.0, 1.0, 3.0]), (2, [0.0, 0.0, 1.0]), (3, [0.0, 0.0, 0.0])):
        result = simulate(workload, _config(num_tool_workers=workers), ConstantTimer(0.01),
                          None, ORIGIN)
        tools = [result.sessions[f"s{i}"].turns[0] for i in range(3)]
        assert [t.tool_enqueue_s for t in tools] == [pytest.approx(0.01)] * 3
        assert [t.tool_queue_wait_s for t in tools] == [pytest.approx(w) for w in waits], workers
        for t, d in zip(tools, durations, strict=True):
            assert t.tool_end_s == pytest.approx(t.tool_start_s + d)
            nxt = result.sessions[t.request_id.split("#")[0]].turns[1]
            assert nxt.submit_s == pytest.approx(t.tool_end_s)


def _max_concurrent(result: SimResult) -> int:
    edges = []
    for r in result.sessions.values():
        edges += [(r.admitted_s, 1), (r.end_s, -1)]
    level = peak = 0
    for _, delta in sorted(edges, key=lambda e: (e[0], e[1])):
        level += delta
        peak = max(peak, level)
    return peak


def test_admission_window_is_respected() -> None:
    fixed = AdmissionParams(window_min=2, window_init=2, window_max=2)
    workload = _agentic(6, gap_s=0.0, turns=3)
    on = _run(workload, is_admission_enabled=True, admission=fixed)
    assert on.max_admitted_sessions == 2 and on.num_admissions_over_window == 0
    assert _max_concurrent(on) == 2
    waited = [r for r in on.sessions.values() if r.admitted_s > r.arrival_s]
    assert len(waited) == 4
    for r in waited:
        assert r.turns[0].submit_s == r.admitted_s
    off = _run(workload, is_admission_enabled=False, admission=fixed)
    assert off.max_admitted_sessions == 6 and _max_concurrent(off) > 2


def test_aimd_window_never_exceeded_under_cpu_pressure() -> None:
    workload = _agentic(10, gap_s=0.1, turns=4)
    sink = ListSink()
    result = _run(workload, sink=sink, is_admission_enabled=True, num_tool_workers=1,
                  admission=AdmissionParams(window_min=1, window_init=8, window_max=8))
    assert result.num_admissions_over_window == 0
    windows = [e.window for e in sink.events if e.kind == "admission_update"]
    assert min(windows) < 8, "C_cpu = ceil(1 * 2.5) = 3 caps the window below W_max"
    assert result.max_admitted_sessions <= 8


def test_stall_raises() -> None:
    workload = _workload(_session("big", 0.0, [(5000, 4, None, 0.0)]))
    engine = InprocEngineParams(num_gpu_blocks=64, max_model_len=16384)
    with pytest.raises(RuntimeError, match="stalled"):
        simulate(workload, _config(engine=engine, stall_timeout_s=5.0), ConstantTimer(), None, ORIGIN)


def test_plugin_policy_runs_with_cpu_events() -> None:
    from mars_openhands import engine as engine_pkg

    exported = getattr(engine_pkg, "_LAZY", {})
    policy = "MarsScheduler" if "MarsScheduler" in exported else "FcfsScheduler"
    sink = ListSink()
    result = _run(_agentic(3, turns=3), sink=sink, policy=policy)
    kinds = Counter(e.kind for e in sink.events)
    assert kinds["finished"] == 9 and kinds["session_end"] == 3
    assert all(e.t_wall >= ORIGIN for e in sink.events)
    stamps = [e.t_mono_ns for e in sink.events if e.source == "engine:0"]
    assert max(stamps) <= round(result.makespan_s * 1e9), "engine events carry virtual stamps"
    assert result.kv_blocks_at_end[1:] == (0, 0)


def test_ideal_times_bound_loaded_e2e(streamed: tuple[SimResult, ListSink]) -> None:
    result, _ = streamed
    ideal = ideal_times_s(_agentic(5), _config(num_tool_workers=2), LinearStepTimeModel())
    assert set(ideal) == set(result.sessions)
    for sid, record in result.sessions.items():
        assert 0 < ideal[sid] <= record.e2e_s + 1e-9, sid
    assert any(ideal[sid] < r.e2e_s * 0.999 for sid, r in result.sessions.items()), \
        "some session must be slowed down by the others"
