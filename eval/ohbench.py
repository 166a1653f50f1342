"""``mars-openhands openhands bench``: end-to-end OpenHands task time across schedulers (MARS §6).

The MARS paper's deployment result is OpenHands task completion time on real repository tasks,
1.20–1.87× faster than the baselines (design.md §7): smaller than the serving-level gains because
the framework, tool and sandbox phases are not accelerated by GPU scheduling. This module measures
that number here: the same task set (:mod:`eval.task_sources`) runs as real OpenHands
conversations with real tools (:mod:`mars_openhands.openhands.runner`, one process and workspace
per task) against one serving backend per policy, each behind the real gateway as that policy is
deployed (``--admission auto``: MARS with the gateway's admission window, design.md §6 OpenHands
sizes W = 8/8/2; the baselines without it), at a fixed or Poisson arrival rate or a fixed
concurrency, seeds fixed. Policies run one after the other (one engine at a time).

Backends:

* ``emulated`` (no GPU): per policy, a vLLM server on the emulated-GPU executor (the real vLLM
  scheduler with the policy's ``--scheduler-cls``, GPU-faithful step times and KV capacity of
  ``--gpu`` × ``--model``, :mod:`eval.backends`), and in front of it the playback engine
  (:mod:`mars_openhands.openhands.playback`) serving each task's recorded assistant turns (its
  mini-swe-agent trace by ``instance_id``, else one from the pool) and forwarding each turn's
  prefill (the recorded prompt length, prefix-consistent) and decode (the recorded completion
  length) to the engine. The gateway fronts the playback engine; the tool events go to the
  engine's inbox and its telemetry to the gateway. The tools really run, in workspaces built from
  the tasks' local repositories.
* ``gpu``: per policy, a vLLM server with the real model (``--real-model``, its tool-call parser)
  and the policy's scheduler; the gateway fronts it directly and the agent's own choices drive
  the run.

Per task (``tasks.parquet``), from the runner's result, the SDK's per-call LLM latencies, the
engine's telemetry (through the gateway) and the playback's request log:

* ``task_s``: the conversation's wall time (first LLM call's admission wait included);
* ``llm_s``: Σ LLM call latencies as the agent saw them; ``tool_s`` / ``tool_queue_s``: Σ tool
  execution / tool queue time (``tool_end.duration_s``, ``tool_start.queue_wait_s``);
* ``engine_s``: Σ engine request time (``finished.e2e_s``: engine arrival → last token);
  ``engine_queue_s``: Σ engine queueing (``first_scheduled.prefill_start_delay_s``);
* ``gateway_wait_s``: Σ over calls of (agent latency − time the backend behind the gateway
  spent on it: the playback's handling time, or the engine's ``e2e_s`` for ``gpu``);
  ``admission_wait_s``: the part the gateway measured as waiting for an admission slot
  (``Gateway.admission_wait_s``); ``call_overhead_s`` = the rest (LiteLLM, HTTP, the proxy);
* phases, summing to ``task_s``: ``queue_s`` = ``admission_wait_s`` + ``engine_queue_s``;
  ``llm_compute_s`` = ``llm_s`` − ``queue_s`` − ``call_overhead_s`` (the engine's work and the
  playback's own time); ``call_overhead_s``; ``tool_phase_s`` = ``tool_s`` + ``tool_queue_s``;
  ``framework_s`` = ``task_s`` − ``llm_s`` − ``tool_phase_s`` (OpenHands' own time between calls:
  prompts, parsing, events);
* tokens: Σ engine prompt / output / prefix-cached tokens; preemptions.

Per policy (``summary.parquet``, ``summary.md``): tasks finished, task time mean / P50 / P95 /
P99, tool-wait share (Σ tool phase / Σ task time), LLM-wait share (Σ ``llm_s`` / Σ task time),
mean admission wait, tokens, the phase split, and each policy's ratio to the best baseline (the
baseline with the lowest mean task time; ratio = baseline / policy, > 1 = faster) next to the
paper's 1.20–1.87×. Plots: ``task_time_cdf.png`` and ``task_phases.png``.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import random
import re
import shutil
import socket
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import httpx
import numpy as np
import pandas as pd
from pydantic import BaseModel, ConfigDict, Field

from eval.backends import (
    BackendSpec,
    LiveBackend,
    LiveOptions,
    LiveServer,
    engine_flags,
    live_scheduler,
    telemetry_handshake,
)
from eval.policies import POLICIES, live_policy_config, merge_config, parse_policies
from eval.task_sources import BenchTask, materialize, safe_dir_name
from mars_openhands.control.config import GatewayConfig, ReplicaConfig
from mars_openhands.engine.harness.launch import VllmServer, VllmServerOptions
from mars_openhands.openhands.policy_check import is_safe_to_replay
from mars_openhands.policy.admission import AdmissionParams
from mars_openhands.stream.transport import ListSink

__all__ = [
    "PAPER_TASK_TIME_GAIN",
    "BenchOptions",
    "PolicyRun",
    "arrival_offsets_s",
    "assign_traces",
    "emulated_live_options",
    "is_install",
    "policy_summary",
    "ratio_table",
    "run_bench",
    "session_ids",
    "task_rows",
    "write_report",
]

PAPER_TASK_TIME_GAIN: tuple[float, float] = (1.20, 1.87)
"""The MARS paper's OpenHands task-time gain over the baselines (H100/H200; design.md §7)."""
OPENHANDS_WINDOW = {"window_max": 8, "window_init": 8, "window_min": 2}
"""The gateway's AIMD window for OpenHands runs (design.md §6: W_max / init / min = 8 / 8 / 2)."""
_REPO_ROOT = Path(__file__).resolve().parents[1]
DEFAULT_PLAYBACK_TRACES = _REPO_ROOT.parent / "shared" / "data" / "traces" / "mini-swe-agent" / "deepseek_chat_dev"
"""Recorded agent runs for playback (the bundled mini-swe-agent SWE-bench traces)."""
_SESSION_NAMESPACE = uuid.UUID("0b9c5a52-6d3c-4f57-9a53-6b7f7d1f1e17")
_INSTALL = re.compile(r"(?:^|[\s;&|(`])(?:sudo\s+)?(?:pip3?|python[\d.]*\s+-m\s+pip|uv\s+pip|conda|mamba|"
                      r"apt(?:-get)?|npm|yarn|pnpm|poetry|gem|cargo)\s+(?:install|add|uninstall|remove)\b")
