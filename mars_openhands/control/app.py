"""The MARS gateway: an OpenAI-compatible proxy running the external control plane (design.md §2, §3, §6).

Life of a request (``POST /v1/chat/completions`` or ``/v1/completions``)::

    agent ──▶ size/JSON checks (413/400) ──▶ session id (metadata.py) ──▶ admission slot
          (admission.py; waits here while the window is full) ──▶ replica (routing.py: affinity,
          else least loaded) ──▶ body += session_id, vllm_xargs{mars_turn, ...} ──▶ vLLM
          ◀── response (streamed chunk by chunk, or whole) ◀──

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
from collections.abc import AsyncIterator
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from mars_openhands.control import metadata
from mars_openhands.control.admission import AdmissionController, AdmissionTimeoutError
from mars_openhands.control.config import GatewayConfig
from mars_openhands.control.hub import EventHub, parse_cpu_batch, validate_cpu_batch
from mars_openhands.control.metadata import BadRequestError
from mars_openhands.control.metrics import parse_vllm_metrics, render_prometheus
from mars_openhands.control.routing import NoReplicaError, ReplicaState, Router
from mars_openhands.control.sessions import Session, SessionRegistry, ToolTracker
from mars_openhands.control.upstream import (
    UpstreamBrokenError,
    UpstreamClient,
    UpstreamError,
    UpstreamResponse,
    UpstreamTimeoutError,
    UpstreamUnreachableError,
)
from mars_openhands.policy.admission import PressureSnapshot
from mars_openhands.stream.events import AdmissionUpdate, Event, now_stamps
from mars_openhands.stream.transport import EventSink

__all__ = ["Gateway", "build_app"]

logger = logging.getLogger(__name__)

_FORWARD_HEADERS = ("authorization", "content-type", "accept", "x-request-id")


def _error(status: int, message: str, kind: str = "invalid_request_error") -> JSONResponse:
    """An OpenAI-style error body."""
    return JSONResponse({"error": {"message": message, "type": kind, "code": status}}, status)


class _ClientGoneError(Exception):
    """The agent closed its connection."""


class _UpstreamFailedError(Exception):
    """The replica failed (or was marked down) while serving the request."""

    def __init__(self, message: str, status: int = 502, can_retry: bool = False) -> None:
        super().__init__(message)
        self.status = status
        self.can_retry = can_retry


class _InFlight:
    """One proxied request, so the replica poller can fail it when its replica goes down."""

    __slots__ = ("task", "fail_reason")

    def __init__(self) -> None:
        self.task: asyncio.Task[Any] | None = None
        self.fail_reason: str | None = None

    def fail(self, reason: str) -> None:
        self.fail_reason = reason
        if self.task is not None:
            self.task.cancel()


class Gateway:
    """The gateway service: owns the registry, admission, routing, the hub and the HTTP app.

    Usage::

        gateway = Gateway(GatewayConfig(replicas=[ReplicaConfig(url="http://127.0.0.1:8001")]))
        uvicorn.run(gateway.app, host=..., port=...)   # or GatewayServer (server.py)

    Args:
        config: every parameter.
        sink: where the run's stream goes; default a ``StreamRecorder`` at ``config.stream_path``
            (owned and closed by the gateway), or nothing when that is ``None``.
    """

    def __init__(self, config: GatewayConfig, sink: EventSink | None = None) -> None:
        self.config = config
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
        self.fastapi_app = build_app(self)
        self.app = _ProxyFastPath(self, self.fastapi_app)
        """The ASGI app to serve: the two proxy routes on a fast path, the rest through FastAPI."""

    # ------------------------------------------------------------------ lifecycle
    async def start(self) -> None:
        """Open the upstream client, the event channels and the background tasks."""
        self.client = UpstreamClient(self.config.upstream_connect_timeout_s,
                                     self.config.upstream_read_timeout_s)
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
        if self.hub is not None:
            self.hub.record(AdmissionUpdate(
                **now_stamps(), source="gateway", window=decision.state.window,
                num_admitted=len(self.admission.admitted), num_waiting=self.admission.num_waiting,
                cpu_overloaded=decision.state.is_cpu_overloaded,
                kv_overloaded=decision.state.is_kv_overloaded,
                tool_backlog_ratio=snap.tool_backlog_ratio,
                tool_wait_ema_s=snap.tool_wait_ema_s or 0.0, kv_usage=snap.kv_usage or 0.0,
            ))

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
    async def _race(self, request: Request, task: asyncio.Task[Any]) -> Any:
        """Await ``task`` unless the client disconnects first (then cancel it, raise)."""
        watcher = asyncio.ensure_future(request.receive())
        try:
            await asyncio.wait((task, watcher), return_when=asyncio.FIRST_COMPLETED)
        finally:
            if not watcher.done():
                watcher.cancel()
        if task.done():
            return task.result()
        task.cancel()
        with contextlib.suppress(BaseException):
            await task
        raise _ClientGoneError()

    async def _admit(self, request: Request, session: Session, body: dict[str, Any], size: int) -> None:
        """Wait for the session's admission slot (fast path: no await)."""
        now = time.monotonic()
        if self.admission.is_admitted(session.session_id) or self.admission.can_admit_now():
            await self.admission.acquire(session.session_id, now, 0, None, 0.0)
            return
        tokens = metadata.estimate_prompt_tokens(body, size, self.config.bytes_per_token)
        block_size = next(
            (r.block_size_tokens for r in self.router.replicas if r.block_size_tokens),
            self.config.block_size_tokens,
        )
        task = asyncio.create_task(self.admission.acquire(
            session.session_id, now, tokens, math.ceil(tokens / block_size),
            self.config.admission_wait_timeout_s,
        ))
        await self._race(request, task)

    async def _fetch(self, url: str, content: bytes, headers: dict[str, str],
                     stream: bool) -> tuple[UpstreamResponse, bytes | None]:
        """POST; for a non-streaming request also read the whole body (then close)."""
        assert self.client is not None, "Gateway.start() must run first"
        resp = await self.client.post(url, content, headers)
        if stream and resp.status_code == 200:
            return resp, None
        try:
            return resp, await resp.read()
        finally:
            resp.close()

    async def _send(
        self, request: Request, replica: ReplicaState, path: str, content: bytes,
        headers: dict[str, str], stream: bool,
    ) -> tuple[UpstreamResponse, bytes | None]:
        """Send to one replica, cancellable by client disconnect and by the replica going down."""
        handle = _InFlight()
        handle.task = asyncio.create_task(
            self._fetch(f"{replica.url}{path}", content, headers, stream))
        replica.in_flight.add(handle)
        try:
            return await self._race(request, handle.task)
        except asyncio.CancelledError:
            if handle.fail_reason is None:
                raise
            raise _UpstreamFailedError(handle.fail_reason, 503, can_retry=True) from None
        except UpstreamBrokenError as e:
            if not await self._is_alive(replica):  # died under us: nothing to lose by re-running
                raise _UpstreamFailedError(
                    f"replica {replica.name} ({replica.url}) died mid-request: {e}", 503,
                    can_retry=True,
                ) from None
            raise _UpstreamFailedError(
                f"replica {replica.name} ({replica.url}) broke the connection mid-request: {e}"
            ) from None
        except UpstreamUnreachableError as e:
            raise _UpstreamFailedError(
                f"replica {replica.name} ({replica.url}) unreachable: {e}", 503, can_retry=True
            ) from None
        except UpstreamTimeoutError as e:
            raise _UpstreamFailedError(
                f"replica {replica.name} ({replica.url}) sent nothing for "
                f"{self.config.upstream_read_timeout_s} s ({e}); raise --upstream-read-timeout-s "
                "if it is just slow", 504,
            ) from None
        finally:
            replica.in_flight.discard(handle)

    async def _is_alive(self, replica: ReplicaState) -> bool:
        """Probe ``/health`` once (connect timeout): tells a dead replica from a broken connection."""
        assert self.client is not None, "Gateway.start() must run first"
        try:
            status, _, _ = await self.client.get(f"{replica.url}/health",
                                                 self.config.upstream_connect_timeout_s)
        except UpstreamError:
            return False
        return status == 200

    async def _send_with_failover(
        self, request: Request, session: Session, path: str, content_for: Any,
        headers: dict[str, str], stream: bool,
    ) -> tuple[ReplicaState, tuple[UpstreamResponse, bytes | None]]:
        """Route and send; when the replica is dead or unreachable, mark it down and try the next.

        Nothing has reached the agent yet at this point (streams start after it), so re-running the
        request elsewhere is invisible to it apart from the latency. Bounded: each retry marks a
        replica down, and :meth:`Router.route` raises once none is left.
        """
        while True:
            replica = self.router.route(session)  # raises NoReplicaError when none is left
            try:
                resp = await self._send(request, replica, path, content_for(), headers, stream)
            except _UpstreamFailedError as e:
                if not e.can_retry:
                    raise
                if self.router.record_failure(replica.index, str(e), immediate=True):
                    self.on_replica_down(replica, str(e))
                self.router.detach(session)
                continue
            self.router.record_success(replica.index)
            return replica, resp

    def _finish(self, session: Session, replica: ReplicaState | None) -> None:
        """Bookkeeping when a request ends, exactly once: in-flight counts, one-turn release."""
        session.num_in_flight -= 1
        session.last_activity_s = time.monotonic()
        if replica is not None:
            replica.num_in_flight -= 1
        if session.is_one_turn and not session.has_ended:
            self.end_session(session)

    async def proxy(self, request: Request, path: str) -> Response:
        """Handle one completions request end to end (see the module docstring)."""
        self.num_requests += 1
        try:
            raw, body = await self._read_json(request)
            session, last_step = self._session_for(request, body)
        except BadRequestError as e:
            return _error(e.status_code, str(e))
        session.num_in_flight += 1
        replica: ReplicaState | None = None
        streaming = False
        try:
            await self._admit(request, session, body, len(raw))
            turn, prev_tool = session.num_turns, session.prev_tool
            session.num_turns += 1
            session.prev_tool = None
            engine_body = metadata.build_engine_body(
                body, None if session.is_one_turn else session.session_id, turn, last_step, prev_tool
            )
            content = json.dumps(engine_body).encode()
            headers = {k: v for k in _FORWARD_HEADERS if (v := request.headers.get(k)) is not None}
            stream = bool(body.get("stream"))
            replica, (resp, whole) = await self._send_with_failover(
                request, session, path, lambda: content, headers, stream
            )
            replica.num_in_flight += 1
            extra = {"x-mars-replica": replica.name, "x-mars-session": session.session_id,
                     "x-mars-turn": str(turn)}
            if whole is not None:
                return Response(whole, resp.status_code, headers=extra,
                                media_type=resp.content_type)
            streaming = True
            return self._relay_response(resp, session, replica, extra)
        except BadRequestError as e:
            return _error(e.status_code, str(e))
        except _ClientGoneError:
            self.num_client_disconnects += 1
            return Response(status_code=499)
        except AdmissionTimeoutError as e:
            return _error(503, str(e), "admission_timeout")
        except NoReplicaError as e:
            self.num_upstream_errors += 1
            return _error(503, str(e), "no_replica")
        except _UpstreamFailedError as e:
            self.num_upstream_errors += 1
            return _error(e.status, str(e), "upstream_error")
        finally:
            if not streaming:
                self._finish(session, replica)

    def _relay_response(
        self, resp: UpstreamResponse, session: Session, replica: ReplicaState,
        headers: dict[str, str],
    ) -> Response:
        """A streaming response relaying ``resp``; cleanup runs exactly once however it ends."""
        relay = _Relay(self, resp, session, replica)
        return _RelayResponse(relay, resp.status_code, headers=headers,
                              media_type=resp.content_type or "text/event-stream")

    async def _read_json(self, request: Request) -> tuple[bytes, dict[str, Any]]:
        """Read and parse the body. Raises BadRequestError (400 / 413)."""
        limit = self.config.max_body_bytes
        declared = request.headers.get("content-length")
        if declared is not None and declared.isdigit() and int(declared) > limit:
            raise BadRequestError(
                f"request body is {declared} bytes, more than max_body_bytes={limit}; raise "
                "--max-body-bytes", 413,
            )
        raw = await request.body()
        if len(raw) > limit:
            raise BadRequestError(
                f"request body is {len(raw)} bytes, more than max_body_bytes={limit}", 413
            )
        try:
            body = json.loads(raw)
        except ValueError as e:
            raise BadRequestError(f"request body is not valid JSON: {e}") from None
        if not isinstance(body, dict):
            raise BadRequestError(f"request body must be a JSON object, got {type(body).__name__}")
        return raw, body

    def _session_for(self, request: Request, body: dict[str, Any]) -> tuple[Session, int | None]:
        """Find or create the request's session. Raises BadRequestError naming the field."""
        session_id, _ = metadata.extract_session_id(request.headers, body)
        last_step = metadata.extract_last_step(request.headers, body)
        now = time.monotonic()
        if session_id is None:
            session_id = f"one-turn-{self.num_requests}-{now:.6f}"
            return self.sessions.get_or_create(session_id, now, is_one_turn=True), last_step
        return self.sessions.get_or_create(session_id, now), last_step

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


