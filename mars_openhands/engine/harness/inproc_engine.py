"""A real vLLM scheduler driven in-process, with no model and no server (design.md §9).

The simulator (``eval/sim.py``) and tests build the *real* scheduler classes (stock vLLM
``Scheduler`` / ``AsyncScheduler`` or our plugins from :mod:`mars_openhands.engine`) over a fake
KV cache of ``num_gpu_blocks`` blocks (:mod:`.build`), feed them ``Request`` objects with
prefix-cache hashing (:mod:`.tokens`), and answer each ``schedule()`` with a synthetic
``ModelRunnerOutput``: every scheduled request that has computed all its known tokens gets its
next planned token ids, a request still in prefill gets none (as vLLM's model runner does).
Steps run one at a time (``schedule()`` then ``update_from_output()``), as vLLM does on CPU where
async scheduling is off.

Merged runs (simulator speed): one ``schedule()`` may stand for ``k`` single steps when the
engine can prove they would do the same (:meth:`InprocEngine.plan_run`; the kinds, the planner
and the path of one run are in :mod:`.runs`). A steady decode run hands vLLM ``k - 1`` draft
tokens per request through its public ``update_draft_token_ids`` and then "accepts" them all:
the real scheduler allocates KV for ``k`` tokens per request and advances each by ``k`` tokens in
one call, exactly as in speculative decoding. A blocked run also hides the waiting queue
(every waiting request stays blocked in each of its steps: the *probe* and the head proof,
:mod:`.head`), and a chunked-prefill run scales the step's token budget by ``k``.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from vllm.sampling_params import SamplingParams
from vllm.v1.core.sched.async_scheduler import AsyncScheduler
from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.outputs import DraftTokenIds, ModelRunnerOutput
from vllm.v1.request import Request, RequestStatus

from mars_openhands.engine import seams
from mars_openhands.engine.harness.build import (
    InprocEngineParams,
    build_scheduler,
    resolve_scheduler_cls,
)
from mars_openhands.engine.harness.head import HeadProof
from mars_openhands.engine.harness.kv_pool import assert_pooled_no_leaks, pooled_kv_block_counts
from mars_openhands.engine.harness.offload.worker_side import HostKvWorkerSide
from mars_openhands.engine.harness.prefix_memo import PrefixHitMemo
from mars_openhands.engine.harness.runs import (
    SINGLE_STEP,
    RunKind,
    RunKv,
    RunPlan,
    StepTimer,
    decode_step_durations,
    plan_exact_run,
    steady_run,
)
from mars_openhands.engine.harness.tokens import SessionTokenStream, StreamBlockHasher
from mars_openhands.engine.schedulers.base import MarsBaseScheduler
from mars_openhands.engine.schedulers.coalesce import HeadRule, MergedRun, MergesRuns
from mars_openhands.engine.schedulers.host_tier import host_blocks
from mars_openhands.engine.seams import fast_paths

__all__ = ["BlockedProbe", "EngineStepRecord", "InprocEngine", "InprocEngineParams",
           "SessionTokenStream"]


@dataclass
class EngineStepRecord:
    """What one :meth:`InprocEngine.step` did.

    Attributes:
        scheduler_output: vLLM's ``SchedulerOutput``.
        num_scheduled_tokens: request id -> tokens scheduled this step.
        prefill: ``(new_tokens, cached_tokens)`` per request running a prefill chunk.
        decode_context_tokens: context length (tokens attended, incl. the new one) per decoding
            request at the first of the step's ``num_decode_tokens`` decode positions.
        num_decode_tokens: tokens each decoding request advanced (``k`` of a coalesced step).
        new_request_cached_tokens: request id -> prefix-cache hit tokens, for requests scheduled
            for the first time (or resumed) in this step.
        preempted_ids: requests vLLM preempted in this step.
        outputs: ``(request_id, num_new_tokens, finish_reason or None)`` from update_from_output.
        sampled_token_ids: the synthetic model output, one list per scheduled request.
        loaded_ids: requests whose host-tier load finished by the step's end (host KV tier).
    """

    scheduler_output: Any
    num_scheduled_tokens: dict[str, int]
    prefill: list[tuple[int, int]] = field(default_factory=list)
    decode_context_tokens: list[int] = field(default_factory=list)
    num_decode_tokens: int = 1
    new_request_cached_tokens: dict[str, int] = field(default_factory=dict)
    preempted_ids: set[str] = field(default_factory=set)
    outputs: list[tuple[str, int, str | None]] = field(default_factory=list)
    sampled_token_ids: list[list[int]] = field(default_factory=list)
    loaded_ids: set[str] = field(default_factory=set)

    @property
    def is_empty(self) -> bool:
        """True when nothing was scheduled."""
        return not self.num_scheduled_tokens

    @property
    def finished_ids(self) -> list[str]:
        """Requests that finished in this step."""
        return [rid for rid, _, reason in self.outputs if reason is not None]


@dataclass(frozen=True, slots=True)
class BlockedProbe:
    """A single step that proved the waiting requests blocked (:meth:`InprocEngine.plan_run`):
    requests waited, every running request was scheduled (so vLLM asked the waiting queue with
    what the step's budget had left), and none was admitted, resumed or preempted. Valid until
    anything that could change that happens (a request added ahead, a finish). Frozen.

    Attributes:
        num_tokens: tokens the step scheduled (its waiting queue saw the budget less these).
        has_prefill: the step held a prefill chunk (our schedulers then merge no decode run).
    """

    num_tokens: int
    has_prefill: bool


class InprocEngine:
    """One real vLLM scheduler plus the synthetic model runner around it.

    Args:
        policy: scheduler class or policy name (:func:`~.build.resolve_scheduler_cls`).
        params: the engine shape.
        seed: seeds the token ids of session streams.
        clock: virtual clock (seconds) for our schedulers (their ``set_clock``); stock vLLM
            reads no clock that matters with ``log_stats=False`` (request arrival times are set
            by the caller).
        model_dir: tiny model folder (default: written under the temp dir).
        memoize_prefix_hits: install a :class:`~.prefix_memo.PrefixHitMemo`, the fused block
            allocation (:func:`fast_paths.install_fused_block_allocation`), the batched token
            append (:func:`fast_paths.install_batched_token_append`) and the fused prefix lookup
            (:func:`fast_paths.install_fused_prefix_lookup`): exact; the simulator's speed.
        kv_pool_of: share this engine's KV block pool (the pooled-KV bound, :mod:`.kv_pool`):
            both must be built with the same shape (:func:`~.kv_pool.pooled_params`); the pool's
            fused allocation stays the first engine's, and only the first engine memoizes prefix
            hits (its memo watches the one prefix-cache map every engine changes).

    With a host KV tier (``params.host_kv``) vLLM's ``OffloadingConnector`` runs in the
    scheduler and its worker side here (:class:`~.offload.worker_side.HostKvWorkerSide`) on
    ``clock``: each step starts its copies at :meth:`schedule`, reports the finished ones at
    :meth:`update`, and :meth:`step_s` slows the step while copies run. Decode steps merge then
    only while the tier would do nothing in any of them (:meth:`plan_run`).
    """

    def __init__(
        self, policy: str | type[Scheduler], params: InprocEngineParams, *, seed: int = 0,
        clock: Callable[[], float] | None = None, model_dir: Path | None = None,
        memoize_prefix_hits: bool = False, kv_pool_of: InprocEngine | None = None,
    ) -> None:
        cls = resolve_scheduler_cls(policy) if isinstance(policy, str) else policy
        self.params = params
        self.seed = seed
        self.scheduler = build_scheduler(cls, params, model_dir)
        s = self.scheduler
        self.pool_peers: list[InprocEngine] = [self]
        """The engines sharing this one's KV block pool, itself included (one list object)."""
        if kv_pool_of is not None:
            if params.host_kv is not None or kv_pool_of.params.host_kv is not None:
                raise ValueError("a pooled KV cannot have a host KV tier (its copies are modelled "
                                 "on one engine only); drop host_kv or the pooled-KV bound")
            seams.blocks.share_block_pool(s, kv_pool_of.scheduler)
            self.pool_peers = kv_pool_of.pool_peers
            self.pool_peers.append(self)
        self._plugin: MarsBaseScheduler | None = s if isinstance(s, MarsBaseScheduler) else None
        """Our scheduler (telemetry, a clock, a CPU-event inbox), or None for stock vLLM."""
        if kv_pool_of is not None and self._plugin is not None and kv_pool_of.plugin is not None:
            self._plugin.join_kv_pool_of(kv_pool_of.plugin)  # one pool, one reclaim
        self._runs: MergesRuns | None = s if isinstance(s, MergesRuns) else None
        """The scheduler's side of merged runs, or None (a plugin that allows none)."""
        if clock is not None:
            self.set_clock(clock)
        self._num_host_blocks = host_blocks(s.vllm_config, s.kv_cache_config)
        """The host KV tier's capacity in GPU blocks (0: none), for ``engine_step``."""
        self.host_kv: HostKvWorkerSide | None = None
        """The host KV tier's worker side, or None (no ``params.host_kv``)."""
        if params.host_kv is not None:
            self.host_kv = HostKvWorkerSide(s.vllm_config, s.kv_cache_config,
                                            clock if clock is not None else (lambda: 0.0))
        self.hasher = StreamBlockHasher(params.block_size, params.prefix_caching_hash_algo)
        self.prefix_memo = (PrefixHitMemo(s) if memoize_prefix_hits and kv_pool_of is None
                            and params.enable_prefix_caching else None)
        if memoize_prefix_hits:
            if kv_pool_of is None:  # a shared pool's methods are wrapped once, by its first engine
                fast_paths.install_fused_block_allocation(s)
            fast_paths.install_batched_token_append(s)
            fast_paths.install_fused_prefix_lookup(s)
        self.head = HeadProof(s, params.block_size,
                              self._runs.head_rule() if self._runs is not None else HeadRule.STOCK)
        """The waiting head's proof for blocked runs."""
        self._planned: dict[str, list[int]] = {}
        self._requests: dict[str, Request] = {}
        self._kv_counts: tuple[int, int, int] | None = None
        """Memo of :meth:`kv_block_counts`; cleared by every call that can change the KV state."""
        self.probe: BlockedProbe | None = None
        """The last single step's proof that the waiting requests are blocked, while it holds."""
        self._plan: RunPlan | None = None
        """The merged run :meth:`plan_run` planned last, until the state changes."""
        self.num_steps = 0
        """``schedule()`` calls so far."""
        self.num_decode_substeps = 0
        """Engine steps represented so far (a coalesced step of ``k`` tokens counts ``k``)."""
        self.num_prefill_runs = 0
        """Merged chunked-prefill runs so far (the simulator's speed)."""

    # ------------------------------------------------------------------ plumbing
    def set_clock(self, clock: Callable[[], float]) -> None:
        """Point our scheduler's clock at ``clock`` (no-op for stock vLLM). Mutates."""
        if self._plugin is not None:
            self._plugin.set_clock(clock)

    @property
    def plugin(self) -> MarsBaseScheduler | None:
        """Our scheduler (the same object as :attr:`scheduler`), or None for stock vLLM."""
        return self._plugin

    @property
    def is_kv_pooled(self) -> bool:
        """True when this engine shares its KV block pool with others (:mod:`.kv_pool`)."""
        return len(self.pool_peers) > 1

    @property
    def is_plugin(self) -> bool:
        """True for our schedulers (they have telemetry, a clock and a CPU-event inbox)."""
        return self._plugin is not None

    def set_telemetry_sink(self, sink: Any, *, engine_steps: bool = True) -> None:
        """Our scheduler's GPU-plane events go to ``sink`` (no-op for stock vLLM, which has
        none); ``engine_steps=False``: no ``engine_step`` snapshots. Mutates."""
        if self._plugin is not None:
            self._plugin.set_telemetry_sink(sink, engine_steps=engine_steps)

    def post_event(self, event: Any) -> None:
        """Hand a CPU-plane event to our scheduler (applied at its next step; no-op for stock
        vLLM), as the gateway forwards it. Mutates."""
        if self._plugin is not None:
            self._plugin.post_event(event)

    def request_counts(self) -> tuple[int, int]:
        """``(running, waiting)`` as the scheduler reports them (vLLM's ``get_request_counts``;
        ours count the requests they hold outside vLLM's queues as waiting). Pure."""
        return self.scheduler.get_request_counts()

    def stream(self, session_id: str) -> SessionTokenStream:
        """A new token stream for ``session_id`` (seeded by the engine's seed)."""
        return SessionTokenStream(session_id, self.seed)

    # ------------------------------------------------------------------ requests
    def add_request(
        self, request_id: str, stream: SessionTokenStream, prompt_end: int, num_output_tokens: int,
        *, arrival_time_s: float, session_id: str | None = None,
        extra_args: dict[str, Any] | None = None,
    ) -> Request:
        """Add one turn: prompt ``stream[:prompt_end]``, output ``stream[prompt_end:+n]``.

        The output ids must already be appended to ``stream``. Mutates the scheduler.

        Args:
            request_id: unique id.
            stream: the session's token stream.
            prompt_end: prompt length in tokens (>= 1).
            num_output_tokens: ``max_tokens`` (>= 1); generation ignores EOS.
            arrival_time_s: ``Request.arrival_time`` (the caller's clock, seconds).
            session_id: vLLM's native ``Request.session_id`` (default: the stream's).
            extra_args: ``SamplingParams.extra_args`` (the gateway's ``vllm_xargs``).

        Raises:
            ValueError: bad lengths, or the output ids are not in the stream yet.
        """
        if prompt_end < 1 or num_output_tokens < 1:
            raise ValueError(f"request {request_id!r} needs prompt >= 1 and output >= 1 tokens, "
                             f"got {prompt_end} and {num_output_tokens}")
        end = prompt_end + num_output_tokens
        self._planned[request_id] = stream.ids(prompt_end, end)
        sampling = SamplingParams(max_tokens=num_output_tokens, ignore_eos=True)
        sampling.extra_args = dict(extra_args) if extra_args else None
        self.hasher.register(request_id, stream, end)
        request = Request(request_id, stream.ids(0, prompt_end), sampling, None,
                          arrival_time=arrival_time_s, block_hasher=self.hasher,
                          session_id=session_id if session_id is not None else stream.session_id)
        # Per-request prefill stats feed only the API's usage/metrics output, which nothing reads
        # here; vLLM computes them at the first output with an O(context blocks) walk.
        request.prefill_stats = None
        self._requests[request_id] = request
        waiting = self.scheduler.waiting
        head = waiting.peek_request() if waiting else None
        self.scheduler.add_request(request)
        self._kv_counts = None
        self._plan = None
        if self.is_plugin or head is None or waiting.peek_request() is not head:
            # Stock vLLM queues it behind a blocked head, which stays blocked; our schedulers
            # may reorder or admit on arrival.
            self.probe = None
        return request

    def step_s(self, work_s: float) -> float:
        """Seconds a step just scheduled takes, given its modelled GPU work ``work_s``: the same
        without a host KV tier, else slowed while copies run (:meth:`HostKvWorkerSide.step_s`).
        Mutates (the host tier's flush wait is taken)."""
        return work_s if self.host_kv is None else self.host_kv.step_s(work_s)

    def next_copy_done_s(self) -> float:
        """Clock time the host tier's next copy finishes (``inf`` without one or when idle).
        Pure."""
        return math.inf if self.host_kv is None else self.host_kv.next_done_s()

    def next_wake_s(self) -> float:
        """Clock time at which an idle engine's :meth:`has_work` turns true by the clock alone:
        with a host KV tier (vLLM's ``has_requests``) our scheduler's next retained-KV expiry;
        ``inf`` otherwise (without the tier an idle engine wakes only for a request). Pure."""
        if self.host_kv is None or not self.is_plugin:
            return math.inf
        retained = getattr(self.scheduler, "retained", None)
        return math.inf if retained is None else retained.next_expiry_s

    def _tier_store_horizons(self) -> dict[str, float] | None:
        """Without a host KV tier an empty dict; with one, while it is idle (no copy queued or
        running, nothing pending in vLLM's connector), running request id -> tokens computed from
        which the connector stores its next chunk (:func:`fast_paths.host_tier_store_horizons`),
        else None (no merged run). Pure."""
        if self.host_kv is None:
            return {}
        if not self.host_kv.is_idle():
            return None
        return fast_paths.host_tier_store_horizons(self.scheduler)

    def _can_merge_tier_runs(self) -> bool:
        """No host KV tier, or stock vLLM, or one of our schedulers that merges runs
        (:class:`MergesRuns`): the others merge no run with the tier (:meth:`_tier_steady_run`). Pure."""
        return self.host_kv is None or not self.is_plugin or self._runs is not None

    def _is_tier_idle(self) -> bool:
        """No host KV tier, or one with nothing queued, running or pending. Pure."""
        return self._tier_store_horizons() is not None

    def abort_all(self) -> list[str]:
        """Abort every unfinished request (the replica is lost): vLLM's ``finish_requests`` with
        ``FINISHED_ABORTED``, which frees their blocks. A step scheduled but not yet updated is
        dropped with them. Mutates. Returns the aborted request ids."""
        request_ids = list(self._requests)
        self.scheduler.finish_requests(request_ids, RequestStatus.FINISHED_ABORTED)
        for request_id in request_ids:
            self._forget(request_id)
        self._kv_counts = None
        self._plan = None
        self.probe = None
        return request_ids

    def has_work(self) -> bool:
        """True while the scheduler holds an unfinished request; with a host KV tier, while vLLM's
        engine core would step (``has_requests``: also a finished request not yet reported, and the
        connector's pending copies)."""
        if self.host_kv is not None:
            return self.scheduler.has_requests()
        return self.scheduler.has_unfinished_requests()

    def request(self, request_id: str) -> Request | None:
        """A live request by id (``None`` once finished)."""
        return self._requests.get(request_id)

    # ------------------------------------------------------------------ KV transfer
    def cached_prefix_blocks(self, block_hashes: Sequence[Any]) -> int:
        """Leading blocks of ``block_hashes`` (a session stream's ``block_hashes``) that this
        engine's prefix cache holds now: what a KV transfer of that prefix can send. Pure."""
        return seams.blocks.cached_prefix_blocks(self.scheduler, block_hashes)

    def import_prefix(self, block_hashes: Sequence[Any]) -> int:
        """A prefix another engine computed arrives by KV transfer: its blocks join this engine's
        prefix cache as free, most recently used blocks
        (:func:`~mars_openhands.engine.seams.blocks.import_cached_prefix`: nothing is held for the
        request that will read them, so a full engine may evict them first). Mutates.

        Returns:
            Leading blocks of ``block_hashes`` cached here now.

        Raises:
            ValueError: a pooled engine (its pool is every replica's already), or as
                ``import_cached_prefix``.
        """
        if self.is_kv_pooled:
            raise ValueError("a pooled-KV engine shares every prefix already; nothing to import")
        num = seams.blocks.import_cached_prefix(self.scheduler, block_hashes)
        self._kv_counts = None
        self._plan = None
        self.probe = None  # the free queue's cached blocks changed: a blocked head's hit may too
        return num

    # ------------------------------------------------------------------ stepping
    def step(self, plan: RunPlan | int = 1) -> EngineStepRecord:
        """One engine step: :meth:`schedule` then :meth:`update` (no time passes in between).

        Raises:
            ValueError: as :meth:`schedule`.
        """
        return self.update(self.schedule(plan))

    def schedule(self, plan: RunPlan | int = 1) -> EngineStepRecord:
        """``schedule()`` and the synthetic model output for it (not yet applied).

        Args:
            plan: what the call stands for: a merged run :meth:`plan_run` just planned, or ``k``
                (a steady decode run of ``k`` tokens per request through vLLM's draft-token
                path, allowed only in a steady decode state: :meth:`max_decode_run`; 1: one step).

        Returns:
            The step's record (``is_empty`` when nothing was scheduled); pass it to
            :meth:`update` once the step's (virtual) time has passed.

        Raises:
            ValueError: ``k`` > 1 outside a steady decode state, or a merged run that is not the
                one :meth:`plan_run` planned for the current state.
        """
        if isinstance(plan, int):
            k, kind = plan, RunKind.SINGLE if plan == 1 else RunKind.STEADY
        else:
            k, kind = plan.num_steps, plan.kind
        # A probe needs requests waiting before the step (one preempted in it voids the probe).
        was_tier_idle = self.host_kv is None or (bool(self.scheduler.waiting) and self._can_merge_tier_runs()
                                                 and self._is_tier_idle())
        if kind in (RunKind.SINGLE, RunKind.STEADY):
            if k > 1:
                self._propose_drafts(k, self.max_decode_run(k))
            out = self.scheduler.schedule()
        elif plan is not self._plan:
            raise ValueError(f"a {kind.value} run of {k} steps that is not the one plan_run() "
                             "planned for the engine's current state; call plan_run() first")
        else:
            out = self._schedule_merged(plan)
        if self.host_kv is not None:
            self.host_kv.begin_step(out)
        self._kv_counts = None
        self._plan = None
        self.num_steps += 1
        record = EngineStepRecord(out, dict(out.num_scheduled_tokens), num_decode_tokens=k,
                                  preempted_ids=set(out.preempted_req_ids or ()))
        for new in out.scheduled_new_reqs:
            record.new_request_cached_tokens[new.req_id] = new.num_computed_tokens
        cached = out.scheduled_cached_reqs
        for rid, num_computed in zip(cached.req_ids, cached.num_computed_tokens, strict=False):
            if rid in cached.resumed_req_ids:
                record.new_request_cached_tokens[rid] = num_computed
        record.sampled_token_ids = [self._sample(rid, out, record) for rid in out.num_scheduled_tokens]
        if record.num_scheduled_tokens:
            is_prefill_run = kind in (RunKind.PREFILL, RunKind.BLOCKED_PREFILL)
            self.num_decode_substeps += k if is_prefill_run or not record.prefill else 1
        if kind not in (RunKind.BLOCKED, RunKind.BLOCKED_PREFILL):
            # With a host tier the step proves a wait only if the tier did nothing in it: its
            # waiting requests' host hits were then the ones a merged run's steps would see.
            is_quiet = was_tier_idle and self._is_tier_idle()
            self.probe = self._blocked_probe(record) if is_quiet else None
        return record

    def _schedule_merged(self, plan: RunPlan) -> Any:
        """One ``schedule()`` for a blocked or chunked-prefill run (:meth:`plan_run`): drafts for
        the decodes, the step budget scaled for a prefill run, the waiting queue hidden for a
        blocked one (our schedulers get the run: :class:`MergedRun`)."""
        s = self.scheduler
        k = plan.num_steps
        if plan.is_prefill_run:
            self._propose_drafts(k, k, decoding_only=True)
            self.num_prefill_runs += 1
            budget = k * sum(plan.step_tokens)
            with fast_paths.scaled_step_budget(s, k, budget):
                return self._schedule_hiding(plan) if plan.is_waiting_hidden else s.schedule()
        self._propose_drafts(k, k)
        return self._schedule_hiding(plan)

    def _schedule_hiding(self, plan: RunPlan) -> Any:
        """``schedule()`` with the waiting queue hidden: each of the run's single steps leaves every
        waiting request waiting (:meth:`plan_run` proved it)."""
        with fast_paths.hidden_waiting(self.scheduler):
            if self._runs is None:
                return self.scheduler.schedule()
            return self._runs.schedule(run=MergedRun(plan.num_steps, plan.last_step_s))

    def _blocked_probe(self, record: EngineStepRecord) -> BlockedProbe | None:
        """This single step as a :class:`BlockedProbe`, or None when it proves nothing. With
        stock vLLM the step may hold prefill chunks (a blocked chunked-prefill run follows);
        with our schedulers too, and it then starts no blocked decode run."""
        s = self.scheduler
        if (record.num_decode_tokens != 1 or not s.waiting
                or record.preempted_ids or record.new_request_cached_tokens
                or fast_paths.is_kv_holding_waiting(s)
                or len(record.num_scheduled_tokens) != len(s.running)):
            return None
        has_prefill = self.is_plugin and (bool(record.prefill) or any(
            n != 1 for n in record.num_scheduled_tokens.values()))
        return BlockedProbe(sum(record.num_scheduled_tokens.values()), has_prefill)

    def update(self, record: EngineStepRecord) -> EngineStepRecord:
        """Apply the step's synthetic model output (``update_from_output``). Mutates ``record``.

        Returns:
            ``record`` with :attr:`EngineStepRecord.outputs` filled.
        """
        req_ids = list(record.num_scheduled_tokens)
        runner_output = ModelRunnerOutput(
            req_ids=req_ids, req_id_to_index={r: i for i, r in enumerate(req_ids)},
            sampled_token_ids=record.sampled_token_ids,
        )
        if self.host_kv is not None:
            kv_out = self.host_kv.end_step(record.scheduler_output)
            runner_output.kv_connector_output = kv_out
            record.loaded_ids = set(kv_out.finished_recving or ())
        engine_outputs = self.scheduler.update_from_output(record.scheduler_output, runner_output)
        self._kv_counts = None
        self._plan = None
        for outputs in engine_outputs.values():
            for o in outputs.outputs:
                reason = None if o.finish_reason is None else str(o.finish_reason)
                record.outputs.append((o.request_id, len(o.new_token_ids), reason))
                if reason is not None:
                    self._forget(o.request_id)
                    self.probe = None  # its blocks are free now
        return record

    def _sample(self, rid: str, out: Any, record: EngineStepRecord) -> list[int]:
        """Classify ``rid`` for the step-time model and return its sampled ids (maybe none)."""
        request = self.scheduler.requests[rid]
        num_new = out.num_scheduled_tokens[rid]
        spec = out.scheduled_spec_decode_tokens.get(rid, ())
        before = request.num_computed_tokens - num_new
        if before >= request.num_prompt_tokens:
            record.decode_context_tokens.append(before + 1)
        else:
            record.prefill.append((num_new, before))
        if request.num_computed_tokens < request.num_tokens:
            return []  # still in prefill after this chunk: the model runner samples nothing
        index = request.num_output_tokens
        planned = self._planned.get(rid, ())
        ids = list(planned[index:index + 1 + len(spec)])
        return ids + [0] * (1 + len(spec) - len(ids))

    def _propose_drafts(self, k: int, limit: int, *, decoding_only: bool = False) -> None:
        """Give each running request (``decoding_only``: each decoding one) its next ``k - 1``
        planned ids as draft tokens (``limit``: the longest run the engine allows now)."""
        if limit < k:
            raise ValueError(f"num_decode_tokens={k} but the engine allows at most {limit} "
                             "coalesced decode tokens now; call max_decode_run() first")
        req_ids, drafts = [], []
        for request in self.scheduler.running:
            if decoding_only and request.num_computed_tokens != request.num_tokens - 1:
                continue
            index = request.num_output_tokens
            req_ids.append(request.request_id)
            drafts.append(list(self._planned[request.request_id][index:index + k - 1]))
        self.scheduler.update_draft_token_ids(DraftTokenIds(req_ids, drafts))

    def _forget(self, request_id: str) -> None:
        self._planned.pop(request_id, None)
        self._requests.pop(request_id, None)
        self.hasher.forget(request_id)
        if self.prefix_memo is not None:
            self.prefix_memo.forget(request_id)

    # ------------------------------------------------------------------ merged runs
    def plan_run(self, max_steps: int, now_s: float, bound_s: float, timer: StepTimer, *,
                 merge_blocked: bool = True) -> RunPlan:
        """What the next ``schedule()`` should stand for: the longest exact merged run that ends
        by ``bound_s``, or one step (:mod:`.runs` has the kinds and the path of one run). Pure
        (but for the head proof's memo); the plan is valid until the engine's state changes.

        Args:
            max_steps: most single steps merged (the simulator's ``coalesce_max_steps``).
            now_s: the scheduler clock now (the caller's clock).
            bound_s: the next event that may change the engine's input.
            timer: the step-time model (its step times chain a run's end).
            merge_blocked: also merge steps while requests wait, or a chunked-prefill run (the
                simulator's fast paths); else only steady decode runs.

        With a host KV tier (``params.host_kv``) a run merges only steps in which the tier does
        nothing (no copy queued, in flight or pending in vLLM's connector, and no step filling a
        chunk the connector stores: :func:`fast_paths.host_tier_store_horizons`), so every step
        runs at full speed and the run ends as its single steps' chain of additions (a steady
        run too: :meth:`_tier_steady_run`); no chunked-prefill run (each chunk fills blocks the
        connector stores).
        """
        if not self._can_merge_tier_runs():
            return SINGLE_STEP
        k = self.max_decode_run(max_steps)
        plan = None
        if k > 1:
            running = self.scheduler.running
            contexts = [r.num_computed_tokens + 1 for r in running]
            if self.host_kv is None:
                return steady_run(now_s, k, contexts, timer, bound_s)
            plan = self._tier_steady_run(k, now_s, bound_s, contexts, timer)
            self._plan = plan
            return plan if plan is not None else SINGLE_STEP
        if merge_blocked:
            plan = (self._blocked_decode_run(max_steps, now_s, bound_s, timer)
                    or self._prefill_run(max_steps, now_s, bound_s, timer))
        self._plan = plan
        return plan if plan is not None else SINGLE_STEP

    def _tier_steady_run(self, k: int, now_s: float, bound_s: float, contexts: list[int],
                         timer: StepTimer) -> RunPlan | None:
        """A steady decode run of at most ``k`` steps with a host KV tier, or None: timed as its
        single steps (bit-identical to one step at a time, as the tier's steps ran before they
        merged), not at the mean context. Our schedulers: only one that merges runs
        (:class:`MergesRuns`, bounded by its ``run_limits``) and holds no request outside vLLM's
        queues (it could admit one in the run's first step), unless its ``run_limits`` keep its
        holds (``run_limits_cover_held``: MARS's residency). Pure."""
        if self.is_plugin:
            if self._runs is None or (self.request_counts()[1] and not self._runs.run_limits_cover_held()):
                return None
            limits = self._runs.run_limits(k, now_s)
            if limits is None or limits.max_steps <= 1:
                return None
            k, bound_s = limits.max_steps, min(bound_s, limits.until_s)
        return plan_exact_run(RunKind.STEADY, now_s, k, bound_s, decode_step_durations(contexts, timer),
                              None, [1] * len(contexts))

    def _blocked_decode_run(self, limit: int, now_s: float, bound_s: float,
                            timer: StepTimer) -> RunPlan | None:
        """The longest run of pure-decode steps with the waiting queue hidden that equals as many
        single steps, or None.

        Mental model: FCFS past its KV knee. Requests wait for KV while the running ones decode;
        every single step asks vLLM to admit the waiting head, and the answer stays "no" until a
        request finishes, a request arrives or the head's prefix hit changes. The *probe* is the
        last single step (:class:`BlockedProbe`): a pure decode step (the waiting queue saw the
        full remaining token budget) that left every waiting request unscheduled; since then
        nothing was added, finished or preempted. Over the next ``k`` steps the same requests
        decode one token each (same token budget and running count), the free blocks only
        shrink (decode allocations, no frees), and each waiting request's need for blocks is
        unchanged as long as its prefix hit is. vLLM stops at the first waiting request it
        cannot allocate (requests are never skipped here: no KV connector, no structured output),
        so only the head is asked, and the blocks the run takes must leave it blocked
        (:meth:`HeadProof.keep_blocked`). So vLLM would leave every waiting request waiting in
        every step, and hiding them is exact. With stock vLLM a request added behind the head
        leaves the probe valid.

        With a host KV tier vLLM's connector also looks the head up in the host cache each step
        (a pure lookup; its bookkeeping is rebuilt at every lookup) and skips a request only while
        a copy of its is pending. The run needs the tier idle (:meth:`_tier_store_horizons`: no
        copy pending, no store in any of its steps), a quiet probe (the tier idle before and
        after it, so the host cache the probe's lookups saw is the run's) and vLLM's
        full-sequence gate, under which a head's admission does not depend on its host hit.

        Our schedulers add time- and event-driven decisions of their own; a class that allows
        merged runs (:class:`~mars_openhands.engine.schedulers.coalesce.MergesRuns`) bounds the
        run by them (``run_limits``: its counters and timers); a class that does not merges
        none."""
        s = self.scheduler
        probe = self.probe
        if (limit <= 1 or probe is None or not s.running or not s.waiting
                or fast_paths.is_kv_holding_waiting(s) or probe.num_tokens != len(s.running)):
            return None
        if self.is_plugin and (probe.has_prefill or self._runs is None):
            return None
        if self.host_kv is not None and not fast_paths.has_full_sequence_gate(s):
            return None  # a head's chunk may then depend on its host hit (this proof ignores it)
        # Our schedulers decide on a finish (retained KV from the other requests' lengths): the
        # finishing token takes a single step, where every other request is one token further.
        k = self._steady_decode_run(limit, keep_last=self.is_plugin)
        if k <= 1:
            return None
        if self._runs is not None:
            limits = self._runs.run_limits(k, now_s)
            if limits is None or limits.max_steps <= 1:
                return None
            k, bound_s = limits.max_steps, min(bound_s, limits.until_s)
        contexts = [r.num_computed_tokens + 1 for r in s.running]
        return plan_exact_run(
            RunKind.BLOCKED, now_s, k, bound_s, decode_step_durations(contexts, timer),
            lambda k_: self.head.keep_blocked(k_, self._run_new_blocks, probe.num_tokens),
            [1] * len(s.running))

    def _prefill_run(self, limit: int, now_s: float, bound_s: float,
                     timer: StepTimer) -> RunPlan | None:
        """The longest run of chunked-prefill steps (capped prefills beside decodes) that equals as
        many single steps, or None: while nothing waits (stock vLLM only), or, after a probe
        step that scheduled as many tokens, with the waiting requests blocked and hidden.

        Mental model: vllm-tuned (``long_prefill_token_threshold`` 512) re-prefills a 60k-token
        context in ~120 steps of one 512-token chunk beside the decodes. While nothing waits,
        every step schedules the running requests in their order, each capped prefill gets ``T``
        tokens (its remainder is larger than ``T``) and each decode one token, within the budget,
        and nobody is preempted if the ``k`` steps' new blocks fit in the free blocks (no block
        is freed inside the run: nobody finishes before its last step, and the free blocks only
        shrink). So the same requests get the same tokens in every step, and a run's end state
        equals ``k`` steps' (the blocks taken are the same first ones of the free queue, in
        another order among the requests: no decision reads block ids). Async scheduling only.
        While requests wait, the probe scheduled as many tokens as each step of the run does (the
        same requests, the same chunks): vLLM asks the waiting head with the same budget left in
        every step and fewer free blocks, which leave it blocked (:meth:`HeadProof.keep_blocked`).
        Our schedulers give each running prefill's chunk (``prefill_run_chunk_tokens``: the same
        in every step) and bound the run as a blocked decode run (``run_limits`` with the
        step's tokens), and the chunk hook scales each chunk by ``k`` (:class:`MergedRun`).

        Region diagram of one prefilling request (``c`` computed tokens, cap ``T``)::

            | computed c | k chunks of T (this run) | rest > 0 |
            |<-------------------- num_tokens --------------------->|
        """
        s = self.scheduler
        if limit <= 1 or fast_paths.is_kv_holding_waiting(s) or self.host_kv is not None:
            return None  # with a host tier each chunk fills blocks the connector stores
        if not s.waiting:
            if self.is_plugin:
                return None
            steps = self.run_step_tokens()
            k = self._prefill_run_len(limit, steps)
            if k <= 1:
                return None
            return plan_exact_run(RunKind.PREFILL, now_s, k, bound_s,
                                  self._prefill_step_durations(k, steps, timer), None, steps)
        probe = self.probe
        if probe is None or (not self.is_plugin and self.params.long_prefill_token_threshold <= 0):
            return None
        if self.is_plugin and self._runs is None:
            return None
        steps = self.run_step_tokens()
        k = self._prefill_run_len(limit, steps)
        if k <= 1 or probe.num_tokens != sum(steps):
            return None
        max_step_s = float("inf")
        if self._runs is not None:
            limits = self._runs.run_limits(k, now_s, step_tokens=probe.num_tokens)
            if limits is None or limits.max_steps <= 1:
                return None
            k, bound_s, max_step_s = limits.max_steps, min(bound_s, limits.until_s), limits.max_prefill_step_s
        return plan_exact_run(
            RunKind.BLOCKED_PREFILL, now_s, k, bound_s, self._prefill_step_durations(k, steps, timer),
            lambda k_: self.head.keep_blocked(k_, lambda n: self._prefill_run_new_blocks(n, steps),
                                              probe.num_tokens),
            steps, max_step_s)

    def run_kv(self, plan: RunPlan) -> RunKv:
        """The used KV blocks ``plan`` (an exact run, before its ``schedule()``) leaves after each
        of its single steps (:class:`RunKv`). Pure."""
        s = self.scheduler
        return RunKv(plan.step_ends_s, self.kv_block_counts()[2], tuple(
            (r.num_computed_tokens, n, seams.blocks.num_block_table_entries(s, r.request_id))
            for r, n in zip(s.running, plan.step_tokens, strict=True)), self.params.block_size)

    def max_decode_run(self, limit: int) -> int:
        """Largest ``k <= limit`` for which a coalesced step equals ``k`` single steps. Pure.

        Requires a steady decode state: nothing waiting, every running request decoding with
        exactly its last sampled token pending, none finishing before its ``k``-th token (with
        the sync ``Scheduler`` or a host KV tier: none finishing within the run, see the code
        comments), and enough free KV blocks and token budget for ``k`` more tokens each (so
        vLLM neither preempts nor splits); with a host KV tier also the tier idle and no step
        filling a chunk its connector would store (:func:`fast_paths.host_tier_store_horizons`).
        Returns 1 when not steady.

        Region diagram of one decoding request (``c`` computed tokens, block size ``b``)::

            | computed c tokens | pending 1 | k - 1 drafts |
            blocks needed after the step: ceil((c + k) / b); held now: ceil(c / b)
        """
        s = self.scheduler
        if limit <= 1 or not s.running or s.waiting or fast_paths.is_kv_holding_waiting(s):
            return 1
        # With a host tier a finish takes a single step: the run then frees nothing (its KV
        # after each step is RunKv's, which an admission tick inside it reads).
        return self._steady_decode_run(limit, keep_last=self.host_kv is not None)

    def _steady_decode_run(self, limit: int, keep_last: bool = False) -> int:
        """:meth:`max_decode_run` without its empty-waiting condition (``keep_last``: no request
        may finish within the run). Pure."""
        s = self.scheduler
        running = s.running
        k = min(limit, self.params.max_num_batched_tokens // len(running))
        if self.params.long_prefill_token_threshold > 0:
            k = min(k, self.params.long_prefill_token_threshold)
        # The sync Scheduler caches a request's full blocks at its next allocate_slots(), so a
        # run must not end a request: its last token takes a single step, after which vLLM
        # caches the blocks the drafts filled (AsyncScheduler caches them at update time).
        keep_last = int(keep_last or not isinstance(s, AsyncScheduler))
        horizons = self._tier_store_horizons()  # {} without a host tier
        if horizons is None:
            return 1
        for r in running:
            c = r.num_computed_tokens
            if (c != r.num_tokens - 1 or c < r.num_prompt_tokens or r.num_output_placeholders
                    or r.request_id not in self._planned):
                return 1
            k = min(k, r.max_tokens - r.num_output_tokens - keep_last,
                    self.params.max_model_len - c - 1 - keep_last)
            if horizons:  # the step whose tokens reach the horizon stores a chunk: not merged
                horizon = horizons[r.request_id]
                if horizon < math.inf:
                    k = min(k, int(horizon) - 1 - c)
        while k > 1:
            if self._run_new_blocks(k) <= seams.blocks.num_free_blocks(s):
                break
            k //= 2
        return max(1, k)

    def _run_new_blocks(self, k: int) -> int:
        """New KV blocks the running requests take over ``k`` more decode tokens each. Pure."""
        bs = self.params.block_size
        return sum(-(-(r.num_computed_tokens + k) // bs) - -(-r.num_computed_tokens // bs)
                   for r in self.scheduler.running)

    @staticmethod
    def _is_decoding(r: Request) -> bool:
        c = r.num_computed_tokens
        return c == r.num_tokens - 1 and c >= r.num_prompt_tokens

    def _run_step_tokens(self, r: Request) -> int:
        """Tokens the running ``r`` takes in each step of a chunked-prefill run: 1 if decoding,
        else its prefill chunk (stock vLLM: the long-prefill cap; our schedulers:
        ``prefill_run_chunk_tokens``, 0 when the chunk may change after a step). Pure."""
        if self._is_decoding(r):
            return 1
        if self.is_plugin:
            return (self._runs.prefill_run_chunk_tokens(r) or 0) if self._runs is not None else 0
        return self.params.long_prefill_token_threshold

    def run_step_tokens(self) -> list[int]:
        """Tokens each running request takes per step of a merged run (1 if decoding, else its
        prefill chunk, 0 when the chunk may change after a step), in the running order. Pure."""
        return [self._run_step_tokens(r) for r in self.scheduler.running]

    def _prefill_run_len(self, limit: int, steps: Sequence[int]) -> int:
        """Largest ``k <= limit`` for which the running requests can take ``k`` steps of ``steps``
        tokens each (:meth:`run_step_tokens`) and stay inside their prompts, else 1. Pure."""
        s = self.scheduler
        if (limit <= 1 or not isinstance(s, AsyncScheduler)
                or len(s.running) + len(s.waiting) < 2):
            return 1
        # Our schedulers decide on a finish: a decode's last token takes a single step.
        keep_last = int(self.is_plugin)
        k, num_prefill, total = limit, 0, 0
        for r, n in zip(s.running, steps, strict=True):
            c = r.num_computed_tokens
            if r.num_output_placeholders or r.spec_token_ids or r.request_id not in self._planned:
                return 1
            total += n
            if self._is_decoding(r):
                k = min(k, r.max_tokens - r.num_output_tokens - keep_last,
                        self.params.max_model_len - c - 1 - keep_last)
            elif n > 0 and r.num_tokens - c > n:
                num_prefill += 1
                k = min(k, (r.num_tokens - c - 1) // n)  # k chunks leave >= 1 token to prefill
            else:
                return 1
        if num_prefill == 0 or total > min(
                self.params.max_num_batched_tokens, seams.hooks.max_num_scheduled_tokens(s)):
            return 1
        while k > 1 and self._prefill_run_new_blocks(k, steps) > seams.blocks.num_free_blocks(s):
            k //= 2
        return max(1, k)

    def _prefill_run_new_blocks(self, k: int, steps: Sequence[int]) -> int:
        """New KV blocks the running requests take over ``k`` steps of ``steps`` tokens each
        (:meth:`run_step_tokens`). Pure."""
        bs = self.params.block_size
        total = 0
        for r, n in zip(self.scheduler.running, steps, strict=True):
            total += max(0, -(-(r.num_computed_tokens + k * n) // bs)
                         - seams.blocks.num_block_table_entries(self.scheduler, r.request_id))
        return total

    def prefill_run_shapes(self, k: int, steps: Sequence[int] | None = None
                           ) -> Iterator[tuple[list[tuple[int, int]], list[int]]]:
        """The step-time model's input of each of the ``k`` single steps a chunked-prefill run
        stands for: ``(prefill (new, cached) chunks, decode contexts)`` in the running order, as
        :meth:`schedule` would record them step by step (lazily; ``steps``: tokens per step, by
        default :meth:`run_step_tokens`). Pure."""
        running = list(zip(self.scheduler.running, steps if steps is not None else self.run_step_tokens(),
                           strict=True))
        for i in range(k):
            prefill: list[tuple[int, int]] = []
            decode: list[int] = []
            for r, n in running:
                before = r.num_computed_tokens + i * n
                if before >= r.num_prompt_tokens:
                    decode.append(before + 1)
                else:
                    prefill.append((n, before))
            yield prefill, decode

    def _prefill_step_durations(self, k: int, steps: Sequence[int], timer: StepTimer) -> Iterator[float]:
        """Seconds of each of a chunked-prefill run's ``k`` single steps, lazily. Pure."""
        return (timer.step_time_s(prefill, decode) for prefill, decode in self.prefill_run_shapes(k, steps))

    # ------------------------------------------------------------------ KV state
    def kv_block_counts(self) -> tuple[int, int, int]:
        """``(free, retained, used)`` blocks, null block excluded (free includes evictable
        prefix-cache blocks; retained = pinned by our schedulers and referenced by no request).

        Memoized between calls that change the KV state (``add_request``, ``schedule``,
        ``update``, ``shutdown``): our schedulers count by walking every request's blocks, and
        the simulator asks several times per step (admission ticks, snapshots). A pooled engine
        counts the whole shared pool, every time (another engine's step changes it)."""
        if self.is_kv_pooled:
            return pooled_kv_block_counts(self.pool_peers)
        if self._kv_counts is None:
            s = self.scheduler
            if self._plugin is not None:
                self._kv_counts = self._plugin.kv_block_counts()
            else:
                free = seams.blocks.num_free_blocks(s)
                self._kv_counts = (free, 0, seams.blocks.num_gpu_blocks(s) - 1 - free)
        return self._kv_counts

    def kv_usage(self) -> float:
        """Used fraction of the KV pool, 0..1 (evictable prefix-cache and retained blocks count as
        free, as the gateway reads ``engine_step``)."""
        _, _, used = self.kv_block_counts()
        return min(1.0, used / max(1, seams.blocks.num_gpu_blocks(self.scheduler) - 1))

    def num_gpu_blocks(self) -> int:
        """Total KV blocks of the pool (including vLLM's null block)."""
        return seams.blocks.num_gpu_blocks(self.scheduler)

    def num_host_blocks(self) -> int:
        """The host KV tier's capacity in GPU blocks, 0 without one (``host_tier.host_blocks``). Pure."""
        return self._num_host_blocks

    def shutdown(self) -> None:
        """Release what the scheduler still holds (our schedulers: retained KV). Mutates."""
        self.scheduler.shutdown()
        self._kv_counts = None
        self._plan = None

    def assert_no_leaks(self) -> dict[str, int]:
        """Integrity check: block ref counts match request references (+ our pins).

        A pooled engine checks the whole shared pool (:func:`~.kv_pool.assert_pooled_no_leaks`).

        Raises:
            AssertionError: naming the counts and the first bad blocks.
        """
        if self.is_kv_pooled:
            return assert_pooled_no_leaks(self.pool_peers)
        if self._plugin is not None:
            return self._plugin.assert_no_leaks()
        s = self.scheduler
        refs = seams.blocks.referenced_block_counts(s)
        bad = [(b.block_id, b.ref_cnt, refs.get(b.block_id, 0))
               for b in seams.blocks.all_blocks(s) if not b.is_null and b.ref_cnt != refs.get(b.block_id, 0)]
        free = seams.blocks.num_free_blocks(s)
        assert not bad, f"KV ref-count mismatch (block, ref_cnt, request refs): {bad[:10]}"
        assert free + len(refs) == seams.blocks.num_gpu_blocks(s) - 1, (
            f"free {free} + used {len(refs)} != num_gpu_blocks {seams.blocks.num_gpu_blocks(s)} - 1")
        return {"free": free, "used": len(refs)}
