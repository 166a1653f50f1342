"""vLLM general-plugin entry point (``[project.entry-points."vllm.general_plugins"]``).

vLLM calls ``register()`` in every process it starts (API server, engine core, workers). Our
scheduler classes need no registration (``--scheduler-cls mars_openhands.engine.MarsScheduler``
imports them by qualname); ``register()`` only verifies, once per process, that the installed vLLM
still has every private our seams use, so a version mismatch fails at startup with a message
instead of misbehaving later. It imports no CUDA-related module.
"""

from __future__ import annotations

import contextlib
import functools
import importlib
import logging
from collections.abc import Iterator

__all__ = ["load_scheduler_cls", "register"]


@functools.cache
def register() -> None:
    """Check the seams against the installed vLLM (idempotent: runs once per process).

    Raises:
        RuntimeError: a seam is missing (names it and the pinned vLLM version).
    """
    from mars_openhands.engine import seams

    seams.compat.check_compat()


def load_scheduler_cls(qualname: str) -> type:
    """The class ``--scheduler-cls qualname`` names, imported here as vLLM's engine core will
    (``SchedulerConfig.get_scheduler_cls``), so a wrong name fails before any engine starts.

    Mutates: imports the class's module (and vLLM's scheduler interface).

    Args:
        qualname: a dotted ``package.module.Class``.

    Returns:
        The class, a subclass of vLLM's ``SchedulerInterface``.

    Raises:
        ValueError: vLLM is not importable here, the module or the attribute is missing, or it is
            not a scheduler class (the message names the value and what was expected).
    """
    with _quiet_vllm_logs():  # a failed import raises below: nothing the user needs is logged
        try:
            from vllm.v1.core.sched.interface import SchedulerInterface
        except ImportError as e:
            raise ValueError(f"cannot check scheduler {qualname!r}: vLLM is not importable here "
                             f"({e}); run from the engine env (.venv), where vLLM is installed") from None
        module_name, _, attr = qualname.rpartition(".")
        try:
            obj = getattr(importlib.import_module(module_name), attr)
        except Exception as e:  # the module runs arbitrary code: any failure is the user's to see
            raise ValueError(f"scheduler {qualname!r} cannot be imported: {type(e).__name__}: {e}; "
                             "give an importable package.module.Class") from None
    if not (isinstance(obj, type) and issubclass(obj, SchedulerInterface)):
        raise ValueError(f"scheduler {qualname!r} is {_describe(obj)}, not a vLLM scheduler class "
                         "(a subclass of vllm.v1.core.sched.interface.SchedulerInterface, e.g. "
                         "mars_openhands.engine.MarsScheduler)")
    return obj


@contextlib.contextmanager
def _quiet_vllm_logs() -> Iterator[None]:
    """vLLM's loggers show errors only, for the block (its import-time warnings, e.g. "Triton is
    installed, but doesn't include CPU backend", are noise around a flag check); the level the
    ``vllm`` logger had is restored afterwards.

    A logger level, not ``VLLM_LOGGING_LEVEL``: vLLM 0.32 configures its logging only when an
    engine starts (``configure_logging``), so import-time records reach Python's last-resort
    handler, which no vLLM setting filters. Mutates: the ``vllm`` logger's level, for the block.
    """
    logger = logging.getLogger("vllm")
    before = logger.level
    logger.setLevel(max(logging.ERROR, logger.getEffectiveLevel()))
    try:
        yield
    finally:
        logger.setLevel(before)


def _describe(obj: object) -> str:
    """``a class`` / ``a builtin_function_or_method`` ... for an error message."""
    return "a class" if isinstance(obj, type) else f"a {type(obj).__name__}"
