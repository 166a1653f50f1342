"""GPU check: vLLM's real decode and prefill step times on your GPU against the emulator's model.

The emulated GPU (the simulator and the emulated executor) times every engine step with
``scale × aiconfigurator estimate + overhead_ms`` (docs/timing.md §1, §3). This script is how to
check that model on a real GPU, and how to calibrate it for a GPU or model it was not fitted on
(issue 31, item 4). Two halves:

* ``measure`` (needs an NVIDIA GPU and the GPU build of vLLM; nothing is downloaded): starts an
  in-process vLLM engine on the model profile's ``config.json`` with **dummy weights**
  (``load_format="dummy"``, no tokenizer), and for each batch × context (default batch 1, 2, 4, 8
  × contexts 8k, 16k, 32k, 64k) sends ``batch`` requests of ``context`` random prompt tokens and
  times every ``engine.step()`` (one forward pass each: async scheduling and multiprocessing off)
  until each has decoded ``--decode-steps`` tokens. Writes one JSON line per step after one
  ``meta`` line (GPU name, vLLM version, the engine's KV blocks).
* ``compare`` (runs anywhere with aiconfigurator-core, e.g. here): reads that file and puts each
  point next to the model: the **prefill phase** (every step until each request has its first
  token, against the same steps as vLLM's scheduler packs them into the token budget) and the
  **median decode step** (against the median of the model's pure-decode steps at those contexts), the KV blocks
  vLLM allocated against the profile's memory model, and a least-squares ``scale`` and
  ``overhead_ms`` over the decode steps: the numbers to put into ``CALIBRATIONS`` in
  ``mars_openhands/engine/harness/executor/profiles.py`` for that GPU × model.

Usage (on the GPU machine; the second command also runs here on the copied file)::

    python scripts/gpu_check.py measure --model qwen3-coder-30b-a3b-instruct --out runs/gpu-check/steps.jsonl
    python scripts/gpu_check.py compare runs/gpu-check/steps.jsonl --gpu h100_sxm

Mental model of the prefill packing (vLLM v1's scheduler: running requests first, in order, each
taking what it still needs up to the step's token budget; decode takes one token)::

    budget 8192, batch 2, context 12288:
    step 0 | r0 prefill 8192 (cached 0)                 |
    step 1 | r0 prefill 4096 (cached 8192) | r1 4096     |  r0 has its first token
    step 2 | r0 decode 1   | r1 prefill 8191 (cached 4096) |
    step 3 | r0 decode 1   | r1 prefill 1 (cached 12287)   |  r1 has its first token: decode phase

Decode step ``k`` after that phase attends ``context + 1 + k`` tokens per request (requests that
finished their prefill earlier are a few tokens ahead: ignored, < 0.1% of 8k).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

SCHEMA = 1
"""Version of the JSONL the ``measure`` half writes."""
DEFAULT_BATCHES = (1, 2, 4, 8)
DEFAULT_CONTEXTS = (8192, 16384, 32768, 65536)
DEFAULT_BUDGET_TOKENS = 8192
"""vLLM's GPU default ``max_num_batched_tokens``, as the profiles assume (``GpuProfile``)."""
_STEP_KEYS = ("batch", "context_tokens", "phase", "index", "wall_s")
_META_KEYS = ("device", "vllm", "model", "kv_cache_dtype", "gpu_memory_utilization",
              "max_num_batched_tokens", "num_gpu_blocks")


# --------------------------------------------------------------------------- the recorded sample
@dataclass(frozen=True)
class StepRecord:
    """One timed ``engine.step()``.

    Attributes:
        batch: requests sent together. context_tokens: prompt tokens of each.
        phase: ``"prefill"`` (some request still lacks its first token) or ``"decode"``.
        index: the step's number within its phase (0-based).
        wall_s: wall seconds of the step (schedule + forward + sampling + output processing).
    """

    batch: int
    context_tokens: int
    phase: str
    index: int
    wall_s: float


@dataclass(frozen=True)
class Sample:
    """A ``measure`` file: its ``meta`` facts and its steps in file order."""

    meta: dict[str, Any]
    steps: tuple[StepRecord, ...]

    def points(self) -> list[tuple[int, int]]:
        """The (batch, context_tokens) points measured, in file order. Pure."""
        return list(dict.fromkeys((s.batch, s.context_tokens) for s in self.steps))

    def of(self, batch: int, context_tokens: int, phase: str) -> list[StepRecord]:
        """The steps of one point and phase, by index. Pure."""
        return sorted((s for s in self.steps if (s.batch, s.context_tokens, s.phase) ==
                       (batch, context_tokens, phase)), key=lambda s: s.index)


