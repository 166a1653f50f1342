"""StepTimeModel, StepShape and the GPU profiles (mars_openhands.engine.harness.executor.timing/profiles).

Fast tests use a recording fake estimator; tests marked by ``needs_aic`` load NVIDIA's real
kernel data (aiconfigurator-core 0.12.0, ~5 s per model, cached per module).
"""

from __future__ import annotations

import functools
import importlib.metadata
import importlib.util
import json
from pathlib import Path

import pytest

from mars_openhands.engine.harness.executor.profiles import (
    GPUS,
    GpuProfile,
    estimate_kv_capacity,
    materialize_model_config,
    require_aiconfigurator,
)
from mars_openhands.engine.harness.executor.timing import (
    StepShape,
    StepTimeModel,
    StepTimeModelError,
    bucket_tokens,
)

needs_aic = pytest.mark.skipif(
    importlib.util.find_spec("aiconfigurator_core") is None,
    reason="needs aiconfigurator-core==0.12.0 (emulated-GPU extra)",
)


class RecordingEstimator:
    """Returns ``1 ms + 0.01 ms per new token + 0.001 ms per context token``; records calls."""

    def __init__(self, fail_above_tokens: int | None = None) -> None:
        self.calls: list[dict] = []
        self.fail_above_tokens = fail_above_tokens

    def estimate_forward_pass_time_ms(self, metrics: dict) -> float:
        s = metrics["scheduled_requests"]
        self.calls.append(dict(s))
        if self.fail_above_tokens is not None and s["sum_prefill_tokens"] > self.fail_above_tokens:
            raise ValueError("perf database error: out of range")
        return 1.0 + 0.01 * s["sum_prefill_tokens"] + 0.001 * s["sum_decode_kv_tokens"]


def fake_model(**profile: object) -> tuple[StepTimeModel, RecordingEstimator]:
    est = RecordingEstimator()
    return StepTimeModel(GpuProfile(**profile), estimator=est), est


# ---------------------------------------------------------------- bucketing and shapes
@pytest.mark.parametrize("n", [0, 1, 17, 255])
def test_small_sums_are_exact(n: int) -> None:
    assert bucket_tokens(n) == n


@pytest.mark.parametrize("n", [256, 257, 1000, 4097, 65_537, 1_000_003, 7_777_777])
def test_bucket_relative_error_is_below_one_percent(n: int) -> None:
    assert abs(bucket_tokens(n) - n) <= n / 128


def test_bucket_is_monotone() -> None:
    values = [bucket_tokens(n) for n in range(0, 20_000, 7)]
    assert values == sorted(values)


def test_from_requests_sums_per_phase() -> None:
    shape = StepShape.from_requests(prefill=[(100, 0), (50, 200)], decode_context_tokens=[10, 20])
    assert shape == StepShape(2, 150, 200, 2, 30)


def test_multi_prefill_total_rounds_down_to_multiple_of_count() -> None:
    # The estimator inflates totals not divisible by the prefill count (design.md §9).
    assert StepShape(3, 3002, 0, 0, 0).cache_key()[1] == 3000
    assert StepShape(1, 3001, 0, 0, 0).cache_key()[1] == 3001
    assert StepShape(2, 4000, 0, 0, 0).cache_key()[1] == 4000


@pytest.mark.parametrize(
    "shape",
    [StepShape(2, 1, 0, 0, 0), StepShape(0, 5, 0, 0, 0), StepShape(0, 0, 0, 3, 2),
     StepShape(1, 10, -1, 0, 0)],
)
def test_impossible_shapes_are_rejected(shape: StepShape) -> None:
    model, est = fake_model()
    with pytest.raises(StepTimeModelError):
        model.shape_time_s(shape)
    assert est.calls == []


# ---------------------------------------------------------------- calibration and caching
def test_step_time_is_scale_times_estimate_plus_overhead() -> None:
    model, _ = fake_model(scale=1.25, overhead_ms=2.0)
    # estimate = 1 + 0.01 * 1000 = 11 ms -> 1.25 * 11 + 2 = 15.75 ms
    assert model.step_time_s(prefill=[(1000, 0)]) == pytest.approx(0.01575)