"""A recorded command that installs or removes packages (``pip install numpy``, ``npm i`` is
not matched). Played back, it would change the host's interpreters (the tasks run on the host)
and reach package indexes; its turn is dropped instead."""
NO_INSTALL_ENV = {"PIP_NO_INDEX": "1", "PIP_CONFIG_FILE": os.devnull, "PIP_FIND_LINKS": "",
                  "UV_OFFLINE": "1", "npm_config_offline": "true"}
"""Environment of the task processes (inherited by their terminals): a package install that
still runs finds no index."""


def is_install(command: str) -> bool:
    """Whether ``command`` installs or removes packages (see :data:`_INSTALL`). Pure.

    >>> is_install("cd . && pip install -e ."), is_install("python -m pytest"), is_install("grep pip")
    (True, False, False)
    """
    return _INSTALL.search(command) is not None


class BenchOptions(BaseModel):
    """How ``openhands bench`` runs. Frozen; unknown keys are an error."""

    model_config = ConfigDict(frozen=True, extra="forbid", use_attribute_docstrings=True)

    policies: tuple[str, ...] = ("fcfs", "mars")
    """Policies of :data:`eval.policies.POLICIES`, run one after the other."""
    backend: Literal["emulated", "gpu"] = "emulated"
    """``emulated``: emulated-GPU vLLM + playback; ``gpu``: vLLM with ``real_model``."""
    rps: float | None = Field(0.2, gt=0)
    """Task arrivals per second (open loop); ignored with ``concurrency``."""
    concurrency: int | None = Field(None, ge=1)
    """Closed loop: this many tasks in flight, the next starting when one ends."""
    arrival: Literal["fixed", "poisson"] = "fixed"
    """Fixed gaps of 1/rps (MARS) or Poisson arrivals (seeded by ``seed``)."""
    seed: int = 0
    """Seeds the arrivals, the session ids (so prompts) and the pool traces' assignment."""
    admission: Literal["auto", "on", "off"] = "auto"
    """``auto``: the gateway's admission window for policies that come with it (mars,
    mars-preview), off for the baselines; ``on`` / ``off``: for every policy."""
    gpu: str = "h100_sxm"
    """Emulated GPU profile (``h100_sxm``, ``h100_nvl``, ``h200_sxm``, ``h200_nvl``)."""
    model: str = "qwen3-coder-30b-a3b-instruct"
    """Emulated model profile."""
    dtype: str = "bf16"
    """Emulated model's weight dtype key (``--model NAME/DTYPE``; with ``model``, a key of ``MODELS``)."""
    kv_cache_dtype: Literal["bf16", "fp8"] | None = None
    """Emulated KV cache dtype (``--kv-cache-dtype``); ``None`` = the model's own. Sets the KV
    blocks of the profile's capacity and the step times, as in ``compare`` (:mod:`eval.deployment`)."""
    gpu_memory_utilization: float = Field(0.9, gt=0.0, le=1.0)
    """Emulated ``--gpu-memory-utilization``: the KV pool of the profile's capacity."""
    num_gpu_blocks: int | None = Field(None, ge=2)
    """KV blocks (16 tokens) of the emulated engine; ``None``: the profile's capacity."""
    max_model_len_tokens: int = Field(32_768, ge=256)
    """``--max-model-len``."""
    engine_python: str | None = None
    """Python with vLLM (the engine env); ``None``: ``.venv/bin/python`` of the repository if it
    exists, else this interpreter."""
    traces_dir: Path | None = None
    """Recorded runs for playback (``*.traj.json[.gz]``); ``None``: :data:`DEFAULT_PLAYBACK_TRACES`."""
    max_turns: int | None = Field(20, ge=1)
    """Recorded turns per task (emulated); the playback then sends ``finish``."""
    max_prompt_tokens: int = Field(30_000, ge=1)
    """Cap on a played-back turn's prompt (below ``max_model_len_tokens``)."""
    max_completion_tokens: int = Field(1024, ge=1)
    """Cap on a played-back turn's decode length."""
    max_iterations: int = Field(100, ge=1)
    """Agent steps per task."""
    num_tool_workers: int = Field(16, ge=1)
    """The gateway's tool-worker count N_tool (its CPU backlog signal, design.md §6)."""
    task_timeout_s: float = Field(1800.0, gt=0)
    """Wall-clock limit per task, seconds."""
    startup_timeout_s: float = Field(900.0, gt=0)
    """Seconds a vLLM server may take to become ready."""
    real_model: str | None = None
    """``gpu``: the model to serve (a Hugging Face name or a local directory)."""
    tool_call_parser: str = "qwen3_coder"
    """``gpu``: vLLM's ``--tool-call-parser`` for ``real_model``."""
    engine_args: tuple[str, ...] = ()
    """``gpu``: more vLLM flags (e.g. ``--gpu-memory-utilization 0.9``)."""
    temperature: float | None = None
    top_p: float | None = None


