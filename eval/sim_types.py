"""The simulator's inputs and results: its configuration, the linear step-time model of the tests,
and what a run returns per turn, per session and in all (:mod:`eval.sim` runs them)."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field

from pydantic import BaseModel, ConfigDict, Field, model_validator

from mars_openhands.engine.harness.inproc_engine import InprocEngineParams
from mars_openhands.policy.admission import AdmissionParams
from mars_openhands.policy.placement import routing_policy
from mars_openhands.policy.reorder import ReorderParams

__all__ = ["EngineStalled", "LinearStepTimeModel", "ReplicaLossReport", "SessionRecord", "SimConfig", "SimResult",
           "SimulationOverrun", "TurnRecord"]


class SimulationOverrun(RuntimeError):
    """The virtual clock passed ``SimConfig.max_virtual_s`` with sessions still open: the load is
    more than the engine serves in that time (a knee probe counts the rate unstable), not a fault."""


class EngineStalled(RuntimeError):
    """An engine held work yet scheduled nothing, with no copy in flight, for
    ``SimConfig.stall_timeout_s`` of virtual time: a prompt larger than the KV cache, or a bug in a
    scheduler or the simulator. Never a load effect: a knee probe that meets it fails visibly
    instead of counting the rate unstable."""


@dataclass(frozen=True)
class LinearStepTimeModel:
    """A simple affine step-time model (tests, and a stand-in when aiconfigurator is absent).

    ``t = overhead_s + Σ new·prefill_token_s + Σ cached·prefill_cached_token_s
    + D·decode_request_s + Σ context·decode_context_token_s``; 0 for an empty step.
    """

    overhead_s: float = 0.005
    prefill_token_s: float = 2e-5
    prefill_cached_token_s: float = 1e-8
    decode_request_s: float = 2e-4
    decode_context_token_s: float = 5e-9

    def decode_step_time_s(self, num_decode_requests: int, decode_context_tokens: int) -> float:
        """:meth:`step_time_s` of a pure-decode step from its shape (``D``, Σ context). Pure."""
        return self.step_time_s((), [decode_context_tokens] + [0] * (num_decode_requests - 1))

    def step_time_s(
        self, prefill: Sequence[tuple[int, int]] = (), decode_context_tokens: Sequence[int] = ()
    ) -> float:
        """Seconds of one step (see the class docstring). Pure."""
        if not prefill and not decode_context_tokens:
            return 0.0
        new = sum(p[0] for p in prefill)
        cached = sum(p[1] for p in prefill)
        return (self.overhead_s + new * self.prefill_token_s + cached * self.prefill_cached_token_s
                + len(decode_context_tokens) * self.decode_request_s
                + sum(decode_context_tokens) * self.decode_context_token_s)


class SimConfig(BaseModel):
    """Everything one simulated run needs besides the workload and the step-time model.

    Frozen; unknown keys are an error.
    """

    model_config = ConfigDict(frozen=True, extra="forbid", use_attribute_docstrings=True)

    policy: str = "fcfs"
    """Scheduler: ``fcfs`` (stock vLLM AsyncScheduler), ``fcfs-sync`` (stock Scheduler), a class
    exported by ``mars_openhands.engine`` (e.g. ``MarsScheduler``) or ``module:Class``."""
    engine: InprocEngineParams
    """Engine shape (KV blocks, token budget, ``additional_config`` for our schedulers)."""
    num_tool_workers: int = Field(16, ge=1)
    """N_tool: tool calls that run at once; the rest wait in a FIFO queue."""
    is_admission_enabled: bool = False
    """Run the gateway's AIMD session window (design.md §5: report baselines with and without)."""
    admission: AdmissionParams = AdmissionParams()
    """The gateway's window parameters (same model as ``GatewayConfig.admission``)."""
    reorder: ReorderParams = ReorderParams()
    """The gateway's waiting-session order (same model as ``GatewayConfig.reorder``)."""
    tool_wait_idle_decay: bool = True
    """As ``GatewayConfig.tool_wait_idle_decay``."""
    send_last_step: bool = True
    """Send ``mars_last_step`` (1 on a session's final turn, else 0) with each request, as a replay
    driver that knows the trace does; off: the engine must guess."""
    coalesce_max_steps: int = Field(1024, ge=1)
    """Most pure-decode steps merged into one scheduler call (1 = every step is simulated). Runs
    end anyway at the next arrival, tool end or finishing request; 1024 instead of 64 saved ~16%
    CPU on the bundled traces (the run's time uses the mean context, exact for a linear model)."""
    engine_step_interval_s: float = Field(0.1, gt=0.0)
    """Virtual seconds between ``engine_step`` snapshots (telemetry's default 100 ms)."""
    seed: int = 0
    """Seeds the synthetic token ids."""
    engine_source: str = "engine:0"
    """``source`` of GPU-plane events."""
    agent_source: str = "sim"
    """``source`` of CPU-plane events (the agents / replay driver)."""
    gateway_source: str = "gateway"
    """``source`` of ``admission_update`` events."""
    stall_timeout_s: float = Field(600.0, gt=0.0)
    """Virtual seconds the engine may hold work yet schedule nothing before the run fails."""
    max_virtual_s: float | None = Field(None, gt=0.0)
    """Stop (raise) once the virtual clock passes this many seconds; ``None``: no limit."""
    num_replicas: int = Field(1, ge=1)
    """Engines behind the one control plane, on the one virtual clock (``compare --replicas``)."""
    replica_engines: tuple[InprocEngineParams, ...] = ()
    """Each replica's engine shape (a mix of GPU profiles); empty: ``engine`` for every one."""
    router: str = "least-sessions"
    """The control plane's routing policy (:data:`mars_openhands.policy.placement.ROUTING_POLICIES`;
    ``compare --router``)."""
    lose_replica: tuple[int, float] | None = None
    """``(index, seconds)``: that replica is lost at that virtual time (``--lose-replica``): its
    requests fail and are re-sent, its sessions are re-placed, its KV is gone."""
    kv_transfer_gb_s: float | None = Field(None, gt=0.0)
    """A session moved off a live replica takes its KV along at this bandwidth, GB/s (10^9 B/s)
    one way (``compare --kv-transfer-gbps``; e.g. NIXL over one 400 Gb/s RDMA NIC per GPU, ~50):
    its prefix cached on the old replica is written into the new one's prefix cache and its turn
    waits ``bytes / bandwidth`` for the blocks the new one lacks before it is sent, instead of
    re-prefilling that prefix. ``None``:
    a moved session re-prefills (what the live gateway does). The copy's slowdown of either
    replica's steps is not modelled."""
    kv_bytes_per_token: int | None = Field(None, gt=0)
    """KV bytes of one token (the deployment's; ``kv_transfer_gb_s`` needs it)."""

    @model_validator(mode="after")
    def _check_replicas(self) -> SimConfig:
        n = self.num_replicas
        if self.replica_engines and len(self.replica_engines) != n:
            raise ValueError(f"replica_engines has {len(self.replica_engines)} shapes for "
                             f"num_replicas={n}; give one per replica (--replica-gpus)")
        routing_policy(self.router)  # raises, listing the known names
        if self.pools_kv and self.lose_replica is not None:
            raise ValueError(f"router={self.router!r} (one KV pool for every replica) with "
                             "lose_replica: a lost replica's KV would be every replica's; drop "
                             "--lose-replica or use another --router")
        if n > 1 and any(self.engine_of(i).host_kv is not None for i in range(n)):
            raise ValueError(f"num_replicas={n} with a host KV tier: the tier's copies are modelled "
                             "on one engine only so far (idle waits for a copy); use one replica")
        if self.kv_transfer_gb_s is not None and (n < 2 or self.pools_kv or self.kv_bytes_per_token is None):
            raise ValueError(f"kv_transfer_gb_s={self.kv_transfer_gb_s:g} needs num_replicas >= 2 "
                             f"(got {n}), a router other than the pooled-KV bound (its replicas share "
                             "one KV pool) and kv_bytes_per_token")
        if self.lose_replica is not None:
            index, at_s = self.lose_replica
            if n < 2 or not 0 <= index < n or at_s < 0:
                raise ValueError(f"lose_replica={index}@{at_s} needs 0 <= index < num_replicas={n} "
                                 "(at least 2, so another can take its sessions) and a time >= 0 "
                                 "(--lose-replica INDEX@SECONDS)")
        return self

    @property
    def pools_kv(self) -> bool:
        """The pooled-KV bound: several replicas whose engines share one KV block pool
        (``router`` is ``pooled-kv``; one replica is the single engine). Pure."""
        return self.num_replicas > 1 and routing_policy(self.router).pools_kv

    def engine_of(self, index: int) -> InprocEngineParams:
        """Replica ``index``'s engine shape. Pure."""
        return self.replica_engines[index] if self.replica_engines else self.engine

    def source_of(self, index: int) -> str:
        """``source`` of replica ``index``'s GPU-plane events (``engine_source`` with one
        replica, ``engine:<index>`` with several). Pure."""
        return self.engine_source if self.num_replicas == 1 else f"engine:{index}"