def test_empty_step_costs_nothing_and_skips_the_estimator() -> None:
    model, est = fake_model()
    assert model.step_time_s() == 0.0
    assert est.calls == []


def test_estimator_receives_quirk_corrected_sums() -> None:
    model, est = fake_model()
    model.step_time_s(prefill=[(1001, 10), (1000, 20)], decode_context_tokens=[100, 120])
    assert est.calls == [{"num_prefill_requests": 2, "sum_prefill_tokens": 2000,
                          "sum_prefill_kv_tokens": 30, "num_decode_requests": 2,
                          "sum_decode_kv_tokens": 220}]


def test_repeated_and_nearby_steps_hit_the_cache() -> None:
    model, est = fake_model()
    first = model.step_time_s(decode_context_tokens=[5000] * 8)
    again = model.step_time_s(decode_context_tokens=[5000] * 7 + [5001])  # same bucket
    assert first == again
    assert len(est.calls) == 1
    assert model.cache_info().hits == 1


def test_missing_kernel_data_becomes_step_time_model_error() -> None:
    est = RecordingEstimator(fail_above_tokens=100)
    model = StepTimeModel(GpuProfile(), estimator=est)
    with pytest.raises(StepTimeModelError, match="new=200"):
        model.step_time_s(prefill=[(200, 0)])


def test_default_calibration_comes_from_the_table_and_can_be_overridden() -> None:
    default = GpuProfile(gpu="h100_sxm", model="qwen3-30b-a3b").calibration
    assert "23151" in default.source
    nvl = GpuProfile(gpu="h100_nvl", model="qwen3-coder-30b-a3b-instruct").calibration
    assert (nvl.scale, nvl.overhead_ms) == (default.scale, default.overhead_ms)
    explicit = GpuProfile(scale=2.0).calibration
    assert (explicit.scale, explicit.overhead_ms, explicit.source) == (2.0, default.overhead_ms,
                                                                      "explicit")


# ---------------------------------------------------------------- profiles
def test_unknown_gpu_lists_the_known_ones() -> None:
    with pytest.raises(ValueError, match="h100_nvl"):
        GpuProfile(gpu="a100_pcie")


def test_unknown_model_dtype_pair_is_rejected() -> None:
    with pytest.raises(ValueError, match="qwen3-30b-a3b/bf16"):
        GpuProfile(model="qwen3-30b-a3b", dtype="int4")


def test_unknown_key_is_rejected() -> None:
    with pytest.raises(ValueError, match="gpu_name"):
        GpuProfile(gpu_name="h100_sxm")


def test_nvl_has_more_memory_but_sxm_kernel_data() -> None:
    sxm, nvl = GpuProfile(gpu="h100_sxm"), GpuProfile(gpu="h100_nvl")
    assert nvl.aic_system == sxm.aic_system == "h100_sxm"
    assert nvl.memory_bytes_effective > sxm.memory_bytes_effective
    assert GpuProfile(memory_bytes=123).memory_bytes_effective == 123


def test_explicit_kv_budget_skips_the_memory_model() -> None:
    cap = estimate_kv_capacity(GpuProfile(kv_cache_memory_bytes=98_304 * 16 * 10))
    assert (cap.num_gpu_blocks, cap.num_tokens, cap.source) == (10, 160, "explicit")


def test_local_model_config_is_written_once(tmp_path: Path) -> None:
    spec = GpuProfile(model="qwen3-coder-30b-a3b-instruct").model_spec
    folder = Path(materialize_model_config(spec, root=tmp_path))
    config = json.loads((folder / "config.json").read_text())
    assert config["num_hidden_layers"] == 48 and config["num_key_value_heads"] == 4
    mtime = (folder / "config.json").stat().st_mtime_ns
    materialize_model_config(spec, root=tmp_path)
    assert (folder / "config.json").stat().st_mtime_ns == mtime


def test_missing_aiconfigurator_says_how_to_install(monkeypatch: pytest.MonkeyPatch) -> None:
    def missing(name: str) -> str:
        raise importlib.metadata.PackageNotFoundError(name)

    monkeypatch.setattr(importlib.metadata, "version", missing)
    with pytest.raises(ImportError, match=r"pip install aiconfigurator-core==0\.12\.0"):
        require_aiconfigurator()
    with pytest.raises(ImportError, match="aiconfigurator-core"):
        StepTimeModel(GpuProfile())


