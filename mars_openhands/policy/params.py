"""Typed parameters of the internal scheduler plugins (design.md §4, §5; style.md "Config").

vLLM hands the plugin one dict, ``vllm_config.additional_config["mars"]`` (from
``--additional-config '{"mars": {...}}'``). It is parsed exactly once, at the plugin boundary, by
:func:`parse_scheduler_params` into the frozen :class:`SchedulerParams`; nothing past that point
sees a dict. Every constant of every policy lives here with its documented default and source.

Example:
    >>> p = parse_scheduler_params({"levels": {"aging_interval_s": 10.0}})
    >>> p.levels.aging_interval_s, p.levels.quanta_tokens
    (10.0, (2048, 1024, 512, 256))
    >>> parse_scheduler_params({"levels": {"agng": 1}})
    Traceback (most recent call last):
    ...
    ValueError: invalid --additional-config mars: unknown key 'mars.levels.agng'; 'mars.levels' takes: prompt_thresholds_tokens, quanta_tokens, aging_interval_s
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from mars_openhands.cli_style import config_error_lines, keys_hint
from mars_openhands.policy.continuum import ContinuumParams
from mars_openhands.policy.infercept import InferceptParams
from mars_openhands.policy.plas import PlasParams
from mars_openhands.policy.thunderagent import ThunderAgentParams

__all__ = [
    "LevelParams",
    "MarsLevelParams",
    "ResidencyParams",
    "RetentionParams",
    "SchedulerParams",
    "TelemetryParams",
    "WindowParams",
    "parse_scheduler_params",
]


class _Frozen(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid", strict=False)


class LevelParams(_Frozen):
    """MLFQ levels shared by the preview port and our policy (MARS preview, design.md §4)."""

    prompt_thresholds_tokens: tuple[int, ...] = (2048, 8192, 32768)
    """Bucket upper bounds: tokens <= t[0] -> level 0, <= t[1] -> 1, ...; above all -> last level."""
    quanta_tokens: tuple[int, ...] = (2048, 1024, 512, 256)
    """Prefill token quantum per level (capped at max_num_batched_tokens). One more than thresholds."""
    aging_interval_s: float = Field(30.0, ge=0.0)
    """Promote one level per this many seconds since last scheduled (0 disables aging)."""

    @model_validator(mode="after")
    def _check(self) -> LevelParams:
        t, q = self.prompt_thresholds_tokens, self.quanta_tokens
        if len(q) != len(t) + 1:
            raise ValueError(
                f"quanta_tokens needs len(prompt_thresholds_tokens) + 1 = {len(t) + 1} entries, "
                f"got {len(q)}"
            )
        if any(b <= a for a, b in zip(t, t[1:], strict=False)) or any(x <= 0 for x in t):
            raise ValueError(f"prompt_thresholds_tokens must be positive, increasing, got {t}")
        if any(x <= 0 for x in q):
            raise ValueError(f"quanta_tokens must be positive, got {q}")
        return self

    @property
    def num_levels(self) -> int:
        """Number of MLFQ levels (len(quanta_tokens))."""
        return len(self.quanta_tokens)


class MarsLevelParams(_Frozen):
    """Our MLFQ extension: uncached remainder + session service + bounded promotion (§4), and
    program-level FIFO within a level."""

    mlfq: bool = False
    """The MLFQ priority coordinator (MARS §4.3): levels from the prefill work a turn adds and
    the session's attained service, aging promotion, and per-level prefill quanta. Off: every
    request is level 0 (one quantum, ``quanta_tokens[0]``, the step budget) and the order is
    ``session_fifo``'s. Off by default: on the full bundled workload, the CPU-bound family and
    with residency on it changed nothing measurable (mean and P95 within 1%, docs/schedulers.md
    "Ablations") and it hurt the mix's median; ``mars-mlfq`` runs it on."""

    session_service_thresholds_tokens: tuple[int, ...] = (262144, 1048576, 4194304)
    """Session attained-service buckets (scheduled tokens); same shape as prompt thresholds.
    Large defaults: only very heavy sessions are demoted (Autellix-style PLAS as a tiebreaker)."""
    max_promotion_levels: int = Field(3, ge=0)
    """Bound on aging promotion: at most this many levels above the base level."""
    use_session_service: bool = True
    """Include the session's attained service in the base level."""
    quanta_tokens: tuple[int, ...] | None = (8192, 2048, 1024, 512)
    """Our prefill quantum per level (None: ``levels.quanta_tokens``, the preview's 2048..256).
    Level 0 gets the whole step budget: on a MoE model any prefill chunk reads every expert's
    weights (~20 ms a step for Qwen3-30B-A3B on H100 SXM, aiconfigurator), so a 256-token chunk
    prefills at about a fifth of an 8k chunk's rate and the preview's small quanta mostly add
    steps. Must have ``levels.num_levels`` entries."""
    level_from_new_work: bool = True
    """Bucket only the prefill work the turn adds (prompt beyond the session's previous context)
    instead of the whole uncached remainder: re-prefilling a context the cache lost is the
    engine's cost, not the session's demand, so it neither demotes the session nor uses up MLFQ
    quanta (an evicted long session otherwise starves behind new ones)."""
    session_fifo: bool = True
    """Within a level, serve (and protect from eviction) the oldest *session* first instead of
    the oldest request (program-level FIFO, as Continuum and Autellix order programs)."""


    @model_validator(mode="after")
    def _check_quanta(self) -> MarsLevelParams:
        if self.quanta_tokens is not None and any(q <= 0 for q in self.quanta_tokens):
            raise ValueError(f"quanta_tokens must be positive, got {self.quanta_tokens}")
        return self


