"""Metrics of one run, computed from its recorded stream (design.md §7; MARS arXiv 2604.26963 §6).

Input: the stream frame of :func:`mars_openhands.stream.reader.read_stream` (one row per event,
a ``kind`` column, the event fields as columns, ``t_wall`` as UTC datetimes) and, for slowdown and
goodput, each session's *ideal* time: its E2E when run alone on an idle system with the same engine
model and the same tool times (computed by the simulator or an isolated replay, not here).

Definitions (all times in seconds; a *completed* session has a ``session_end`` with status ``"ok"``
and at least one ``finished`` event):

* **arrival** = ``t_wall`` of the session's ``session_start`` (emitted by the client/replay driver
  when the session arrives, so E2E includes admission wait).
* **end** = ``t_wall`` of the session's last ``finished`` event (the last token of its final turn).
* **E2E** = end − arrival. Summaries: mean, P50, P90, P95, P99 (numpy linear interpolation).
* **makespan** = last end of a completed session − first arrival of any session.
* **throughput** = completed sessions / makespan (sessions/s).
* **TTFT** per turn = the engine's ``first_token.ttft_s`` (engine arrival → first token), one value
  per (session, turn, request); summarized like E2E.
* **slowdown** = E2E / ideal (≥ 1 up to noise; design.md §7: the physical limit of the mean is 1.0).
* **goodput(α)** = completed sessions with E2E ≤ α·ideal, divided by the makespan (sessions/s);
  α = 3 by default, reported over a sweep (design.md §7).
* **tool-wait share** = Σ (tool execution ``tool_end.duration_s`` + tool queue wait
  ``tool_start.queue_wait_s``) / Σ E2E over completed sessions: the part of session time spent in
  tools rather than in the LLM path. The queue-wait part alone is reported too.
* **preemptions** = number of ``preempted`` events; also per ``finished`` request.
* **KV retention hit ratio** = tokens the next turns actually reused from retained KV (``kv_released
  .num_reused_blocks``: blocks of the release the next turn's prefix hit took) / tokens of every
  retention released for any reason except ``"shutdown"`` (the run ended before the outcome was
  known); a release as ``"resumed"`` whose next turn kept half the context counts half. Streams
  written before the measurement (no ``num_reused_blocks``) count a ``"resumed"`` release whole.
  Also the share of releases that were resumes (``resume_ratio``, what the ratio used to count).
  ``None`` when nothing was released.
* **agent TTFT** per turn = its ``first_token`` − the moment the agent sent the turn: the session's
  arrival for its first turn, the end of the previous turn's tool (``tool_end`` of turn k−1) for
  turn k (the engine's ``ttft_s`` as a fallback when neither was recorded). Unlike the engine's
  ``ttft_s`` it includes the wait in the gateway's admission window, which is what a user of an
  agent waits for.
* **TTFT-SLO goodput(τ)** = turns of completed sessions with agent TTFT ≤ τ: as a share of those
  turns, and per second of makespan; τ = 10 s and 30 s (:data:`TTFT_SLOS_S`).
* **admission wait** per session = its first ``first_scheduled`` − its arrival: the gateway's window
  and the engine's own queue (a ThunderAgent program admission, a MARS residency hold, KV blocking)
  together, until the session first gets GPU time. Reported as its max and P99 over sessions (a
  bounded tail means no session starves at the door).
* **session P99** = P99 of the sessions' E2E (job level, not per request): ``e2e_s.p99``.
* **re-prefilled tokens** = prompt tokens computed again that the engine had already computed:
  for turn k ≥ 1, ``min(prompt_k, prompt_(k−1) + output_(k−1) − 1) − cached_k`` (``cached_k`` =
  the prefix-cache or retained-KV hit at the turn's first schedule, ``first_scheduled
  .num_cached_tokens``; the −1: the last output token has no KV yet), clipped at 0; plus, per
  ``preempted`` event, the tokens it discarded (``num_computed_tokens``; where an engine reports
  0 there, as the simulator's stock vLLM does, the request's prompt length, a lower bound since a
  request is preempted while it decodes).

Pure pandas/numpy: every function takes a frame and returns new values; nothing is mutated.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence

import numpy as np
import pandas as pd
from pydantic import BaseModel, ConfigDict

__all__ = [
    "DEFAULT_ALPHA",
    "DEFAULT_ALPHAS",
    "TTFT_SLOS_S",
    "admission_wait_s",
    "agent_ttft_table",
    "reprefill_tokens",
    "KvRetentionStats",
    "RunMetrics",
    "Summary",
    "compute_metrics",
    "goodput_per_s",
    "kv_retention_stats",
    "session_table",
    "summarize",
    "ttft_slo_goodput",
    "ttft_table",
]

DEFAULT_ALPHA = 3.0
"""Dynamic-SLO factor: a session is good when E2E <= alpha * ideal (design.md §7)."""
DEFAULT_ALPHAS: tuple[float, ...] = (1.0, 1.5, 2.0, 3.0, 5.0, 10.0)
"""Default goodput sweep (includes :data:`DEFAULT_ALPHA`)."""

TTFT_SLOS_S: tuple[float, ...] = (10.0, 30.0)
"""TTFT SLOs of the TTFT goodput, seconds (issue 12: what users of agentic serving ask for)."""

NOT_A_RESOLUTION = "shutdown"
"""``kv_released`` reason that does not resolve a retention (the run ended)."""


class Summary(BaseModel):
    """count, mean, P50, P90, P95, P99 of a sample (NaN when empty); units as the field that holds it."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    count: int
    mean: float
    p50: float
    p90: float
    p95: float
    p99: float


