"""The MARS gateway: OpenAI-compatible proxy running the external control plane (docs/gateway.md).

Public names are loaded lazily so that importing the package costs nothing (FastAPI, uvicorn,
msgspec and aiohttp load on first use): ``GatewayConfig``, ``ReplicaConfig``, ``Gateway``,
``GatewayServer``, ``run_gateway``.
"""

from __future__ import annotations

import importlib
from typing import Any

__all__ = ["Gateway", "GatewayConfig", "GatewayServer", "ReplicaConfig", "run_gateway"]

_WHERE = {
    "Gateway": "mars_openhands.control.app",
    "GatewayConfig": "mars_openhands.control.config",
    "ReplicaConfig": "mars_openhands.control.config",
    "GatewayServer": "mars_openhands.control.server",
    "run_gateway": "mars_openhands.control.server",
}


def __getattr__(name: str) -> Any:
    if name not in _WHERE:
        raise AttributeError(f"module 'mars_openhands.control' has no attribute {name!r}")
    return getattr(importlib.import_module(_WHERE[name]), name)
