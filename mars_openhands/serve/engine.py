"""One engine replica under Ray Serve: a vLLM OpenAI server with a MARS scheduler, in one actor.

The body of each ``engine-<i>`` deployment (:mod:`~mars_openhands.serve.app`). Its constructor
starts ``python -m vllm.entrypoints.openai.api_server`` on the actor's node
(:class:`~mars_openhands.engine.harness.launch.VllmServer`: its own process group, torn down on
stop) with ``--scheduler-cls`` and ``--additional-config``, and wires the scheduler plugin's two
ZeroMQ channels to this actor over loopback (the project's sockets never leave a node,
``stream.transport.check_address``):

* GPU plane: the plugin's telemetry (``mars.telemetry.addr``) → a collector bound here; the events
  wait in a bounded log that the ingress reads by sequence number (:meth:`EngineReplica.poll`);
* CPU plane: the ingress calls :meth:`EngineReplica.post_events` (a Ray call, across nodes) → a
  publisher here → the plugin's inbox (``mars.inbox_addr``), so tool events reach the replica that
  holds the session.

Ray Serve calls :meth:`EngineReplica.check_health` every ``health_check_period_s``: a dead vLLM
server raises, Ray replaces the replica (a new actor, a new server, a new ``incarnation``), and the
ingress sees the new address at its next refresh.

Mental model: the actor is a thin shell; the engine is stock vLLM with our plugin, exactly as
``vllm serve`` runs it by hand; Ray adds placement, restarts and a control channel.
"""

from __future__ import annotations

import collections
import contextlib
import logging
import os
import shutil
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

from mars_openhands.cli_style import config_error_lines
from mars_openhands.engine.harness.launch import VllmServer, VllmServerError, VllmServerOptions
from mars_openhands.engine.harness.offload.params import HostKvParams
from mars_openhands.serve.config import ServeConfig
from mars_openhands.stream.events import Event

__all__ = ["EngineReplica", "check_engine_options", "checked_model", "engine_failure_text",
           "engine_options", "kept_log_path", "remove_run_root", "run_root"]

logger = logging.getLogger(__name__)

MAX_LOGGED_EVENTS = 65_536
"""GPU-plane events an engine keeps for the ingress (oldest dropped first; ~10 MiB)."""

START_FAILED = "did not start"
"""What an engine's start-up error says after its deployment's name (``engine-0 did not start:
...``): :func:`engine_failure_text` finds the engine's own message in Ray Serve's status by it."""


def _node_tmp() -> Path:
    """This node's temporary directory for a run's files: ``tempfile.gettempdir()``, or ``/tmp``
    when that is so long that an engine's ZeroMQ ``ipc://`` socket below it
    (``<tmp>/mars-serve-<run>/engine<i>-<12 hex>/gpu.sock``) would pass the 107-byte limit of a
    Unix socket path (seen: a pytest worker's temporary directory). Pure but for the lookup."""
    tmp = Path(tempfile.gettempdir())
    return tmp if len(str(tmp)) <= 48 else Path("/tmp")


def run_root(run_id: str) -> Path:
    """The directory on a node that holds every engine's run directory (sockets, vLLM log, tiny
    model) of the ``serve`` run ``run_id``: the driver removes it on its node whatever way the
    run stops (:func:`~mars_openhands.serve.app.stop`), also where Ray killed an engine's actor
    before its own clean-up ran. Pure."""
    return _node_tmp() / f"mars-serve-{run_id}"


def kept_log_path(run_id: str, index: int) -> Path:
    """Where engine ``index`` keeps its vLLM log when its server did not start (next to
    :func:`run_root`, not in it: the stop that follows keeps it; Ray Serve's retries of the
    engine overwrite it, so it is the last try's). Pure."""
    return _node_tmp() / f"mars-serve-{run_id}-engine{index}-vllm.log"


def remove_run_root(run_id: str) -> None:
    """Remove :func:`run_root` of ``run_id`` on this node (kept logs stay). Idempotent.

    Mutates: deletes files.
    """
    shutil.rmtree(run_root(run_id), ignore_errors=True)


def engine_failure_text(name: str, message: str, num_lines: int = 40) -> str:
    """The part of a failed deployment's Ray Serve status ``message`` that says why engine
    ``name`` did not start: from its own error (``<name> did not start: ...``, the last thing
    in Ray's traceback text) to the end; else the message's last ``num_lines`` lines. Pure."""
    start = message.find(f"{name} {START_FAILED}")
    if start >= 0:
        return message[start:].strip()
    return "\n".join(message.strip().splitlines()[-num_lines:])