def _step_record(row: dict[str, Any], where: str) -> StepRecord:
    missing = [k for k in _STEP_KEYS if k not in row]
    if missing:
        raise ValueError(f"{where}: step record lacks {missing}; expected keys {list(_STEP_KEYS)}")
    record = StepRecord(int(row["batch"]), int(row["context_tokens"]), str(row["phase"]),
                        int(row["index"]), float(row["wall_s"]))
    if record.phase not in ("prefill", "decode"):
        raise ValueError(f"{where}: phase must be 'prefill' or 'decode', got {record.phase!r}")
    if min(record.batch, record.context_tokens) < 1 or record.index < 0 or not record.wall_s > 0:
        raise ValueError(f"{where}: batch and context_tokens must be >= 1, index >= 0 and "
                         f"wall_s > 0, got {row}")
    return record


def load_sample(path: str | Path) -> Sample:
    """Parse a ``measure`` file (JSON lines: one ``meta``, then ``step`` records).

    Raises:
        ValueError: a line that is not JSON, an unknown ``kind``, a step lacking a key or out of
            range, a missing or second ``meta``, another schema, or no steps; the message names
            ``path:line``.
        OSError: the file cannot be read.
    """
    meta: dict[str, Any] | None = None
    steps: list[StepRecord] = []
    for number, line in enumerate(Path(path).read_text(encoding="utf-8").splitlines(), start=1):
        where = f"{path}:{number}"
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as exc:
            raise ValueError(f"{where}: not JSON ({exc.msg}); is this a gpu_check measure file?") from None
        kind = row.get("kind") if isinstance(row, dict) else None
        if kind == "meta":
            if meta is not None:
                raise ValueError(f"{where}: a second meta record; one measure run per file")
            if row.get("schema") != SCHEMA:
                raise ValueError(f"{where}: schema {row.get('schema')!r}, this script reads {SCHEMA}")
            meta = row
        elif kind == "step":
            steps.append(_step_record(row, where))
        else:
            raise ValueError(f"{where}: kind must be 'meta' or 'step', got {kind!r}")
    if meta is None or not steps:
        raise ValueError(f"{path}: no meta record or no steps; rerun `gpu_check.py measure`")
    absent = [k for k in _META_KEYS if k not in meta]
    if absent:
        raise ValueError(f"{path}: meta record lacks {absent}")
    return Sample(meta, tuple(steps))


# ------------------------------------------------------------------------------- the model side
class StepModel(Protocol):
    """What the comparison needs of ``mars_openhands.engine.harness.executor.timing.StepTimeModel``."""

    scale: float
    overhead_s: float

    def step_time_s(self, prefill: Iterable[tuple[int, int]] = (),
                    decode_context_tokens: Sequence[int] = ()) -> float:
        """Calibrated seconds of one step."""

    def decode_step_time_s(self, num_decode_requests: int, decode_context_tokens: int) -> float:
        """Calibrated seconds of a pure-decode step (``decode_context_tokens`` summed)."""


Step = tuple[list[tuple[int, int]], list[int]]
"""One packed step: ``(prefill (new, cached) per request, decode context per request)``."""


def prefill_steps(batch: int, context_tokens: int, budget_tokens: int = DEFAULT_BUDGET_TOKENS) -> list[Step]:
    """The steps vLLM's scheduler runs until each of ``batch`` requests of ``context_tokens`` prompt
    tokens has its first token (module docstring's diagram). Pure.

    Raises:
        ValueError: a count or the budget below 1.
    """
    if min(batch, context_tokens, budget_tokens) < 1:
        raise ValueError(f"batch, context and budget must be >= 1, got {batch}, {context_tokens}, "
                         f"{budget_tokens}")
    computed = [0] * batch  # prompt tokens in KV per request; == context once prefilled
    decoded = [0] * batch   # tokens decoded after the first
    steps: list[Step] = []
    while min(computed) < context_tokens:
        budget, prefill, decode = budget_tokens, [], []
        for i in range(batch):
            if budget == 0:
                break
            if computed[i] == context_tokens:
                decode.append(context_tokens + 1 + decoded[i])
                decoded[i] += 1
                budget -= 1
                continue
            chunk = min(context_tokens - computed[i], budget)
            prefill.append((chunk, computed[i]))
            computed[i] += chunk
            budget -= chunk
        steps.append((prefill, decode))
    return steps


