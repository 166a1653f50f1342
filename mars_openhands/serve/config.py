"""What one ``mars-openhands serve`` application runs: :class:`ServeConfig`, and scheduler names.

One frozen model (style.md, "Config"): the engines (model, scheduler class and its
``additional_config``, vLLM sizes), where Ray runs (``ray_address``, resources per replica) and the
gateway in the ingress (a :class:`~mars_openhands.control.config.GatewayConfig` without replicas:
they are the engine deployments, known only once they run). The CLI flags and their ``--help``
come from the field docstrings (:mod:`~mars_openhands.serve.cli`).
"""

from __future__ import annotations

import re
from typing import Any, Self

from pydantic import BaseModel, ConfigDict, Field, ValidationInfo, field_validator, model_validator

__all__ = ["SCHEDULER_NAMES", "ServeConfig", "scheduler_qualname"]

SCHEDULER_NAMES: dict[str, str] = {
    "mars": "MarsScheduler",
    "mars-preview": "MarsPreviewScheduler",
    "fcfs": "FcfsScheduler",
    "autellix": "AutellixScheduler",
    "infercept": "InferceptScheduler",
    "continuum": "ContinuumScheduler",
    "thunderagent": "ThunderAgentScheduler",
}
"""``--scheduler`` name → the class :mod:`mars_openhands.engine` exports (docs/schedulers.md)."""

_QUALNAME = re.compile(r"[A-Za-z_]\w*(\.[A-Za-z_]\w*)+")


def scheduler_qualname(name: str) -> str:
    """The ``--scheduler-cls`` value for a ``--scheduler`` name. Pure.

    Args:
        name: a key of :data:`SCHEDULER_NAMES`, or a dotted ``package.module.Class``.

    Raises:
        ValueError: neither (the message lists the names, not the flag: the caller's error
            line names ``--scheduler``).
    """
    if name in SCHEDULER_NAMES:
        return f"mars_openhands.engine.{SCHEDULER_NAMES[name]}"
    if _QUALNAME.fullmatch(name):
        return name
    raise ValueError(f"unknown scheduler {name!r}; choose one of "
                     f"{', '.join(SCHEDULER_NAMES)} or give a dotted package.module.Class")


