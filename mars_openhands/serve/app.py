"""The Ray Serve application of ``mars-openhands serve``: N engine deployments and the gateway ingress.

::

    agents ──HTTP (OpenAI API, /mars/v1/*)──▶ ingress (GatewayIngress: Gateway + ControlPlane)
                                                 │  HTTP to the chosen replica's vLLM server
                                                 ├──▶ engine-0 (EngineReplica: vLLM + MarsScheduler)
                                                 ├──▶ engine-1 ...
                                                 │  Ray calls: poll (address, GPU-plane events),
                                                 └─────────── post_events (CPU-plane events)

One deployment per replica (``num_replicas=1`` each), not one deployment of N: the control plane
routes by replica *index* (its replica table: affinity, KV signals, failures), and each index keeps
its name when Ray replaces the actor behind it. Ray Serve's own HTTP proxy is off: the gateway
serves HTTP itself (one hop less, and the same server as ``mars-openhands gateway``).

:func:`build_app` is pure (an unstarted Application); :func:`serve_forever` is the CLI's
lifecycle: join or start Ray, run the application, wait, and shut everything down.
"""

from __future__ import annotations

import logging
import secrets
import signal
import sys
import threading
import time
from collections.abc import Callable
from typing import Any

from mars_openhands.serve.config import ServeConfig

__all__ = ["APP_NAME", "build_app", "serve_forever", "start"]

logger = logging.getLogger(__name__)

APP_NAME = "mars"
"""The Ray Serve application's name (``serve status``)."""


HEAD_NODE_RESOURCE = "node:__internal_head__"
"""The custom resource Ray gives the head node only (``ray._common.constants``, Ray 2.60)."""


def build_app(config: ServeConfig, ingress_node_ip: str | None = None,
              api_key: str | None = None, run_id: str | None = None) -> Any:
    """The Serve application: ``engine-0`` … ``engine-<N-1>`` and the ``ingress``.

    Args:
        config: the application's settings.
        ingress_node_ip: run the ingress (the gateway's HTTP port) on this node; ``None``:
            anywhere. Through a Ray Client (``ray://``) the driver's IP is its own machine's, no
            node of the cluster: the ingress then runs on the head node, whatever is given.
        api_key: the engines' vLLM ``--api-key`` (the gateway sends it; agents cannot reach an
            engine around the gateway); ``None``: a fresh random one.
        run_id: names the engines' temporary directories on each node
            (:func:`~mars_openhands.serve.engine.run_root`); ``None``: each engine picks one.

    Returns:
        A ``ray.serve.Application`` (not started).
    """
    from ray import serve

    from mars_openhands.serve.engine import EngineReplica
    from mars_openhands.serve.ingress import GatewayIngress

    key = api_key or secrets.token_urlsafe(24)
    engine_options = {"num_cpus": config.cpus_per_replica, "num_gpus": config.gpus_per_replica}
    engines = [
        serve.deployment(EngineReplica, name=f"engine-{i}", num_replicas=1,
                         ray_actor_options=engine_options,
                         health_check_period_s=config.health_check_period_s,
                         health_check_timeout_s=max(30.0, 4 * config.health_check_period_s),
                         graceful_shutdown_timeout_s=30.0, max_ongoing_requests=64,
                         max_constructor_retry_count=config.engine_start_attempts,
                         ).bind(config, i, key, run_id)
        for i in range(config.num_replicas)
    ]
    ingress_options: dict[str, Any] = {"num_cpus": 0}
    if config.is_ray_client:
        ingress_options["resources"] = {HEAD_NODE_RESOURCE: 0.001}
    elif ingress_node_ip is not None:
        ingress_options["resources"] = {f"node:{ingress_node_ip}": 0.001}
    ingress = serve.deployment(GatewayIngress, name="ingress", num_replicas=1,
                               ray_actor_options=ingress_options, max_ongoing_requests=64,
                               graceful_shutdown_timeout_s=30.0)
    return ingress.bind(config, key, *engines)


