"""A real vLLM scheduler over a fake KV cache, built as vLLM's ``EngineCore`` builds it.

No tokenizer, no weights, no download: a tiny local model config (:mod:`.tiny_model`) sized to
``max_model_len``, one full-attention KV group of ``num_gpu_blocks`` blocks whose bytes are never
allocated, and the scheduler class by policy name (stock vLLM or our plugins).
"""

from __future__ import annotations

import importlib
import logging
import tempfile
from pathlib import Path
from typing import Any

import torch
from pydantic import BaseModel, ConfigDict, Field
from vllm.config import CacheConfig, KVTransferConfig, ModelConfig, SchedulerConfig, VllmConfig
from vllm.v1.core.sched.async_scheduler import AsyncScheduler
from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.kv_cache_interface import (
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheGroupSpec,
    KVCacheTensor,
)
from vllm.v1.structured_output import StructuredOutputManager

from mars_openhands.engine.harness.offload.params import HostKvParams
from mars_openhands.engine.harness.tiny_model import write_tiny_model

__all__ = [
    "STOCK_SCHEDULERS",
    "InprocEngineParams",
    "build_kv_cache_config",
    "build_scheduler",
    "build_vllm_config",
    "resolve_scheduler_cls",
]

STOCK_SCHEDULERS: dict[str, type[Scheduler]] = {
    "fcfs": AsyncScheduler,
    "fcfs-sync": Scheduler,
}
"""Stock vLLM schedulers by policy name (``fcfs`` = vLLM's default with async scheduling on)."""


class InprocEngineParams(BaseModel):
    """Engine shape of an in-process scheduler. Frozen; unknown keys are an error.

    Defaults are vLLM's GPU defaults where vLLM has one (block size 16, 256 sequences, 8192
    batched tokens, prefix caching and chunked prefill on).
    """

    model_config = ConfigDict(frozen=True, extra="forbid", use_attribute_docstrings=True)

    num_gpu_blocks: int = Field(ge=2)
    """KV blocks of the pool, including vLLM's null block (e.g. a GPU profile's capacity)."""
    block_size: int = Field(16, ge=1)
    """Tokens per KV block."""
    max_num_seqs: int = Field(256, ge=1)
    """vLLM ``--max-num-seqs``: running-request cap."""
    max_num_batched_tokens: int = Field(8192, ge=1)
    """vLLM ``--max-num-batched-tokens``: token budget of one step."""
    max_model_len: int = Field(131072, ge=16)
    """vLLM ``--max-model-len``: longest prompt + output, tokens."""
    long_prefill_token_threshold: int = Field(0, ge=0)
    """vLLM's per-request prefill chunk cap, tokens (0 = off)."""
    enable_prefix_caching: bool = True
    """vLLM ``--enable-prefix-caching``."""
    prefix_caching_hash_algo: str = "sha256"
    """vLLM ``--prefix-caching-hash-algo`` (the block hash function)."""
    additional_config: dict[str, Any] = Field(default_factory=dict)
    """vLLM ``--additional-config`` (our schedulers read ``additional_config["mars"]``)."""
    host_kv: HostKvParams | None = None
    """vLLM's host-memory KV tier (``--kv-offloading-backend native --kv-offloading-size``) with
    emulated copies (:mod:`.offload`); ``None``: no host tier (vLLM's default)."""


# ----------------------------------------------------------------------------- building
def resolve_scheduler_cls(policy: str) -> type[Scheduler]:
    """Scheduler class for a policy name.

    Args:
        policy: ``"fcfs"`` (stock ``AsyncScheduler``), ``"fcfs-sync"`` (stock ``Scheduler``), a
            class exported by :mod:`mars_openhands.engine` (e.g. ``"MarsScheduler"``), or a
            ``"package.module:Class"`` / ``"package.module.Class"`` path.

    Raises:
        ValueError: unknown name (the message lists the known ones) or not a vLLM scheduler.
    """
    if policy in STOCK_SCHEDULERS:
        return STOCK_SCHEDULERS[policy]
    from mars_openhands import engine

    exported = sorted(getattr(engine, "_LAZY", {}))
    cls: Any = None
    if policy in exported:
        cls = getattr(engine, policy)
    elif ":" in policy or "." in policy:
        module_name, sep, attr = policy.partition(":") if ":" in policy else policy.rpartition(".")
        try:
            cls = getattr(importlib.import_module(module_name), attr)
        except (ImportError, AttributeError) as e:
            raise ValueError(f"cannot load scheduler class {policy!r}: {e}") from None
    if cls is None:
        raise ValueError(
            f"unknown scheduler policy {policy!r}; expected one of "
            f"{sorted(STOCK_SCHEDULERS) + exported} or a 'module:Class' path"
        )
    if not (isinstance(cls, type) and issubclass(cls, Scheduler)):
        raise ValueError(f"{policy!r} resolves to {cls!r}, which is not a vLLM Scheduler subclass")
    return cls