def summarize(values: Iterable[float]) -> Summary:
    """Summarize ``values`` (NaNs dropped); percentiles by linear interpolation. Pure."""
    x = np.asarray(list(values), dtype=np.float64)
    x = x[~np.isnan(x)]
    if x.size == 0:
        nan = float("nan")
        return Summary(count=0, mean=nan, p50=nan, p90=nan, p95=nan, p99=nan)
    p50, p90, p95, p99 = (float(v) for v in np.percentile(x, [50, 90, 95, 99]))
    return Summary(count=int(x.size), mean=float(x.mean()), p50=p50, p90=p90, p95=p95, p99=p99)


def _run_origin(stream: pd.DataFrame) -> pd.Timestamp:
    """The run's wall origin: the earliest ``t_wall`` of its stream (``NaT`` for an empty one). Pure."""
    return pd.to_datetime(stream["t_wall"], utc=True).min() if len(stream) else pd.NaT


def _seconds(t_wall: pd.Series, origin: pd.Timestamp) -> pd.Series:
    """UTC datetimes → float seconds since ``origin`` (:func:`_run_origin`). Pure.

    Why not epoch seconds: a float near 1.8e9 has a step of 2.4e-7 s, so an E2E computed from two
    of them rounded differently depending on the wall time a run started at, and two policies with
    the same schedule (a tie) came out unequal in the last digits, which flipped tie-breaks (the
    best baseline) between runs. The difference from ``origin`` is taken in integer nanoseconds,
    so the same schedule gives bit-equal seconds whatever its origin."""
    return (pd.to_datetime(t_wall, utc=True) - origin) / pd.Timedelta(seconds=1)


def _of_kind(stream: pd.DataFrame, kind: str) -> pd.DataFrame:
    return stream.loc[stream["kind"] == kind]


def _per_session_sum(stream: pd.DataFrame, kind: str, column: str) -> pd.Series:
    rows = _of_kind(stream, kind)
    return rows.groupby("session_id")[column].sum(min_count=1).astype("float64")