def checked_model(model: str) -> str:
    """``--model`` checked on this machine, where every engine of a private Ray runs; returns
    it as the engines should get it: a local directory as an absolute path (each vLLM server
    runs in the repository's directory, not the caller's), anything else unchanged.

    A name that is no local path must be a Hugging Face model id (``org/name``): vLLM downloads
    it, or finds it in the Hugging Face cache; with ``HF_HUB_OFFLINE`` set it must be in the
    cache. ``tiny`` is the tests' model. Reads the file system (and the Hugging Face cache).

    Raises:
        ValueError: one line naming ``--model``: a path that does not exist, a directory without
            ``config.json``, a file that is not a GGUF model, a name that is neither a path nor
            a model id, or an id that is not cached while offline.
    """
    if model == "tiny":
        return model
    path = Path(model)
    if path.is_dir():
        if not any((path / name).is_file() for name in ("config.json", "params.json")):
            raise ValueError(f"--model {model}: the directory has no config.json, so it is no "
                             "Hugging Face model directory; pass the directory that holds the "
                             "model's config.json and weights")
        return str(path.absolute())
    if path.exists():
        if path.suffix != ".gguf":
            raise ValueError(f"--model {model}: a file, not a model directory (or a .gguf "
                             "model); pass the directory that holds the model's config.json")
        return str(path.absolute())
    from huggingface_hub import constants, try_to_load_from_cache
    from huggingface_hub.utils import validate_repo_id

    try:
        validate_repo_id(model)
    except ValueError:  # HFValidationError: "/nonexistent/model", "a/b/c", "my model"
        raise ValueError(f"--model {model}: no such model directory, and not a Hugging Face model "
                         "id (org/name); pass a directory that holds the model's config.json, "
                         "or an id such as Qwen/Qwen3-8B") from None
    if constants.HF_HUB_OFFLINE and not any(
            isinstance(try_to_load_from_cache(model, name), str)
            for name in ("config.json", "params.json")):
        raise ValueError(f"--model {model}: not in the local Hugging Face cache, and HF_HUB_OFFLINE "
                         "is set (nothing is downloaded); download it first (hf download "
                         f"{model}) or pass its directory")
    return model


def engine_options(config: ServeConfig, index: int, host: str, model_dir: str,
                   run_dir: Path) -> VllmServerOptions:
    """The vLLM server of replica ``index`` on a node reachable at ``host``. Pure.

    Args:
        config: the application's settings.
        index: the replica's index (its telemetry ``source`` is ``engine:<index>``).
        host: the address vLLM binds (the node's IP, so the ingress on another node reaches it).
        model_dir: ``--model`` (the tiny model's directory, or the configured model).
        run_dir: a directory of this actor for the ZeroMQ sockets and the server log.
    """
    mars = dict(config.additional_config.get("mars", {}))
    mars["telemetry"] = {**mars.get("telemetry", {}), "addr": f"ipc://{run_dir}/gpu.sock",
                         "source": f"engine:{index}"}
    mars["inbox_addr"] = f"ipc://{run_dir}/cpu.sock"
    on_gpu = config.gpus_per_replica > 0
    return VllmServerOptions(
        model_dir=Path(model_dir), host=host,
        served_model_name=config.served_model_name or ("tiny-llama" if config.is_tiny_model
                                                       else config.model),
        load_format=config.load_format or ("dummy" if config.is_tiny_model else "auto"),
        dtype=config.dtype or ("auto" if on_gpu else "float32"), enforce_eager=not on_gpu,
        is_on_gpu=on_gpu,
        scheduler_cls=config.scheduler_cls,
        additional_config={**config.additional_config, "mars": mars},
        max_model_len=config.max_model_len or (4096 if config.is_tiny_model else None),
        num_gpu_blocks_override=config.num_gpu_blocks_override, block_size=config.block_size,
        max_num_seqs=config.max_num_seqs, max_num_batched_tokens=config.max_num_batched_tokens,
        host_kv=HostKvParams(size_gib=config.host_kv_gib) if config.host_kv_gib else None,
        kv_cache_space_gib=config.kv_cache_space_gib, extra_args=config.vllm_args,
        extra_env=config.engine_env,
        startup_timeout_s=config.engine_startup_timeout_s, log_path=run_dir / "vllm.log",
        stop_timeout_s=5.0,  # SIGTERM, then SIGKILL: within Serve's graceful shutdown
        reap_with_owner=True,  # Ray SIGKILLs a replaced actor: its vLLM group must not outlive it
        api_key=None,
    )


_SERVE_FLAGS = {"extra_args": "vllm-arg", "extra_env": "engine-env",
                "startup_timeout_s": "engine-startup-timeout-s", "scheduler_cls": "scheduler"}
