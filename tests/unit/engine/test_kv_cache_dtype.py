"""Deployment settings of a GPU profile (issue 31): the KV cache dtype (vLLM ``--kv-cache-dtype``)
and ``gpu_memory_utilization``, against aiconfigurator's memory model and kernel data, and the
emulated executor's KV spec."""

from __future__ import annotations

import importlib.util
from types import SimpleNamespace

import pytest

from mars_openhands.engine.harness.executor.profiles import GpuProfile, estimate_kv_capacity
from mars_openhands.engine.harness.executor.timing import StepTimeModel

needs_aic = pytest.mark.skipif(importlib.util.find_spec("aiconfigurator_core") is None,
                               reason="needs aiconfigurator-core (the emulated-GPU extra)")
CODER = "qwen3-coder-30b-a3b-instruct"


@pytest.mark.parametrize(("model", "dtype", "bf16_bytes"), [
    (CODER, "bf16", 98_304), ("gpt-oss-120b", "mxfp4", 36_864), ("qwen3-30b-a3b", "fp8", 98_304)])
def test_fp8_kv_halves_the_bytes_per_token(model: str, dtype: str, bf16_bytes: int) -> None:
    profile = {"model": model, "dtype": dtype}
    assert GpuProfile(**profile, kv_cache_dtype="bf16").kv_bytes_per_token == bf16_bytes
    assert GpuProfile(**profile, kv_cache_dtype="fp8").kv_bytes_per_token == bf16_bytes // 2


def test_no_kv_cache_dtype_keeps_the_models_own() -> None:
    assert GpuProfile(model=CODER).kv_bytes_per_token == 98_304
    assert GpuProfile(model="qwen3-30b-a3b", dtype="fp8").kv_bytes_per_token == 49_152  # FP8 checkpoint
    with pytest.raises(ValueError, match="kv_cache_dtype"):
        GpuProfile(kv_cache_dtype="fp4")


@needs_aic
def test_fp8_kv_doubles_the_kv_blocks_in_the_same_bytes() -> None:
    bf16 = estimate_kv_capacity(GpuProfile(gpu="h100_sxm", model=CODER))
    fp8 = estimate_kv_capacity(GpuProfile(gpu="h100_sxm", model=CODER, kv_cache_dtype="fp8"))
    assert fp8.kv_bytes == bf16.kv_bytes  # weights and activations do not change
    assert (bf16.num_gpu_blocks, fp8.num_gpu_blocks) == (7_396, 14_792)
    oss = estimate_kv_capacity(GpuProfile(gpu="h100_sxm", model="gpt-oss-120b", dtype="mxfp4",
                                          kv_cache_dtype="fp8"))
    assert oss.bytes_per_token == 18_432 and oss.num_tokens > 600_000  # aiconfigurator: 631,826


@needs_aic
def test_gpu_memory_utilization_moves_the_kv_pool() -> None:
    at = {u: estimate_kv_capacity(GpuProfile(gpu="h100_sxm", model=CODER, gpu_memory_utilization=u))
          for u in (0.9, 0.95)}
    # the 5% of 80 GiB vLLM may now use all goes to KV: 118k -> 162k tokens (+37%, issue 31)
    assert at[0.95].kv_bytes - at[0.9].kv_bytes == pytest.approx(0.05 * 80 * (1 << 30), rel=1e-6)
    assert (at[0.9].num_gpu_blocks, at[0.95].num_gpu_blocks) == (7_396, 10_127)


@needs_aic
def test_fp8_kv_step_times_come_from_the_fp8_kernels() -> None:
    def model(kv: str | None) -> StepTimeModel:
        return StepTimeModel(GpuProfile(gpu="h100_sxm", model=CODER, kv_cache_dtype=kv, overhead_ms=0.0))

    bf16, fp8, own = model("bf16"), model("fp8"), model(None)
    long_decode = {"decode_context_tokens": [65_536] * 8}
    # decode at long contexts reads half the KV bytes: 26.8 ms -> 19.4 ms (aiconfigurator, vLLM 0.24.0)
    assert fp8.step_time_s(**long_decode) < 0.8 * bf16.step_time_s(**long_decode)
    assert fp8.step_time_s(prefill=[(8192, 0)]) == pytest.approx(bf16.step_time_s(prefill=[(8192, 0)]), rel=0.1)
    assert own.step_time_s(**long_decode) == bf16.step_time_s(**long_decode)


@pytest.mark.parametrize(("kv", "bytes_per_token"), [(None, 98_304), ("fp8", 49_152)])
def test_emulated_kv_spec_has_the_profiles_bytes_per_token(kv: str | None, bytes_per_token: int) -> None:
    emulated = pytest.importorskip("mars_openhands.engine.harness.executor.emulated")
    config = emulated.EmulatedGpuConfig(model=CODER, kv_cache_dtype=kv)
    specs = emulated.EmulatedWorker.get_kv_cache_spec(SimpleNamespace(config=config))
    page_bytes = sum(s.page_size_bytes for s in specs.values())
    assert page_bytes == bytes_per_token * config.block_size
