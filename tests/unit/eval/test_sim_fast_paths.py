"""The simulator's speed-ups are exact: with ``MARS_SIM_FAST_PATHS=0`` (every step that today goes
through ``schedule()`` does so) and with them on, a KV-bound run makes the same decisions at the
same virtual times, to the last bit (eval/sim.py, engine/harness/inproc_engine.py)."""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Any

import pytest
from compare_helpers import growing_sessions, sim_fingerprint

pytest.importorskip("vllm")

from eval.runs import METRIC_KINDS  # noqa: E402
from eval.sim import FAST_PATHS_ENV, LinearStepTimeModel, SimConfig, SimResult, Simulator  # noqa: E402
from eval.workloads.format import Workload  # noqa: E402
from mars_openhands.engine.harness.inproc_engine import InprocEngineParams  # noqa: E402
from mars_openhands.engine.harness.runs import RunPlan  # noqa: E402
from mars_openhands.policy.admission import AdmissionParams  # noqa: E402
from mars_openhands.stream.transport import ListSink  # noqa: E402

NUM_BLOCKS = 160
"""2,560 tokens of KV for sessions that grow to ~1,600 tokens each: requests wait for KV."""

ORIGIN = datetime(2026, 1, 1, tzinfo=UTC)


def _kv_bound_workload(num_sessions: int = 7, num_turns: int = 5) -> Workload:
    return growing_sessions(num_sessions, num_turns)


def _preview_config(**admission: Any) -> SimConfig:
    """The MARS preview with its admission window (the preview's CPU threshold, H = 4: ours, 1.5,
    would cap the window at 4 sessions for 3 tool workers and the workload would not be KV-bound)."""
    return SimConfig(policy="MarsPreviewScheduler", num_tool_workers=3, is_admission_enabled=True,
                     admission=AdmissionParams(cpu_set_backlog_ratio=4.0, **admission),
                     engine=InprocEngineParams(num_gpu_blocks=NUM_BLOCKS, max_model_len=4096))


def _fingerprint(result: SimResult, sink: ListSink) -> tuple[Any, ...]:
    return sim_fingerprint(result, sink.events)


def _both_ways(monkeypatch: pytest.MonkeyPatch, config: SimConfig,
               workload: Workload) -> tuple[SimResult, SimResult, tuple[Any, ...], tuple[Any, ...], Any]:
    out = []
    for flag in ("0", "1"):
        monkeypatch.setenv(FAST_PATHS_ENV, flag)
        sink = ListSink()
        sim = Simulator(workload, config, LinearStepTimeModel(), sink, ORIGIN)
        result = sim.run()
        out.append((result, _fingerprint(result, sink)))
    (slow, slow_print), (fast, fast_print) = out
    return slow, fast, slow_print, fast_print, sim.engine


_CONTINUUM = {"additional_config": {"mars": {"continuum": {"mode": "continuum"}}}}
_AUTELLIX_SMALL = {"additional_config": {"mars": {"autellix": {
    "service_thresholds_tokens": [64, 256, 1024], "level_quanta_tokens": [128, 64, 32, 16]}}}}
"""Autellix scaled to these sessions: programs reach the last level (16-token quantum), so every
re-prefill after a preemption runs as chunks of one quantum while others wait (merged runs)."""
_PREVIEW_SMALL = {"additional_config": {"mars": {"levels": {
    "prompt_thresholds_tokens": [64, 256, 1024], "quanta_tokens": [128, 64, 32, 16],
    "aging_interval_s": 0.006}}}}
"""The preview scaled the same way, with an aging interval near the step times (a run must not
hold a step that ages a prompt)."""


