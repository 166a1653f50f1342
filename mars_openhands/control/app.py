"""The MARS gateway: an OpenAI-compatible proxy running the external control plane (design.md §2, §3, §6).

Life of a request (``POST /v1/chat/completions`` or ``/v1/completions``; the hot path is
:mod:`mars_openhands.control.proxy`, raw ASGI)::

    agent ──▶ size/JSON checks (413/400) ──▶ session id, vllm_xargs check (metadata.py; 400)
          ──▶ admission slot (the control plane, plane.py; the request waits on a future while the
          window is full) ──▶ replica (routing.py: affinity, else least loaded) ──▶ body +=
          session_id, vllm_xargs{mars_turn, ...} ──▶ vLLM ◀── response (streamed or whole) ◀──

Every decision is :class:`~mars_openhands.control.plane.ControlPlane`'s, the same object the
simulator drives; this module adds what waits or talks. Background tasks: the control-plane tick
(every ``update_interval_s``: idle sessions release their slots, the window moves, waiting sessions
are admitted, an ``admission_update`` is recorded), and one poller per replica (``/metrics``: KV
usage, health, restarts).

Failure behaviour (never a hang, never a leaked slot):

* client disconnect: the upstream request is cancelled (the upstream connection is closed, vLLM aborts the
  request), the session's in-flight count drops and an ``aborted`` event is recorded; the session's
  slot goes back at once unless more of it is in flight (``ControlPlane.client_gone``).
* a dead agent (no ``tool_end`` within a tool call's bound): the tick closes the call with a
  recorded ``tool_end`` of status ``"interrupted"``, and the session then idles out. A
  ``session_end`` closes its session's calls still open the same way first (a resumed agent's
  lost ``tool_end``), so every ``tool_start`` recorded gets a ``tool_end``.
* replica cannot be reached, dies mid-request (the connection breaks and ``/health`` does not
  answer) or is marked down by the poller while requests run: it is marked down, its sessions are
  re-routed (keeping their slots and turn counts), and every request that has not yet sent bytes to
  its agent is re-run on the next replica; when none is left, HTTP 503 naming every replica's
  error. A stream already under way ends with an SSE ``error`` chunk naming the replica. A broken
  connection to a replica that is still alive is HTTP 502 (the request may have run).
* bad input: HTTP 400 (malformed JSON, bad session id, bad ``vllm_xargs``, bad event), 404 (event for
  an unknown session), 413 (body larger than ``max_body_bytes``), never 5xx.
* credentials (:mod:`~mars_openhands.control.auth`): 401 without the API key (``/v1/*``, events) or
  the admin key (``/mars/v1/state``), 400/403 for a session's token missing or not its own; a
  refused call changes nothing.
* a session idle past ``session_idle_timeout_s`` releases its slot, and a ``session_end`` of status
  ``"idle_timeout"`` is recorded and forwarded to its replica (the engine releases its KV).
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import json
import logging
import time
from collections.abc import AsyncIterator, Callable, Mapping
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response

from mars_openhands.cli_style import redact_url
from mars_openhands.control import metadata
from mars_openhands.control.admission import AdmissionPolicy, AdmissionTimeoutError
from mars_openhands.control.auth import (
    SESSION_TOKEN_HEADER,
    UNAUTHORIZED_BODY,
    AuthError,
    Credentials,
    SessionTokens,
)
from mars_openhands.control.config import GatewayConfig
from mars_openhands.control.hub import GATEWAY_SOURCE, EventHub, parse_cpu_batch, validate_cpu_batch
from mars_openhands.control.metadata import BadRequestError
from mars_openhands.control.metrics import parse_vllm_metrics, render_prometheus
from mars_openhands.control.plane import AdmissionReport, ControlPlane, Tick
from mars_openhands.control.proxy import PROXY_PATHS, ProxyHandler
from mars_openhands.control.routing import ReplicaState
from mars_openhands.control.sessions import Session
from mars_openhands.control.upstream import UpstreamBrokenError, UpstreamClient, UpstreamError
from mars_openhands.stream.events import (
    AdmissionUpdate,
    Event,
    ReplicaReplaced,
    RequestAborted,
    SessionEnd,
    ToolEnd,
    now_stamps,
)
from mars_openhands.stream.transport import EventSink

RECENT_ADMISSION_WAITS = 10_000
"""Sessions whose admission wait :attr:`Gateway.admission_wait_s` keeps (oldest dropped first)."""

__all__ = ["Gateway", "build_app", "settings_line"]

logger = logging.getLogger(__name__)

def _error(status: int, message: str, kind: str = "invalid_request_error") -> JSONResponse:
    """An OpenAI-style error body."""
    return JSONResponse({"error": {"message": message, "type": kind, "code": status}}, status)


def _unauthorized() -> Response:
    """vLLM's answer to a missing or wrong key."""
    return Response(UNAUTHORIZED_BODY, 401, media_type="application/json")


