"""Synthetic agent workloads calibrated from real traces and published work (design.md §8).

Kinds (see :data:`SYNTH_KINDS`):

* ``swebench``: SWE-bench-like coding-agent sessions. Calibrated on the mini-swe-agent traces
  (``shared/data/traces/mini-swe-agent``, SWE-bench Lite; measured with :mod:`eval.workloads.traces`,
  numbers in ``docs/workloads.md``) and design.md §8.
* ``gittaskbench`` / ``terminalbench``: the same session shape with the heavier tool-time tail of
  CPU-heavy suites: in 4,265 Claude Code/Codex sessions 3.97% of tool calls took > 1 min and held
  84.7% of tool time (design.md §8). Session shape and tool names are assumptions (no per-turn
  public traces of these suites here); override them through the params models.
* ``repobench``: RepoBench-like (Liu et al., ICLR 2024) single-turn long-prefill requests: long
  repository-context prompts and a one-line completion, used by MARS as prefill-heavy load.

Mental model of one synthetic session: draw the number of LLM calls, the first prompt (system +
task), then per call an output length and, for every call but the last, a tool (name and duration)
and the observation its output appends to the next prompt. All draws are independent given the
params; the only coupling is through the caps (:func:`eval.workloads.transform.cap_session`).
Randomness: ``numpy.random.default_rng([seed, 0])`` for sessions; arrivals use stream 1
(:data:`eval.workloads.arrivals.ARRIVAL_STREAM`), so changing the arrival process keeps the sessions.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from types import MappingProxyType
from typing import Annotated, Literal

import numpy as np
from pydantic import BaseModel, ConfigDict, Field, model_validator

from eval.workloads.arrivals import ArrivalProcess, with_arrivals
from eval.workloads.format import Session, Turn, Workload, WorkloadMeta
from eval.workloads.transform import cap_session

__all__ = [
    "HEAVY_TAIL_TOOL_TIME",
    "SESSION_STREAM",
    "SYNTH_KINDS",
    "AgentSessionParams",
    "GitTaskBenchParams",
    "LogNormal",
    "RepoBenchParams",
    "SweBenchParams",
    "SynthParams",
    "TerminalBenchParams",
    "ToolTimeParams",
    "WorkloadCaps",
    "generate_sessions",
    "synthesize",
]

SESSION_STREAM = 0
"""Stream index of the session draws: ``default_rng([seed, SESSION_STREAM])``."""

_Z90 = 1.2815515655446004  # standard normal 90th percentile: p90 = median * exp(Z90 * sigma)

Probability = Annotated[float, Field(ge=0.0, le=1.0)]


class _Frozen(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")


class LogNormal(_Frozen):
    """X = exp(N(mu, sigma^2)); ``exp(mu)`` is the median (numpy's ``lognormal(mu, sigma)``)."""

    mu: float
    sigma: Annotated[float, Field(ge=0.0)]

    @classmethod
    def from_median_p90(cls, median: float, p90: float) -> LogNormal:
        """The lognormal with the given median and 90th percentile (``p90 >= median > 0``). Pure."""
        return cls(mu=math.log(median), sigma=math.log(p90 / median) / _Z90)

    def sample(self, rng: np.random.Generator, size: int) -> np.ndarray:
        """Draw ``size`` values, float64 array of shape ``(size,)``. Advances ``rng``."""
        return rng.lognormal(self.mu, self.sigma, size=size)


class ToolTimeParams(_Frozen):
    """Tool durations: a body lognormal plus, with ``tail_fraction``, ``tail_min_s`` + a tail lognormal.

    Durations are capped at ``cap_s`` (the environment's command timeout). Names are drawn from
    ``body_tools`` or ``tail_tools`` (weights, normalized) by the component the duration came from.
    Defaults: SWE-bench-like (design.md §8): body lognormal(-1.19, 0.59) for ~97.7% of calls (the
    traces' cat/grep/sed/python body), a pip/pytest-like tail with p50 2 s and p90 10 s, capped at
    the mini-swe-agent 60 s timeout. Body tool weights: tool-name counts measured on the traces.
    """

    body: LogNormal = LogNormal(mu=-1.19, sigma=0.59)
    tail_fraction: Probability = 0.023
    tail_min_s: Annotated[float, Field(ge=0.0)] = 0.0
    tail: LogNormal = LogNormal.from_median_p90(2.0, 10.0)
    cap_s: Annotated[float, Field(gt=0.0)] | None = 60.0
    body_tools: dict[str, Annotated[float, Field(gt=0.0)]] = Field(
        default_factory=lambda: {"cat": 3005, "grep": 2746, "python": 1700, "sed": 1585, "find": 651,
                                 "git": 425, "cp": 317, "head": 126, "ls": 80})
    tail_tools: dict[str, Annotated[float, Field(gt=0.0)]] = Field(
        default_factory=lambda: {"pip": 369, "pytest": 381, "python": 314})

    @model_validator(mode="after")
    def _tools_given(self) -> ToolTimeParams:
        if not self.body_tools or not self.tail_tools:
            raise ValueError("body_tools and tail_tools need at least one tool name each")
        return self

    def sample(self, rng: np.random.Generator, size: int) -> tuple[list[str], np.ndarray]:
        """Draw ``size`` (tool name, duration in seconds) pairs. Advances ``rng``."""
        is_tail = rng.random(size) < self.tail_fraction
        durations_s = np.where(is_tail, self.tail_min_s + self.tail.sample(rng, size),
                               self.body.sample(rng, size))
        if self.cap_s is not None:
            durations_s = np.minimum(durations_s, self.cap_s)
        names = np.where(is_tail, _choose(rng, self.tail_tools, size), _choose(rng, self.body_tools, size))
        return [str(n) for n in names], durations_s


def _choose(rng: np.random.Generator, weights: dict[str, float], size: int) -> np.ndarray:
    names = list(weights)
    p = np.array([weights[n] for n in names], dtype=np.float64)
    return rng.choice(np.array(names, dtype=object), size=size, p=p / p.sum())


HEAVY_TAIL_TOOL_TIME = ToolTimeParams(
    body=LogNormal(mu=0.0, sigma=1.0),
    tail_fraction=0.0397,
    tail_min_s=60.0,
    tail=LogNormal(mu=4.58, sigma=1.0),
    cap_s=1800.0,
)
"""CPU-heavy suites (design.md §8: 3.97% of calls > 1 min holding 84.7% of tool time).

Derivation: with short calls lognormal(0, 1) (median 1 s, mean e^0.5 ≈ 1.65 s; an assumption) and
long calls 60 s + lognormal(mu_l, 1), the long share is f·L / (f·L + (1−f)·S) = 0.847 with
f = 0.0397, S = 1.65 s, so L ≈ 221 s and mu_l = ln(L − 60) − 0.5 ≈ 4.58 (median long call ≈ 158 s).
The 30-minute cap is an assumed harness timeout; set ``cap_s`` to yours."""


class AgentSessionParams(_Frozen):
    """Shape of a multi-turn agent session; defaults are SWE-bench-like (design.md §8).

    Sources: calls per session lognormal(4.32, 0.34) (mean ≈ 80; traces: p50 73, p90 118); first
    prompt uniform in [1600, 2000] tokens (traces: p50 1,558, p90 2,086); output tokens
    lognormal(4.90, 0.94) (median ≈ 134; traces p50 89, p90 624). Observation tokens appended per
    turn lognormal(4.81, 1.10), at least 22 (measured on the traces' test subset: the minimum is the
    ``<returncode>``/``<output>`` wrapper); with the output this reproduces design.md §8's context
    growth per turn prompt(k) − prompt(k−1) ≈ lognormal(5.83, 0.76) (median ≈ 340; checked in tests).
    """

    kind: str = "agent"
    num_calls: LogNormal = LogNormal(mu=4.32, sigma=0.34)
    first_prompt_min_tokens: Annotated[int, Field(ge=1)] = 1600
    first_prompt_max_tokens: Annotated[int, Field(ge=1)] = 2000
    observation_tokens: LogNormal = LogNormal(mu=4.81, sigma=1.10)
    observation_min_tokens: Annotated[int, Field(ge=0)] = 22
    output_tokens: LogNormal = LogNormal(mu=4.90, sigma=0.94)
    tool_time: ToolTimeParams = ToolTimeParams()

    @model_validator(mode="after")
    def _prompt_range(self) -> AgentSessionParams:
        if self.first_prompt_min_tokens > self.first_prompt_max_tokens:
            raise ValueError(f"first_prompt_min_tokens ({self.first_prompt_min_tokens}) must be <= "
                             f"first_prompt_max_tokens ({self.first_prompt_max_tokens})")
        return self


class SweBenchParams(AgentSessionParams):
    """SWE-bench-like sessions: :class:`AgentSessionParams` defaults (see there for sources)."""

    kind: Literal["swebench"] = "swebench"


class GitTaskBenchParams(AgentSessionParams):
    """GitTaskBench-like sessions (54 repo tasks in 7 domains, QuantaAlpha/GitTaskBench).

    Heavy tool tail of :data:`HEAVY_TAIL_TOOL_TIME`; long calls are environment setup and model runs
    (pip, python, bash scripts). Session shape: SWE-bench defaults (assumption).
    """

    kind: Literal["gittaskbench"] = "gittaskbench"
    tool_time: ToolTimeParams = HEAVY_TAIL_TOOL_TIME.model_copy(update={
        "body_tools": {"cat": 3, "ls": 2, "python": 2, "grep": 2, "sed": 1, "git": 1},
        "tail_tools": {"pip": 3, "python": 4, "bash": 1, "git": 1}})


class TerminalBenchParams(AgentSessionParams):
    """Terminal-Bench-like sessions: terminal tasks with builds, package installs and test runs.

    Heavy tool tail of :data:`HEAVY_TAIL_TOOL_TIME`; long calls are builds and installs. Session
    shape: SWE-bench defaults (assumption).
    """

    kind: Literal["terminalbench"] = "terminalbench"
    tool_time: ToolTimeParams = HEAVY_TAIL_TOOL_TIME.model_copy(update={
        "body_tools": {"ls": 3, "cat": 3, "cd": 1, "grep": 2, "echo": 1, "python": 1},
        "tail_tools": {"make": 2, "apt-get": 2, "pip": 2, "pytest": 2, "cargo": 1, "npm": 1}})


class RepoBenchParams(_Frozen):
    """RepoBench-like single-turn long-prefill requests (Liu et al., ICLR 2024).

    Prompt lengths: lognormal with median 8,192 tokens clipped to [2,048, 32,768] (RepoBench v1.1
    buckets its prompts by length from 2k to 128k tokens; the clip keeps the default inside a 32k
    context, an assumption). Output: next-line completion, lognormal median 24 tokens, clipped to
    [1, 128] (one line of code; assumption).
    """

    kind: Literal["repobench"] = "repobench"
    prompt_tokens: LogNormal = LogNormal(mu=math.log(8192), sigma=0.5)
    prompt_min_tokens: Annotated[int, Field(ge=1)] = 2048
    prompt_max_tokens: Annotated[int, Field(ge=1)] = 32768
    output_tokens: LogNormal = LogNormal(mu=math.log(24), sigma=0.5)
    output_max_tokens: Annotated[int, Field(ge=1)] = 128


SynthParams = SweBenchParams | GitTaskBenchParams | TerminalBenchParams | RepoBenchParams

SYNTH_KINDS: Mapping[str, type[SynthParams]] = MappingProxyType({
    "swebench": SweBenchParams,
    "gittaskbench": GitTaskBenchParams,
    "terminalbench": TerminalBenchParams,
    "repobench": RepoBenchParams,
})
"""Synthetic workload kind → its params model (defaults calibrated as documented there)."""


class WorkloadCaps(_Frozen):
    """Optional caps so a workload fits a small engine (see :func:`~eval.workloads.transform.cap_session`)."""

    max_turns: Annotated[int, Field(ge=1)] | None = None
    """At most this many LLM calls per session."""
    max_context_tokens: Annotated[int, Field(ge=2)] | None = None
    """Sessions end before prompt + output of a turn exceeds this many tokens."""


def _rounded(values: np.ndarray, low: int, high: int | None = None) -> list[int]:
    """Round to int and clip to ``[low, high]``. Pure."""
    return [int(v) for v in np.clip(np.rint(values), low, high if high is not None else np.inf)]


def _agent_session(params: AgentSessionParams, session_id: str, rng: np.random.Generator) -> Session:
    num_calls = _rounded(params.num_calls.sample(rng, 1), 1)[0]
    first_prompt = int(rng.integers(params.first_prompt_min_tokens, params.first_prompt_max_tokens + 1))
    outputs = _rounded(params.output_tokens.sample(rng, num_calls), 1)
    observations = _rounded(params.observation_tokens.sample(rng, num_calls - 1),
                            params.observation_min_tokens)
    names, durations_s = params.tool_time.sample(rng, num_calls - 1)
    turns = [
        Turn(prompt_tokens_appended=appended, output_tokens=outputs[k], tool_name=names[k],
             tool_duration_s=float(durations_s[k]))
        for k, appended in enumerate([first_prompt, *observations][:-1])
    ]
    appended_last = first_prompt if num_calls == 1 else observations[-1]
    turns.append(Turn(prompt_tokens_appended=appended_last, output_tokens=outputs[-1]))
    return Session(session_id=session_id, turns=tuple(turns))


def _repobench_session(params: RepoBenchParams, session_id: str, rng: np.random.Generator) -> Session:
    prompt = _rounded(params.prompt_tokens.sample(rng, 1), params.prompt_min_tokens,
                      params.prompt_max_tokens)[0]
    output = _rounded(params.output_tokens.sample(rng, 1), 1, params.output_max_tokens)[0]
    return Session(session_id=session_id, turns=(Turn(prompt_tokens_appended=prompt, output_tokens=output),))


def generate_sessions(params: SynthParams, num_sessions: int, rng: np.random.Generator,
                      caps: WorkloadCaps | None = None) -> tuple[Session, ...]:
    """Draw ``num_sessions`` sessions (arrival 0 s) with ids ``"<kind>-<index:05d>"``.

    Advances ``rng``; otherwise pure. Caps are applied after drawing, so a capped workload has the
    same sessions as the uncapped one, cut short.

    Raises:
        ValueError: ``num_sessions < 0``.
    """
    if num_sessions < 0:
        raise ValueError(f"num_sessions must be >= 0, got {num_sessions}")
    caps = caps or WorkloadCaps()
    sessions = []
    for index in range(num_sessions):
        session_id = f"{params.kind}-{index:05d}"
        if isinstance(params, RepoBenchParams):
            session = _repobench_session(params, session_id, rng)
        else:
            session = _agent_session(params, session_id, rng)
        sessions.append(cap_session(session, max_turns=caps.max_turns,
                                    max_context_tokens=caps.max_context_tokens))
    return tuple(sessions)


def synthesize(kind: str, num_sessions: int, seed: int, *, params: SynthParams | None = None,
               caps: WorkloadCaps | None = None, arrival: ArrivalProcess | None = None) -> Workload:
    """Generate a synthetic workload of ``kind`` (see :data:`SYNTH_KINDS`), reproducibly from ``seed``.

    Args:
        kind: ``"swebench"``, ``"gittaskbench"``, ``"terminalbench"`` or ``"repobench"``.
        num_sessions: number of sessions (>= 1).
        seed: sessions come from ``default_rng([seed, 0])``, arrivals from ``[seed, 1]``.
        params: override the kind's calibrated defaults (must be that kind's params model).
        caps: optional max turns / max context tokens per session.
        arrival: arrival process; ``None`` leaves every session at 0 s.

    Returns:
        The workload; ``meta`` records the kind, params, caps, seed and arrival process.

    Raises:
        ValueError: unknown ``kind`` (lists the known ones), ``params`` of another kind, or
            ``num_sessions < 1``.
    """
    if kind not in SYNTH_KINDS:
        raise ValueError(f"unknown synthetic workload kind {kind!r}; expected one of {sorted(SYNTH_KINDS)}")
    params = params if params is not None else SYNTH_KINDS[kind]()
    if params.kind != kind:
        raise ValueError(f"params are for kind {params.kind!r} but kind is {kind!r}")
    if num_sessions < 1:
        raise ValueError(f"num_sessions must be >= 1, got {num_sessions}")
    caps = caps or WorkloadCaps()
    rng = np.random.default_rng([seed, SESSION_STREAM])
    meta = WorkloadMeta(source=f"synth:{kind}", seed=seed, generator={
        "kind": kind, "num_sessions": num_sessions, "params": params.model_dump(mode="json"),
        "caps": caps.model_dump(mode="json")})
    workload = Workload(meta=meta, sessions=generate_sessions(params, num_sessions, rng, caps))
    return with_arrivals(workload, arrival, seed) if arrival is not None else workload