class RetentionParams(_Frozen):
    """KV retention value model (design.md §4 last paragraph).

    Retain a finished, non-final turn's KV for TTL tau when
    ``P(tool returns within tau) * (reload_s + queue_delay_s) > tau * blocks * shadow_price``.
    """

    enabled: bool = True
    """Master switch of KV retention for schedulers that use it."""
    reload_linear_s_per_token: float = Field(0.0002, ge=0.0)
    """Prefill reload time per retained token (Continuum's default PrefillReload, design §5)."""
    reload_quad_s_per_token2: float = Field(0.0, ge=0.0)
    """Quadratic term of the reload model (attention cost), s/token^2."""
    default_queue_delay_s: float = Field(0.5, ge=0.0)
    """Expected queueing delay before any is measured, seconds."""
    queue_delay_ema_alpha: float = Field(0.2, gt=0.0, le=1.0)
    """EMA weight of measured queueing delays (arrival -> first scheduled)."""
    price_free_usage: float = Field(0.5, ge=0.0, lt=1.0)
    """KV usage below which a retained block costs nothing (no pressure)."""
    price_max_s_per_block_s: float = Field(0.0032, ge=0.0)
    """Shadow price of one block for one second at full usage: 16 tokens x 0.0002 s reload,
    i.e. holding a block for a second costs as much as reloading one block."""
    max_ttl_s: float = Field(60.0, gt=0.0)
    """Never retain longer than this, seconds."""
    cold_start_ttl_s: float = Field(2.0, ge=0.0)
    """TTL candidate used while too few durations are known (Continuum's 2.0 s)."""
    min_tool_samples: int = Field(100, ge=1)
    """Per-tool duration samples needed before its own CDF is used (else all tools; Continuum K)."""
    max_samples_per_tool: int = Field(2048, ge=16)
    """Sliding window of durations kept per tool."""
    imminent_grace_s: float = Field(5.0, ge=0.0)
    """After tool_end, keep retained KV at least this long for the imminent next turn."""
    reuse_ema_alpha: float = Field(0.5, gt=0.0, le=1.0)
    """EMA weight of the newest measured reuse fraction of a session (the share of its previous
    context its next turn's prompt kept, policy/session.py); the value model scales a session's
    gain by it, so a session whose turns do not reuse their context stops being retained."""


class ResidencyParams(_Frozen):
    """KV residency (working-set load control, policy/residency.py): which sessions keep KV."""

    enabled: bool = True
    """Hold the turns of sessions whose KV does not fit outside vLLM's queue; pin residents' KV
    across tool calls. Off: the previous behaviour (retention by the value model alone)."""
    budget_usage: float = Field(0.97, gt=0.0, le=1.0)
    """Share of the KV pool the resident set's demand may use."""
    output_reserve_tokens: int = Field(256, ge=0)
    """Prior of the decode growth reserved per request beyond its current tokens, used until
    output lengths have been seen (then: the expected remaining output given what the request
    generated, from the engine's own finished turns). A request that has outlived the prior (or
    every length seen) reserves as many tokens again as it has generated; never more than its
    ``max_tokens`` allow."""
    max_pin_s: float = Field(3600.0, gt=0.0)
    """Longest a resident's KV stays pinned in one tool call, seconds."""
    max_hold_s: float = Field(1800.0, gt=0.0)
    """A turn held this long (seconds since it arrived, never scheduled yet) becomes resident
    whether or not it fits: the bound on admission wait (ThunderAgent's forced admission
    after 1800 s, arXiv 2602.13692)."""
    order: Literal["fifo", "response-ratio"] = "response-ratio"
    """Order in which held sessions become resident. ``response-ratio`` (default): the held
    session with the highest response ratio (wait + E) / E first, E = ``response_ratio_prior_s``
    + the session's age when its turn was held (highest response ratio next, Brinch Hansen 1971:
    short jobs first, and every wait raises the ratio, so no one starves); residents keep their
    KV in arrival order and an idle one is suspended only when that pays (``displace_value_s``).
    ``fifo``: the oldest session first (no bypass), and an idle resident younger than a held
    session may be suspended for it: the tail of the KV-bound bundled traces a few percent lower,
    capacity on long-tool workloads 0.84x instead of 1.09x thunderagent's. Measured in
    docs/schedulers.md "Residency order"."""
    count_past_waits: bool | None = None
    """Under ``order: response-ratio``, a held session's earlier waits for residency in this
    engine count as waiting and not as service: E = prior + age when held - past waits, and the
    ratio's wait is the current one plus the past ones (the ratio becomes the session's own
    slowdown so far). ``None`` (default): on when the engine has a host KV tier (there it gained a
    rung of capacity on long tools and most of bf16's P95 gap to continuum + tier), off without
    one (the bundled traces 1-4% worse with it); measured in docs/schedulers.md "Past waits in the
    response ratio"."""
    response_ratio_prior_s: float = Field(60.0, gt=0.0)
    """E of a session held at its first turn (nothing known of its size yet), seconds: how long a
    new session waits before its ratio doubles (ours; 300 s measured as the alternative in
    docs/schedulers.md "Residency order"). With ``order: response-ratio`` only."""