@pytest.mark.parametrize(("policy", "engine", "admission", "merges"), [
    ("fcfs", {}, False, True),
    ("fcfs", {"long_prefill_token_threshold": 64}, False, True),  # vllm-tuned's cap (scaled)
    ("fcfs", {}, True, True),
    ("InferceptScheduler", {}, False, True),
    ("ContinuumScheduler", _CONTINUUM, False, True),
    ("AutellixScheduler", {}, False, True),
    ("AutellixScheduler", _AUTELLIX_SMALL, False, True),
    ("ThunderAgentScheduler", {}, False, True),
    ("MarsPreviewScheduler", {}, True, True),
    ("MarsPreviewScheduler", _PREVIEW_SMALL, True, True),
    ("MarsScheduler", {}, True, False),
])
def test_fast_paths_are_exact(monkeypatch: pytest.MonkeyPatch, policy: str, engine: dict[str, Any],
                              admission: bool, merges: bool) -> None:
    """Every request's schedule, token and finish times, cached tokens and preemptions, every
    non-snapshot event, the KV at the end: equal with and without the fast paths."""
    # The preview's CPU threshold (H = 4): ours (1.5) would cap the window at 4 sessions for 3 tool
    # workers, and the workload would no longer be KV-bound.
    config = SimConfig(policy=policy, num_tool_workers=3, is_admission_enabled=admission,
                       admission=AdmissionParams(cpu_set_backlog_ratio=4.0),
                       engine=InprocEngineParams(num_gpu_blocks=NUM_BLOCKS, max_model_len=4096,
                                                 **engine))
    slow, fast, slow_print, fast_print, engine_ = _both_ways(monkeypatch, config, _kv_bound_workload())
    assert engine_.prefix_memo is not None and engine_.prefix_memo.num_hits > 0
    assert all(r.end_s is not None for r in slow.sessions.values())
    assert slow.num_preemptions > 0, "the workload must be KV-bound (requests preempted and waiting)"
    assert fast_print[0] == slow_print[0], "per-request times differ"
    first = next((i for i, (a, b) in enumerate(zip(slow_print[1], fast_print[1], strict=False))
                  if a != b), None)
    assert first is None, f"event {first} differs: {slow_print[1][first]} vs {fast_print[1][first]}"
    assert fast_print == slow_print
    if merges:
        assert fast.num_schedule_calls < 0.8 * slow.num_schedule_calls, (
            f"blocked runs unused: {fast.num_schedule_calls} vs {slow.num_schedule_calls} calls")
    if engine.get("long_prefill_token_threshold") or engine in (_AUTELLIX_SMALL, _PREVIEW_SMALL):
        assert engine_.num_prefill_runs > 0, "chunked-prefill runs unused"


