"""Session-granular AIMD admission window with hysteresis (MARS arXiv 2604.26963 §4.2; design.md §6).

The external control plane admits whole agent *sessions*: an admitted session holds one slot of the
window until it ends (or idles past a timeout). Every ``update_interval_s`` the window ``W`` moves
like TCP's congestion window, driven by two pressure signals, each with hysteresis:

* **CPU** (the tool workers): backlog ratio ``rho = in-flight tool calls / tool workers`` and the EMA
  (alpha = 0.2) of the tool queue wait ``w``. Overload is *set* when ``rho >= H`` (1.5; the
  preview's 4) or ``w >= 5 s`` and *cleared* only when ``rho <= L`` (1: no call waits for a
  worker) and ``w <= 2 s``.
* **KV** (the engines): usage ``u`` excluding evictable prefix-cache blocks. Overload is set at
  ``u >= 0.90`` and cleared at ``u <= 0.85``.

Mental model: overload (either plane) multiplies the window down (``W <- max(W_min, floor(0.7 W))``)
on every tick while it lasts; the window grows by one per tick only when both planes are *healthy*
(below the clear thresholds), and holds in the band between. Two caps bound the window from above
at every tick: ``C_cpu = ceil(N_tool (L + H) / (2 f))`` sessions (enough sessions to keep the tool
workers between their clear and set thresholds when a share ``f`` of their time is in tool calls)
and ``C_kv``, which falls linearly from ``W_max`` at ``u = 0.85`` to ``W_min`` at ``u = 0.90``::

    C_kv
    W_max |‾‾‾‾‾‾‾‾‾‾‾\\
          |            \\
    W_min |             \\____________
          +------------+--+-----------> u
                     0.85 0.90

The session counts (``W_max``, ``W_init``, ``W_min``, the increase step) are *per replica*: behind N
live replicas every one of them is multiplied by N (``PressureSnapshot.num_replicas``), as N copies of
the one engine the preview sized them for. One window of 30 sessions in front of 8 H100s held the
cluster at about 30 sessions in flight, below what their KV holds (docs/compare.md).

Defaults are the public preview's (``Afterglow231/MARS_preview``,
``experiments/replay/vllm_tool_baseline/run_experiment.py``, ``_fill_active_mars``), except ``H`` and
``f`` (the preview's is 1; ours is measured, ``tool_fraction_horizon_s``): W_max / init / min = 30 / 30 / 4 for replay (8 / 8 / 2 for OpenHands runs); the window itself is clamped by the caps,
so after pressure clears it regrows one slot per tick from the cap. The functions here are pure
(snapshot in, decision out); :mod:`mars_openhands.control.admission` (``AimdWindow``) keeps the state, and
:mod:`mars_openhands.control.plane` the clock.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Literal, Self

from pydantic import BaseModel, ConfigDict, Field, model_validator

from mars_openhands.policy.reorder import WaitingSession

__all__ = [
    "AdmissionDecision",
    "AdmissionParams",
    "AdmissionState",
    "PressureSnapshot",
    "cpu_window_cap",
    "ema",
    "initial_state",
    "is_cpu_healthy",
    "is_cpu_overloaded",
    "is_kv_healthy",
    "is_kv_overloaded",
    "kv_window_cap",
    "overdue_sessions",
    "update_window",
    "window_bounds",
]


class AdmissionParams(BaseModel):
    """Parameters of the AIMD admission window (design.md §6). Frozen; unknown keys are an error."""

    model_config = ConfigDict(frozen=True, extra="forbid", use_attribute_docstrings=True)

    window_max: int = Field(30, ge=1)
    """W_max: largest window, in sessions per replica (preview replay default 30; OpenHands runs
    use 8)."""
    window_init: int = Field(30, ge=1)
    """Window at start, in sessions per replica (preview replay default 30; OpenHands runs use 8)."""
    window_min: int = Field(4, ge=1)
    """W_min: smallest window, in sessions per replica (preview replay default 4; OpenHands runs
    use 2)."""
    decrease_factor: float = Field(0.7, gt=0.0, lt=1.0)
    """Multiplicative decrease on overload: W <- max(W_min, floor(factor * W)) (default 0.7)."""
    increase_step: int = Field(1, ge=1)
    """Additive increase per healthy tick, in sessions per replica (default 1)."""
    update_interval_s: float = Field(0.2, gt=0.0)
    """Seconds between window updates (default 0.2)."""
    cpu_set_backlog_ratio: float = Field(1.5, gt=0.0)
    """H: CPU overload is set when rho = in-flight tool calls / tool workers >= H (default 1.5:
    calls wait at half the workers; ours. The MARS preview's 4 lets three calls per worker queue
    before the window reacts, and its cap ``C_cpu = ceil(N_tool (L + H) / 2)`` then admits 2.5
    sessions per worker; ``mars-preview`` keeps 4)."""
    cpu_clear_backlog_ratio: float = Field(1.0, ge=0.0)
    """L: CPU overload clears (and growth is allowed) only when rho <= L (default 1)."""
    cpu_set_wait_s: float = Field(5.0, gt=0.0)
    """CPU overload is set when the tool queue-wait EMA >= this many seconds (default 5)."""
    cpu_clear_wait_s: float = Field(2.0, ge=0.0)
    """CPU overload clears only when the tool queue-wait EMA <= this many seconds (default 2)."""
    kv_set_usage: float = Field(0.90, gt=0.0, le=1.0)
    """KV overload is set when usage u (fraction of KV blocks, 0..1) >= this (default 0.90)."""
    kv_clear_usage: float = Field(0.85, ge=0.0, lt=1.0)
    """KV overload clears, and C_kv = W_max, when u <= this (default 0.85)."""
    kv_usage_over_replicas: Literal["pooled", "max"] = "pooled"
    """How u reads several replicas' KV usage: ``pooled`` = their used blocks over all their
    blocks, as if one pool (the window counts sessions on every replica; placing them on the
    replica with room is the router's job); ``max`` = the fullest replica's, so one full replica
    holds the window shut for all (the rule before 2026-12-06: 0.93x the pooled-KV bound's
    capacity on 4 H100s, docs/compare.md). One replica: the same u either way."""
    tool_wait_ema_alpha: float = Field(0.2, gt=0.0, le=1.0)
    """Weight of the newest tool queue-wait sample in the EMA (default 0.2)."""
    tool_fraction_horizon_s: float | None = Field(600.0, gt=0.0)
    """Time constant, seconds, of the measured tool fraction ``f`` (the share of admitted sessions'
    time spent in tool calls, queued or running) that scales C_cpu to ``N_tool (L + H) / (2 f)``
    (:func:`cpu_window_cap`). ``None``: the preview's cap, which counts every admitted session as
    always in a tool (``f = 1``). Default 600 s: many tool calls of even minute-long tools."""
    max_admission_wait_s: float | None = Field(1800.0, gt=0.0)
    """Forced admission: a session that has waited this many seconds is admitted whatever the
    window (the bound on admission wait; ``None``: unbounded). Default 1800 s, ThunderAgent's
    forced-admission bound (arXiv 2602.13692)."""

    @model_validator(mode="after")
    def _check_order(self) -> Self:
        if not self.window_min <= self.window_init <= self.window_max:
            raise ValueError(
                "admission window must satisfy window_min <= window_init <= window_max, got "
                f"{self.window_min} / {self.window_init} / {self.window_max}; fix "
                "--admission-window-min/-init/-max"
            )
        pairs = (
            ("cpu_clear_backlog_ratio", "cpu_set_backlog_ratio"),
            ("cpu_clear_wait_s", "cpu_set_wait_s"),
            ("kv_clear_usage", "kv_set_usage"),
        )
        for clear, set_ in pairs:
            if getattr(self, clear) >= getattr(self, set_):
                raise ValueError(
                    f"hysteresis needs {clear} < {set_}, got {getattr(self, clear)} >= "
                    f"{getattr(self, set_)}; lower --admission-{clear.replace('_', '-')}"
                )
        return self


class PressureSnapshot(BaseModel):
    """The signals one window update sees. Frozen.

    ``None`` means "not measured" (no tool events yet, no engine answered): a missing signal
    neither sets nor clears an overload and does not block growth, as in the preview.
    """

    model_config = ConfigDict(frozen=True, extra="forbid", use_attribute_docstrings=True)

    tool_backlog_ratio: float = Field(0.0, ge=0.0)
    """rho = in-flight (enqueued or running) tool calls / tool workers."""
    tool_wait_ema_s: float | None = Field(None, ge=0.0)
    """EMA of tool queue wait, seconds."""
    kv_usage: float | None = Field(None, ge=0.0, le=1.0)
    """KV usage u in 0..1 (evictable prefix-cache blocks excluded); several replicas' read as
    ``AdmissionParams.kv_usage_over_replicas`` says."""
    num_tool_workers: int = Field(1, ge=1)
    """N_tool: tool workers serving all sessions."""
    tool_fraction: float | None = Field(None, ge=0.0, le=1.0)
    """f: share of admitted sessions' time in tool calls (queued or running), averaged over
    ``tool_fraction_horizon_s``; ``None`` when not measured (no session admitted yet)."""
    num_replicas: int = Field(1, ge=1)
    """N: live replicas behind the window; its per-replica session counts are multiplied by N
    (:func:`window_bounds`)."""


class AdmissionState(BaseModel):
    """Window and overload flags carried from one update to the next. Frozen."""

    model_config = ConfigDict(frozen=True, extra="forbid", use_attribute_docstrings=True)

    window: int = Field(ge=1)
    """Current window W, sessions."""
    is_cpu_overloaded: bool = False
    is_kv_overloaded: bool = False


class AdmissionDecision(BaseModel):
    """Result of one :func:`update_window`. Frozen."""

    model_config = ConfigDict(frozen=True, extra="forbid", use_attribute_docstrings=True)

    state: AdmissionState
    """The new state (window already clamped to ``[W_min, min(W_max, C_cpu, C_kv)]``)."""
    action: Literal["decrease", "increase", "hold"]
    """What AIMD did before the caps were applied."""
    cpu_cap: int
    """C_cpu, sessions."""
    kv_cap: int
    """C_kv, sessions."""


def window_bounds(params: AdmissionParams, num_replicas: int = 1) -> tuple[int, int, int]:
    """``(W_min, W_max, increase step)`` in sessions behind ``num_replicas`` live replicas: the
    per-replica counts of ``params`` times ``num_replicas`` (at least 1). Pure."""
    n = max(1, num_replicas)
    return params.window_min * n, params.window_max * n, params.increase_step * n


def initial_state(params: AdmissionParams, num_replicas: int = 1) -> AdmissionState:
    """Return the starting state: ``W = window_init`` per replica (times ``num_replicas``), no
    overload. Pure."""
    return AdmissionState(window=params.window_init * max(1, num_replicas))


def ema(prev: float | None, sample: float, alpha: float) -> float:
    """Exponential moving average: ``alpha * sample + (1 - alpha) * prev`` (``sample`` if none yet).

    Pure. Units are those of ``sample``.
    """
    if prev is None:
        return sample
    return alpha * sample + (1.0 - alpha) * prev


def is_cpu_healthy(snapshot: PressureSnapshot, params: AdmissionParams) -> bool:
    """True when the tool plane is below both *clear* thresholds (rho <= L and w <= clear). Pure."""
    wait_ok = snapshot.tool_wait_ema_s is None or snapshot.tool_wait_ema_s <= params.cpu_clear_wait_s
    return snapshot.tool_backlog_ratio <= params.cpu_clear_backlog_ratio and wait_ok


def is_cpu_overloaded(was_overloaded: bool, snapshot: PressureSnapshot, params: AdmissionParams) -> bool:
    """CPU overload with hysteresis: set at rho >= H or w >= set, cleared at rho <= L and w <= clear.

    Pure. Between the thresholds the previous flag is kept.
    """
    if was_overloaded:
        return not is_cpu_healthy(snapshot, params)
    wait = snapshot.tool_wait_ema_s
    return snapshot.tool_backlog_ratio >= params.cpu_set_backlog_ratio or (
        wait is not None and wait >= params.cpu_set_wait_s
    )


def is_kv_healthy(snapshot: PressureSnapshot, params: AdmissionParams) -> bool:
    """True when KV usage is unknown or at most the clear threshold. Pure."""
    return snapshot.kv_usage is None or snapshot.kv_usage <= params.kv_clear_usage


def is_kv_overloaded(was_overloaded: bool, snapshot: PressureSnapshot, params: AdmissionParams) -> bool:
    """KV overload with hysteresis: set at u >= set, cleared at u <= clear; unknown u keeps it. Pure."""
    usage = snapshot.kv_usage
    if usage is None:
        return was_overloaded
    if was_overloaded:
        return usage > params.kv_clear_usage
    return usage >= params.kv_set_usage


def overdue_sessions(waiting: Sequence[WaitingSession], now_s: float, params: AdmissionParams) -> list[str]:
    """Ids of the waiting sessions that have waited ``max_admission_wait_s`` or longer, oldest first.

    Pure. ``now_s`` is on the clock of ``WaitingSession.arrival_s``; none when the bound is ``None``.
    """
    bound = params.max_admission_wait_s
    if bound is None:
        return []
    overdue = [s for s in waiting if now_s - s.arrival_s >= bound]
    return [s.session_id for s in sorted(overdue, key=lambda s: s.arrival_s)]


def cpu_window_cap(num_tool_workers: int, params: AdmissionParams, tool_fraction: float | None = None,
                   num_replicas: int = 1) -> int:
    """C_cpu = ceil(N_tool * (L + H) / (2 f)), clamped to [W_min, W_max] (per replica, times
    ``num_replicas``), in sessions. Pure.

    The admitted sessions at which the tool calls in flight sit midway between the clear and set
    backlog ratios: by Little's law ``f x sessions`` of them are in a tool call at a time, where
    ``f`` (``tool_fraction``) is the measured share of an admitted session's time spent in tool
    calls. ``f`` unknown, or ``params.tool_fraction_horizon_s`` None: ``f = 1``, the preview's
    ``cpu_window_cap`` (every admitted session counted as in a tool); ``f = 0`` (no tool call yet):
    W_max.
    """
    w_min, w_max, _ = window_bounds(params, num_replicas)
    ratio = (params.cpu_clear_backlog_ratio + params.cpu_set_backlog_ratio) / 2.0
    share = 1.0 if tool_fraction is None or params.tool_fraction_horizon_s is None else tool_fraction
    if share <= 0.0:
        return w_max
    cap = math.ceil(num_tool_workers * ratio / share - 1e-9)
    return max(w_min, min(w_max, cap))


def kv_window_cap(kv_usage: float | None, params: AdmissionParams, num_replicas: int = 1) -> int:
    """C_kv: W_max at u <= clear, W_min at u >= set, linear (rounded) in between, in sessions
    (per replica, times ``num_replicas``). Pure.

    Source: the preview's ``kv_window_cap``. Unknown usage gives W_max.
    """
    w_min, w_max, _ = window_bounds(params, num_replicas)
    if kv_usage is None or kv_usage <= params.kv_clear_usage:
        return w_max
    if kv_usage >= params.kv_set_usage:
        return w_min
    frac = (kv_usage - params.kv_clear_usage) / (params.kv_set_usage - params.kv_clear_usage)
    cap = round(w_max - frac * (w_max - w_min))
    return max(w_min, min(w_max, cap))


def update_window(
    state: AdmissionState, snapshot: PressureSnapshot, params: AdmissionParams
) -> AdmissionDecision:
    """One AIMD tick: update the overload flags, move the window, apply the caps. Pure.

    Args:
        state: the previous window and flags.
        snapshot: the current signals.
        params: thresholds and AIMD constants.

    Returns:
        The decision; ``decision.state.window`` is always within ``[W_min, W_max]`` times
        ``snapshot.num_replicas``.
    """
    n = snapshot.num_replicas
    w_min, w_max, step = window_bounds(params, n)
    cpu_over = is_cpu_overloaded(state.is_cpu_overloaded, snapshot, params)
    kv_over = is_kv_overloaded(state.is_kv_overloaded, snapshot, params)
    window = state.window
    if cpu_over or kv_over:
        action: Literal["decrease", "increase", "hold"] = "decrease"
        window = max(w_min, math.floor(params.decrease_factor * window))
    elif is_cpu_healthy(snapshot, params) and is_kv_healthy(snapshot, params):
        action = "increase"
        window = min(w_max, window + step)
    else:
        action = "hold"
    cpu_cap = cpu_window_cap(snapshot.num_tool_workers, params, snapshot.tool_fraction, n)
    kv_cap = kv_window_cap(snapshot.kv_usage, params, n)
    window = max(w_min, min(window, cpu_cap, kv_cap, w_max))
    new_state = AdmissionState(window=window, is_cpu_overloaded=cpu_over, is_kv_overloaded=kv_over)
    return AdmissionDecision(state=new_state, action=action, cpu_cap=cpu_cap, kv_cap=kv_cap)
