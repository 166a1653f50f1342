"""The simulator's fast paths are exact as a property: for every policy of the registry
(``eval.policies.POLICIES``: the baselines, the ``*-offload`` host-tier variants over a small host
tier, the ablations, ``unbounded-kv``) and the scheduler settings that make levels change inside a
run, seeded random small workloads run the same with ``MARS_SIM_FAST_PATHS=0`` (every step its own
``schedule()``) and with the fast paths on: every turn's times, every event but the snapshots, the
host tier's copies, and the running order vLLM schedules from at the start of every step both runs
share (eval/sim.py, engine/harness/runs.py, engine/schedulers/coalesce.py).

Why a property: the hand-made workloads of test_sim_fast_paths.py and
test_sim_host_kv_fast_paths.py reach the cases their authors thought of. A merged run stands for
``k`` steps in one ``schedule()``, so any per-step decision the run's certification forgets (a
running-queue sort by ``running_key`` that a single step would do, a level that changes with the
service a decode attains, a timer, a held turn) shows up here as a difference on some schedule.
What is random (all from the seed, :func:`random_case`): 3-8 sessions of 2-6 turns arriving in
the first 1.5 s (some at the same instant: ties in the running keys), prompts of 20-900 tokens,
outputs of 1-220 tokens (multi-step decode runs; the scaled levels demote inside them), tools of
1 ms to 3 s, a KV pool between one session's context and a third of the workload's (waits,
preemptions), the step budget and running cap (how often ``_allocation_may_fail`` makes a step
sort its running queue), tool workers, the host tier's size, and on odd seeds two replicas
behind a random router (one replica's merged run must not move what another does).

``MARS_TEST_FAST_PATH_SEEDS`` (default 6) sets the workloads per policy; a deeper hunt:
``MARS_TEST_FAST_PATH_SEEDS=40 pytest tests/unit/eval/test_sim_fast_paths_random.py``.
"""

from __future__ import annotations

import dataclasses
import os
import random
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

import pytest
from compare_helpers import sim_fingerprint

pytest.importorskip("vllm")

from eval.policies import (  # noqa: E402
    POLICIES,
    admission_modes,
    merge_config,
    unbounded_kv_blocks,
)
from eval.runs import sim_config  # noqa: E402
from eval.sim import FAST_PATHS_ENV, LinearStepTimeModel, SimConfig, SimResult, Simulator  # noqa: E402
from eval.sweep_options import CompareOptions  # noqa: E402
from eval.workloads.format import Session, Turn, Workload, WorkloadMeta  # noqa: E402
from mars_openhands.engine.schedulers.mars import MarsScheduler  # noqa: E402
from mars_openhands.policy.placement import ROUTING_POLICIES  # noqa: E402
from mars_openhands.stream.transport import ListSink  # noqa: E402

NUM_SEEDS = int(os.environ.get("MARS_TEST_FAST_PATH_SEEDS", "6"))
"""Random workloads per policy (6, ~35 s of simulation in all: seed 5 is the first whose two
replicas caught a merged run crossing another replica's step end)."""

ORIGIN = datetime(2026, 1, 1, tzinfo=UTC)
BLOCK_SIZE = 16
KV_BYTES_PER_BLOCK = 16 * 98_304
"""A host-tier block copy's bytes (1.5 MiB: as test_sim_host_kv_fast_paths.py): 0.05-0.5 GiB of
host tier holds 34-341 blocks, fewer than the workload's prefixes (host evictions)."""

_SMALL_LEVELS = {"prompt_thresholds_tokens": [64, 256, 1024], "quanta_tokens": [128, 64, 32, 16]}
"""MLFQ levels scaled to these workloads (defaults 2,048-32,768 tokens are never reached)."""


