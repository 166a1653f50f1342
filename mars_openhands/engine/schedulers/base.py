"""``MarsBaseScheduler``: stock vLLM's scheduler plus narrow policy hooks (design.md §2-§4).

Mental model: vLLM's ``schedule()`` stays in charge of budgets, allocation and outputs; we only
(1) re-sort ``self.waiting`` (our :class:`~mars_openhands.engine.queues.PolicyRequestQueue`) and
``self.running`` before calling it, (2) rank preemption victims through vLLM's PRIORITY victim
rule, (3) size each prefill chunk through a per-request hook, (4) pin a finished turn's KV blocks
(an extra block reference) so the session's next turn hits the prefix cache, and reclaim those
pins lowest-value-first when an allocation fails, before vLLM preempts anyone. Every vLLM private
involved is in :mod:`mars_openhands.engine.seams`.

One step::

    schedule():  drain CPU-plane inbox -> expire retained KV -> reject bad requests
                 -> on_step_start hook -> admit from overflow window
                 -> reorder waiting / running, rank victims
                 -> super().schedule()   (chunk hook; allocate_slots wrapper reclaims pins)
                 -> first_scheduled, release pins of resumed sessions, prefill hooks

Per-step cost is O(new requests + prefill chunks), not O(running): the running list is only
re-sorted when a running request is prefilling or memory is tight, the waiting queue only when it
changed or ``reorder_interval_s`` passed, and session service is computed lazily
(:meth:`MarsBaseScheduler.session_service_tokens`).

Subclasses override only the hooks of :class:`~mars_openhands.engine.schedulers.hooks.PolicyHooks`
(the table there); each hook should call one ``policy`` function. The parts the base composes:
:class:`~.retained.RetainedKvPool` (retained KV), :class:`~.sessions.SessionTable` (sessions and
their program slot), :class:`~.inbox.CpuEventInbox` (CPU-plane events), :class:`~.waker.EngineWaker`
(waking an idle engine core), :class:`~.request_state.RequestState` (per-request policy state).
Its machinery lives in mixins of their own modules, one concern each: :class:`~.kv_retention.KvRetention`
(pin, release, expire and reclaim retained KV: where retention is decided),
:class:`~.cpu_events.CpuEvents` (the CPU-plane inbox), :class:`~.session_tracking.SessionTracking`
(a turn's session record), :class:`~.step_telemetry.StepTelemetry`, :class:`~.integrity.KvIntegrity`
(KV counts and the leak check) and :class:`~.chunks.ChunkSizing` (the chunk hook). Merged runs
(the simulator's speed) are a separate contract: :mod:`.coalesce`.

Side requests (``vllm_xargs`` ``mars_side=1``; the gateway tags chat requests without tools, such
as a conversation title or a condenser summary): they are scheduled as requests of their session
(same levels, same prefix), but are not its next turn: their arrival does not end the session's
tool phase, their first schedule does not release the session's retained KV, and their finish is
not counted or retained.

Invalid MARS extras (``vllm_xargs``): vLLM's engine core does not catch exceptions from
``add_request`` (one bad request would kill the server), so a request with a bad value is finished
with ``FINISHED_ERROR`` at the next step (the client gets ``finish_reason="error"``) and the
problem is logged naming the key; the gateway rejects the same input earlier with HTTP 400.
"""

from __future__ import annotations

import logging
import time
from collections import deque
from collections.abc import Callable, Iterator
from typing import Any, ClassVar

from vllm.v1.core.sched.async_scheduler import AsyncScheduler
from vllm.v1.core.sched.request_queue import SchedulingPolicy
from vllm.v1.request import Request, RequestStatus

