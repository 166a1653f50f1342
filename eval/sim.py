"""Virtual-time simulator over the REAL vLLM schedulers (design.md §6-§9; MARS arXiv 2604.26963 §6).

One discrete-event loop replays a workload (:mod:`eval.workloads`) against one in-process engine
(:class:`~mars_openhands.engine.harness.inproc_engine.InprocEngine`: stock vLLM or our scheduler plugins with
their real KV cache manager), the gateway's control plane (the very
:class:`~mars_openhands.control.plane.ControlPlane` both gateways run, on the virtual clock: its
sessions, tool tracker, AIMD window, reorder and session ends, so admission makes the live
gateway's decisions by construction) and a pool of ``num_tool_workers`` tool workers with a FIFO
queue.
Time is virtual: an engine step lasts what the step-time model says (H4's
:class:`~mars_openhands.engine.harness.executor.timing.StepTimeModel` or any :class:`StepTimer`), and when
the engine has nothing to run the clock jumps to the next event.

Mental model of one session (times on the virtual clock)::

    arrival ─ admission wait ─ turn 0 ──────────────── tool 0 (queue, run) ─ turn 1 ─ ... ─ end
              (window full)    queued→scheduled→tokens  enqueued→start→end     prompt = turn 0's
                                                                               prompt + output +
                                                                               observation

Engine timing follows vLLM's engine-core loop: ``schedule()`` at the step start, the model runs for
the modelled step time, ``update_from_output()`` at the step end, then requests that arrived during
the step are added (with their true arrival times) before the next ``schedule()``. CPU-plane events
(``tool_enqueued``, ``tool_start``, ``tool_end``, ``session_end``) reach our schedulers through
``post_event`` the moment they happen, which they drain at the next step, as the gateway forwards
them (its ≤ 50 ms batching delay is not modelled).

What the simulated gateway sees is what a live one would be sent: a session's arrival is its
``session_start`` and first request (in flight, so waiting for admission, from then), each later
turn a request sent at its tool's end, the tool calls' ``tool_enqueued`` / ``tool_start`` /
``tool_end``, and ``session_end`` after the final turn. The engine reports its KV to the gateway
just before every admission tick, as an ``engine_step`` would (``num_used_blocks /
num_gpu_blocks``), so the window and the KV budget of releases between ticks use that report.

Speed: one ``schedule()`` may stand for ``k`` single steps (a *merged run*). The engine plans
each step (:meth:`InprocEngine.plan_run`; the kinds of run, the planner and the path of one run:
:mod:`mars_openhands.engine.harness.runs`) given ``coalesce_max_steps`` and the next event that can
change the engine's input (:meth:`Simulator._next_hard_event_s`: an arrival, a tool's end, and an
admission tick only while a session waits for admission, as a tick then cannot change the
engine's input). Steady decode runs (nothing waits) go through vLLM's draft-token path and last
``k`` steps at the mean context (exact for a linear model); ``coalesce_max_steps=1`` turns them
off (``tests/integration/test_sim_vs_emulated.py`` checks both give the emulated server's
per-request schedule).

Past the KV knee the *fast paths* (blocked decode runs, chunked-prefill runs, a memo of vLLM's
prefix-hit lookup, telemetry the sink drops not computed) keep every decision and timing exact
(``MARS_SIM_FAST_PATHS=0`` turns them off; ``tests/unit/eval/test_sim_fast_paths.py`` compares both
ways for every policy); docs/structure.md "The simulator's fast paths" describes each.

Events: every event carries ``t_mono_ns`` = virtual nanoseconds since the run start and ``t_wall``
= ``wall_origin`` + the virtual offset. GPU-plane events come from our schedulers' own telemetry
(re-stamped with the virtual time); for stock vLLM, which has none, the simulator emits the same
kinds from what it observes. ``engine_step`` snapshots are emitted by the simulator every
``engine_step_interval_s`` of virtual time for every policy.
"""

from __future__ import annotations

import bisect
import gc
import heapq
import math
import os
import time
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from typing import Any

from eval.sim_types import (
    EngineStalled,
    LinearStepTimeModel,
    ReplicaLossReport,
    SessionRecord,
    SimConfig,
    SimResult,
    SimulationOverrun,
    TurnRecord,
)
from eval.workloads.format import Session, Workload
from mars_openhands.control.config import GatewayConfig, ReplicaConfig
from mars_openhands.control.metadata import gateway_xargs
from mars_openhands.control.plane import ControlPlane
from mars_openhands.control.sessions import Session as GatewaySession
from mars_openhands.engine.harness.inproc_engine import (
    EngineStepRecord,
    InprocEngine,
    SessionTokenStream,
)
from mars_openhands.engine.harness.kv_pool import pooled_params
from mars_openhands.engine.harness.runs import (
    RunKind,
    RunKv,
    RunPlan,
    StepTimer,
    decode_run_step_time_s,
)
from mars_openhands.policy.placement import routing_policy
from mars_openhands.stream import events as ev
from mars_openhands.stream.transport import EventSink

__all__ = [
    "EngineStalled",
    "LinearStepTimeModel",
    "ReplicaLossReport",
    "SessionRecord",
    "SimConfig",
    "SimResult",
    "SimulationOverrun",
    "Simulator",
    "StepTimer",
    "TurnRecord",
    "fast_paths_enabled",
    "gateway_config",
    "ideal_times_s",
    "simulate",
]

FAST_PATHS_ENV = "MARS_SIM_FAST_PATHS"
"""``MARS_SIM_FAST_PATHS=0`` turns the exact speed-ups of the event loop off (the reference the
exactness tests compare against; they change CPU time only, never a decision or a timing)."""

_QUIET_TICKS = 64
"""Admission ticks still run while the system is empty (0.8**64 ~ 1e-6: the tool-wait EMA has
decayed and the window has regrown to its cap) before idle time is skipped."""


