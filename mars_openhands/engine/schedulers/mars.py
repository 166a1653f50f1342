"""``MarsScheduler``: our in-engine MARS policy (MARS §4.3; design.md §4 "Our mars policy").

Fixes the preview's weaknesses on the same hooks (docs/schedulers.md has each choice's measurement):

* no MLFQ priority levels by default (``mars.mlfq``: every request is level 0 and gets the whole
  step budget as its prefill quantum; the ablation measured no gain from them with residency on).
  With ``mars.mlfq``: level from the prefill work the turn *adds* (prompt beyond the session's
  previous context, and beyond the prefix hit measured at arrival, which includes retained KV),
  plus the session's attained service, with aging promotion bounded by
  ``mars.max_promotion_levels`` (policy/levels.py), and per-level prefill quanta;
* within a level, program-level FIFO: the oldest session first (``mars.session_fifo``);
* prefill quanta sized for MoE step costs (``mars.quanta_tokens``), then chunk shrinking down to
  block granularity when KV would not fit;
* victim ``argmax (level', session arrival, arrival)`` (decode ``level' = -1``): the youngest
  session goes first;
* KV retention at the end of a non-final turn by the value model (policy/retention.py), with the
  provisional TTL refined at ``tool_start`` by that tool's duration CDF, kept for the imminent turn
  at ``tool_end``, released at ``session_end``; reclaimed before any preemption, lowest value first,
  a younger session's always, an older session's only once its value no longer pays for its
  remaining TTL at the current shadow price.

No in-engine admission window by default (the gateway admits whole sessions); set
``mars.window.enabled`` to use one.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterator
from typing import Any, ClassVar

from vllm.v1.request import Request, RequestStatus

from mars_openhands.engine import seams
from mars_openhands.engine.schedulers.base import MarsBaseScheduler, RetainedKv
from mars_openhands.engine.schedulers.coalesce import RUN_MARGIN_S, CertifiedRuns
from mars_openhands.engine.schedulers.host_tier import host_reload
from mars_openhands.engine.schedulers.request_state import update_mlfq_feedback
from mars_openhands.policy.estimators import EmpiricalCdf
from mars_openhands.policy.levels import DECODE_VICTIM_LEVEL, mars_level
from mars_openhands.policy.residency import (
    SessionDemand,
    displace_value_s,
    output_reserve_tokens,
    plan_residency,
    response_ratio_priority,
)
from mars_openhands.policy.retention import (
    RetentionDecision,
    choose_ttl,
    is_reclaimable_by_value,
)
from mars_openhands.policy.session import SessionState
from mars_openhands.policy.victim import victim_key

__all__ = ["MarsScheduler"]


class MarsScheduler(CertifiedRuns, MarsBaseScheduler):
    """Our MARS internal scheduler (program-level FIFO, KV residency and retention; MLFQ levels
    with ``mars.mlfq``).

    Merged runs (:class:`CertifiedRuns`; decode runs only, no prefill run; with vLLM's host KV
    tier, ``mars-offload``, unless :attr:`merges_gpu_only_runs`): in a run every running
    request decodes, so its level is 0 (with ``mars.mlfq`` too), its running key is constant and no
    MLFQ clock or feedback moves (``on_prefill_scheduled`` sees no chunk); retention is decided at a
    finish or an event (none inside a run) and expires on the base class's timer. What is left is
    the residency plan of every step (``on_step_start``), which a run must leave doing nothing in
    each of its steps (the first included: the merged call runs it with the waiting queue hidden):
    :meth:`_is_residency_quiet` proves that without the plan's clocks (held sessions' response
    ratios, idle residents' displacement values), :meth:`run_max_steps` ends the run before the
    decode growth of the busy sessions would suspend an idle resident, and :meth:`run_until_s`
    before a held turn becomes overdue."""

    default_window_enabled: ClassVar[bool] = False
    default_chunk_shrinking: ClassVar[bool] = True
    default_resume_when_context_fits: ClassVar[bool] = True
    merges_gpu_only_runs: ClassVar[bool] = False
    """Merge blocked decode runs without a host KV tier too. Off: GPU-only mars keeps one
    ``schedule()`` per blocked step (its steady runs merge as before), so its golden runs, which
    hash the ``schedule()`` calls and every ``engine_step`` snapshot, stay what they were. On,
    they are the same run (every other event and every turn's times equal; fewer calls and
    snapshots: ``tests/unit/eval/test_sim_fast_paths.py``)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.resident: set[str] = set()
        """Sessions whose KV is resident (policy/residency.py)."""
        self.held: dict[str, deque[Request]] = {}
        """Requests of non-resident sessions, held outside vLLM's waiting queue."""
        self.held_at_s: dict[str, float] = {}
        """When each held session began its current wait for residency (engine clock, s)."""
        self.past_held_s: dict[str, float] = {}
        """Seconds each live session waited held before its current wait
        (``residency.count_past_waits``)."""
        self.num_suspensions = 0
        self.output_tokens = EmpiricalCdf(self.params.retention.max_samples_per_tool)
        """Output lengths of finished turns: a request's decode reserve is its expected
        remaining output given what it has generated."""
        self.host_reload = host_reload(self.vllm_config, self.kv_cache_config)
        """vLLM's host KV tier's reload cost, or None (GPU KV only): a displaced session's cold
        resume then loads its stored blocks instead of re-prefilling them."""
        self.host_prompt_tokens: dict[str, int] = {}
        """With the tier: session -> prompt tokens of its last finished turn (vLLM stores a
        turn's computed prompt blocks, ``offload_prompt_only``), dropped at ``session_end``."""

    # ------------------------------------------------------------------ residency
    @property
    def _residency_on(self) -> bool:
        return self.params.residency.enabled

    def on_request_added(self, request: Request) -> None:
        """Base hook: a non-resident session's new request is held (see residency). (A
        streaming-input chunk of a known request, same id, is vLLM's alone: the base calls no
        hook for it.)"""
        sid = request.session_id
        if (not self._residency_on or sid is None or sid in self.resident
                or request.request_id in self._rejected or request.is_finished()):
            return
        if self._is_one_turn_job(request, sid):
            # Nothing to keep after it (its first turn is its last): it is a busy resident for
            # as long as it runs, then leaves the set with its blocks (on_step_start).
            self.resident.add(sid)
            return
        self.waiting.remove_request(request)
        self.held.setdefault(sid, deque()).append(request)
        self.held_at_s.setdefault(sid, self.clock())

    def _is_one_turn_job(self, request: Request, sid: str) -> bool:
        """The request is its session's first turn and says it is the last (``mars_last_step``):
        a one-turn job (e.g. a long-context completion among agents) has no working set."""
        state = self.req_state.get(request.request_id)
        session = self.sessions.get(sid)
        return (state is not None and bool(state.meta.is_last_step) and not state.meta.is_side
                and session is not None and session.num_turns_finished == 0 and sid not in self.held)

    def on_request_finishing(self, request: Request) -> None:
        """Base hook: a finished turn's output length feeds the output-length estimate (before
        the base's retention decision reads it)."""
        if request.status in (RequestStatus.FINISHED_STOPPED, RequestStatus.FINISHED_LENGTH_CAPPED):
            self.output_tokens.observe(float(request.num_output_tokens))
            if self.host_reload is not None and request.session_id is not None:
                self.host_prompt_tokens[request.session_id] = request.num_prompt_tokens

    def _blocks(self, tokens: int) -> int:
        return -(-tokens // self.block_size)

    def _output_reserve_tokens(self, request: Request, num_steps: int = 0) -> int:
        """Decode growth to reserve for ``request`` (``num_steps`` decode tokens from now), tokens
        (:func:`~mars_openhands.policy.residency.output_reserve_tokens`, from the output lengths
        of the engine's finished turns)."""
        num_generated = request.num_output_tokens + num_steps
        return output_reserve_tokens(num_generated, self.output_tokens.mean_remaining_s(num_generated),
                                     self.params.residency.output_reserve_tokens, request.max_tokens)

    def _demand(self, sid: str, session: SessionState | None, num_steps: int = 0) -> tuple[int, bool]:
        """(demand blocks, is_busy) of one session, ``num_steps`` decode steps from now (each
        running request one token longer per step). O(its requests)."""
        held = self.held.get(sid)
        if held:
            # A preempted turn (held again) has generated part of its output already: reserve
            # only what is expected beyond that, as for a busy request.
            first = held[0]
            return self._blocks(first.num_tokens + self._output_reserve_tokens(first)), False
        blocks = 0
        busy = False
        if session is not None:
            for rid in session.active_request_ids:
                r = self.requests.get(rid)
                if r is None:
                    continue
                busy = True
                grown = num_steps if num_steps and r.status == RequestStatus.RUNNING else 0
                blocks += self._blocks(r.num_tokens + grown + self._output_reserve_tokens(r, grown))
            if not busy:
                entry = self.retained.get(sid)
                blocks = entry.num_blocks if entry is not None else 0
        return blocks, busy

    def _residency_sessions(self, num_steps: int = 0) -> tuple[list[tuple[str, SessionState | None, int, bool]],
                                                                  list[str]]:
        """What the residency plan of the step ``num_steps`` decode steps from now sees: each
        session's ``(id, session, demand blocks, is_busy)`` in the plan's input order, and the
        residents it drops first (no session record, or idle with no KV to keep). Pure."""
        views: list[tuple[str, SessionState | None, int, bool]] = []
        dropped: list[str] = []
        # sorted: a set's order follows the per-process string hash (runs differed between processes)
        for sid in sorted(self.resident) + [h for h in self.held if h not in self.resident]:
            session = self.sessions.get(sid)
            if session is None and sid not in self.held:
                dropped.append(sid)
                continue
            demand, busy = self._demand(sid, session, num_steps)
            if not busy and sid not in self.held and sid not in self.retained:
                # An idle resident without KV (its final turn is done, or its KV was released)
                # has nothing to keep: its next turn, if any, is held and activated by priority.
                dropped.append(sid)
                continue
            views.append((sid, session, demand, busy))
        return views, dropped

    def _residency_budget_blocks(self) -> int:
        """KV blocks the resident set may use: ``budget_usage`` of the pool, less the demand of
        the other residents of a shared pool (the :attr:`kv_pool_peers` that plan residency
        too), so N replicas on one pool plan one pool's worth between them. Pure."""
        budget = int((seams.blocks.num_gpu_blocks(self) - 1) * self.params.residency.budget_usage)
        for peer in self.kv_pool_peers:
            if peer is not self and isinstance(peer, MarsScheduler) and peer._residency_on:
                budget -= peer.resident_demand_blocks()
        return max(0, budget)

    def adopt_session(self, peer: MarsBaseScheduler, session_id: str) -> None:
        """As the base; a resident of ``peer`` stays resident here (its KV is still pinned, now
        by this scheduler), instead of being held as a new session, and its past waits for
        residency come along."""
        super().adopt_session(peer, session_id)
        if not isinstance(peer, MarsScheduler):
            return
        if session_id in peer.resident:
            peer.resident.discard(session_id)
            self.resident.add(session_id)
        if (past := peer.past_held_s.pop(session_id, None)) is not None:
            self.past_held_s[session_id] = past

    def resident_demand_blocks(self) -> int:
        """Blocks the resident sessions' demand counts now (what this scheduler's residency plan
        holds against its budget). O(residents). Pure."""
        return sum(self._demand(sid, self.sessions.get(sid))[0] for sid in self.resident)

    def on_step_start(self, now_s: float) -> None:
        """Plan the resident set and apply it (suspend idle residents, activate held sessions)."""
        if not self._residency_on or not (self.held or self.resident):
            return
        sessions, dropped = self._residency_sessions()
        for sid in dropped:
            self.resident.discard(sid)
        num_busy = sum(busy for _, _, _, busy in sessions)
        views = [SessionDemand(
            sid, self._residency_priority(sid, session, now_s), demand,
            is_resident=sid in self.resident, is_busy=busy, is_held=sid in self.held,
            displace_value_s=self._displace_value_s(session, demand, num_busy, now_s)
            if self.held and not busy and sid in self.resident else 0.0,
            is_overdue=sid in self.held and self._is_overdue(self.held[sid][0], now_s))
            for sid, session, demand, busy in sessions]
        # With the host tier a displaced idle resident resumes by a host load, not a re-prefill:
        # age may displace it (fifo's protection of old sessions) under the response ratio too.
        plan = plan_residency(views, self._residency_budget_blocks(),
                              displaces_by_age=self.host_reload is not None)
        for sid in plan.suspend:
            self._suspend(sid, now_s)
        for sid in plan.activate:
            self.resident.add(sid)
            if (held_at := self.held_at_s.pop(sid, None)) is not None:
                self.past_held_s[sid] = self.past_held_s.get(sid, 0.0) + max(0.0, now_s - held_at)
            for request in self.held.pop(sid, ()):
                self.waiting.add_request(request)

    def _residency_priority(self, sid: str, session: SessionState | None, now_s: float) -> tuple[float, ...]:
        """The residency plan's rank key of one session (smaller first): its first arrival
        (``residency.order: fifo``) or :func:`response_ratio_priority` of its held turn."""
        first = session.first_arrival_s if session else now_s
        if self.params.residency.order == "fifo":
            return (first,)
        held = self.held.get(sid)
        state = self.req_state.get(held[0].request_id) if held else None
        since = None if not held else (state.arrival_s if state is not None else now_s)
        residency = self.params.residency
        counts = residency.count_past_waits
        if counts is None:
            counts = self.host_reload is not None
        past = self.past_held_s.get(sid, 0.0) if counts else 0.0
        return response_ratio_priority(now_s, first, since, residency.response_ratio_prior_s, past)

    def _is_overdue(self, request: Request, now_s: float) -> bool:
        """A held turn never scheduled that arrived ``residency.max_hold_s`` ago or more."""
        state = self.req_state.get(request.request_id)
        return (state is not None and request.num_preemptions == 0
                and now_s - state.arrival_s >= self.params.residency.max_hold_s)

    def _displace_value_s(self, session: SessionState | None, demand_blocks: int, num_busy: int,
                          now_s: float) -> float:
        """Seconds a held session gains from an idle resident's blocks minus what it costs
        (:func:`~mars_openhands.policy.residency.displace_value_s`, with this engine's tool
        durations, tool queue wait and measured prefill rate; with a host tier, the load of the
        prompt blocks vLLM stored at its last turn instead of their re-prefill)."""
        host = {}
        if self.host_reload is not None and session is not None:
            num_stored = self.host_prompt_tokens.get(session.session_id, 0) // self.block_size
            host = {"host": self.host_reload, "num_host_blocks": num_stored}
        return displace_value_s(
            session, demand_blocks, num_busy, now_s,
            imminent_grace_s=self.params.retention.imminent_grace_s,
            tool_queue_wait_s=self.tool_queue_wait.value,
            tool_cdf=self.tool_durations.cdf_for,
            block_size=self.block_size, prefill_s_per_token=self.prefill_s_per_token.value, **host)

    def _suspend(self, sid: str, now_s: float) -> None:
        if sid in self.resident:
            self.resident.discard(sid)
            self.num_suspensions += 1
        self.release_retained(sid, "suspended", now_s)

    def get_request_counts(self, **kwargs: Any) -> tuple[int, int]:
        """vLLM: (running, waiting); waiting includes held requests."""
        num_running, num_waiting = super().get_request_counts(**kwargs)
        return num_running, num_waiting + sum(len(q) for q in self.held.values())

    def held_requests(self) -> Iterator[Request]:
        """As the base, plus the requests of non-resident sessions (:attr:`held`)."""
        yield from super().held_requests()
        for queue in self.held.values():
            yield from queue

    def drop_held(self, request: Request) -> None:
        """As the base; a finishing held request (aborted, or preempted with its last token in
        flight, then stopped by it) also leaves :attr:`held`. O(the session's held requests)."""
        super().drop_held(request)
        queue = self.held.get(request.session_id) if self.held else None
        if queue is not None and request in queue:
            queue.remove(request)
            if not queue:
                del self.held[request.session_id]
                self.held_at_s.pop(request.session_id, None)

    def release_retained(self, session_id: str, reason: str, now_s: float | None = None) -> int:
        """As the base; a reclaimed resident is suspended (its KV is gone)."""
        if reason == "reclaimed" and session_id in self.resident:
            self.resident.discard(session_id)
            self.num_suspensions += 1
        return super().release_retained(session_id, reason, now_s)

    def on_stream_event(self, event: Any, now_s: float | None = None) -> None:
        """As the base; ``session_end`` also leaves the resident set."""
        super().on_stream_event(event, now_s)
        if event.kind == "session_end" and event.session_id is not None:
            self.resident.discard(event.session_id)
            self.host_prompt_tokens.pop(event.session_id, None)
            self.held_at_s.pop(event.session_id, None)
            self.past_held_s.pop(event.session_id, None)

    # ------------------------------------------------------------------ merged runs
    def can_merge_run(self) -> bool:
        """With vLLM's host KV tier (or :attr:`merges_gpu_only_runs`): base conditions and a
        residency plan that does nothing now (:meth:`_is_residency_quiet`). Pure."""
        return ((self.host_reload is not None or self.merges_gpu_only_runs)
                and super().can_merge_run() and self._is_residency_quiet(0))

    def run_max_steps(self, limit: int, step_tokens: int | None = None) -> int:
        """Most steps (<= ``limit``) in each of which the residency plan does nothing and whose
        running order merging keeps (:meth:`_run_steps_keeping_running_order`): the first step
        whose plan may act ends the run (1 while a running request is in its prompt: a run of
        ours is decode only). Pure.

        Bisection is exact: a session's demand only grows over a decode run (its context grows a
        token a step, and its reserve ``E[L | L > n] - n`` from integer output lengths, or the
        prior's ``max(prior, 2n) - n``, capped by ``max_tokens``, never drops by more), so a plan
        that suspends an idle resident at step ``i`` suspends one at every later step, and one
        whose held sessions fit nowhere now fits them nowhere later."""
        if any(r.num_computed_tokens < r.num_prompt_tokens for r in self.running):
            return 1
        limit = self._run_steps_keeping_running_order(limit)
        if limit <= 1 or not self._residency_on or not (self.held or self.resident):
            return limit
        if self._is_residency_quiet(limit - 1):
            return limit
        lo, hi = 0, limit - 1  # quiet at step lo, not at step hi: find the first step it acts
        while hi - lo > 1:
            mid = (lo + hi) // 2
            lo, hi = (mid, hi) if self._is_residency_quiet(mid) else (lo, mid)
        return max(1, hi)

    def run_limits_cover_held(self) -> bool:
        """Yes: a run's limits keep every held session held (:meth:`_is_residency_quiet`). Pure."""
        return True

    def run_until_s(self, now_s: float) -> float:
        """Base timers and the first held turn to become overdue (``residency.max_hold_s``: it is
        then activated whether or not it fits). Pure."""
        t = super().run_until_s(now_s)
        if self._residency_on:
            max_hold_s = self.params.residency.max_hold_s
            for queue in self.held.values():
                state = self.req_state.get(queue[0].request_id)
                if state is not None and queue[0].num_preemptions == 0:
                    t = min(t, state.arrival_s + max_hold_s - RUN_MARGIN_S)
        return t

    def _run_steps_keeping_running_order(self, limit: int) -> int:
        """Most steps (<= ``limit``) whose running order a merged call leaves as the single steps
        would. Pure.

        A step sorts the running requests by :meth:`running_key` while one is prefilling or an
        allocation may fail (the free blocks fall below a step's budget plus a block per running
        and waiting request, ``_allocation_may_fail``); the merged call checks once, at the
        run's start and with its waiting queue hidden. Sorted requests stay sorted (decode keys
        do not move within a run; the sort is stable); unsorted ones may only merge the steps
        that surely sort nothing: the free blocks at the start of the last one (``k - 1`` steps'
        new blocks taken) still above the bound with the real waiting queue."""
        if len(self.running) < 2:
            return limit
        now = self.clock()
        keys = [self.running_key(r, now) for r in self.running]
        if all(a <= b for a, b in zip(keys, keys[1:], strict=False)):
            return limit
        if self.prefilling:
            return 1
        bs = self.block_size
        bound = (-(-seams.hooks.max_num_scheduled_tokens(self) // bs) + len(self.running)
                 + min(len(self.waiting), seams.hooks.max_num_running_reqs(self)))
        room = seams.blocks.num_free_blocks(self) - bound  # blocks the run may take before a sort

        def new_blocks(k: int) -> int:
            return sum(-(-(r.num_computed_tokens + k) // bs) - -(-r.num_computed_tokens // bs)
                       for r in self.running)

        if room < 0:
            return 1
        lo, hi = 0, limit - 1  # largest i <= limit - 1 with new_blocks(i) <= room (monotone)
        while lo < hi:
            mid = (lo + hi + 1) // 2
            lo, hi = (mid, hi) if new_blocks(mid) <= room else (lo, mid - 1)
        return max(1, lo + 1)

    def _is_residency_quiet(self, num_steps: int) -> bool:
        """Whether the residency plan of the step ``num_steps`` decode steps from now (each running
        request a token longer per step) surely neither suspends nor activates anyone, whatever
        the clock says to its ranks and displacement values. Pure.

        Residents rank by arrival (no clock): no idle one may overflow the budget beside the
        sessions ranked above it. Held sessions rank by response ratio (a clock) and idle
        residents may be displaced for them by value (a clock), so neither is read: each held
        turn must be too large for the budget even with every idle resident suspended (then
        whichever comes first blocks the rest), none may be overdue now, and a busy resident
        must be there (else the plan's progress rule activates one whatever its size)."""
        if not self._residency_on or not (self.held or self.resident):
            return True
        sessions, _ = self._residency_sessions(num_steps)
        now = self.clock()
        residents = sorted(((self._residency_priority(sid, session, now), demand, busy)
                            for sid, session, demand, busy in sessions if sid in self.resident),
                           key=lambda v: v[0])
        budget = self._residency_budget_blocks()
        used = busy_used = 0
        for _, demand, busy in residents:
            if not busy and used + demand > budget:
                return False  # this idle resident would be suspended
            used += demand
            busy_used += demand if busy else 0
        held = [(sid, demand) for sid, _, demand, _ in sessions
                if sid in self.held and sid not in self.resident]
        if not held:
            return True
        if not any(busy for _, _, busy in residents):
            return False
        return all(demand > budget - busy_used and not self._is_overdue(self.held[sid][0], now)
                   for sid, demand in held)

    # ------------------------------------------------------------------ levels
    def cached_tokens_at_arrival(self, request: Request) -> int:
        """Base hook: the request's prefix hit now (its level counts the uncached work)."""
        return seams.blocks.prefix_hit_tokens(self, request)

    def level(self, request: Request, now_s: float, num_computed_tokens: int | None = None) -> int:
        """Effective MLFQ level of ``request`` now (0 = highest priority; always 0 without
        ``mars.mlfq``). Pure w.r.t. state."""
        if not self.params.mars.mlfq:
            return 0
        state = self.req_state.get(request.request_id)
        computed = request.num_computed_tokens if num_computed_tokens is None else num_computed_tokens
        if state is None or computed >= request.num_prompt_tokens:
            return 0  # decode is level 0 (design.md §4); no need to sum the session's service
        session = self.sessions.get(state.session_id) if state.session_id else None
        since = state.mlfq_last_scheduled_s if state.mlfq_last_scheduled_s is not None else state.arrival_s
        return mars_level(
            num_prompt_tokens=request.num_prompt_tokens, num_computed_tokens=computed,
            num_cached_at_arrival_tokens=state.cached_at_arrival_tokens,
            num_session_context_tokens=state.session_context_tokens,
            session_service_tokens=self.session_service_tokens(session) if session else 0,
            feedback_level=state.feedback_level, wait_s=now_s - since,
            params=self.params.levels, mars=self.params.mars)

    def _session_arrival_s(self, state: Any) -> float:
        """Program-level arrival of the request's session (its own arrival without a session)."""
        if state is None:
            return 0.0
        if self.params.mars.session_fifo and state.session_id:
            session = self.sessions.get(state.session_id)
            if session is not None:
                return session.first_arrival_s
        return state.arrival_s

    def waiting_key(self, request: Request, now_s: float) -> Any:
        """(effective level, preempted/skipped first, session arrival, arrival, FIFO)."""
        state = self.req_state.get(request.request_id)
        order = self.waiting.order_of(request)
        return (self.level(request, now_s), 0 if order < 0 else 1, self._session_arrival_s(state),
                state.arrival_s if state else 0.0, order)

    def running_key(self, request: Request, now_s: float) -> Any:
        """(effective level, session arrival, last scheduled, arrival)."""
        state = self.req_state.get(request.request_id)
        last = state.mlfq_last_scheduled_s if state and state.mlfq_last_scheduled_s is not None else 0.0
        first = self._session_arrival_s(state) if self.params.mars.session_fifo else 0.0
        return (self.level(request, now_s), first, last, state.arrival_s if state else 0.0)

    def victim_key(self, request: Request, now_s: float) -> Any:
        """argmax (level', blocks held, arrival); decode level' = -1. With ``session_fifo`` the
        youngest session goes first (largest session arrival) instead of the largest footprint."""
        state = self.req_state.get(request.request_id)
        is_decode = request.num_computed_tokens >= request.num_prompt_tokens
        level = self.level(request, now_s)
        if self.params.mars.session_fifo:
            return ((DECODE_VICTIM_LEVEL if is_decode else level), self._session_arrival_s(state),
                    state.arrival_s if state else 0.0)
        return victim_key(level, is_decode, seams.blocks.num_request_blocks(self, request.request_id),
                          state.arrival_s if state else 0.0)

    def chunk_tokens(self, request: Request, num_new_tokens: int, num_computed_tokens: int) -> int:
        """Cap a prefill chunk at its level's quantum (shrink-to-fit follows in the base)."""
        level = self.level(request, self.clock(), num_computed_tokens)
        return self.cap_chunk_at_quantum(request, level, num_new_tokens, self.params.mars.quanta_tokens)

    def on_prefill_scheduled(
        self, request: Request, num_tokens: int, was_running: bool, now_s: float
    ) -> None:
        """MLFQ feedback after every scheduled prefill chunk (running or newly admitted); decode
        needs none (it is level 0)."""
        state = self.req_state.get(request.request_id)
        if state is None:
            return
        if self.params.mars.level_from_new_work and request.num_computed_tokens <= state.session_context_tokens:
            state.mlfq_last_scheduled_s = now_s  # still re-prefilling old context: no demotion
            return
        update_mlfq_feedback(state, request, num_tokens, now_s, self.params.levels)

    def on_preempted(self, request: Request) -> None:
        """A preempted request keeps its feedback level; its aging clock restarts now. With
        residency its session is suspended and the request held until it fits again."""
        state = self.req_state.get(request.request_id)
        if state is not None:
            state.mlfq_last_scheduled_s = self.clock()
        sid = request.session_id
        if self._residency_on and sid is not None and sid in self.resident:
            self.resident.discard(sid)
            self.num_suspensions += 1
            self.waiting.remove_request(request)
            self.held.setdefault(sid, deque()).appendleft(request)
            self.held_at_s.setdefault(sid, self.clock())

    # ------------------------------------------------------------------ retention
    def _decide(self, tool_name: str | None, num_tokens: int, num_blocks: int,
                session: SessionState | None = None) -> RetentionDecision | None:
        """The value model's decision; its gain scales with the session's measured reuse (a
        session whose next turns do not keep their context is not retained)."""
        reuse = session.reuse_fraction_ema if session is not None else None
        return choose_ttl(
            self.tool_durations.cdf_for(tool_name), elapsed_s=0.0, num_tokens=num_tokens,
            num_blocks=num_blocks, queue_delay_s=self.queue_delay.value,
            kv_usage=seams.blocks.kv_usage(self), params=self.params.retention,
            reuse_fraction=1.0 if reuse is None else reuse,
        )

    def retention_decision(
        self, request: Request, session: SessionState, now_s: float
    ) -> RetentionDecision | None:
        """Provisional decision at turn end from the pooled tool-duration CDF (next tool unknown)."""
        if self._residency_on:
            if session.session_id not in self.resident:
                return None
            return RetentionDecision(self.params.residency.max_pin_s, float("inf"), "resident")
        if not self.params.retention.enabled:
            return None
        num_blocks = request.num_computed_tokens // self.block_size
        return self._decide(None, num_blocks * self.block_size, num_blocks, session)

    def can_reclaim_for(self, entry: RetainedKv, request: Request, now_s: float) -> bool:
        """Whether ``entry`` may be released so ``request`` can allocate.

        With ``mars.session_fifo`` (default): always when the entry's session is younger than the
        requester's; otherwise only when the entry's value no longer pays for its remaining TTL at
        full-pressure shadow price (an allocation just failed, so KV is the binding constraint:
        usage counts as 1). Without it: always for running work, by that value test for a
        waiting request."""
        if self._residency_on:
            # Residency: only a younger session's pinned KV is taken (and it is suspended).
            owner = self.retention_owner(entry).sessions.get(entry.session_id)
            requester_s = self._session_arrival_s(self.req_state.get(request.request_id))
            return owner is None or owner.first_arrival_s > requester_s
        if self.params.mars.session_fifo:
            # Priority-aligned: a younger session's KV is always taken; an older session's only
            # when it no longer pays for its TTL (else vLLM preempts the youngest running one).
            owner = self.retention_owner(entry).sessions.get(entry.session_id)
            requester_s = self._session_arrival_s(self.req_state.get(request.request_id))
            if owner is None or owner.first_arrival_s > requester_s:
                return True
        elif request.status == RequestStatus.RUNNING:
            return True
        return is_reclaimable_by_value(entry.value_s, entry.expires_s, entry.num_blocks, now_s,
                                       self.params.retention)

    def refine_retention(
        self, entry: RetainedKv, session: SessionState, tool_name: str, now_s: float
    ) -> RetentionDecision | None:
        """At ``tool_start``: re-decide with that tool's CDF; ttl 0 releases ("tool_start:cut")."""
        if self._residency_on:
            return None  # a resident keeps its KV; the residency plan decides
        decision = self._decide(tool_name, entry.num_tokens, entry.num_blocks, session)
        if decision is None:
            return RetentionDecision(0.0, 0.0, "tool_start:cut")
        longer = now_s + decision.ttl_s > entry.expires_s
        return RetentionDecision(decision.ttl_s, decision.value_s,
                                 "tool_start:extend" if longer else "tool_start:shorten")