@dataclass(frozen=True)
class Row:
    """One measured point next to the model (seconds)."""

    batch: int
    context_tokens: int
    measured_prefill_s: float
    modelled_prefill_s: float
    measured_decode_s: float
    modelled_decode_s: float
    num_prefill_steps: int
    num_decode_steps: int

    @property
    def prefill_ratio(self) -> float:
        """Measured / modelled prefill phase."""
        return self.measured_prefill_s / self.modelled_prefill_s

    @property
    def decode_ratio(self) -> float:
        """Measured / modelled median decode step."""
        return self.measured_decode_s / self.modelled_decode_s


def compare_sample(sample: Sample, model: StepModel) -> list[Row]:
    """Each measured point next to ``model``'s times for the same steps. Pure (``model`` aside).

    Raises:
        ValueError: a point without prefill or decode steps.
    """
    budget = int(sample.meta["max_num_batched_tokens"])
    rows = []
    for batch, context in sample.points():
        prefill, decode = sample.of(batch, context, "prefill"), sample.of(batch, context, "decode")
        if not prefill or not decode:
            raise ValueError(f"point batch {batch} × context {context}: {len(prefill)} prefill and "
                             f"{len(decode)} decode steps; both phases are needed")
        plan = prefill_steps(batch, context, budget)
        modelled_prefill = sum(model.step_time_s(p, d) for p, d in plan)
        modelled_decode = [model.decode_step_time_s(batch, batch * (context + 1 + s.index)) for s in decode]
        rows.append(Row(batch, context, sum(s.wall_s for s in prefill), modelled_prefill,
                        statistics.median(s.wall_s for s in decode), statistics.median(modelled_decode),
                        len(prefill), len(decode)))
    return rows


def fit_decode_calibration(sample: Sample, model: StepModel) -> tuple[float, float]:
    """Least-squares ``(scale, overhead_ms)`` with ``measured = scale × estimate + overhead`` over
    every decode step, where ``estimate`` is ``model``'s uncalibrated time. Pure.

    Raises:
        ValueError: fewer than two distinct estimates (one point cannot fix two unknowns).
    """
    xs, ys = [], []
    for s in sample.steps:
        if s.phase == "decode":
            modelled = model.decode_step_time_s(s.batch, s.batch * (s.context_tokens + 1 + s.index))
            xs.append((modelled - model.overhead_s) / model.scale)
            ys.append(s.wall_s)
    mean_x, mean_y = (statistics.fmean(xs), statistics.fmean(ys)) if xs else (0.0, 0.0)
    var_x = sum((x - mean_x) ** 2 for x in xs)
    if len(xs) < 2 or var_x <= 0:
        raise ValueError("need decode steps at two or more batch sizes or contexts to fit scale and overhead")
    scale = sum((x - mean_x) * (y - mean_y) for x, y in zip(xs, ys, strict=True)) / var_x
    return scale, (mean_y - scale * mean_x) * 1000.0


def worst_gap(rows: Sequence[Row]) -> float:
    """The largest ``|measured / modelled - 1|`` over every point's prefill and decode. Pure."""
    return max((abs(x - 1) for r in rows for x in (r.prefill_ratio, r.decode_ratio)), default=0.0)


def render(sample: Sample, rows: list[Row], fit: tuple[float, float] | None, model: StepModel,
           profile_blocks: int | None, tolerance: float) -> str:
    """The comparison as Markdown: facts, one row per point, KV blocks, the fit, a verdict. Pure."""
    meta = sample.meta
    lines = [f"GPU check: {meta['device']}, vLLM {meta['vllm']}, {meta['model']}, KV {meta['kv_cache_dtype']}, "
             f"budget {meta['max_num_batched_tokens']} tokens; model: scale {model.scale:g}, "
             f"overhead {model.overhead_s * 1000:g} ms", "",
             "| batch | context | prefill measured (s) | modelled (s) | ratio | decode step measured (ms) "
             "| modelled (ms) | ratio |", "|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        lines.append(f"| {r.batch} | {r.context_tokens} | {r.measured_prefill_s:.4g} | {r.modelled_prefill_s:.4g} "
                     f"| {r.prefill_ratio:.3f} | {r.measured_decode_s * 1000:.4g} | "
                     f"{r.modelled_decode_s * 1000:.4g} | {r.decode_ratio:.3f} |")
    lines.append("")
    if profile_blocks is not None:
        lines.append(f"KV blocks: vLLM allocated {meta['num_gpu_blocks']}, the profile's memory model says "
                     f"{profile_blocks} ({int(meta['num_gpu_blocks']) / profile_blocks:.3f}×)")
    if fit is not None:
        lines.append(f"Decode fit (least squares over every decode step): scale {fit[0]:.3f}, overhead "
                     f"{fit[1]:.3f} ms: put these into CALIBRATIONS for this GPU × model")
    worst = worst_gap(rows)
    verdict = "within" if worst <= tolerance else "OUTSIDE"
    lines.append(f"Largest gap {worst:.1%}: {verdict} the ±{tolerance:.0%} tolerance.")
    return "\n".join(lines) + "\n"