class ServeConfig(BaseModel):
    """Run N vLLM replicas with a MARS scheduler on Ray Serve, behind the MARS gateway
    (docs/serve.md). Frozen; unknown keys are an error."""

    model_config = ConfigDict(frozen=True, extra="forbid", use_attribute_docstrings=True)

    num_replicas: int = Field(2, ge=1, le=4096)
    """vLLM replicas, one Ray Serve deployment each (engine-0 … engine-N-1); Ray restarts a dead one."""
    scheduler: str = "mars"
    """Scheduler class of every replica: mars, mars-preview, fcfs, autellix, infercept, continuum,
    thunderagent, or a dotted package.module.Class (docs/schedulers.md)."""
    additional_config: dict[str, Any] = Field(default_factory=dict)
    """vLLM --additional-config of every replica as JSON, e.g. '{"mars": {"retention": {"max_ttl_s":
    30}}}'; the telemetry and inbox addresses under "mars" are set by each replica."""
    model: str = "tiny"
    """Model directory or Hugging Face name on every node; 'tiny' writes the tests' tiny Llama (random
    weights) on each replica's node, to try the wiring without a model."""
    served_model_name: str | None = None
    """The 'model' field clients send; default: 'tiny-llama' for the tiny model, else --model."""
    load_format: str | None = None
    """vLLM --load-format; default: dummy for the tiny model, auto otherwise."""
    dtype: str | None = None
    """vLLM --dtype; default: float32 on CPU-only replicas (--gpus-per-replica 0), auto on GPUs."""
    max_model_len: int | None = Field(None, ge=1)
    """vLLM --max-model-len in tokens; default vLLM's (4096 for the tiny model)."""
    num_gpu_blocks_override: int | None = Field(None, ge=1)
    """vLLM --num-gpu-blocks-override: KV blocks each replica's scheduler sees (tests)."""
    block_size: int | None = Field(None, ge=1)
    """vLLM --block-size in tokens: a multiple of 32 on CPU replicas (--gpus-per-replica 0), of 16
    on GPUs."""
    vllm_args: tuple[str, ...] = ()
    """More vLLM server arguments for every replica, e.g. --tensor-parallel-size 2 (then also
    --gpus-per-replica 2)."""
    engine_env: dict[str, str] = Field(default_factory=dict)
    """Environment variables for every replica's vLLM server as a JSON object, e.g.
    '{"VLLM_ENABLE_V1_MULTIPROCESSING": "0"}' (CPU: the worker in the engine-core process, one
    process fewer to start; the tests use it)."""
    max_num_seqs: int | None = Field(None, ge=1)
    """vLLM --max-num-seqs: requests each replica runs per step; default vLLM's."""
    max_num_batched_tokens: int | None = Field(None, ge=1)
    """vLLM --max-num-batched-tokens: each replica's token budget per step (the prefill chunk);
    default vLLM's."""
    kv_cache_space_gib: int = Field(1, ge=1)
    """VLLM_CPU_KVCACHE_SPACE in GiB for CPU replicas (ignored on GPUs)."""
    gpus_per_replica: float = Field(0.0, ge=0)
    """GPUs Ray reserves for each replica (1 on a GPU node; 0 runs vLLM's CPU build)."""
    cpus_per_replica: float = Field(1.0, gt=0)
    """CPUs Ray reserves for each replica's actor (vLLM's own processes are not counted by Ray)."""
    host_kv_gib: float | None = Field(None, gt=0)
    """vLLM's native host-memory KV tier of each replica, GiB of pinned host memory
    (--kv-offloading-backend native --kv-offloading-size; mars reads it and resumes idle sessions
    by a copy: docs/schedulers.md); GPU replicas only (vLLM's CPU build has no offload worker)."""
    engine_startup_timeout_s: float = Field(600.0, gt=0)
    """Seconds one replica's vLLM server may take to answer /v1/models before its start fails."""
    engine_start_attempts: int = Field(1, ge=1, le=20)
    """Starts of a replica's vLLM server before the application fails (Ray Serve's
    max_constructor_retry_count); once a replica has started, Ray replaces a dead one without limit.
    1 (default): a server that cannot start fails the command at once, with its log's last lines
    (Ray's default, 3 here, repeats a failure that is nearly always the same)."""
    health_check_period_s: float = Field(2.0, gt=0)
    """Seconds between Ray Serve's health checks of a replica (a dead vLLM server fails one and Ray
    replaces the replica)."""
    ray_address: str | None = None
    """Ray cluster to join: auto (the cluster `ray start` made on this node), ray://host:10001, or
    none for a private single-node Ray that stops with this command."""
    ray_temp_dir: str | None = None
    """Ray's session directory root for a private Ray (default Ray's /tmp/ray)."""
    gateway: dict[str, Any] = Field(default_factory=dict)
    """GatewayConfig keys for the gateway in the ingress (the keys of `gateway --config`, without
    replicas), e.g. {"port": 8000, "admission": {"window_max": 30}}."""

    @field_validator("scheduler")
    @classmethod
    def _scheduler(cls, value: str) -> str:
        qualname = scheduler_qualname(value)
        if value not in SCHEDULER_NAMES:  # a dotted name: import it now, as each engine will
            # (the named classes are ours, loaded by tests/compat; importing them would import
            # vLLM and torch for every config, seconds)
            from mars_openhands.engine.plugin import load_scheduler_cls

            load_scheduler_cls(qualname)
        return value

    @field_validator("host_kv_gib")
    @classmethod
    def _host_kv_needs_gpus(cls, value: float | None, info: ValidationInfo) -> float | None:
        if value is not None and not info.data.get("gpus_per_replica"):
            raise ValueError("needs GPU replicas (--gpus-per-replica > 0): vLLM's CPU build has no "
                             "offload worker")
        return value

    @field_validator("gateway")
    @classmethod
    def _gateway(cls, value: dict[str, Any]) -> dict[str, Any]:
        if "replicas" in value:
            raise ValueError("gateway.replicas: the replicas are the engine deployments; give "
                             "--replicas N instead")
        if value.get("port") == 0:  # the gateway's "any free port": not here (its --port refuses 0)
            raise ValueError("gateway.port: expected a port in 1..65535, got 0 (Ray restarts a failed "
                             "ingress, which must listen again on the port of the URL printed at start)")
        return value

    @model_validator(mode="after")
    def _engines_can_start(self) -> Self:
        # What each engine's actor checks when it starts vLLM (--block-size for its device, the
        # "mars" section of --additional-config, --vllm-arg), checked here: once, before Ray.
        from mars_openhands.serve.engine import check_engine_options  # it imports this module

        check_engine_options(self)
        return self

    @property
    def is_ray_client(self) -> bool:
        """Whether the driver joins through a Ray Client (``ray://``): its machine is then no node
        of the cluster, and the ingress (the gateway) runs on the head node, not here."""
        return (self.ray_address or "").startswith("ray://")

    @property
    def is_tiny_model(self) -> bool:
        """The tests' tiny model (written on each replica's node)."""
        return self.model == "tiny"

    @property
    def scheduler_cls(self) -> str:
        """The replicas' ``--scheduler-cls``."""
        return scheduler_qualname(self.scheduler)
