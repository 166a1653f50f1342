"""N engines behind one control plane in the simulator (eval/sim.py, ``SimConfig.num_replicas``):
one replica is the single-engine run, sticky routing keeps a session's turns on one replica,
per-turn routing may move them, and a lost replica's sessions complete elsewhere, nothing leaked."""

from __future__ import annotations

import dataclasses

import pytest

pytest.importorskip("vllm")

from eval.sim import LinearStepTimeModel, SimConfig, SimResult, Simulator, simulate  # noqa: E402
from eval.workloads.format import Session, Turn, Workload, WorkloadMeta  # noqa: E402
from mars_openhands.engine.harness.inproc_engine import InprocEngineParams  # noqa: E402
from mars_openhands.policy.admission import AdmissionParams  # noqa: E402
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


def _max_admitted(result: SimResult) -> int:
    """Most sessions holding a slot at once (admitted, not yet ended)."""
    marks = sorted([(r.admitted_s, 1) for r in result.sessions.values()]
                   + [(r.end_s, -1) for r in result.sessions.values()])  # an end first at a tie
    held = most = 0
    for _, step in marks:
        held += step
        most = max(most, held)
    return most


def test_the_window_holds_its_sessions_per_replica_up() -> None:
    """Admission pinned at one session per replica: four replicas hold four sessions at once, never
    more; after one is lost, the three left hold three (the lost one's sessions keep theirs)."""
    workload = _workload(12, gap_s=0.1)
    one = AdmissionParams(window_min=1, window_max=1, window_init=1)
    result = simulate(workload, _config("fcfs", num_replicas=4, is_admission_enabled=True, admission=one),
                      LinearStepTimeModel())
    _assert_complete(result, workload)
    assert _max_admitted(result) == 4
    lost = simulate(workload, _config("fcfs", num_replicas=4, is_admission_enabled=True, admission=one,
                                      lose_replica=(1, 1.0)), LinearStepTimeModel())
    _assert_complete(lost, workload)
    late = [r for r in lost.sessions.values() if r.admitted_s > 1.5]  # a tick or more after the loss
    assert late and all(
        sum(1 for o in lost.sessions.values() if o.admitted_s <= r.admitted_s < o.end_s) <= 3 for r in late)


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


# ----------------------------------------------------------------------------- KV transfer on a move
_BYTES_PER_TOKEN = 98_304  # Qwen3-Coder-30B-A3B bf16


def _moved(result: SimResult) -> list[tuple]:
    return [(prev, t) for r in result.sessions.values()
            for prev, t in zip(r.turns, r.turns[1:], strict=False) if t.replica != prev.replica]


@pytest.mark.parametrize("policy", ["fcfs", "MarsScheduler"])
def test_a_moved_session_waits_for_its_kv_transfer(policy: str) -> None:
    """llm-d moves sessions per turn whatever the deployment (here on replicas short of KV): with a
    KV transfer the moved turn waits ``bytes / bandwidth`` for what lands; without, nothing is
    sent and it re-prefills."""
    workload = _workload(12, gap_s=0.1)
    config = _config(policy, blocks=256, num_replicas=2, router="llm-d", is_admission_enabled=True)
    apart = simulate(workload, config, LinearStepTimeModel())
    assert _moved(apart) and apart.num_kv_transfer_tokens == 0
    assert not any(t.num_transferred_tokens for _, t in _moved(apart))
    for gb_s in (5.0, 0.05):  # 1,000 tokens: ~0.02 s, ~2 s
        moving = simulate(workload, config.model_copy(update={
            "kv_transfer_gb_s": gb_s, "kv_bytes_per_token": _BYTES_PER_TOKEN}), LinearStepTimeModel())
        _assert_complete(moving, workload)
        assert moving.kv_blocks_at_end[2] == 0
        sent = [t for _, t in _moved(moving) if t.num_transferred_tokens]
        assert sent and moving.num_kv_transfer_tokens >= sum(t.num_transferred_tokens for t in sent)
        for t in sent:
            assert t.first_scheduled_s - t.submit_s >= t.num_transferred_tokens * _BYTES_PER_TOKEN / (gb_s * 1e9)


@pytest.mark.parametrize(("router", "kv_transfer_gb_s", "lose_replica"), [
    ("llm-d", None, None), ("llm-d", 0.05, None), ("least-sessions", None, (1, 1.0))])