# ---------------------------------------------------------------------------- the GPU side
def _model_dir(model: str, dtype: str, root: Path) -> Path:
    """A folder with the model profile's ``config.json`` (vLLM loads dummy weights from it)."""
    from mars_openhands.engine.harness.executor.profiles import MODELS, materialize_model_config

    spec = MODELS[(model, dtype)]
    if spec.local_config is not None:
        return Path(materialize_model_config(spec, root))
    import aiconfigurator_core

    bundled = Path(aiconfigurator_core.__file__).parent / "model_configs"
    source = bundled / f"{spec.aic_model.replace('/', '--')}_config.json"
    folder = root / spec.name
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(source.read_text(encoding="utf-8"), encoding="utf-8")
    return folder


def _engine(args: argparse.Namespace, deployment: Any, model_dir: Path, block_size: int = 16) -> Any:
    """An in-process vLLM engine (no multiprocessing, no async scheduling: one step per call);
    ``block_size`` 16 as the profiles assume (the CPU build, in tests, needs a multiple of 32)."""
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    from vllm import EngineArgs
    from vllm.v1.engine.llm_engine import LLMEngine

    kv = {None: "auto", "bf16": "bfloat16", "fp8": "fp8"}[deployment.kv_cache_dtype]
    return LLMEngine.from_engine_args(EngineArgs(
        model=str(model_dir), load_format="dummy", skip_tokenizer_init=True, kv_cache_dtype=kv,
        gpu_memory_utilization=deployment.gpu_memory_utilization, enable_prefix_caching=False,
        max_model_len=max(args.contexts) + args.decode_steps + 16, max_num_batched_tokens=args.budget,
        max_num_seqs=max(args.batches), async_scheduling=False, block_size=block_size))


def _measure_point(engine: Any, batch: int, context: int, decode_steps: int, vocab: int,
                   seed: int) -> list[dict[str, Any]]:
    """Time every step of ``batch`` requests of ``context`` random tokens (distinct per request)."""
    import random

    from vllm import SamplingParams

    rng = random.Random(seed)
    params = SamplingParams(max_tokens=decode_steps + 1, ignore_eos=True, detokenize=False, temperature=0.0)
    for i in range(batch):
        tokens = [rng.randrange(100, vocab - 100) for _ in range(context)]
        engine.add_request(f"b{batch}-c{context}-{i}", {"prompt_token_ids": tokens}, params)
    started: set[str] = set()
    records, index = [], {"prefill": 0, "decode": 0}
    while engine.has_unfinished_requests():
        phase = "prefill" if len(started) < batch else "decode"
        t0 = time.perf_counter()
        outputs = engine.step()
        wall_s = time.perf_counter() - t0
        records.append({"kind": "step", "batch": batch, "context_tokens": context, "phase": phase,
                        "index": index[phase], "wall_s": wall_s})
        index[phase] += 1
        started.update(o.request_id for o in outputs if o.outputs and o.outputs[0].token_ids)
    return records


def measure(args: argparse.Namespace) -> int:
    """The ``measure`` subcommand: run every point on the GPU, write the JSONL, return 0.

    Raises:
        RuntimeError: no CUDA device or no GPU build of vLLM (the message says so).
    """
    import torch

    if not torch.cuda.is_available():
        raise RuntimeError("measure needs an NVIDIA GPU and the GPU build of vLLM (scripts/setup.sh installs "
                           "it where nvidia-smi sees a GPU); run `compare` on its output anywhere")
    import vllm

    from eval.deployment import deployment_from_args

    deployment = deployment_from_args(args)
    model_dir = _model_dir(deployment.model, deployment.dtype, Path(args.out).parent / "model")
    engine = _engine(args, deployment, model_dir)
    vocab = int(json.loads((model_dir / "config.json").read_text())["vocab_size"])
    _measure_point(engine, 1, 512, 4, vocab, seed=0)  # warm-up: first-call allocations, graphs
    meta = {"kind": "meta", "schema": SCHEMA, "device": torch.cuda.get_device_name(), "vllm": vllm.__version__,
            "model": f"{deployment.model}/{deployment.dtype}", "kv_cache_dtype": deployment.kv_dtype,
            "gpu_memory_utilization": deployment.gpu_memory_utilization, "max_num_batched_tokens": args.budget,
            "num_gpu_blocks": engine.vllm_config.cache_config.num_gpu_blocks}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    with open(args.out, "w", encoding="utf-8") as out:
        out.write(json.dumps(meta) + "\n")
        for context in args.contexts:
            for batch in args.batches:
                for record in _measure_point(engine, batch, context, args.decode_steps, vocab, seed=batch * context):
                    out.write(json.dumps(record) + "\n")
                print(f"measured batch {batch} × context {context}", file=sys.stderr)
    print(f"wrote {args.out}; next: python scripts/gpu_check.py compare {args.out} --gpu <profile>")
    return 0


