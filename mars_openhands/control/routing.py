"""The replica table: what each vLLM replica reported (KV usage, health), and routing of sessions
across replicas: KV affinity first, then the least loaded (design.md §6).

KV usage u of a replica is the newer of its last ``engine_step`` (younger than
``engine_step_max_age_s``) and its last ``/metrics`` poll; the admission window's KV signal reads
the healthy replicas as one pool (their used blocks over all their blocks; or the fullest one's u,
``AdmissionParams.kv_usage_over_replicas``), and the KV budget of a new session is
``(kv_set_usage - u) * num_gpu_blocks`` on the replica with the most room.

Mental model: a session's KV (prefix cache or retained blocks) lives on the replica that served its
previous turn, so the routing policy (``routing_policy``, :mod:`mars_openhands.policy.placement`)
keeps it there unless it decides otherwise. The default, ``least-sessions``, sends every turn there
while it is healthy; a new session, or one whose replica went down, goes to the healthy replica with
the fewest live sessions, ties broken by KV usage, then in-flight requests, then index. A replica is
marked down after ``replica_failure_threshold`` consecutive failed polls, or at once when a request
cannot connect; it is marked up again by the next successful poll. Marking a replica down detaches
its sessions (they are re-routed on their next request) and fails its in-flight requests (see
:class:`mars_openhands.control.app.Gateway`), so nothing waits on a dead engine.

Single-threaded; the clock is injected (the control plane's).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from mars_openhands.cli_style import redact_url
from mars_openhands.control.config import GatewayConfig
from mars_openhands.control.metrics import EngineMetrics
from mars_openhands.control.sessions import Session
from mars_openhands.policy.placement import (
    NoHealthyReplicaError,
    ReplicaLoad,
    RouteRequest,
    choose_replica,
    routing_policy,
)

__all__ = ["NoReplicaError", "ReplicaState", "Router"]

logger = logging.getLogger(__name__)


class NoReplicaError(RuntimeError):
    """No healthy replica can take the request (HTTP 503)."""


@dataclass
class ReplicaState:
    """What the gateway knows about one replica. Mutable; owned by :class:`Router`."""

    index: int
    name: str
    url: str
    is_healthy: bool = True
    num_consecutive_failures: int = 0
    last_error: str | None = None
    num_sessions: int = 0
    """Live sessions routed here (affinity)."""
    num_in_flight: int = 0
    """Requests being proxied to it now."""
    kv_usage_polled: float | None = None
    """``vllm:kv_cache_usage_perc`` from the last poll (0..1; excludes evictable prefix-cache blocks,
    since vLLM counts them as free)."""
    kv_usage_polled_mono_s: float = 0.0
    """Monotonic seconds when ``kv_usage_polled`` arrived."""
    kv_usage_step: float | None = None
    """Usage from the last ``engine_step`` event (used / total blocks)."""
    kv_usage_step_mono_s: float = 0.0
    num_gpu_blocks: int | None = None
    num_host_blocks: int = 0
    """Its host-memory KV tier in GPU blocks (0: none), from its last ``engine_step``."""
    block_size_tokens: int | None = None
    num_running: int | None = None
    num_waiting: int | None = None
    process_start_s: float | None = None
    """``process_start_time_seconds`` of the replica; a change means it restarted."""
    num_restarts: int = 0
    num_failures_total: int = 0
    num_prefix_tokens: int = 0
    """Prompt tokens the router's prefix index holds for it (Ray's prefix-tree tenant size)."""
    in_flight: set = field(default_factory=set)
    """In-flight requests (``proxy._Call``), failed when the replica goes down."""
    authorization: str | None = field(default=None, repr=False)
    """``Bearer <the replica's own API key>`` sent in place of the agent's ``Authorization``
    (``ReplicaConfig.api_key``); ``None``: the agent's is forwarded."""

    def kv_usage(self, now_mono_s: float, max_step_age_s: float) -> float | None:
        """KV usage 0..1: the newer of the last ``engine_step`` (if younger than ``max_step_age_s``)
        and the last poll; ``None`` if unknown.

        The newer one wins because an engine that goes idle runs no further step: its last
        ``engine_step`` still counts the blocks of the request that just finished, while vLLM's
        own gauge (the poll) is computed after finished requests are freed.
        """
        step = self.kv_usage_step
        if (step is not None and now_mono_s - self.kv_usage_step_mono_s <= max_step_age_s
                and (self.kv_usage_polled is None
                     or self.kv_usage_step_mono_s >= self.kv_usage_polled_mono_s)):
            return step
        return self.kv_usage_polled

    def kv_pool_usage(self, now_mono_s: float, max_step_age_s: float) -> tuple[float, int | None] | None:
        """``(usage, blocks)`` of the KV pool a session keeps its KV in without a re-prefill: the
        GPU's, and with a host tier the host's too (a session displaced from the GPU resumes by a
        copy): ``u x gpu / (gpu + host)`` over ``gpu + host`` blocks. ``None`` if the usage is
        unknown; ``blocks`` ``None`` (and ``u`` unscaled) if the GPU's blocks are."""
        usage = self.kv_usage(now_mono_s, max_step_age_s)
        if usage is None:
            return None
        if not self.num_gpu_blocks:
            return usage, None
        blocks = self.num_gpu_blocks + self.num_host_blocks
        return usage * self.num_gpu_blocks / blocks, blocks