class _Relay:
    """Relays one upstream SSE stream to the agent.

    Mental model: a *pump* task reads upstream chunks into a queue and a *watcher* task waits for
    the agent's disconnect; the response iterates the queue. The replica poller fails the stream
    by cancelling the pump (our own task, never Starlette's), which turns into an SSE ``error``
    chunk naming the replica; a disconnect stops the pump, which closes the upstream connection so
    vLLM aborts the request. :meth:`close` is idempotent and always runs (from
    ``_RelayResponse.__call__``), even when Starlette never starts the iterator.
    """

    def __init__(self, gateway: Gateway, resp: UpstreamResponse, session: Session,
                 replica: ReplicaState) -> None:
        self.gateway = gateway
        self.resp = resp
        self.session = session
        self.replica = replica
        self.handle = _InFlight()
        self.queue: asyncio.Queue[bytes | BaseException | None] = asyncio.Queue()
        self.watcher: asyncio.Task[None] | None = None
        self.closed = False
        replica.in_flight.add(self.handle)

    async def _pump(self) -> None:
        try:
            async for chunk in self.resp.iter_chunks():
                self.queue.put_nowait(chunk)
            self.queue.put_nowait(None)
        except asyncio.CancelledError:
            self.queue.put_nowait(_UpstreamFailedError(self.handle.fail_reason or "cancelled"))
            raise
        except Exception as e:
            self.queue.put_nowait(e)

    async def _watch(self, receive: Any) -> None:
        while (await receive())["type"] != "http.disconnect":
            pass
        self.gateway.num_client_disconnects += 1
        self.queue.put_nowait(_ClientGoneError())
        if self.handle.task is not None:
            self.handle.task.cancel()

    async def iterate(self, receive: Any) -> AsyncIterator[bytes]:
        """Yield upstream chunks until the end, a replica failure (SSE error) or a disconnect."""
        self.handle.task = asyncio.create_task(self._pump())
        self.watcher = asyncio.create_task(self._watch(receive))
        while (item := await self.queue.get()) is not None:
            if isinstance(item, _ClientGoneError):
                return
            if isinstance(item, BaseException):
                self.gateway.num_upstream_errors += 1
                message = str(item) if isinstance(item, _UpstreamFailedError) else (
                    f"replica {self.replica.name} ({self.replica.url}) failed mid-stream: {item!r}")
                payload = {"error": {"message": message, "type": "upstream_error", "code": 502}}
                yield f"data: {json.dumps(payload)}\n\n".encode()
                return
            yield item

    async def close(self) -> None:
        """Stop the pump and watcher, close upstream, do the request's bookkeeping. Idempotent."""
        if self.closed:
            return
        self.closed = True
        self.replica.in_flight.discard(self.handle)
        for task in (self.handle.task, self.watcher):
            if task is not None and not task.done():
                task.cancel()
                with contextlib.suppress(BaseException):
                    await task
        self.resp.close()
        self.gateway._finish(self.session, self.replica)