def test_other_aiconfigurator_version_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(importlib.metadata, "version", lambda name: "0.13.0")
    with pytest.raises(ImportError, match="0.13.0 is installed"):
        require_aiconfigurator()


# ---------------------------------------------------------------- real kernel data
@functools.cache
def real_model(gpu: str, model: str = "qwen3-30b-a3b", dtype: str = "bf16") -> StepTimeModel:
    return StepTimeModel(GpuProfile(gpu=gpu, model=model, dtype=dtype, scale=1.0,
                                    overhead_ms=0.0))


@needs_aic
@pytest.mark.parametrize(
    ("gpu", "prefill_ms", "decode_ms"),
    # design.md §9 sample estimates: prefill 1x2048; decode at 8k context, batch 1/8/32.
    [("h100_sxm", 46.0, (4.85, 12.5, 27.9)), ("h200_sxm", 40.4, (4.22, 9.75, 20.9))],
)
def test_real_estimates_match_the_design_samples(gpu: str, prefill_ms: float,
                                                 decode_ms: tuple[float, ...]) -> None:
    m = real_model(gpu)
    assert m.step_time_s(prefill=[(2048, 0)]) * 1000 == pytest.approx(prefill_ms, rel=0.01)
    for batch, expected in zip((1, 8, 32), decode_ms, strict=True):
        got = m.step_time_s(decode_context_tokens=[8192] * batch) * 1000
        assert got == pytest.approx(expected, rel=0.01)


@needs_aic
def test_real_mixed_step_costs_more_than_either_part() -> None:
    m = real_model("h100_sxm")
    prefill = m.step_time_s(prefill=[(1024, 4096)])
    decode = m.step_time_s(decode_context_tokens=[3000] * 16)
    mixed = m.step_time_s(prefill=[(1024, 4096)], decode_context_tokens=[3000] * 16)
    assert mixed > max(prefill, decode)


@needs_aic
def test_coder_config_gives_the_same_numbers_as_qwen3_30b() -> None:
    a = real_model("h100_sxm")
    b = real_model("h100_sxm", "qwen3-coder-30b-a3b-instruct")
    for kwargs in ({"prefill": [(2048, 0)]}, {"decode_context_tokens": [4096] * 8}):
        assert a.step_time_s(**kwargs) == b.step_time_s(**kwargs)


@needs_aic
def test_gpt_oss_has_data_on_both_gpus() -> None:
    for gpu in ("h100_sxm", "h200_sxm"):
        m = real_model(gpu, "gpt-oss-120b", "mxfp4")
        assert 0 < m.step_time_s(decode_context_tokens=[1500] * 4) < 0.05


@needs_aic
def test_real_kv_capacity_follows_memory() -> None:
    from aiconfigurator_core.sdk.memory import estimate_num_gpu_blocks

    sxm = estimate_kv_capacity(GpuProfile(gpu="h100_sxm"))
    # design.md §9: Qwen3-30B-A3B bf16 holds only ~118k tokens on one H100 SXM 80 GB.
    assert 117_000 < sxm.num_tokens < 119_500
    assert sxm.num_gpu_blocks == estimate_num_gpu_blocks(
        "Qwen/Qwen3-30B-A3B", "h100_sxm", "vllm", "0.24.0", scheduler_block_size=16,
        max_num_tokens=8192, max_batch_size=256, memory_fraction_kind="of_total",
        memory_fraction_value=0.9)
    nvl = estimate_kv_capacity(GpuProfile(gpu="h100_nvl"))
    extra_bytes = (GPUS["h100_nvl"].memory_bytes - GPUS["h100_sxm"].memory_bytes) * 0.9
    assert nvl.kv_bytes - sxm.kv_bytes == pytest.approx(extra_bytes, rel=0.01)
    h200 = estimate_kv_capacity(GpuProfile(gpu="h200_sxm"))
    assert 700_000 < h200.num_tokens < 730_000  # design.md §9: ~718k on H200 141 GB
