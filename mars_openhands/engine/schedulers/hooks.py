"""``PolicyHooks``: the surface a scheduling policy overrides on :class:`MarsBaseScheduler`.

Mental model: the base scheduler (``base.py``) owns the mechanics (vLLM's ``schedule()``, the
retained-KV pool, sessions, the CPU-event inbox, telemetry) and asks the policy at narrow points;
each hook a subclass overrides should call one ``policy`` function (docs/structure.md). Every
default is stock vLLM's behaviour, and the ordering hooks' defaults raise instead of answering:
the base checks which hooks a class overrides (:func:`is_overridden`) and calls only those, so
a policy that overrides nothing costs nothing per step.

=====================================  ==========================================================
hook                                   default (stock vLLM behaviour)
=====================================  ==========================================================
``waiting_key(request, now_s)``        not overridden -> FCFS order kept
``running_key(request, now_s)``        not overridden -> order kept (victim = last, stock)
``victim_key(request, now_s)``         not overridden -> stock victim; else argmax key evicted
``chunk_tokens(request, n, start)``    not overridden -> n
``retention_decision(request, s, t)``  None (no retention)
``refine_retention(entry, s, tool, t)``None (keep the provisional decision)
``can_release_expired(entry, t)``      True
``can_reclaim_for(entry, request, t)`` True (every other session's entry may be reclaimed)
``reclaim_key(entry, request, t)``     (value per block, newest first): on a failed allocation the
                                       allowed entry with the smallest key is reclaimed first
``on_request_added(request)``          no-op; a new request, after the base took it in (its state,
                                       session, the window's overflow; a rejected one too)
``cached_tokens_at_arrival(request)``  0; the prefix hit a new request finds at arrival (its
                                       ``RequestState.cached_at_arrival_tokens``)
``on_request_finishing(request)``      no-op; every finishing request, before the base's
                                       bookkeeping and retention and before vLLM frees its blocks
``on_prefill_scheduled(request, n, was_running, now_s)``  no-op; after schedule, per scheduled
                                       prefill chunk (cheap: O(prefills) per step)
``on_scheduled(request, n, was_running, now_s)``  no-op; per scheduled request, O(running) per
                                       step, only called if overridden (avoid on the hot path)
``on_preempted(request)``              no-op
``on_step_start(now_s)``               not overridden -> not called; once per step after the
                                       inbox is drained, before vLLM's schedule() (a policy
                                       that moves requests in or out of ``waiting``)
``on_requests_finished(ids)``          no-op; finished or aborted requests, after vLLM applied
                                       them (per-call bookkeeping: Autellix, Continuum)
=====================================  ==========================================================

Contracts: key hooks return any totally ordered value and must not mutate; the ``on_*`` hooks
may mutate the policy's own state; none may raise on a valid request.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from mars_openhands.policy.retention import reclaim_order_key

if TYPE_CHECKING:
    from vllm.v1.request import Request

    from mars_openhands.engine.schedulers.retained import RetainedKv
    from mars_openhands.policy.retention import RetentionDecision
    from mars_openhands.policy.session import SessionState

__all__ = ["PolicyHooks", "is_overridden"]


def is_overridden(cls: type, name: str) -> bool:
    """Whether ``cls`` overrides the :class:`PolicyHooks` hook ``name``. Pure.

    Raises:
        AttributeError: ``name`` is not a hook.
    """
    return getattr(cls, name) is not getattr(PolicyHooks, name)


class PolicyHooks:
    """The policy hooks, with stock vLLM's behaviour as defaults (see the module docstring).

    A mixin: :class:`~mars_openhands.engine.schedulers.base.MarsBaseScheduler` inherits it before
    vLLM's ``AsyncScheduler``; it holds no state.
    """

    def waiting_key(self, request: Request, now_s: float) -> Any:
        """Sort key of a waiting request (smallest first). Default: FCFS (not called)."""
        raise NotImplementedError

    def running_key(self, request: Request, now_s: float) -> Any:
        """Sort key of a running request (smallest scheduled first). Default: keep order."""
        raise NotImplementedError

    def victim_key(self, request: Request, now_s: float) -> Any:
        """Preemption key; the largest is evicted first. Default: vLLM's (last running)."""
        raise NotImplementedError

    def chunk_tokens(self, request: Request, num_new_tokens: int, num_computed_tokens: int) -> int:
        """Tokens to schedule for ``request`` this step (<= num_new_tokens, >= 1).

        ``num_computed_tokens`` includes this step's prefix-cache hit for a waiting request.
        """
        return num_new_tokens

    def retention_decision(
        self, request: Request, session: SessionState, now_s: float
    ) -> RetentionDecision | None:
        """Whether to retain a finished non-final turn's KV, and for how long. Default: never."""
        return None

    def refine_retention(
        self, entry: RetainedKv, session: SessionState, tool_name: str, now_s: float
    ) -> RetentionDecision | None:
        """At ``tool_start``: a new decision (ttl 0 = release now), or None to keep. Default None."""
        return None

    def can_release_expired(self, entry: RetainedKv, now_s: float) -> bool:
        """Whether an expired entry may be released now. Default: yes."""
        return True

    def can_reclaim_for(self, entry: RetainedKv, request: Request, now_s: float) -> bool:
        """Whether ``entry`` may be reclaimed because ``request``'s allocation failed.
        Default: yes (never the requesting session's own entry; the base filters that)."""
        return True

    def reclaim_key(self, entry: RetainedKv, request: Request, now_s: float) -> Any:
        """Reclaim order of the retained entries of other sessions when ``request``'s allocation
        fails: the smallest key among those :meth:`can_reclaim_for` allows goes first (ties: the
        pool's order). Default: lowest value per block
        (:func:`~mars_openhands.policy.retention.reclaim_order_key`), then the most recently
        retained. Pure."""
        return (reclaim_order_key(entry.value_s, entry.num_blocks), -entry.retained_s)

    def cached_tokens_at_arrival(self, request: Request) -> int:
        """Prefix-cache hit tokens of a new request at its arrival, recorded in its
        ``RequestState`` (MARS ranks by the uncached work). Default: 0 (not measured). Pure."""
        return 0

    def on_request_finishing(self, request: Request) -> None:
        """A request finishes (any status: ``request.status`` says how), before the base's
        bookkeeping, its retention decision and vLLM's freeing of its blocks. Default: no-op."""

    def on_request_added(self, request: Request) -> None:
        """A new request, after the base took it in: its ``req_state``, its session, the window
        (it may sit in the overflow queue), telemetry; a request with invalid extras too (it is
        finished at the next step). Not called for a streaming-input continuation (same id).
        Default: no-op."""

    def on_scheduled(
        self, request: Request, num_tokens: int, was_running: bool, now_s: float
    ) -> None:
        """Called after ``schedule()`` for each scheduled request (only if overridden; O(running))."""

    def on_prefill_scheduled(
        self, request: Request, num_tokens: int, was_running: bool, now_s: float
    ) -> None:
        """Called after ``schedule()`` for each scheduled prefill chunk (``was_running``: it was
        already running before this step, i.e. not admitted from the waiting queue)."""

    def on_preempted(self, request: Request) -> None:
        """Called when vLLM preempts ``request`` (after its blocks were freed)."""

    def on_step_start(self, now_s: float) -> None:
        """Called once per step before vLLM's ``schedule()`` (only if overridden), after the inbox
        was drained and expired KV released; may add requests to or remove them from
        ``self.waiting``."""


    def on_requests_finished(self, request_ids: list[str]) -> None:
        """Hook: requests that finished in this step's output or were aborted. Default: nothing.

        Called after vLLM has applied the output (or the abort); subclasses fold per-call
        bookkeeping into their programs here (Autellix, Continuum).
        """

