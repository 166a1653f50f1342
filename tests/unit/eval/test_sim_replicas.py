"""N engines behind one control plane in the simulator (eval/sim.py, ``SimConfig.num_replicas``):
one replica is the single-engine run, sticky routing keeps a session's turns on one replica,
per-turn routing may move them, and a lost replica's sessions complete elsewhere, nothing leaked."""

from __future__ import annotations

import dataclasses

import pytest

pytest.importorskip("vllm")

from eval.sim import LinearStepTimeModel, SimConfig, SimResult, simulate  # noqa: E402
from eval.workloads.format import Session, Turn, Workload, WorkloadMeta  # noqa: E402
from mars_openhands.engine.harness.inproc_engine import InprocEngineParams  # noqa: E402
from mars_openhands.policy.placement import ROUTING_POLICIES  # noqa: E402
from mars_openhands.stream.transport import ListSink  # noqa: E402


def _workload(n: int, gap_s: float = 0.3, turns: int = 5) -> Workload:
    sessions = []
    for i in range(n):
        spec = [Turn(prompt_tokens_appended=300 + 40 * i + 7 * k, output_tokens=20 + 3 * k + i,
                     tool_name="bash", tool_duration_s=0.2 + 0.1 * ((i + k) % 3))
                for k in range(turns - 1)]
        spec.append(Turn(prompt_tokens_appended=50, output_tokens=10))
        sessions.append(Session(session_id=f"s{i}", arrival_s=i * gap_s, turns=tuple(spec)))
    return Workload(meta=WorkloadMeta(source="test"), sessions=tuple(sessions))


def _config(policy: str = "fcfs", blocks: int = 2048, **kw: object) -> SimConfig:
    return SimConfig(policy=policy, engine=InprocEngineParams(num_gpu_blocks=blocks,
                                                              max_model_len=16384), **kw)


def _rows(result: SimResult) -> list[tuple]:
    return [(sid, t.turn, t.first_scheduled_s, t.first_token_s, t.finish_s, t.num_cached_tokens,
             t.num_preemptions) for sid, r in result.sessions.items() for t in r.turns]


def _assert_complete(result: SimResult, workload: Workload) -> None:
    for spec in workload.sessions:
        record = result.sessions[spec.session_id]
        assert record.end_s is not None, spec.session_id
        assert [t.turn for t in record.turns] == list(range(spec.num_turns))
        assert all(t.finish_s is not None for t in record.turns)


@pytest.mark.parametrize("policy", ["fcfs", "MarsScheduler"])
def test_one_replica_is_the_single_engine_run_under_every_router(policy: str) -> None:
    workload = _workload(8)
    base = simulate(workload, _config(policy, is_admission_enabled=True), LinearStepTimeModel())
    for router in ("least-sessions", "llm-d", "pooled-kv"):
        again = simulate(workload, _config(policy, is_admission_enabled=True, router=router),
                         LinearStepTimeModel())
        assert _rows(again) == _rows(base)
        assert again.kv_blocks_at_end == base.kv_blocks_at_end


@pytest.mark.parametrize("policy", ["fcfs", "MarsScheduler"])
def test_two_replicas_keep_each_sessions_turns_on_one_and_share_the_load(policy: str) -> None:
    workload = _workload(10)
    sink = ListSink()
    result = simulate(workload, _config(policy, num_replicas=2, is_admission_enabled=True),
                      LinearStepTimeModel(), sink)
    _assert_complete(result, workload)
    homes = {sid: {t.replica for t in r.turns} for sid, r in result.sessions.items()}
    assert all(len(h) == 1 for h in homes.values()), homes
    per_replica = [sum(1 for h in homes.values() if h == {i}) for i in (0, 1)]
    assert min(per_replica) >= 3, per_replica
    sources = {e.source for e in sink.events if e.kind in ("first_token", "finished")}
    assert sources == {"engine:0", "engine:1"}
    assert result.num_rehomes == 0 and result.kv_blocks_at_end[2] == 0
    # Two engines at half the load each: every session finishes no later than on one engine.
    one = simulate(workload, _config(policy, is_admission_enabled=True), LinearStepTimeModel())
    assert result.makespan_s <= one.makespan_s


@pytest.mark.parametrize("router", sorted(ROUTING_POLICIES))
def test_every_router_completes_every_session_on_four_replicas(router: str) -> None:
    workload = _workload(12, gap_s=0.1)
    result = simulate(workload, _config("MarsScheduler", blocks=256, num_replicas=4, router=router,
                                        is_admission_enabled=True), LinearStepTimeModel())
    _assert_complete(result, workload)
    assert result.kv_blocks_at_end[2] == 0
    used = {t.replica for r in result.sessions.values() for t in r.turns}
    assert len(used) >= 3, (router, used)


