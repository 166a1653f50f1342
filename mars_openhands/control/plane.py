"""The control plane: one synchronous object that both gateways and the simulator drive (design.md §6).

MARS's external control plane (arXiv 2604.26963 §4.2) is one :class:`ControlPlane` built from small
managers, one per concept: the session registry and the tool tracker (``sessions.py``: CPU
pressure), the replica table (``routing.py``: KV pressure, affinity), and session admission
(``admission.py``: the admitted and waiting sets, and a swappable policy, by default the AIMD
window). The clock is injected. The plane never waits and does no I/O: each call changes its state
and returns what the caller must act on (the sessions admitted now, the replica to send to).

Who drives it:

* the gateway (:class:`~mars_openhands.control.app.Gateway`, standalone or inside vLLM's API server
  through :mod:`~mars_openhands.control.inprocess`): HTTP requests and posted events become calls; a
  request that must wait parks on an asyncio future, resolved when a later call returns its session
  among the admitted; a background task calls :meth:`ControlPlane.tick` every ``update_interval_s``;
* the simulator (:mod:`eval.sim`) on its virtual clock, without an event loop: arrivals, turns, tool
  calls and the engine's KV become the same calls, and its event heap schedules the ticks.

The simulator therefore makes the gateway's admission decisions by construction;
``tests/unit/eval/test_sim_gateway_parity.py`` replays a simulated run through the gateway's HTTP
app and compares every admission and every tick.

Life of a session, and the call that moves each step (the one place a lifecycle change touches)::

    open_session ─▶ begin_request ─▶ request_slot ──(admitted now, or by a later tick / release)──┐
                    (in flight from   (waits while the                                          │
                     here: a waiting   policy has no room)                                      ▼
                     session never                 end_request ◀── the engine serves it ◀── start_turn
                     idles out)                        │                                (turn k, the
                                                       ▼                                 tool since k-1)
                                   tool_enqueued ─▶ tool_started ─▶ tool_ended ─▶ begin_request ...
    end_session: session_end, idle past ``session_idle_timeout_s`` (in tick), a one-turn request's
    end; frees the slot, unbinds the replica, forgets the session, admits waiters.

Dead clients (an agent killed mid-tool, a client that hangs up) must not hold anything forever:

* every tool call carries a bound (its event's ``timeout_s``, else the session's
  ``tool_timeout_s``, else ``config.tool_call_timeout_s``); :meth:`ControlPlane.tick` closes calls
  past it (``Tick.interrupted``: the gateway records a ``tool_end`` with status
  ``"interrupted"``), and a session whose only tool calls are overdue can idle out; an
  idle-released session's replica is named (``Tick.idle_replicas``: the gateway records a
  ``session_end`` of status ``"idle_timeout"`` and forwards it, so the engine releases the
  session's KV instead of holding it for a next turn that never comes);
* a ``session_end`` that finds tool calls of its session in flight (their ``tool_end`` was lost:
  an agent killed between a call's start and that post, resumed, then ended) closes them first
  (:meth:`ControlPlane.interrupt_tools_of`: the gateway records their ``tool_end``, status
  ``"interrupted"``, before the ``session_end``);
* a client that goes away (:meth:`ControlPlane.client_gone`) gives back its session's slot at
  once when nothing else of the session is in flight; the session keeps its turns and queues again
  on its next request.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import NamedTuple

from mars_openhands.control.admission import AdmissionController, AdmissionPolicy, AimdWindow
from mars_openhands.control.config import GatewayConfig
from mars_openhands.control.routing import Router
from mars_openhands.control.sessions import Session, SessionRegistry, ToolTracker, TurnAttempts
from mars_openhands.policy.admission import AdmissionDecision, PressureSnapshot
from mars_openhands.policy.reorder import WaitingSession
from mars_openhands.stream.events import Event

__all__ = ["AdmissionReport", "ControlPlane", "InterruptedTool", "Tick"]

logger = logging.getLogger(__name__)


class AdmissionReport(NamedTuple):
    """The fields of an ``admission_update`` event (stream/events.py) after one tick."""

    window: int
    num_admitted: int
    num_waiting: int
    cpu_overloaded: bool
    kv_overloaded: bool
    tool_backlog_ratio: float
    tool_wait_ema_s: float
    kv_usage: float

    def differs_from(self, last: AdmissionReport) -> bool:
        """True if worth recording: a state field changed, or a pressure signal moved a step.

        Steps: any change of the tool backlog ratio (it moves in 1/N_tool steps), 0.01 of KV usage,
        and 10 % (at least 10 ms) of the tool-wait EMA, so that a signal sitting between its
        thresholds while the overload flag holds (hysteresis) is recorded once it settles, and an
        idle gateway records nothing but heartbeats.
        """
        return (
            self[:5] != last[:5] or self.tool_backlog_ratio != last.tool_backlog_ratio
            or abs(self.kv_usage - last.kv_usage) >= 0.01
            or abs(self.tool_wait_ema_s - last.tool_wait_ema_s)
            >= max(0.01, 0.1 * last.tool_wait_ema_s)
        )


class InterruptedTool(NamedTuple):
    """A tool call the control plane closed because no ``tool_end`` came within its bound."""

    session_id: str
    turn: int
    """The session's turn count when it was closed (the turn the tool's result would feed)."""
    tool_call_id: str
    tool_name: str
    waited_s: float
    """Seconds from its last ``tool_enqueued`` / ``tool_start`` to the close."""


@dataclass(frozen=True)
class Tick:
    """What one :meth:`ControlPlane.tick` did.

    Attributes:
        report: the state after it (an ``admission_update``'s fields).
        decision: the policy's update.
        admitted: sessions admitted by it (idle releases first, then the update), in order.
        idle_released: sessions ended by the idle timeout.
        interrupted: tool calls closed for being past their bound (before the idle releases).
        idle_replicas: the replica each routed idle-released session was bound to (its engine
            still holds the session's KV and state until told the session ended).
    """

    report: AdmissionReport
    decision: AdmissionDecision
    admitted: list[str]
    idle_released: list[str]
    interrupted: tuple[InterruptedTool, ...] = ()
    idle_replicas: dict[str, int] = field(default_factory=dict)


class ControlPlane:
    """Sessions, tool pressure, KV pressure and routing, and admission, on an injected clock.

    Args:
        config: the gateway's configuration (the simulator builds one for its single replica).
        clock: monotonic seconds; virtual in the simulator and in tests.
        policy: the admission policy; default :class:`~mars_openhands.control.admission.AimdWindow`
            from ``config.admission`` / ``config.reorder``, enforced when
            ``config.is_admission_enabled``.

    Single-threaded: call it from one thread (the gateway's event loop, the simulator's loop).
    """

    def __init__(self, config: GatewayConfig, clock: Callable[[], float] = time.monotonic,
                 policy: AdmissionPolicy | None = None) -> None:
        self.config = config
        self.clock = clock
        self.sessions = SessionRegistry()
        self.tools = ToolTracker(config.num_tool_workers, config.admission.tool_wait_ema_alpha)
        self.router = Router(config, clock)
        self.admission = AdmissionController(policy if policy is not None else AimdWindow(
            config.admission, config.reorder, is_enforced=config.is_admission_enabled,
            num_replicas=len(config.replicas)))
        self.num_idle_releases = 0
        self.num_tools_interrupted = 0
        self.num_client_gone_releases = 0
        self._num_one_turn = 0

    # ------------------------------------------------------------------ session lifecycle
    def open_session(self, session_id: str | None) -> Session:
        """The session ``session_id``, created if new; ``None``: a new one-turn session (a request
        without a session id, ended with that request). Mutates the registry."""
        now = self.clock()
        if session_id is None:
            self._num_one_turn += 1
            return self.sessions.get_or_create(f"one-turn-{self._num_one_turn}-{now:.6f}", now,
                                               is_one_turn=True)
        return self.sessions.get_or_create(session_id, now)

    def begin_request(self, session: Session) -> None:
        """An LLM request of the session arrived, before admission. It is in flight until
        :meth:`end_request`, so a session waiting for a slot never idles out. Mutates ``session``."""
        session.num_in_flight += 1

    def request_slot(self, session: Session, num_prompt_tokens: int) -> bool:
        """Admit the session now, or add it to the waiting set with its request's size.

        Args:
            session: a session with a request in flight.
            num_prompt_tokens: estimated prompt tokens of that request; its projected KV blocks
                are ``ceil(tokens / block size)`` (``Router.block_size_tokens``).

        Returns:
            True if it holds a slot now; False: it waits until a later call admits it.
        """
        if self.admission.try_admit(session.session_id):
            return True
        view = WaitingSession(
            session_id=session.session_id, arrival_s=self.clock(), num_prompt_tokens=num_prompt_tokens,
            num_projected_blocks=math.ceil(num_prompt_tokens / self.router.block_size_tokens()),
        )
        return self.admission.request(view)

    def withdraw(self, session: Session) -> None:
        """The session's waiting request gave up (timeout, client gone): leave the waiting set."""
        self.admission.withdraw(session.session_id)

    def start_turn(self, session: Session, is_side: bool = False,
                   fingerprint: int | None = None) -> tuple[int | None, tuple[str, float] | None]:
        """The admitted session's request becomes its next turn, unless it is a side request (a
        title or summary: ``metadata.is_side_request``), which takes no turn, or another attempt
        of the latest turn (the same ``fingerprint``: a retry, or a client re-sending it), which
        keeps that turn's number. Call :meth:`end_turn` when the request ends. Mutates
        ``session``.

        Args:
            session: an admitted session.
            is_side: a side request.
            fingerprint: :func:`~mars_openhands.control.metadata.body_fingerprint` of the
                request's body; ``None``: never taken for a retry.

        Returns:
            ``(turn, prev_tool)``: the 0-based turn and ``(tool_name, duration_s)`` of the tool that
            ended since the previous turn (consumed), for ``mars_turn`` / ``mars_prev_tool``;
            ``(None, None)`` for a side request (both stay for the next agent turn).
        """
        if is_side:
            session.num_side_requests += 1
            return None, None
        last = session.last_turn
        if last is not None and fingerprint is not None and last.fingerprint == fingerprint:
            last.num_live += 1
            session.num_turn_retries += 1
            return last.turn, last.prev_tool
        turn, prev_tool = session.num_turns, session.prev_tool
        if session.first_turn_s is None:
            session.first_turn_s = self.clock()
        session.num_turns += 1
        session.prev_tool, session.tool_batch_ns = None, None
        session.last_turn = TurnAttempts(turn, fingerprint, prev_tool)
        return turn, prev_tool

    def session_age_s(self, session: Session, turn: int | None) -> float | None:
        """``mars_session_age_s`` for the session's request of ``turn`` (``None``: a side request):
        seconds since its first turn started (the engine that opens the session's record at this
        request, one it moved to, dates the session's first arrival back by it); ``None`` for turn
        0 or before any turn. Pure."""
        if turn == 0 or session.first_turn_s is None:
            return None
        return max(0.0, self.clock() - session.first_turn_s)

    def end_turn(self, session: Session, turn: int, is_answered: bool) -> None:
        """An attempt of ``turn`` (from :meth:`start_turn`) ended: answered (its response ended
        normally) or not (refused by the engine, the replica failed, the client went away). The
        last unanswered attempt of the latest turn gives the turn back: the agent's retry, or
        its next request, takes the same number, and the tool it reported travels again. A turn
        that a later one followed keeps its number. Mutates ``session``."""
        last = session.last_turn
        if last is None or last.turn != turn:
            return
        last.num_live -= 1
        last.is_answered = last.is_answered or is_answered
        if last.num_live == 0 and not last.is_answered:
            session.num_turns = turn
            if session.prev_tool is None:  # a tool that ended since is newer
                session.prev_tool = last.prev_tool
            session.last_turn = None

    def end_request(self, session: Session) -> list[str]:
        """The request ended (answered, failed or abandoned). A one-turn session ends with it.

        Returns:
            Sessions admitted into the room it freed.
        """
        session.num_in_flight -= 1
        session.last_activity_s = self.clock()
        if session.is_one_turn and not session.has_ended:
            return self.end_session(session)
        return []

    def client_gone(self, session: Session) -> list[str]:
        """A client hung up on one of the session's requests (call after :meth:`end_request`).

        With nothing else of the session in flight (no request, no tool call within its bound) its
        slot goes back at once: a dead client must not hold it until ``session_end`` or the idle
        timeout. The session stays known (turns, replica) and queues again on its next request.

        Returns:
            Sessions admitted into the freed room (empty when the slot was kept or not held).
        """
        if session.has_ended or session.num_in_flight > 0 or not self.admission.is_admitted(
                session.session_id):
            return []
        now = self.clock()
        if any(call.deadline_s > now for call in session.tools_in_flight.values()):
            return []
        self.num_client_gone_releases += 1
        return self.admission.release(session.session_id, now, self.kv_budget_blocks())

    def tool_bound_s(self, session: Session, timeout_s: float | None) -> float:
        """A tool call's bound, seconds: its own ``timeout_s``, else the session's
        ``tool_timeout_s``, else ``config.tool_call_timeout_s``. Pure."""
        if timeout_s is not None:
            return timeout_s
        if session.tool_timeout_s is not None:
            return session.tool_timeout_s
        return self.config.tool_call_timeout_s

    def tool_enqueued(self, session: Session, tool_call_id: str, tool_name: str,
                      timeout_s: float | None = None) -> None:
        """A tool call entered the agents' tool queue, bounded by :meth:`tool_bound_s`. Mutates the
        session and the tool counts."""
        now = session.last_activity_s = self.clock()
        self.tools.on_enqueued(session, tool_call_id, tool_name, now,
                               self.tool_bound_s(session, timeout_s))

    def tool_started(self, session: Session, tool_call_id: str, tool_name: str,
                     queue_wait_s: float, timeout_s: float | None = None) -> None:
        """A tool call started after ``queue_wait_s`` seconds in the queue; its bound restarts.
        Mutates the counts."""
        now = session.last_activity_s = self.clock()
        self.tools.on_start(session, tool_call_id, tool_name, queue_wait_s, now,
                            self.tool_bound_s(session, timeout_s))

    def tool_ended(self, session: Session, tool_call_id: str, tool_name: str,
                   duration_s: float, status: str = "ok", end_mono_ns: int | None = None) -> None:
        """A tool call ended; it travels with the session's next turn (not an ``"interrupted"``
        one: it has no measured duration), as part of the span of the calls that ended since the
        previous turn when ``end_mono_ns`` (its ``tool_end.t_mono_ns``) is given. Mutates the
        counts."""
        session.last_activity_s = self.clock()
        self.tools.on_end(session, tool_call_id, tool_name, duration_s,
                          is_measured=status != "interrupted", end_mono_ns=end_mono_ns)

    def interrupt_overdue_tools(self) -> list[InterruptedTool]:
        """Close every tool call past its bound (no ``tool_end`` came: the agent is presumed
        dead). The session's idle clock is not reset: a session silent past the idle timeout
        ends at the same tick. Mutates the counts; the caller records the ``tool_end`` events."""
        now = self.clock()
        return [self._interrupt(session, call_id, now, "past its bound")
                for session, call_id, _ in self.sessions.overdue_tools(now)]

    def interrupt_tools_of(self, session: Session) -> list[InterruptedTool]:
        """Close the session's tool calls still in flight: call before its ``session_end`` is
        applied. Their ``tool_end`` never came (an agent killed between a call's start and its
        ``tool_end``'s post, then resumed and ended), and the gateway's view stays whole: every
        call it saw start, it saw end. Mutates the counts; the caller records the ``tool_end``
        events, before the ``session_end``."""
        now = self.clock()
        return [self._interrupt(session, call_id, now, "at its session's end")
                for call_id in list(session.tools_in_flight)]

    def _interrupt(self, session: Session, call_id: str, now: float, why: str) -> InterruptedTool:
        """Close one in-flight tool call as interrupted (unmeasured). Mutates the counts."""
        call = session.tools_in_flight[call_id]
        self.tools.on_end(session, call_id, call.tool_name, now - call.since_s, is_measured=False)
        self.num_tools_interrupted += 1
        logger.info("tool call %s (%s) of session %s: no tool_end %.1f s after its %s; closed "
                    "as interrupted %s", call_id, call.tool_name, session.session_id,
                    now - call.since_s, "start" if call.is_started else "enqueue", why)
        return InterruptedTool(session.session_id, session.num_turns, call_id, call.tool_name,
                               now - call.since_s)

    def on_cpu_event(self, session: Session, event: Event) -> list[str]:
        """Apply a CPU-plane event posted by an agent (``session_start``, ``tool_*``, ``session_end``).

        Returns:
            Sessions admitted because it ended a session.
        """
        kind = event.kind
        if kind == "tool_enqueued":
            self.tool_enqueued(session, event.tool_call_id, event.tool_name, event.timeout_s)
        elif kind == "tool_start":
            self.tool_started(session, event.tool_call_id, event.tool_name, event.queue_wait_s,
                              event.timeout_s)
        elif kind == "tool_end":
            self.tool_ended(session, event.tool_call_id, event.tool_name, event.duration_s,
                            event.status, event.t_mono_ns)
        elif kind == "session_end":
            return self.end_session(session)
        else:
            if kind == "session_start" and event.tool_timeout_s is not None:
                session.tool_timeout_s = event.tool_timeout_s
            session.last_activity_s = self.clock()
        return []

    def end_session(self, session: Session) -> list[str]:
        """Free the session's slot and replica binding, forget it, and admit waiters.

        Returns:
            Sessions admitted into the freed room, in admission order. Mutates every manager.
        """
        session.has_ended = True
        self.tools.forget(session)
        self.router.detach(session)
        if self.sessions.get(session.session_id) is session:
            self.sessions.remove(session.session_id)
        return self.admission.release(session.session_id, self.clock(), self.kv_budget_blocks())

    # ------------------------------------------------------------------ ticks
    def tick(self) -> Tick:
        """One control-plane tick: tool-wait decay, overdue tool calls closed, idle releases, the
        policy's update, admissions.

        Every ``update_interval_s`` seconds of the caller's clock. Mutates every manager.
        """
        now = self.clock()
        if self.config.tool_wait_idle_decay:
            self.tools.decay_if_idle()
        admitted: list[str] = []
        interrupted = self.interrupt_overdue_tools()
        idle = self.sessions.idle(now, self.config.session_idle_timeout_s)
        idle_replicas = {s.session_id: s.replica for s in idle if s.replica is not None}
        for session in idle:
            self.num_idle_releases += 1
            logger.info("session %s idle for %.1f s: releasing its slot", session.session_id,
                        now - session.last_activity_s)
            admitted += self.end_session(session)
        horizon_s = self.config.admission.tool_fraction_horizon_s
        if horizon_s is not None:
            self.tools.observe_fraction(len(self.admission.admitted), now, horizon_s)
        snap = self.snapshot()
        decision, more = self.admission.tick(snap, now, self.kv_budget_blocks())
        st = decision.state
        report = AdmissionReport(
            window=st.window, num_admitted=len(self.admission.admitted),
            num_waiting=self.admission.num_waiting, cpu_overloaded=st.is_cpu_overloaded,
            kv_overloaded=st.is_kv_overloaded, tool_backlog_ratio=snap.tool_backlog_ratio,
            tool_wait_ema_s=snap.tool_wait_ema_s or 0.0, kv_usage=snap.kv_usage or 0.0,
        )
        return Tick(report, decision, admitted + more, [s.session_id for s in idle],
                    tuple(interrupted), idle_replicas)

    # ------------------------------------------------------------------ signals and replicas
    def snapshot(self) -> PressureSnapshot:
        """The current pressure signals (design.md §6): tool backlog and wait, KV usage, and the
        replicas up (the window's session counts are per replica)."""
        return PressureSnapshot(
            tool_backlog_ratio=self.tools.backlog_ratio, tool_wait_ema_s=self.tools.wait_ema_s,
            kv_usage=self.router.kv_usage(), num_tool_workers=self.config.num_tool_workers,
            tool_fraction=self.tools.tool_fraction, num_replicas=max(1, len(self.router.healthy())),
        )

    def kv_budget_blocks(self) -> int | None:
        """Blocks a new session may still commit before the KV set threshold (``Router``)."""
        return self.router.kv_budget_blocks(self.config.admission.kv_set_usage)

    def replica_failed(self, index: int, error: str, immediate: bool = False) -> bool:
        """A poll or request of replica ``index`` failed (see ``Router.record_failure``).

        Returns:
            True if it just went down: its sessions are detached (re-routed on their next request,
            keeping their slots and turns); the caller fails its in-flight requests.
        """
        if not self.router.record_failure(index, error, immediate):
            return False
        for session in self.sessions:
            if session.replica == index:
                self.router.detach(session)
        self.router.forget_replica_cache(index)
        return True
