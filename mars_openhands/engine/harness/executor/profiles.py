"""Emulated-GPU profiles: which GPU, which model, which dtype, and what follows from them.

A profile names the hardware and model an emulated engine stands for (design.md §9). It fixes
three things the emulated executor and the simulator need:

* the **kernel data** used for step times: NVIDIA AIConfigurator's measured vLLM 0.24.0 kernel
  latencies for an ``aic_system`` (``h100_sxm``, ``h200_sxm``) and an ``aic_model`` (a Hugging
  Face id bundled with ``aiconfigurator-core`` or a local folder holding a ``config.json``);
* the **calibration** ``step = scale × estimate + overhead_ms`` that closes the gap between the
  kernel-only estimate and measured end-to-end vLLM runs (the defaults and their sources are in
  :data:`CALIBRATIONS` and docs/timing.md);
* the **KV capacity** the GPU would have: the bytes left for KV after weights, activations and
  runtime overhead at ``gpu_memory_utilization`` of the GPU's memory, as AIConfigurator's vLLM
  memory model computes it (:func:`estimate_kv_capacity`). The H100 NVL has 94 GB instead of the
  SXM's 80 GB, so capacity follows the profile's memory and not the kernel-data system.

Mental model: a profile is a *name plus numbers*. Everything heavy (loading kernel tables, the
memory model) happens in :mod:`.timing` or :func:`estimate_kv_capacity`, never on import, so this
module imports with pydantic only. The pinned AIConfigurator release is named here too
(:data:`AIC_PACKAGE_VERSION`, checked by :func:`require_aiconfigurator`), so :mod:`.timing` depends
on this module and never the other way round.

KV geometry (one layer, one block; the bytes per token must match what AIConfigurator assumes)::

    bytes_per_token = 2 (K and V) × num_kv_heads × head_dim × kv_dtype_bytes × num_layers
    Qwen3-30B-A3B bf16:  2 × 4 × 128 × 2 × 48 = 98,304 bytes/token
    gpt-oss-120b (bf16 KV):  2 × 8 × 64 × 2 × 18 = 36,864 bytes/token (18 full-attention
                             layers; the 18 sliding-window layers hold a constant 128 tokens)
    num_gpu_blocks = floor(kv_bytes / (bytes_per_token × block_size))

A profile's ``kv_cache_dtype`` (vLLM's ``--kv-cache-dtype``) overrides the model's own KV dtype:
``fp8`` stores one byte per element (Qwen3-Coder 49,152 bytes/token, gpt-oss-120b 18,432), so the
same KV bytes hold twice the tokens; the step times then use aiconfigurator's fp8-KV attention
kernels (measured for vLLM 0.24.0 on H100/H200 SXM: decode reads half the bytes, prefill
attention is a few percent slower).
"""

from __future__ import annotations

import json
import tempfile
from dataclasses import dataclass, replace
from importlib import metadata
from pathlib import Path
from types import MappingProxyType
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

__all__ = [
    "AIC_BACKEND",
    "AIC_BACKEND_VERSION",
    "AIC_PACKAGE_VERSION",
    "CALIBRATIONS",
    "GPUS",
    "MODELS",
    "Calibration",
    "GpuProfile",
    "GpuSpec",
    "KV_CACHE_DTYPES",
    "KvCapacity",
    "ModelSpec",
    "estimate_kv_capacity",
    "materialize_model_config",
    "require_aiconfigurator",
]

AIC_PACKAGE_VERSION = "0.12.0"
"""The pinned ``aiconfigurator-core`` release; its kernel data changes between releases."""
AIC_BACKEND = "vllm"
AIC_BACKEND_VERSION = "0.24.0"
"""vLLM release whose kernels AIConfigurator 0.12.0 measured (the newest vLLM data it ships)."""

_KV_TOKENS_TOLERANCE = 0.01
"""Allowed relative gap between aiconfigurator's token capacity and the profile geometry's."""
KV_CACHE_DTYPES: MappingProxyType[str, tuple[int, str]] = MappingProxyType(
    {"bf16": (2, "bfloat16"), "fp8": (1, "fp8")}
)
"""KV cache dtype key -> (bytes per element, aiconfigurator's name for it)."""
_GIB = 1 << 30
_MIB = 1 << 20