def start(config: ServeConfig, on_ray_started: Callable[[], None] | None = None,
          run_id: str | None = None) -> tuple[Any, str]:
    """Join (``config.ray_address``) or start Ray, run the application, wait until it serves.

    Args:
        config: the application's settings.
        on_ray_started: called once Ray is up, before the (minutes-long) engine start: Ray's
            driver puts its own SIGTERM handler in place, which aborts the process (no clean-up),
            so the caller re-installs its own here.
        run_id: the run's id (:func:`build_app`); give the same one to :func:`stop`.

    Returns:
        ``(ingress handle, gateway URL)``.

    Raises:
        RuntimeError, TimeoutError: the application did not come up (the message says why: for
            an engine whose vLLM server did not start, its own error, with the log's last lines
            and where the log is kept).
    """
    import ray
    from ray import serve

    from mars_openhands.serve.ingress import wait_for_url

    if config.ray_address is None:  # "local": a new Ray even where RAY_ADDRESS or `ray start`
        # names a cluster (stop() shuts Serve and Ray down: never someone else's)
        num_cpus = int(config.num_replicas * config.cpus_per_replica) + 2  # + a replacement
        ray.init(address="local", num_cpus=num_cpus, include_dashboard=False,
                 _temp_dir=config.ray_temp_dir, log_to_driver=False, configure_logging=False)
    else:
        ray.init(address=config.ray_address, log_to_driver=False, configure_logging=False)
    if on_ray_started is not None:
        on_ray_started()
    serve.start(proxy_location="Disabled")
    app = build_app(config, ingress_node_ip=ray.util.get_node_ip_address(), run_id=run_id)
    try:
        handle = serve.run(app, name=APP_NAME, route_prefix=None)
    except RuntimeError as e:  # "Deploying application mars failed: Failed to update the
        # deployments ['engine-0']": the why is in each deployment's status message
        raise RuntimeError("\n".join([str(e), *_failed_deployments()])) from None
    return handle, wait_for_url(handle, config.engine_startup_timeout_s)


def _failed_deployments() -> list[str]:
    """What each failed deployment of the application says (an engine: its own start-up error,
    :func:`~mars_openhands.serve.engine.engine_failure_text`); empty when Serve cannot say."""
    from ray import serve

    from mars_openhands.serve.engine import engine_failure_text

    try:
        deployments = serve.status().applications[APP_NAME].deployments
    except Exception:  # the status is a courtesy: the deploy's own error is raised anyway
        return []
    return [engine_failure_text(name, status.message or "")
            for name, status in sorted(deployments.items())
            if str(status.status).endswith("DEPLOY_FAILED")]


class _StartInterrupted(BaseException):
    """SIGINT/SIGTERM while :func:`start` runs (a ``BaseException``: no ``except Exception`` in
    Ray's start-up code swallows it)."""

    def __init__(self, signum: int) -> None:
        super().__init__(signum)
        self.signum = signum


STOP_TIMEOUT_S = 45.0
"""Seconds :func:`stop` waits for the application's graceful delete (each replica gets Serve's
``graceful_shutdown_timeout_s``, 30 s) before it stops Ray anyway; below the 60 s after which
Ray's driver aborts the process once its GCS is unreachable."""


_SERVE_NEEDS = frozenset({"gcs_server", "raylet"})
"""Ray's own processes without which no Serve call answers (Ray 2.60's process-type names)."""


def _lost_ray_daemons() -> list[str]:
    """The private Ray's GCS and raylet, of those that have exited: a SIGTERM to the whole
    process group (``timeout``, a service manager) reaches them too, and then no Serve call can
    answer. Empty when Ray was joined (its processes are not this command's). Reads Ray's node
    object (``ray._private.worker._global_node``, Ray 2.60); empty when it is not there."""
    try:
        from ray._private import worker

        node = worker._global_node
        return sorted({kind for kind, _ in node.dead_processes()} & _SERVE_NEEDS) if node else []
    except Exception:  # a Ray without that internal: fall back to the bounded delete
        return []