@dataclass
class _Placement:
    """A session's routing history (the router's prefix index and its working-set projection)."""

    routed_tokens: dict[int, int] = field(default_factory=dict)
    """Replica index -> the longest prompt of the session routed there, tokens."""
    first_prompt_tokens: int = 0
    last_prompt_tokens: int = 0
    num_prompts: int = 0

    def observe_prompt(self, num_prompt_tokens: int) -> None:
        """A turn's prompt, tokens (0: unknown, ignored). Mutates."""
        if num_prompt_tokens <= 0:
            return
        if self.num_prompts == 0:
            self.first_prompt_tokens = num_prompt_tokens
        self.last_prompt_tokens = num_prompt_tokens
        self.num_prompts += 1

    @property
    def projected_tokens(self) -> int:
        """Next turn's context: the last prompt plus the mean growth per turn so far, tokens."""
        if self.num_prompts < 2:
            return self.last_prompt_tokens
        growth = (self.last_prompt_tokens - self.first_prompt_tokens) / (self.num_prompts - 1)
        return int(self.last_prompt_tokens + growth)


class Router:
    """Replica table (what each replica reported: KV, health) and the affinity / least-loaded choice.

    Args:
        config: the replicas, their failure threshold and the ``engine_step`` freshness.
        clock: monotonic seconds (the control plane's clock; virtual in the simulator).
    """

    def __init__(self, config: GatewayConfig, clock: Callable[[], float] = time.monotonic) -> None:
        self.config = config
        self.clock = clock
        self.replicas = [
            ReplicaState(i, config.replica_name(i), r.url, authorization=(
                f"Bearer {r.api_key.get_secret_value()}" if r.api_key is not None else None))
            for i, r in enumerate(config.replicas)
        ]
        self._by_source = {config.replica_source(i): i for i in range(len(config.replicas))}
        self.policy = routing_policy(config.routing_policy)
        """The routing policy (``config.routing_policy``)."""
        self._bound: list[dict[str, Session]] = [{} for _ in self.replicas]
        """Per replica: the sessions bound to it."""
        self._placement: dict[str, _Placement] = {}
        """Per session: what the prefix-aware and working-set policies read."""
        self.num_rehomes = 0
        """Sessions moved off a healthy replica by the policy (per-turn or re-homing)."""
        self.moves_kv = False
        """A moved session's KV goes along to its new replica (the simulator's
        ``--kv-transfer-gbps``); else the new replica re-prefills it (a live gateway today)."""

    def index_of_source(self, source: str) -> int | None:
        """Replica index whose GPU-plane events carry ``source``, if any."""
        return self._by_source.get(source)

    def healthy(self) -> list[ReplicaState]:
        """Replicas currently marked up."""
        return [r for r in self.replicas if r.is_healthy]

    # ------------------------------------------------------------------ KV signals
    def observe_engine_step(self, source: str, num_used_blocks: int, num_gpu_blocks: int,
                            num_host_blocks: int = 0) -> bool:
        """An engine's ``engine_step`` KV snapshot: u = used / total blocks, stamped now, and its
        host tier's blocks (``num_host_blocks``, 0: none).

        Returns:
            False if no replica has that ``source`` (or it reports no blocks). Mutates the replica.
        """
        index = self._by_source.get(source)
        if index is None or num_gpu_blocks <= 0:
            return False
        replica = self.replicas[index]
        replica.kv_usage_step = min(1.0, num_used_blocks / num_gpu_blocks)
        replica.kv_usage_step_mono_s = self.clock()
        replica.num_gpu_blocks = num_gpu_blocks
        replica.num_host_blocks = num_host_blocks
        return True

    def observe_metrics(self, index: int, m: EngineMetrics) -> None:
        """A successful ``/metrics`` poll of replica ``index``: health, restarts, KV usage, queues."""
        replica = self.replicas[index]
        if self.record_success(index):
            logger.warning("replica %s (%s) is back up", replica.name, replica.url)
        if m.process_start_s is not None:
            if replica.process_start_s is not None and m.process_start_s != replica.process_start_s:
                replica.num_restarts += 1
                logger.warning("replica %s restarted; its sessions' KV is gone", replica.name)
                self.forget_replica_cache(index)
            replica.process_start_s = m.process_start_s
        replica.kv_usage_polled = m.kv_usage
        replica.kv_usage_polled_mono_s = self.clock()
        replica.num_running, replica.num_waiting = m.num_running, m.num_waiting
        replica.num_gpu_blocks = m.num_gpu_blocks or replica.num_gpu_blocks
        replica.block_size_tokens = m.block_size_tokens or replica.block_size_tokens

    def kv_usage(self) -> float | None:
        """KV usage u of the admission window, 0..1, over the healthy replicas' KV pools
        (:meth:`ReplicaState.kv_pool_usage`: with a host tier, GPU + host), or ``None`` if no
        replica reported. ``config.admission.kv_usage_over_replicas``: ``pooled`` = used blocks /
        blocks, summed over replicas (the plain mean of their u when one's size is unknown);
        ``max`` = the fullest replica's u."""
        now = self.clock()
        pools = [pool for r in self.healthy()
                 if (pool := r.kv_pool_usage(now, self.config.engine_step_max_age_s)) is not None]
        if not pools:
            return None
        if len(pools) == 1 or self.config.admission.kv_usage_over_replicas == "max":
            return max(u for u, _ in pools)
        if any(blocks is None for _, blocks in pools):
            return sum(u for u, _ in pools) / len(pools)
        return sum(u * blocks for u, blocks in pools) / sum(blocks for _, blocks in pools)

    def kv_budget_blocks(self, kv_set_usage: float) -> int | None:
        """Blocks a new session may still commit before usage ``kv_set_usage`` on the best replica:
        ``max(0, max over replicas of floor((kv_set_usage - u) * blocks))`` over each replica's KV
        pool (:meth:`ReplicaState.kv_pool_usage`); ``None`` if no replica reported."""
        now = self.clock()
        budgets = [int((kv_set_usage - pool[0]) * pool[1]) for r in self.healthy()
                   if (pool := r.kv_pool_usage(now, self.config.engine_step_max_age_s)) is not None
                   and pool[1]]
        return max(0, max(budgets)) if budgets else None

    def block_size_tokens(self) -> int:
        """KV block size for projections: the first replica's reported one, else the config's."""
        return next((r.block_size_tokens for r in self.replicas if r.block_size_tokens),
                    self.config.block_size_tokens)

    # ------------------------------------------------------------------ routing
    def replica_loads(self) -> list[ReplicaLoad]:
        """Every replica as the routing policy sees it (:class:`ReplicaLoad`). Pure."""
        now = self.clock()
        max_age = self.config.engine_step_max_age_s
        needs_sets = self.policy.needs_prompt
        block_size = self.block_size_tokens()
        loads = []
        append = loads.append
        for r in self.replicas:
            if needs_sets:
                bound = self._bound[r.index]
                working_set = sum(self._placement[s].projected_tokens for s in bound)
                acting = sum(1 for s in bound.values() if s.tools_in_flight)
            else:
                working_set = acting = 0
            # Positional: the order of ReplicaLoad's fields (a keyword call costs twice as much).
            append(ReplicaLoad(
                r.index, r.is_healthy, r.num_sessions, r.kv_usage(now, max_age), r.num_in_flight,
                r.num_waiting or 0,
                r.num_gpu_blocks * block_size if r.num_gpu_blocks else None,
                working_set, acting, r.num_prefix_tokens))
        return loads

    def route(self, session: Session, num_prompt_tokens: int = 0) -> ReplicaState:
        """Return the replica for the session's next request, binding the session to it: the
        routing policy's choice (``config.routing_policy``,
        :func:`~mars_openhands.policy.placement.choose_replica`). Mutates.

        Args:
            session: the session.
            num_prompt_tokens: this request's prompt, tokens (0: unknown); the prefix-aware and
                working-set policies read it.

        Raises:
            NoReplicaError: every replica is down (the message lists them with their last error).
        """
        current = session.replica
        if (current is not None and self.policy.is_sticky and not self.policy.rehomes
                and not self.policy.needs_prompt and self.replicas[current].is_healthy):
            return self.replicas[current]  # the hot path: affinity, no snapshot needed
        if current is not None and not self.replicas[current].is_healthy:
            self.detach(session)
        placement = self._placement.get(session.session_id)
        if placement is None:
            placement = self._placement[session.session_id] = _Placement()
        placement.observe_prompt(num_prompt_tokens)
        request = RouteRequest(
            session_id=session.session_id, replica=session.replica,
            num_prompt_tokens=num_prompt_tokens, num_projected_tokens=placement.projected_tokens,
            cached_tokens=placement.routed_tokens, block_size_tokens=self.block_size_tokens(),
            moves_kv=self.moves_kv)
        try:
            index = choose_replica(request, self.replica_loads(), self.policy)
        except NoHealthyReplicaError:
            states = ", ".join(f"{r.name} ({redact_url(r.url)}): {r.last_error}" for r in self.replicas)
            raise NoReplicaError(f"no healthy vLLM replica; all are down: {states}") from None
        if session.replica != index:
            self.detach(session)
            if placement.routed_tokens:
                self.num_rehomes += 1
            session.replica = index
            self.replicas[index].num_sessions += 1
            self._bound[index][session.session_id] = session
        self._record_prefix(placement, index, num_prompt_tokens)
        return self.replicas[index]

    def _record_prefix(self, placement: _Placement, index: int, num_prompt_tokens: int) -> None:
        """The prefix index (llm-d's approximate scorer, Ray's tree): this prompt is now on
        ``index``; the replica's tenant grows by what the session's prefix there grew."""
        before = placement.routed_tokens.get(index, 0)
        if num_prompt_tokens > before:
            placement.routed_tokens[index] = num_prompt_tokens
            self.replicas[index].num_prefix_tokens += num_prompt_tokens - before

    def detach(self, session: Session) -> None:
        """Unbind the session from its replica (session ended, re-homed or replica down); an ended
        session's placement state is forgotten. Mutates."""
        if session.replica is not None:
            self.replicas[session.replica].num_sessions -= 1
            self._bound[session.replica].pop(session.session_id, None)
            session.replica = None
        if session.has_ended:
            self._placement.pop(session.session_id, None)

    def forget_replica_cache(self, index: int) -> None:
        """Replica ``index`` lost its KV (down or restarted): its prefix index entries go (Ray's
        ``remove_tenants``). Mutates."""
        self.replicas[index].num_prefix_tokens = 0
        for placement in self._placement.values():
            placement.routed_tokens.pop(index, None)

    def record_success(self, index: int) -> bool:
        """A poll or request succeeded. Returns True if the replica came back up. Mutates."""
        r = self.replicas[index]
        came_back = not r.is_healthy
        r.is_healthy = True
        r.num_consecutive_failures = 0
        r.last_error = None
        return came_back

    def record_failure(self, index: int, error: str, immediate: bool = False) -> bool:
        """A poll or request failed. Returns True if the replica just went down. Mutates.

        Args:
            index: replica index.
            error: what failed, for messages.
            immediate: mark down now (a request could not connect) instead of after the threshold.
        """
        r = self.replicas[index]
        r.num_consecutive_failures += 1
        r.num_failures_total += 1
        r.last_error = error
        threshold = 1 if immediate else self.config.replica_failure_threshold
        if r.is_healthy and r.num_consecutive_failures >= threshold:
            r.is_healthy = False
            return True
        return False
