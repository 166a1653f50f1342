"""The ingress deployment: the MARS gateway over the engine deployments, with their addresses kept fresh.

The body of the ``ingress`` deployment (:mod:`~mars_openhands.serve.app`). It serves the gateway
(:class:`~mars_openhands.control.app.Gateway`: the same OpenAI-compatible endpoint, ``/mars/v1/*``
routes, auth and stream as ``mars-openhands gateway``) on ``gateway.host:gateway.port`` of the
node it runs on, and its :class:`~mars_openhands.control.plane.ControlPlane` makes every decision:
admission and reorder (the AIMD window), routing (``Router.route``: affinity, then least loaded),
replica failure and fail-over. What is new here is only the link to Ray:

* replicas are the ``engine-<i>`` deployments; a thread per engine asks it
  (:meth:`~mars_openhands.serve.engine.EngineReplica.poll`, a Ray call) for its address and its
  new GPU-plane events every ``poll_interval_s``; the events go to ``Gateway.on_engine_event``
  (the stream, the KV signal), a changed address to the replica table, and a new incarnation
  (Ray replaced the replica) to ``Gateway.on_replica_replaced`` (a ``replica_replaced`` event);
* CPU-plane events the gateway forwards to a replica travel as Ray calls
  (:class:`HandlePublisher` → ``EngineReplica.post_events``), in order, one batch at a time.

Mental model: Ray Serve is the cluster layer (placement, restarts, the control channel); the
gateway is unchanged and does not know it runs in an actor.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
import time
from typing import Any

from mars_openhands.control.app import Gateway
from mars_openhands.control.config import GatewayConfig, ReplicaConfig
from mars_openhands.serve.config import ServeConfig
from mars_openhands.stream.events import Event

__all__ = ["GatewayIngress", "HandlePublisher", "gateway_config"]

logger = logging.getLogger(__name__)

POLL_TIMEOUT_S = 5.0
"""Seconds one poll of an engine may take; a replica being replaced answers none."""


def gateway_config(config: ServeConfig, urls: list[str], api_key: str | None) -> GatewayConfig:
    """The ingress gateway's configuration: ``config.gateway`` plus one replica per engine. Pure.

    Raises:
        pydantic.ValidationError: a bad ``config.gateway`` key or value.
    """
    replicas = [ReplicaConfig(url=url, name=f"engine-{i}", api_key=api_key)
                for i, url in enumerate(urls)]
    return GatewayConfig.model_validate({**config.gateway, "replicas": replicas})


class HandlePublisher:
    """An ``EventSink`` that sends CPU-plane events to one engine deployment, in order.

    ``emit`` never blocks (the gateway's loop calls it); a sender thread sends what is queued as
    one ``post_events`` call at a time, so a ``tool_end`` never overtakes its ``tool_start``. A
    batch that fails (the replica is being replaced) is dropped and counted: its sessions are
    re-routed anyway.
    """

    def __init__(self, handle: Any, name: str) -> None:
        self.handle = handle
        self.num_dropped = 0
        self._queue: queue.SimpleQueue[Event | None] = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._send_loop, name=f"mars-events-{name}",
                                        daemon=True)
        self._thread.start()

    def emit(self, event: Event) -> None:
        """Queue one event. Never blocks."""
        self._queue.put(event)

    def close(self) -> None:
        """Stop the sender after what is queued. Idempotent."""
        self._queue.put(None)

    def _send_loop(self) -> None:
        while True:
            batch = [self._queue.get()]
            while not self._queue.empty() and len(batch) < 256:
                batch.append(self._queue.get())
            events = [e for e in batch if e is not None]
            if events:
                response = self.handle.post_events.remote(events)
                try:
                    response.result(timeout_s=POLL_TIMEOUT_S)
                except Exception as e:  # replaced replica: its sessions move on
                    response.cancel()  # not to a replica that replaces it: unknown sessions there
                    self.num_dropped += len(events)
                    logger.warning("CPU-plane events to %s dropped (%d): %r", self.handle,
                                   len(events), e)
            if len(events) < len(batch):
                return


class GatewayIngress:
    """The gateway on its own thread and event loop, fed by the engine deployments.

    Args:
        config: the application's settings (``config.gateway``: the gateway's keys).
        api_key: the engines' vLLM ``--api-key`` (the gateway sends it to them).
        engines: handles of ``engine-0`` … ``engine-<N-1>``.
        poll_interval_s: seconds between two polls of one engine.
    """

    def __init__(self, config: ServeConfig, api_key: str | None, *engines: Any,
                 poll_interval_s: float = 0.25) -> None:
        self.config = config
        self.engines = engines
        self.poll_interval_s = poll_interval_s
        self.gateway: Gateway | None = None
        self.url: str | None = None
        self.error: str | None = None
        self._api_key = api_key
        self._loop: asyncio.AbstractEventLoop | None = None
        self._server: Any = None
        self._stop = threading.Event()
        self._threads: list[threading.Thread] = [threading.Thread(
            target=self._serve, name="mars-serve-gateway", daemon=True)]
        self._threads[0].start()

    # ------------------------------------------------------------------ Ray Serve calls
    def gateway_url(self) -> str | None:
        """``http://host:port`` of the gateway once it serves, else ``None``.

        Raises:
            RuntimeError: the gateway failed to start (the message says why).
        """
        if self.error is not None:
            raise RuntimeError(self.error)
        return self.url

    def check_health(self) -> None:
        """Ray Serve's health check. Raises RuntimeError if the gateway's thread failed."""
        if self.error is not None:
            raise RuntimeError(self.error)

    def __del__(self) -> None:
        """Ray Serve's shutdown: stop polling and the server (the stream is flushed and closed)."""
        if not hasattr(self, "_stop"):  # the constructor did not run
            return
        self._stop.set()
        if self._server is not None:
            self._server.should_exit = True
        for thread in self._threads[:1]:
            thread.join(timeout=30)

    # ------------------------------------------------------------------ the gateway's thread
    def _first_infos(self) -> list[dict[str, Any]]:
        """Each engine's ``poll`` answer, waiting for engines still starting."""
        pending = [h.poll.remote(None, 0) for h in self.engines]
        return [r.result(timeout_s=self.config.engine_startup_timeout_s) for r in pending]

    def _serve(self) -> None:
        import uvicorn

        try:
            infos = self._first_infos()
            gw_config = gateway_config(self.config, [i["url"] for i in infos], self._api_key)
        except Exception as e:
            self.error = f"the gateway could not start: {e}"
            logger.exception("ingress: %s", self.error)
            return
        self._loop = loop = asyncio.new_event_loop()
        asyncio.set_event_loop(loop)
        self.gateway = Gateway(gw_config)
        self._server = uvicorn.Server(uvicorn.Config(
            self.gateway.app, host=gw_config.host, port=gw_config.port, log_level="warning",
            access_log=False, proxy_headers=False, timeout_graceful_shutdown=2, lifespan="on"))
        loop.create_task(self._after_start(infos))
        try:
            loop.run_until_complete(self._server.serve())
        except BaseException as e:
            self.error = f"the gateway stopped: {e!r}"
            logger.exception("ingress: %s", self.error)
        finally:
            self._stop.set()
            loop.close()

    async def _after_start(self, infos: list[dict[str, Any]]) -> None:
        """Once uvicorn serves: route CPU-plane events through Ray, start the engine pollers."""
        while not self._server.started:
            if self._server.should_exit:
                return
            await asyncio.sleep(0.01)
        gateway = self.gateway
        assert gateway is not None and gateway.hub is not None, "Gateway.start() ran in lifespan"
        for i, handle in enumerate(self.engines):
            gateway.hub.publishers[i] = HandlePublisher(handle, f"engine-{i}")
        config = gateway.config
        self.url = f"http://{config.host}:{config.port}"
        print(gateway.startup_line(self.url), flush=True)
        for i, info in enumerate(infos):
            thread = threading.Thread(target=self._poll_engine, args=(i, info), daemon=True,
                                      name=f"mars-poll-engine-{i}")
            self._threads.append(thread)
            thread.start()

    def _poll_engine(self, index: int, info: dict[str, Any]) -> None:
        """Thread: poll engine ``index`` until stopped; hand what changed to the gateway's loop."""
        handle, loop = self.engines[index], self._loop
        assert loop is not None, "the loop runs before the pollers start"
        incarnation, seq = info["incarnation"], info["next_seq"]
        self._deliver(index, info)
        while not self._stop.wait(self.poll_interval_s):
            response = handle.poll.remote(incarnation, seq)
            try:
                info = response.result(timeout_s=POLL_TIMEOUT_S)
            except Exception as e:  # being replaced; the gateway's own poll marks it down
                response.cancel()
                logger.debug("engine-%d poll failed: %r", index, e)
                continue
            replaced = incarnation if info["incarnation"] != incarnation else None
            incarnation, seq = info["incarnation"], info["next_seq"]
            if not loop.is_closed():
                loop.call_soon_threadsafe(self._deliver, index, info, replaced)

    def _deliver(self, index: int, info: dict[str, Any],
                 replaced_incarnation: str | None = None) -> None:
        """Gateway loop: apply one poll answer (address, GPU-plane events; a new incarnation
        after ``replaced_incarnation``: Ray replaced the replica). Mutates the gateway."""
        gateway = self.gateway
        if gateway is None:
            return
        replica = gateway.router.replicas[index]
        if replica.url != info["url"]:
            logger.warning("engine-%d moved: %s → %s", index, replica.url, info["url"])
            replica.url = info["url"]
        if replaced_incarnation is not None:
            gateway.on_replica_replaced(index, replaced_incarnation, info["incarnation"],
                                        info["url"])
        for event in info["events"]:
            gateway.on_engine_event(event)


def wait_for_url(handle: Any, timeout_s: float, poll_s: float = 0.5) -> str:
    """The gateway URL from the ingress ``handle`` once it serves (driver side).

    Raises:
        TimeoutError: not serving within ``timeout_s``.
        RuntimeError: the gateway failed to start.
    """
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        url = handle.gateway_url.remote().result(timeout_s=timeout_s)
        if url is not None:
            return str(url)
        time.sleep(poll_s)
    raise TimeoutError(f"the gateway did not serve within {timeout_s:.0f} s")