def session_table(stream: pd.DataFrame, ideal_s: Mapping[str, float] | pd.Series | None = None) -> pd.DataFrame:
    """One row per session that has a ``session_start``, indexed by ``session_id``. Pure.

    Columns: ``arrival_s``, ``end_s`` (seconds from the run's first event, :func:`_run_origin`), ``e2e_s``, ``status`` and ``error`` (of
    ``session_end``, ``None`` if absent), ``is_complete``, ``num_turns`` (distinct turns with a ``finished`` event),
    ``tool_s``, ``tool_queue_wait_s``, ``num_preemptions``, and with ``ideal_s`` also ``ideal_s`` and
    ``slowdown``. See the module docstring for the definitions.

    Raises:
        ValueError: ``ideal_s`` is given but lacks completed sessions (the message lists some ids).
        KeyError: the frame lacks the ``kind``/``t_wall``/``session_id`` columns.
    """
    origin = _run_origin(stream)
    starts = _of_kind(stream, "session_start")
    table = pd.DataFrame({"arrival_s": _seconds(starts["t_wall"], origin).to_numpy()},
                         index=pd.Index(starts["session_id"].to_numpy(), name="session_id"))
    table = table.groupby(level=0).min()
    finished = _of_kind(stream, "finished").assign(t_s=lambda f: _seconds(f["t_wall"], origin))
    table["end_s"] = finished.groupby("session_id")["t_s"].max()
    table["e2e_s"] = table["end_s"] - table["arrival_s"]
    ends = _of_kind(stream, "session_end").groupby("session_id")
    for column in ("status", "error"):  # "error": absent from streams written before it existed
        last = ends[column].last() if column in stream.columns else pd.Series(dtype=object)
        table[column] = last.reindex(table.index).astype(object).where(lambda s: s.notna(), None)
    table["is_complete"] = (table["status"] == "ok") & table["end_s"].notna()
    table["num_turns"] = finished.groupby("session_id")["turn"].nunique().reindex(table.index).fillna(0).astype(int)
    table["tool_s"] = _per_session_sum(stream, "tool_end", "duration_s").reindex(table.index).fillna(0.0)
    table["tool_queue_wait_s"] = (
        _per_session_sum(stream, "tool_start", "queue_wait_s").reindex(table.index).fillna(0.0))
    table["num_preemptions"] = (
        _of_kind(stream, "preempted").groupby("session_id").size().reindex(table.index).fillna(0).astype(int))
    if ideal_s is not None:
        ideal = pd.Series(ideal_s, dtype="float64")
        missing = [s for s in table.index[table["is_complete"]] if s not in ideal.index]
        if missing:
            raise ValueError(f"ideal_s has no ideal time for {len(missing)} completed session(s), "
                             f"e.g. {missing[:5]}; compute ideals for every session of the workload")
        table["ideal_s"] = ideal.reindex(table.index)
        table["slowdown"] = table["e2e_s"] / table["ideal_s"]
    return table


def ttft_table(stream: pd.DataFrame) -> pd.DataFrame:
    """TTFT per turn: columns ``session_id``, ``turn``, ``request_id``, ``ttft_s``. Pure.

    One row per ``first_token`` event; requests without a session keep ``session_id`` ``None``.
    """
    rows = _of_kind(stream, "first_token")
    return rows[["session_id", "turn", "request_id", "ttft_s"]].reset_index(drop=True)


def _makespan_s(table: pd.DataFrame) -> float:
    done = table.loc[table["is_complete"]]
    if done.empty:
        return float("nan")
    return float(done["end_s"].max() - table["arrival_s"].min())


def goodput_per_s(table: pd.DataFrame, alpha: float, makespan_s: float | None = None) -> float:
    """Completed sessions with ``e2e_s <= alpha * ideal_s``, per second of makespan. Pure.

    Args:
        table: :func:`session_table` output with ``ideal_s``.
        alpha: SLO factor (> 0).
        makespan_s: override the makespan (default: from ``table``).

    Raises:
        ValueError: ``alpha <= 0`` or ``table`` has no ``ideal_s`` column.
    """
    if alpha <= 0:
        raise ValueError(f"goodput alpha must be > 0, got {alpha}")
    if "ideal_s" not in table.columns:
        raise ValueError("goodput needs ideal times: pass ideal_s to session_table()")
    makespan_s = _makespan_s(table) if makespan_s is None else makespan_s
    done = table.loc[table["is_complete"]]
    num_good = int((done["e2e_s"] <= alpha * done["ideal_s"]).sum())
    return num_good / makespan_s if makespan_s and makespan_s > 0 else float("nan")


