"""Session admission: who holds a slot, who waits, and the swappable policy that decides between them.

Mental model: an *admitted* session keeps its slot across turns and tool calls until it is released
(``session_end``, idle timeout, end of a one-turn request; a replica failure is *not* a release: the
session is re-routed and keeps its slot). A session's first request (or its first after an idle
release) asks :meth:`AdmissionController.request`: admitted at once when the policy has room and
nobody waits (the fast path costs a set lookup), otherwise it joins the waiting set until a tick or
a release hands it a slot, in the policy's order.

The controller owns the two sets and never decides; an :class:`AdmissionPolicy` decides how much
room there is and which waiting sessions take it. :class:`AimdWindow` is MARS's policy (arXiv
2604.26963 §4.2): the AIMD session window of :mod:`mars_openhands.policy.admission` and the
pressure-aware order of :mod:`mars_openhands.policy.reorder`. Another policy (e.g. one admitting by
the KV working set of the admitted sessions) is another class with the same four members, passed to
:class:`~mars_openhands.control.plane.ControlPlane`.

Synchronous and clock-free: the caller passes ``now_s``. Nothing here waits; the gateway wraps it
with asyncio futures (:mod:`mars_openhands.control.app`), the simulator calls it on its virtual clock.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

from mars_openhands.policy.admission import (
    AdmissionDecision,
    AdmissionParams,
    AdmissionState,
    PressureSnapshot,
    initial_state,
    overdue_sessions,
    update_window,
)
from mars_openhands.policy.reorder import (
    ReorderContext,
    ReorderMode,
    ReorderParams,
    WaitingSession,
    select_admissions,
)

__all__ = ["AdmissionController", "AdmissionPolicy", "AdmissionTimeoutError", "AimdWindow"]


class AdmissionTimeoutError(TimeoutError):
    """A session waited longer than ``admission_wait_timeout_s`` for a slot."""


class AdmissionPolicy(Protocol):
    """How much room there is for sessions and which waiting ones take it. Mutable state, no clock.

    Reported (``admission_update`` events, ``/mars/v1/state``, ``/metrics``): :attr:`state` (its
    window W in sessions and the overload flags), :attr:`last_decision`, :attr:`last_mode`.
    """

    state: AdmissionState
    last_decision: AdmissionDecision | None
    last_mode: ReorderMode | None

    def update(self, snapshot: PressureSnapshot) -> AdmissionDecision:
        """One tick of the policy on the current pressure. Mutates the policy's state."""
        ...

    def can_admit(self, num_admitted: int, num_waiting: int) -> bool:
        """Query: may a new session be admitted now, before everyone waiting? Pure."""
        ...

    def select(self, waiting: Sequence[WaitingSession], num_admitted: int, now_s: float,
               kv_budget_blocks: int | None) -> list[str]:
        """Which waiting sessions to admit now, in admission order (a subset of ``waiting``).

        Args:
            waiting: every waiting session, in arrival order.
            num_admitted: sessions holding a slot now.
            now_s: seconds on the clock of ``WaitingSession.arrival_s``.
            kv_budget_blocks: KV blocks a new session may still commit, if known.
        """
        ...


class AimdWindow:
    """MARS's admission policy: at most W sessions admitted, W moved by AIMD on CPU and KV pressure.

    Args:
        params: window parameters (``policy.admission``).
        reorder: order of the waiting sessions (``policy.reorder``).
        is_enforced: when false, every session is admitted at once, but the window is still computed
            and reported, so a baseline run shows what admission *would* have done.
        num_replicas: replicas behind the window at start (its per-replica session counts are
            multiplied by it; each tick's ``PressureSnapshot.num_replicas`` then says how many are up).
    """

    def __init__(self, params: AdmissionParams, reorder: ReorderParams, is_enforced: bool = True,
                 num_replicas: int = 1) -> None:
        self.params = params
        self.reorder = reorder
        self.is_enforced = is_enforced
        self.state = initial_state(params, num_replicas)
        self.last_decision: AdmissionDecision | None = None
        self.last_mode: ReorderMode | None = None

    def update(self, snapshot: PressureSnapshot) -> AdmissionDecision:
        """One AIMD update (:func:`~mars_openhands.policy.admission.update_window`). Mutates the state."""
        decision = update_window(self.state, snapshot, self.params)
        self.state = decision.state
        self.last_decision = decision
        return decision

    def can_admit(self, num_admitted: int, num_waiting: int) -> bool:
        """True when not enforced, or nobody waits and the window has a free slot. Pure."""
        return not self.is_enforced or (num_waiting == 0 and num_admitted < self.state.window)

    def select(self, waiting: Sequence[WaitingSession], num_admitted: int, now_s: float,
               kv_budget_blocks: int | None) -> list[str]:
        """Fill the free slots, best first (:func:`~mars_openhands.policy.reorder.select_admissions`),
        then admit every session that has waited ``max_admission_wait_s`` (window or not).

        Mutates :attr:`last_mode`.
        """
        free = len(waiting) if not self.is_enforced else self.state.window - num_admitted
        ctx = ReorderContext(
            now_s=now_s, num_free_slots=max(0, free), num_admitted=num_admitted,
            is_cpu_overloaded=self.state.is_cpu_overloaded,
            is_kv_overloaded=self.state.is_kv_overloaded, kv_budget_blocks=kv_budget_blocks,
        )
        self.last_mode, chosen = select_admissions(waiting, ctx, self.reorder)
        if self.is_enforced:  # forced admission past the wait bound, beyond the window
            chosen += [sid for sid in overdue_sessions(waiting, now_s, self.params) if sid not in chosen]
        return chosen


