"""vLLM plugins: scheduler classes, the emulated-GPU executor, GPU-plane telemetry.

Importing this package does not import vLLM; a scheduler class is imported only when asked for
(``from mars_openhands.engine import MarsScheduler``, or vLLM resolving
``--scheduler-cls mars_openhands.engine.MarsScheduler``). To export another class, add one line
to ``_LAZY`` (public name -> "module:attribute").
"""

from __future__ import annotations

import importlib
from typing import Any

_LAZY: dict[str, str] = {
    "MarsBaseScheduler": "mars_openhands.engine.schedulers.base:MarsBaseScheduler",
    "MarsScheduler": "mars_openhands.engine.schedulers.mars:MarsScheduler",
    "MarsPreviewScheduler": "mars_openhands.engine.schedulers.mars_preview:MarsPreviewScheduler",
    "FcfsScheduler": "mars_openhands.engine.schedulers.fcfs:FcfsScheduler",
    "AutellixScheduler": "mars_openhands.engine.schedulers.autellix:AutellixScheduler",
    "InferceptScheduler": "mars_openhands.engine.schedulers.infercept:InferceptScheduler",
    "ContinuumScheduler": "mars_openhands.engine.schedulers.continuum:ContinuumScheduler",
    "ThunderAgentScheduler": "mars_openhands.engine.schedulers.thunderagent:ThunderAgentScheduler",
    "EmulatedGPUExecutor": "mars_openhands.engine.harness.executor.emulated:EmulatedGPUExecutor",
}
"""Public name -> "module:attribute", resolved on first access."""

__all__ = sorted(_LAZY)


def __getattr__(name: str) -> Any:
    target = _LAZY.get(name)
    if target is None:
        raise AttributeError(
            f"module {__name__!r} has no attribute {name!r}; exported classes: {sorted(_LAZY)}"
        )
    module_name, _, attr = target.partition(":")
    value = getattr(importlib.import_module(module_name), attr)
    globals()[name] = value  # cache: later lookups skip __getattr__
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_LAZY))