"""A :class:`VllmServerOptions` field -> the ``serve`` flag that sets it, where the names differ."""


def check_engine_options(config: ServeConfig) -> None:
    """Check now what each replica's actor checks when it starts its vLLM server: its
    :class:`VllmServerOptions` (``--block-size`` for the replica's device, KV for one request, no
    managed flag in ``--vllm-arg``) and the ``"mars"`` section of ``--additional-config`` as the
    scheduler plugin parses it (:func:`~mars_openhands.policy.params.parse_scheduler_params`, the
    one parser: an unknown key or a bad value). Pure.

    Without this, a bad value failed in every actor after Ray and the engines started (slow, and
    Ray Serve retries a failing constructor, then restarts the replica).

    Raises:
        ValueError: one line per problem, each naming the ``serve`` flag to fix.
    """
    from pydantic import ValidationError

    from mars_openhands.policy.params import parse_scheduler_params

    # First: engine_options reads the section as a dict (a ValueError here names the flag).
    parse_scheduler_params(config.additional_config.get("mars"))
    try:
        engine_options(config, 0, "127.0.0.1", config.model,
                       Path(tempfile.gettempdir()) / "mars-serve-engine0")
    except ValidationError as e:  # a check across fields goes to the first field it names
        flags = {field: f"--{_SERVE_FLAGS.get(field, field.replace('_', '-'))}"
                 for field in VllmServerOptions.model_fields}
        raise ValueError("\n".join(config_error_lines(e, flags))) from None