class AdmissionController:
    """The admitted and waiting sets of sessions; every choice is the policy's.

    Args:
        policy: decides room and order (e.g. :class:`AimdWindow`).
    """

    def __init__(self, policy: AdmissionPolicy) -> None:
        self.policy = policy
        self.admitted: set[str] = set()
        self._waiting: dict[str, WaitingSession] = {}
        self.num_admitted_total = 0

    @property
    def window(self) -> int:
        """The policy's current window W, sessions."""
        return self.policy.state.window

    @property
    def num_waiting(self) -> int:
        """Sessions waiting for a slot."""
        return len(self._waiting)

    def is_admitted(self, session_id: str) -> bool:
        """Query: does the session hold a slot?"""
        return session_id in self.admitted

    def waiting(self) -> list[WaitingSession]:
        """The waiting sessions, in the order they started waiting."""
        return list(self._waiting.values())

    def is_waiting(self, session_id: str) -> bool:
        """Query: is the session in the waiting set?"""
        return session_id in self._waiting

    def can_admit_now(self) -> bool:
        """Query: would a new session be admitted without waiting?"""
        return self.policy.can_admit(len(self.admitted), len(self._waiting))

    def try_admit(self, session_id: str) -> bool:
        """Admit the session if it holds a slot or one is free with nobody waiting (the fast path).

        Returns:
            True if it holds a slot now. Mutates the admitted set.
        """
        if session_id in self.admitted:
            return True
        if self.can_admit_now():
            self._admit(session_id)
            return True
        return False

    def request(self, view: WaitingSession) -> bool:
        """Admit ``view.session_id`` now (fast path) or add it to the waiting set.

        A session already waiting keeps its first view (its arrival time orders it).

        Returns:
            True if it holds a slot now, False if it waits. Mutates the sets.
        """
        if self.try_admit(view.session_id):
            return True
        self._waiting.setdefault(view.session_id, view)
        return False

    def withdraw(self, session_id: str) -> bool:
        """Drop the session from the waiting set (its request timed out or went away).

        Returns:
            True if it was waiting. Mutates the waiting set.
        """
        return self._waiting.pop(session_id, None) is not None

    def release(self, session_id: str, now_s: float, kv_budget_blocks: int | None = None) -> list[str]:
        """Free the session's slot (or drop it from the waiting set), then admit waiters.

        Returns:
            The sessions admitted into the freed room, in admission order. Mutates the sets.
        """
        self._waiting.pop(session_id, None)
        if session_id not in self.admitted:
            return []
        self.admitted.discard(session_id)
        return self.admit_waiting(now_s, kv_budget_blocks)

    def admit_waiting(self, now_s: float, kv_budget_blocks: int | None = None) -> list[str]:
        """Admit the waiting sessions the policy selects. Returns their ids, in admission order."""
        if not self._waiting:
            return []
        chosen = self.policy.select(self.waiting(), len(self.admitted), now_s, kv_budget_blocks)
        for session_id in chosen:
            del self._waiting[session_id]
            self._admit(session_id)
        return chosen

    def tick(self, snapshot: PressureSnapshot, now_s: float,
             kv_budget_blocks: int | None = None) -> tuple[AdmissionDecision, list[str]]:
        """One policy update, then admit waiters.

        Returns:
            ``(decision, admitted ids)``. Mutates the policy and the sets.
        """
        decision = self.policy.update(snapshot)
        return decision, self.admit_waiting(now_s, kv_budget_blocks)

    def _admit(self, session_id: str) -> None:
        self.admitted.add(session_id)
        self.num_admitted_total += 1