def test_a_moved_session_keeps_its_first_arrival_on_its_new_replica(
        router: str, kv_transfer_gb_s: float | None, lose_replica: tuple[int, float] | None,
        monkeypatch: pytest.MonkeyPatch) -> None:
    """A session that moves is not a new session where it lands, whether a per-turn router moved
    it (with or without its KV) or its replica was lost: the gateway's ``mars_session_age_s``
    dates the new replica's record back to the session's first turn, so session-ordered policies
    (MARS's FIFO and residency order) keep its place."""
    from mars_openhands.engine.schedulers.sessions import SessionTable

    opened: list[tuple[str, float | None, float]] = []
    open_record = SessionTable.open

    def recording(self, session_id, now_s, age_s=None):  # noqa: ANN001, ANN202
        is_new = session_id not in self
        record = open_record(self, session_id, now_s, age_s)
        if is_new:
            opened.append((session_id, age_s, record.first_arrival_s))
        return record

    monkeypatch.setattr(SessionTable, "open", recording)
    workload = _workload(12, gap_s=0.1)
    config = _config("MarsScheduler", blocks=256, num_replicas=2 if lose_replica is None else 4,
                     router=router, is_admission_enabled=True, lose_replica=lose_replica,
                     kv_transfer_gb_s=kv_transfer_gb_s, kv_bytes_per_token=_BYTES_PER_TOKEN)
    result = simulate(workload, config, LinearStepTimeModel())
    _assert_complete(result, workload)
    moved = {t.turn for _, t in _moved(result)}
    assert moved and any(age is not None and age > 0 for _, age, _ in opened)
    for sid, age, first in opened:
        submitted = result.sessions[sid].turns[0].submit_s
        if age is None:  # the session's first turn: its own arrival here
            assert first >= submitted
        else:  # a later turn opening a record: dated back to its first turn, not "now"
            assert first == pytest.approx(submitted, abs=1e-9), (sid, age, first)


def test_a_moved_turn_hits_the_kv_that_landed_on_a_replica_with_room() -> None:
    workload = _workload(12, gap_s=0.1)
    config = _config("MarsScheduler", blocks=384, num_replicas=2, router="llm-d", is_admission_enabled=True,
                     kv_transfer_gb_s=5.0, kv_bytes_per_token=_BYTES_PER_TOKEN)
    result = simulate(workload, config, LinearStepTimeModel())
    sent = [(prev, t) for prev, t in _moved(result) if t.num_transferred_tokens]
    assert sent
    for prev, t in sent:
        assert (t.num_cached_tokens or 0) >= t.num_transferred_tokens >= prev.num_prompt_tokens // 16 * 16


def test_a_turn_in_transfer_is_in_flight_at_its_new_replica(monkeypatch: pytest.MonkeyPatch) -> None:
    """The gateway sends the request at the move and the replica waits for the KV: routers that
    read requests in flight see it during the transfer, counted once."""
    workload = _workload(12, gap_s=0.1)
    config = _config("MarsScheduler", blocks=256, num_replicas=2, router="llm-d", is_admission_enabled=True,
                     kv_transfer_gb_s=0.05, kv_bytes_per_token=_BYTES_PER_TOKEN)
    sim = Simulator(workload, config, LinearStepTimeModel())
    seen: list[tuple[int, int]] = []
    send = Simulator._send

    def checked(self, run, *, is_counted=False):  # noqa: ANN001, ANN202
        if is_counted:  # every unfinished turn routed to the replica, this one included
            routed = sum(1 for r, _ in self._by_request.values() if r.replica is run.replica)
            seen.append((self.plane.router.replicas[run.replica.index].num_in_flight, routed))
        return send(self, run, is_counted=is_counted)

    monkeypatch.setattr(Simulator, "_send", checked)
    result = sim.run()
    assert seen and result.num_kv_transfer_tokens > 0
    assert all(in_flight == routed for in_flight, routed in seen), seen
    assert [r.num_in_flight for r in sim.plane.router.replicas] == [0, 0]


def test_the_kv_transfer_is_the_same_with_the_fast_paths_off(monkeypatch: pytest.MonkeyPatch) -> None:
    """The import goes through the pool's own methods: the fused ones keep the prefix-hit memo
    exact (a stale memo would schedule a moved turn differently)."""
    from eval.sim import FAST_PATHS_ENV

    workload = _workload(12, gap_s=0.1)
    config = _config("MarsScheduler", blocks=256, num_replicas=3, router="mars-placement",
                     is_admission_enabled=True, kv_transfer_gb_s=5.0, kv_bytes_per_token=_BYTES_PER_TOKEN)
    runs = []
    for flag in ("0", "1"):
        monkeypatch.setenv(FAST_PATHS_ENV, flag)
        runs.append(simulate(workload, config, LinearStepTimeModel()))
    assert runs[0].num_kv_transfer_tokens > 0
    assert _rows(runs[0]) == _rows(runs[1])
    assert runs[0].num_kv_transfer_tokens == runs[1].num_kv_transfer_tokens