def agent_ttft_table(stream: pd.DataFrame) -> pd.DataFrame:
    """Agent-side TTFT per turn (see the module docstring). Pure.

    Returns:
        Columns ``session_id``, ``turn``, ``ttft_s`` (seconds), one row per ``first_token`` event of a
        session (the earliest if a turn has several); requests without a session are left out.
    """
    first = _of_kind(stream, "first_token")
    first = first.loc[first["session_id"].notna()]
    if first.empty:
        return pd.DataFrame({"session_id": [], "turn": [], "ttft_s": []})
    origin = _run_origin(stream)
    first = (first.assign(t_s=_seconds(first["t_wall"], origin))
             .sort_values("t_s").drop_duplicates(["session_id", "turn"], keep="first"))
    starts = _of_kind(stream, "session_start")
    arrival = pd.Series(_seconds(starts["t_wall"], origin).to_numpy(), index=starts["session_id"].to_numpy())
    arrival = arrival.groupby(level=0).min()
    ends = _of_kind(stream, "tool_end")
    tool_end = pd.Series(_seconds(ends["t_wall"], origin).to_numpy(),
                         index=pd.MultiIndex.from_arrays([ends["session_id"].to_numpy(),
                                                          ends["turn"].to_numpy() + 1]))
    tool_end = tool_end.groupby(level=[0, 1]).max()
    turns = first["turn"].astype("int64").to_numpy()
    sids = first["session_id"].to_numpy()
    sent = [tool_end.get((sid, turn)) if turn > 0 else arrival.get(sid) for sid, turn in zip(sids, turns, strict=True)]
    sent_s = pd.Series([math.nan if v is None else float(v) for v in sent], index=first.index)
    ttft = (first["t_s"] - sent_s).where(sent_s.notna(), first["ttft_s"].astype("float64"))
    first_turn = first.groupby("session_id")["turn"].transform("min")
    is_first = first["turn"] == first_turn  # a stream may number turns from any start
    arrival_ttft = first["t_s"] - first["session_id"].map(arrival)
    ttft = ttft.where(~is_first | arrival_ttft.isna(), arrival_ttft)
    return pd.DataFrame({"session_id": sids, "turn": turns, "ttft_s": ttft.clip(lower=0.0).to_numpy()})


def ttft_slo_goodput(stream: pd.DataFrame, table: pd.DataFrame, slo_s: float,
                     makespan_s: float | None = None) -> tuple[float, float]:
    """``(share, per_s)`` of turns of completed sessions whose agent TTFT is ≤ ``slo_s``. Pure.

    Args:
        stream: the run's stream frame. table: its :func:`session_table`.
        slo_s: the TTFT SLO, seconds (> 0). makespan_s: override (default: from ``table``).

    Returns:
        Share of those turns (0..1) and their count per second of makespan; NaN when no turn of a
        completed session has a first token.

    Raises:
        ValueError: ``slo_s <= 0``.
    """
    if slo_s <= 0:
        raise ValueError(f"TTFT SLO must be > 0 s, got {slo_s}")
    ttft = agent_ttft_table(stream)
    done = set(table.index[table["is_complete"]])
    ttft = ttft.loc[ttft["session_id"].isin(done)]
    if ttft.empty:
        return float("nan"), float("nan")
    num_good = int((ttft["ttft_s"] <= slo_s).sum())
    makespan_s = _makespan_s(table) if makespan_s is None else makespan_s
    return num_good / len(ttft), (num_good / makespan_s if makespan_s and makespan_s > 0 else float("nan"))


def admission_wait_s(stream: pd.DataFrame) -> pd.Series:
    """Per session: its first ``first_scheduled`` − its arrival, seconds (see the module docstring). Pure.

    Sessions never scheduled are left out (their wait is unbounded; they count as incomplete).
    """
    origin = _run_origin(stream)
    starts = _of_kind(stream, "session_start")
    arrival = pd.Series(_seconds(starts["t_wall"], origin).to_numpy(), index=starts["session_id"].to_numpy())
    arrival = arrival.groupby(level=0).min()
    sched = _of_kind(stream, "first_scheduled")
    sched = sched.loc[sched["session_id"].isin(arrival.index)]
    first = pd.Series(_seconds(sched["t_wall"], origin).to_numpy(), index=sched["session_id"].to_numpy())
    first = first.groupby(level=0).min()
    return (first - arrival.reindex(first.index)).clip(lower=0.0).rename("admission_wait_s")