# ----------------------------------------------------------------------------- helpers
def fast_paths_enabled() -> bool:
    """Whether the simulator's exact speed-ups are on (``$MARS_SIM_FAST_PATHS`` is not ``0``)."""
    return os.environ.get(FAST_PATHS_ENV, "1") != "0"


def gateway_config(config: SimConfig) -> GatewayConfig:
    """The simulated gateway's configuration: the run's admission settings and routing policy, in
    front of the simulated engines (replica ``i``'s ``engine_step`` source is
    ``config.source_of(i)``). Pure."""
    if config.num_replicas == 1:
        replicas = (ReplicaConfig(url="http://simulated-engine", name="sim",
                                  engine_source=config.engine_source),)
    else:
        replicas = tuple(ReplicaConfig(url=f"http://simulated-engine-{i}", name=f"sim{i}",
                                       engine_source=config.source_of(i))
                         for i in range(config.num_replicas))
    is_bound = routing_policy(config.router).pools_kv
    gateway = GatewayConfig(
        replicas=replicas, routing_policy=config.router if not is_bound else "least-sessions",
        is_admission_enabled=config.is_admission_enabled, admission=config.admission,
        reorder=config.reorder, num_tool_workers=config.num_tool_workers,
        tool_wait_idle_decay=config.tool_wait_idle_decay, block_size_tokens=config.engine.block_size,
    )
    # The pooled-KV bound is a router only the simulator can run (its engines share one KV pool):
    # the live gateway's validation refuses it, so it is set past that validation here.
    return gateway.model_copy(update={"routing_policy": config.router}) if is_bound else gateway


class _VirtualStampSink:
    """Re-stamps our schedulers' telemetry with the virtual clock (and, with several replicas, the
    replica's ``source``); drops their ``engine_step`` (the simulator emits snapshots on the
    virtual clock for every policy)."""

    def __init__(self, sim: Simulator, source: str | None = None) -> None:
        self._sim = sim
        self._source = source

    def emit(self, event: ev.Event) -> None:
        if event.kind != "engine_step":
            update = self._sim._stamps()
            if self._source is not None:
                update["source"] = self._source
            self._sim._emit_event(event.model_copy(update=update))

    def close(self) -> None:
        """Nothing to release (the simulator owns the real sink)."""


@dataclass
class _SessionRun:
    """Mutable state of one session during the run."""

    spec: Session
    record: SessionRecord
    gateway: GatewaySession | None = None
    """The control plane's session, from the arrival on."""
    stream: SessionTokenStream | None = None
    turn: int = 0
    prev_tool: tuple[str, float] | None = None
    replica: _Replica | None = None
    """The replica serving (or that served) its latest turn: its CPU-plane events go there."""
    kv_import: list[Any] | None = None
    """Block hashes of the prefix on its way to ``replica`` (``SimConfig.kv_transfer_gb_s``),
    written into its prefix cache when the turn reaches it."""
    is_in_transfer: bool = False
    """Its turn waits for its KV transfer (a ``kv_moved`` event sends it)."""


@dataclass
class _Replica:
    """One engine behind the control plane and its step state on the virtual clock."""

    index: int
    engine: InprocEngine
    timer: StepTimer
    source: str
    """``source`` of its GPU-plane events (the router's ``engine_step`` key)."""
    deferred: list[tuple[_SessionRun, float]] = field(default_factory=list)
    """Requests that arrived during its running step (added at the step's end)."""
    in_step: bool = False
    run_kv: RunKv | None = None
    """A merged run that spans admission ticks: the KV its single steps leave (read by a tick)."""
    step: tuple[RunPlan, EngineStepRecord, float, float] | None = None
    """Several replicas: its step in progress ``(plan, record, t_start, t_end)``."""
    is_blocked: bool = False
    """Several replicas: it scheduled nothing; retried after the next event or a new request."""
    is_lost: bool = False
    last_progress_s: float = 0.0
    last_snapshot_s: float | None = None
    last_step_s: float = 0.0


class _ToolPool:
    """``num_workers`` tool workers and a FIFO queue of ``(session, turn, enqueue_s)``."""

    def __init__(self, num_workers: int) -> None:
        self.num_workers = num_workers
        self.num_busy = 0
        self.queue: deque[tuple[_SessionRun, int, float]] = deque()