class EngineReplica:
    """A vLLM server with a MARS scheduler, its GPU-plane log and its CPU-plane inbox.

    Args:
        config: the application's settings.
        index: this replica's index among ``config.num_replicas``.
        api_key: the vLLM server's ``--api-key`` (the gateway sends it; agents never hold it).
        run_id: the ``serve`` run's id: the run directory lies under :func:`run_root` of it,
            which the driver removes at stop; ``None``: a fresh one (used alone, as in tests).

    Raises:
        VllmServerError: the server did not start; the message (``engine-<index> did not start:
            ...``) has the log's last lines and where the log is kept (:func:`kept_log_path`;
            the rest of the run directory is removed). Ray Serve retries the constructor.
    """

    def __init__(self, config: ServeConfig, index: int, api_key: str | None = None,
                 run_id: str | None = None) -> None:
        self.index = index
        self.incarnation = uuid.uuid4().hex[:12]
        """Changes when Ray replaces the replica (the ingress resets its event cursor)."""
        self._run_id = run_id or uuid.uuid4().hex[:12]
        root = run_root(self._run_id)
        root.mkdir(mode=0o700, exist_ok=True)
        self._run_dir = root / f"engine{index}-{self.incarnation}"
        self._run_dir.mkdir(mode=0o700, parents=True)  # parents: another engine's stop may
        # have removed the (then empty) root meanwhile
        self._events: collections.deque[tuple[int, Event]] = collections.deque(
            maxlen=MAX_LOGGED_EVENTS)
        self._next_seq = 0
        try:
            self._start(config, api_key)
        except VllmServerError as e:  # the server's own failure: keep its log, say where
            tail = self.server.log_tail(30) if getattr(self, "server", None) else ""
            kept = self._close(keep_log=True)
            where = f"its vLLM log is kept at {kept} on {_node_ip()}" if kept else "no vLLM log"
            raise VllmServerError(f"engine-{index} {START_FAILED}: {str(e).splitlines()[0]}\n"
                                  f"{where}; its last lines:\n{tail}") from None
        except BaseException:  # a bad option, a signal, Ray stopping the actor: leave nothing
            self._close()
            raise
        logger.info("engine-%d (%s) serves at %s, pid %d, ready in %.1f s", index,
                    self.incarnation, self.server.url, self.server.pid, self.server.startup_s or 0)

    def _start(self, config: ServeConfig, api_key: str | None) -> None:
        """Start the collector, the vLLM server (blocks until it serves) and the inbox."""
        from mars_openhands.stream.transport import ZmqEventCollector, ZmqEventPublisher

        options = engine_options(config, self.index, _node_ip(), self._model_dir(config),
                                 self._run_dir)
        self._collector = ZmqEventCollector(options.additional_config["mars"]["telemetry"]["addr"],
                                            self._log_event)
        self.server = VllmServer(options.model_copy(update={"api_key": api_key}))
        self.server.start()
        self._inbox = ZmqEventPublisher(options.additional_config["mars"]["inbox_addr"])
        self.started_s = time.time()

    def _model_dir(self, config: ServeConfig) -> str:
        if not config.is_tiny_model:
            return config.model
        from mars_openhands.engine.harness.tiny_model import write_tiny_model

        return str(write_tiny_model(self._run_dir / "tiny-model"))

    def _log_event(self, event: Event) -> None:
        """Collector thread: append one GPU-plane event with its sequence number."""
        self._events.append((self._next_seq, event))
        self._next_seq += 1

    # ------------------------------------------------------------------ Ray Serve calls
    def info(self) -> dict[str, Any]:
        """Where this replica serves: ``url``, ``pid`` (vLLM's process group), ``incarnation``,
        ``node_ip``, ``started_s`` (wall seconds). Pure."""
        return {"index": self.index, "url": self.server.url, "pid": self.server.pid,
                "incarnation": self.incarnation, "node_ip": self.server.options.host,
                "started_s": self.started_s}

    def poll(self, incarnation: str | None, seq: int) -> dict[str, Any]:
        """:meth:`info`, plus the GPU-plane events from sequence number ``seq`` on (all of them
        when ``incarnation`` is not this replica's: the caller knew the one Ray replaced) and
        ``next_seq``, the number to ask from next time. Pure.

        A cursor, not a drain: an answer lost on the way (the caller timed out) is sent again.
        """
        start = seq if incarnation == self.incarnation else 0
        logged = list(self._events)  # the collector thread appends meanwhile
        events = [e for s, e in logged if s >= start]
        return {**self.info(), "next_seq": logged[-1][0] + 1 if logged else 0, "events": events}

    def post_events(self, events: list[Event]) -> int:
        """Forward CPU-plane events of this replica's sessions to the scheduler's inbox.

        Returns:
            How many were queued (never blocks; the publisher drops past its buffer).
        """
        for event in events:
            self._inbox.emit(event)
        return len(events)

    def check_health(self) -> None:
        """Ray Serve's health check.

        Raises:
            RuntimeError: the vLLM server exited (Ray then replaces this replica).
        """
        if not self.server.is_running:
            raise RuntimeError(f"engine-{self.index}: vLLM server (pid group {self.server.pid}) "
                               f"exited; log tail:\n{self.server.log_tail(20)}")

    def record_routing_stats(self) -> dict[str, Any]:
        """Routing stats for :class:`~mars_openhands.serve.router.SessionRequestRouter`: the last
        ``engine_step``'s KV usage (0..1), GPU and host-tier blocks and queue sizes, when one
        arrived. Pure."""
        step = next((e for _, e in reversed(self._events) if e.kind == "engine_step"), None)
        if step is None or not step.num_gpu_blocks:
            return {}
        return {"kv_usage": step.num_used_blocks / step.num_gpu_blocks,
                "num_gpu_blocks": step.num_gpu_blocks, "num_host_blocks": step.num_host_blocks,
                "num_running": step.num_running, "num_waiting": step.num_waiting}

    def _close(self, keep_log: bool = False) -> Path | None:
        """Stop vLLM's process group and the sockets, and remove the run directory (model,
        sockets, log) and :func:`run_root` once empty. Idempotent.

        Args:
            keep_log: first move the vLLM log to :func:`kept_log_path`.

        Returns:
            The kept log's path; ``None`` when none was asked for or there was none.
        """
        for close in ("server", "_inbox", "_collector"):
            part = getattr(self, close, None)
            if part is None:
                continue
            try:
                part.stop() if close != "_inbox" else part.close()
            except Exception:  # shutting down: keep stopping the rest
                logger.exception("engine-%d: stopping %s failed", self.index, close)
            setattr(self, close, None)
        kept = None
        run_dir = getattr(self, "_run_dir", None)
        if run_dir is None:
            return None
        if keep_log and (run_dir / "vllm.log").is_file():
            kept = kept_log_path(self._run_id, self.index)
            try:
                os.replace(run_dir / "vllm.log", kept)
            except OSError:  # say where it was; it goes with the run directory
                logger.exception("engine-%d: keeping the vLLM log failed", self.index)
                kept = None
        shutil.rmtree(run_dir, ignore_errors=True)
        with contextlib.suppress(OSError):  # other engines of this run on this node still use it
            run_dir.parent.rmdir()
        self._run_dir = None
        return kept

    def __del__(self) -> None:
        """Ray Serve's shutdown (graceful): :meth:`_close`. Ray may kill the actor without it;
        then the driver's stop removes :func:`run_root` (on its node)."""
        self._close()


def _node_ip() -> str:
    """This node's address other nodes reach (Ray's view of it), loopback without Ray."""
    try:
        import ray

        return str(ray.util.get_node_ip_address())
    except Exception:  # not inside Ray (unit tests)
        return os.environ.get("MARS_SERVE_NODE_IP", "127.0.0.1")