@pytest.mark.parametrize("seed", range(6))
def test_random_moves_with_transfers_and_a_lost_replica_complete_and_leak_nothing(seed: int) -> None:
    """The class, not one case: random workloads, routers that move sessions, transfers slow enough
    to be in flight when a replica is lost (its turns are re-sent once, and a transfer's late
    arrival sends nothing twice)."""
    import random

    rng = random.Random(seed)
    sessions = []
    for i in range(rng.randint(8, 14)):  # contexts below 2,700 tokens: a 256-block replica holds one
        turns = [Turn(prompt_tokens_appended=rng.randint(50, 600), output_tokens=rng.randint(5, 60),
                      tool_name="bash", tool_duration_s=rng.uniform(0.05, 1.5))
                 for _ in range(rng.randint(1, 4))]
        turns.append(Turn(prompt_tokens_appended=rng.randint(10, 100), output_tokens=rng.randint(5, 30)))
        sessions.append(Session(session_id=f"r{i}", arrival_s=rng.uniform(0.0, 2.0), turns=tuple(turns)))
    workload = Workload(meta=WorkloadMeta(source="test"),
                        sessions=tuple(sorted(sessions, key=lambda s: s.arrival_s)))
    router = ("llm-d", "mars-placement", "prefix-affinity")[seed % 3]
    config = _config(("fcfs", "MarsScheduler")[seed % 2], blocks=rng.choice((256, 512)), num_replicas=3,
                     router=router, is_admission_enabled=True, kv_transfer_gb_s=rng.choice((0.05, 1.0)),
                     kv_bytes_per_token=_BYTES_PER_TOKEN, lose_replica=(rng.randrange(3), rng.uniform(0.5, 3.0)))
    sim = Simulator(workload, config, LinearStepTimeModel())
    result = sim.run()
    _assert_complete(result, workload)
    assert result.kv_blocks_at_end[2] == 0
    # A turn in transfer counts as in flight at its new replica once, from the move on.
    assert [r.num_in_flight for r in sim.plane.router.replicas] == [0, 0, 0]
    lost = result.replica_loss
    assert lost is not None
    late = [t for r in result.sessions.values() for t in r.turns if t.first_scheduled_s is not None
            and t.first_scheduled_s > lost.at_s]
    assert all(t.replica != lost.index for t in late)


def test_kv_transfer_settings_are_checked() -> None:
    with pytest.raises(ValueError, match="needs num_replicas >= 2"):
        _config(kv_transfer_gb_s=50.0, kv_bytes_per_token=_BYTES_PER_TOKEN)
    with pytest.raises(ValueError, match="pooled-KV bound"):
        _config(num_replicas=2, router="pooled-kv", kv_transfer_gb_s=50.0, kv_bytes_per_token=1)
    with pytest.raises(ValueError, match="kv_bytes_per_token"):
        _config(num_replicas=2, kv_transfer_gb_s=50.0)


@pytest.mark.parametrize("seed", range(6))
def test_the_pooled_kv_bound_is_the_same_with_the_fast_paths_off_on_random_workloads(
        seed: int, monkeypatch: pytest.MonkeyPatch) -> None:
    """The class of the test above: on the random workloads of test_sim_fast_paths_random.py
    (KV between one session's context and a third of the workload's, so replicas reclaim each
    other's retained KV and their residency plans share the pool's budget), two pooled MARS
    replicas run the same schedule with and without merged steps."""
    from eval.sim import FAST_PATHS_ENV
    from tests.unit.eval.test_sim_fast_paths_random import random_case

    rc = random_case(seed)
    engine = InprocEngineParams(num_gpu_blocks=rc.num_gpu_blocks, max_model_len=16384,
                                max_num_seqs=rc.max_num_seqs,
                                max_num_batched_tokens=rc.max_num_batched_tokens)
    config = SimConfig(policy="MarsScheduler", engine=engine, num_replicas=2, router="pooled-kv",
                       is_admission_enabled=True)
    runs = []
    for flag in ("0", "1"):
        monkeypatch.setenv(FAST_PATHS_ENV, flag)
        runs.append(simulate(rc.workload, config, LinearStepTimeModel()))
    _assert_complete(runs[0], rc.workload)
    assert _rows(runs[0]) == _rows(runs[1])