# ----------------------------------------------------------------------------- pure helpers
def session_ids(tasks: Sequence[BenchTask], seed: int) -> dict[str, str]:
    """Task id → session (= conversation) UUID, the same for every policy. Pure."""
    return {t.task_id: str(uuid.uuid5(_SESSION_NAMESPACE, f"{seed}:{t.task_id}")) for t in tasks}


def arrival_offsets_s(num_tasks: int, rps: float, arrival: str, seed: int) -> list[float]:
    """Start offsets (seconds after the first task) of ``num_tasks`` arrivals at ``rps``. Pure.

    ``fixed``: ``i / rps``; ``poisson``: cumulative exponential gaps (mean ``1 / rps``), the first
    at 0, from ``random.Random(seed)``.

    >>> arrival_offsets_s(3, 2.0, "fixed", 0)
    [0.0, 0.5, 1.0]
    """
    if arrival == "fixed":
        return [i / rps for i in range(num_tasks)]
    rng = random.Random(seed)
    offsets, t = [], 0.0
    for i in range(num_tasks):
        if i:
            t += rng.expovariate(rps)
        offsets.append(t)
    return offsets


def assign_traces(tasks: Sequence[BenchTask], traces: Mapping[str, Path]) -> dict[str, Path]:
    """Task id → recorded run: its own (``trace_id``) if recorded, else one of the pool in turn
    (sorted by name; the i-th unmatched task gets pool[i mod size]). Pure.

    Raises:
        ValueError: ``traces`` is empty (names the flag).
    """
    if not traces:
        raise ValueError("no recorded runs to play back (--traces: a folder of "
                         "*.traj.json[.gz] mini-swe-agent trajectories)")
    pool = [traces[k] for k in sorted(traces)]
    out: dict[str, Path] = {}
    unmatched = 0
    for task in tasks:
        if task.trace_id is not None and task.trace_id in traces:
            out[task.task_id] = traces[task.trace_id]
        else:
            out[task.task_id] = pool[unmatched % len(pool)]
            unmatched += 1
    return out


def find_traces(traces_dir: Path) -> dict[str, Path]:
    """``instance_id`` (file name without ``.traj.json[.gz]``) → path, under ``traces_dir``.

    Raises:
        ValueError: ``traces_dir`` is not a directory.
    """
    if not traces_dir.is_dir():
        raise ValueError(f"--traces {traces_dir}: not a directory (the recorded runs to play "
                         "back; default: the bundled mini-swe-agent traces)")
    out = {}
    for path in sorted(traces_dir.rglob("*.traj.json*")):
        if path.name.endswith((".traj.json", ".traj.json.gz")):
            out.setdefault(path.name.split(".traj.json")[0], path)
    return out


def _sum(events: Sequence[Mapping[str, Any]], column: str) -> float:
    return float(sum(float(e.get(column) or 0.0) for e in events))


def task_rows(policy: str, is_admission_enabled: bool, results: Sequence[Mapping[str, Any]],
              events: Sequence[Mapping[str, Any]],
              requests: Sequence[Mapping[str, Any]] | None,
              admission_waits: Mapping[str, float] | None = None) -> pd.DataFrame:
    """One row per task of one policy's run (columns: the module docstring's). Pure.

    Args:
        policy: the policy label. is_admission_enabled: the gateway's window was on.
        results: the runner's ``TaskResult`` dumps (``session_id``, ``status``, ``wall_s``,
            ``llm_calls``, ``events`` (the task's CPU-plane events), ...).
        events: the gateway's stream as dicts (GPU-plane ``finished`` / ``first_scheduled`` /
            ``preempted`` with ``session_id`` and ``turn``).
        requests: the playback's request log (``response_id``, ``handle_s``); ``None``: no
            playback (the engine's ``e2e_s`` of the call's turn is what the backend spent).
        admission_waits: session → seconds its requests waited for a slot, as the gateway
            measured them (absent: never waited); ``None``: unknown, then the first call's
            ``gateway_wait`` stands in (where a session waits for its slot).
    """
    by_session: dict[str, dict[str, list[Mapping[str, Any]]]] = {}
    for e in events:
        if e.get("session_id") is not None:
            by_session.setdefault(e["session_id"], {}).setdefault(e["kind"], []).append(e)
    handle = {r["response_id"]: float(r["handle_s"]) for r in requests or () if "response_id" in r}
    rows = []
    for result in results:
        mine = by_session.get(result["session_id"], {})
        finished = mine.get("finished", [])
        engine_by_turn = {e.get("turn"): float(e.get("e2e_s") or 0.0) for e in finished}
        calls = result.get("llm_calls") or []
        backend_s = [handle.get(c["response_id"], 0.0) if requests is not None
                     else engine_by_turn.get(i, 0.0) for i, c in enumerate(calls)]
        waits = [max(0.0, float(c["latency_s"]) - b) for c, b in zip(calls, backend_s, strict=True)]
        cpu = result.get("events") or []
        tool_s = _sum([e for e in cpu if e.get("kind") == "tool_end"], "duration_s")
        tool_queue_s = _sum([e for e in cpu if e.get("kind") == "tool_start"], "queue_wait_s")
        llm_s = float(sum(float(c["latency_s"]) for c in calls))
        engine_queue_s = _sum(mine.get("first_scheduled", []), "prefill_start_delay_s")
        task_s = float(result.get("wall_s") or 0.0)
        gateway_wait_s = float(sum(waits))
        if admission_waits is not None:
            admission_s = min(gateway_wait_s, float(admission_waits.get(result["session_id"], 0.0)))
        else:
            admission_s = waits[0] if waits else 0.0
        overhead_s = gateway_wait_s - admission_s
        queue_s = admission_s + engine_queue_s
        rows.append({
            "policy": policy, "is_admission_enabled": is_admission_enabled,
            "task_id": result["task_id"], "session_id": result["session_id"],
            "status": result["status"], "is_finished": result["status"] == "finished",
            "task_s": task_s, "llm_s": llm_s, "tool_s": tool_s, "tool_queue_s": tool_queue_s,
            "engine_s": _sum(finished, "e2e_s"), "engine_queue_s": engine_queue_s,
            "gateway_wait_s": gateway_wait_s, "admission_wait_s": admission_s,
            "call_overhead_s": overhead_s, "queue_s": queue_s,
            "llm_compute_s": max(0.0, llm_s - queue_s - overhead_s),
            "tool_phase_s": tool_s + tool_queue_s,
            "framework_s": max(0.0, task_s - llm_s - tool_s - tool_queue_s),
            "num_llm_calls": len(calls), "num_tool_calls": int(result.get("num_tool_calls") or 0),
            "num_engine_requests": len(finished),
            "num_prompt_tokens": int(_sum(finished, "num_prompt_tokens")),
            "num_output_tokens": int(_sum(finished, "num_output_tokens")),
            "num_cached_tokens": int(_sum(mine.get("first_scheduled", []), "num_cached_tokens")),
            "num_preemptions": len(mine.get("preempted", [])),
            "error": result.get("error"),
        })
    return pd.DataFrame(rows)