@dataclass
class TurnRecord:
    """One turn (LLM call + the tool after it); times in virtual seconds since the run start."""

    turn: int
    request_id: str
    num_prompt_tokens: int
    num_output_tokens: int
    submit_s: float
    first_scheduled_s: float | None = None
    first_token_s: float | None = None
    finish_s: float | None = None
    num_cached_tokens: int | None = None
    """Prompt tokens served by the prefix cache (or retained KV) at the first schedule."""
    num_preemptions: int = 0
    tool_name: str | None = None
    tool_duration_s: float = 0.0
    tool_enqueue_s: float | None = None
    tool_start_s: float | None = None
    tool_end_s: float | None = None
    replica: int = 0
    """The replica that served it (the last one it was sent to)."""
    num_failures: int = 0
    """Times it was lost with its replica and sent again."""
    num_transferred_tokens: int = 0
    """Tokens of KV sent along (and charged) when its session moved to its replica with a KV
    transfer (``kv_transfer_gb_s``): its prefix cached on the old replica that the new one lacked
    (0 when it was re-sent after a lost replica)."""

    @property
    def ttft_s(self) -> float | None:
        """Seconds from submission to the first token."""
        return None if self.first_token_s is None else self.first_token_s - self.submit_s

    @property
    def tool_queue_wait_s(self) -> float | None:
        """Seconds the tool call waited for a worker."""
        if self.tool_start_s is None or self.tool_enqueue_s is None:
            return None
        return self.tool_start_s - self.tool_enqueue_s