def reprefill_tokens(stream: pd.DataFrame) -> int:
    """Prompt tokens the engine computed again (see the module docstring). Pure.

    Needs ``finished`` (``num_prompt_tokens``, ``num_output_tokens``), ``first_scheduled``
    (``num_cached_tokens``) and ``preempted`` events; turns missing one of them add nothing.
    """
    fin = _of_kind(stream, "finished")
    fin = fin.loc[fin["session_id"].notna()].drop_duplicates(["session_id", "turn"], keep="last")
    sched = _of_kind(stream, "first_scheduled")
    sched = sched.loc[sched["session_id"].notna()].drop_duplicates(["session_id", "turn"], keep="first")
    total = 0
    if not fin.empty and not sched.empty:
        turns = fin.set_index(["session_id", "turn"])[["num_prompt_tokens", "num_output_tokens"]]
        prev = turns.copy()
        prev.index = pd.MultiIndex.from_arrays([prev.index.get_level_values(0),
                                                prev.index.get_level_values(1) + 1])
        cached = sched.set_index(["session_id", "turn"])["num_cached_tokens"].astype("float64")
        joined = turns.join(prev, rsuffix="_prev", how="inner").join(cached, how="inner")
        computed_before = np.minimum(joined["num_prompt_tokens"],
                                     joined["num_prompt_tokens_prev"] + joined["num_output_tokens_prev"] - 1)
        total += int((computed_before - joined["num_cached_tokens"]).clip(lower=0).sum())
    pre = _of_kind(stream, "preempted")
    if not pre.empty:
        computed = (pre["num_computed_tokens"].fillna(0).astype("int64") if "num_computed_tokens" in pre
                    else pd.Series(0, index=pre.index))
        prompt = pre["request_id"].map(fin.drop_duplicates("request_id").set_index("request_id")["num_prompt_tokens"]
                                       if not fin.empty else {}).fillna(0).astype("int64")
        total += int(computed.where(computed > 0, prompt).sum())
    return total


class KvRetentionStats(BaseModel):
    """KV retention outcomes from ``kv_retained`` / ``kv_released`` events (see module docstring)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    num_retained: int
    """``kv_retained`` events (extensions included)."""
    num_released: int
    """``kv_released`` events except reason ``"shutdown"`` (resolved retentions)."""
    num_hits: int
    """Resolved releases of which the next turn reused at least one block."""
    num_reused_blocks: int
    """Blocks the next turns reused, over all resolved releases."""
    hit_ratio: float | None
    """Reused tokens / retained tokens of the resolved releases (the module docstring); ``None``
    when nothing was released."""
    hit_block_ratio: float | None
    """Blocks released by ``"resumed"`` / blocks of all resolved releases: whole resumes, an
    upper bound of ``hit_ratio``."""
    resume_ratio: float | None
    """Releases by ``"resumed"`` / resolved releases."""
    released_by_reason: dict[str, int]


def kv_retention_stats(stream: pd.DataFrame) -> KvRetentionStats:
    """Count retentions, releases and hits (see the module docstring). Pure."""
    released = _of_kind(stream, "kv_released")
    resolved = released.loc[released["reason"] != NOT_A_RESOLUTION]
    resumes = resolved.loc[resolved["reason"] == "resumed"]
    measured = (resolved["num_reused_blocks"] if "num_reused_blocks" in resolved
                else pd.Series(np.nan, index=resolved.index, dtype=float))
    legacy = resolved["num_blocks"].where(resolved["reason"] == "resumed", 0)
    reused = measured.where(measured.notna(), legacy).astype(float)
    blocks = float(resolved["num_blocks"].sum())
    return KvRetentionStats(
        num_retained=int((stream["kind"] == "kv_retained").sum()),
        num_released=len(resolved),
        num_hits=int((reused > 0).sum()),
        num_reused_blocks=int(reused.sum()),
        hit_ratio=float(reused.sum()) / blocks if blocks > 0 else None,
        hit_block_ratio=float(resumes["num_blocks"].sum()) / blocks if blocks > 0 else None,
        resume_ratio=len(resumes) / len(resolved) if len(resolved) else None,
        released_by_reason={str(k): int(v) for k, v in released["reason"].value_counts().items()},
    )


class RunMetrics(BaseModel):
    """Everything design.md §7 asks of one run (times in seconds, rates per second)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    num_sessions: int
    """Sessions with a ``session_start``."""
    num_completed: int
    makespan_s: float
    throughput_sessions_per_s: float
    e2e_s: Summary
    ttft_s: Summary
    slowdown: Summary | None
    """E2E / ideal over completed sessions; ``None`` without ideal times."""
    goodput_per_s: dict[float, float] | None
    """alpha → goodput (sessions/s); ``None`` without ideal times."""
    tool_wait_share: float
    tool_queue_wait_share: float
    num_preemptions: int
    preemptions_per_request: float
    """``preempted`` events / ``finished`` events (NaN when nothing finished)."""
    kv_retention: KvRetentionStats
    ttft_slo: dict[float, tuple[float, float]]
    """SLO seconds → (share of turns, turns per second) with agent TTFT ≤ SLO (completed sessions)."""
    admission_wait_s: Summary
    """Per-session admission wait (arrival → first scheduled), seconds; ``max`` is ``admission_wait_max_s``."""
    admission_wait_max_s: float
    reprefill_tokens: int
    """Prompt tokens computed again (cross-turn KV loss + preemptions)."""