@pytest.mark.parametrize("policy", ["fcfs", "MarsScheduler"])
def test_a_lost_replica_re_places_its_sessions_which_all_complete(policy: str) -> None:
    workload = _workload(12, gap_s=0.1)
    config = _config(policy, num_replicas=4, is_admission_enabled=True, lose_replica=(1, 1.0))
    result = simulate(workload, config, LinearStepTimeModel())
    _assert_complete(result, workload)
    loss = result.replica_loss
    assert loss is not None and loss.index == 1 and loss.at_s == 1.0
    assert loss.num_sessions_replaced >= 1 and loss.num_reprefill_tokens > 0
    late = [t for r in result.sessions.values() for t in r.turns if t.submit_s > 1.0]
    assert late and all(t.replica != 1 for t in late)
    failed = [t for r in result.sessions.values() for t in r.turns if t.num_failures]
    assert len(failed) == loss.num_turns_failed
    assert all(t.replica != 1 and t.finish_s is not None for t in failed)
    assert result.kv_blocks_at_end[2] == 0


@pytest.mark.parametrize("policy", ["fcfs", "MarsScheduler"])
def test_the_pooled_kv_bound_moves_sessions_with_their_prefix_and_leaks_nothing(policy: str) -> None:
    workload = _workload(12, gap_s=0.1)
    result = simulate(workload, _config(policy, blocks=1024, num_replicas=2, router="pooled-kv",
                                        is_admission_enabled=True), LinearStepTimeModel())
    _assert_complete(result, workload)
    moved = [(prev, t) for r in result.sessions.values()
             for prev, t in zip(r.turns, r.turns[1:], strict=False) if t.replica != prev.replica]
    assert moved and result.num_rehomes == len(moved)
    # A turn moved to the other replica hits the KV its previous turn left on the first one:
    # at least that turn's whole prompt, in full blocks.
    assert all((t.num_cached_tokens or 0) >= prev.num_prompt_tokens // 16 * 16 > 0
               for prev, t in moved), [(t.turn, t.num_cached_tokens) for _, t in moved]
    assert result.num_preemptions == 0
    assert result.kv_blocks_at_end == (2 * 1023, 0, 0), "one pool, every block free at the end"


def test_the_pooled_kv_bound_preempts_where_one_replicas_own_kv_would() -> None:
    workload = _workload(12, gap_s=0.1)
    apart = simulate(workload, _config(blocks=256, num_replicas=2), LinearStepTimeModel())
    pooled = simulate(workload, _config(blocks=256, num_replicas=2, router="pooled-kv"),
                      LinearStepTimeModel())
    _assert_complete(pooled, workload)
    assert apart.num_preemptions > 0 and pooled.num_preemptions == 0
    assert pooled.kv_blocks_at_end == (2 * 255, 0, 0)


@pytest.mark.parametrize("policy", ["fcfs", "MarsScheduler"])
def test_the_pooled_kv_bound_is_the_same_with_the_fast_paths_off(
        policy: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Only the first engine memoizes prefix hits and wraps the pool; the others' changes reach its
    memo through the one prefix-cache map: the same schedule as vLLM's own lookups."""
    from eval.sim import FAST_PATHS_ENV

    workload = _workload(12, gap_s=0.1)
    config = _config(policy, blocks=256, num_replicas=2, router="pooled-kv", is_admission_enabled=True)
    runs = []
    for flag in ("0", "1"):
        monkeypatch.setenv(FAST_PATHS_ENV, flag)
        runs.append(simulate(workload, config, LinearStepTimeModel()))
    assert _rows(runs[0]) == _rows(runs[1])
    assert runs[0].num_preemptions == runs[1].num_preemptions


def test_replica_settings_are_checked() -> None:
    with pytest.raises(ValueError, match="num_replicas"):
        _config(num_replicas=1, lose_replica=(0, 1.0))
    with pytest.raises(ValueError, match="known: least-sessions"):
        _config(router="round-robin")
    with pytest.raises(ValueError, match="one KV pool for every replica"):
        _config(num_replicas=2, router="pooled-kv", lose_replica=(0, 1.0))
    engine = InprocEngineParams(num_gpu_blocks=64, max_model_len=1024)
    with pytest.raises(ValueError, match="one per replica"):
        _config(num_replicas=2, replica_engines=(engine,))
    assert dataclasses.is_dataclass(LinearStepTimeModel())
