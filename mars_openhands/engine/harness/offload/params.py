"""The host-memory KV tier's parameters: vLLM's flags and the hardware assumptions, each with its
source (docs/timing.md "Host-memory KV tier").

vLLM's side: ``--kv-offloading-backend native --kv-offloading-size <GiB>`` makes vLLM 0.32 set
``kv_transfer_config = {kv_connector: OffloadingConnector, kv_role: kv_both,
kv_connector_extra_config: {cpu_bytes_to_use: GiB << 30}}`` (``VllmConfig._post_init_kv_transfer_config``);
``eviction_policy`` (``lru`` / ``arc``), ``store_threshold`` and ``offload_prompt_only`` are keys of
the same ``kv_connector_extra_config`` (``CPUOffloadingSpec``, ``OffloadingSpec``). The emulated
copies add the keys below (``mars_*``), read by :class:`~.spec.EmulatedOffloadingSpec`.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

__all__ = ["EXTRA_CONFIG_KEY", "SPEC_MODULE", "SPEC_NAME", "HostKvParams"]

SPEC_MODULE = "mars_openhands.engine.harness.offload.spec"
"""``kv_connector_extra_config["spec_module_path"]``: vLLM's out-of-tree spec plug point."""
SPEC_NAME = "EmulatedOffloadingSpec"
"""``kv_connector_extra_config["spec_name"]``."""
EXTRA_CONFIG_KEY = "mars_host_kv"
"""``kv_connector_extra_config`` key holding :meth:`HostKvParams.model_dump` for the spec."""

GIB = 1 << 30


class HostKvParams(BaseModel):
    """The host tier of one engine. Frozen; unknown keys are an error.

    Bandwidths are in GB/s (10^9 bytes per second), one direction each; ``duplex_gb_per_s`` is the
    two directions' sum while both copy at once.
    """

    model_config = ConfigDict(frozen=True, extra="forbid", use_attribute_docstrings=True)

    size_gib: float = Field(gt=0.0)
    """vLLM ``--kv-offloading-size``: host memory for KV, GiB (``cpu_bytes_to_use``)."""
    eviction: Literal["lru", "arc"] = "lru"
    """``kv_connector_extra_config["eviction_policy"]``: vLLM's ``CPUOffloadingManager`` policy
    (``lru`` is vLLM's default)."""
    store_threshold: int = Field(0, ge=0)
    """``kv_connector_extra_config["store_threshold"]``: offers before a chunk is stored (vLLM's
    default 0: every computed block)."""
    offload_prompt_only: bool = True
    """``kv_connector_extra_config["offload_prompt_only"]`` (vLLM's default True: only prompt
    blocks are stored, not the KV a turn generates)."""
    h2d_gb_per_s: float = Field(50.0, gt=0.0)
    """Host→GPU copy bandwidth, one way: ~50 GB/s measured on H100 (PCIe Gen5 x16, pinned memory;
    issue 31, measured by others)."""
    d2h_gb_per_s: float = Field(50.0, gt=0.0)
    """GPU→host copy bandwidth, one way (same measurement as ``h2d_gb_per_s``)."""
    duplex_gb_per_s: float = Field(83.0, gt=0.0)
    """Both directions together: ~83 GB/s measured on H100 (issue 31); each direction then gets
    half, at most its one-way rate."""
    copy_slowdown: float = Field(1.5, ge=1.0)
    """How much slower an engine step's work runs while a copy is in flight (1 = copies are free
    for the GPU). Upper bound 2.8× (decode steps' p50 while copies ran, one H100 profile, issue
    31); the default 1.5 is our middle between no contention and that bound (stores use the copy
    engine, loads of small pages a Triton kernel on the SMs: ``cpu/gpu_worker.py``)."""
    kv_bytes_per_block: int | None = Field(None, gt=0)
    """KV bytes of one GPU block (all layers) that a copy moves; ``None`` takes vLLM's own from the
    KV cache config (the emulated executor's real geometry). The simulator's fake cache has tiny
    blocks, so it passes the profile's ``kv_bytes_per_token × block_size``."""

    def extra_config(self, is_emulated: bool = True) -> dict[str, Any]:
        """``kv_connector_extra_config`` for vLLM's ``OffloadingConnector``. Pure.

        Args:
            is_emulated: over our spec, whose worker emulates the copies (the simulator, the
                emulated executor); ``False``: over vLLM's own ``CPUOffloadingSpec`` (a GPU
                engine, real copies). Either way the parameters ride along under
                :data:`EXTRA_CONFIG_KEY` for mars's cost model (vLLM ignores the key).

        ``cpu_bytes_to_use`` is set by vLLM itself from ``--kv-offloading-size``."""
        spec = {"spec_name": SPEC_NAME, "spec_module_path": SPEC_MODULE} if is_emulated else {}
        out: dict[str, Any] = {
            **spec, "eviction_policy": self.eviction, "offload_prompt_only": self.offload_prompt_only,
            EXTRA_CONFIG_KEY: self.model_dump(),
        }
        if self.store_threshold:
            out["store_threshold"] = self.store_threshold
        return out

    def describe(self) -> str:
        """One line for a report's scope: size, eviction and the copy model. Pure.

        >>> HostKvParams(size_gib=64).describe()
        'host KV tier 64 GiB (vLLM native offload, LRU; copies 50/50 GB/s, 83 both ways, steps x1.5 while copying)'
        """
        return (f"host KV tier {self.size_gib:g} GiB (vLLM native offload, {self.eviction.upper()}; "
                f"copies {self.h2d_gb_per_s:g}/{self.d2h_gb_per_s:g} GB/s, {self.duplex_gb_per_s:g} "
                f"both ways, steps x{self.copy_slowdown:g} while copying)")