@dataclass(frozen=True)
class PolicyCase:
    """One policy of the registry, maybe with its settings scaled to small workloads."""

    policy: str
    """Key of ``POLICIES``."""
    extra_config: dict[str, Any] | None = None
    """Merged into the policy's ``--additional-config``."""
    gpu_only_runs: bool = False
    """``MarsScheduler.merges_gpu_only_runs`` on (mars merges blocked runs without the tier)."""
    merges: bool = True
    """Merged runs are expected on some workload (GPU-only mars merges no blocked run; nothing
    waits under ``unbounded-kv``)."""
    is_kv_bound: bool = True
    """Some workload preempts, suspends or blocks a request on KV (not ``unbounded-kv``; not the
    preview at its own settings, which none of the default seeds' workloads fills: its scaled
    case is KV-bound)."""

    @property
    def name(self) -> str:
        return self.policy + ("-scaled" if self.extra_config else "") + (
            "-gpu-runs" if self.gpu_only_runs else "")


_CASES: tuple[PolicyCase, ...] = (
    *(PolicyCase(p, merges=not (POLICIES[p].scheduler == "MarsScheduler" and POLICIES[p].host_kv is None)
                 and not POLICIES[p].is_kv_unbounded,
                 is_kv_bound=not POLICIES[p].is_kv_unbounded and p != "mars-preview") for p in POLICIES),
    # Autellix's levels as test_sim_fast_paths.py scales them: decodes of 1-220 tokens use up
    # 16-128-token quanta (demotions inside decode runs), programs pass the service thresholds.
    PolicyCase("autellix", {"mars": {"autellix": {"service_thresholds_tokens": [64, 256, 1024],
                                                  "level_quanta_tokens": [128, 64, 32, 16]}}}),
    # The preview's levels scaled, aging within a few steps (its running key reads the clock).
    PolicyCase("mars-preview", {"mars": {"levels": {**_SMALL_LEVELS, "aging_interval_s": 0.006}}}),
    # MARS's blocked runs without the tier, its MLFQ levels scaled, holds short enough to expire.
    PolicyCase("mars", gpu_only_runs=True),
    PolicyCase("mars-mlfq", {"mars": {"levels": {**_SMALL_LEVELS, "aging_interval_s": 0.05},
                                      "residency": {"max_hold_s": 0.3}}}, gpu_only_runs=True),
    PolicyCase("mars-offload", {"mars": {"mars": {"mlfq": True}, "levels": _SMALL_LEVELS,
                                         "residency": {"order": "fifo", "max_hold_s": 0.3}}}),
)


@dataclass(frozen=True)
class RandomCase:
    """A seeded workload and the engine around it."""

    workload: Workload
    num_gpu_blocks: int
    max_num_batched_tokens: int
    max_num_seqs: int
    num_tool_workers: int
    host_kv_gib: float
    num_replicas: int
    """1, or 2 on odd seeds: engines behind one control plane, each stepping on the one clock."""
    router: str
    """The control plane's router (several replicas)."""