SUMMARY_COLUMNS = ("policy", "is_admission_enabled", "num_tasks", "num_finished", "task_mean_s",
                   "task_p50_s", "task_p95_s", "task_p99_s", "tool_wait_share", "llm_wait_share",
                   "queue_share", "admission_wait_mean_s", "llm_compute_mean_s", "queue_mean_s",
                   "call_overhead_mean_s", "tool_phase_mean_s", "framework_mean_s",
                   "num_prompt_tokens",
                   "num_output_tokens", "num_cached_tokens", "num_preemptions")
"""Columns of ``summary.parquet`` (one row per policy)."""


def policy_summary(tasks: pd.DataFrame) -> pd.DataFrame:
    """Per-policy summary of :func:`task_rows` frames (columns :data:`SUMMARY_COLUMNS`). Pure.

    Times are over *finished* tasks (a task that errored or timed out has no completion time);
    shares are Σ part / Σ task time over them; tokens and preemptions over all tasks.
    """
    rows = []
    for policy, frame in tasks.groupby("policy", sort=False):
        done = frame[frame["is_finished"]]
        times = done["task_s"].to_numpy(dtype=float)
        total = float(times.sum())

        def pct(q: float, values: np.ndarray = times) -> float:
            return float(np.percentile(values, q)) if len(values) else math.nan

        def share(column: str, done: pd.DataFrame = done, total: float = total) -> float:
            return float(done[column].sum()) / total if total > 0 else math.nan

        rows.append({
            "policy": policy, "is_admission_enabled": bool(frame["is_admission_enabled"].iloc[0]),
            "num_tasks": len(frame), "num_finished": len(done),
            "task_mean_s": float(times.mean()) if len(times) else math.nan,
            "task_p50_s": pct(50), "task_p95_s": pct(95), "task_p99_s": pct(99),
            "tool_wait_share": share("tool_phase_s"), "llm_wait_share": share("llm_s"),
            "queue_share": share("queue_s"),
            "admission_wait_mean_s": float(done["admission_wait_s"].mean()) if len(done) else math.nan,
            **{f"{c}_mean_s": float(done[f"{c}_s"].mean()) if len(done) else math.nan
               for c in ("llm_compute", "queue", "call_overhead", "tool_phase", "framework")},
            "num_prompt_tokens": int(frame["num_prompt_tokens"].sum()),
            "num_output_tokens": int(frame["num_output_tokens"].sum()),
            "num_cached_tokens": int(frame["num_cached_tokens"].sum()),
            "num_preemptions": int(frame["num_preemptions"].sum()),
        })
    return pd.DataFrame(rows, columns=list(SUMMARY_COLUMNS))


_RATIO_METRICS = (("task_mean_s", "mean"), ("task_p50_s", "P50"), ("task_p95_s", "P95"),
                  ("task_p99_s", "P99"))


def ratio_table(summary: pd.DataFrame, baselines: Sequence[str]) -> pd.DataFrame:
    """Each policy's task-time ratio to the best baseline (lowest mean among ``baselines``). Pure.

    Ratio = baseline value / policy value per metric (mean, P50, P95, P99): > 1 means the policy
    finishes tasks faster, the sense of the paper's 1.20–1.87×. Empty when no baseline ran.
    Columns: ``policy``, ``best_baseline``, ``mean``, ``P50``, ``P95``, ``P99``.
    """
    ran = summary[summary["policy"].isin(baselines) & summary["task_mean_s"].notna()]
    if ran.empty:
        return pd.DataFrame(columns=["policy", "best_baseline", *(n for _, n in _RATIO_METRICS)])
    best = ran.loc[ran["task_mean_s"].idxmin()]
    rows = [{"policy": row["policy"], "best_baseline": best["policy"],
             **{name: float(best[col]) / float(row[col]) if row[col] and row[col] > 0 else math.nan
                for col, name in _RATIO_METRICS}} for _, row in summary.iterrows()]
    return pd.DataFrame(rows)


# ----------------------------------------------------------------------------- report
def _fmt(value: Any, digits: int = 3) -> str:
    if isinstance(value, float):
        return "–" if math.isnan(value) else f"{value:.{digits}g}"
    return str(value)


def _table(header: Sequence[str], rows: Sequence[Sequence[Any]]) -> list[str]:
    return ["| " + " | ".join(header) + " |", "|" + "---|" * len(header),
            *("| " + " | ".join(_fmt(v) for v in row) + " |" for row in rows)]