def _model_dir(params: InprocEngineParams, root: Path | None) -> Path:
    """Write (once per folder) a tiny Llama model dir whose context covers ``max_model_len``."""
    base = root if root is not None else Path(tempfile.gettempdir()) / "mars_openhands_inproc"
    folder = base / f"tiny-{params.max_model_len}"
    if not (folder / "config.json").exists():
        write_tiny_model(folder, max_position_embeddings=params.max_model_len)
    return folder


def build_vllm_config(params: InprocEngineParams, model_dir: Path | None = None) -> VllmConfig:
    """A ``VllmConfig`` over a tiny local model (no tokenizer, no weights, no download).

    Takes ~1 s the first time in a process (vLLM's platform setup), ~20 ms after.

    Args:
        params: the engine shape.
        model_dir: a folder with a ``config.json``; ``None`` writes a tiny one under the temp dir.
    """
    folder = model_dir if model_dir is not None else _model_dir(params, None)
    _quiet_cpu_block_size_warning()
    model = ModelConfig(model=str(folder), skip_tokenizer_init=True,
                        max_model_len=params.max_model_len, dtype="float32")
    sched = SchedulerConfig(
        max_num_seqs=params.max_num_seqs, max_num_batched_tokens=params.max_num_batched_tokens,
        max_model_len=params.max_model_len, is_encoder_decoder=False, enable_chunked_prefill=True,
        long_prefill_token_threshold=params.long_prefill_token_threshold,
    )
    host_kv = params.host_kv
    offload: dict[str, Any] = {}
    if host_kv is not None:
        # What --kv-offloading-backend native --kv-offloading-size does, over our spec.
        offload = {"kv_offloading_size": host_kv.size_gib, "kv_offloading_backend": "native"}
    cache = CacheConfig(block_size=params.block_size,
                        enable_prefix_caching=params.enable_prefix_caching,
                        prefix_caching_hash_algo=params.prefix_caching_hash_algo, **offload)
    transfer = (KVTransferConfig(engine_id="inproc", kv_connector_extra_config=host_kv.extra_config())
                if host_kv is not None else None)
    config = VllmConfig(model_config=model, scheduler_config=sched, cache_config=cache,
                        kv_transfer_config=transfer, additional_config=dict(params.additional_config))
    config.cache_config.num_gpu_blocks = params.num_gpu_blocks
    return config


def _drop_block_size_advice(record: logging.LogRecord) -> bool:
    return not str(record.msg).startswith("CPU backend prefers block_size")


def _quiet_cpu_block_size_warning() -> None:
    """Drop vLLM's "CPU backend prefers block_size is multiples of 32" warning in this process.

    It is kernel-performance advice, and no kernel runs here; the simulator uses the emulated
    GPU's block size (16) on purpose, and the warning repeats once per engine built (18 lines in a
    two-policy fidelity run).
    """
    cpu_logger = logging.getLogger("vllm.platforms.cpu")
    if _drop_block_size_advice not in cpu_logger.filters:
        cpu_logger.addFilter(_drop_block_size_advice)


def build_kv_cache_config(params: InprocEngineParams) -> KVCacheConfig:
    """One full-attention KV group of ``num_gpu_blocks`` blocks (the bytes are never allocated).

    The layer geometry is irrelevant to the scheduler (it only counts blocks), so one small layer
    stands for the model.
    """
    spec = FullAttentionSpec(block_size=params.block_size, num_kv_heads=1, head_size=16,
                             dtype=torch.float32)
    page = spec.page_size_bytes
    size = page * params.num_gpu_blocks
    return KVCacheConfig(
        num_blocks=params.num_gpu_blocks,
        kv_cache_tensors=[KVCacheTensor(size=size, layers=["layer.0"], layer_stride=size,
                                        block_stride=page)],
        kv_cache_groups=[KVCacheGroupSpec(["layer.0"], spec)],
    )


def build_scheduler(
    scheduler_cls: type[Scheduler], params: InprocEngineParams, model_dir: Path | None = None
) -> Scheduler:
    """Construct ``scheduler_cls`` the way vLLM's ``EngineCore`` does (``log_stats=False``).

    Raises:
        ValueError: from our schedulers, on an invalid ``additional_config["mars"]``.
    """
    vllm_config = build_vllm_config(params, model_dir)
    return scheduler_cls(
        vllm_config=vllm_config, kv_cache_config=build_kv_cache_config(params),
        structured_output_manager=StructuredOutputManager(vllm_config),
        block_size=params.block_size, hash_block_size=params.block_size, log_stats=False,
    )