def require_aiconfigurator() -> None:
    """Check that the pinned ``aiconfigurator-core`` is importable.

    Raises:
        ImportError: it is missing or another version is installed; the message gives the
            install command.
    """
    fix = (
        f"install it with `pip install aiconfigurator-core=={AIC_PACKAGE_VERSION}` "
        "(the emulated-GPU extra of mars-openhands)"
    )
    try:
        version = metadata.version("aiconfigurator-core")
    except metadata.PackageNotFoundError as exc:
        raise ImportError(
            "the emulated-GPU step-time model needs aiconfigurator-core "
            f"{AIC_PACKAGE_VERSION}, which is not installed; {fix}"
        ) from exc
    if version != AIC_PACKAGE_VERSION:
        raise ImportError(
            f"aiconfigurator-core {version} is installed but the step-time model is pinned to "
            f"{AIC_PACKAGE_VERSION} (its kernel data changes between releases); {fix}"
        )


@dataclass(frozen=True)
class GpuSpec:
    """One GPU model.

    Attributes:
        name: profile key, e.g. ``"h100_nvl"``.
        aic_system: AIConfigurator system whose measured kernel latencies stand for this GPU.
        memory_bytes: device memory in bytes, as the driver reports it (vLLM applies
            ``gpu_memory_utilization`` to this total).
        note: where the numbers come from and what is approximated.
    """

    name: str
    aic_system: str
    memory_bytes: int
    note: str