def compute_metrics(stream: pd.DataFrame, ideal_s: Mapping[str, float] | pd.Series | None = None,
                    alphas: Sequence[float] = DEFAULT_ALPHAS) -> RunMetrics:
    """Compute :class:`RunMetrics` of a recorded run. Pure.

    Args:
        stream: the run's stream frame (``read_stream(path)``).
        ideal_s: session_id → ideal E2E seconds; enables slowdown and goodput.
        alphas: goodput SLO factors to report.

    Raises:
        ValueError: ``ideal_s`` misses completed sessions, or an alpha <= 0.
    """
    table = session_table(stream, ideal_s)
    done = table.loc[table["is_complete"]]
    makespan_s = _makespan_s(table)
    e2e_total_s = float(done["e2e_s"].sum())
    num_finished = int((stream["kind"] == "finished").sum())
    num_preemptions = int((stream["kind"] == "preempted").sum())
    has_ideal = ideal_s is not None
    return RunMetrics(
        num_sessions=len(table),
        num_completed=len(done),
        makespan_s=makespan_s,
        throughput_sessions_per_s=len(done) / makespan_s if makespan_s > 0 else float("nan"),
        e2e_s=summarize(done["e2e_s"]),
        ttft_s=summarize(ttft_table(stream)["ttft_s"]),
        slowdown=summarize(done["slowdown"]) if has_ideal else None,
        goodput_per_s={float(a): goodput_per_s(table, a, makespan_s) for a in alphas} if has_ideal else None,
        tool_wait_share=_share(done["tool_s"].sum() + done["tool_queue_wait_s"].sum(), e2e_total_s),
        tool_queue_wait_share=_share(done["tool_queue_wait_s"].sum(), e2e_total_s),
        num_preemptions=num_preemptions,
        preemptions_per_request=num_preemptions / num_finished if num_finished else float("nan"),
        kv_retention=kv_retention_stats(stream),
        ttft_slo={float(slo): ttft_slo_goodput(stream, table, slo, makespan_s) for slo in TTFT_SLOS_S},
        admission_wait_s=summarize(waits := admission_wait_s(stream)),
        admission_wait_max_s=float(waits.max()) if len(waits) else float("nan"),
        reprefill_tokens=reprefill_tokens(stream),
    )


def _share(part: float, whole: float) -> float:
    return float(part) / whole if whole > 0 else float("nan")