def _secret(value: Any) -> str | None:
    return value.get_secret_value() if value is not None else None


def settings_line(config: GatewayConfig, is_in_process: bool = False) -> str:
    """``replicas: ...; admission: ...; stream: ...; auth: ...``: the settings of a gateway start-up
    line (in-process, vLLM's ``--api-key`` is the API key). Pure."""
    replicas = ", ".join(f"{config.replica_name(i)}={redact_url(r.url)}" for i, r in enumerate(config.replicas))
    p = config.admission
    per = " per replica" if len(config.replicas) > 1 else ""
    admission = (f"on (window {p.window_min}..{p.window_max}{per}, starts at {p.window_init})"
                 if config.is_admission_enabled else "off (window computed, not enforced)")
    stream = config.stream_path or "not recorded (--stream-path)"
    keys = ", ".join(f"{name} key {'on' if key is not None else 'off'}"
                     for name, key in (("API", config.api_key), ("admin", config.admin_key)))
    if is_in_process:
        keys = keys.replace("API key off", "API key: vLLM's --api-key")
    return f"replicas: {replicas}; admission: {admission}; stream: {stream}; auth: {keys}"


class Gateway:
    """The gateway service: the control plane behind HTTP, with the event hub and background tasks.

    Every decision is the :class:`~mars_openhands.control.plane.ControlPlane`'s (``self.plane``);
    the gateway adds what waits or talks: asyncio futures for requests waiting for admission
    (resolved when a plane call returns their session as admitted), the tick and poll loops, the
    replica client, the stream hub and the HTTP app.

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
        clock: the control plane's clock. Default ``time.monotonic``, with the gateway's own tick and
            poll loops; a given clock (virtual time: tests, a simulation driving a real gateway)
            means the caller advances it and calls :meth:`tick` and :meth:`poll_replica` itself.
        policy: the admission policy (default: the AIMD window of ``config``).
    """

    def __init__(self, config: GatewayConfig, sink: EventSink | None = None,
                 client_factory: Callable[[GatewayConfig], Any] | None = None,
                 clock: Callable[[], float] | None = None,
                 policy: AdmissionPolicy | None = None) -> None:
        self.config = config
        self._client_factory = client_factory
        self._owns_sink = sink is None and config.stream_path is not None
        if self._owns_sink:
            from mars_openhands.stream.recorder import StreamRecorder

            sink = StreamRecorder(config.stream_path, write_parquet=config.stream_write_parquet)
        self.sink = sink
        self._has_own_loops = clock is None
        self.plane = ControlPlane(config, clock if clock is not None else time.monotonic, policy)
        self.sessions = self.plane.sessions
        self.router = self.plane.router
        self._engine_sources = frozenset(config.replica_source(i)
                                         for i in range(len(config.replicas)))
        """The replicas' GPU-plane sources: an agent's event may not claim one."""
        self._waiters: dict[str, asyncio.Future[None]] = {}
        self.credentials = Credentials(_secret(config.api_key), _secret(config.admin_key))
        self.tokens = SessionTokens(config.session_token_keep_s)
        """Session id → its token's digest (trust on first use; control/auth.py)."""
        self.num_unauthorized = 0
        self.num_forbidden = 0
        self.hub: EventHub | None = None
        self.client: UpstreamClient | None = None
        self._tasks: list[asyncio.Task[None]] = []
        self._collector: Any = None
        self.engine_events_address: str | None = None
        self.num_requests = 0
        self.num_client_disconnects = 0
        self.num_upstream_errors = 0
        self.num_admission_timeouts = 0
        self.admission_wait_s: collections.OrderedDict[str, float] = collections.OrderedDict()
        """Seconds each recent session's requests waited for an admission slot (summed; only
        sessions that waited; the newest :data:`RECENT_ADMISSION_WAITS` sessions), for benchmarks
        reading an in-process gateway (``eval.ohbench``)."""
        self.admission_wait_total_s = 0.0
        self.num_admission_waits = 0
        self._last_update: AdmissionReport | None = None
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
        """Open the upstream client, the event channels and (on the real clock) the tick and poll
        loops."""
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
        if not self._has_own_loops:
            return
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

    # ------------------------------------------------------------------ admission
    def tick(self) -> Tick:
        """One control-plane tick (:meth:`ControlPlane.tick`); wakes the admitted requests and
        records an ``admission_update`` when something changed or a heartbeat is due."""
        tick = self.plane.tick()
        self._wake(tick.admitted)
        now = self.plane.clock()
        for session_id in tick.idle_released:
            self.tokens.release(session_id, now)
        self.tokens.expire(now)
        if self.hub is None:
            return tick
        for closed in tick.interrupted:
            self._record_interrupted(closed)
        for session_id in tick.idle_released:
            self._record_idle_end(session_id, tick.idle_replicas.get(session_id))
        last = self._last_update
        if (last is not None and not tick.report.differs_from(last)
                and now - self._last_update_mono_s < self.config.admission_update_heartbeat_s):
            return tick
        self._last_update, self._last_update_mono_s = tick.report, now
        self.hub.record(AdmissionUpdate(**now_stamps(), source=GATEWAY_SOURCE, **tick.report._asdict()))
        return tick

    def _record_interrupted(self, closed: Any) -> None:
        """Record (and forward to the session's replica, if still bound) the ``tool_end`` of a
        tool call the tick or its session's ``session_end`` closed as interrupted."""
        assert self.hub is not None, "Gateway.start() must run first"
        event = ToolEnd(**now_stamps(), source=GATEWAY_SOURCE, session_id=closed.session_id,
                        turn=closed.turn, tool_name=closed.tool_name,
                        tool_call_id=closed.tool_call_id, duration_s=closed.waited_s,
                        status="interrupted")
        self.hub.record(event)
        session = self.sessions.get(closed.session_id)
        if session is not None:
            self.hub.forward(session.replica, event)

    def _record_idle_end(self, session_id: str, replica: int | None) -> None:
        """Record a ``session_end`` (status ``"idle_timeout"``) for a session the tick released
        for silence, and forward it to the replica it was bound to: the engine then releases the
        session's retained KV and state at once (a dead agent sends no ``session_end``; without
        this the KV of its last turn stays pinned until the engine's own expiry)."""
        assert self.hub is not None, "Gateway.start() must run first"
        timeout_s = self.config.session_idle_timeout_s
        event = SessionEnd(**now_stamps(), source=GATEWAY_SOURCE, session_id=session_id,
                           status="idle_timeout",
                           error=f"no request or event for {timeout_s:g} s (session_idle_timeout_s)")
        self.hub.record(event)
        self.hub.forward(replica, event)

    def record_aborted(self, session: Session | None, request_id: str, reason: str, stage: str,
                       elapsed_s: float, is_slot_released: bool = False,
                       turn: int | None = None) -> None:
        """Record an ``aborted`` event: the gateway gave up a request (client gone, admission
        timeout, replica down) before its response ended. ``session`` ``None``: not known yet
        (the client hung up while sending the body); ``turn``: the agent turn it ran as (``None``:
        none yet, or a side request)."""
        if self.hub is None:
            return
        is_named = session is not None and not session.is_one_turn
        self.hub.record(RequestAborted(
            **now_stamps(), source=GATEWAY_SOURCE,
            session_id=session.session_id if is_named else None,
            turn=turn if is_named else None,
            request_id=request_id,
            reason=reason, stage=stage, is_slot_released=is_slot_released,
            elapsed_s=max(0.0, elapsed_s),
        ))

    async def _tick_loop(self) -> None:
        while True:
            try:
                self.tick()
            except Exception:  # a bug in one tick must not stop admission forever
                logger.exception("admission tick failed")
            await asyncio.sleep(self.config.admission.update_interval_s)

    def _wake(self, admitted: list[str]) -> None:
        """Resolve the futures of requests whose sessions the plane just admitted."""
        for session_id in admitted:
            waiter = self._waiters.pop(session_id, None)
            if waiter is not None and not waiter.done():
                waiter.set_result(None)

    def _drop_waiter(self, session_id: str) -> None:
        """The session's wait ended without a slot (it gave up or ended): cancel its future."""
        waiter = self._waiters.pop(session_id, None)
        if waiter is not None:
            waiter.cancel()

    def _record_admission_wait(self, session_id: str, wait_s: float) -> None:
        """Count one admission wait of ``wait_s`` seconds. Mutates the wait totals."""
        self.admission_wait_total_s += wait_s
        self.num_admission_waits += 1
        waits = self.admission_wait_s
        waits[session_id] = waits.pop(session_id, 0.0) + wait_s
        while len(waits) > RECENT_ADMISSION_WAITS:
            waits.popitem(last=False)

    async def wait_for_admission(self, session: Session, raw: bytes) -> None:
        """Return once the session holds a slot (the slow path: the window is full or others wait).

        Raises:
            AdmissionTimeoutError: no slot within ``admission_wait_timeout_s``.
            asyncio.CancelledError: the client went away, or the session ended while it waited
                (the session leaves the waiting set).
        """
        try:
            body = json.loads(raw)
        except ValueError:
            body = {}
        tokens = metadata.estimate_prompt_tokens(body, len(raw), self.config.bytes_per_token)
        if self.plane.request_slot(session, tokens):
            return
        session_id = session.session_id
        waiter = self._waiters.get(session_id)
        if waiter is None:
            waiter = self._waiters[session_id] = asyncio.get_running_loop().create_future()
        timeout_s = self.config.admission_wait_timeout_s
        started_s = self.plane.clock()
        try:
            await asyncio.wait_for(asyncio.shield(waiter), timeout_s)
            self._record_admission_wait(session_id, self.plane.clock() - started_s)
        except (TimeoutError, asyncio.CancelledError) as e:
            self.plane.withdraw(session)
            self._drop_waiter(session_id)
            if not isinstance(e, TimeoutError):
                raise
            self.num_admission_timeouts += 1
            admission = self.plane.admission
            raise AdmissionTimeoutError(
                f"session {session_id!r} waited {timeout_s:.1f} s for an admission slot (window "
                f"{admission.window}, {len(admission.admitted)} admitted, {admission.num_waiting} "
                "waiting); retry later or raise --admission-wait-timeout-s"
            ) from None

    # ------------------------------------------------------------------ replicas
    async def poll_replica(self, replica: ReplicaState) -> None:
        """Poll one replica's ``/metrics`` once: KV usage, queue sizes, health, restarts."""
        assert self.client is not None, "Gateway.start() must run first"
        try:
            status, body, _ = await self.client.get(
                f"{replica.url}/metrics", self.config.upstream_connect_timeout_s, _auth(replica)
            )
            if status != 200:
                raise UpstreamBrokenError(f"HTTP {status}")
        except UpstreamError as e:
            self.replica_failed(replica, f"/metrics poll failed: {e}")
            return
        self.router.observe_metrics(replica.index, parse_vllm_metrics(body.decode(errors="replace")))

    async def _poll_loop(self, replica: ReplicaState) -> None:
        while True:
            try:
                await self.poll_replica(replica)
            except Exception:
                logger.exception("polling replica %s failed", replica.name)
            await asyncio.sleep(self.config.poll_interval_s)

    def replica_failed(self, replica: ReplicaState, reason: str, immediate: bool = False) -> bool:
        """A poll or request failed (:meth:`ControlPlane.replica_failed`). If that took the replica
        down, its in-flight requests fail (re-run elsewhere when nothing reached the agent).

        Returns:
            True if the replica just went down.
        """
        if not self.plane.replica_failed(replica.index, reason, immediate):
            return False
        logger.warning("replica %s (%s) marked down: %s", replica.name, redact_url(replica.url), reason)
        message = f"replica {replica.name} ({redact_url(replica.url)}) went down: {reason}"
        for handle in list(replica.in_flight):
            handle.fail(message)
        return True

    def on_engine_event(self, event: Event) -> None:
        """A GPU-plane event from an engine (collector thread → loop): record it, read KV usage."""
        if self.hub is not None:
            self.hub.num_gpu_events += 1
            self.hub.record(event)
        if event.kind == "engine_step":
            self.router.observe_engine_step(event.source, event.num_used_blocks, event.num_gpu_blocks,
                                            event.num_host_blocks)

    def on_replica_replaced(self, index: int, previous_incarnation: str, incarnation: str,
                            url: str) -> None:
        """The cluster layer replaced replica ``index`` with a new server at ``url`` (``serve``'s
        ingress saw a new actor answer): a ``replica_replaced`` event in the stream. The count
        is the replica's ``restarts`` (``/mars/v1/state``), from its ``/metrics`` poll."""
        replica = self.router.replicas[index]
        logger.warning("replica %s replaced by the cluster (%s -> %s): now at %s", replica.name,
                       previous_incarnation, incarnation, url)
        if self.hub is not None:
            self.hub.record(ReplicaReplaced(**now_stamps(), source=GATEWAY_SOURCE, replica=replica.name,
                                            url=url, previous_incarnation=previous_incarnation,
                                            incarnation=incarnation))

    # ------------------------------------------------------------------ sessions and events
    def ingest_events(self, raw: bytes, token: str | None) -> int:
        """Apply a ``POST /mars/v1/events`` body, all of whose events name one session, the one
        whose token ``token`` is. Returns the number of events accepted.

        Raises:
            BadRequestError: the batch is invalid (400, 404 unknown session, 413).
            AuthError: no token (400), or the batch names another session than the token's, or
                several sessions (403). Nothing is applied in any of these cases.
        """
        assert self.hub is not None, "Gateway.start() must run first"
        events = parse_cpu_batch(raw, self.config.max_events_per_post, self._engine_sources)
        if token is None:
            raise AuthError("header X-Mars-Session-Token is required on POST /mars/v1/events; send "
                            "the token of the session the events belong to", 400)
        named = list(dict.fromkeys(e.session_id for e in events))
        if len(named) > 1:
            raise AuthError(f"the events batch names more than one session_id ({named[:4]}); a "
                            "batch carries the events of one session, the one whose "
                            "X-Mars-Session-Token is sent: post each session's events separately")
        if not named:
            return 0
        session_id = named[0]
        assert session_id is not None, "parse_cpu_batch guarantees a session_id"
        digest = self.tokens.check(session_id, token, self.plane.clock(), is_required=True)
        validate_cpu_batch(events, lambda sid: self.sessions.get(sid) is not None)
        if digest is not None:
            self.tokens.bind(session_id, digest)
        for event in events:
            session = self.plane.open_session(event.session_id)
            if event.kind == "session_end":  # a lost tool_end's call must not stay open forever
                for closed in self.plane.interrupt_tools_of(session):
                    self._record_interrupted(closed)
            self.hub.num_cpu_events += 1
            self.hub.record(event)
            self.hub.forward(session.replica, event)  # before session_end unbinds the replica
            self._wake(self.plane.on_cpu_event(session, event))
            if session.has_ended:
                self._drop_waiter(session.session_id)
                self.tokens.forget(session.session_id)
        return len(events)

    def session_for(self, headers: Mapping[str, str],
                    fields: Mapping[str, Any]) -> tuple[Session, int | None]:
        """Find or create the request's session, once its caller may act for it; also its
        ``mars_last_step``.

        Args:
            headers: request headers with lower-case names (``x-mars-session-token`` among them).
            fields: the body's gateway fields (``proxy.probe_body``) or the whole body.

        Raises:
            BadRequestError: a bad session id or ``mars_last_step``, naming the field.
            AuthError: the session is bound to another token, or the call has none (403), or the
                token is malformed (400); nothing is created or counted.
        """
        session_id, _ = metadata.extract_session_id(headers, fields)
        last_step = metadata.extract_last_step(headers, fields)
        if session_id is None:
            return self.plane.open_session(None), last_step
        token = headers.get(SESSION_TOKEN_HEADER)
        digest = self.tokens.check(session_id, token, self.plane.clock(), is_required=False)
        if digest is not None:
            self.tokens.bind(session_id, digest)
        return self.plane.open_session(session_id), last_step

    def _finish(self, session: Session, replica: ReplicaState | None,
                is_client_gone: bool = False) -> bool:
        """Bookkeeping when a request ends, exactly once: in-flight counts, one-turn release, and
        for a client that went away, its session's slot (:meth:`ControlPlane.client_gone`).

        Returns:
            True if the client-gone rule released the session's slot.
        """
        if replica is not None:
            replica.num_in_flight -= 1
        was_admitted = self.plane.admission.is_admitted(session.session_id)
        self._wake(self.plane.end_request(session))
        if is_client_gone:
            self._wake(self.plane.client_gone(session))
        return was_admitted and not self.plane.admission.is_admitted(session.session_id)

    # ------------------------------------------------------------------ proxy
    async def is_alive(self, replica: ReplicaState) -> bool:
        """Probe ``/health`` once (connect timeout): tells a dead replica from a broken connection."""
        assert self.client is not None, "Gateway.start() must run first"
        try:
            status, _, _ = await self.client.get(f"{replica.url}/health",
                                                 self.config.upstream_connect_timeout_s,
                                                 _auth(replica))
        except UpstreamError:
            return False
        return status == 200

    async def models(self) -> Response:
        """``GET /v1/models`` from the first healthy replica."""
        assert self.client is not None, "Gateway.start() must run first"
        for replica in self.router.healthy():
            try:
                status, body, content_type = await self.client.get(
                    f"{replica.url}/v1/models", self.config.upstream_read_timeout_s,
                    _auth(replica))
            except UpstreamError as e:
                self.router.record_failure(replica.index, str(e))
                continue
            return Response(body, status, media_type=content_type)
        return _error(503, "no healthy vLLM replica to list models", "no_replica")

    # ------------------------------------------------------------------ introspection
    def state(self) -> dict[str, Any]:
        """JSON-able view of the control plane with every session (``GET /mars/v1/state`` with
        the admin key): :meth:`aggregate_state` plus ``sessions`` and the replicas' URLs and last
        errors."""
        view = self.aggregate_state()
        admission = self.plane.admission
        now = self.plane.clock()
        view["sessions"] = {
            s.session_id: {"replica": s.replica, "turns": s.num_turns,
                           "side_requests": s.num_side_requests,
                           "turn_retries": s.num_turn_retries,
                           "in_flight": s.num_in_flight,
                           "admitted": admission.is_admitted(s.session_id),
                           "is_token_bound": self.tokens.is_bound(s.session_id, now)}
            for s in self.sessions
        }
        for replica, row in zip(self.router.replicas, view["replicas"], strict=True):
            row.update(url=redact_url(replica.url), last_error=replica.last_error)
        return view

    def aggregate_state(self) -> dict[str, Any]:
        """The figures of :meth:`state` that name no session and no replica address: window,
        flags, pressure, counts (``GET /mars/v1/state`` when no admin key is configured)."""
        plane = self.plane
        admission, policy = plane.admission, plane.admission.policy
        decision = policy.last_decision
        return {
            "window": admission.window,
            "is_admission_enabled": self.config.is_admission_enabled,
            "num_admitted": len(admission.admitted),
            "num_waiting": admission.num_waiting,
            "num_sessions": len(self.sessions),
            "num_in_flight": sum(s.num_in_flight for s in self.sessions),
            "num_token_bindings": len(self.tokens),
            "is_cpu_overloaded": policy.state.is_cpu_overloaded,
            "is_kv_overloaded": policy.state.is_kv_overloaded,
            "cpu_cap": decision.cpu_cap if decision else None,
            "kv_cap": decision.kv_cap if decision else None,
            "reorder_mode": policy.last_mode,
            "tool_backlog_ratio": plane.tools.backlog_ratio,
            "tool_wait_ema_s": plane.tools.wait_ema_s,
            "tool_fraction": plane.tools.tool_fraction,
            "kv_usage": self.router.kv_usage(),
            "replicas": [
                {"name": r.name, "healthy": r.is_healthy, "sessions": r.num_sessions,
                 "in_flight": r.num_in_flight, "kv_usage": r.kv_usage_polled,
                 "restarts": r.num_restarts}
                for r in self.router.replicas
            ],
        }

    def metrics_text(self) -> str:
        """The gateway's ``/metrics`` in Prometheus text format."""
        plane = self.plane
        admission, tools = plane.admission, plane.tools
        st = admission.policy.state
        now = plane.clock()
        replicas = self.router.replicas
        hub = self.hub
        g = "gauge"
        c = "counter"
        rows: list[tuple[str, str, str, list[tuple[dict[str, str], float]]]] = [
            ("mars_admission_window", g, "AIMD admission window W, sessions", [({}, st.window)]),
            ("mars_admission_enabled", g, "1 if admission is on",
             [({}, float(self.config.is_admission_enabled))]),
            ("mars_sessions_admitted", g, "Sessions holding a slot", [({}, len(admission.admitted))]),
            ("mars_sessions_waiting", g, "Sessions waiting for a slot", [({}, admission.num_waiting)]),
            ("mars_admission_wait_seconds_total", c, "Seconds requests waited for a slot",
             [({}, self.admission_wait_total_s)]),
            ("mars_admission_waits_total", c, "Requests that waited for a slot",
             [({}, self.num_admission_waits)]),
            ("mars_sessions_live", g, "Sessions known to the gateway", [({}, len(self.sessions))]),
            ("mars_cpu_overloaded", g, "CPU overload flag", [({}, float(st.is_cpu_overloaded))]),
            ("mars_kv_overloaded", g, "KV overload flag", [({}, float(st.is_kv_overloaded))]),
            ("mars_tool_backlog_ratio", g, "In-flight tool calls / tool workers",
             [({}, tools.backlog_ratio)]),
            ("mars_tool_wait_ema_seconds", g, "EMA of tool queue wait, s",
             [({}, tools.wait_ema_s or 0.0)]),
            ("mars_tool_calls_in_flight", g, "Tool calls enqueued or running",
             [({}, tools.num_in_flight)]),
            ("mars_tool_fraction", g,
             "Share of admitted session-time with a tool call in flight (f of C_cpu)",
             [({}, tools.tool_fraction or 0.0)]),
            ("mars_kv_usage", g, "KV usage used by admission (healthy replicas, as one pool by default)",
             [({}, self.router.kv_usage() or 0.0)]),
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
             [({}, plane.num_idle_releases)]),
            ("mars_client_gone_releases_total", c, "Slots released because the client hung up",
             [({}, plane.num_client_gone_releases)]),
            ("mars_tool_calls_interrupted_total", c,
             "Tool calls closed as interrupted (no tool_end within their bound or by their session's end)",
             [({}, plane.num_tools_interrupted)]),
            ("mars_sessions_admitted_total", c, "Admissions", [({}, admission.num_admitted_total)]),
            ("mars_events_cpu_total", c, "CPU-plane events received",
             [({}, hub.num_cpu_events if hub else 0)]),
            ("mars_events_gpu_total", c, "GPU-plane events received",
             [({}, hub.num_gpu_events if hub else 0)]),
            ("mars_events_forwarded_total", c, "CPU-plane events forwarded to replicas",
             [({}, hub.num_forwarded if hub else 0)]),
            ("mars_events_forward_dropped_total", c, "Forwarded events dropped by the channel",
             [({}, hub.num_forward_dropped() if hub else 0)]),
            ("mars_unauthorized_total", c, "Calls refused for a missing or wrong API or admin key",
             [({}, self.num_unauthorized)]),
            ("mars_forbidden_total", c,
             "Calls refused for a session token missing, malformed or not the session's",
             [({}, self.num_forbidden)]),
            ("mars_session_tokens", g, "Sessions bound to a token (live or kept after release)",
             [({}, len(self.tokens))]),
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
        if scope["type"] == "http" and scope["path"].startswith("/v1"):
            credentials = self.handler.gateway.credentials
            if credentials.has_api_key and scope["method"] != "OPTIONS" and not (
                    credentials.is_api_allowed(_header(scope, b"authorization"))):
                self.handler.gateway.num_unauthorized += 1
                await _unauthorized()(scope, receive, send)
                return
            if scope["path"] in PROXY_PATHS and scope["method"] == "POST":
                await self.handler(scope, receive, send)
                return
        await self.app(scope, receive, send)


def _header(scope: Any, name: bytes) -> str | None:
    """An ASGI request header's value (``name`` lower-case), or ``None``."""
    for key, value in scope["headers"]:
        if key == name:
            return value.decode("latin-1")
    return None


def _auth(replica: ReplicaState) -> dict[str, str] | None:
    """The headers the gateway's own requests to ``replica`` carry (its API key, if any)."""
    return {"authorization": replica.authorization} if replica.authorization else None


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
        if not gateway.credentials.is_api_allowed(request.headers.get("authorization")):
            gateway.num_unauthorized += 1
            return _unauthorized()
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
            accepted = gateway.ingest_events(raw, request.headers.get(SESSION_TOKEN_HEADER))
        except BadRequestError as e:
            gateway.num_forbidden += isinstance(e, AuthError)
            return _error(e.status_code, str(e), e.kind)
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
    async def state(request: Request) -> Response:
        authorization = request.headers.get("authorization")
        credentials = gateway.credentials
        if credentials.is_admin(authorization):
            return JSONResponse(gateway.state())
        if credentials.has_admin_key or not credentials.is_api_allowed(authorization):
            gateway.num_unauthorized += 1
            return _unauthorized()
        return JSONResponse(gateway.aggregate_state())

    return app