def random_case(seed: int) -> RandomCase:
    """The workload and engine of ``seed`` (module docstring). Pure."""
    rng = random.Random(seed)
    sessions = []
    for i in range(rng.randint(3, 8)):
        num_turns = rng.randint(2, 6)
        turns = [Turn(prompt_tokens_appended=rng.randint(100, 900) if k == 0 else rng.randint(20, 500),
                      output_tokens=rng.randint(1, 220),
                      tool_name=None if k == num_turns - 1 else "bash",
                      tool_duration_s=0.0 if k == num_turns - 1 else round(10 ** rng.uniform(-3, 0.5), 6))
                 for k in range(num_turns)]
        arrival_s = 0.0 if rng.random() < 0.3 else round(rng.uniform(0.0, 1.5), 6)
        sessions.append(Session(session_id=f"s{i}", arrival_s=arrival_s, turns=tuple(turns)))
    workload = Workload(meta=WorkloadMeta(source="test:random", seed=seed), sessions=tuple(sessions))
    largest = max(-(-s.max_context_tokens // BLOCK_SIZE) for s in workload.sessions)
    total = sum(-(-s.max_context_tokens // BLOCK_SIZE) for s in workload.sessions)
    num_blocks = rng.randint(largest + 2, max(largest + 3, total // 3))
    max_num_seqs = rng.choice([4, 8, 256])
    num_replicas = 1 + seed % 2
    return RandomCase(
        workload, num_gpu_blocks=max(largest + 2, num_blocks // num_replicas),  # per replica
        max_num_batched_tokens=max(max_num_seqs, rng.choice([256, 512, 1024, 8192])),
        max_num_seqs=max_num_seqs, num_tool_workers=rng.randint(1, 4),
        host_kv_gib=round(rng.uniform(0.05, 0.5), 3), num_replicas=num_replicas,
        # pooled-kv is left out: it merges steady runs only (test_sim_replicas.py compares it).
        router=rng.choice(sorted(set(ROUTING_POLICIES) - {"pooled-kv"})))


def case_config(case: PolicyCase, rc: RandomCase) -> SimConfig:
    """``case.policy``'s config as ``compare`` builds it (:func:`eval.runs.sim_config`, its
    admission window under ``--admission auto``) on ``rc``'s engine. Pure."""
    spec = POLICIES[case.policy]
    options = CompareOptions(policies=(case.policy,), num_gpu_blocks=rc.num_gpu_blocks,
                             num_tool_workers=rc.num_tool_workers, host_kv_gib=rc.host_kv_gib,
                             host_kv_bytes_per_block=KV_BYTES_PER_BLOCK, max_virtual_s=3600.0)
    blocks = unbounded_kv_blocks(rc.workload, BLOCK_SIZE) if spec.is_kv_unbounded else rc.num_gpu_blocks
    config = sim_config(options, case.policy, admission_modes("auto", case.policy)[0], blocks)
    additional = merge_config(config.engine.additional_config, case.extra_config or {})
    engine = config.engine.model_copy(update={
        "additional_config": additional, "max_num_batched_tokens": rc.max_num_batched_tokens,
        "max_num_seqs": rc.max_num_seqs})
    return config.model_copy(update={"engine": engine, "num_replicas": rc.num_replicas,
                                     "router": rc.router if rc.num_replicas > 1 else config.router})


@contextmanager
def _gpu_only_runs(monkeypatch: pytest.MonkeyPatch, on: bool) -> Iterator[None]:
    with monkeypatch.context() as m:
        m.setattr(MarsScheduler, "merges_gpu_only_runs", on)
        yield


def _record_running_orders(sim: Simulator) -> dict[float, tuple[str, ...]]:
    """Scheduler clock -> the running order vLLM schedules from at the first ``schedule()`` then
    (after our schedulers' ``_reorder``; stock vLLM's own order). Mutates ``sim``'s scheduler."""
    scheduler = sim.engine.scheduler
    orders: dict[float, tuple[str, ...]] = {}
    if hasattr(scheduler, "_reorder"):
        reorder = scheduler._reorder

        def recording(now: float) -> None:
            reorder(now)
            orders.setdefault(now, tuple(r.request_id for r in scheduler.running))

        scheduler._reorder = recording
    else:
        schedule = scheduler.schedule

        def recording_stock(*args: Any, **kwargs: Any) -> Any:
            orders.setdefault(sim.now_s, tuple(r.request_id for r in scheduler.running))
            return schedule(*args, **kwargs)

        scheduler.schedule = recording_stock
    return orders


def run_case(monkeypatch: pytest.MonkeyPatch, config: SimConfig, workload: Workload, *,
             fast: bool) -> tuple[SimResult, tuple[Any, ...], dict[float, tuple[str, ...]], int]:
    """One run: its result, fingerprint (:func:`sim_fingerprint`, plus the host tier's copies),
    running orders and KV waits (preemptions, MARS's suspensions, blocked merged runs). The reference (``fast=False``) with a host tier also steps its steady
    runs one at a time (``coalesce_max_steps=1``, as test_sim_host_kv_fast_paths.py: with the
    tier those are exact too); without one steady runs are the model both ways."""
    monkeypatch.setenv(FAST_PATHS_ENV, "1" if fast else "0")
    if not fast and config.engine.host_kv is not None:
        config = config.model_copy(update={"coalesce_max_steps": 1})
    sink = ListSink()
    sim = Simulator(workload, config, LinearStepTimeModel(), sink, ORIGIN)
    orders = _record_running_orders(sim)
    schedule, num_blocked_runs = sim.engine.schedule, [0]

    def counting(plan: Any = 1) -> Any:
        num_blocked_runs[0] += bool(getattr(plan, "is_waiting_hidden", False))
        return schedule(plan)

    sim.engine.schedule = counting
    result = sim.run()
    fingerprint = sim_fingerprint(result, sink.events)
    if sim.engine.host_kv is not None:
        fingerprint = (*fingerprint, list(sim.engine.host_kv.worker.history))
    # KV-bound: requests preempted, (MARS's residency) sessions suspended to make room, or a
    # merged run that proved a waiting request blocked on KV.
    num_kv_waits = (result.num_preemptions + getattr(sim.engine.scheduler, "num_suspensions", 0)
                    + num_blocked_runs[0])
    return result, fingerprint, orders, num_kv_waits


def assert_same_run(slow_print: tuple[Any, ...], fast_print: tuple[Any, ...],
                    slow_orders: dict[float, tuple[str, ...]], fast_orders: dict[float, tuple[str, ...]],
                    label: str) -> None:
    """Both ways are the same run; the message names the first difference. Pure."""
    sessions = [s for s in slow_print[0] if slow_print[0][s] != fast_print[0].get(s)]
    assert not sessions, f"{label}: session {sessions[0]} differs: {slow_print[0][sessions[0]]} vs " \
                         f"{fast_print[0].get(sessions[0])}"
    first = next((i for i, (a, b) in enumerate(zip(slow_print[1], fast_print[1], strict=False)) if a != b), None)
    assert first is None, f"{label}: event {first} differs: {slow_print[1][first]} vs {fast_print[1][first]}"
    assert fast_print == slow_print, f"{label}: steps, preemptions, KV at the end, makespan or copies differ"
    # A merged run's schedule() starts where a single step does (its end is the single steps' chain).
    extra = sorted(set(fast_orders) - set(slow_orders))
    assert not extra, f"{label}: a step starts at {extra[0]} only with the fast paths"
    differ = [t for t in fast_orders if fast_orders[t] != slow_orders[t]]
    assert not differ, (f"{label}: at {differ[0]} vLLM schedules the running requests in the order "
                        f"{fast_orders[differ[0]]}, one step at a time {slow_orders[differ[0]]}")


@pytest.mark.parametrize("case", _CASES, ids=lambda c: c.name)
def test_fast_paths_are_exact_on_random_workloads(monkeypatch: pytest.MonkeyPatch, case: PolicyCase) -> None:
    """Every seed's run is the same with and without the fast paths (:func:`assert_same_run`);
    over the seeds the workloads reach the paths (a preemption, suspension or blocked run; merged
    runs where expected)."""
    num_kv_waits, calls = 0, []
    with _gpu_only_runs(monkeypatch, case.gpu_only_runs):
        for seed in range(NUM_SEEDS):
            rc = random_case(seed)
            config = case_config(case, rc)
            slow, slow_print, slow_orders, kv_waits = run_case(monkeypatch, config, rc.workload, fast=False)
            fast, fast_print, fast_orders, _ = run_case(monkeypatch, config, rc.workload, fast=True)
            assert all(r.end_s is not None for r in slow.sessions.values())
            assert_same_run(slow_print, fast_print, slow_orders, fast_orders, f"{case.name} seed {seed}")
            num_kv_waits += kv_waits
            calls.append((fast.num_schedule_calls, slow.num_schedule_calls))
    if case.is_kv_bound:
        assert num_kv_waits > 0, f"{case.name}: no workload preempted, suspended or blocked (not KV-bound)"
    if case.merges:
        assert any(f < s for f, s in calls), f"{case.name}: no merged run saved a schedule() call: {calls}"


def test_a_merged_run_that_skips_a_running_sort_rejoins_the_single_steps(monkeypatch: pytest.MonkeyPatch) -> None:
    """The suspected fault class, reached: a step sorts its running queue by ``running_key`` only
    while a request prefills or an allocation may fail (``_allocation_may_fail``, which counts
    the waiting requests), and a merged run checks once, at its start, with its waiting queue
    hidden. Here (Autellix, seed 4) the single steps sort inside a run whose
    merged call did not, so at the next step both runs share the running queue comes in in
    another order; that step sorts it (the free blocks only fell in the run, and the waiting
    queue is seen again), and the two runs are the same run, the order vLLM schedules from at
    every shared step included."""
    from mars_openhands.engine.schedulers.base import MarsBaseScheduler

    case = next(c for c in _CASES if c.name == "autellix")
    rc = random_case(4)
    config = case_config(case, rc)
    before: dict[float, tuple[str, ...]] = {}
    reorder = MarsBaseScheduler._reorder

    def recording(self: Any, now: float) -> None:
        before.setdefault(now, tuple(r.request_id for r in self.running))
        reorder(self, now)

    monkeypatch.setattr(MarsBaseScheduler, "_reorder", recording)
    _, slow_print, slow_orders, _ = run_case(monkeypatch, config, rc.workload, fast=False)
    slow_before = dict(before)
    before.clear()
    fast, fast_print, fast_orders, _ = run_case(monkeypatch, config, rc.workload, fast=True)
    rejoined = [t for t in before if before[t] != slow_before[t]]
    assert rejoined, "no merged run carried a running order the single steps had sorted"
    assert all(fast_orders[t] == slow_orders[t] for t in rejoined)
    assert_same_run(slow_print, fast_print, slow_orders, fast_orders, "autellix seed 4")


def test_an_idle_replicas_retained_kv_expires_as_one_step_at_a_time(monkeypatch: pytest.MonkeyPatch) -> None:
    """Two replicas, continuum over the tier (its TTL pins): replica 1 idles with retained KV
    while replica 0 decodes. With the tier an idle engine steps once its retained KV expires
    (``has_requests``), which the loop notices at its first pass after the expiry: one step at a
    time, replica 0's next single step end. A merged run of replica 0 must not cross that wake
    (``Simulator._other_replicas_bound_s``, ``InprocEngine.next_wake_s``), or the expiry comes at
    the run's end (seed 1's workload: 'kv_released' at 4.400 s instead of 4.320 s before)."""
    case = next(c for c in _CASES if c.name == "continuum-offload")
    rc = dataclasses.replace(random_case(1), num_gpu_blocks=246, max_num_batched_tokens=8192,
                             max_num_seqs=8, num_tool_workers=2, host_kv_gib=0.187, num_replicas=2,
                             router="least-sessions")
    config = case_config(case, rc)
    slow, slow_print, slow_orders, _ = run_case(monkeypatch, config, rc.workload, fast=False)
    fast, fast_print, fast_orders, _ = run_case(monkeypatch, config, rc.workload, fast=True)
    assert any(e["kind"] == "kv_released" and e["reason"] == "expired" and e["source"] == "engine:1"
               for e in slow_print[1]), "no retained KV expired on replica 1"
    assert_same_run(slow_print, fast_print, slow_orders, fast_orders, "continuum-offload, 2 replicas")
    assert fast.num_schedule_calls < slow.num_schedule_calls


def test_a_replica_whose_host_load_finished_schedules_at_once(monkeypatch: pytest.MonkeyPatch) -> None:
    """Two replicas, stock vLLM over the tier (seed 9's workload, sticky-hash): a turn of replica 1
    waits for its host load; the empty step that sees the load finished leaves it schedulable
    (not blocked), and, as with one engine, the replica steps again at once. It used to retry at
    the loop's next pass, another replica's next step end: one step at a time s0#2 was first
    scheduled at 2.603 s, behind a merged run of replica 0 at 2.800 s."""
    case = next(c for c in _CASES if c.name == "vllm-offload-lru")
    rc = random_case(9)
    assert rc.num_replicas == 2 and rc.router == "sticky-hash"
    config = case_config(case, rc)
    slow, slow_print, slow_orders, _ = run_case(monkeypatch, config, rc.workload, fast=False)
    fast, fast_print, fast_orders, _ = run_case(monkeypatch, config, rc.workload, fast=True)
    assert_same_run(slow_print, fast_print, slow_orders, fast_orders, "vllm-offload-lru, 2 replicas")
    assert fast.num_schedule_calls < slow.num_schedule_calls
