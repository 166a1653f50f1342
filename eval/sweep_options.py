"""What a sweep is given besides its workload: :class:`CompareOptions` (policies, loads, admission,
knee search) and per GPU a :class:`GpuSetup` (its step-time model and KV blocks).

A GPU profile's step-time model (``StepTimeModel``, aiconfigurator's kernel data) cannot be
pickled, so sweeps hand worker processes a :class:`ProfileTimer` (the profile's keys), which
each worker builds once (:func:`real_timer`).
"""

from __future__ import annotations

import functools
import json
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from eval.metrics import DEFAULT_ALPHAS
from eval.policies import DEFAULT_HOST_KV_GIB, DEFAULT_POLICIES, POLICIES
from mars_openhands.engine.harness.executor.profiles import GpuProfile
from mars_openhands.engine.harness.executor.timing import StepTimeModel

__all__ = ["CompareOptions", "GpuSetup", "ProfileTimer", "real_timer"]


class CompareOptions(BaseModel):
    """Everything one comparison needs besides the workload and the step-time model. Frozen."""

    model_config = ConfigDict(frozen=True, extra="forbid", use_attribute_docstrings=True)

    policies: tuple[str, ...] = DEFAULT_POLICIES
    """Policy names (keys of :data:`eval.policies.POLICIES`)."""
    loads: tuple[float, ...] = (0.5, 0.8, 1.0, 1.2)
    """Multipliers of the base rate, or sessions/s with ``is_absolute_rates``."""
    is_absolute_rates: bool = False
    admission: Literal["auto", "off", "on", "both"] = "auto"
    """Gateway admission window: ``auto`` = on for the MARS policies (their control plane), off for
    the baselines (as published; the MARS paper ran them so); or off / on for every policy, or one
    run of each (``both``: the fair ablation, design.md §5)."""
    num_gpu_blocks: int = Field(ge=2)
    """KV blocks of the simulated GPU."""
    num_tool_workers: int = Field(16, ge=1)
    seed: int = 0
    """Seeds the Poisson arrivals and the simulator."""
    base_rate_per_s: float | None = Field(None, gt=0.0)
    """Skip the knee search and use this base rate."""
    knee_slowdown: float = Field(2.0, gt=1.0)
    """Stable = every session completes and mean slowdown <= this."""
    search_max_runs: int = Field(8, ge=1)
    """Runs one knee search may spend (FCFS's, and each policy's with ``is_capacity``)."""
    knee_tolerance: float = Field(1.1, gt=1.0)
    """Stop bisecting once the bracket's ``hi / lo`` is at most this (10%: finer than one seed's noise)."""
    knee_step: float = Field(2.0, gt=1.0)
    """The bracketing ladder's factor (2: double while stable, halve while unstable)."""
    is_capacity: bool = False
    """Also search every policy's own knee (capacity at SLO; ``--capacity``)."""
    alphas: tuple[float, ...] = DEFAULT_ALPHAS
    max_virtual_s: float | None = Field(None, gt=0.0)
    """Abort a run whose virtual clock passes this (a guard against runaway overload)."""
    num_replicas: int = Field(1, ge=1)
    """Engines behind one control plane (``--replicas``); rates (loads, the base rate, knees) stay
    per GPU: a run's arrivals come at ``rate x num_replicas``."""
    router: str = "least-sessions"
    """The control plane's routing policy (``--router``)."""
    lose_replica: tuple[int, float] | None = None
    """``(index, seconds)``: that replica is lost then in every run (``--lose-replica``)."""
    kv_transfer_gb_s: float | None = Field(None, gt=0.0)
    """A session moved off a live replica takes its KV along at this bandwidth, GB/s one way
    (``--kv-transfer-gbps``; ``SimConfig.kv_transfer_gb_s``); ``None``: it re-prefills."""
    kv_bytes_per_token: int | None = Field(None, gt=0)
    """The deployment's KV bytes per token (what a KV transfer moves)."""
    replica_blocks: tuple[int, ...] = ()
    """KV blocks of each replica for a mix of GPU profiles (``--replica-gpus``; the sweep's GPU
    setup then carries one step timer per replica); empty: ``num_gpu_blocks`` for every one."""
    host_kv_gib: float = Field(DEFAULT_HOST_KV_GIB, gt=0.0, le=65536.0)
    """Host-memory KV tier of the policies that have one (``PolicySpec.host_kv``), GiB (vLLM
    ``--kv-offloading-size``; ``compare --host-kv-gib``); at most 64 TiB, far above any host."""
    host_kv_bytes_per_block: int | None = Field(None, gt=0)
    """KV bytes one block's copy moves (the deployment's bytes per token × 16); ``None``: vLLM's
    own from the engine's KV cache config."""

    mars_config: dict[str, Any] = Field(default_factory=dict)
    """``SchedulerParams`` keys merged into the ``mars`` section of every ``MarsScheduler`` policy's
    additional config (``compare --mars-config``; :func:`eval.policies.policy_additional_config`);
    empty: the registry's settings."""

    def mars_config_key(self) -> tuple[Any, ...]:
        """What ``--mars-config`` adds to a cache key: nothing when empty (older keys stay valid).
        Pure."""
        return ("mars_config", json.dumps(self.mars_config, sort_keys=True)) if self.mars_config else ()

    def kv_transfer_key(self) -> tuple[Any, ...]:
        """What ``--kv-transfer-gbps`` adds to a run's cache key: nothing without it (older keys
        stay valid), else the bandwidth and the bytes per token. Pure."""
        if self.kv_transfer_gb_s is None:
            return ()
        return ("kv_transfer", self.kv_transfer_gb_s, self.kv_bytes_per_token)

    def host_kv_key(self) -> tuple[Any, ...]:
        """What the host tier adds to a cache key: nothing when no policy has one (older keys stay
        valid), else its size and block bytes. Pure."""
        if not any(POLICIES[p].host_kv is not None for p in self.policies):
            return ()
        return ("host_kv", self.host_kv_gib, self.host_kv_bytes_per_block)