class WindowParams(_Frozen):
    """In-engine admission window with an FCFS overflow queue (MARS preview: 30)."""

    enabled: bool | None = None
    """None: the scheduler class's default (preview: on; others: off)."""
    size: int = Field(30, ge=1)
    """Maximum running + waiting requests inside the engine."""


class TelemetryParams(_Frozen):
    """GPU-plane telemetry (design.md §3)."""

    addr: str | None = None
    """ZeroMQ address of a stream collector (ipc://... or tcp://127.0.0.1:port); None: off."""
    engine_step_interval_ms: float = Field(100.0, ge=0.0)
    """Emit at most one engine_step snapshot per this many milliseconds."""
    source: str = "engine:0"
    """The ``source`` field of emitted events."""


class SchedulerParams(_Frozen):
    """All parameters of the scheduler plugins (``--additional-config '{"mars": {...}}'``)."""

    levels: LevelParams = LevelParams()
    mars: MarsLevelParams = MarsLevelParams()
    retention: RetentionParams = RetentionParams()
    residency: ResidencyParams = ResidencyParams()
    window: WindowParams = WindowParams()
    telemetry: TelemetryParams = TelemetryParams()
    inbox_addr: str | None = None
    """ZeroMQ PULL address (bound by the engine) for CPU-plane events; None: in-process only."""
    max_inbox_events_per_step: int = Field(1024, ge=1)
    """Bound on CPU-plane events consumed per step (the rest wait for the next step)."""
    reorder_interval_s: float = Field(1.0, ge=0.0)
    """Re-sort an unchanged waiting queue at most this often (keys age in 30 s steps), seconds."""
    session_idle_timeout_s: float = Field(1800.0, gt=0.0)
    """Forget a session's state after this long without a request or event."""
    chunk_shrinking: bool | None = None
    """Halve a prefill chunk (down to block_size) when KV would not fit; None: class default."""
    resume_when_context_fits: bool | None = None
    """Resume a preempted request only once its whole context fits in the free KV blocks (its
    cached prefix counts), so its re-prefill is not preempted again midway by the pressure that
    preempted it; the waiting requests after it wait too that step (vLLM's head-of-line rule),
    and it resumes anyway when nothing runs. None: class default (mars, autellix: on)."""
    autellix: PlasParams = PlasParams()
    """Autellix PLAS baseline (AutellixScheduler; docs/schedulers.md)."""
    continuum: ContinuumParams = ContinuumParams()
    """Continuum / Continuum-dy baseline (ContinuumScheduler; docs/schedulers.md)."""
    infercept: InferceptParams = InferceptParams()
    """InferCept baseline, MARS port (InferceptScheduler; docs/schedulers.md)."""
    thunderagent: ThunderAgentParams = ThunderAgentParams()
    """ThunderAgent baseline (ThunderAgentScheduler; docs/schedulers.md)."""

    @model_validator(mode="after")
    def _check_mars_quanta(self) -> SchedulerParams:
        q = self.mars.quanta_tokens
        if q is not None and len(q) != self.levels.num_levels:
            raise ValueError(f"mars.quanta_tokens needs levels.num_levels = {self.levels.num_levels} "
                             f"entries, got {len(q)}")
        return self


def parse_scheduler_params(raw: dict[str, Any] | SchedulerParams | None) -> SchedulerParams:
    """Parse ``additional_config["mars"]`` into :class:`SchedulerParams`.

    Args:
        raw: the dict vLLM passes (or None / an already-built params object).

    Returns:
        The frozen params.

    Raises:
        ValueError: unknown key or bad value; the message names each key as ``mars.a.b``, the
            offending value (an unknown key's: the keys its section takes instead), and the flag
            (``--additional-config``) to fix (:func:`~mars_openhands.cli_style.config_error_lines`).
    """
    if raw is None:
        return SchedulerParams()
    if isinstance(raw, SchedulerParams):
        return raw
    if not isinstance(raw, dict):
        raise ValueError(
            f"--additional-config mars must be a JSON object, got {type(raw).__name__}: {raw!r}"
        )
    try:
        return SchedulerParams.model_validate(raw)
    except ValidationError as e:
        problems = "; ".join(config_error_lines(
            e, key_prefix="mars.", unknown_key_hint=keys_hint(SchedulerParams, "mars")))
        raise ValueError(f"invalid --additional-config mars: {problems}") from None