@dataclass
class SessionRecord:
    """One session; times in virtual seconds since the run start."""

    session_id: str
    arrival_s: float
    admitted_s: float | None = None
    end_s: float | None = None
    turns: list[TurnRecord] = field(default_factory=list)

    @property
    def e2e_s(self) -> float | None:
        """Last token of the final turn − arrival (includes admission wait; design.md §7)."""
        return None if self.end_s is None else self.end_s - self.arrival_s


@dataclass
class SimResult:
    """Outcome of one simulated run.

    Attributes:
        sessions: session id -> record, in workload order.
        makespan_s: virtual seconds from the run start to the last session end.
        wall_s: wall-clock seconds the run took (excluding engine construction).
        num_schedule_calls: real ``schedule()`` calls.
        num_engine_steps: engine steps represented (a coalesced call of ``k`` tokens counts ``k``).
        num_preemptions: requests preempted by vLLM.
        max_admitted_sessions: most sessions holding an admission slot at once.
        num_admissions_over_window: admissions that left more admitted sessions than the window
            (must be 0).
        kv_blocks_at_end: ``(free, retained, used)`` after the engine's shutdown (summed over the
            replicas still up).
        num_events: events emitted to the sink (of its ``kinds``).
        num_replicas: engines behind the control plane.
        num_rehomes: sessions the routing policy moved off a live replica.
        num_kv_transfer_tokens: tokens of KV the moves sent along (``kv_transfer_gb_s``).
        replica_loss: what losing a replica cost, if one was lost.
    """

    sessions: dict[str, SessionRecord]
    makespan_s: float
    wall_s: float
    num_schedule_calls: int
    num_engine_steps: int
    num_preemptions: int
    max_admitted_sessions: int
    num_admissions_over_window: int
    kv_blocks_at_end: tuple[int, int, int]
    num_events: int
    num_replicas: int = 1
    num_rehomes: int = 0
    num_kv_transfer_tokens: int = 0
    replica_loss: ReplicaLossReport | None = None

    @property
    def speedup(self) -> float:
        """Simulated seconds per wall second."""
        return self.makespan_s / self.wall_s if self.wall_s > 0 else math.inf

    def e2e_s(self) -> list[float]:
        """E2E latency of every completed session, seconds."""
        return [s.e2e_s for s in self.sessions.values() if s.e2e_s is not None]


@dataclass
class ReplicaLossReport:
    """What losing a replica cost (``SimConfig.lose_replica``).

    Attributes:
        index: the replica lost.
        at_s: virtual seconds of the loss.
        num_sessions_replaced: sessions bound to it, re-placed by the router.
        num_turns_failed: turns in flight on it (re-sent to another replica).
        num_reprefill_tokens: context tokens of those sessions whose KV it held (prefilled again
            elsewhere).
        num_requests_aborted: requests its engine held at the loss (aborted, then checked for
            leaks).
    """

    index: int
    at_s: float
    num_sessions_replaced: int
    num_turns_failed: int
    num_reprefill_tokens: int
    num_requests_aborted: int