@dataclass(frozen=True)
class ProfileTimer:
    """Picklable step-time model of a GPU profile:
    ``StepTimeModel(GpuProfile(gpu, model, dtype, kv_cache_dtype))``.

    aiconfigurator's model is a Rust object that cannot be pickled, so worker processes get this
    spec and build the model once each (:meth:`build`, cached per process).
    """

    gpu: str
    model: str
    dtype: str = "bf16"
    """Weight dtype key of the model profile (``GpuProfile.dtype``)."""
    kv_cache_dtype: str | None = None
    """``GpuProfile.kv_cache_dtype``: ``None`` = the model's own KV dtype."""

    def build(self) -> Any:
        """The ``StepTimeModel`` (built on first use in this process)."""
        return _profile_step_model(self.gpu, self.model, self.dtype, self.kv_cache_dtype)

    def step_time_s(self, prefill: Sequence[tuple[int, int]] = (),
                    decode_context_tokens: Sequence[int] = ()) -> float:
        """Seconds of one step (see ``StepTimeModel.step_time_s``)."""
        return float(self.build().step_time_s(prefill, decode_context_tokens))


@functools.lru_cache(maxsize=8)
def _profile_step_model(gpu: str, model: str, dtype: str, kv_cache_dtype: str | None) -> Any:
    return StepTimeModel(GpuProfile(gpu=gpu, model=model, dtype=dtype, kv_cache_dtype=kv_cache_dtype))


def real_timer(timer: Any) -> Any:
    """The model behind a :class:`ProfileTimer` (skips one call per step), else ``timer`` itself."""
    if isinstance(timer, tuple):  # one per replica (a mix of GPU profiles)
        return [real_timer(t) for t in timer]
    return timer.build() if isinstance(timer, ProfileTimer) else timer


@dataclass(frozen=True)
class GpuSetup:
    """One GPU of a sweep.

    Attributes:
        gpu: profile key (``h100_sxm``) or any label; the ``gpu`` column of the results.
        step_timer: seconds per engine step; picklable for ``jobs > 1`` (:class:`ProfileTimer`,
            ``LinearStepTimeModel``).
        num_gpu_blocks: KV blocks of this GPU.
        timing: one line describing the step times and KV (for ``summary.md``).
    """

    gpu: str
    step_timer: Any
    num_gpu_blocks: int
    timing: str = ""
