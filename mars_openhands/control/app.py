"""The MARS gateway: an OpenAI-compatible proxy running the external control plane (design.md §2, §3, §6).

Life of a request (``POST /v1/chat/completions`` or ``/v1/completions``; the hot path is
:mod:`mars_openhands.control.proxy`, raw ASGI)::

    agent ──▶ size/JSON checks (413/400) ──▶ session id, vllm_xargs check (metadata.py; 400)
          ──▶ admission slot (admission.py; waits here while the window is full) ──▶ replica
          (routing.py: affinity, else least loaded) ──▶ body += session_id, vllm_xargs{mars_turn,
          ...} ──▶ vLLM ◀── response (streamed chunk by chunk, or whole) ◀──

Background tasks: the AIMD tick (every ``update_interval_s``: idle sessions release their slots, the
window moves, waiting sessions are admitted, an ``admission_update`` is recorded), and one poller per
replica (``/metrics``: KV usage, health, restarts).

Failure behaviour (never a hang, never a leaked slot):

* client disconnect: the upstream request is cancelled (the upstream connection is closed, vLLM aborts the
  request) and the session's in-flight count drops; a one-turn session frees its slot.
* replica cannot be reached, dies mid-request (the connection breaks and ``/health`` does not
  answer) or is marked down by the poller while requests run: it is marked down, its sessions are
  re-routed (keeping their slots and turn counts), and every request that has not yet sent bytes to
  its agent is re-run on the next replica; when none is left, HTTP 503 naming every replica's
  error. A stream already under way ends with an SSE ``error`` chunk naming the replica. A broken
  connection to a replica that is still alive is HTTP 502 (the request may have run).
* bad input: HTTP 400 (malformed JSON, bad session id, bad ``vllm_xargs``, bad event), 404 (event for
  an unknown session), 413 (body larger than ``max_body_bytes``), never 5xx.
* a session idle past ``session_idle_timeout_s`` releases its slot.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import math
import time
from collections.abc import AsyncIterator, Callable, Mapping
from typing import Any, NamedTuple

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response

from mars_openhands.control import metadata
from mars_openhands.control.admission import AdmissionController
from mars_openhands.control.config import GatewayConfig
from mars_openhands.control.hub import EventHub, parse_cpu_batch, validate_cpu_batch
from mars_openhands.control.metadata import BadRequestError
from mars_openhands.control.metrics import parse_vllm_metrics, render_prometheus
from mars_openhands.control.proxy import PROXY_PATHS, ProxyHandler
from mars_openhands.control.routing import ReplicaState, Router
from mars_openhands.control.sessions import Session, SessionRegistry, ToolTracker
from mars_openhands.control.upstream import UpstreamBrokenError, UpstreamClient, UpstreamError
from mars_openhands.policy.admission import PressureSnapshot
from mars_openhands.stream.events import AdmissionUpdate, Event, now_stamps
from mars_openhands.stream.transport import EventSink

__all__ = ["Gateway", "build_app", "settings_line"]

logger = logging.getLogger(__name__)

def _error(status: int, message: str, kind: str = "invalid_request_error") -> JSONResponse:
    """An OpenAI-style error body."""
    return JSONResponse({"error": {"message": message, "type": kind, "code": status}}, status)


class _UpdateKey(NamedTuple):
    """The fields of an ``admission_update`` (stream/events.py), compared tick to tick."""

    window: int
    num_admitted: int
    num_waiting: int
    cpu_overloaded: bool
    kv_overloaded: bool
    tool_backlog_ratio: float
    tool_wait_ema_s: float
    kv_usage: float

    def differs_from(self, last: _UpdateKey) -> bool:
        """True if worth recording: a state field changed, or a pressure signal moved a step.

        Steps: any change of the tool backlog ratio (it moves in 1/N_tool steps), 0.01 of KV usage,
        and 10 % (at least 10 ms) of the tool-wait EMA, so that a signal sitting between its
        thresholds while the overload flag holds (hysteresis) is recorded once it settles, and an
        idle gateway records nothing but heartbeats.
        """
        return (
            self[:5] != last[:5] or self.tool_backlog_ratio != last.tool_backlog_ratio
            or abs(self.kv_usage - last.kv_usage) >= 0.01
            or abs(self.tool_wait_ema_s - last.tool_wait_ema_s)
            >= max(0.01, 0.1 * last.tool_wait_ema_s)
        )


def settings_line(config: GatewayConfig) -> str:
    """``replicas: ...; admission: ...; stream: ...``: the settings of a gateway start-up line. Pure."""
    replicas = ", ".join(f"{config.replica_name(i)}={r.url}" for i, r in enumerate(config.replicas))
    p = config.admission
    admission = (f"on (window {p.window_min}..{p.window_max}, starts at {p.window_init})"
                 if config.is_admission_enabled else "off (window computed, not enforced)")
    stream = config.stream_path or "not recorded (--stream-path)"
    return f"replicas: {replicas}; admission: {admission}; stream: {stream}"


class Gateway:
    """The gateway service: owns the registry, admission, routing, the hub and the HTTP app.

    Usage::

        gateway = Gateway(GatewayConfig(replicas=[ReplicaConfig(url="http://127.0.0.1:8001")]))
        uvicorn.run(gateway.app, host=..., port=...)   # or GatewayServer (server.py)

    Args:
        config: every parameter.
        sink: where the run's stream goes; default a ``StreamRecorder`` at ``config.stream_path``
            (owned and closed by the gateway), or nothing when that is ``None``.
        client_factory: builds the replica client at :meth:`start` (inside the serving loop);
            default an aiohttp :class:`~mars_openhands.control.upstream.UpstreamClient`. The
            in-process gateway (:mod:`mars_openhands.control.inprocess`) passes one that calls
            vLLM's ASGI app directly.
    """

    def __init__(self, config: GatewayConfig, sink: EventSink | None = None,
                 client_factory: Callable[[GatewayConfig], Any] | None = None) -> None:
        self.config = config
        self._client_factory = client_factory
        self._owns_sink = sink is None and config.stream_path is not None
        if self._owns_sink:
            from mars_openhands.stream.recorder import StreamRecorder

            sink = StreamRecorder(config.stream_path, write_parquet=config.stream_write_parquet)
        self.sink = sink
        self.sessions = SessionRegistry()
        self.tools = ToolTracker(config.num_tool_workers, config.admission.tool_wait_ema_alpha)
        self.admission = AdmissionController(
            config.admission, config.reorder, enabled=config.is_admission_enabled
        )
        self.router = Router(config)
        self.hub: EventHub | None = None
        self.client: UpstreamClient | None = None
        self._tasks: list[asyncio.Task[None]] = []
        self._collector: Any = None
        self.engine_events_address: str | None = None
        self.num_requests = 0
        self.num_client_disconnects = 0
        self.num_upstream_errors = 0
        self.num_idle_releases = 0
        self._last_update: _UpdateKey | None = None
        self._last_update_mono_s = 0.0
        self.fastapi_app = build_app(self)
        self.app = _ProxyFastPath(self, self.fastapi_app)
        """The ASGI app to serve: the two proxy routes on a fast path, the rest through FastAPI."""

    # ------------------------------------------------------------------ lifecycle
    def startup_line(self, url: str) -> str:
        """The one line printed when the gateway serves: listen URL, replicas, admission, stream."""
        return f"MARS gateway listening on {url} (OpenAI base {url}/v1); {self.settings_line()}"

    def settings_line(self) -> str:
        """``replicas: ...; admission: ...; stream: ...`` (the start-up line's settings)."""
        return settings_line(self.config)

    async def start(self) -> None:
        """Open the upstream client, the event channels and the background tasks."""
        self.client = (self._client_factory(self.config) if self._client_factory is not None else
                       UpstreamClient(self.config.upstream_connect_timeout_s,
                                      self.config.upstream_read_timeout_s))
        self.hub = EventHub(self.config, self.sink)
        if self.config.engine_events_address is not None:
            from mars_openhands.stream.transport import ZmqEventCollector

            loop = asyncio.get_running_loop()
            self._collector = ZmqEventCollector(
                self.config.engine_events_address,
                lambda event: loop.call_soon_threadsafe(self.on_engine_event, event),
            )
            self.engine_events_address = self._collector.address
        self._tasks = [asyncio.create_task(self._tick_loop(), name="mars-admission-tick")]
        self._tasks += [
            asyncio.create_task(self._poll_loop(r), name=f"mars-poll-{r.name}")
            for r in self.router.replicas
        ]

    async def stop(self) -> None:
        """Stop background tasks, close channels, the client and an owned recorder. Idempotent."""
        for task in self._tasks:
            task.cancel()
        for task in self._tasks:
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task
        self._tasks = []
        if self._collector is not None:
            await asyncio.to_thread(self._collector.stop)
            self._collector = None
        if self.hub is not None:
            await asyncio.to_thread(self.hub.close)
        if self.client is not None:
            await self.client.close()
            self.client = None
        if self._owns_sink and self.sink is not None:
            await asyncio.to_thread(self.sink.close)
            self._owns_sink = False

    # ------------------------------------------------------------------ signals
    def kv_usage(self) -> float | None:
        """KV usage u across healthy replicas (max), 0..1, or ``None`` if no replica reported."""
        now = time.monotonic()
        values = [
            u for r in self.router.healthy()
            if (u := r.kv_usage(now, self.config.engine_step_max_age_s)) is not None
        ]
        return max(values) if values else None

    def kv_budget_blocks(self) -> int | None:
        """Blocks a new session may still commit before the KV set threshold, on the best replica."""
        now = time.monotonic()
        budgets = []
        for r in self.router.healthy():
            usage = r.kv_usage(now, self.config.engine_step_max_age_s)
            if usage is not None and r.num_gpu_blocks:
                budgets.append(int((self.config.admission.kv_set_usage - usage) * r.num_gpu_blocks))
        return max(0, max(budgets)) if budgets else None

    def snapshot(self) -> PressureSnapshot:
        """The current pressure signals (design.md §6)."""
        return PressureSnapshot(
            tool_backlog_ratio=self.tools.backlog_ratio, tool_wait_ema_s=self.tools.wait_ema_s,
            kv_usage=self.kv_usage(), num_tool_workers=self.config.num_tool_workers,
        )

    def tick(self) -> None:
        """One control-plane tick: idle releases, AIMD update, admissions, ``admission_update``."""
        now = time.monotonic()
        if self.config.tool_wait_idle_decay:
            self.tools.decay_if_idle()
        for session in self.sessions.idle(now, self.config.session_idle_timeout_s):
            self.num_idle_releases += 1
            logger.info("session %s idle for %.1f s: releasing its slot", session.session_id,
                        now - session.last_activity_s)
            self.end_session(session)
        snap = self.snapshot()
        decision = self.admission.tick(snap, now, self.kv_budget_blocks())
        if self.hub is None:
            return
        st = decision.state
        update = _UpdateKey(
            window=st.window, num_admitted=len(self.admission.admitted),
            num_waiting=self.admission.num_waiting, cpu_overloaded=st.is_cpu_overloaded,
            kv_overloaded=st.is_kv_overloaded, tool_backlog_ratio=snap.tool_backlog_ratio,
            tool_wait_ema_s=snap.tool_wait_ema_s or 0.0, kv_usage=snap.kv_usage or 0.0,
        )
        last = self._last_update
        if (last is not None and not update.differs_from(last)
                and now - self._last_update_mono_s < self.config.admission_update_heartbeat_s):
            return
        self._last_update, self._last_update_mono_s = update, now
        self.hub.record(AdmissionUpdate(**now_stamps(), source="gateway", **update._asdict()))

    async def _tick_loop(self) -> None:
        while True:
            try:
                self.tick()
            except Exception:  # a bug in one tick must not stop admission forever
                logger.exception("admission tick failed")
            await asyncio.sleep(self.config.admission.update_interval_s)

    # ------------------------------------------------------------------ replicas
    async def poll_replica(self, replica: ReplicaState) -> None:
        """Poll one replica's ``/metrics`` once: KV usage, queue sizes, health, restarts."""
        assert self.client is not None, "Gateway.start() must run first"
        try:
            status, body, _ = await self.client.get(
                f"{replica.url}/metrics", self.config.upstream_connect_timeout_s
            )
            if status != 200:
                raise UpstreamBrokenError(f"HTTP {status}")
        except UpstreamError as e:
            reason = f"/metrics poll failed: {e}"
            if self.router.record_failure(replica.index, reason):
                self.on_replica_down(replica, reason)
            return
        m = parse_vllm_metrics(body.decode(errors="replace"))
        if self.router.record_success(replica.index):
            logger.warning("replica %s (%s) is back up", replica.name, replica.url)
        if m.process_start_s is not None:
            if replica.process_start_s is not None and m.process_start_s != replica.process_start_s:
                replica.num_restarts += 1
                logger.warning("replica %s restarted; its sessions' KV is gone", replica.name)
            replica.process_start_s = m.process_start_s
        replica.kv_usage_polled = m.kv_usage
        replica.kv_usage_polled_mono_s = time.monotonic()
        replica.num_running, replica.num_waiting = m.num_running, m.num_waiting
        replica.num_gpu_blocks = m.num_gpu_blocks or replica.num_gpu_blocks
        replica.block_size_tokens = m.block_size_tokens or replica.block_size_tokens

    async def _poll_loop(self, replica: ReplicaState) -> None:
        while True:
            try:
                await self.poll_replica(replica)
            except Exception:
                logger.exception("polling replica %s failed", replica.name)
            await asyncio.sleep(self.config.poll_interval_s)

    def on_replica_down(self, replica: ReplicaState, reason: str) -> None:
        """Detach the replica's sessions (re-routed on their next request), fail its requests."""
        logger.warning("replica %s (%s) marked down: %s", replica.name, replica.url, reason)
        for session in self.sessions:
            if session.replica == replica.index:
                self.router.detach(session)
        message = f"replica {replica.name} ({replica.url}) went down: {reason}"
        for handle in list(replica.in_flight):
            handle.fail(message)

    def on_engine_event(self, event: Event) -> None:
        """A GPU-plane event from an engine (collector thread → loop): record it, read KV usage."""
        if self.hub is not None:
            self.hub.num_gpu_events += 1
            self.hub.record(event)
        if event.kind == "engine_step" and event.num_gpu_blocks > 0:
            index = self.router.index_of_source(event.source)
            if index is not None:
                replica = self.router.replicas[index]
                replica.kv_usage_step = min(1.0, event.num_used_blocks / event.num_gpu_blocks)
                replica.kv_usage_step_mono_s = time.monotonic()
                replica.num_gpu_blocks = event.num_gpu_blocks

    # ------------------------------------------------------------------ sessions and events
    def end_session(self, session: Session) -> None:
        """Release the session's slot and replica binding and forget it. Mutates everything."""
        session.has_ended = True
        self.tools.forget(session)
        self.router.detach(session)
        if self.sessions.get(session.session_id) is session:
            self.sessions.remove(session.session_id)
        self.admission.release(session.session_id, time.monotonic(), self.kv_budget_blocks())

    def ingest_events(self, raw: bytes) -> int:
        """Apply a ``POST /mars/v1/events`` body. Returns the number of events accepted.

        Raises:
            BadRequestError: the batch is invalid (nothing applied).
        """
        assert self.hub is not None, "Gateway.start() must run first"
        events = parse_cpu_batch(raw, self.config.max_events_per_post)
        validate_cpu_batch(events, lambda sid: self.sessions.get(sid) is not None)
        now = time.monotonic()
        for event in events:
            assert event.session_id is not None
            session = self.sessions.get_or_create(event.session_id, now)
            session.last_activity_s = now
            if event.kind == "tool_enqueued":
                self.tools.on_enqueued(session, event.tool_call_id, event.tool_name)
            elif event.kind == "tool_start":
                self.tools.on_start(session, event.tool_call_id, event.tool_name, event.queue_wait_s)
            elif event.kind == "tool_end":
                self.tools.on_end(session, event.tool_call_id, event.tool_name, event.duration_s)
            self.hub.num_cpu_events += 1
            self.hub.record(event)
            self.hub.forward(session.replica, event)
            if event.kind == "session_end":
                self.end_session(session)
        return len(events)

    # ------------------------------------------------------------------ proxy
    async def is_alive(self, replica: ReplicaState) -> bool:
        """Probe ``/health`` once (connect timeout): tells a dead replica from a broken connection."""
        assert self.client is not None, "Gateway.start() must run first"
        try:
            status, _, _ = await self.client.get(f"{replica.url}/health",
                                                 self.config.upstream_connect_timeout_s)
        except UpstreamError:
            return False
        return status == 200

    async def wait_for_admission(self, session: Session, raw: bytes) -> None:
        """Wait for the session's slot (the slow path: the window is full or others wait).

        Raises:
            AdmissionTimeoutError: no slot within ``admission_wait_timeout_s``.
            asyncio.CancelledError: the client went away (the waiter is dropped).
        """
        try:
            body = json.loads(raw)
        except ValueError:
            body = {}
        tokens = metadata.estimate_prompt_tokens(body, len(raw), self.config.bytes_per_token)
        block_size = next(
            (r.block_size_tokens for r in self.router.replicas if r.block_size_tokens),
            self.config.block_size_tokens,
        )
        await self.admission.acquire(
            session.session_id, time.monotonic(), tokens, math.ceil(tokens / block_size),
            self.config.admission_wait_timeout_s,
        )

    def session_for(self, headers: Mapping[str, str],
                    fields: Mapping[str, Any]) -> tuple[Session, int | None]:
        """Find or create the request's session; also its ``mars_last_step``.

        Args:
            headers: request headers with lower-case names.
            fields: the body's gateway fields (``proxy.probe_body``) or the whole body.

        Raises:
            BadRequestError: a bad session id or ``mars_last_step``, naming the field.
        """
        session_id, _ = metadata.extract_session_id(headers, fields)
        last_step = metadata.extract_last_step(headers, fields)
        now = time.monotonic()
        if session_id is None:
            session_id = f"one-turn-{self.num_requests}-{now:.6f}"
            return self.sessions.get_or_create(session_id, now, is_one_turn=True), last_step
        return self.sessions.get_or_create(session_id, now), last_step

    def _finish(self, session: Session, replica: ReplicaState | None) -> None:
        """Bookkeeping when a request ends, exactly once: in-flight counts, one-turn release."""
        session.num_in_flight -= 1
        session.last_activity_s = time.monotonic()
        if replica is not None:
            replica.num_in_flight -= 1
        if session.is_one_turn and not session.has_ended:
            self.end_session(session)

    async def models(self) -> Response:
        """``GET /v1/models`` from the first healthy replica."""
        assert self.client is not None, "Gateway.start() must run first"
        for replica in self.router.healthy():
            try:
                status, body, content_type = await self.client.get(
                    f"{replica.url}/v1/models", self.config.upstream_read_timeout_s)
            except UpstreamError as e:
                self.router.record_failure(replica.index, str(e))
                continue
            return Response(body, status, media_type=content_type)
        return _error(503, "no healthy vLLM replica to list models", "no_replica")

    # ------------------------------------------------------------------ introspection
    def state(self) -> dict[str, Any]:
        """JSON-able view of the control plane (``GET /mars/v1/state``)."""
        decision = self.admission.last_decision
        return {
            "window": self.admission.window,
            "is_admission_enabled": self.config.is_admission_enabled,
            "num_admitted": len(self.admission.admitted),
            "num_waiting": self.admission.num_waiting,
            "is_cpu_overloaded": self.admission.state.is_cpu_overloaded,
            "is_kv_overloaded": self.admission.state.is_kv_overloaded,
            "cpu_cap": decision.cpu_cap if decision else None,
            "kv_cap": decision.kv_cap if decision else None,
            "reorder_mode": self.admission.last_mode,
            "tool_backlog_ratio": self.tools.backlog_ratio,
            "tool_wait_ema_s": self.tools.wait_ema_s,
            "kv_usage": self.kv_usage(),
            "sessions": {
                s.session_id: {"replica": s.replica, "turns": s.num_turns,
                               "side_requests": s.num_side_requests,
                               "in_flight": s.num_in_flight,
                               "admitted": self.admission.is_admitted(s.session_id)}
                for s in self.sessions
            },
            "replicas": [
                {"name": r.name, "url": r.url, "healthy": r.is_healthy, "sessions": r.num_sessions,
                 "in_flight": r.num_in_flight, "kv_usage": r.kv_usage_polled,
                 "restarts": r.num_restarts, "last_error": r.last_error}
                for r in self.router.replicas
            ],
        }

    def metrics_text(self) -> str:
        """The gateway's ``/metrics`` in Prometheus text format."""
        st = self.admission.state
        now = time.monotonic()
        replicas = self.router.replicas
        hub = self.hub
        g = "gauge"
        c = "counter"
        rows: list[tuple[str, str, str, list[tuple[dict[str, str], float]]]] = [
            ("mars_admission_window", g, "AIMD admission window W, sessions", [({}, st.window)]),
            ("mars_admission_enabled", g, "1 if admission is on", [({}, float(self.admission.enabled))]),
            ("mars_sessions_admitted", g, "Sessions holding a slot", [({}, len(self.admission.admitted))]),
            ("mars_sessions_waiting", g, "Sessions waiting for a slot", [({}, self.admission.num_waiting)]),
            ("mars_sessions_live", g, "Sessions known to the gateway", [({}, len(self.sessions))]),
            ("mars_cpu_overloaded", g, "CPU overload flag", [({}, float(st.is_cpu_overloaded))]),
            ("mars_kv_overloaded", g, "KV overload flag", [({}, float(st.is_kv_overloaded))]),
            ("mars_tool_backlog_ratio", g, "In-flight tool calls / tool workers",
             [({}, self.tools.backlog_ratio)]),
            ("mars_tool_wait_ema_seconds", g, "EMA of tool queue wait, s",
             [({}, self.tools.wait_ema_s or 0.0)]),
            ("mars_tool_calls_in_flight", g, "Tool calls enqueued or running",
             [({}, self.tools.num_in_flight)]),
            ("mars_kv_usage", g, "KV usage used by admission (max over healthy replicas)",
             [({}, self.kv_usage() or 0.0)]),
            ("mars_replica_kv_usage", g, "KV usage per replica (0..1)",
             [({"replica": r.name}, r.kv_usage(now, self.config.engine_step_max_age_s) or 0.0)
              for r in replicas]),
            ("mars_replica_healthy", g, "1 if the replica is up",
             [({"replica": r.name}, float(r.is_healthy)) for r in replicas]),
            ("mars_replica_sessions", g, "Sessions routed to the replica",
             [({"replica": r.name}, r.num_sessions) for r in replicas]),
            ("mars_replica_requests_in_flight", g, "Requests proxied to the replica now",
             [({"replica": r.name}, r.num_in_flight) for r in replicas]),
            ("mars_replica_restarts_total", c, "Restarts seen",
             [({"replica": r.name}, r.num_restarts) for r in replicas]),
            ("mars_requests_total", c, "Completions requests received", [({}, self.num_requests)]),
            ("mars_client_disconnects_total", c, "Requests whose client went away",
             [({}, self.num_client_disconnects)]),
            ("mars_upstream_errors_total", c, "Requests failed by a replica",
             [({}, self.num_upstream_errors)]),
            ("mars_idle_releases_total", c, "Slots released by the idle timeout",
             [({}, self.num_idle_releases)]),
            ("mars_sessions_admitted_total", c, "Admissions", [({}, self.admission.num_admitted_total)]),
            ("mars_events_cpu_total", c, "CPU-plane events received",
             [({}, hub.num_cpu_events if hub else 0)]),
            ("mars_events_gpu_total", c, "GPU-plane events received",
             [({}, hub.num_gpu_events if hub else 0)]),
            ("mars_events_forwarded_total", c, "CPU-plane events forwarded to replicas",
             [({}, hub.num_forwarded if hub else 0)]),
            ("mars_events_forward_dropped_total", c, "Forwarded events dropped by the channel",
             [({}, hub.num_forward_dropped() if hub else 0)]),
        ]
        return render_prometheus(rows)


class _ProxyFastPath:
    """ASGI wrapper sending ``POST /v1/chat/completions`` and ``/v1/completions`` straight to
    :class:`~mars_openhands.control.proxy.ProxyHandler` (raw ASGI), skipping FastAPI's middleware
    stack, routing, request/response objects and dependency solving on the hot path; every other
    path and the lifespan go through FastAPI.
    """

    def __init__(self, gateway: Gateway, app: FastAPI) -> None:
        self.handler = ProxyHandler(gateway)
        self.app = app

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] == "http" and scope["path"] in PROXY_PATHS and scope["method"] == "POST":
            await self.handler(scope, receive, send)
            return
        await self.app(scope, receive, send)