def test_merged_blocked_run_leaves_the_preview_aging_clocks_of_its_last_step(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """The preview stamps each scheduled request's aging clock every step; a merged blocked run of
    ``k`` steps must leave the stamp its last single step would (not the run's first step's)."""
    monkeypatch.setenv(FAST_PATHS_ENV, "1")
    config = _preview_config()
    sim = Simulator(_kv_bound_workload(), config, LinearStepTimeModel(), ListSink(), ORIGIN)
    schedule = sim.engine.schedule
    runs: list[tuple[float, float, set[float | None]]] = []

    def recording(plan: RunPlan | int = 1) -> Any:
        record = schedule(plan)
        if isinstance(plan, RunPlan) and plan.is_waiting_hidden:
            s = sim.engine.scheduler
            runs.append((sim.now_s, plan.last_step_s,
                         {s.req_state[r.request_id].mlfq_last_scheduled_s for r in s.running}))
        return record

    sim.engine.schedule = recording
    sim.run()
    assert runs, "no merged blocked run: the preview's runs are certified"
    for start_s, last_s, stamps in runs:
        assert last_s > start_s and stamps == {last_s}


@pytest.mark.parametrize(("policy", "engine", "admission"), [
    ("fcfs", {}, True),
    ("ThunderAgentScheduler", {}, False),
    ("MarsScheduler", {}, True),
])
def test_a_sink_with_kinds_gets_those_events_and_the_others_are_not_built(
        monkeypatch: pytest.MonkeyPatch, policy: str, engine: dict[str, Any], admission: bool) -> None:
    """compare's sinks take only the metrics' kinds: they must get exactly the events of those
    kinds a full sink gets, from the same run, and no snapshot or admission update is built."""
    from mars_openhands.stream import events as ev

    monkeypatch.setenv(FAST_PATHS_ENV, "1")
    config = SimConfig(policy=policy, num_tool_workers=3, is_admission_enabled=admission,
                       admission=AdmissionParams(cpu_set_backlog_ratio=4.0),
                       engine=InprocEngineParams(num_gpu_blocks=NUM_BLOCKS, max_model_len=4096, **engine))
    full = ListSink()
    full_result = Simulator(_kv_bound_workload(), config, LinearStepTimeModel(), full, ORIGIN).run()
    built: list[str] = []
    for cls in (ev.EngineStep, ev.AdmissionUpdate):
        original = cls.model_construct
        monkeypatch.setattr(cls, "model_construct",
                            lambda *a, _o=original, **kw: built.append("x") or _o(*a, **kw))
    part = ListSink(kinds=METRIC_KINDS)
    part_result = Simulator(_kv_bound_workload(), config, LinearStepTimeModel(), part, ORIGIN).run()
    assert {e.kind for e in full.events} >= {"engine_step", "admission_update", *METRIC_KINDS} - {
        "kv_retained", "kv_released", "preempted"}
    assert [e.model_dump() for e in part.events] == [
        e.model_dump() for e in full.events if e.kind in METRIC_KINDS]
    assert {s: r.end_s for s, r in part_result.sessions.items()} == {
        s: r.end_s for s, r in full_result.sessions.items()}
    assert part_result.num_preemptions == full_result.num_preemptions > 0
    assert part_result.num_events == len(part.events) < full_result.num_events
    assert not built, f"{len(built)} filtered events built"


def test_a_merged_run_spans_admission_ticks_and_each_tick_reads_its_single_steps_kv(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """With nobody waiting for admission a tick admits no one, so a blocked run may span ticks;
    each tick inside it must report the used KV blocks the single steps would have left by then
    (the window moves on it): the admission updates, and everything else, equal both ways."""
    spans: list[int] = []
    plan_run = Simulator._plan_run

    def noting(self: Simulator, rep: Any) -> RunPlan:
        plan = plan_run(self, rep)
        if rep.run_kv is not None:
            spans.append(sum(t > self._next_tick_s for t in rep.run_kv.step_ends_s))
        return plan

    monkeypatch.setattr(Simulator, "_plan_run", noting)
    config = _preview_config(update_interval_s=0.02)
    prints = []
    for flag in ("0", "1"):
        monkeypatch.setenv(FAST_PATHS_ENV, flag)
        sink = ListSink()
        result = Simulator(_kv_bound_workload(), config, LinearStepTimeModel(), sink, ORIGIN).run()
        updates = [e.model_dump() for e in sink.events if e.kind == "admission_update"]
        prints.append((_fingerprint(result, sink), updates))
    assert spans and max(spans) > 0, "no merged run spanned a tick"
    assert prints[0][1] and prints[1][1] == prints[0][1], "a tick inside a run read other KV"
    assert prints[1][0] == prints[0][0]


def test_the_previews_waiting_queue_is_always_in_key_order(monkeypatch: pytest.MonkeyPatch) -> None:
    """``is_waiting_order_timeless``: a merged run need not end before the preview's periodic re-sort,
    because its queue is in key order before every ``schedule()`` (prepended requests included)."""
    monkeypatch.setenv(FAST_PATHS_ENV, "1")
    config = _preview_config()
    sim = Simulator(_kv_bound_workload(), config, LinearStepTimeModel(), ListSink(), ORIGIN)
    s = sim.engine.scheduler
    assert s.is_waiting_order_timeless()
    schedule = sim.engine.schedule
    checked = []

    def checking(plan: RunPlan | int = 1) -> Any:
        queue = list(s.waiting)
        if len(queue) > 1 and not s.waiting.is_dirty:
            assert queue == sorted(queue, key=lambda r: s.waiting_key(r, sim.now_s))
            checked.append(any(s.waiting.order_of(r) < 0 for r in queue))
        return schedule(plan)

    sim.engine.schedule = checking
    result = sim.run()
    assert result.num_preemptions > 0 and checked and any(checked), "no queue with a prepended request"


_MARS_CONFIGS: dict[str, dict[str, Any]] = {
    "response-ratio": {},
    "fifo": {"residency": {"order": "fifo"}},
    "mlfq": {"mars": {"mlfq": True}},
    "short-hold": {"residency": {"max_hold_s": 0.2}},
}
"""MarsScheduler's residency orders, its MLFQ levels, and a hold bound short enough to act."""


@pytest.mark.parametrize("gpu_only_runs", [False, True])
@pytest.mark.parametrize("mars", list(_MARS_CONFIGS))
def test_mars_blocked_runs_without_the_tier(monkeypatch: pytest.MonkeyPatch, mars: str,
                                            gpu_only_runs: bool) -> None:
    """MarsScheduler without a host tier merges blocked runs only with ``merges_gpu_only_runs``
    (off: one ``schedule()`` per blocked step, so its golden runs keep their hashes); on, the run
    is the same to the last bit with fewer calls."""
    from mars_openhands.engine.schedulers.mars import MarsScheduler

    monkeypatch.setattr(MarsScheduler, "merges_gpu_only_runs", gpu_only_runs)
    config = SimConfig(policy="MarsScheduler", num_tool_workers=3, is_admission_enabled=True,
                       admission=AdmissionParams(cpu_set_backlog_ratio=4.0),
                       engine=InprocEngineParams(num_gpu_blocks=NUM_BLOCKS, max_model_len=4096,
                                                 additional_config={"mars": _MARS_CONFIGS[mars]}))
    workload = growing_sessions(output_tokens=(90, 13), tool_s=(0.2, 0.15))  # long decodes, long tools
    slow, fast, slow_print, fast_print, _ = _both_ways(monkeypatch, config, workload)
    assert slow.num_preemptions > 0, "the workload must be KV-bound"
    assert fast_print[0] == slow_print[0], "per-request times differ"
    assert fast_print == slow_print
    if gpu_only_runs:
        # steady runs merge both ways here (nothing waits in vLLM's queue while turns are held)
        assert fast.num_schedule_calls < slow.num_schedule_calls, (
            f"blocked runs unused: {fast.num_schedule_calls} vs {slow.num_schedule_calls} calls")
    else:
        assert fast.num_schedule_calls == slow.num_schedule_calls