def render_summary(tasks: pd.DataFrame, summary: pd.DataFrame, ratios: pd.DataFrame,
                   meta: Mapping[str, Any]) -> str:
    """``summary.md``: parameters, task times, shares, phases, ratios next to the paper's. Pure."""
    label = {r["policy"]: r["policy"] + (" (+ admission)" if r["is_admission_enabled"] else "")
             for _, r in summary.iterrows()}
    lines = ["# OpenHands task time across schedulers", ""]
    lines += [f"- {k}: {v}" for k, v in meta.items()] + [""]
    lines += ["## Task completion time (finished tasks)", ""]
    lines += _table(["policy", "finished", "mean (s)", "P50 (s)", "P95 (s)", "P99 (s)",
                     "tool-wait share", "LLM-wait share", "admission wait mean (s)",
                     "prompt tokens", "output tokens", "cached tokens", "preemptions"],
                    [[label[r["policy"]], f"{r['num_finished']}/{r['num_tasks']}", r["task_mean_s"],
                      r["task_p50_s"], r["task_p95_s"], r["task_p99_s"], r["tool_wait_share"],
                      r["llm_wait_share"], r["admission_wait_mean_s"], r["num_prompt_tokens"],
                      r["num_output_tokens"], r["num_cached_tokens"], r["num_preemptions"]]
                     for _, r in summary.iterrows()])
    lines += ["", "## Where task time goes (mean per finished task, seconds)", "",
              "queue = the gateway's admission wait + engine queueing; LLM = the engine's work "
              "(and the playback's own time); call overhead = the rest of the agent's LLM wait "
              "(LiteLLM, HTTP, the proxy); tool = execution + tool queue; framework = OpenHands "
              "between calls.", ""]
    lines += _table(["policy", "queue", "LLM", "call overhead", "tool", "framework", "total"],
                    [[label[r["policy"]], r["queue_mean_s"], r["llm_compute_mean_s"],
                      r["call_overhead_mean_s"], r["tool_phase_mean_s"], r["framework_mean_s"],
                      r["task_mean_s"]] for _, r in summary.iterrows()])
    low, high = PAPER_TASK_TIME_GAIN
    lines += ["", "## Against the best baseline (baseline time / policy time; > 1 = faster)", ""]
    if ratios.empty:
        lines += ["No baseline ran, so there is no ratio."]
    else:
        lines += [f"Best baseline: {ratios['best_baseline'].iloc[0]} (lowest mean task time). "
                  f"The paper: OpenHands task time {low:.2f}–{high:.2f}× faster than the baselines "
                  "(H100/H200, Qwen3-Coder-30B-A3B-Instruct and GPT-OSS-120B).", ""]
        lines += _table(["policy", "mean", "P50", "P95", "P99", "paper"],
                        [[label.get(r["policy"], r["policy"]), r["mean"], r["P50"], r["P95"],
                          r["P99"], f"{low:.2f}–{high:.2f}×"] for _, r in ratios.iterrows()])
    failed = tasks[~tasks["is_finished"]]
    if not failed.empty:
        lines += ["", "## Tasks that did not finish", ""]
        lines += _table(["policy", "task", "status", "error"],
                        [[r["policy"], r["task_id"], r["status"], str(r["error"] or "")[:160]]
                         for _, r in failed.iterrows()])
    return "\n".join(lines) + "\n"


def write_report(out_dir: Path, tasks: pd.DataFrame, baselines: Sequence[str],
                 meta: Mapping[str, Any]) -> dict[str, Path]:
    """Write ``tasks.parquet``, ``summary.parquet``, ``ratios.parquet``, ``summary.md`` and the
    plots into ``out_dir``; return the paths by name.

    Mutates: files in ``out_dir`` (each replaced whole).
    """
    out_dir.mkdir(parents=True, exist_ok=True)
    summary = policy_summary(tasks)
    ratios = ratio_table(summary, baselines)
    paths = {"tasks": out_dir / "tasks.parquet", "summary": out_dir / "summary.parquet",
             "ratios": out_dir / "ratios.parquet", "summary_md": out_dir / "summary.md"}
    tasks.to_parquet(paths["tasks"], index=False)
    summary.to_parquet(paths["summary"], index=False)
    ratios.to_parquet(paths["ratios"], index=False)
    paths["summary_md"].write_text(render_summary(tasks, summary, ratios, meta))
    paths.update(write_plots(out_dir, tasks, summary))
    return paths


def write_plots(out_dir: Path, tasks: pd.DataFrame, summary: pd.DataFrame) -> dict[str, Path]:
    """``task_time_cdf.png`` (finished tasks' time, per policy) and ``task_phases.png`` (mean
    queue / LLM / tool / framework seconds per policy, stacked)."""
    import matplotlib  # ~1 s to import, and only the report draws: not at module level

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    cdf = out_dir / "task_time_cdf.png"
    fig, ax = plt.subplots(figsize=(6, 4))
    for policy, frame in tasks[tasks["is_finished"]].groupby("policy", sort=False):
        times = np.sort(frame["task_s"].to_numpy(dtype=float))
        ax.step(times, np.arange(1, len(times) + 1) / len(times), where="post", label=policy)
    ax.set_xlabel("task completion time (s)")
    ax.set_ylabel("fraction of tasks")
    ax.set_title("OpenHands task completion time")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(cdf, dpi=120)
    plt.close(fig)
    phases = out_dir / "task_phases.png"
    fig, ax = plt.subplots(figsize=(6, 4))
    bottom = np.zeros(len(summary))
    for column, name in (("queue_mean_s", "queue"), ("llm_compute_mean_s", "LLM"),
                         ("call_overhead_mean_s", "LLM-call overhead"),
                         ("tool_phase_mean_s", "tool"), ("framework_mean_s", "framework")):
        values = summary[column].fillna(0.0).to_numpy(dtype=float)
        ax.bar(summary["policy"], values, bottom=bottom, label=name)
        bottom += values
    ax.set_ylabel("mean seconds per finished task")
    ax.set_title("Where OpenHands task time goes")
    ax.legend()
    fig.tight_layout()
    fig.savefig(phases, dpi=120)
    plt.close(fig)
    return {"task_time_cdf": cdf, "task_phases": phases}