def build_app(gateway: Gateway) -> FastAPI:
    """The FastAPI app of ``gateway`` (routes only; lifespan starts and stops the gateway)."""

    @contextlib.asynccontextmanager
    async def lifespan(_app: FastAPI) -> AsyncIterator[None]:
        await gateway.start()
        try:
            yield
        finally:
            await gateway.stop()

    app = FastAPI(title="MARS gateway", lifespan=lifespan, docs_url=None, redoc_url=None,
                  openapi_url=None)

    @app.get("/v1/models")
    async def models() -> Response:
        return await gateway.models()

    @app.post("/mars/v1/events")
    async def events(request: Request) -> Response:
        try:
            declared = request.headers.get("content-length")
            limit = gateway.config.max_body_bytes
            if declared is not None and declared.isdigit() and int(declared) > limit:
                raise BadRequestError(
                    f"events body is {declared} bytes, more than max_body_bytes={limit}", 413
                )
            raw = await request.body()
            if len(raw) > limit:
                raise BadRequestError(
                    f"events body is {len(raw)} bytes, more than max_body_bytes={limit}", 413
                )
            accepted = gateway.ingest_events(raw)
        except BadRequestError as e:
            return _error(e.status_code, str(e))
        return JSONResponse({"accepted": accepted})

    @app.get("/metrics")
    @app.get("/mars/v1/metrics")  # the in-process gateway's path (vLLM keeps /metrics)
    async def metrics() -> Response:
        return Response(gateway.metrics_text(), media_type="text/plain; version=0.0.4")

    @app.get("/healthz")
    @app.get("/mars/v1/healthz")
    async def healthz() -> Response:
        healthy = [r.name for r in gateway.router.healthy()]
        status = 200 if healthy else 503
        return JSONResponse({"status": "ok" if healthy else "no healthy replica",
                             "healthy_replicas": healthy}, status)

    @app.get("/mars/v1/state")
    async def state() -> Response:
        return JSONResponse(gateway.state())

    return app