@dataclass(frozen=True)
class ModelSpec:
    """One model at one weight dtype, with the KV geometry vLLM would allocate.

    Attributes:
        name: profile key, e.g. ``"qwen3-30b-a3b"``.
        dtype: weight dtype key (``"bf16"``, ``"fp8"``, ``"mxfp4"``).
        aic_model: Hugging Face id bundled with aiconfigurator-core, or ``None`` when the model
            is described by ``local_config`` (written to a folder by
            :func:`materialize_model_config`).
        num_layers: attention layers whose KV grows with the context (reported to vLLM as
            full-attention layers; sliding-window layers with a small window are left out).
        num_kv_heads: KV heads per layer (before tensor parallelism).
        head_dim: per-head size in elements.
        kv_dtype_bytes: bytes per KV element (2 for bf16 KV cache).
        local_config: a public ``config.json`` for models AIConfigurator does not bundle.
        note: source of the facts.
    """

    name: str
    dtype: str
    aic_model: str | None
    num_layers: int
    num_kv_heads: int
    head_dim: int
    kv_dtype_bytes: int = 2
    local_config: MappingProxyType | None = None
    note: str = ""

    def kv_bytes_per_token(self, tp_size: int = 1) -> int:
        """Bytes of KV one token occupies on one GPU (K and V, all layers).

        Args:
            tp_size: tensor-parallel size; KV heads are split across GPUs (at least one each).

        Returns:
            ``2 × ceil(num_kv_heads / tp_size) × head_dim × kv_dtype_bytes × num_layers``.
        """
        heads = max(1, -(-self.num_kv_heads // tp_size))
        return 2 * heads * self.head_dim * self.kv_dtype_bytes * self.num_layers


@dataclass(frozen=True)
class Calibration:
    """``step_s = scale × estimate_s + overhead_ms / 1000`` for one GPU × model × dtype.

    Attributes:
        scale: multiplier on AIConfigurator's kernel estimate (dimensionless, > 0).
        overhead_ms: per-step CPU/framework time the kernel data does not contain (ms, >= 0).
        source: the measurement the values were fitted to (see docs/timing.md).
    """

    scale: float
    overhead_ms: float
    source: str


GPUS: MappingProxyType[str, GpuSpec] = MappingProxyType(
    {
        g.name: g
        for g in (
            GpuSpec(
                "h100_sxm",
                "h100_sxm",
                80 * _GIB,
                "H100 SXM5 80 GB; capacity as in aiconfigurator systems/h100_sxm.yaml (80 GiB).",
            ),
            GpuSpec(
                "h100_nvl",
                "h100_sxm",
                95_830 * _MIB,
                "H100 NVL 94 GB (nvidia-smi reports 95,830 MiB). No NVL kernel data exists in "
                "aiconfigurator 0.12.0, so step times use H100 SXM data (the NVL has more memory "
                "bandwidth, 3.9 vs 3.35 TB/s, and a lower power limit, 400 vs 700 W); only the "
                "memory, hence the KV capacity, differs. Calibrate scale for real NVL numbers.",
            ),
            GpuSpec(
                "h200_sxm",
                "h200_sxm",
                141 * _GIB,
                "H200 SXM 141 GB; capacity as in aiconfigurator systems/h200_sxm.yaml (141 GiB).",
            ),
            GpuSpec(
                "h200_nvl",
                "h200_sxm",
                141 * _GIB,
                "H200 NVL 141 GB; step times from H200 SXM data (same memory and bandwidth, "
                "lower power limit, 600 vs 700 W).",
            ),
        )
    }
)
"""Supported GPUs by profile key."""

# Qwen3-Coder-30B-A3B-Instruct's public config.json (Hugging Face Qwen/Qwen3-Coder-30B-A3B-
# Instruct). Architecturally Qwen3-30B-A3B: same layers, heads, experts and expert sizes; it
# differs in rope_theta, max_position_embeddings and the unused dense intermediate_size, none of
# which enter the step-time or memory model (design.md §9: identical numbers).
_QWEN3_CODER_30B_A3B_CONFIG = MappingProxyType(
    {
        "architectures": ["Qwen3MoeForCausalLM"],
        "attention_dropout": 0.0,
        "decoder_sparse_step": 1,
        "eos_token_id": 151645,
        "head_dim": 128,
        "hidden_act": "silu",
        "hidden_size": 2048,
        "initializer_range": 0.02,
        "intermediate_size": 5472,
        "max_position_embeddings": 262144,
        "max_window_layers": 28,
        "mlp_only_layers": [],
        "model_type": "qwen3_moe",
        "moe_intermediate_size": 768,
        "norm_topk_prob": True,
        "num_attention_heads": 32,
        "num_experts": 128,
        "num_experts_per_tok": 8,
        "num_hidden_layers": 48,
        "num_key_value_heads": 4,
        "output_router_logits": False,
        "qkv_bias": False,
        "rms_norm_eps": 1e-06,
        "rope_scaling": None,
        "rope_theta": 10000000,
        "router_aux_loss_coef": 0.0,
        "shared_expert_intermediate_size": 0,
        "sliding_window": None,
        "tie_word_embeddings": False,
        "torch_dtype": "bfloat16",
        "transformers_version": "4.52.3",
        "use_cache": True,
        "use_qk_norm": True,
        "use_sliding_window": False,
        "vocab_size": 151936,
    }
)

MODELS: MappingProxyType[tuple[str, str], ModelSpec] = MappingProxyType(
    {
        (m.name, m.dtype): m
        for m in (
            ModelSpec(
                "qwen3-30b-a3b", "bf16", "Qwen/Qwen3-30B-A3B", 48, 4, 128,
                note="aiconfigurator model_configs/Qwen--Qwen3-30B-A3B_config.json",
            ),
            ModelSpec(
                "qwen3-30b-a3b", "fp8", "Qwen/Qwen3-30B-A3B-FP8", 48, 4, 128, kv_dtype_bytes=1,
                note="FP8 weights and FP8 KV cache, as aiconfigurator models this checkpoint "
                "(vLLM --kv-cache-dtype fp8).",
            ),
            ModelSpec(
                "qwen3-coder-30b-a3b-instruct", "bf16", None, 48, 4, 128,
                local_config=_QWEN3_CODER_30B_A3B_CONFIG,
                note="Public config.json of Qwen/Qwen3-Coder-30B-A3B-Instruct, written locally.",
            ),
            ModelSpec(
                "gpt-oss-120b", "mxfp4", "openai/gpt-oss-120b", 18, 8, 64,
                note="MXFP4 experts, bf16 attention and KV. 36 layers alternate full and "
                "128-token sliding-window attention; vLLM's hybrid allocator gives the window "
                "layers a constant few blocks, so KV grows with context in the 18 full layers "
                "only. Reporting those 18 to vLLM reproduces aiconfigurator's token capacity "
                "(within 0.1%), slightly optimistic by the window layers' ~9 blocks per request.",
            ),
        )
    }
)
"""Supported (model, dtype) pairs by key."""

_DEFAULT_CALIBRATION = Calibration(
    scale=1.0,
    overhead_ms=1.5,
    source="design.md §9: +1.5 ms per step matched vLLM PR #23151 (H100 SXM, Qwen3-30B-A3B).",
)

CALIBRATIONS: MappingProxyType[tuple[str, str, str], Calibration] = MappingProxyType(
    {
        # Fitted with scripts/calibrate_timing.py (scale fixed at 1.0, overhead fitted) to the
        # step traces of benchmarks/bench_timing.py runs of each published request pattern;
        # numbers and errors in docs/timing.md.
        ("h100_sxm", "qwen3-30b-a3b", "bf16"): Calibration(
            scale=1.0,
            overhead_ms=1.5,
            source="vLLM PR #23151: H100 SXM, TP 1, random 2048 in / 1024 out, concurrency 10, "
            "100 prompts: TPOT 13.18 ms, 739.8 output tok/s (fit: 1.504 ms).",
        ),
        ("h100_sxm", "gpt-oss-120b", "mxfp4"): Calibration(
            scale=1.0,
            overhead_ms=0.83,
            source="Published gpt-oss-120b vLLM run: 1k in / 1024 out, 511 output tok/s on one "
            "H100 SXM at concurrency <= 4 (fit at concurrency 4: 0.831 ms).",
        ),
        ("h200_sxm", "gpt-oss-120b", "mxfp4"): Calibration(
            scale=1.0,
            overhead_ms=1.99,
            source="Published gpt-oss-120b vLLM run: 1k in / 1024 out, 849 output tok/s on one "
            "H200 SXM at concurrency 10 (fit: 1.990 ms).",
        ),
    }
)
"""Default calibrations by (gpu, model, dtype); other profiles fall back to scale 1.0 and
1.5 ms (design.md §9). Coder shares Qwen3-30B-A3B's kernels, so it shares its calibration."""

_CALIBRATION_ALIASES = MappingProxyType(
    {"qwen3-coder-30b-a3b-instruct": "qwen3-30b-a3b", "h100_nvl": "h100_sxm", "h200_nvl": "h200_sxm"}
)


class GpuProfile(BaseModel):
    """One emulated GPU × model × dtype (design.md §9). Frozen; unknown keys are an error.

    Example:
        >>> p = GpuProfile(gpu="h100_nvl", model="qwen3-30b-a3b", dtype="bf16")
        >>> p.aic_system, p.memory_bytes // (1 << 20)
        ('h100_sxm', 95830)
    """

    model_config = ConfigDict(frozen=True, extra="forbid")

    gpu: str = "h100_sxm"
    """GPU key, one of :data:`GPUS`."""
    model: str = "qwen3-30b-a3b"
    """Model key, one of the names in :data:`MODELS`."""
    dtype: str = "bf16"
    """Weight dtype key; with ``model`` one key of :data:`MODELS`."""
    tp_size: int = Field(default=1, ge=1, le=8)
    """Tensor-parallel size the emulated deployment uses (kernel data and memory per GPU)."""
    memory_bytes: int | None = Field(default=None, gt=0)
    """Device memory in bytes; ``None`` takes the GPU's (:data:`GPUS`)."""
    gpu_memory_utilization: float = Field(default=0.9, gt=0.0, le=1.0)
    """vLLM's ``--gpu-memory-utilization``: the fraction of device memory vLLM may use."""
    scale: float | None = Field(default=None, gt=0.0)
    """Multiplier on the kernel estimate; ``None`` takes :data:`CALIBRATIONS`."""
    overhead_ms: float | None = Field(default=None, ge=0.0)
    """Per-step framework time in ms; ``None`` takes :data:`CALIBRATIONS`."""
    block_size: int = Field(default=16, ge=1)
    """KV block size in tokens (vLLM's GPU default, 16)."""
    max_num_batched_tokens: int = Field(default=8192, ge=1)
    """Activation-memory sizing: vLLM's GPU default token budget per step."""
    max_num_seqs: int = Field(default=256, ge=1)
    """Activation-memory sizing: vLLM's default running-request limit."""
    kv_cache_memory_bytes: int | None = Field(default=None, gt=0)
    """Explicit KV budget in bytes (vLLM's ``--kv-cache-memory-bytes``); skips the memory model."""
    kv_cache_dtype: Literal["bf16", "fp8"] | None = None
    """vLLM's ``--kv-cache-dtype``; ``None`` keeps the model's own (``ModelSpec.kv_dtype_bytes``)."""

    @model_validator(mode="after")
    def _check_keys(self) -> GpuProfile:
        if self.gpu not in GPUS:
            raise ValueError(
                f"emulated_gpu.gpu={self.gpu!r} is not a known GPU; expected one of "
                f"{sorted(GPUS)} (set it in --additional-config emulated_gpu.gpu)"
            )
        if (self.model, self.dtype) not in MODELS:
            pairs = sorted(f"{m}/{d}" for m, d in MODELS)
            raise ValueError(
                f"emulated_gpu.model/dtype={self.model}/{self.dtype} is not a known model; "
                f"expected one of {pairs} (set emulated_gpu.model and emulated_gpu.dtype)"
            )
        return self

    @property
    def gpu_spec(self) -> GpuSpec:
        """The :class:`GpuSpec` named by ``gpu``."""
        return GPUS[self.gpu]

    @property
    def model_spec(self) -> ModelSpec:
        """The :class:`ModelSpec` named by ``model`` and ``dtype``."""
        return MODELS[(self.model, self.dtype)]

    @property
    def kv_dtype_bytes(self) -> int:
        """Bytes per KV element: ``kv_cache_dtype``'s if set, else the model's own."""
        if self.kv_cache_dtype is None:
            return self.model_spec.kv_dtype_bytes
        return KV_CACHE_DTYPES[self.kv_cache_dtype][0]

    @property
    def kv_bytes_per_token(self) -> int:
        """KV bytes of one token on one GPU at this profile's KV dtype and TP size."""
        return replace(self.model_spec, kv_dtype_bytes=self.kv_dtype_bytes).kv_bytes_per_token(self.tp_size)

    @property
    def aic_system(self) -> str:
        """AIConfigurator system whose kernel data gives the step times."""
        return self.gpu_spec.aic_system

    @property
    def memory_bytes_effective(self) -> int:
        """Device memory in bytes: ``memory_bytes`` if set, else the GPU's."""
        return self.memory_bytes if self.memory_bytes is not None else self.gpu_spec.memory_bytes

    @property
    def calibration(self) -> Calibration:
        """The effective calibration: explicit ``scale``/``overhead_ms`` override the defaults."""
        base = _lookup_calibration(self.gpu, self.model, self.dtype)
        return Calibration(
            scale=self.scale if self.scale is not None else base.scale,
            overhead_ms=self.overhead_ms if self.overhead_ms is not None else base.overhead_ms,
            source=base.source if self.scale is None and self.overhead_ms is None else "explicit",
        )

    @property
    def key(self) -> str:
        """``"gpu/model/dtype"``, e.g. ``"h100_sxm/qwen3-30b-a3b/bf16"``."""
        return f"{self.gpu}/{self.model}/{self.dtype}"


def _lookup_calibration(gpu: str, model: str, dtype: str) -> Calibration:
    """Find the default calibration, trying exact keys first, then kernel-sharing aliases."""
    for g in (gpu, _CALIBRATION_ALIASES.get(gpu, gpu)):
        for m in (model, _CALIBRATION_ALIASES.get(model, model)):
            found = CALIBRATIONS.get((g, m, dtype))
            if found is not None:
                return found
    return _DEFAULT_CALIBRATION


def materialize_model_config(spec: ModelSpec, root: Path | None = None) -> str:
    """Return the ``model_path`` AIConfigurator should load for ``spec``.

    Bundled models return their Hugging Face id. Models given by ``local_config`` are written to
    ``<root>/<name>/config.json`` (default root: ``<tmp>/mars_openhands_aic_models``) and the
    folder path is returned; the file is rewritten only when its content differs. No download.

    Raises:
        OSError: the folder cannot be written.
    """
    if spec.local_config is None:
        assert spec.aic_model is not None, f"model {spec.name} has neither aic_model nor config"
        return spec.aic_model
    base = root if root is not None else Path(tempfile.gettempdir()) / "mars_openhands_aic_models"
    folder = base / spec.name
    folder.mkdir(parents=True, exist_ok=True)
    text = json.dumps(dict(spec.local_config), indent=2, sort_keys=True)
    path = folder / "config.json"
    if not path.exists() or path.read_text() != text:
        tmp = folder / "config.json.tmp"
        tmp.write_text(text)
        tmp.replace(path)
    return str(folder)


@dataclass(frozen=True)
class KvCapacity:
    """KV capacity of one emulated GPU.

    Attributes:
        kv_bytes: bytes available for KV on one GPU.
        bytes_per_token: KV bytes one token occupies (all layers).
        block_size: tokens per block.
        source: ``"aiconfigurator"`` (memory model) or ``"explicit"`` (kv_cache_memory_bytes).
    """

    kv_bytes: int
    bytes_per_token: int
    block_size: int
    source: Literal["aiconfigurator", "explicit"]

    @property
    def num_tokens(self) -> int:
        """Tokens of KV that fit: ``floor(kv_bytes / bytes_per_token)``."""
        return self.kv_bytes // self.bytes_per_token

    @property
    def num_gpu_blocks(self) -> int:
        """Blocks vLLM will allocate: ``floor(kv_bytes / (bytes_per_token × block_size))``."""
        return self.kv_bytes // (self.bytes_per_token * self.block_size)


def estimate_kv_capacity(profile: GpuProfile) -> KvCapacity:
    """KV bytes the profile's GPU would leave for the cache under vLLM.

    Uses ``aiconfigurator_core.sdk.memory.estimate_kv_cache`` (vLLM memory model: a fraction
    ``gpu_memory_utilization`` of total memory, minus weights, activations for
    ``max_num_batched_tokens``/``max_num_seqs`` and runtime overhead), with the profile's memory.
    Takes ~10 ms after aiconfigurator's first import (~2 s).

    Returns:
        A :class:`KvCapacity`; ``num_gpu_blocks`` equals
        ``aiconfigurator_core.sdk.memory.estimate_num_gpu_blocks`` for the same inputs.

    Raises:
        ImportError: aiconfigurator-core is not installed (message says how to install it).
        ValueError: the memory model rejects the profile (e.g. the weights do not fit), or its
            bytes per token disagree with the profile's KV geometry.
    """
    spec = profile.model_spec
    bytes_per_token = profile.kv_bytes_per_token
    if profile.kv_cache_memory_bytes is not None:
        return KvCapacity(profile.kv_cache_memory_bytes, bytes_per_token, profile.block_size,
                          "explicit")
    require_aiconfigurator()
    from aiconfigurator_core.sdk.memory import estimate_kv_cache

    result = estimate_kv_cache(
        materialize_model_config(spec),
        profile.aic_system,
        AIC_BACKEND,
        AIC_BACKEND_VERSION,
        max_num_tokens=profile.max_num_batched_tokens,
        max_batch_size=profile.max_num_seqs,
        memory_fraction_kind="of_total",
        memory_fraction_value=profile.gpu_memory_utilization,
        tp_size=profile.tp_size,
        moe_tp_size=profile.tp_size,
        moe_ep_size=1,
        gpu_memory_capacity_bytes_override=profile.memory_bytes_effective,
        kvcache_quant_mode=(KV_CACHE_DTYPES[profile.kv_cache_dtype][1]
                            if profile.kv_cache_dtype is not None else None),
    )
    capacity = KvCapacity(int(result["total_kv_size_bytes"]), bytes_per_token,
                          profile.block_size, "aiconfigurator")
    aic_tokens = int(result["total_kv_size_tokens"])
    if abs(capacity.num_tokens - aic_tokens) > _KV_TOKENS_TOLERANCE * aic_tokens:
        raise ValueError(
            f"KV token capacity disagrees for {profile.key}: aiconfigurator says {aic_tokens} "
            f"tokens, the profile's geometry gives {capacity.num_tokens} "
            f"({bytes_per_token} bytes/token); fix MODELS[{spec.name!r}] in "
            "mars_openhands/engine/harness/executor/profiles.py"
        )
    return capacity
