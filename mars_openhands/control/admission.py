"""The gateway's admission controller: wires the pure AIMD window and reorder policies to sessions.

Mental model: the window ``W`` (from :func:`mars_openhands.policy.admission.update_window`, once per
``update_interval_s``) bounds the number of *admitted sessions*. A session's first request (or its
first request after an idle timeout) calls :meth:`AdmissionController.acquire`; with a free slot and
nobody waiting it is admitted at once (the fast path costs a dict lookup), otherwise it waits in the
waiting set until a tick or a release picks it, in the order of
:func:`mars_openhands.policy.reorder.select_admissions`. An admitted session keeps its slot across
turns and tool calls until :meth:`release` (``session_end``, idle timeout, one-turn request done,
replica failure is *not* a release: the session is re-routed and keeps its slot).

With ``enabled=False`` every session is admitted at once, but the window is still computed and
reported, so a baseline run shows what admission *would* have done.

Single-threaded: call everything from the gateway's event loop.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass

from mars_openhands.policy.admission import (
    AdmissionDecision,
    AdmissionParams,
    PressureSnapshot,
    initial_state,
    update_window,
)
from mars_openhands.policy.reorder import (
    ReorderContext,
    ReorderMode,
    ReorderParams,
    WaitingSession,
    select_admissions,
)

__all__ = ["AdmissionController", "AdmissionTimeoutError"]


class AdmissionTimeoutError(TimeoutError):
    """A session waited longer than ``admission_wait_timeout_s`` for a slot."""


@dataclass
class _Waiter:
    view: WaitingSession
    future: asyncio.Future[None]


class AdmissionController:
    """Session admission through the AIMD window.

    Args:
        params: window parameters.
        reorder: waiting-session order parameters.
        enabled: when false, admit every session at once (window still computed).
    """

    def __init__(self, params: AdmissionParams, reorder: ReorderParams, enabled: bool = True) -> None:
        self.params = params
        self.reorder = reorder
        self.enabled = enabled
        self.state = initial_state(params)
        self.last_decision: AdmissionDecision | None = None
        self.last_mode: ReorderMode | None = None
        self.admitted: set[str] = set()
        self._waiting: dict[str, _Waiter] = {}
        self.num_admitted_total = 0
        self.num_timed_out_total = 0

    @property
    def window(self) -> int:
        """Current window W, sessions."""
        return self.state.window

    @property
    def num_waiting(self) -> int:
        """Sessions waiting for a slot."""
        return len(self._waiting)

    def is_admitted(self, session_id: str) -> bool:
        """Query: does the session hold a slot?"""
        return session_id in self.admitted

    def can_admit_now(self) -> bool:
        """Query: would a new session be admitted without waiting?"""
        return not self.enabled or (not self._waiting and len(self.admitted) < self.state.window)

    def try_admit(self, session_id: str) -> bool:
        """Admit the session now if it holds a slot or one is free with nobody waiting (the proxy's
        synchronous fast path, no await). Returns True if it holds a slot now."""
        if session_id in self.admitted:
            return True
        if self.can_admit_now():
            self._admit(session_id)
            return True
        return False

    def _admit(self, session_id: str) -> None:
        self.admitted.add(session_id)
        self.num_admitted_total += 1

    async def acquire(
        self,
        session_id: str,
        now_s: float,
        num_prompt_tokens: int,
        num_projected_blocks: int | None,
        timeout_s: float,
    ) -> None:
        """Return once the session holds a slot. Mutates the admitted/waiting sets.

        Args:
            session_id: the session.
            now_s: monotonic seconds (its arrival in the waiting set).
            num_prompt_tokens: estimated prefill work of its pending request, tokens.
            num_projected_blocks: KV blocks that request needs, if known.
            timeout_s: longest wait, seconds.

        Raises:
            AdmissionTimeoutError: no slot within ``timeout_s``.
            asyncio.CancelledError: the caller was cancelled (client gone); the session is removed
                from the waiting set, or released if it was admitted meanwhile.
        """
        if session_id in self.admitted:
            return
        if self.can_admit_now():
            self._admit(session_id)
            return
        waiter = self._waiting.get(session_id)
        if waiter is None:
            view = WaitingSession(
                session_id=session_id, arrival_s=now_s, num_prompt_tokens=num_prompt_tokens,
                num_projected_blocks=num_projected_blocks,
            )
            waiter = _Waiter(view, asyncio.get_running_loop().create_future())
            self._waiting[session_id] = waiter
        try:
            await asyncio.wait_for(asyncio.shield(waiter.future), timeout_s)
        except TimeoutError:
            self._drop_waiter(session_id, waiter)
            self.num_timed_out_total += 1
            raise AdmissionTimeoutError(
                f"session {session_id!r} waited {timeout_s:.1f} s for an admission slot (window "
                f"{self.state.window}, {len(self.admitted)} admitted, {len(self._waiting)} waiting); "
                "retry later or raise --admission-wait-timeout-s"
            ) from None
        except asyncio.CancelledError:
            self._drop_waiter(session_id, waiter)
            raise

    def _drop_waiter(self, session_id: str, waiter: _Waiter) -> None:
        if self._waiting.get(session_id) is waiter:
            del self._waiting[session_id]
        waiter.future.cancel()

    def release(self, session_id: str, now_s: float, kv_budget_blocks: int | None = None) -> bool:
        """Free the session's slot (or drop it from the waiting set) and admit waiters.

        Returns:
            True if the session held a slot.
        """
        waiter = self._waiting.pop(session_id, None)
        if waiter is not None:
            waiter.future.cancel()
        if session_id not in self.admitted:
            return False
        self.admitted.discard(session_id)
        self.admit_waiting(now_s, kv_budget_blocks)
        return True

    def admit_waiting(self, now_s: float, kv_budget_blocks: int | None = None) -> list[str]:
        """Admit waiting sessions into free slots, best first (policy.reorder). Returns their ids."""
        if not self._waiting:
            return []
        free = len(self._waiting) if not self.enabled else self.state.window - len(self.admitted)
        ctx = ReorderContext(
            now_s=now_s, num_free_slots=max(0, free), num_admitted=len(self.admitted),
            is_cpu_overloaded=self.state.is_cpu_overloaded,
            is_kv_overloaded=self.state.is_kv_overloaded, kv_budget_blocks=kv_budget_blocks,
        )
        views = [w.view for w in self._waiting.values()]
        self.last_mode, chosen = select_admissions(views, ctx, self.reorder)
        for session_id in chosen:
            waiter = self._waiting.pop(session_id)
            self._admit(session_id)
            if not waiter.future.done():
                waiter.future.set_result(None)
        return chosen

    def tick(
        self, snapshot: PressureSnapshot, now_s: float, kv_budget_blocks: int | None = None
    ) -> AdmissionDecision:
        """One AIMD update (policy.admission.update_window), then admit waiters. Mutates the state."""
        decision = update_window(self.state, snapshot, self.params)
        self.state = decision.state
        self.last_decision = decision
        self.admit_waiting(now_s, kv_budget_blocks)
        return decision