from mars_openhands.engine import seams
from mars_openhands.engine.queues import PolicyRequestQueue
from mars_openhands.engine.schedulers.chunks import ChunkSizing
from mars_openhands.engine.schedulers.coalesce import MergedRun
from mars_openhands.engine.schedulers.cpu_events import CpuEvents
from mars_openhands.engine.schedulers.hooks import PolicyHooks, is_overridden
from mars_openhands.engine.schedulers.host_tier import host_blocks
from mars_openhands.engine.schedulers.inbox import CpuEventInbox
from mars_openhands.engine.schedulers.integrity import KvIntegrity
from mars_openhands.engine.schedulers.kv_retention import KvRetention
from mars_openhands.engine.schedulers.request_state import (
    RequestState,
    finished_request_ids,
    reset_mlfq,
)
from mars_openhands.engine.schedulers.retained import RetainedKv, RetainedKvPool
from mars_openhands.engine.schedulers.session_tracking import SessionTracking
from mars_openhands.engine.schedulers.sessions import SESSION_GC_INTERVAL_S, SessionTable
from mars_openhands.engine.schedulers.step_telemetry import StepTelemetry
from mars_openhands.engine.schedulers.waker import EngineWaker
from mars_openhands.engine.telemetry import EngineTelemetry, make_telemetry
from mars_openhands.policy.estimators import Ema, PrefillRate, ToolDurationEstimator
from mars_openhands.policy.params import SchedulerParams, parse_scheduler_params
from mars_openhands.policy.session import (
    context_checkpoints,
)
from mars_openhands.policy.types import TurnMeta, parse_turn_meta
from mars_openhands.stream.transport import EventSink

__all__ = ["MarsBaseScheduler", "RequestState", "RetainedKv"]

logger = logging.getLogger(__name__)

_RETAINABLE = (RequestStatus.FINISHED_STOPPED, RequestStatus.FINISHED_LENGTH_CAPPED)
_MIN_PREFILL_SAMPLE_TOKENS = 512
"""Steps with fewer prefill tokens say more about decode than about prefill speed."""