# ----------------------------------------------------------------------------- live runs
@dataclass
class PolicyRun:
    """What one policy's run produced (inputs of :func:`task_rows`)."""

    policy: str
    is_admission_enabled: bool
    results: list[dict[str, Any]] = field(default_factory=list)
    events: list[dict[str, Any]] = field(default_factory=list)
    requests: list[dict[str, Any]] | None = None
    admission_waits: dict[str, float] = field(default_factory=dict)
    server_startup_s: float = math.nan
    run_s: float = math.nan


class _PlaybackThread:
    """The playback engine on a uvicorn server in a background thread (port chosen free)."""

    def __init__(self, app: Any) -> None:
        import uvicorn  # the control extra; only the emulated backend serves a playback engine

        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            self.port = int(s.getsockname()[1])
        self._server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=self.port,
                                                     log_level="warning", access_log=False))
        self._thread = threading.Thread(target=self._server.run, name="playback", daemon=True)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def __enter__(self) -> _PlaybackThread:
        self._thread.start()
        deadline = time.monotonic() + 30.0
        while not self._server.started:
            if not self._thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError(f"the playback engine did not start on {self.url}")
            time.sleep(0.02)
        return self

    def __exit__(self, *exc_info: object) -> None:
        self._server.should_exit = True
        self._thread.join(timeout=30)


def default_engine_python() -> str:
    """``<repo>/.venv/bin/python`` (the engine env of scripts/setup.sh) if present, else this one."""
    candidate = _REPO_ROOT / ".venv" / "bin" / "python"
    return str(candidate) if candidate.exists() else sys.executable


def admission_for(policy: str, admission: str) -> bool:
    """Whether ``policy`` runs behind the gateway's admission window (``auto``: as deployed)."""
    return admission == "on" or (admission == "auto" and POLICIES[policy].has_control_plane)


@contextlib.contextmanager
def _engine(policy: str, options: BenchOptions, log_dir: Path,
            num_gpu_blocks: int | None) -> Iterator[Any]:
    """``policy``'s vLLM server (emulated or real), stopped on exit; yields its ``LiveServer``."""
    python = options.engine_python or default_engine_python()
    if options.backend == "emulated":
        live = emulated_live_options(options, num_gpu_blocks, log_dir, python)
        with LiveBackend(BackendSpec("emulated"), live, live_policy_config()) as backend:
            yield backend.server_for(policy)
        return
    with _gpu_server(policy, options, python, log_dir) as server:
        yield server


def emulated_live_options(options: BenchOptions, num_gpu_blocks: int | None, log_dir: Path,
                          python: str) -> LiveOptions:
    """The emulated engine's :class:`eval.backends.LiveOptions`: the GPU and model profile, the
    weight and KV cache dtypes and the memory utilization of ``options``, ``num_gpu_blocks``. Pure."""
    return LiveOptions(num_gpu_blocks=num_gpu_blocks or 2, gpu=options.gpu, model=options.model,
                       dtype=options.dtype, kv_cache_dtype=options.kv_cache_dtype,
                       gpu_memory_utilization=options.gpu_memory_utilization,
                       max_model_len_tokens=options.max_model_len_tokens,
                       startup_timeout_s=options.startup_timeout_s, log_dir=log_dir, engine_python=python)


@contextlib.contextmanager
def _gpu_server(policy: str, options: BenchOptions, python: str, log_dir: Path) -> Iterator[Any]:
    with tempfile.TemporaryDirectory(prefix="mbench-") as tmp:
        server_options = gpu_server_options(policy, options, python, Path(tmp), log_dir)
        server = VllmServer(server_options).start()
        mars = server_options.additional_config["mars"]
        try:
            yield LiveServer(policy, server.url, server.model, mars["telemetry"]["addr"],
                          mars["inbox_addr"], server.stop)
        finally:
            server.stop()


def gpu_server_options(policy: str, options: BenchOptions, python: str, sockets_dir: Path,
                       log_dir: Path) -> Any:
    """``VllmServerOptions`` of ``policy``'s real-model server (``gpu``). Pure.

    The real weights (``load_format auto``), the model's tool-call parser (without it the tool
    calls come back as text), prefix caching, the policy's scheduler and its telemetry / inbox
    addresses.

    Raises:
        ValueError: ``real_model`` is not set.
    """
    if not options.real_model:
        raise ValueError("--backend gpu needs --real-model (e.g. Qwen/Qwen3-Coder-30B-A3B-Instruct)")
    spec = POLICIES[policy]
    tag = policy.replace("-", "_")
    mars = {"telemetry": {"addr": f"ipc://{sockets_dir}/gpu-{tag}.sock"},
            "inbox_addr": f"ipc://{sockets_dir}/inbox-{tag}.sock"}
    return VllmServerOptions(
        model_dir=Path(options.real_model), served_model_name=options.real_model,
        python_executable=python, scheduler_cls=live_scheduler(spec.scheduler),
        additional_config=merge_config(dict(spec.additional_config), {"mars": mars}),
        max_model_len=options.max_model_len_tokens, enable_prefix_caching=True, dtype="auto",
        enforce_eager=False, load_format="auto", startup_timeout_s=options.startup_timeout_s,
        extra_args=("--enable-auto-tool-choice", "--tool-call-parser", options.tool_call_parser,
                    *engine_flags(spec.engine, options.max_model_len_tokens), *options.engine_args),
        log_path=log_dir / f"server-{policy}.log")


