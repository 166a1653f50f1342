"""``ThunderAgentScheduler``: ThunderAgent's program-aware scheduler on stock vLLM (arXiv 2602.13692).

Policy and sources: :mod:`mars_openhands.policy.thunderagent` (public code
``ThunderAgent-org/ThunderAgent`` @ ``a7eef77``, ``scheduler/router.py``). The public system is a
router in front of vLLM; here the same decisions run inside the engine, so "the router holds the
request" becomes "the request waits outside vLLM's waiting queue" and "the KV is released" becomes
"the program's pinned KV is unpinned" (it stays in the prefix-cache LRU until evicted).

Program lifecycle (one per session; a session-less request is a one-request program)::

    request arrives ─┬─ program ACTIVE ───────────────▶ vLLM waiting queue (REASONING)
                     ├─ new, fits, no program paused ─▶ admitted, as above
                     └─ otherwise ────────────────────▶ held (program PAUSED, REASONING)
    request finishes ─▶ ACTING (context pinned if ``pin_acting_kv``), or paused if it was marked
    every Δt:  resume (held requests enter vLLM) ─▶ pause ACTING / mark REASONING until it fits
    held ≥ max_wait_s ─▶ resumed by force;  last step / session_end ─▶ program released

==========================  =================================================================
hook                        policy
==========================  =================================================================
``add_request``             :func:`can_admit_new_program` for a program's first request
``on_step_start``           forced admission, then every ``Δt``: :func:`select_resumes`
                            (:func:`remaining_capacity_tokens` with decay) and
                            :func:`select_pauses`
``retention_decision``      pin an ACTIVE, unmarked program's KV while it is ACTING
``on_requests_finished``    REASONING -> ACTING (or paused if marked, released if last)
``_reclaim_for``            allocation failed: unpin the smallest other program first
``on_stream_event``         ``tool_start`` starts the decay clock, ``tool_end`` restarts it,
                            ``session_end`` releases the program
==========================  =================================================================

Tool state: the decay clock ``t`` of an ACTING program starts at its ``tool_start`` (CPU-plane
inbox, forwarded by the gateway) or, without events, at its request's finish; the ACTING phase
itself lasts from the finish to the next request's arrival, as in the router.

``--additional-config '{"mars": {"thunderagent": {...}}}'`` (see docs/schedulers.md).
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from vllm.v1.request import Request

from mars_openhands.engine import seams
from mars_openhands.engine.schedulers.base import MarsBaseScheduler, RetainedKv
from mars_openhands.engine.schedulers.coalesce import CertifiedRuns
from mars_openhands.policy.retention import RetentionDecision, reload_time_s
from mars_openhands.policy.session import SessionState
from mars_openhands.policy.thunderagent import (
    RESUME_GROUP_ACTING,
    RESUME_GROUP_NEW,
    RESUME_GROUP_REASONING,
    PausedProgramView,
    ProgramView,
    ThunderAgentParams,
    can_admit_new_program,
    remaining_capacity_tokens,
    select_pauses,
    select_resumes,
)

__all__ = ["ThunderAgentScheduler"]


@dataclass(slots=True)
class _Program:
    """One LLM program (router ``Program``): its phase, pause state and context."""

    program_id: str
    is_paused: bool = False
    is_reasoning: bool = True
    num_requests: int = 0
    """Requests the program has made (router ``step_count``)."""
    num_tokens: int = 0
    """Context at the last finish (or the pending request's prompt), tokens."""
    request: Request | None = None
    """The program's request while REASONING (in vLLM or held)."""
    acting_since_s: float = 0.0
    """Start of the decay clock (tool start, else the request's finish), scheduler clock."""
    marked_tokens: int | None = None
    """Tokens counted as to-be-released when it was marked for pause; None: not marked."""
    paused_tokens: int = 0
    """Context when it entered the paused pool."""
    last_activity_s: float = 0.0

    def context_tokens(self) -> int:
        """``c``: the live request's tokens while REASONING, else the last finished context."""
        return self.request.num_tokens if self.request is not None else self.num_tokens


class ThunderAgentScheduler(CertifiedRuns, MarsBaseScheduler):
    """ThunderAgent: program-level KV admission, tool-boundary pause, smallest-first resume."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.thunder_params: ThunderAgentParams = self.params.thunderagent
        self.capacity_tokens = self.block_size * seams.blocks.num_gpu_blocks(self)
        """``block_size * num_gpu_blocks``: the KV pool in tokens (the router reads vLLM's
        ``cache_config_info``)."""
        self.active: dict[str, _Program] = {}
        self.paused: dict[str, _Program] = {}
        """The global paused pool (router ``global_waiting_queue``), in pause order."""
        self.held: dict[str, tuple[Request, float]] = {}
        """Requests of paused programs, waiting outside vLLM: request id -> (request, since)."""
        self._program_of: dict[str, tuple[str, bool]] = {}
        """Request id -> (program id, is the program's last step) while it is in the engine."""
        self.marked_tokens = 0
        """Router ``future_paused_tokens``: tokens of marked programs, freed at their finish."""
        self._next_check_s: float | None = None
        self.num_paused = 0
        self.num_forced = 0

    # ------------------------------------------------------------------ requests in and out
    def on_request_added(self, request: Request) -> None:
        """Base hook: a new request is admitted into vLLM's queue or held while its program is
        paused (one with invalid extras is left to the base, which finishes it)."""
        rid = request.request_id
        if rid in self._rejected:
            return
        now = self.clock()
        state = self.req_state.get(rid)
        pid = request.session_id or rid
        self._program_of[rid] = (pid, request.session_id is None
                                 or bool(state and state.meta.is_last_step))
        program = self._program(pid) or _Program(pid)
        program.num_requests += 1
        program.is_reasoning = True
        program.request = request
        program.num_tokens = request.num_prompt_tokens
        program.last_activity_s = now
        if program.is_paused:
            self._hold(request, now)
        elif pid not in self.active:
            self._admit_or_queue(program, now)

    def _admit_or_queue(self, program: _Program, now: float) -> None:
        remaining = remaining_capacity_tokens(self.capacity_tokens, self._views(), self.thunder_params)
        if (can_admit_new_program(program.num_tokens, remaining, bool(self.paused), self.thunder_params)
                or (self._is_idle() and not self.paused)):
            self.active[program.program_id] = program
            return
        self._enter_pool(program)
        assert program.request is not None, "a new program has its first request"
        self._hold(program.request, now)

    def _is_idle(self) -> bool:
        """No program is admitted and nothing runs. Holding a request protects the admitted
        programs' reservations; with none it protects nothing, so an idle engine admits what it
        holds (issue 33: a request whose context plus the buffer exceeded the pool waited
        ``max_wait_s``, 1800 s, on an idle engine; the router's own pool never shrinks below
        its programs, so it does not meet this case). Pure."""
        return not self.active and not self.running

    def _hold(self, request: Request, now: float) -> None:
        self.waiting.remove_request(request)
        self.held[request.request_id] = (request, now)

    def get_request_counts(self, **kwargs: Any) -> tuple[int, int]:
        """vLLM: (running, waiting); waiting includes requests held for a paused program."""
        num_running, num_waiting = super().get_request_counts(**kwargs)
        return num_running, num_waiting + len(self.held)

    def held_requests(self) -> Iterator[Request]:
        """As the base, plus the requests of paused programs (:attr:`held`)."""
        yield from super().held_requests()
        for request, _ in self.held.values():
            yield request

    def drop_held(self, request: Request) -> None:
        """As the base; a finishing (aborted) held request also leaves :attr:`held`."""
        super().drop_held(request)
        self.held.pop(request.request_id, None)

    def on_requests_finished(self, request_ids: list[str]) -> None:
        """Base hook: a finished request turns its program ACTING (paused if marked, released if
        it was the last step)."""
        now = self.clock()
        for rid in request_ids:
            pid, is_last = self._program_of.pop(rid, ("", False))
            program = self._program(pid)
            if program is None or program.request is None or program.request.request_id != rid:
                continue  # not the program's latest request (parallel calls): nothing to track
            request, program.request = program.request, None
            if is_last:
                self._release_program(pid, now)
                continue
            program.is_reasoning = False
            program.num_tokens = request.num_tokens
            program.acting_since_s = now
            program.last_activity_s = now
            if program.marked_tokens is not None:
                self._unmark(program)
                self._pause(program, now)

    # ------------------------------------------------------------------ merged runs
    def can_merge_run(self) -> bool:
        """Base conditions, once the periodic check's clock has started (``on_step_start`` acts
        only at its two timers: :meth:`run_until_s`). Pure."""
        return super().can_merge_run() and self._next_check_s is not None

    def run_until_s(self, now_s: float) -> float:
        """Base timers, the next periodic check and the oldest held request's forced admission."""
        t = super().run_until_s(now_s)
        if self._next_check_s is not None:
            t = min(t, self._next_check_s)
        if self.held:
            _, since = next(iter(self.held.values()))
            t = min(t, since + self.thunder_params.max_wait_s - 1e-6)
        return t

    # ------------------------------------------------------------------ the periodic check
    def on_step_start(self, now_s: float) -> None:
        """Base hook: forced admissions (overdue, or the oldest held request on an idle engine),
        then the periodic resume/pause check every ``Δt``."""
        self._force_overdue(now_s)
        if self.held and self._is_idle():
            self._resume_holder(next(iter(self.held)), now_s)
        if self._next_check_s is None:
            self._next_check_s = now_s + self.thunder_params.scheduler_interval_s
        elif now_s >= self._next_check_s:
            self._next_check_s = now_s + self.thunder_params.scheduler_interval_s
            self.scheduled_check(now_s)

    def scheduled_check(self, now_s: float) -> None:
        """One periodic check (router ``_scheduled_check``): resume, then pause until it fits.

        Mutates the program sets, the held requests and ``self.waiting``.
        """
        self._forget_idle(now_s)
        p = self.thunder_params
        remaining = remaining_capacity_tokens(self.capacity_tokens, self._views(now_s), p,
                                              with_decay=True)
        for pid in select_resumes(self._paused_views(), remaining, p):
            self._resume(self.paused[pid], now_s)
        pauses, marks = select_pauses(self._views(now_s), self.capacity_tokens, self.marked_tokens, p)
        for pid in pauses:
            self._pause(self.active[pid], now_s)
        for pid in marks:
            program = self.active[pid]
            program.marked_tokens = program.context_tokens()
            self.marked_tokens += program.marked_tokens

    def _force_overdue(self, now: float) -> None:
        """Admit by force the programs whose request waited ``max_wait_s`` (oldest first)."""
        bound = self.thunder_params.max_wait_s
        while self.held:
            rid, (_, since) = next(iter(self.held.items()))
            if now - since < bound:
                return
            self.num_forced += 1
            self._resume_holder(rid, now)

    def _resume_holder(self, request_id: str, now: float) -> None:
        """Resume the paused program of held ``request_id`` (its held requests enter vLLM)."""
        request, _ = self.held[request_id]
        program = self.paused.get(self._program_of.get(request_id, (request.session_id or request_id,))[0])
        if program is None:  # not expected: a held request's program is paused
            self._unhold([request_id])
            return
        self._resume(program, now)

    # ------------------------------------------------------------------ pause / resume / release
    def _enter_pool(self, program: _Program) -> None:
        program.is_paused = True
        program.paused_tokens = program.context_tokens()
        self.paused[program.program_id] = program

    def _pause(self, program: _Program, now: float) -> None:
        """Pause an ACTING program (router ``_pause_program``): out of the active set, KV unpinned."""
        self.active.pop(program.program_id, None)
        self._enter_pool(program)
        self.num_paused += 1
        self.release_retained(program.program_id, "reclaimed", now)

    def _resume(self, program: _Program, now: float) -> None:
        """Resume a paused program (router ``_resume_program``): its held request enters vLLM."""
        self.paused.pop(program.program_id, None)
        program.is_paused = False
        self.active[program.program_id] = program
        self._unhold(self._held_of(program.program_id))

    def _held_of(self, program_id: str) -> list[str]:
        return [rid for rid in self.held if self._program_of.get(rid, ("",))[0] == program_id]

    def _unhold(self, request_ids: list[str]) -> None:
        """Move held requests into vLLM's waiting queue (in the order they were held)."""
        for rid in request_ids:
            request, _ = self.held.pop(rid)
            self.waiting.add_request(request)

    def _program(self, program_id: str) -> _Program | None:
        return self.active.get(program_id) or self.paused.get(program_id)

    def _unmark(self, program: _Program) -> None:
        if program.marked_tokens is not None:
            self.marked_tokens = max(0, self.marked_tokens - program.marked_tokens)
            program.marked_tokens = None

    def _release_program(self, program_id: str, now: float) -> None:
        """The program ended (router ``release_program``); a held request still goes to vLLM."""
        program = self.active.pop(program_id, None) or self.paused.pop(program_id, None)
        if program is None:
            return
        self._unmark(program)
        self._unhold(self._held_of(program_id))
        self.release_retained(program_id, "session_end", now)

    def _forget_idle(self, now: float) -> None:
        """Release ACTING programs idle past ``session_idle_timeout_s`` (the router keeps a program
        until its release call; an agent that never sends one would hold its reservation)."""
        timeout = self.params.session_idle_timeout_s
        for program in [*self.active.values(), *self.paused.values()]:
            if program.request is None and now - program.last_activity_s > timeout:
                self._release_program(program.program_id, now)

    # ------------------------------------------------------------------ snapshots
    def _views(self, now_s: float | None = None) -> list[ProgramView]:
        now = self.clock() if now_s is None else now_s
        return [ProgramView(p.program_id, p.context_tokens(), p.is_reasoning,
                            0.0 if p.is_reasoning else now - p.acting_since_s,
                            p.marked_tokens is not None)
                for p in self.active.values()]

    def _paused_views(self) -> list[PausedProgramView]:
        views = []
        for p in self.paused.values():
            group = (RESUME_GROUP_NEW if p.num_requests == 1
                     else RESUME_GROUP_REASONING if p.is_reasoning else RESUME_GROUP_ACTING)
            views.append(PausedProgramView(p.program_id, p.context_tokens(), p.paused_tokens, group))
        return views

    # ------------------------------------------------------------------ KV reservation and events
    def retention_decision(
        self, request: Request, session: SessionState, now_s: float
    ) -> RetentionDecision | None:
        """Pin the finished turn's KV while its ACTIVE, unmarked program runs its tool."""
        program = self.active.get(session.session_id)
        if not self.thunder_params.pin_acting_kv or program is None or program.marked_tokens is not None:
            return None
        value_s = max(reload_time_s(request.num_tokens, self.params.retention), 1e-9)
        return RetentionDecision(self.params.session_idle_timeout_s, value_s, "thunderagent:acting")

    def reclaim_key(self, entry: RetainedKv, request: Request, now_s: float) -> Any:
        """Allocation failed: the smallest other program's KV is unpinned first, the most
        recently pinned among equals (ThunderAgent's pause order). Pure."""
        return (entry.num_blocks, -entry.retained_s)

    def on_stream_event(self, event: Any, now_s: float | None = None) -> None:
        """Base event handling, plus: ``tool_start`` starts an ACTING program's decay clock,
        ``tool_end`` restarts it (the next request is imminent), ``session_end`` releases it."""
        now = self.clock() if now_s is None else now_s
        super().on_stream_event(event, now)
        sid = event.session_id
        if sid is None:
            return
        if event.kind == "session_end":
            self._release_program(sid, now)
            return
        program = self._program(sid)
        if program is not None and not program.is_reasoning and event.kind in ("tool_start", "tool_end"):
            program.acting_since_s = now
            program.last_activity_s = now
