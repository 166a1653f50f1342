"""The proxy hot path: ``POST /v1/chat/completions`` and ``/v1/completions`` as raw ASGI.

Life of a request (:meth:`ProxyHandler.__call__`)::

    agent ──▶ size check (413) ──▶ probe parse (400; only the six fields the gateway reads are
          built as Python objects, ``messages`` is skipped) ──▶ session id, vllm_xargs check (400)
          ──▶ admission slot (sync fast path; else waits) ──▶ replica (affinity, else least loaded)
          ──▶ turn (plane.start_turn: the same body as the latest turn is a retry of it)
          ──▶ body += session_id, vllm_xargs (spliced into the agent's bytes when it has neither)
          ──▶ vLLM ──▶ response (whole, or a stream whose headers are held until its first chunk,
          then relayed chunk by chunk) ──▶ plane.end_turn (unanswered: the turn is given back)

Per request the gateway creates no pydantic model and, for a request answered within
:data:`DISCONNECT_WATCH_DELAY_S`, no task: the disconnect watcher (a task awaiting ``receive()``,
~0.15 ms of CPU on the critical path) starts only after that delay, off the critical path, so a
disconnect is noticed at most that much later. JSON is read with msgspec and, in the common case,
never re-serialized. Cancellation is the one mechanism
that interrupts a request: a client disconnect (watcher) or the replica poller marking the replica
down (:meth:`_Call.fail`) cancels the request's own task and says why; the handler turns that
into an abort of the upstream request (its connection is closed, so vLLM aborts), a re-run on the
next replica (nothing sent to the agent yet: a stream's headers wait for its first chunk, up to
``stream_hold_s``) or an SSE ``error`` chunk (a stream under way).
A response that simply finished is never counted as a disconnect.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, Protocol

import msgspec

from mars_openhands.cli_style import redact_url
from mars_openhands.control import metadata
from mars_openhands.control.admission import AdmissionTimeoutError
from mars_openhands.control.auth import SESSION_TOKEN_HEADER, AuthError
from mars_openhands.control.metadata import BadRequestError
from mars_openhands.control.routing import NoReplicaError, ReplicaState
from mars_openhands.control.sessions import Session
from mars_openhands.control.upstream import (
    UpstreamBrokenError,
    UpstreamError,
    UpstreamResponse,
    UpstreamTimeoutError,
    UpstreamUnreachableError,
)

if TYPE_CHECKING:
    from collections.abc import Mapping

    from mars_openhands.control.config import GatewayConfig
    from mars_openhands.control.plane import ControlPlane
    from mars_openhands.control.routing import Router
    from mars_openhands.control.upstream import UpstreamClient

__all__ = ["DISCONNECT_WATCH_DELAY_S", "PROXY_PATHS", "GatewayCore", "ProxyHandler"]

PROXY_PATHS = frozenset(("/v1/chat/completions", "/v1/completions"))
"""Paths served by :class:`ProxyHandler`."""

_HEADERS_READ = {name.encode(): name for name in (
    "x-mars-session", "x-litellm-session-id", "x-mars-last-step", "content-length",
    "authorization", "content-type", "accept", "x-request-id", SESSION_TOKEN_HEADER)}
_FORWARD_HEADERS = ("authorization", "accept", "x-request-id")
_NEEDS_REWRITE = frozenset(("mars_session", "mars_last_step", "mars_side", "session_id",
                            "vllm_xargs"))
DISCONNECT_WATCH_DELAY_S = 0.05
"""Seconds after the request body is read before the gateway starts watching for the client's
disconnect. A shorter request never pays for the watcher; a longer one is aborted upstream at most
this much later than the disconnect (vLLM requests that matter last seconds)."""


class _Probe(msgspec.Struct):
    """The body fields the gateway reads; everything else is skipped by the decoder."""

    mars_session: Any = msgspec.UNSET
    session_id: Any = msgspec.UNSET
    prompt_cache_key: Any = msgspec.UNSET
    mars_last_step: Any = msgspec.UNSET
    mars_side: Any = msgspec.UNSET
    vllm_xargs: Any = msgspec.UNSET
    stream: Any = msgspec.UNSET
    tools: msgspec.Raw = msgspec.UNSET  # kept raw: only its presence matters (side requests)


_PROBE = msgspec.json.Decoder(_Probe)
_ENCODE = msgspec.json.Encoder().encode


def probe_body(raw: bytes) -> dict[str, Any]:
    """The gateway's fields of a JSON request body, as a dict of the present ones, plus
    ``has_tools`` (a non-empty ``tools`` list; the list itself is not decoded). Pure.

    Raises:
        BadRequestError: not JSON, or not a JSON object.
    """
    try:
        probe = _PROBE.decode(raw)
    except msgspec.ValidationError as e:
        raise BadRequestError(f"request body must be a JSON object ({e})") from None
    except msgspec.DecodeError as e:
        raise BadRequestError(f"request body is not valid JSON: {e}") from None
    fields = {f: v for f in _Probe.__struct_fields__
              if f != "tools" and (v := getattr(probe, f)) is not msgspec.UNSET}
    tools = probe.tools
    fields["has_tools"] = (tools is not msgspec.UNSET
                           and bytes(tools).strip() not in (b"null", b"[]", b""))
    return fields


def engine_content(raw: bytes, fields: dict[str, Any], session_id: str | None, turn: int | None,
                   last_step: int | None, prev_tool: tuple[str, float] | None,
                   session_age_s: float | None = None) -> bytes:
    """The body to send to vLLM (see :func:`metadata.build_engine_body`; ``turn`` ``None``: a
    side request), as bytes. Pure.

    When the agent's body has none of ``mars_session``, ``mars_last_step``, ``session_id`` and
    ``vllm_xargs``, the two fields are spliced in before the closing brace of the agent's bytes
    (no parse of ``messages``, no re-serialization); otherwise the body is decoded, rewritten by
    :func:`metadata.build_engine_body` and encoded.

    Raises:
        BadRequestError: from :func:`metadata.build_engine_body`.
    """
    if _NEEDS_REWRITE.isdisjoint(fields):
        xargs = metadata.gateway_xargs(turn, last_step, prev_tool, session_age_s)
        end = raw.rindex(b"}")
        head = raw[:end]
        parts = [head]
        if session_id is not None:
            parts += [b',"session_id":', _ENCODE(session_id)]
        parts += [b',"vllm_xargs":', _ENCODE(xargs), b"}"]
        if head.rstrip().endswith(b"{"):  # empty object: no leading comma
            parts[1] = parts[1][1:]
        return b"".join(parts)
    body = msgspec.json.decode(raw)
    return _ENCODE(metadata.build_engine_body(body, session_id, turn, last_step, prev_tool,
                                              session_age_s))


class GatewayCore(Protocol):
    """What the proxy needs of the gateway (:class:`~mars_openhands.control.app.Gateway`
    implements it): its config, control plane, router and upstream client, the counters it
    bumps, and the per-request steps it calls. The proxy never imports the app (the app mounts
    the proxy)."""

    config: GatewayConfig
    plane: ControlPlane
    router: Router
    client: UpstreamClient | None
    num_requests: int
    num_forbidden: int
    num_client_disconnects: int
    num_upstream_errors: int

    def session_for(self, headers: Mapping[str, str],
                    fields: Mapping[str, Any]) -> tuple[Session, int | None]:
        """The request's session (found or created, once its caller may act for it) and its
        last step."""
        ...

    async def wait_for_admission(self, session: Session, raw: bytes) -> None:
        """Return once the session holds an admission slot."""
        ...

    def record_aborted(self, session: Session | None, request_id: str, reason: str, stage: str,
                       elapsed_s: float, is_slot_released: bool = False,
                       turn: int | None = None) -> None:
        """Record a request that ended without an answer."""
        ...

    def replica_failed(self, replica: ReplicaState, reason: str, immediate: bool = False) -> bool:
        """A request to ``replica`` failed; True when that took the replica out."""
        ...

    async def is_alive(self, replica: ReplicaState) -> bool:
        """Probe the replica's ``/health`` once."""
        ...

    def _finish(self, session: Session, replica: ReplicaState | None,
                is_client_gone: bool = False) -> bool:
        """Bookkeeping when a request ends, exactly once; True when the session's slot was
        released."""
        ...