class _RelayResponse(StreamingResponse):
    """``StreamingResponse`` over a :class:`_Relay` that always closes it."""

    def __init__(self, relay: _Relay, status_code: int, headers: dict[str, str],
                 media_type: str) -> None:
        self.relay = relay
        super().__init__(self._empty(), status_code, headers=headers, media_type=media_type)

    @staticmethod
    async def _empty() -> AsyncIterator[bytes]:
        return
        yield b""

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        # Not StreamingResponse.__call__: the relay's watcher already listens for the disconnect,
        # so the extra task group Starlette creates per response is pure overhead here.
        try:
            await send({"type": "http.response.start", "status": self.status_code,
                        "headers": self.raw_headers})
            async for chunk in self.relay.iterate(receive):
                await send({"type": "http.response.body", "body": chunk, "more_body": True})
            await send({"type": "http.response.body", "body": b"", "more_body": False})
        except OSError:  # the client went away (ASGI 2.4 servers raise on send)
            pass
        finally:
            await asyncio.shield(self.relay.close())


class _ProxyFastPath:
    """ASGI wrapper sending ``POST /v1/chat/completions`` and ``/v1/completions`` straight to
    :meth:`Gateway.proxy`, skipping FastAPI's middleware stack, routing and dependency solving on
    the hot path (every other path and the lifespan go through FastAPI). ``proxy`` turns every
    expected failure into a response; anything else propagates to the server, as in FastAPI.
    """

    _PATHS = frozenset(("/v1/chat/completions", "/v1/completions"))

    def __init__(self, gateway: Gateway, app: FastAPI) -> None:
        self.gateway = gateway
        self.app = app

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] == "http" and scope["method"] == "POST" and scope["path"] in self._PATHS:
            response = await self.gateway.proxy(Request(scope, receive), scope["path"])
            await response(scope, receive, send)
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

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        return await gateway.proxy(request, "/v1/chat/completions")

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        return await gateway.proxy(request, "/v1/completions")

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
    async def metrics() -> Response:
        return Response(gateway.metrics_text(), media_type="text/plain; version=0.0.4")

    @app.get("/healthz")
    async def healthz() -> Response:
        healthy = [r.name for r in gateway.router.healthy()]
        status = 200 if healthy else 503
        return JSONResponse({"status": "ok" if healthy else "no healthy replica",
                             "healthy_replicas": healthy}, status)

    @app.get("/mars/v1/state")
    async def state() -> Response:
        return JSONResponse(gateway.state())

    return app
