"""What a scheduler knows of vLLM's host-memory KV tier (``--kv-offloading-backend native``): is
one configured, and what a host→GPU load of one block costs (policy.residency.HostReload).

Read from vLLM's public config only: ``kv_transfer_config`` (``kv_connector`` is
``OffloadingConnector``; its ``kv_connector_extra_config`` holds the emulated copies' parameters
under ``mars_host_kv`` when the tier is ours, ``HostKvParams.extra_config``) and the KV cache
config's tensor bytes per block. A native tier without our key (a real GPU server) gets the
defaults of ``HostKvParams``: 50 GB/s host→GPU and a 1.5× step slowdown while copying, both from
the H100 measurement of issue 31 (docs/timing.md §9). The plugin may not import the harness, so
the key and the defaults are repeated here; tests/unit/engine/test_mars_host_kv.py checks they
agree with ``HostKvParams``.
"""

from __future__ import annotations

from typing import Any

from mars_openhands.policy.residency import HostReload

__all__ = ["DEFAULT_COPY_SLOWDOWN", "DEFAULT_H2D_GB_PER_S", "EXTRA_CONFIG_KEY", "host_blocks", "host_reload"]

EXTRA_CONFIG_KEY = "mars_host_kv"
"""``kv_connector_extra_config`` key of the emulated tier's parameters (``offload.params``)."""
DEFAULT_H2D_GB_PER_S = 50.0
"""``HostKvParams.h2d_gb_per_s``'s default: H100, PCIe Gen5 x16, pinned memory (issue 31)."""
DEFAULT_COPY_SLOWDOWN = 1.5
"""``HostKvParams.copy_slowdown``'s default (docs/timing.md §9)."""


def _native_tier(vllm_config: Any) -> dict[str, Any] | None:
    """The ``kv_connector_extra_config`` of a native offloading tier, or None without one. Pure."""
    transfer = getattr(vllm_config, "kv_transfer_config", None)
    if transfer is None or transfer.kv_connector != "OffloadingConnector":
        return None
    return transfer.kv_connector_extra_config or {}


def _bytes_per_block(extra: dict[str, Any], kv_cache_config: Any) -> float:
    raw: dict[str, Any] = extra.get(EXTRA_CONFIG_KEY) or {}
    bytes_per_block = raw.get("kv_bytes_per_block")
    if bytes_per_block is None:
        total = sum(t.size for t in kv_cache_config.kv_cache_tensors)
        bytes_per_block = total / max(1, kv_cache_config.num_blocks)
    return float(bytes_per_block)


def host_blocks(vllm_config: Any, kv_cache_config: Any) -> int:
    """The host tier's capacity in GPU blocks (``cpu_bytes_to_use``, which vLLM sets from
    ``--kv-offloading-size``, over one block's bytes); 0 without a native offloading tier. Pure."""
    extra = _native_tier(vllm_config)
    if extra is None or not extra.get("cpu_bytes_to_use"):
        return 0
    return int(int(extra["cpu_bytes_to_use"]) // _bytes_per_block(extra, kv_cache_config))


def host_reload(vllm_config: Any, kv_cache_config: Any) -> HostReload | None:
    """The host tier's reload cost per GPU block, or None without a native offloading tier. Pure.

    Args:
        vllm_config: the engine's ``VllmConfig`` (its ``kv_transfer_config``).
        kv_cache_config: the engine's ``KVCacheConfig`` (``kv_cache_tensors``, ``num_blocks``):
            the bytes one block's copy moves when the tier's parameters do not give them.
    """
    extra = _native_tier(vllm_config)
    if extra is None:
        return None
    raw: dict[str, Any] = extra.get(EXTRA_CONFIG_KEY) or {}
    bytes_per_block = _bytes_per_block(extra, kv_cache_config)
    h2d = float(raw.get("h2d_gb_per_s", DEFAULT_H2D_GB_PER_S)) * 1e9
    return HostReload(load_s_per_block=bytes_per_block / h2d,
                      copy_slowdown=float(raw.get("copy_slowdown", DEFAULT_COPY_SLOWDOWN)))