class _ClientGoneError(Exception):
    """The agent closed its connection."""


class _UpstreamFailedError(Exception):
    """The replica failed (or was marked down) while serving the request."""

    def __init__(self, message: str, status: int = 502, can_retry: bool = False) -> None:
        super().__init__(message)
        self.status = status
        self.can_retry = can_retry


class _HeldStream:
    """A 200 stream whose headers the gateway held back: the first chunk it read meanwhile
    (``None``: none within ``stream_hold_s``; ``b""``: the stream ended without one)."""

    __slots__ = ("head",)

    def __init__(self, head: bytes | None) -> None:
        self.head = head


class _Call:
    """One proxied request: its task, where it is, and why it was interrupted (client gone,
    replica down)."""

    __slots__ = ("task", "is_gone", "fail_reason", "is_done", "watcher", "stage", "turn", "is_complete")

    def __init__(self, task: asyncio.Task[Any] | None) -> None:
        self.task = task
        self.is_gone = False
        self.fail_reason: str | None = None
        self.is_done = False
        self.watcher: asyncio.Future[Any] | None = None
        self.stage = "admission"
        """``RequestAborted.stage``: "admission", "upstream" (no byte to the agent yet), "stream"."""
        self.turn: int | None = None
        """The agent turn it runs as, once started (``None``: not yet, or a side request)."""
        self.is_complete = False
        """The stream's last event (``data: [DONE]``) reached the agent: a hang-up after it is an
        answered turn, not an abort."""

    def watch(self, receive: Any) -> None:
        """Start watching for the client's disconnect (a task awaiting ``receive()``)."""
        if not self.is_done:
            self.watcher = asyncio.ensure_future(receive())
            self.watcher.add_done_callback(self.on_receive)

    def stop_watching(self) -> None:
        if self.watcher is not None:
            self.watcher.cancel()

    def fail(self, reason: str) -> None:
        """The replica went down (poller): interrupt the request."""
        if not self.is_done and self.task is not None:
            self.fail_reason = reason
            self.task.cancel()

    def on_receive(self, fut: asyncio.Future[Any]) -> None:
        """Watcher callback: a disconnect before the response finished interrupts the request."""
        if fut.cancelled() or fut.exception() is not None or self.is_done:
            return
        if fut.result().get("type") == "http.disconnect" and self.task is not None:
            self.is_gone = True
            self.task.cancel()

    def interrupted(self, task: asyncio.Task[Any] | None) -> str:
        """After catching CancelledError: ``"gone"``, ``"failed"``, or ``""`` (a real cancel)."""
        why = "gone" if self.is_gone else "failed" if self.fail_reason is not None else ""
        if why and task is not None:
            task.uncancel()
        return why


