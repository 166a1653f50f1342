"""``AutellixScheduler``: Autellix PLAS on stock vLLM (arXiv 2502.13965 §4; design.md §5).

Program-level least-attained-service with MLFQ levels, as MARS ran it (policy:
:mod:`mars_openhands.policy.plas`, whose docstring has the formulas and parameters). Each hook
calls one policy function:

=========================  ==================================================================
hook                       policy
=========================  ==================================================================
``add_request``            :func:`plas.new_call` (arrival level from the program's service)
``schedule`` (before)      :func:`plas.should_promote` / :func:`plas.promote` (anti-starvation)
``waiting_key``            ``(level, FIFO order)``: one FIFO per level, preempted at the front
``running_key``            :func:`plas.running_order_key` ``(level, arrival)``
``chunk_tokens``           :func:`plas.step_token_cap` (a prefill chunk is capped by the quantum)
``on_scheduled``           :func:`plas.on_scheduled` (charge tokens, demote on a used quantum)
``schedule`` (after)       :func:`plas.accrue_wait` (tokens scheduled for others)
``victim_key``             :func:`plas.victim_key` ``(level, KV blocks held, arrival)``
finish / abort             :func:`plas.on_call_finished` (fold into the program's service)
=========================  ==================================================================

A program is a session (``Request.session_id``); a request without one is a one-call program.
A program's attained service between its calls lives in its session's ``program`` slot
(:class:`~mars_openhands.engine.schedulers.sessions.SessionTable`); it is dropped after its last
call (``mars_last_step=1``), at ``session_end``, or with the session when the base class forgets
it idle.

Difference from the MARS preview: the preview computed "work left" from tokens already known
(prompt and sampled tokens) only, so with synchronous scheduling a decoding call was never demoted
(its quantum was just refilled). Autellix charges decode service too (§4: attained service
includes decode), so here a decoding call with output still to generate is demoted once its
decode tokens use up the quantum.

``--additional-config '{"mars": {"autellix": {...}}}'`` (see docs/schedulers.md).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, replace
from typing import Any, ClassVar

from vllm.v1.request import Request

from mars_openhands.engine import seams
from mars_openhands.engine.schedulers.base import MarsBaseScheduler
from mars_openhands.engine.schedulers.coalesce import (
    CertifiedRuns,
    HeadRule,
    head_rule_without_hit_cap,
)
from mars_openhands.policy import plas
from mars_openhands.policy.plas import PlasCall, PlasParams, PlasProgram

__all__ = ["AutellixScheduler"]

_NO_PROGRAM = PlasProgram()


@dataclass(slots=True)
class _Call:
    program_id: str
    is_last_step: bool
    plas: PlasCall


class AutellixScheduler(CertifiedRuns, MarsBaseScheduler):
    """Autellix PLAS (program-level attained service, MLFQ, anti-starvation) on stock vLLM.

    Merged runs (:class:`CertifiedRuns`): per step, waiting calls accrue the step's tokens and
    running calls are charged theirs (both additive), and the running order ``(level,
    arrival)`` is constant while no level changes: :meth:`run_max_steps` ends a run before a
    demotion or a promotion. A long call at the last level is charged its level's whole quantum
    each step and refilled (demotion stays at the last level), so its chunk is the same in every
    step (:meth:`prefill_run_chunk_tokens`)."""

    default_resume_when_context_fits: ClassVar[bool] = True
    """A preempted call resumes once its whole context fits (issue 16 kind 4: a long call
    resumed into one finished call's room was preempted again midway through its re-prefill)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.plas_params: PlasParams = self.params.autellix
        self._budget_tokens = seams.hooks.max_num_scheduled_tokens(self)
        self._calls: dict[str, _Call] = {}

    # ------------------------------------------------------------------ read access
    def plas_call(self, request_id: str) -> PlasCall | None:
        """PLAS state of a call still in the engine, else None. Pure."""
        entry = self._calls.get(request_id)
        return entry.plas if entry else None

    def plas_program(self, program_id: str) -> PlasProgram | None:
        """Attained service / wait of a program between its calls, else None. Pure."""
        return self.sessions.program(program_id)

    def _program(self, program_id: str) -> PlasProgram:
        """The program's PLAS state (a fresh one for a new or session-less program). Pure."""
        program = self.sessions.program(program_id)
        return _NO_PROGRAM if program is None else program

    # ------------------------------------------------------------------ request lifecycle
    def on_request_added(self, request: Request) -> None:
        """Base hook: a new call arrives at the level of its program's attained service."""
        state = self.req_state.get(request.request_id)
        program_id = request.session_id or request.request_id
        program = self._program(program_id)
        self._calls[request.request_id] = _Call(
            program_id, bool(state and state.meta.is_last_step),
            plas.new_call(program, self.plas_params, self._budget_tokens),
        )

    def schedule(self, *args: Any, **kwargs: Any) -> Any:
        """vLLM: promote starving calls, schedule (base + hooks), then charge waiting."""
        self._promote_starving()
        out = super().schedule(*args, **kwargs)
        total = out.total_num_scheduled_tokens
        if total > 0:
            scheduled = out.num_scheduled_tokens
            for rid, entry in self._calls.items():
                if rid not in scheduled:
                    entry.plas = plas.accrue_wait(entry.plas, total)
        return out

    def on_requests_finished(self, request_ids: list[str]) -> None:
        """Base hook: finished or aborted calls end their bookkeeping (aborted ones count too)."""
        self._finish_calls(request_ids)

    def on_stream_event(self, event: Any, now_s: float | None = None) -> None:
        """Base event handling; ``session_end`` also drops the program's PLAS state."""
        super().on_stream_event(event, now_s)
        if event.kind == "session_end" and event.session_id is not None:
            self.sessions.set_program(event.session_id, None)

    # ------------------------------------------------------------------ merged runs
    def head_rule(self) -> HeadRule:
        """The chunk cap is the call's remaining quantum (:meth:`chunk_tokens`), whatever its hit
        (:func:`head_rule_without_hit_cap`). Pure."""
        return head_rule_without_hit_cap(self.chunk_shrinking)

    def prefill_run_chunk_tokens(self, request: Request) -> int | None:
        """The last level's quantum for a running call at the last level with a full quantum and
        no promotion due, else None. Pure.

        Each single step then caps its chunk at that quantum, charges it (:func:`plas.on_scheduled`:
        the quantum is used with work left, so the call is "demoted" to the last level again with
        a full quantum) and its wait ratio only falls (it is scheduled every step). ::

            level:  max | max | max | ...     chunk: q | q | q | ...   (q = last level's quantum)
        """
        entry = self._calls.get(request.request_id)
        if entry is None:
            return None
        call, params = entry.plas, self.plas_params
        quantum = plas.level_quantum_tokens(call.level, params, self._budget_tokens)
        if (call.level != params.max_level
                or plas.step_token_cap(call, params, self._budget_tokens) != quantum
                or plas.should_promote(call, self._program(entry.program_id), params)):
            return None
        return quantum

    def run_max_steps(self, limit: int, step_tokens: int | None = None) -> int:
        """Most steps (decode tokens each) before a level would change. Pure.

        A running decoding call is demoted at the step it starts with one quantum token left:
        ``k`` single steps keep its level iff ``k <= quantum - 1`` (a running prefill in a merged
        run keeps the last level: :meth:`prefill_run_chunk_tokens`). A waiting call's wait grows
        by the step's tokens (``step_tokens``; default the running count: one token each); the
        check before step ``i + 1`` sees ``i`` steps of it, so a promotion at ``i`` (the first,
        found by bisection: the ratio only grows) ends the run at ``i`` steps.
        """
        k = limit
        for request in self.running:
            entry = self._calls.get(request.request_id)
            if entry is not None and request.num_computed_tokens >= request.num_tokens - 1:
                quantum = entry.plas.quantum_left_tokens
                if quantum <= 0:
                    quantum = plas.level_quantum_tokens(entry.plas.level, self.plas_params,
                                                        self._budget_tokens)
                k = min(k, quantum - 1)
        per_step = len(self.running) if step_tokens is None else step_tokens
        for request in [*self.waiting, *self.overflow]:  # the window's overflow calls wait too
            entry = self._calls.get(request.request_id)
            if entry is None or k <= 1:
                continue
            program = self._program(entry.program_id)
            call = entry.plas

            def promoted_after(i: int, call: PlasCall = call, program: PlasProgram = program) -> bool:
                waited = replace(call, wait_tokens=call.wait_tokens + i * per_step)
                return plas.should_promote(waited, program, self.plas_params)

            if promoted_after(k - 1):
                lo, hi = 1, k - 1  # the first i with a promotion
                while lo < hi:
                    mid = (lo + hi) // 2
                    lo, hi = (lo, mid) if promoted_after(mid) else (mid + 1, hi)
                k = lo
        return max(1, k)

    # ------------------------------------------------------------------ hooks
    def waiting_key(self, request: Request, now_s: float) -> Any:
        """``(level, FIFO order)``; vLLM-prepended (preempted) requests lead their level."""
        entry = self._calls.get(request.request_id)
        return (entry.plas.level if entry else 0, self.waiting.order_of(request))

    def running_key(self, request: Request, now_s: float) -> Any:
        """``(level, arrival)`` (:func:`plas.running_order_key`)."""
        entry = self._calls.get(request.request_id)
        if entry is None:
            return (0, request.arrival_time)
        return plas.running_order_key(entry.plas, request.arrival_time)

    def victim_key(self, request: Request, now_s: float) -> Any:
        """``(level, KV blocks held, arrival)``; the largest is preempted."""
        entry = self._calls.get(request.request_id)
        level_call = entry.plas if entry else PlasCall(level=0, quantum_left_tokens=0)
        num_blocks = seams.blocks.num_request_blocks(self, request.request_id)
        return plas.victim_key(level_call, num_blocks, request.arrival_time)

    def chunk_tokens(self, request: Request, num_new_tokens: int, num_computed_tokens: int) -> int:
        """Cap a prefill chunk at the call's remaining quantum."""
        entry = self._calls.get(request.request_id)
        if entry is None:
            return num_new_tokens
        return min(num_new_tokens,
                   plas.step_token_cap(entry.plas, self.plas_params, self._budget_tokens))

    def on_preempted(self, request: Request) -> None:
        """A preempted call re-enters the waiting queue at the head of its level, not of all."""
        self.waiting.is_dirty = True

    def on_scheduled(self, request: Request, num_tokens: int, was_running: bool, now_s: float) -> None:
        """Charge the step's tokens; demote if the quantum is used up with work left."""
        entry = self._calls.get(request.request_id)
        if entry is None:
            return
        # vLLM has already advanced num_computed_tokens by num_tokens.
        prompt_left = max(0, request.num_tokens - request.num_computed_tokens)
        samples_now = 1 if request.num_computed_tokens >= request.num_tokens else 0
        output_left = max(0, request.max_tokens - request.num_output_tokens - samples_now)
        entry.plas = plas.on_scheduled(entry.plas, num_tokens, prompt_left + output_left,
                                       self.plas_params, self._budget_tokens)

    # ------------------------------------------------------------------ internals
    def _promote_starving(self) -> None:
        for entry in self._calls.values():
            program = self._program(entry.program_id)
            if plas.should_promote(entry.plas, program, self.plas_params):
                entry.plas = plas.promote(entry.plas, self.plas_params, self._budget_tokens)
                self.waiting.is_dirty = True  # a waiting key changed: re-sort this step

    def _finish_calls(self, request_ids: Iterable[str]) -> None:
        for rid in request_ids:
            entry = self._calls.pop(rid, None)
            if entry is None:
                continue
            if entry.program_id == rid:
                continue  # a one-call program: nothing to keep
            program = plas.on_call_finished(self._program(entry.program_id), entry.plas)
            self.sessions.set_program(entry.program_id, None if entry.is_last_step else program)