def stop(config: ServeConfig, run_id: str | None = None) -> None:
    """Delete the application and, for a private Ray, stop Ray (no process left); then remove the
    engines' temporary directories on this node (``run_id``'s
    :func:`~mars_openhands.serve.engine.run_root`: an engine that Ray killed, as it does one
    still starting, had no chance to; a log an engine kept after a failed start stays, its path
    printed). Idempotent.

    The delete (each replica's graceful shutdown: vLLM stopped, stream closed) is skipped when the
    private Ray's own processes are already gone, and given up after :data:`STOP_TIMEOUT_S`; Ray
    is stopped either way. The engines' vLLM processes then end by their watchdogs
    (engine/harness/reaper.py), which outlive any actor.
    """
    try:
        _stop_ray(config)
    finally:
        if run_id is not None:
            from mars_openhands.serve.engine import remove_run_root

            remove_run_root(run_id)


def _stop_ray(config: ServeConfig) -> None:
    """:func:`stop`'s application delete and Ray shutdown."""
    import ray
    from ray import serve

    if not ray.is_initialized():
        return
    try:
        lost = _lost_ray_daemons()
        if lost:
            print(f"mars-openhands serve: Ray's {', '.join(lost)} already exited (a signal to the "
                  "whole process group?): stopping Ray without the application's graceful delete",
                  file=sys.stderr, flush=True)
            return

        def delete() -> None:
            try:
                serve.delete(APP_NAME)
                if config.ray_address is None:
                    serve.shutdown()
            except Exception as e:  # stop Ray anyway (the finally below); say why, in one line
                print(f"mars-openhands serve: deleting the application failed: {e}",
                      file=sys.stderr, flush=True)

        deleting = threading.Thread(target=delete, name="serve-delete", daemon=True)
        deleting.start()
        deadline_s = time.monotonic() + STOP_TIMEOUT_S
        while deleting.is_alive() and time.monotonic() < deadline_s:
            deleting.join(0.5)
            if deleting.is_alive() and (lost := _lost_ray_daemons()):  # the signal reached them
                print(f"mars-openhands serve: Ray's {', '.join(lost)} exited meanwhile: "
                      "stopping Ray without waiting for the delete", file=sys.stderr, flush=True)
                return
        if deleting.is_alive():
            print(f"mars-openhands serve: the application's delete took more than "
                  f"{STOP_TIMEOUT_S:g} s: stopping Ray anyway", file=sys.stderr, flush=True)
    finally:
        ray.shutdown()


def serve_forever(config: ServeConfig) -> int:
    """Run until SIGINT or SIGTERM, then shut down; the CLI's body.

    Prints ``MARS serve: ... listening on <url>`` to stderr once the gateway serves.

    A signal while the application starts (engines load for minutes) stops it as well: the start
    is abandoned and everything it started is shut down.

    Returns:
        0 after a clean stop; 1 when the application could not start (the reason on stderr);
        128 + the signal's number when a signal came before it served.
    """
    stopped = threading.Event()
    is_serving = False

    def on_signal(signum: int, _frame: object) -> None:
        stopped.set()
        if not is_serving:  # leave the start (Ray's waits are Python loops: this interrupts them)
            raise _StartInterrupted(signum)

    def install() -> None:
        for sig in (signal.SIGINT, signal.SIGTERM):
            signal.signal(sig, on_signal)

    install()
    run_id = secrets.token_hex(6)
    try:
        _, url = start(config, on_ray_started=install, run_id=run_id)
    except _StartInterrupted as e:
        print(f"mars-openhands serve: {signal.Signals(e.signum).name} while starting: stopping "
              "what started", file=sys.stderr, flush=True)
        stop(config, run_id)
        return 128 + e.signum
    except Exception as e:
        print(f"mars-openhands serve: error: the application did not start: {e}", file=sys.stderr,
              flush=True)
        stop(config, run_id)
        return 1
    is_serving = True
    print(f"MARS serve: {config.num_replicas} replica(s) of {config.scheduler} on Ray Serve; "
          f"gateway listening on {url} (OpenAI base {url}/v1)", file=sys.stderr, flush=True)
    install()  # the application's start may have put other handlers in place
    while not stopped.wait(0.5):
        pass
    print("mars-openhands serve: stopping (Serve application, engines, Ray)", file=sys.stderr,
          flush=True)
    stop(config, run_id)
    print("mars-openhands serve: stopped", file=sys.stderr, flush=True)
    return 0