class MarsBaseScheduler(KvRetention, CpuEvents, SessionTracking, StepTelemetry, KvIntegrity, ChunkSizing,
                        PolicyHooks, AsyncScheduler):
    """Stock vLLM ``AsyncScheduler`` with policy hooks, KV retention and telemetry.

    Works whether async scheduling is on or off (on CPU vLLM forces it off; the AsyncScheduler
    then runs one step at a time). Constructed by vLLM's EngineCore with the usual arguments.

    Raises:
        ValueError: invalid ``--additional-config mars`` (names the key).
        RuntimeError: the installed vLLM lacks a seam (see :func:`seams.compat.check_compat`).
    """

    default_window_enabled: ClassVar[bool] = False
    """Class default of ``params.window.enabled`` (preview port: True)."""
    default_chunk_shrinking: ClassVar[bool] = False
    """Class default of ``params.chunk_shrinking`` (MARS: True)."""
    default_resume_when_context_fits: ClassVar[bool] = False
    """Class default of ``params.resume_when_context_fits`` (MARS, Autellix: True)."""
    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        seams.compat.check_compat()
        additional = self.vllm_config.additional_config or {}
        self.params: SchedulerParams = parse_scheduler_params(additional.get("mars"))
        self.clock: Callable[[], float] = time.monotonic
        self._check_scheduling_policy()
        self.waiting = PolicyRequestQueue(is_priority_order=self.policy == SchedulingPolicy.PRIORITY)
        self._saved_priorities: list[tuple[Request, int]] = []
        """User priorities of the requests ranked as victims for this step (restored after it)."""
        self.req_state: dict[str, RequestState] = {}
        self.sessions = SessionTable()
        """Per-session records (and the policy's per-program slot)."""
        self.retained = RetainedKvPool()
        """Finished turns' KV pinned for their sessions' next turns (expiry, reclaim, counters)."""
        self.kv_pool_peers = [self]
        """Schedulers whose retained KV a failed allocation here may reclaim (shared KV pool)."""
        rp = self.params.retention
        self.tool_durations = ToolDurationEstimator(rp.min_tool_samples, rp.max_samples_per_tool)
        self.queue_delay = Ema(rp.queue_delay_ema_alpha, rp.default_queue_delay_s)
        self.tool_queue_wait = Ema(rp.queue_delay_ema_alpha, 0.0)
        """EMA of the seconds tool calls waited for a tool worker (``tool_start.queue_wait_s``):
        the CPU plane's congestion as the engine sees it."""
        self.overflow: deque[Request] = deque()
        self._call_steps = 1
        """Single steps the ``schedule()`` in progress stands for: its ``run``'s (a merged run,
        :mod:`.coalesce`; each prefill chunk is scaled by it), 1 for every real step."""
        self._init_switches()
        self._rejected: dict[str, str] = {}
        self.inbox = CpuEventInbox(self.params.max_inbox_events_per_step)
        """CPU-plane events posted or received between steps (applied by :meth:`_drain_inbox`)."""
        self.waker = EngineWaker(lambda: self.clock(), lambda: self.retained.next_expiry_s)
        """Wakes an idle engine core for inbox events and retained-KV expiries."""
        self._last_step_counts: tuple[int, int, int, int, int] | None = None
        self._last_gc_s = 0.0
        self._last_waiting_sort_s = float("-inf")
        self._step_prefills: list[str] = []
        self.prefill_s_per_token = PrefillRate(rp.reload_linear_s_per_token, _MIN_PREFILL_SAMPLE_TOKENS)
        """Measured seconds per prefill token (step time / prefill tokens of steps with at least
        ``_MIN_PREFILL_SAMPLE_TOKENS``; includes the decodes batched with them, so an upper
        bound). Prior: ``retention.reload_linear_s_per_token``."""
        self.prefilling: set[str] = set()
        """Running requests still inside their prompt (kept up to date after each step)."""
        self.telemetry: EngineTelemetry = make_telemetry(self.params.telemetry)
        self.num_host_blocks = host_blocks(self.vllm_config, self.kv_cache_config)
        """The host-memory KV tier's capacity in GPU blocks (0: no tier), reported in ``engine_step``."""
        self._init_seams()

    # ------------------------------------------------------------------ wiring
    def _check_scheduling_policy(self) -> None:
        """``--scheduling-policy priority`` is honoured by a class that keeps vLLM's order and
        victim (no ``waiting_key``/``running_key``/``victim_key``: its waiting queue is then kept
        in vLLM's priority order, and vLLM's victim rule reads the user's priority); a class that
        orders requests by its own policy refuses it at start-up rather than ignore it.

        Raises:
            ValueError: the policy is ``priority`` and the class orders requests itself.
        """
        hooks = [h for h in ("waiting_key", "running_key", "victim_key") if self._overrides(h)]
        if self.policy == SchedulingPolicy.PRIORITY and hooks:
            raise ValueError(
                f"{type(self).__name__} does not support --scheduling-policy priority: it orders "
                f"requests by its own policy ({', '.join(hooks)}), which request priorities "
                "would contradict; use --scheduling-policy fcfs, or a class that honours "
                "priorities (FcfsScheduler, InferceptScheduler, ThunderAgentScheduler)")

    def _init_switches(self) -> None:
        """The window size and the chunk switches: the ``--additional-config`` value when given,
        else the class default (``default_*``)."""
        window_on = self.params.window.enabled
        self.window_size: int | None = (
            self.params.window.size
            if (self.default_window_enabled if window_on is None else window_on) else None
        )
        shrink = self.params.chunk_shrinking
        self.chunk_shrinking = self.default_chunk_shrinking if shrink is None else shrink
        whole = self.params.resume_when_context_fits
        self.resume_when_context_fits = (self.default_resume_when_context_fits if whole is None
                                         else whole)

    def _overrides(self, name: str) -> bool:
        return is_overridden(type(self), name)

    def _init_seams(self) -> None:
        self._has_waiting_key = self._overrides("waiting_key")
        self._has_running_key = self._overrides("running_key")
        self._has_victim_key = self._overrides("victim_key")
        self._has_on_scheduled = self._overrides("on_scheduled")
        self._has_on_prefill = self._overrides("on_prefill_scheduled")
        self._has_on_step_start = self._overrides("on_step_start")
        self._model_needs_mamba_split = seams.hooks.model_needs_mamba_split(self)
        # Enabled only while something is retained (zero cost otherwise).
        self._allocate_wrapper = seams.blocks.wrap_allocate_slots(self, self._reclaim_for)
        self._allocate_wrapper.disable()
        if self._has_victim_key:
            seams.hooks.enable_victim_ranks(self)
        self._uses_chunk_hook = (self._overrides("chunk_tokens") or self.chunk_shrinking
                                 or self.resume_when_context_fits)
        # On only in steps that can size a prefill chunk (see _reorder).
        seams.hooks.enable_chunk_hook(self, self._model_needs_mamba_split)
        # In an engine-core process: wake its idle loop when CPU-plane events or a retention
        # expiry need a step (None in-process: the simulator and tests step by themselves).
        self.set_engine_waker(seams.hooks.engine_core_waker())
        if self.params.inbox_addr:
            self.inbox.listen(self.params.inbox_addr, self.waker.wake)

    def set_engine_waker(self, wake: Callable[[], None] | None) -> None:
        """Use ``wake`` (thread-safe, non-blocking) to have the engine run a step while it is
        idle: at once when a CPU-plane event arrives, and when retained KV expires
        (:class:`~mars_openhands.engine.schedulers.waker.EngineWaker`, which says why).
        ``None``: no waking (the caller steps the scheduler). Mutates; call once, at
        construction or from a test."""
        self.waker.set(wake)

    def has_requests(self, **kwargs: Any) -> bool:
        """vLLM: whether the engine must step: requests (vLLM's rule), or CPU-plane events to
        apply, or retained KV past its expiry (an idle engine then runs one empty step)."""
        return (super().has_requests(**kwargs) or bool(self.inbox)
                or self.clock() >= self.retained.next_expiry_s)

    def set_telemetry_sink(self, sink: EventSink | None, *, engine_steps: bool = True) -> None:
        """Replace the telemetry sink (tests, simulator; ``engine_steps=False``: no
        ``engine_step`` snapshots, whose KV walk the simulator does on its own clock). Mutates."""
        self.telemetry = EngineTelemetry(
            sink, self.params.telemetry.source,
            self.params.telemetry.engine_step_interval_ms if engine_steps else None,
        )

    def set_clock(self, clock: Callable[[], float]) -> None:
        """Read time from ``clock`` (seconds; the simulator's virtual clock) instead of
        ``time.monotonic``. Mutates; call before the first request."""
        self.clock = clock

    # ------------------------------------------------------------------ vLLM entry points
    def add_request(self, request: Request, **kwargs: Any) -> None:
        """vLLM: a new request. Parses MARS extras, tracks the session, applies the window."""
        if request.request_id in self.requests:
            super().add_request(request, **kwargs)  # streaming-input continuation: vLLM's own path
            return
        now = self.clock()
        # CPU-plane events sent before this request (its previous tool's tool_end) apply first:
        # the request reaches add_request before the next step would drain them.
        self._drain_inbox(now)
        extra = request.sampling_params.extra_args if request.sampling_params else None
        try:
            meta = parse_turn_meta(extra)
        except ValueError as e:
            meta = TurnMeta()
            self._rejected[request.request_id] = str(e)
        sid = request.session_id
        if sid is not None and len(self.kv_pool_peers) > 1 and sid not in self.sessions:
            self._adopt_from_pool(sid)  # a shared KV pool: the session moved here whole
        if sid is not None and not meta.is_side and sid in self.sessions:
            self._observe_reuse(self.sessions[sid], request)
        self.req_state[request.request_id] = RequestState(
            sid, meta, now, user_priority=request.priority,
            cached_at_arrival_tokens=self.cached_tokens_at_arrival(request),
            session_context_tokens=min(request.num_prompt_tokens, self.sessions[sid].last_context_tokens)
            if sid is not None and sid in self.sessions else 0,
        )
        if sid is not None:
            if meta.is_side:  # a title/summary call: not the session's next turn
                self._on_side_request(sid, request.request_id, meta, now)
            else:
                self._on_session_request(sid, request.request_id, meta, now)
        super().add_request(request, **kwargs)
        if self.window_size is not None and request.request_id not in self._rejected:
            if len(self.running) + len(self.waiting) > self.window_size:
                self.waiting.remove_request(request)
                self.overflow.append(request)
        if self.telemetry.enabled:
            self.telemetry.queued(
                request.request_id, sid, meta.turn, request.num_prompt_tokens,
                -(-request.num_tokens // self.block_size),
            )
        self.on_request_added(request)

    def schedule(self, *args: Any, run: MergedRun | None = None, **kwargs: Any) -> Any:
        """vLLM: one scheduling step (see the module docstring for the order of work).

        ``run`` (the simulator only, :mod:`.coalesce`): the call stands for the run's steps, with
        the waiting queue hidden: the window admits nothing from its overflow (none was due, and
        the hidden queue's length would say otherwise), each prefill chunk is scaled by the
        run's steps, and per-step clocks get its last step's start."""
        now = self.clock()
        self._drain_inbox(now)
        if self.retained.is_expiry_due(now):
            self._expire_retained(now)
        if self._rejected:
            self._reject_invalid()
        if self._has_on_step_start:
            self.on_step_start(now)
        if self.overflow and run is None:
            self._admit_overflow()
        self._reorder(now)
        was_running = {r.request_id for r in self.running} if self._has_on_scheduled else None
        self._step_prefills.clear()
        if run is not None:
            self._call_steps = run.num_steps
        try:
            out = super().schedule(*args, **kwargs)
        finally:
            self._call_steps = 1
            if self._saved_priorities:
                seams.hooks.restore_priorities(self._saved_priorities)
                self._saved_priorities = []
        self._after_schedule(out, now, now if run is None else run.last_step_s, was_running)
        self.prefill_s_per_token.step_scheduled(now, self._step_prefill_tokens(out))
        if self.telemetry.enabled and (self.telemetry.should_emit_step() or self._is_idle_snapshot_due()):
            self._emit_engine_step()
        if now - self._last_gc_s > SESSION_GC_INTERVAL_S:
            self._gc_sessions(now)
        return out

    def update_from_output(self, scheduler_output: Any, model_runner_output: Any,
                           **kwargs: Any) -> Any:
        """vLLM: apply one step's output (wrapped for first-token telemetry and finish hooks)."""
        outputs = super().update_from_output(scheduler_output, model_runner_output, **kwargs)
        self.prefill_s_per_token.step_done(self.clock())
        if self.telemetry.enabled:
            self._first_tokens(outputs)
        finished = finished_request_ids(outputs)
        if finished:
            self.on_requests_finished(finished)
        return outputs

    def finish_requests(self, request_ids: Any, finished_status: RequestStatus,
                        **kwargs: Any) -> list[Request]:
        """vLLM: finish requests from outside (abort). A held one (:meth:`held_requests`) is
        finished by vLLM's own path too: it leaves its hold in :meth:`_free_request`."""
        if request_ids is not None and not isinstance(request_ids, str):
            request_ids = list(request_ids)  # may be a one-shot iterator; vLLM reads it too
        if self.retained and request_ids is not None:
            self._release_aborted_after_finish(request_ids)
        aborted = super().finish_requests(request_ids, finished_status, **kwargs)
        if aborted:
            self.on_requests_finished([r.request_id for r in aborted])
        return aborted

    def held_requests(self) -> Iterator[Request]:
        """Requests this scheduler holds outside vLLM's queues: in ``self.requests`` but in
        neither ``waiting`` nor ``running`` (here the window's overflow; a subclass with holds
        of its own adds them and extends :meth:`drop_held`). Pure."""
        return iter(self.overflow)

    def drop_held(self, request: Request) -> None:
        """Take ``request`` out of every hold of :meth:`held_requests` (no-op when not held).
        Called for every request that finishes (:meth:`_free_request`). Mutates."""
        if self.overflow and request in self.overflow:
            self.overflow.remove(request)

    def get_request_counts(self, **kwargs: Any) -> tuple[int, int]:
        """vLLM: (running, waiting); waiting includes the overflow window queue."""
        num_running, num_waiting = super().get_request_counts(**kwargs)
        return num_running, num_waiting + len(self.overflow)

    def reset_prefix_cache(self, reset_running_requests: bool = False, *args: Any,
                           **kwargs: Any) -> bool:
        """vLLM: reset the prefix cache (``POST /reset_prefix_cache``; ``pause_scheduler(
        clear_cache=True)`` after an RL weight update). Retained KV is released first (reason
        ``"reset"``) when the reset can succeed (``reset_running_requests``, or nothing runs):
        vLLM resets only a cache whose blocks no one references, so our pins made it fail, and
        raise with ``reset_running_requests`` (issue 33); KV computed before a weight update
        must not be reused anyway."""
        if self.retained and (reset_running_requests or not self.running):
            now = self.clock()
            for sid in list(self.retained):
                self.release_retained(sid, "reset", now)
        return super().reset_prefix_cache(reset_running_requests, *args, **kwargs)

    def shutdown(self, **kwargs: Any) -> None:
        """vLLM: release every retained block, close telemetry and the inbox."""
        now = self.clock()
        for sid in list(self.retained):
            self.release_retained(sid, "shutdown", now)
        self.telemetry.close()
        self.waker.stop()
        self.inbox.close()
        super().shutdown(**kwargs)

    # ------------------------------------------------------------------ seams
    def _free_blocks(self, request: Request, **kwargs: Any) -> None:
        """vLLM seam: a finished request's blocks are about to be freed; maybe pin them first."""
        self.on_request_finishing(request)
        now = self.clock()
        rid = request.request_id
        state = self.req_state.pop(rid, None)
        self._rejected.pop(rid, None)
        num_blocks = seams.blocks.num_request_blocks(self, rid)
        retained = 0
        self.prefilling.discard(rid)
        session = self.sessions.get(state.session_id) if state and state.session_id else None
        if session is not None:
            session.active_request_ids.discard(rid)
            session.attained_service_tokens += request.num_computed_tokens
            session.last_activity_s = now
            if request.status in _RETAINABLE and not state.meta.is_side:
                session.num_turns_finished += 1
                session.last_finish_s = now
                session.last_context_tokens = request.num_tokens
                session.reuse_checkpoints = context_checkpoints(request.block_hashes)
                session.num_context_blocks = len(request.block_hashes)
                if not state.meta.is_last_step:
                    retained = self._maybe_retain(request, state, session, now)
        super()._free_blocks(request, **kwargs)
        if self.telemetry.enabled and state is not None:
            reason = request.get_finished_reason()
            self.telemetry.finished(
                rid, state.session_id, state.meta.turn, num_prompt_tokens=request.num_prompt_tokens,
                num_output_tokens=request.num_output_tokens,
                num_blocks_freed=max(0, num_blocks - retained), num_blocks_retained=retained,
                finish_reason=None if reason is None else str(reason), e2e_s=now - state.arrival_s,
            )

    def _free_request(self, request: Request, *args: Any, **kwargs: Any) -> Any:
        """vLLM seam: a request finishes (every way: a stop, ``max_tokens`` or an error in
        ``update_from_output``, an abort in ``finish_requests``); it leaves our holds first.

        Why here: a request can finish while held. Under async scheduling a request preempted
        with its last token in flight (mars then holds it, residency) gets that token from the
        step's output; vLLM stops it and removes it from its *own* queues only. Left in the
        hold, it would be put back into ``waiting`` later and ``schedule()`` would raise
        ``Invalid request status: FINISHED_*`` (issue 33). Every finish passes here, whatever
        the status, so no hold keeps a finished request."""
        self.drop_held(request)
        return super()._free_request(request, *args, **kwargs)

    def _preempt_request(self, request: Request, *args: Any, **kwargs: Any) -> None:
        """vLLM seam: preempt (recompute) ``request``; adds telemetry and the policy hook."""
        num_blocks = seams.blocks.num_request_blocks(self, request.request_id) if self.telemetry.enabled else 0
        num_computed = request.num_computed_tokens
        super()._preempt_request(request, *args, **kwargs)
        self.prefilling.discard(request.request_id)
        self.on_preempted(request)
        if self.telemetry.enabled:
            state = self.req_state.get(request.request_id)
            self.telemetry.preempted(
                request.request_id, state.session_id if state else None,
                state.meta.turn if state else None, num_blocks, num_computed,
            )

    # ------------------------------------------------------------------ step phases
    def _reorder(self, now: float) -> None:
        if self._uses_chunk_hook and not self._model_needs_mamba_split:
            # Every prefill chunk comes from a waiting admission or a running prefill.
            seams.hooks.enable_chunk_hook(self, bool(self.prefilling or self.waiting))
        if self._has_waiting_key and len(self.waiting) > 1 and (
            self.waiting.is_dirty or now - self._last_waiting_sort_s >= self.params.reorder_interval_s
        ):
            self.waiting.reorder(lambda r: self.waiting_key(r, now))
            self._last_waiting_sort_s = now
        may_fail = None
        if self._has_running_key and len(self.running) > 1:
            may_fail = self._allocation_may_fail()
            if self.prefilling or may_fail:
                self.running.sort(key=lambda r: self.running_key(r, now))
        if self._has_victim_key and self.running and (
            may_fail if may_fail is not None else self._allocation_may_fail()
        ):
            self._saved_priorities = seams.hooks.set_victim_ranks(
                sorted(self.running, key=lambda r: self.victim_key(r, now), reverse=True)
            )

    def _allocation_may_fail(self) -> bool:
        """Cheap bound: if every running request plus a full budget of new tokens fits in the free
        blocks, no allocation can fail this step and victim ranks are not needed."""
        budget_blocks = -(-seams.hooks.max_num_scheduled_tokens(self) // self.block_size)
        partial_blocks = len(self.running) + min(len(self.waiting), seams.hooks.max_num_running_reqs(self))
        return seams.blocks.num_free_blocks(self) < budget_blocks + partial_blocks

    def _after_schedule(self, out: Any, now: float, stamp_s: float,
                        was_running: set[str] | None) -> None:
        scheduled = out.num_scheduled_tokens
        new_ids = [d.req_id for d in out.scheduled_new_reqs]
        for rid in new_ids:
            state = self.req_state.get(rid)
            if state is None:
                continue
            if state.first_scheduled_s is None:
                state.first_scheduled_s = now
                self._on_first_scheduled(rid, state, scheduled.get(rid, 0), now)
            sid = state.session_id
            if sid is not None and sid in self.retained and not state.meta.is_side:
                self._measure_reuse(self.retained[sid], rid)
                self.release_retained(sid, "resumed", now)  # the hit already took its references
        if self._has_on_scheduled and was_running is not None:
            for rid, n in scheduled.items():
                request = self.requests.get(rid)
                if request is not None:
                    self.on_scheduled(request, n, rid in was_running, stamp_s)
        if self._step_prefills:
            self._after_prefills(scheduled, set(new_ids), out, now)

    def _after_prefills(self, scheduled: dict[str, int], new_ids: set[str], out: Any,
                        now: float) -> None:
        resumed = out.scheduled_cached_reqs.resumed_req_ids
        for rid in self._step_prefills:
            n = scheduled.get(rid)
            request = self.requests.get(rid)
            if n is None or request is None:
                continue
            if request.is_prefill_chunk:
                self.prefilling.add(rid)
            else:
                self.prefilling.discard(rid)
            if self._has_on_prefill:
                was_running = rid not in new_ids and rid not in resumed
                self.on_prefill_scheduled(request, n, was_running, now)
            state = self.req_state.get(rid)
            if state is not None:
                state.quantum_tokens = None

    def _reject_invalid(self) -> None:
        for rid, message in list(self._rejected.items()):
            request = self.requests.get(rid)
            if request is None or request.is_finished():
                self._rejected.pop(rid, None)
                continue
            logger.warning("mars: rejecting request %s: %s", rid, message)
            self.waiting.remove_request(request)
            seams.hooks.finish_with_error_next_step(self, rid, message)

    def _admit_overflow(self) -> None:
        assert self.window_size is not None, "overflow queue used without a window"
        while self.overflow and len(self.running) + len(self.waiting) < self.window_size:
            request = self.overflow.popleft()
            state = self.req_state.get(request.request_id)
            if state is not None:
                reset_mlfq(state)
            self.waiting.add_request(request)