def compare(args: argparse.Namespace) -> int:
    """The ``compare`` subcommand: print the Markdown of :func:`render`; 0 within tolerance, else 1.

    Raises:
        ValueError: a bad file (:func:`load_sample`) or a model profile this checkout lacks.
    """
    from eval.deployment import Deployment, parse_model
    from mars_openhands.engine.harness.executor.profiles import GpuProfile, estimate_kv_capacity
    from mars_openhands.engine.harness.executor.timing import StepTimeModel

    sample = load_sample(args.sample)
    model, dtype = parse_model(str(sample.meta["model"]))
    kv = str(sample.meta["kv_cache_dtype"])
    own = Deployment(model, dtype).kv_dtype
    deployment = Deployment(model, dtype, None if kv == own else kv, float(sample.meta["gpu_memory_utilization"]))
    profile = deployment.profile(args.gpu).model_dump()
    profile = GpuProfile(**{**profile, "scale": args.scale, "overhead_ms": args.overhead_ms})
    step_model = StepTimeModel(profile)
    rows = compare_sample(sample, step_model)
    try:
        fit = fit_decode_calibration(sample, step_model)
    except ValueError:
        fit = None
    blocks = estimate_kv_capacity(profile).num_gpu_blocks
    text = render(sample, rows, fit, step_model, blocks, args.tolerance)
    print(text, end="")
    return 0 if worst_gap(rows) <= args.tolerance else 1


def build_parser() -> argparse.ArgumentParser:
    """The command line (one-line errors naming the flag, as every mars-openhands command)."""
    from eval.argtypes import non_negative_float, positive_float, positive_int, positive_ints
    from eval.deployment import add_deployment_flags
    from mars_openhands.cli_style import CliParser

    parser = CliParser(prog="gpu_check.py", description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    m = sub.add_parser("measure", help="time vLLM's steps on this machine's GPU (dummy weights)")
    add_deployment_flags(m)
    m.add_argument("--batches", type=positive_ints, default=DEFAULT_BATCHES, help="requests per point (default 1,2,4,8)")
    m.add_argument("--contexts", type=positive_ints, default=DEFAULT_CONTEXTS,
                   help="prompt tokens per request (default 8192,16384,32768,65536)")
    m.add_argument("--decode-steps", type=positive_int, default=32, help="decode steps timed per point (default 32)")
    m.add_argument("--budget", type=positive_int, default=DEFAULT_BUDGET_TOKENS,
                   help="max_num_batched_tokens (default 8192, vLLM's GPU default and the profiles')")
    m.add_argument("--out", default="runs/gpu-check/steps.jsonl", help="JSONL to write")
    c = sub.add_parser("compare", help="compare a measure file with the emulator's step-time model")
    c.add_argument("sample", help="the JSONL `measure` wrote")
    c.add_argument("--gpu", required=True, help="GPU profile key to compare with (h100_sxm, h200_sxm, ...)")
    c.add_argument("--scale", type=positive_float, default=None, help="try another scale (default: the profile's)")
    c.add_argument("--overhead-ms", type=non_negative_float, default=None,
                   help="try another per-step overhead in ms (default: the profile's)")
    c.add_argument("--tolerance", type=positive_float, default=0.15,
                   help="largest |measured / modelled - 1| that passes (default 0.15)")
    return parser


def main(argv: list[str] | None = None) -> int:
    """Run the command line; 0 ok, 1 outside tolerance, 2 bad input."""
    from mars_openhands.cli_style import cli_error

    args = build_parser().parse_args(argv)
    try:
        return measure(args) if args.command == "measure" else compare(args)
    except (ValueError, OSError, RuntimeError, ImportError) as exc:
        return cli_error(f"gpu_check.py {args.command}", str(exc))


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # eval/ from a checkout
    sys.exit(main())
