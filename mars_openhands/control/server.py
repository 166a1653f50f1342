"""Running the gateway: in the foreground (the CLI) or in a background thread (tests, benchmarks).

uvicorn picks uvloop and httptools when installed (vLLM and uvicorn[standard] bring both). ``proxy_headers`` is off: the gateway does not read
``X-Forwarded-*``, and the middleware costs a little on every request.
"""

from __future__ import annotations

import logging
import socket
import sys
import threading
import time
from types import TracebackType

import uvicorn

from mars_openhands.control.app import Gateway
from mars_openhands.control.config import GatewayConfig
from mars_openhands.stream.transport import EventSink

__all__ = ["GatewayServer", "run_gateway"]

logger = logging.getLogger(__name__)


class _AnnouncingServer(uvicorn.Server):
    """A uvicorn server that prints the gateway's start-up line once its socket is bound."""

    def __init__(self, config: uvicorn.Config, gateway: Gateway) -> None:
        super().__init__(config)
        self.gateway = gateway

    async def startup(self, sockets: list[socket.socket] | None = None) -> None:
        await super().startup(sockets)
        if self.started:
            servers = getattr(self, "servers", [])
            bound = [s.getsockname() for srv in servers for s in (srv.sockets or ())]
            port = bound[0][1] if bound else self.config.port
            print(self.gateway.startup_line(f"http://{self.config.host}:{port}"), file=sys.stderr,
                  flush=True)


def run_gateway(config: GatewayConfig, sink: EventSink | None = None) -> None:
    """Serve the gateway until interrupted (blocking). Used by ``mars-openhands gateway``.

    Prints one start-up line to stderr once it listens (:meth:`Gateway.startup_line`).
    """
    gateway = Gateway(config, sink)
    server = _AnnouncingServer(uvicorn.Config(
        gateway.app, host=config.host, port=config.port, log_level="warning", access_log=False,
        proxy_headers=False, timeout_graceful_shutdown=5,
    ), gateway)
    server.run()


def _free_port(host: str) -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


class GatewayServer:
    """The gateway on a uvicorn server in a background thread (tests, benchmarks, notebooks).

    Usage::

        with GatewayServer(config) as server:
            httpx.post(f"{server.url}/v1/chat/completions", json=...)
            server.gateway.state()   # read only from tests; the gateway runs on the server thread

    Args:
        config: gateway config; ``port=0`` picks a free port.
        sink: stream sink (see :class:`~mars_openhands.control.app.Gateway`).
        startup_timeout_s: how long to wait for the server to accept connections.

    Raises:
        RuntimeError: the server did not start within ``startup_timeout_s`` (or crashed).
    """

    def __init__(
        self, config: GatewayConfig, sink: EventSink | None = None, startup_timeout_s: float = 20.0
    ) -> None:
        port = config.port or _free_port(config.host)
        self.config = config.model_copy(update={"port": port})
        self.gateway = Gateway(self.config, sink)
        self.startup_timeout_s = startup_timeout_s
        self._server = uvicorn.Server(uvicorn.Config(
            self.gateway.app, host=self.config.host, port=port, log_level="warning",
            access_log=False, proxy_headers=False, timeout_graceful_shutdown=2, lifespan="on",
        ))
        self._thread = threading.Thread(target=self._server.run, name="mars-gateway", daemon=True)

    @property
    def url(self) -> str:
        """``http://host:port`` of the gateway."""
        return f"http://{self.config.host}:{self.config.port}"

    @property
    def base_url(self) -> str:
        """OpenAI base URL (``…/v1``)."""
        return f"{self.url}/v1"

    def start(self) -> GatewayServer:
        """Start the server thread and wait until it serves."""
        self._thread.start()
        deadline = time.monotonic() + self.startup_timeout_s
        while not self._server.started:
            if not self._thread.is_alive() or time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(
                    f"gateway did not start on {self.url} within {self.startup_timeout_s} s"
                )
            time.sleep(0.01)
        return self

    def stop(self) -> None:
        """Shut the server down (lifespan stops the gateway) and join the thread. Idempotent."""
        self._server.should_exit = True
        if self._thread.is_alive():
            self._thread.join(timeout=30)

    def __enter__(self) -> GatewayServer:
        return self.start()

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.stop()