def _json_error(status: int, message: str, kind: str) -> tuple[int, bytes]:
    return status, _ENCODE({"error": {"message": message, "type": kind, "code": status}})


async def _send_whole(send: Any, status: int, body: bytes, content_type: str | None,
                      extra: Sequence[tuple[bytes, bytes]] = ()) -> None:
    """Send a whole response (status, content type, length, ``extra`` headers, body)."""
    headers = [(b"content-type", (content_type or "application/json").encode("latin-1")),
               (b"content-length", str(len(body)).encode()), *extra]
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": body})


class ProxyHandler:
    """Serves the two completions paths for ``gateway`` (raw ASGI; everything else is FastAPI)."""

    def __init__(self, gateway: GatewayCore) -> None:
        self.gateway = gateway

    async def _read_body(self, receive: Any, headers: dict[str, str]) -> bytes:
        """The request body. Raises BadRequestError (413) past ``max_body_bytes``."""
        limit = self.gateway.config.max_body_bytes
        declared = headers.get("content-length")
        if declared is not None and declared.isdigit() and int(declared) > limit:
            raise BadRequestError(
                f"request body is {declared} bytes, more than max_body_bytes={limit}; raise "
                "--max-body-bytes", 413,
            )
        message = await receive()
        body: bytes = message.get("body", b"")
        if not message.get("more_body", False):
            return body
        parts = [body]
        size = len(body)
        while message.get("more_body", False):
            message = await receive()
            if message["type"] == "http.disconnect":
                raise _ClientGoneError()
            parts.append(chunk := message.get("body", b""))
            size += len(chunk)
            if size > limit:
                raise BadRequestError(
                    f"request body is more than max_body_bytes={limit} bytes; raise "
                    "--max-body-bytes", 413,
                )
        return b"".join(parts)

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        """Handle one completions request end to end (see the module docstring)."""
        gateway = self.gateway
        gateway.num_requests += 1
        t0_s = time.monotonic()
        headers = {_HEADERS_READ[n]: v.decode("latin-1") for n, v in scope["headers"]
                   if n in _HEADERS_READ}
        request_id = headers.get("x-request-id") or f"gw-{gateway.num_requests}"
        try:
            raw = await self._read_body(receive, headers)
            fields = probe_body(raw)
            if "vllm_xargs" in fields:
                metadata.check_xargs(fields["vllm_xargs"])
            session, last_step = gateway.session_for(headers, fields)
            is_side = not session.is_one_turn and metadata.is_side_request(scope["path"], fields)
        except BadRequestError as e:  # AuthError too: refused before anything was counted
            gateway.num_forbidden += isinstance(e, AuthError)
            await _send_whole(send, *_json_error(e.status_code, str(e), e.kind), None)
            return
        except _ClientGoneError:
            gateway.num_client_disconnects += 1
            gateway.record_aborted(None, request_id, "client_disconnect", "body",
                                   time.monotonic() - t0_s)
            return
        task = asyncio.current_task()
        call = _Call(task)
        watch = asyncio.get_running_loop().call_later(DISCONNECT_WATCH_DELAY_S, call.watch,
                                                      receive)
        gateway.plane.begin_request(session)
        replica: list[ReplicaState] = []
        abort: list[str] = []
        try:
            await self._serve(scope["path"], raw, fields, headers, session, (last_step, is_side),
                              call, replica, send, abort)
        finally:
            call.is_done = True
            watch.cancel()
            call.stop_watching()
            released = gateway._finish(session, replica[0] if replica else None,
                                       is_client_gone=call.is_gone)
            if abort:
                gateway.record_aborted(session, request_id, abort[0], call.stage,
                                       time.monotonic() - t0_s, released, call.turn)

    async def _serve(self, path: str, raw: bytes, fields: dict[str, Any], headers: dict[str, str],
                     session: Session, step: tuple[int | None, bool], call: _Call,
                     replica_out: list[ReplicaState], send: Any, abort: list[str]) -> None:
        """Admission, routing, forwarding and the response; every expected failure answered.

        ``step`` is ``(mars_last_step, is_side)``: a side request takes no turn (``turn`` None).
        ``abort`` receives the ``RequestAborted.reason`` when the gateway gives the request up.
        """
        gateway = self.gateway
        status_body: tuple[int, bytes] | None = None
        last_step, is_side = step
        is_answered = False
        try:
            if not gateway.plane.admission.try_admit(session.session_id):
                await gateway.wait_for_admission(session, raw)
            call.stage = "upstream"
            fingerprint = None if session.is_one_turn else metadata.body_fingerprint(raw)
            turn, prev_tool = gateway.plane.start_turn(session, is_side, fingerprint)
            call.turn = turn
            content = engine_content(raw, fields, None if session.is_one_turn else session.session_id,
                                     turn, last_step, prev_tool,
                                     gateway.plane.session_age_s(session, turn))
            forward = {k: v for k in _FORWARD_HEADERS if (v := headers.get(k)) is not None}
            forward["content-type"] = "application/json"
            stream = bool(fields.get("stream"))
            replica, resp, body = await self._send_with_failover(session, path, content, forward,
                                                                 stream, call)
            replica_out.append(replica)
            replica.num_in_flight += 1
            extra = [*resp.headers, (b"x-mars-replica", replica.name.encode()),
                     (b"x-mars-session", session.session_id.encode()),
                     (b"x-mars-turn", str(turn).encode()) if turn is not None
                     else (b"x-mars-side", b"1")]
            if isinstance(body, bytes):
                call.is_done = True
                is_answered = resp.status_code < 400  # else vLLM refused it (unknown model, ...)
                await _send_whole(send, resp.status_code, body, resp.content_type, extra)
                return
            call.stage = "stream"
            if await self._relay(resp, body, replica, call, extra, send):
                abort.append("replica_failed")
            else:
                is_answered = True
            return
        except asyncio.CancelledError:
            why = call.interrupted(call.task)
            if not why:
                raise
            if why == "gone":
                if call.is_complete:  # hung up after the stream's last event (before its EOF)
                    is_answered = True
                    return
                gateway.num_client_disconnects += 1
                abort.append("client_disconnect")
                return
            gateway.num_upstream_errors += 1  # marked down just as the response was being sent
            abort.append("replica_failed")
            status_body = _json_error(503, call.fail_reason or "replica down", "upstream_error")
        except BadRequestError as e:
            status_body = _json_error(e.status_code, str(e), "invalid_request_error")
        except AdmissionTimeoutError as e:
            abort.append("admission_timeout")
            status_body = _json_error(503, str(e), "admission_timeout")
        except NoReplicaError as e:
            gateway.num_upstream_errors += 1
            abort.append("replica_failed")
            status_body = _json_error(503, str(e), "no_replica")
        except _UpstreamFailedError as e:
            gateway.num_upstream_errors += 1
            abort.append("replica_failed")
            status_body = _json_error(e.status, str(e), "upstream_error")
        finally:
            if call.turn is not None:  # an attempt without an answer gives its turn back
                gateway.plane.end_turn(session, call.turn, is_answered)
        call.is_done = True
        await _send_whole(send, *status_body, None)

    async def _send_with_failover(
        self, session: Session, path: str, content: bytes, headers: dict[str, str], stream: bool,
        call: _Call,
    ) -> tuple[ReplicaState, UpstreamResponse, bytes | _HeldStream]:
        """Route and send; when the replica is dead or unreachable, mark it down and try the next.

        Nothing has reached the agent yet at this point (a stream's headers are held until its
        first chunk, :meth:`_hold`), so re-running the request elsewhere is invisible to it apart
        from the latency. Bounded: each retry marks a replica down, and :meth:`Router.route` raises
        once none is left.
        """
        gateway = self.gateway
        while True:
            replica = gateway.router.route(session)  # raises NoReplicaError when none is left
            try:
                resp, body = await self._attempt(replica, path, content, headers, stream, call)
            except _UpstreamFailedError as e:
                if not e.can_retry:
                    raise
                gateway.replica_failed(replica, str(e), immediate=True)
                gateway.router.detach(session)
                continue
            gateway.router.record_success(replica.index)
            return replica, resp, body

    async def _attempt(self, replica: ReplicaState, path: str, content: bytes,
                       headers: dict[str, str], stream: bool,
                       call: _Call) -> tuple[UpstreamResponse, bytes | _HeldStream]:
        """One replica: POST, and read the whole body, or of a 200 stream its first chunk
        (:meth:`_hold`): until then a failure of the replica is retryable.

        Raises:
            _UpstreamFailedError: the replica failed (``can_retry`` when it is dead, unreachable
                or was marked down meanwhile).
            asyncio.CancelledError: the client went away (or a real cancel).
        """
        gateway = self.gateway
        client = gateway.client
        assert client is not None, "Gateway.start() must run first"
        call.fail_reason = None
        if replica.authorization is not None:  # the replica's own key, never the agent's
            headers = {**headers, "authorization": replica.authorization}
        replica.in_flight.add(call)
        try:
            resp = await client.post(f"{replica.url}{path}", content, headers)
            if stream and resp.status_code == 200:
                try:
                    return resp, await self._hold(resp)
                except BaseException:
                    resp.close()
                    raise
            try:
                return resp, await resp.read()
            finally:
                resp.close()
        except asyncio.CancelledError:
            raise _retry_after_cancel(call) from None
        except UpstreamBrokenError as e:
            try:
                is_alive = await gateway.is_alive(replica)
            except asyncio.CancelledError:  # the poller marked it down meanwhile and cancelled us
                raise _retry_after_cancel(call) from None
            if not is_alive:  # died under us: nothing to lose by re-running
                raise _UpstreamFailedError(
                    f"replica {replica.name} ({redact_url(replica.url)}) died mid-request: {e}", 503,
                    can_retry=True,
                ) from None
            raise _UpstreamFailedError(
                f"replica {replica.name} ({redact_url(replica.url)}) broke the connection mid-request: {e}"
            ) from None
        except UpstreamUnreachableError as e:
            raise _UpstreamFailedError(
                f"replica {replica.name} ({redact_url(replica.url)}) unreachable: {e}", 503, can_retry=True
            ) from None
        except UpstreamTimeoutError as e:
            raise _UpstreamFailedError(
                f"replica {replica.name} ({redact_url(replica.url)}) sent nothing for "
                f"{gateway.config.upstream_read_timeout_s} s ({e}); raise "
                "--upstream-read-timeout-s if it is just slow", 504,
            ) from None
        finally:
            replica.in_flight.discard(call)

    async def _hold(self, resp: UpstreamResponse) -> _HeldStream:
        """Read a 200 stream's first chunk before anything goes to the agent, for at most
        ``stream_hold_s`` (vLLM sends the headers before the first token: a replica that dies
        while the turn queues or prefills can still be replaced). The read is cancel-safe
        (:meth:`UpstreamResponse.read_chunk`): past the bound the relay goes on from where it was.

        Raises:
            UpstreamError: the replica failed before the first chunk.
            asyncio.CancelledError: the request's task was cancelled (client gone, replica down).
        """
        try:
            async with asyncio.timeout(self.gateway.config.stream_hold_s):
                return _HeldStream(await resp.read_chunk())
        except TimeoutError:
            return _HeldStream(None)

    async def _relay(self, resp: UpstreamResponse, held: _HeldStream, replica: ReplicaState,
                     call: _Call, extra: list[tuple[bytes, bytes]], send: Any) -> bool:
        """Relay an upstream SSE stream chunk for chunk (from its held first chunk on); a replica
        failure ends it with an SSE ``error`` chunk naming the replica; a disconnect closes
        upstream (vLLM aborts).

        Returns:
            True if the replica failed mid-stream (the stream ended with an ``error`` chunk).

        Raises:
            asyncio.CancelledError: the client went away (handled by the caller) or a real cancel.
        """
        gateway = self.gateway
        content_type = (resp.content_type or "text/event-stream").encode("latin-1")
        error: str | None = None
        replica.in_flight.add(call)
        try:
            await send({"type": "http.response.start", "status": resp.status_code,
                        "headers": [(b"content-type", content_type), *extra]})
            tail = b""
            if held.head:
                await send({"type": "http.response.body", "body": held.head, "more_body": True})
                tail = held.head[-len(_SSE_END):]
                call.is_complete = tail == _SSE_END
            async for chunk in resp.iter_chunks():
                await send({"type": "http.response.body", "body": chunk, "more_body": True})
                tail = (tail + chunk)[-len(_SSE_END):]
                call.is_complete = tail == _SSE_END
        except asyncio.CancelledError:
            if call.is_gone or call.fail_reason is None:
                raise
            call.interrupted(call.task)
            error = call.fail_reason
        except UpstreamError as e:
            error = f"replica {replica.name} ({redact_url(replica.url)}) failed mid-stream: {e!r}"
        finally:
            replica.in_flight.discard(call)
            resp.close()
        call.is_done = True
        if error is not None:
            gateway.num_upstream_errors += 1
            payload = {"error": {"message": error, "type": "upstream_error", "code": 502}}
            await send({"type": "http.response.body", "body": b"data: " + _ENCODE(payload) + b"\n\n",
                        "more_body": True})
        await send({"type": "http.response.body", "body": b"", "more_body": False})
        return error is not None


_SSE_END = b"data: [DONE]\n\n"
"""The last event of an OpenAI-style stream (vLLM ends every stream with it)."""


def _retry_after_cancel(call: Any) -> BaseException:
    """What a cancelled upstream call raises: the cancel itself when the client went away (or it
    was a real cancel), else a retryable 503 naming why the gateway cancelled it (its replica
    failed). Marks the call interrupted in that case."""
    reason = call.fail_reason
    if call.is_gone or reason is None:
        return asyncio.CancelledError()
    call.interrupted(call.task)
    return _UpstreamFailedError(reason, 503, can_retry=True)