# ----------------------------------------------------------------------------- simulator
class Simulator:
    """One run: a workload through the gateway's admission, one engine and the tool pool.

    Args:
        workload: sessions with arrival times (apply an arrival process first).
        config: the run's configuration.
        step_timer: the step-time model.
        sink: where events go (``None``: no stream, faster). A sink with a ``kinds`` attribute
            (a set of event kinds, e.g. :class:`~mars_openhands.stream.transport.ListSink`'s) gets
            only those; the others are not built (``engine_step`` snapshots are not taken).
        wall_origin: ``t_wall`` of virtual time 0 (default: now, UTC).

    Raises:
        ValueError: unknown policy or an invalid ``additional_config`` for it.
    """

    def __init__(
        self, workload: Workload, config: SimConfig, step_timer: StepTimer | Sequence[StepTimer],
        sink: EventSink | None = None, wall_origin: datetime | None = None,
    ) -> None:
        self.config = config
        self.workload = workload
        timers = list(step_timer) if isinstance(step_timer, (list, tuple)) else [step_timer]
        if len(timers) not in (1, config.num_replicas):
            raise ValueError(f"{len(timers)} step timers for {config.num_replicas} replicas; give "
                             "one, or one per replica")
        self.timer = timers[0]
        self.sink = sink
        self._kinds: frozenset[str] | None = getattr(sink, "kinds", None)
        self._is_wanted: dict[type[Any], bool] = {}
        self.wall_origin = wall_origin if wall_origin is not None else datetime.now(UTC)
        self.now_s = 0.0
        self._fast_paths = fast_paths_enabled()
        self._replicas: list[_Replica] = []
        for i in range(config.num_replicas):
            self._replicas.append(self._make_replica(i, timers[i % len(timers)]))
        self.engine = self._replicas[0].engine
        """Replica 0's engine (the only one unless ``config.num_replicas`` > 1)."""
        self.plane = ControlPlane(gateway_config(config), clock=lambda: self.now_s)
        self.plane.router.moves_kv = config.kv_transfer_gb_s is not None
        self.admission = self.plane.admission
        """The plane's admitted and waiting sets (read by the event loop)."""
        self.pool = _ToolPool(config.num_tool_workers)
        self._heap: list[tuple[float, int, str, Any]] = []
        self._seq = 0
        self._runs: dict[str, _SessionRun] = {}
        self._by_request: dict[str, tuple[_SessionRun, TurnRecord]] = {}
        self._num_open = 0
        self._next_tick_s = 0.0
        self._quiet_ticks = 0
        self.loss: ReplicaLossReport | None = None
        self.num_events = 0
        self.num_preemptions = 0
        self.max_admitted = 0
        self.num_over_window = 0
        self.num_kv_transfer_tokens = 0

    def _make_replica(self, index: int, timer: StepTimer) -> _Replica:
        """Replica ``index``'s engine; with the pooled-KV bound (``config.pools_kv``) every engine
        is built with the pool's size and shares replica 0's block pool
        (:mod:`mars_openhands.engine.harness.kv_pool`)."""
        config = self.config
        params = config.engine_of(index)
        pool_owner = None
        if config.pools_kv:
            params = pooled_params([config.engine_of(i) for i in range(config.num_replicas)])[index]
            pool_owner = self._replicas[0].engine if index > 0 else None
        engine = InprocEngine(config.policy, params, seed=config.seed, clock=lambda: self.now_s,
                              memoize_prefix_hits=self._fast_paths, kv_pool_of=pool_owner)
        source = config.source_of(index)
        if engine.is_plugin:
            # Our schedulers' own engine_step snapshots run on the wall clock and the sink
            # drops them; the fast paths skip their KV walk.
            engine.set_telemetry_sink(
                _VirtualStampSink(self, source if config.num_replicas > 1 else None)
                if self.sink is not None else None,
                engine_steps=not self._fast_paths)
        return _Replica(index, engine, timer, source)

    # ------------------------------------------------------------------ events out
    def _stamps(self) -> dict[str, Any]:
        return {"t_mono_ns": int(round(self.now_s * 1e9)),
                "t_wall": self.wall_origin + timedelta(seconds=self.now_s)}

    def _wants(self, cls: type[Any]) -> bool:
        """Whether the sink takes events of class ``cls``."""
        is_wanted = self._is_wanted.get(cls)
        if is_wanted is None:
            is_wanted = self.sink is not None and (
                self._kinds is None or cls.model_fields["kind"].default in self._kinds)
            self._is_wanted[cls] = is_wanted
        return is_wanted

    def _emit_event(self, event: ev.Event) -> None:
        if self.sink is not None and (self._kinds is None or event.kind in self._kinds):
            self.num_events += 1
            self.sink.emit(event)

    def _emit(self, cls: type[Any], source: str, session_id: str | None, turn: int | None,
              **fields: Any) -> None:
        if self._wants(cls):
            # Trusted fields: skip pydantic validation (~10 us per event on the hot path).
            self._emit_event(cls.model_construct(**self._stamps(), source=source,
                                                 session_id=session_id, turn=turn, **fields))

    def _cpu_event(self, cls: type[Any], run: _SessionRun, turn: int | None, **fields: Any) -> None:
        """Emit a CPU-plane event and forward it to the scheduler of the session's replica (as the
        gateway does)."""
        if self.sink is None and not self.engine.is_plugin:
            return
        event = cls.model_construct(**self._stamps(), source=self.config.agent_source,
                                    session_id=run.spec.session_id, turn=turn, **fields)
        self._emit_event(event)
        rep = run.replica
        if self.engine.is_plugin and event.kind != "session_start" and rep is not None \
                and not rep.is_lost:
            rep.engine.post_event(event)
            rep.is_blocked = False

    # ------------------------------------------------------------------ the loop
    def run(self) -> SimResult:
        """Run to completion. Mutates the engine.

        Raises:
            EngineStalled: an engine holds work it never schedules (a request larger than the KV
                cache, or a bug).
            SimulationOverrun: the virtual clock passes ``max_virtual_s``.
            RuntimeError: open sessions with nothing left to happen (a bug).
        """
        wall_start = time.perf_counter()
        for run in self._make_runs():
            self._push(run.spec.arrival_s, "arrival", run)
        if self.config.lose_replica is not None:
            index, at_s = self.config.lose_replica
            self._push(at_s, "lose_replica", index)
        self._num_open = len(self._runs)
        # As vLLM's engine core does after start-up: the KV block pool and the engine's other
        # long-lived objects leave the cyclic GC's scans (a few % of the run's CPU time).
        gc.freeze()
        try:
            if len(self._replicas) == 1:
                self._run_one(self._replicas[0])
            else:
                self._run_replicas()
        finally:
            gc.unfreeze()
        wall_s = time.perf_counter() - wall_start
        return self._finish(wall_s)

    def _run_one(self, rep: _Replica) -> None:
        """The loop with one engine: each step runs to its end, the events inside it handled as
        they come (requests for the engine deferred to the step's end)."""
        last_progress_s = 0.0
        while self._num_open > 0:
            self._handle_due_events()
            if not rep.engine.has_work():
                self._advance_to_next_event()
                # An engine without work is not stalled: the stall clock starts with its next work
                # (it used to count the idle time before it, so the load-only first step of a turn
                # that arrived after a long idle stretch read as a stall).
                last_progress_s = self.now_s
            elif self._engine_step(rep):
                last_progress_s = self.now_s
            else:
                self._idle_until_next_event(rep, last_progress_s)

    def _run_replicas(self) -> None:
        """The loop with several engines on the one clock: each free engine with work starts a
        step; the earliest of the next event and the next step end comes next (a step end first
        at equal times, as with one engine). A request routed to an engine in a step is added at
        that step's end; a merged run is bounded by the events known when it is planned and, when
        exact, by the other replicas' step ends and wakes (:meth:`_other_replicas_bound_s`: an
        admission another replica's finish triggers reaches this one as after its single step)."""
        while self._num_open > 0:
            self._handle_due_events()
            for rep in self._replicas:
                # An empty step whose host-tier load finished leaves its request schedulable at
                # once (not blocked): try again now, as with one engine, not at whichever step
                # end or event comes next (which a merged run of another replica would move).
                while (rep.step is None and not rep.is_lost and not rep.is_blocked
                       and rep.engine.has_work() and not self._start_step(rep)):
                    pass
            stepping = [r for r in self._replicas if r.step is not None]
            if stepping:
                rep = min(stepping, key=lambda r: (r.step[3], r.index))  # type: ignore[index]
                if rep.step[3] <= self._next_event_s():  # type: ignore[index]
                    self._finish_step(rep)
                    continue
            else:
                for rep in self._replicas:
                    if rep.is_blocked and self.now_s - rep.last_progress_s > self.config.stall_timeout_s:
                        self._raise_stalled(rep)
            self._advance_to_next_event()

    def _make_runs(self) -> list[_SessionRun]:
        runs = []
        for spec in self.workload.sessions:
            run = _SessionRun(spec, SessionRecord(spec.session_id, spec.arrival_s))
            self._runs[spec.session_id] = run
            runs.append(run)
        return runs

    def _push(self, t_s: float, kind: str, payload: Any) -> None:
        self._seq += 1
        heapq.heappush(self._heap, (t_s, self._seq, kind, payload))

    def _next_event_s(self) -> float:
        """Time of the next event (arrival, tool end or admission tick)."""
        t = self._heap[0][0] if self._heap else math.inf
        return min(t, self._next_tick_s)

    def _next_hard_event_s(self) -> float:
        """Next event that can change the engine's input (a coalesced run must stop before it)."""
        t = self._heap[0][0] if self._heap else math.inf
        if self.admission.num_waiting > 0:
            t = min(t, self._next_tick_s)
        return t

    def _handle_due_events(self) -> None:
        """Handle every event at or before ``now_s``, in time order."""
        while self._next_event_s() <= self.now_s:
            self._handle_next_event()

    def _handle_next_event(self) -> None:
        for rep in self._replicas:
            rep.is_blocked = False  # time passed: a blocked engine may schedule again
        if self._next_tick_s <= (self._heap[0][0] if self._heap else math.inf):
            self.now_s = max(self.now_s, self._next_tick_s)
            self._tick()
            self._next_tick_s += self.config.admission.update_interval_s
            return
        t_s, _, kind, payload = heapq.heappop(self._heap)
        self.now_s = max(self.now_s, t_s)
        if kind == "arrival":
            self._on_arrival(payload)
        elif kind == "tool_end":
            self._on_tool_end(*payload)
        elif kind == "kv_moved":
            if payload.is_in_transfer:  # (not if its new replica was lost meanwhile: re-sent)
                payload.is_in_transfer = False
                self._send(payload, is_counted=True)
        else:
            self._lose_replica(self._replicas[payload])

    def _advance_to_next_event(self) -> None:
        """Jump the clock to the next event (the engine is idle or blocked)."""
        if (not self._heap and self.admission.num_waiting == 0 and self.pool.num_busy == 0
                and not self._has_work()):
            raise RuntimeError(f"simulator has {self._num_open} open session(s) but no pending "
                               "event, tool or admission; this is a bug")
        self._skip_quiet_ticks()
        self._check_limit(self._next_event_s())
        self._handle_next_event()

    def _skip_quiet_ticks(self) -> None:
        """Idle skipping: with no session in the system, ticks past the first ``_QUIET_TICKS``
        (by then the window and the EMA have converged) are skipped up to the next arrival."""
        if (not self._heap or self._quiet_ticks < _QUIET_TICKS or self.admission.admitted
                or self.admission.num_waiting or self.pool.num_busy or self._has_work()):
            return
        interval = self.config.admission.update_interval_s
        gap = self._heap[0][0] - self._next_tick_s
        if gap > interval:
            self._next_tick_s += math.floor(gap / interval) * interval

    def _has_work(self) -> bool:
        return any(r.engine.has_work() for r in self._replicas if not r.is_lost)

    def _idle_until_next_event(self, rep: _Replica, last_progress_s: float) -> None:
        """The engine holds work but scheduled nothing: wait for the next event, or for the host
        KV tier's next copy to finish (a request waiting for its load)."""
        copy_done_s = rep.engine.next_copy_done_s()
        if copy_done_s < self._next_event_s():
            self.now_s = max(self.now_s, copy_done_s)
            return
        if copy_done_s == math.inf and self.now_s - last_progress_s > self.config.stall_timeout_s:
            self._raise_stalled(rep)  # (a copy in flight is progress: the tier is working)
        self._advance_to_next_event()

    def _raise_stalled(self, rep: _Replica) -> None:
        running, waiting = rep.engine.request_counts()
        where = f" (replica {rep.index})" if len(self._replicas) > 1 else ""
        raise EngineStalled(
            f"engine stalled{where} at t={self.now_s:.3f} s: {running} running, {waiting} waiting "
            "and nothing schedulable (a prompt larger than the KV cache? raise "
            "engine.num_gpu_blocks or max_model_len)")

    def _check_limit(self, t_s: float) -> None:
        limit = self.config.max_virtual_s
        if limit is not None and t_s > limit:
            raise SimulationOverrun(f"virtual time {t_s:.1f} s passed max_virtual_s={limit} with "
                               f"{self._num_open} session(s) still open")

    # ------------------------------------------------------------------ engine steps
    def _engine_step(self, rep: _Replica) -> bool:
        """One (possibly merged) engine step, the events inside it handled as they come (one
        engine). Returns False if nothing was scheduled and nothing else moved (a host-tier
        load that finished is progress: its request can be scheduled at once)."""
        if not self._start_step(rep):
            return not rep.is_blocked
        t_end = rep.step[3]  # type: ignore[index]
        rep.in_step = True
        while self._next_event_s() < t_end:
            self._handle_next_event()
        self._finish_step(rep)
        return True

    def _start_step(self, rep: _Replica) -> bool:
        """Plan and schedule ``rep``'s next (possibly merged) step; its end time goes in
        ``rep.step``. Returns False (and marks it blocked) if nothing was scheduled."""
        t_start = self.now_s
        plan = self._plan_run(rep)
        record = rep.engine.schedule(plan)
        if record.is_empty:
            rep.engine.update(record)
            # A host-tier load that finished makes its request schedulable now (not blocked).
            rep.is_blocked = not record.loaded_ids
            return False
        t_end = plan.end_s
        if plan.kind in (RunKind.STEADY, RunKind.BLOCKED) and (record.prefill or any(
                n != plan.num_steps for n in record.num_scheduled_tokens.values())):
            assert plan.kind is RunKind.STEADY, "a blocked decode run is fully determined"
            t_end = None  # the scheduler changed the plan
        if t_end is None:
            t_end = t_start + rep.engine.step_s(self._step_time_s(rep, record))
        self._on_scheduled(rep, record, t_start)
        self._check_limit(t_end)
        rep.step = (plan, record, t_start, t_end)
        rep.in_step = True
        return True

    def _finish_step(self, rep: _Replica) -> None:
        """``rep``'s step ends now: its model output is applied, finished turns move on, and the
        requests that arrived during it are added."""
        assert rep.step is not None
        _, record, t_start, t_end = rep.step
        rep.step = None
        rep.in_step = False
        if rep.run_kv is not None:
            assert rep.run_kv.used_after(record.num_decode_tokens) == rep.engine.kv_block_counts()[2], \
                "a merged run's KV differs from its single steps'"
            rep.run_kv = None
        self.now_s = t_end
        rep.engine.update(record)
        self._on_outputs(rep, record)
        for run, arrival_s in rep.deferred:
            self._add_request(run, arrival_s)
        rep.deferred.clear()
        rep.last_step_s = (t_end - t_start) / max(1, record.num_decode_tokens)
        rep.last_progress_s = t_end
        if self.config.pools_kv:  # the blocks it freed are every replica's: retry the blocked ones
            for other in self._replicas:
                other.is_blocked = False
        self._maybe_snapshot(rep)

    def _plan_run(self, rep: _Replica) -> RunPlan:
        """What the next ``schedule()`` stands for (:meth:`InprocEngine.plan_run`: a merged run
        never crosses the next event that can change the engine's input, :meth:`_next_hard_event_s`);
        an exact run that spans an admission tick keeps the KV its single steps leave
        (``rep.run_kv``), which the tick reads."""
        # A pooled KV changes under another replica's step: only steady decode runs (nothing waits;
        # their KV is allocated at the schedule) stay merged, never a run that proves a wait.
        bound_s = self._next_hard_event_s()
        merge_blocked = self._fast_paths and not self.config.pools_kv
        others_s = self._other_replicas_bound_s(rep) if len(self._replicas) > 1 else math.inf
        if rep.engine.host_kv is not None:  # with the tier every merged run is exact: bound it
            bound_s = min(bound_s, others_s)
        plan = rep.engine.plan_run(self.config.coalesce_max_steps, self.now_s, bound_s, rep.timer,
                                   merge_blocked=merge_blocked)
        if plan.is_exact and plan.step_ends_s[-1] > others_s:
            plan = rep.engine.plan_run(self.config.coalesce_max_steps, self.now_s,
                                       min(bound_s, others_s), rep.timer, merge_blocked=merge_blocked)
        if (plan.is_exact and self.config.is_admission_enabled
                and plan.step_ends_s[-1] > self._next_tick_s):
            rep.run_kv = rep.engine.run_kv(plan)
        return plan

    def _other_replicas_bound_s(self, rep: _Replica) -> float:
        """Several replicas: the time an exact merged run of ``rep`` must end by so that the other
        replicas see it as its single steps (virtual seconds). Pure.

        Another replica's step end can change ``rep``'s input before the next known event (a turn
        it finishes frees a slot of the admission window, and the admitted session's request may
        be routed to ``rep``; a tool it starts may end inside the run, its next turn routed to
        ``rep``), so no exact run crosses one; a replica about to start a step (its end not known
        yet) allows none. And an idle replica starts a step at the first loop pass after its clock
        wakes it (:meth:`InprocEngine.next_wake_s`), which one step at a time is the first single
        step's end after it: no exact run crosses that wake either. (Steady runs timed at the mean
        context are the model, merged the same way with the fast paths off: not bounded here.)"""
        t_s = math.inf
        for other in self._replicas:
            if other is rep or other.is_lost:
                continue
            if other.step is not None:
                t_s = min(t_s, other.step[3])
            elif not other.is_blocked and other.engine.has_work():
                t_s = self.now_s
            else:  # idle, or blocked until the next event (then maybe idle, to wake by its clock)
                t_s = min(t_s, other.engine.next_wake_s())
        return t_s

    def _kv_used_blocks(self, rep: _Replica) -> int:
        """Used KV blocks as the engine would report them now: inside a merged run (``rep.run_kv``)
        those after the single steps scheduled by now (a tick at a step's end comes before the
        next step's ``schedule()``, one inside a step after its own). Pure."""
        if rep.run_kv is None or not rep.in_step:
            return rep.engine.kv_block_counts()[2]
        times = rep.run_kv.step_ends_s
        done = bisect.bisect_right(times, self.now_s)
        return rep.run_kv.used_after(done if done and times[done - 1] == self.now_s else done + 1)

    def _step_time_s(self, rep: _Replica, record: EngineStepRecord) -> float:
        """Modelled seconds of the step; a coalesced step of ``k`` tokens counts ``k`` steps."""
        k = record.num_decode_tokens
        contexts = record.decode_context_tokens
        timer = rep.timer
        if k > 1 and not record.prefill:
            return decode_run_step_time_s(timer.step_time_s, contexts, k)
        first = timer.step_time_s(record.prefill, contexts)
        if k == 1:
            return first
        # A plugin admitted a prefill into a planned decode run (not expected with an empty
        # waiting queue): the first step carries the prefill, the other k - 1 are pure decode.
        return first + decode_run_step_time_s(timer.step_time_s, [c + 1 for c in contexts],
                                              k - 1)

    def _on_scheduled(self, rep: _Replica, record: EngineStepRecord, t_start: float) -> None:
        """First schedules and preemptions (stamped at the step start)."""
        stock = not rep.engine.is_plugin
        source = rep.source
        for rid in sorted(record.preempted_ids):  # a set's order follows the per-process hash
            run, turn = self._by_request[rid]
            turn.num_preemptions += 1
            self.num_preemptions += 1
            if stock:
                self._emit(ev.RequestPreempted, source, run.spec.session_id,
                           turn.turn, request_id=rid, num_blocks_freed=0)
        for rid, num_cached in record.new_request_cached_tokens.items():
            run, turn = self._by_request[rid]
            if turn.first_scheduled_s is not None:
                continue
            turn.first_scheduled_s = t_start
            turn.num_cached_tokens = num_cached
            if stock:
                self._emit(ev.RequestFirstScheduled, source,
                           run.spec.session_id, turn.turn, request_id=rid,
                           prefill_start_delay_s=t_start - turn.submit_s,
                           num_cached_tokens=num_cached)

    def _on_outputs(self, rep: _Replica, record: EngineStepRecord) -> None:
        stock = not rep.engine.is_plugin
        source = rep.source
        router_replica = self.plane.router.replicas[rep.index]
        for rid, num_new, reason in record.outputs:
            run, turn = self._by_request[rid]
            if turn.first_token_s is None and num_new > 0:
                turn.first_token_s = self.now_s
                if stock:
                    self._emit(ev.RequestFirstToken, source,
                               run.spec.session_id, turn.turn, request_id=rid,
                               ttft_s=self.now_s - turn.submit_s)
            if reason is not None:
                del self._by_request[rid]
                router_replica.num_in_flight -= 1
                turn.finish_s = self.now_s
                if stock:
                    self._emit(ev.RequestFinished, source, run.spec.session_id,
                               turn.turn, request_id=rid,
                               num_prompt_tokens=turn.num_prompt_tokens,
                               num_output_tokens=turn.num_output_tokens,
                               num_blocks_freed=-(-(turn.num_prompt_tokens + turn.num_output_tokens)
                                                  // self.config.engine.block_size),
                               finish_reason=reason.lower(), e2e_s=self.now_s - turn.submit_s)
                self._on_turn_finished(run, turn)

    def _maybe_snapshot(self, rep: _Replica) -> None:
        last = rep.last_snapshot_s
        if not self._wants(ev.EngineStep) or (
                last is not None and self.now_s - last < self.config.engine_step_interval_s):
            return
        rep.last_snapshot_s = self.now_s
        engine = rep.engine
        free, retained, used = engine.kv_block_counts()
        running, waiting = engine.request_counts()
        self._emit(ev.EngineStep, rep.source, None, None,
                   num_gpu_blocks=engine.num_gpu_blocks(), num_used_blocks=used,
                   num_free_blocks=free, num_retained_blocks=retained, num_running=running,
                   num_waiting=waiting, step_time_s=rep.last_step_s,
                   num_host_blocks=rep.engine.num_host_blocks())

    # ------------------------------------------------------------------ sessions
    def _on_arrival(self, run: _SessionRun) -> None:
        """``session_start`` and the first request: admitted now, or it waits (in flight)."""
        run.gateway = self.plane.open_session(run.spec.session_id)
        self._cpu_event(ev.SessionStart, run, None)
        self.plane.begin_request(run.gateway)
        if self.plane.request_slot(run.gateway, run.spec.turns[0].prompt_tokens_appended):
            self._on_admitted(run)

    def _start_admitted(self, session_ids: list[str]) -> None:
        """Start the sessions the control plane just admitted (in its order)."""
        for session_id in session_ids:
            self._on_admitted(self._runs[session_id])

    def _on_admitted(self, run: _SessionRun) -> None:
        assert run.gateway is not None, "a session is admitted after its arrival"
        num_admitted = len(self.admission.admitted)
        self.max_admitted = max(self.max_admitted, num_admitted)
        if self.config.is_admission_enabled and num_admitted > self.admission.window:
            self.num_over_window += 1
        run.record.admitted_s = self.now_s
        run.stream = self.engine.stream(run.spec.session_id)  # the same ids on every replica
        self._submit_turn(run)

    def _submit_turn(self, run: _SessionRun) -> None:
        """Turn ``run.turn`` is sent now (added to the engine now, or after the running step)."""
        spec = run.spec.turns[run.turn]
        stream = run.stream
        assert stream is not None, "session must be admitted before its turns"
        stream.append(spec.prompt_tokens_appended)
        num_prompt = len(stream)
        stream.append(spec.output_tokens)
        rid = f"{run.spec.session_id}#{run.turn}"
        turn = TurnRecord(run.turn, rid, num_prompt, spec.output_tokens, self.now_s,
                          tool_name=spec.tool_name, tool_duration_s=spec.tool_duration_s)
        run.record.turns.append(turn)
        self._by_request[rid] = (run, turn)
        assert run.gateway is not None
        transfer_s = self._route(run, num_prompt)
        _, run.prev_tool = self.plane.start_turn(run.gateway)
        if transfer_s > 0.0:
            # In flight at its new replica from now: a gateway sends the request at once and the
            # replica waits for the KV (vLLM's WAITING_FOR_REMOTE_KVS), so routers count it.
            assert run.replica is not None
            run.is_in_transfer = True
            self.plane.router.replicas[run.replica.index].num_in_flight += 1
            self._push(self.now_s + transfer_s, "kv_moved", run)
        else:
            self._send(run)

    def _route(self, run: _SessionRun, num_prompt_tokens: int) -> float:
        """The gateway's routing decision for the session's request (``Router.route``: the
        policy's :func:`~mars_openhands.policy.placement.choose_replica`). A session that moves
        off a live replica has it told ``session_end`` (the KV it kept for the session is
        released, as a gateway that moves a session would); with ``kv_transfer_gb_s`` its prefix
        cached there goes along (:meth:`_start_transfer`).

        Returns:
            Seconds until the turn reaches its replica (the KV transfer; 0: send it now).
        """
        assert run.gateway is not None
        index = self.plane.router.route(run.gateway, num_prompt_tokens).index
        old = run.replica
        transfer_s = 0.0
        if old is not None and old.index != index and not old.is_lost:
            if self.config.kv_transfer_gb_s is not None:
                transfer_s = self._start_transfer(run, old, self._replicas[index])
            if old.engine.is_plugin:
                old.engine.post_event(ev.SessionEnd.model_construct(
                    **self._stamps(), source=self.config.gateway_source,
                    session_id=run.spec.session_id, turn=None, status="moved"))
                old.is_blocked = False
        run.replica = self._replicas[index]
        return transfer_s

    def _start_transfer(self, run: _SessionRun, old: _Replica, new: _Replica) -> float:
        """The session's prefix cached on ``old`` (before it drops the session's pins) starts for
        ``new``: ``run.kv_import``, written there when the turn arrives. Only the blocks ``new``
        does not hold yet are sent. Returns the transfer's seconds: ``tokens sent x
        kv_bytes_per_token / kv_transfer_gb_s`` (0: nothing to send)."""
        assert run.stream is not None and self.config.kv_transfer_gb_s is not None
        hashes = run.stream.block_hashes
        num_blocks = old.engine.cached_prefix_blocks(hashes)
        num_sent = num_blocks - min(num_blocks, new.engine.cached_prefix_blocks(hashes[:num_blocks]))
        if num_sent == 0:
            return 0.0
        run.kv_import = list(hashes[:num_blocks])
        num_tokens = num_sent * self.config.engine.block_size
        self.num_kv_transfer_tokens += num_tokens
        run.record.turns[-1].num_transferred_tokens = num_tokens
        assert self.config.kv_bytes_per_token is not None
        return num_tokens * self.config.kv_bytes_per_token / (self.config.kv_transfer_gb_s * 1e9)

    def _send(self, run: _SessionRun, *, is_counted: bool = False) -> None:
        """The session's latest turn goes to its replica: now, or after the replica's step; in
        flight there from now (``is_counted``: since its KV transfer started)."""
        rep = run.replica
        assert rep is not None
        if not is_counted:
            self.plane.router.replicas[rep.index].num_in_flight += 1
        run.record.turns[-1].replica = rep.index
        if rep.in_step:
            rep.deferred.append((run, self.now_s))
        else:
            self._add_request(run, self.now_s)

    def _add_request(self, run: _SessionRun, arrival_s: float) -> None:
        turn = run.record.turns[-1]
        assert run.gateway is not None
        last_step = int(turn.turn == run.spec.num_turns - 1) if self.config.send_last_step else None
        extra = gateway_xargs(turn.turn, last_step, run.prev_tool,
                              self.plane.session_age_s(run.gateway, turn.turn))
        assert run.stream is not None and run.replica is not None
        rep = run.replica
        if run.kv_import is not None:
            rep.engine.import_prefix(run.kv_import)
            run.kv_import = None
        rep.engine.add_request(turn.request_id, run.stream, turn.num_prompt_tokens,
                               turn.num_output_tokens, arrival_time_s=arrival_s,
                               session_id=run.spec.session_id, extra_args=extra)
        rep.is_blocked = False
        if not rep.engine.is_plugin:
            self._emit(ev.RequestQueued, rep.source, run.spec.session_id, turn.turn,
                       request_id=turn.request_id, num_prompt_tokens=turn.num_prompt_tokens,
                       num_projected_blocks=-(-turn.num_prompt_tokens
                                              // self.config.engine.block_size))

    def _on_turn_finished(self, run: _SessionRun, turn: TurnRecord) -> None:
        assert run.gateway is not None
        self._start_admitted(self.plane.end_request(run.gateway))
        if turn.turn == run.spec.num_turns - 1:
            self._end_session(run)
            return
        self._enqueue_tool(run, turn)

    def _end_session(self, run: _SessionRun) -> None:
        run.record.end_s = self.now_s
        self._num_open -= 1
        self._cpu_event(ev.SessionEnd, run, None, status="ok")
        assert run.gateway is not None
        self._start_admitted(self.plane.end_session(run.gateway))

    # ------------------------------------------------------------------ tools
    def _enqueue_tool(self, run: _SessionRun, turn: TurnRecord) -> None:
        assert turn.tool_name is not None, "a non-final turn has a tool"
        call_id = turn.request_id
        turn.tool_enqueue_s = self.now_s
        assert run.gateway is not None
        self.plane.tool_enqueued(run.gateway, call_id, turn.tool_name)
        self._cpu_event(ev.ToolEnqueued, run, turn.turn, tool_name=turn.tool_name,
                        tool_call_id=call_id)
        self.pool.queue.append((run, turn.turn, self.now_s))
        self._start_tools()

    def _start_tools(self) -> None:
        pool = self.pool
        while pool.queue and pool.num_busy < pool.num_workers:
            run, k, enqueue_s = pool.queue.popleft()
            turn = run.record.turns[k]
            pool.num_busy += 1
            turn.tool_start_s = self.now_s
            wait_s = self.now_s - enqueue_s
            assert run.gateway is not None
            self.plane.tool_started(run.gateway, turn.request_id, turn.tool_name or "", wait_s)
            self._cpu_event(ev.ToolStart, run, k, tool_name=turn.tool_name,
                            tool_call_id=turn.request_id, queue_wait_s=wait_s)
            self._push(self.now_s + turn.tool_duration_s, "tool_end", (run, k))

    def _on_tool_end(self, run: _SessionRun, k: int) -> None:
        turn = run.record.turns[k]
        turn.tool_end_s = self.now_s
        self.pool.num_busy -= 1
        assert run.gateway is not None
        self.plane.tool_ended(run.gateway, turn.request_id, turn.tool_name or "", turn.tool_duration_s)
        self._cpu_event(ev.ToolEnd, run, k, tool_name=turn.tool_name,
                        tool_call_id=turn.request_id, duration_s=turn.tool_duration_s)
        self._start_tools()
        run.turn = k + 1
        self.plane.begin_request(run.gateway)  # the next turn's request, sent at the tool's end
        self._submit_turn(run)

    # ------------------------------------------------------------------ admission ticks
    def _tick(self) -> None:
        """The engine reports its KV (an ``engine_step``), then the gateway's tick
        (:meth:`ControlPlane.tick`): decay, idle releases, AIMD update, admissions; then its
        ``admission_update`` (one per tick, unlike the live gateway's recorder)."""
        is_quiet = not (self.admission.admitted or self.admission.num_waiting or self.pool.num_busy)
        self._quiet_ticks = self._quiet_ticks + 1 if is_quiet else 0
        router = self.plane.router
        for rep in self._replicas:
            if rep.is_lost:
                continue
            router.observe_engine_step(rep.source, self._kv_used_blocks(rep),
                                       rep.engine.num_gpu_blocks(), rep.engine.num_host_blocks())
            if len(self._replicas) > 1:  # as the gateway's /metrics poll (llm-d's queue scorer)
                router.replicas[rep.index].num_waiting = rep.engine.request_counts()[1]
        tick = self.plane.tick()
        if self._wants(ev.AdmissionUpdate):
            self._emit(ev.AdmissionUpdate, self.config.gateway_source, None, None,
                       **tick.report._asdict())
        self._start_admitted(tick.admitted)

    # ------------------------------------------------------------------ end
    def _finish(self, wall_s: float) -> SimResult:
        live = [r for r in self._replicas if not r.is_lost]
        for rep in live:
            rep.engine.shutdown()
        makespan = max((r.record.end_s or 0.0) for r in self._runs.values()) if self._runs else 0.0
        counts = [r.engine.kv_block_counts() for r in live]
        if self.config.pools_kv:
            counts = counts[:1]  # one pool: every replica counts the same blocks
        return SimResult(
            sessions={sid: r.record for sid, r in self._runs.items()}, makespan_s=makespan,
            wall_s=wall_s, num_schedule_calls=sum(r.engine.num_steps for r in self._replicas),
            num_engine_steps=sum(r.engine.num_decode_substeps for r in self._replicas),
            num_preemptions=self.num_preemptions, max_admitted_sessions=self.max_admitted,
            num_admissions_over_window=self.num_over_window,
            kv_blocks_at_end=counts[0] if len(counts) == 1 else tuple(  # type: ignore[arg-type]
                sum(c[i] for c in counts) for i in range(3)),
            num_events=self.num_events, num_replicas=len(self._replicas),
            num_rehomes=self.plane.router.num_rehomes, replica_loss=self.loss,
            num_kv_transfer_tokens=self.num_kv_transfer_tokens,
        )

    # ------------------------------------------------------------------ replica loss
    def _lose_replica(self, rep: _Replica) -> None:
        """Replica ``rep`` is gone (``SimConfig.lose_replica``): its step never ends, its engine's
        requests are aborted (and its blocks checked for leaks), the control plane marks it down
        (its sessions detached, as the gateway does), and the turns it was serving are re-sent:
        routed again, prefilled again from their whole context elsewhere."""
        if rep.is_lost:
            return
        rep.is_lost = True
        rep.step, rep.in_step, rep.run_kv = None, False, None
        rep.deferred.clear()
        aborted = rep.engine.abort_all()
        rep.engine.shutdown()
        rep.engine.assert_no_leaks()
        bound = [r for r in self._runs.values() if r.replica is rep and r.record.end_s is None]
        failed = [(run, turn) for run, turn in self._by_request.values() if run.replica is rep]
        self.plane.replica_failed(rep.index, "lost (--lose-replica)", immediate=True)
        self.plane.router.replicas[rep.index].num_in_flight = 0
        self.loss = ReplicaLossReport(
            rep.index, self.now_s, len(bound), len(failed),
            sum(len(run.stream) for run in bound if run.stream is not None), len(aborted))
        for run in bound:
            run.replica = None
        for run, turn in failed:
            run.is_in_transfer, run.kv_import = False, None
            turn.num_transferred_tokens = 0
            turn.first_scheduled_s = turn.first_token_s = turn.num_cached_tokens = None
            turn.num_failures += 1
            self._route(run, turn.num_prompt_tokens)
            self._send(run)


def simulate(
    workload: Workload, config: SimConfig, step_timer: StepTimer, sink: EventSink | None = None,
    wall_origin: datetime | None = None,
) -> SimResult:
    """Build a :class:`Simulator` and run it (see there)."""
    return Simulator(workload, config, step_timer, sink, wall_origin).run()


def ideal_times_s(workload: Workload, config: SimConfig, step_timer: StepTimer) -> dict[str, float]:
    """Each session's E2E when run alone on an idle system: the slowdown denominator (design.md §7).

    Same engine, step-time model and tool times as ``config``; the session arrives at 0 s, admission
    is off and it has the tool pool to itself. One fresh engine per session.

    Returns:
        session id -> ideal E2E seconds (pass to :func:`eval.metrics.compute_metrics`).
    """
    alone = config.model_copy(update={"is_admission_enabled": False})
    ideal: dict[str, float] = {}
    for session in workload.sessions:
        solo = Workload(meta=workload.meta, sessions=(session.model_copy(update={"arrival_s": 0.0}),))
        e2e = simulate(solo, alone, step_timer).sessions[session.session_id].e2e_s
        assert e2e is not None, f"session {session.session_id!r} did not finish alone"
        ideal[session.session_id] = e2e
    return ideal
