"""vLLM's decision points the schedulers steer (not our ``PolicyHooks``: those are the policy's).

Audience: the schedulers. vLLM's ``schedule()`` decides the preemption victim, the size of each
prefill chunk and which requests finish with an error; we steer each from outside: victim ranks
through the PRIORITY rule, chunk sizes through the Mamba-split hook, errors through the grammar
error set. Also the step's limits the policies read, and the engine core's wake-up.
"""

from __future__ import annotations

import queue
import sys
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

from vllm.v1.core.sched.request_queue import SchedulingPolicy
from vllm.v1.core.sched.scheduler import Scheduler

from mars_openhands.engine.seams import compat

if TYPE_CHECKING:
    from vllm.v1.request import Request

__all__ = [
    "enable_chunk_hook",
    "enable_victim_ranks",
    "engine_core_waker",
    "finish_with_error_next_step",
    "is_chunked_mm_input_disabled",
    "max_num_running_reqs",
    "max_num_scheduled_tokens",
    "model_needs_mamba_split",
    "restore_priorities",
    "set_victim_ranks",
]


_MAX_WAKER_FRAMES = 16
"""How far up the stack :func:`engine_core_waker` looks for the engine core building the scheduler
(subclass ``__init__`` chains are a few frames deep)."""


def engine_core_waker() -> Any:
    """A callable that wakes the vLLM engine-core loop building the calling scheduler, or ``None``.

    Call it from the scheduler's ``__init__``. vLLM's ``EngineCoreProc`` blocks on its
    ``input_queue`` while its scheduler has no requests; putting ``(WAKEUP, None)`` there (the
    no-op vLLM itself sends to wake the loop at shutdown) makes the loop check
    ``scheduler.has_requests()`` again. The engine core is found as ``self`` of the
    ``EngineCore.__init__`` frame up the stack (``EngineCoreProc.__init__`` creates
    ``input_queue`` before it builds the scheduler, checked by :func:`~.compat.check_compat`).

    Returns:
        A thread-safe, non-blocking ``wake()``; ``None`` outside an engine-core process (the
        in-process ``EngineCore``, the simulator, tests), where the caller steps the scheduler.
    """
    from vllm.v1.engine import EngineCoreRequestType
    from vllm.v1.engine.core import EngineCoreProc

    frame = sys._getframe(1)
    for _ in range(_MAX_WAKER_FRAMES):
        if frame is None:
            return None
        owner = frame.f_locals.get("self")
        if isinstance(owner, EngineCoreProc):
            inputs = getattr(owner, "input_queue", None)
            if not isinstance(inputs, queue.Queue):
                return None
            wakeup = (EngineCoreRequestType.WAKEUP, None)
            return lambda: inputs.put_nowait(wakeup)
        frame = frame.f_back
    return None


def enable_victim_ranks(sched: Scheduler) -> None:
    """Make vLLM pick preemption victims by ``max(running, key=(priority, arrival_time))``.

    Only the victim choice in ``schedule()`` reads ``self.policy`` after ``__init__`` (our own
    waiting queue replaces the priority heap), so this changes nothing else.
    """
    sched.policy = SchedulingPolicy.PRIORITY


def set_victim_ranks(requests: Iterable[Request]) -> list[tuple[Request, int]]:
    """Write ranks so that vLLM evicts in the given order: first = evicted first.

    Mutates ``Request.priority`` for one ``schedule()``: vLLM reads it there only for the victim
    choice (our waiting queue replaces its priority heap, and a class that ranks victims refuses
    ``--scheduling-policy priority``). The caller puts the user's priorities back after the step
    with :func:`restore_priorities` (issue 33: the ranks used to stay, so the user's priority was
    lost for good).

    Returns:
        ``(request, user priority)`` of each ranked request, for :func:`restore_priorities`.
    """
    ranked = list(requests)
    saved = [(request, request.priority) for request in ranked]
    n = len(ranked)
    for i, request in enumerate(ranked):
        request.priority = n - i
    return saved


def restore_priorities(saved: Iterable[tuple[Request, int]]) -> None:
    """Undo :func:`set_victim_ranks` (``saved`` is what it returned). Mutates the requests."""
    for request, priority in saved:
        request.priority = priority


def enable_chunk_hook(sched: Scheduler, enabled: bool = True) -> None:
    """Make vLLM call ``_mamba_block_aligned_split`` for every chunk it sizes (or stop).

    Only ``schedule()`` reads the flag after ``__init__``, so it may be toggled between steps. Our
    override calls vLLM's Mamba split first when the model really needs it (then keep it on).
    """
    sched.need_mamba_block_aligned_split = enabled


def model_needs_mamba_split(sched: Scheduler) -> bool:
    """vLLM's own condition for the Mamba block-aligned split (computed as in ``__init__``)."""
    return bool(sched.has_mamba_layers and sched.cache_config.mamba_cache_mode == "align")


def finish_with_error_next_step(sched: Scheduler, request_id: str, message: str = "rejected by the scheduler") -> None:
    """Have vLLM finish ``request_id`` with FINISHED_ERROR (and send its output) at the next
    ``update_from_output`` (the same path vLLM uses for grammar compile errors).

    vLLM 0.32 keeps those ids in a set; 0.33 maps each to a ``RequestError`` that reaches the
    client, so ``message`` (what was wrong and how to fix it) is sent there with code
    ``validation_error`` (vLLM's non-retryable request error). Mutates ``sched``.
    """
    errors = sched.grammar_compile_error_reqs
    if compat.vllm_release() >= (0, 33):
        from vllm.outputs import RequestError

        errors[request_id] = RequestError(code="validation_error", message=message)
    else:
        errors.add(request_id)


def max_num_scheduled_tokens(sched: Scheduler) -> int:
    """Token budget of one step."""
    return int(sched.max_num_scheduled_tokens)


def max_num_running_reqs(sched: Scheduler) -> int:
    """Most requests that run at once (vLLM's ``--max-num-seqs``)."""
    return int(sched.max_num_running_reqs)


def is_chunked_mm_input_disabled(sched: Scheduler) -> bool:
    """Whether vLLM refuses to split a multimodal item across chunks (and trusts a chunk that
    starts on one to cover it)."""
    return bool(sched.scheduler_config.disable_chunked_mm_input)
