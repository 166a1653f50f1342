"""vLLM general-plugin entry point (``[project.entry-points."vllm.general_plugins"]``).

vLLM calls ``register()`` in every process it starts (API server, engine core, workers). Our
scheduler classes need no registration (``--scheduler-cls mars_openhands.engine.MarsScheduler``
imports them by qualname); ``register()`` only verifies, once per process, that the installed vLLM
still has every private our seams use, so a version mismatch fails at startup with a message
instead of misbehaving later. It imports no CUDA-related module.
"""

from __future__ import annotations

import functools

__all__ = ["register"]


@functools.cache
def register() -> None:
    """Check the seams against the installed vLLM (idempotent: runs once per process).

    Raises:
        RuntimeError: a seam is missing (names it and the pinned vLLM version).
    """
    from mars_openhands.engine import seams

    seams.compat.check_compat()