def _gateway_config(replica_url: str, server: Any, is_admission_enabled: bool,
                    options: BenchOptions) -> Any:
    return GatewayConfig(
        port=0, replicas=(ReplicaConfig(url=replica_url, events_address=server.inbox_addr),),
        is_admission_enabled=is_admission_enabled, admission=AdmissionParams(**OPENHANDS_WINDOW),
        num_tool_workers=options.num_tool_workers, engine_events_address=server.telemetry_addr,
        poll_interval_s=0.2, admission_wait_timeout_s=options.task_timeout_s,
        upstream_read_timeout_s=options.task_timeout_s,
        session_idle_timeout_s=max(300.0, options.task_timeout_s))


def _task_specs(tasks: Sequence[BenchTask], sessions: Mapping[str, str], work_dir: Path) -> list[Any]:
    from mars_openhands.openhands.runner import TaskSpec  # the OpenHands SDK (.venv-openhands only)

    specs = []
    for task in tasks:
        fields = materialize(task, work_dir / safe_dir_name(task.task_id))
        specs.append(TaskSpec(task_id=safe_dir_name(task.task_id),
                              problem_statement=task.problem_statement,
                              session_id=sessions[task.task_id], **fields))
    return specs


def _wait_for_telemetry(events: list[Any], settle_s: float = 1.5, timeout_s: float = 15.0) -> None:
    """Wait until the gateway's stream stops growing for ``settle_s`` (the engine's last
    ``finished`` events are batched), at most ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    count, since = len(events), time.monotonic()
    while time.monotonic() < deadline:
        time.sleep(0.1)
        if len(events) != count:
            count, since = len(events), time.monotonic()
        elif time.monotonic() - since >= settle_s:
            return


def run_policy(policy: str, tasks: Sequence[BenchTask], scripts: Sequence[Any],
               options: BenchOptions, out_dir: Path, num_gpu_blocks: int | None,
               log: Callable[[str], None] = print) -> PolicyRun:
    """Run every task on ``policy``'s backend behind the gateway; return what was recorded.

    Starts the engine (and for ``emulated`` the playback engine with ``scripts``), the gateway
    (its admission window per :func:`admission_for`), runs the tasks with
    :func:`mars_openhands.openhands.runner.run_tasks` at the options' arrivals or concurrency,
    then stops everything. Per-task output goes to ``out_dir/tasks/<task_id>/``; the gateway's
    stream to ``out_dir/stream.jsonl``.

    Raises:
        mars_openhands.engine.harness.launch.VllmServerError: the engine did not start.
        RuntimeError: its telemetry never reached the gateway.
    """
    # Not at module level: uvicorn + FastAPI (the control extra, ~1 s) and the OpenHands SDK
    # (.venv-openhands only), which the report functions above do without.
    from mars_openhands.control.server import GatewayServer
    from mars_openhands.openhands.llm import LLMSettings
    from mars_openhands.openhands.playback import PlaybackConfig, build_playback_app
    from mars_openhands.openhands.runner import RunConfig, run_tasks

    is_admission = admission_for(policy, options.admission)
    run = PolicyRun(policy, is_admission)
    sessions = session_ids(tasks, options.seed)
    t_start = time.monotonic()
    shutil.rmtree(out_dir / "workspaces", ignore_errors=True)  # a rerun starts from fresh copies
    with contextlib.ExitStack() as stack:
        server = stack.enter_context(_engine(policy, options, out_dir.parent / "server-logs",
                                             num_gpu_blocks))
        run.server_startup_s = time.monotonic() - t_start
        replica_url, model = server.url, server.model
        playback = None
        if options.backend == "emulated":
            config = PlaybackConfig(upstream_url=server.url, upstream_model=server.model,
                                    upstream_prompt="recorded",
                                    max_prompt_tokens=options.max_prompt_tokens,
                                    max_completion_tokens=options.max_completion_tokens,
                                    upstream_timeout_s=options.task_timeout_s)
            playback = stack.enter_context(_PlaybackThread(build_playback_app(scripts, config)))
            replica_url, model = playback.url, config.served_model_name
        sink = ListSink()
        gateway = stack.enter_context(GatewayServer(
            _gateway_config(replica_url, server, is_admission, options), sink))
        telemetry_handshake(server, sink.events)
        log(f"[{policy}] engine ready in {run.server_startup_s:.0f} s; gateway {gateway.url} "
            f"(admission {'on' if is_admission else 'off'}); running {len(tasks)} tasks")
        specs = _task_specs(tasks, sessions, out_dir / "workspaces")
        run_config = RunConfig(
            llm=LLMSettings(backend="mars", base_url=gateway.base_url, model=model,
                            temperature=options.temperature, top_p=options.top_p),
            out_dir=str(out_dir / "tasks"), max_iterations=options.max_iterations,
            task_timeout_s=options.task_timeout_s)
        offsets = (arrival_offsets_s(len(specs), options.rps or 1.0, options.arrival, options.seed)
                   if options.concurrency is None else None)
        t_run = time.monotonic()
        results = run_tasks(specs, run_config, rps=options.rps or 1.0, python=sys.executable,
                            overwrite=True, start_offsets_s=offsets,
                            concurrency=options.concurrency, extra_env=NO_INSTALL_ENV)
        run.run_s = time.monotonic() - t_run
        _wait_for_telemetry(sink.events)
        if playback is not None:
            run.requests = httpx.get(f"{playback.url}/playback/requests", timeout=30).json()["requests"]
        run.admission_waits = dict(gateway.gateway.admission_wait_s)
        run.results = [r.model_dump(mode="json") for r in results]
        run.events = [e.model_dump(mode="json") for e in list(sink.events)]
    (out_dir / "stream.jsonl").write_text("".join(json.dumps(e) + "\n" for e in run.events))
    return run


def profile_kv_blocks(python: str, gpu: str, model: str, dtype: str = "bf16", kv_cache_dtype: str | None = None,
                      gpu_memory_utilization: float = 0.9) -> int:
    """KV blocks (16 tokens) of ``gpu`` × ``model`` (weights ``dtype``, KV ``kv_cache_dtype``, ``None``
    = the model's own, at ``gpu_memory_utilization``) from the engine env's capacity model.

    Runs ``python`` (the engine env: the estimate needs ``aiconfigurator-core``).

    Raises:
        RuntimeError: the estimate failed (names the interpreter and its error).
    """
    profile = (f"GpuProfile(gpu={gpu!r}, model={model!r}, dtype={dtype!r}, kv_cache_dtype={kv_cache_dtype!r}, "
               f"gpu_memory_utilization={gpu_memory_utilization!r})")
    code = ("from mars_openhands.engine.harness.executor.profiles import GpuProfile, estimate_kv_capacity\n"
            f"c = estimate_kv_capacity({profile})\n"
            "print(c.kv_bytes // (c.bytes_per_token * c.block_size))")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(_REPO_ROOT), os.environ.get("PYTHONPATH", "")])}
    done = subprocess.run([python, "-c", code], capture_output=True, text=True, env=env, timeout=300)
    if done.returncode != 0:
        last = (done.stderr.strip().splitlines() or ["no output"])[-1]
        raise RuntimeError(f"KV capacity of {gpu} x {model} via {python} failed: {last}; pass "
                           "--kv-blocks")
    return int(done.stdout.strip().splitlines()[-1])


def _scripts(tasks: Sequence[BenchTask], options: BenchOptions) -> list[Any]:
    """Each task's playback script, bound to its session id (emulated backend)."""
    from mars_openhands.openhands.playback import load_trace_script  # FastAPI: the control extra

    traces = assign_traces(tasks, find_traces(options.traces_dir or DEFAULT_PLAYBACK_TRACES))
    sessions = session_ids(tasks, options.seed)
    scripts = []
    for task in tasks:
        script = load_trace_script(traces[task.task_id], options.max_turns,
                                   lambda c: is_safe_to_replay(c) and not is_install(c))
        scripts.append(script.model_copy(update={"session_id": sessions[task.task_id],
                                                 "name": f"{task.task_id}<-{script.name}"}))
    return scripts


def run_bench(tasks: Sequence[BenchTask], options: BenchOptions, out_dir: Path,
              log: Callable[[str], None] = print) -> pd.DataFrame:
    """Run the task set on every policy in turn and write the report into ``out_dir``.

    Returns the per-task frame (all policies). A policy whose run raises is logged and skipped
    (the report keeps the others); the report is rewritten after each policy.

    Raises:
        ValueError: no tasks, an unknown policy, or no recorded runs for ``emulated``.
    """
    if not tasks:
        raise ValueError("no tasks to run (check --tasks and --limit)")
    policies = parse_policies(options.policies)
    scripts = _scripts(tasks, options) if options.backend == "emulated" else []
    blocks = options.num_gpu_blocks
    if options.backend == "emulated" and blocks is None:
        blocks = profile_kv_blocks(options.engine_python or default_engine_python(), options.gpu,
                                   options.model, options.dtype, options.kv_cache_dtype,
                                   options.gpu_memory_utilization)
    if blocks is not None and blocks * 16 < options.max_model_len_tokens + 16:
        # vLLM refuses to start when one max-length request does not fit (with a margin: 1024
        # blocks did not hold --max-model-len 16384, "estimated maximum model length 16368").
        raise ValueError(f"--kv-blocks {blocks} holds {blocks * 16} tokens, not one "
                         f"--max-model-len {options.max_model_len_tokens} request; use --kv-blocks "
                         f">= {options.max_model_len_tokens // 16 + 1} or a smaller --max-model-len")
    kv_dtype = options.kv_cache_dtype or "of the model"
    arrivals = (f"closed loop, {options.concurrency} in flight" if options.concurrency
                else f"{options.arrival} at {options.rps:g} tasks/s (seed {options.seed})")
    meta = {"tasks": f"{len(tasks)} ({', '.join(sorted({t.source for t in tasks}))})",
            "backend": (f"emulated {options.gpu} x {options.model}/{options.dtype} (KV cache {kv_dtype}, "
                        f"gpu-memory-utilization {options.gpu_memory_utilization:g}), KV {blocks} blocks of 16 "
                        "tokens; playback of recorded turns (recorded prompt/decode lengths)"
                        if options.backend == "emulated" else f"gpu, {options.real_model}"),
            "arrivals": arrivals, "admission": options.admission}
    frames: list[pd.DataFrame] = []
    baselines = [p for p in policies if POLICIES[p].is_baseline]
    for policy in policies:
        try:
            run = run_policy(policy, tasks, scripts, options, out_dir / policy, blocks, log)
        except Exception as e:  # one policy's failure must not lose the others' results
            log(f"[{policy}] failed: {type(e).__name__}: {e}")
            continue
        frames.append(task_rows(policy, run.is_admission_enabled, run.results, run.events,
                                run.requests, run.admission_waits))
        meta[f"{policy} run"] = (f"{run.run_s:.0f} s wall (engine start {run.server_startup_s:.0f} s)")
        write_report(out_dir, pd.concat(frames, ignore_index=True), baselines, meta)
        log(f"[{policy}] done in {run.run_s:.0f} s; report in {out_dir / 'summary.md'}")
    return pd.concat(frames, ignore_index=True) if frames else pd.DataFrame()
