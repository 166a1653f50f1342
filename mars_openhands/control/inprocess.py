"""The gateway inside vLLM's API server: the same control plane without the extra HTTP hop.

A standalone gateway (``mars-openhands gateway``) is one more HTTP hop in front of vLLM; on a busy
2-core machine that hop alone costs ~2 ms per request whatever it does (benchmarks/
bench_gateway.py measures a logic-free reference proxy beside it). For a single replica the same
:class:`~mars_openhands.control.app.Gateway` can instead run as ASGI middleware in vLLM's own API
server process, loaded through vLLM's ``--middleware`` plugin point::

    MARS_GATEWAY_CONFIG='{"replica": {"events_address": "ipc:///tmp/mars-inbox.sock"},
                          "engine_events_address": "ipc:///tmp/mars-gpu.sock"}' \\
    python -m vllm.entrypoints.openai.api_server --model <dir> \\
        --scheduler-cls mars_openhands.engine.schedulers.mars.MarsScheduler \\
        --additional-config '{"mars": {"telemetry": {"addr": "ipc:///tmp/mars-gpu.sock"},
                                        "inbox_addr": "ipc:///tmp/mars-inbox.sock"}}' \\
        --middleware mars_openhands.control.inprocess.MarsGatewayMiddleware

What changes against the standalone gateway:

* ``POST /v1/chat/completions`` and ``/v1/completions`` go through the unchanged
  :class:`~mars_openhands.control.proxy.ProxyHandler` (session id, admission window, ``vllm_xargs``,
  turn counting, disconnects), whose replica client is :class:`InProcessClient`: it calls the rest
  of vLLM's ASGI stack directly (no socket, no HTTP parsing, no copy of the body).
* The gateway's own endpoints live under ``/mars/v1/`` (``events``, ``state``, ``metrics``,
  ``healthz``); ``/metrics``, ``/health`` and ``/v1/models`` stay vLLM's.
* One replica: the local engine (routing and fail-over have nothing to do).
* vLLM adds ``--middleware`` outside its own ``--api-key`` check, so the middleware asks that check
  (once per distinct ``Authorization`` value) before admission, and guards ``/mars/v1/events`` and
  ``/mars/v1/state`` with it: vLLM's key is the gateway's API key here. The admin key
  (``admin_key`` or ``MARS_GATEWAY_ADMIN_KEY``) and the session tokens work as in the standalone
  gateway (control/auth.py); an admin key that is also one of vLLM's keys opens nothing (a config
  error when ``VLLM_API_KEY`` shows it; else found at its first use). ``/mars/v1/metrics`` and
  ``/mars/v1/healthz`` are open, as vLLM's own ``/metrics`` and ``/health``.
* A client that hangs up is passed on as uvicorn would (``http.disconnect`` on ``receive``,
  ``OSError`` on ``send``), then the request is cancelled after :data:`HANG_UP_GRACE_S`.

Configuration: the environment variable ``MARS_GATEWAY_CONFIG`` holds a JSON object of
:class:`~mars_openhands.control.config.GatewayConfig` fields, or ``@path`` to a JSON file; the local
replica's options (``events_address``, ``name``, ``engine_source``) go under ``"replica"``;
``replicas``, ``host``, ``port`` and ``api_key`` are refused (the server's own address and vLLM's
``--api-key`` are used); ``admin_key`` comes from the variable or ``MARS_GATEWAY_ADMIN_KEY``. Unset or empty:
every default (admission on, nothing recorded, no engine channels). vLLM builds middleware only
after its engine is up, so check the value first: ``python -m mars_openhands.control.inprocess``.
"""

from __future__ import annotations

import asyncio
import collections
import hashlib
import json
import os
import secrets
import sys
from collections.abc import AsyncIterator, Mapping
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

from fastapi.responses import JSONResponse
from pydantic import ValidationError

from mars_openhands import env
from mars_openhands.cli_style import config_error_lines, keys_hint
from mars_openhands.control.auth import UNAUTHORIZED_BODY
from mars_openhands.control.config import GatewayConfig, ReplicaConfig, check_runtime
from mars_openhands.control.proxy import PROXY_PATHS, ProxyHandler
from mars_openhands.control.upstream import (
    NOT_RELAYED_HEADERS,
    UpstreamBrokenError,
    UpstreamTimeoutError,
)

__all__ = ["CONFIG_ENV", "IN_PROCESS_URL", "InProcessClient", "MarsGatewayMiddleware", "config_from_env"]

CONFIG_ENV = env.GATEWAY_CONFIG.name
"""Environment variable with the in-process gateway's configuration (JSON, or ``@path``)."""
IN_PROCESS_URL = "http://in-process"
"""The local replica's URL in the gateway's config, metrics and logs (never connected to)."""
_REFUSED = ("replicas", "host", "port", "api_key")
_UNAUTHORIZED = JSONResponse({"error": "Unauthorized"}, status_code=401)  # vLLM's own answer
assert _UNAUTHORIZED.body == UNAUTHORIZED_BODY, "the gateway's 401 body is vLLM's"
_OPEN_PATHS = frozenset(("/mars/v1/metrics", "/mars/v1/healthz"))
"""Gateway paths without a key (aggregate figures, as vLLM's own ``/metrics`` and ``/health``)."""
_ADMIN_PATHS = frozenset(("/mars/v1/state",))
"""Gateway paths the admin key opens (besides vLLM's own key)."""
_SHARED_ADMIN_KEY = ("the admin key is one of vLLM's API keys (--api-key / VLLM_API_KEY): every "
                     "agent that holds the API key could read other sessions' ids; give the admin "
                     "key (admin_key or MARS_GATEWAY_ADMIN_KEY) its own value")


def config_from_env(environ: Mapping[str, str] | None = None) -> GatewayConfig:
    """The in-process gateway's config from ``MARS_GATEWAY_CONFIG`` (see the module docstring).

    Raises:
        ValueError: unreadable file, not a JSON object, a refused key, or an invalid field (the
            message names the variable and the field).
    """
    environ = os.environ if environ is None else environ
    text = environ.get(CONFIG_ENV, "").strip()
    where = CONFIG_ENV
    if text.startswith("@"):
        where = f"{CONFIG_ENV} file {text[1:]}"
        try:
            text = Path(text[1:]).read_text()
        except OSError as e:
            raise ValueError(f"cannot read {where}: {e}") from None
    try:
        data = json.loads(text) if text.strip() else {}
    except json.JSONDecodeError as e:
        raise ValueError(f"{where} is not JSON: {e}") from None
    if not isinstance(data, dict):
        raise ValueError(f"{where} must be a JSON object of gateway settings, got {type(data).__name__}")
    refused = [k for k in _REFUSED if k in data]
    if refused:
        raise ValueError(f"{where}: {', '.join(refused)} cannot be set in-process (the gateway serves on "
                         "vLLM's own address, in front of its own engine, behind vLLM's --api-key); "
                         "put the local replica's options under \"replica\"")
    replica = data.pop("replica", {})
    if not isinstance(replica, dict):
        raise ValueError(f"{where}: \"replica\" must be an object, e.g. "
                         "{\"events_address\": \"ipc:///tmp/mars-inbox.sock\"}")
    for key in ("url", "api_key"):
        if key in replica:
            raise ValueError(f"{where}: replica.{key} cannot be set in-process (the replica is "
                             "this server)")
    admin_key = env.GATEWAY_ADMIN_KEY.get_secret(environ)
    if admin_key is not None and "admin_key" not in data:
        data["admin_key"] = admin_key
    if data.get("admin_key") and data["admin_key"] == environ.get("VLLM_API_KEY"):
        raise ValueError(f"{where}: {_SHARED_ADMIN_KEY}")
    try:
        local = ReplicaConfig(**{"name": "local", **replica, "url": IN_PROCESS_URL})
    except ValidationError as e:
        raise ValueError(f"{where}: {_problems(e, 'replica.')}") from None
    try:
        return GatewayConfig(**data, replicas=(local,))
    except ValidationError as e:
        raise ValueError(f"{where}: {_problems(e, '')}") from None


def _problems(error: ValidationError, key_prefix: str) -> str:
    """The :func:`~mars_openhands.cli_style.config_error_lines` of the variable's keys (those of
    ``"replica"`` under ``key_prefix="replica."``), joined into one line: an unknown key lists the
    keys its section takes here (the refused ones left out), a key's value is never shown."""
    if key_prefix:
        hint = keys_hint(ReplicaConfig, "replica", hidden=("url", "api_key"))
    else:
        hint = keys_hint(GatewayConfig, hidden=_REFUSED, added=("replica",))
    return "; ".join(config_error_lines(error, key_prefix=key_prefix, unknown_key_hint=hint))


HANG_UP_GRACE_S = 1.0
"""Seconds an in-process request gets to end by itself after it was told the client is gone
(``http.disconnect`` on ``receive``, ``OSError`` on ``send``: how vLLM notices a disconnect under
uvicorn) before its task is cancelled."""


class InProcessResponse:
    """A response being produced by the in-process app (the ``UpstreamResponse`` interface).

    Attributes:
        status_code: HTTP status.
        content_type: the ``content-type`` header, if any.
        headers: the app's other response headers, to relay (``x-request-id``, CORS, ...).
    """

    __slots__ = ("_call", "status_code", "content_type", "headers")

    def __init__(self, call: _AppCall, status_code: int, content_type: str | None,
                 headers: list[tuple[bytes, bytes]]) -> None:
        self._call = call
        self.status_code = status_code
        self.content_type = content_type
        self.headers = headers

    async def read(self) -> bytes:
        """The whole body. Raises UpstreamError."""
        return b"".join([chunk async for chunk in self.iter_chunks()])

    async def read_chunk(self) -> bytes:
        """The app's next non-empty body bytes, ``b""`` at the end. Cancel-safe (the messages
        wait in the call's deque). Raises UpstreamError."""
        while not self._call.is_finished:
            message = await self._call.next_message()
            if not message.get("more_body", False):
                self._call.is_finished = True
            if body := message.get("body", b""):
                return body
        return b""

    async def iter_chunks(self) -> AsyncIterator[bytes]:
        """Body bytes as the app sends them (one item per ``http.response.body``). Raises
        UpstreamError."""
        while chunk := await self.read_chunk():
            yield chunk

    def close(self) -> None:
        """Hang up on the app's request if it has not finished (vLLM aborts it)."""
        self._call.hang_up()


def _wake(waiter: asyncio.Future[None]) -> None:
    if not waiter.done():
        waiter.set_result(None)


def _cancel_if_running(task: asyncio.Task[None]) -> None:
    if not task.done():
        task.cancel()


class _AppCall:
    """One request run through the app in its own task: the messages it sent, the disconnect.

    Messages wait in a deque; the reader parks on one future only when the deque is empty (a
    queue with a timeout context per message cost ~20 us each, measured on the stream path).
    The app's own task matters for hang-ups: vLLM's non-streaming handlers run in a task of their
    own (``with_cancellation``) that only a ``http.disconnect`` from ``receive`` cancels; cancelling
    the caller would orphan it and the engine would finish the request.
    """

    __slots__ = ("task", "messages", "gone", "url", "read_timeout_s", "is_finished", "_body", "_waiter")

    def __init__(self, body: bytes, url: str, read_timeout_s: float) -> None:
        self.messages: collections.deque[Any] = collections.deque()
        self.gone = asyncio.Event()
        self.url = url
        self.read_timeout_s = read_timeout_s
        self.is_finished = False
        self._body: bytes | None = body
        self._waiter: asyncio.Future[None] | None = None
        self.task: asyncio.Task[None] | None = None

    async def receive(self) -> dict[str, Any]:
        body, self._body = self._body, None
        if body is not None:
            return {"type": "http.request", "body": body, "more_body": False}
        await self.gone.wait()
        return {"type": "http.disconnect"}

    def _put(self, message: Any) -> None:
        self.messages.append(message)
        if self._waiter is not None:
            _wake(self._waiter)

    async def send(self, message: dict[str, Any]) -> None:
        if self.gone.is_set():  # as uvicorn does once the client is gone (ASGI spec 2.4)
            raise OSError("the client disconnected")
        self._put(message)

    async def run(self, app: Any, scope: dict[str, Any]) -> None:
        try:
            await app(scope, self.receive, self.send)
        except asyncio.CancelledError:
            raise
        except Exception as e:  # the app crashed: the request fails like a broken connection
            self._put(UpstreamBrokenError(f"{self.url} raised {e!r}"))
        self._put(UpstreamBrokenError(f"{self.url} ended without a complete response"))

    async def next_message(self) -> dict[str, Any]:
        """The app's next ``send`` message, within the read timeout. Raises UpstreamError."""
        if not self.messages:
            loop = asyncio.get_running_loop()
            self._waiter = waiter = loop.create_future()
            timer = loop.call_later(self.read_timeout_s, _wake, waiter)
            try:
                await waiter
            finally:
                timer.cancel()
                self._waiter = None
            if not self.messages:
                self.hang_up()
                raise UpstreamTimeoutError(f"no bytes from {self.url} within {self.read_timeout_s} s")
        message = self.messages.popleft()
        if isinstance(message, Exception):
            raise message
        return message

    def hang_up(self) -> None:
        """The client is gone: tell the app (disconnect on ``receive``, ``OSError`` on ``send``) and
        cancel it if it has not ended :data:`HANG_UP_GRACE_S` later. Idempotent."""
        if not self.is_finished:
            self.is_finished = True
            self.gone.set()
            if self.task is not None and not self.task.done():
                asyncio.get_running_loop().call_later(HANG_UP_GRACE_S, _cancel_if_running, self.task)


class InProcessClient:
    """The replica client of the in-process gateway: requests go to an ASGI app in this process.

    Same interface as :class:`~mars_openhands.control.upstream.UpstreamClient` (``post``, ``get``,
    ``close``), so the proxy's hot path, polling and health checks are unchanged. Each request runs
    the app in its own task; a caller that is cancelled (the agent went away) or
    :meth:`InProcessResponse.close` before the end hangs up: the app sees ``http.disconnect``, which
    is how vLLM learns to abort the request, and is cancelled if it has not ended a second later.

    Args:
        app: the ASGI app below the middleware (the rest of vLLM's stack).
        read_timeout_s: longest silence tolerated from the app, seconds (``UpstreamTimeoutError``).
        base_scope: ``app`` and ``state`` of the server's scopes, copied into every request scope
            (vLLM's handlers read ``request.app.state``).
    """

    def __init__(self, app: Any, read_timeout_s: float, base_scope: dict[str, Any]) -> None:
        self.app = app
        self.read_timeout_s = read_timeout_s
        self.base_scope = base_scope  # filled by the middleware from the first scope it sees

    def _scope(self, method: str, url: str, headers: Mapping[str, str], body_len: int) -> dict[str, Any]:
        path = urlsplit(url).path or "/"
        raw = [(k.encode("latin-1"), v.encode("latin-1")) for k, v in headers.items()]
        if method == "POST":
            raw.append((b"content-length", str(body_len).encode()))
        scope = {"type": "http", "asgi": {"version": "3.0", "spec_version": "2.4"}, "http_version": "1.1",
                 "method": method, "scheme": "http", "path": path, "raw_path": path.encode(),
                 "query_string": b"", "root_path": "", "headers": raw, "client": ("127.0.0.1", 0),
                 "server": ("127.0.0.1", 0), "extensions": {}}
        scope.update(self.base_scope)
        if "state" in self.base_scope:
            scope["state"] = dict(self.base_scope["state"])
        return scope

    async def _start(self, method: str, url: str, content: bytes, headers: Mapping[str, str],
                     read_timeout_s: float) -> InProcessResponse:
        call = _AppCall(content, url, read_timeout_s)
        call.task = asyncio.create_task(call.run(self.app, self._scope(method, url, headers, len(content))))
        try:
            start = await call.next_message()
        except BaseException:
            call.hang_up()
            raise
        if start.get("type") != "http.response.start":
            call.hang_up()
            raise UpstreamBrokenError(f"{url} sent {start.get('type')!r} before its response start")
        content_type: str | None = None
        relayed: list[tuple[bytes, bytes]] = []
        for name, value in start.get("headers", ()):
            lower = name.lower()
            if lower == b"content-type":
                content_type = value.decode("latin-1")
            elif lower not in NOT_RELAYED_HEADERS:
                relayed.append((lower, value))
        return InProcessResponse(call, int(start["status"]), content_type, relayed)

    async def post(self, url: str, content: bytes, headers: Mapping[str, str]) -> InProcessResponse:
        """Run a POST through the app; return once it sent its response start. Raises
        UpstreamError; cancelling this call hangs up on the app."""
        return await self._start("POST", url, content, headers, self.read_timeout_s)

    async def get(self, url: str, timeout_s: float | None = None,
                  headers: Mapping[str, str] | None = None) -> tuple[int, bytes, str | None]:
        """GET a small resource through the app: (status, body, content type). Raises UpstreamError."""
        resp = await self._start("GET", url, b"", headers or {}, timeout_s or self.read_timeout_s)
        try:
            return resp.status_code, await resp.read(), resp.content_type
        finally:
            resp.close()

    async def close(self) -> None:
        """Nothing to close (no connections)."""


class MarsGatewayMiddleware:
    """ASGI middleware running the MARS gateway inside vLLM's API server (``--middleware``).

    vLLM instantiates it with the app below it; the config comes from ``MARS_GATEWAY_CONFIG`` (see
    the module docstring). The gateway starts and stops with the server's lifespan.

    Raises:
        ValueError: a bad ``MARS_GATEWAY_CONFIG``, or its ``stream_path`` exists (at construction:
            vLLM builds its middleware once its engine is up, then stops with the message).
    """

    def __init__(self, app: Any) -> None:
        from mars_openhands.control.app import Gateway

        self.app = app
        self.config = config_from_env()
        try:
            check_runtime(self.config, is_in_process=True)  # e.g. the stream file exists (one run, one stream)
        except ValueError as e:
            raise ValueError(str(e).replace("--stream-path", f"{CONFIG_ENV} stream_path")) from None
        self._base_scope: dict[str, Any] = {}
        self.gateway = Gateway(self.config, client_factory=self._client)
        self.handler = ProxyHandler(self.gateway)
        self._start: asyncio.Future[None] | None = None
        self._auth_cache: dict[bytes, bool] = {}
        self._is_admin_key_shared: bool | None = None
        """Whether vLLM's ``--api-key`` check takes the admin key (asked once, at its first use)."""

    def _client(self, config: GatewayConfig) -> InProcessClient:
        return InProcessClient(self.app, config.upstream_read_timeout_s, self._base_scope)

    def _remember(self, scope: Mapping[str, Any]) -> None:
        if not self._base_scope:
            self._base_scope.update({k: scope[k] for k in ("app", "state") if k in scope})

    async def _ensure_started(self) -> None:
        """Start the gateway once (normally at lifespan start-up; else on the first request, with
        concurrent first requests waiting for the same start)."""
        if self._start is None:
            self._start = asyncio.ensure_future(self._start_gateway())
        if not self._start.done():
            await asyncio.shield(self._start)
        elif (error := self._start.exception()) is not None:
            raise error

    async def _start_gateway(self) -> None:
        from mars_openhands.control.app import settings_line

        await self.gateway.start()
        print(f"MARS gateway in-process (vLLM --middleware; OpenAI routes and /mars/v1/* on this "
              f"server); {settings_line(self.config, is_in_process=True)}", file=sys.stderr, flush=True)

    async def _is_authorized(self, scope: Mapping[str, Any]) -> bool:
        """Whether vLLM's own API-key check (``--api-key``, ``VLLM_API_KEY``) lets this request's
        ``Authorization`` header through: asked once per distinct header value by a ``GET
        /v1/models`` through the rest of the stack (401 = refused), then remembered (vLLM's keys are
        fixed for the server's life). The gateway thereby refuses before admission and turn
        counting, and guards its ``/mars/v1/*`` paths with the same keys."""
        header = next((v for k, v in scope["headers"] if k == b"authorization"), b"")
        key = hashlib.sha256(header).digest()
        allowed = self._auth_cache.get(key)
        if allowed is None:
            client = self.gateway.client
            assert client is not None, "the gateway starts before it serves"
            headers = {"authorization": header.decode("latin-1")} if header else {}
            status, _, _ = await client.get(f"{IN_PROCESS_URL}/v1/models", 10.0, headers)
            allowed = status != 401
            if len(self._auth_cache) >= 1024:  # bounded: a client cycling through bad keys
                self._auth_cache.clear()
            self._auth_cache[key] = allowed
        return allowed

    async def _admin_key_is_shared(self, admin_header: bytes) -> bool:
        """Whether the admin key is also one of vLLM's API keys: vLLM's check takes it and refuses
        a random key (without ``--api-key`` it takes every key, and nothing is shared). Asked at
        the admin key's first use (vLLM's ``--api-key`` is known only to vLLM's own check), then
        remembered: the keys are fixed for the server's life."""
        if self._is_admin_key_shared is None:
            random_header = f"Bearer {secrets.token_urlsafe(24)}".encode()
            self._is_admin_key_shared = (
                await self._is_authorized({"headers": [(b"authorization", admin_header)]})
                and not await self._is_authorized({"headers": [(b"authorization", random_header)]}))
            if self._is_admin_key_shared:
                print(f"MARS gateway in-process: error: {_SHARED_ADMIN_KEY}; /mars/v1/state "
                      "refuses it", file=sys.stderr, flush=True)
        return self._is_admin_key_shared

    async def _may_enter(self, path: str, scope: Mapping[str, Any]) -> bool:
        """Whether a request to a gateway path passes the keys: open paths always, the admin
        paths with the admin key (unless it is also vLLM's API key: then with nothing), everything
        else with vLLM's own (:meth:`_is_authorized`). The routes then apply the admin and
        session-token rules (control/auth.py)."""
        if path in _OPEN_PATHS:
            return True
        if path in _ADMIN_PATHS:
            header = next((v for k, v in scope["headers"] if k == b"authorization"), b"")
            if self.gateway.credentials.is_admin(header.decode("latin-1")):
                return not await self._admin_key_is_shared(header)
        return await self._is_authorized(scope)

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        kind = scope["type"]
        if kind == "http":
            path = scope["path"]
            is_proxied = path in PROXY_PATHS and scope["method"] == "POST"
            if is_proxied or path.startswith("/mars/"):
                self._remember(scope)
                await self._ensure_started()
                if not await self._may_enter(path, scope):
                    self.gateway.num_unauthorized += 1
                    await _UNAUTHORIZED(scope, receive, send)
                    return
                if is_proxied:
                    await self.handler(scope, receive, send)
                else:
                    await self.gateway.fastapi_app(scope, receive, send)
                return
        elif kind == "lifespan":
            self._remember(scope)
            await self.app(scope, self._lifespan_receive(receive), send)
            return
        await self.app(scope, receive, send)

    def _lifespan_receive(self, receive: Any) -> Any:
        async def wrapped() -> Any:
            message = await receive()
            if message["type"] == "lifespan.startup":
                await self._ensure_started()
            elif message["type"] == "lifespan.shutdown" and self._start is not None:
                await self.gateway.stop()
            return message

        return wrapped


def main(argv: list[str] | None = None) -> int:
    """``python -m mars_openhands.control.inprocess``: check ``MARS_GATEWAY_CONFIG`` before starting
    vLLM (which builds its middleware only after its engine is up, about a minute on a small
    machine). Prints the settings and returns 0, or the problem and returns 2."""
    import argparse

    argparse.ArgumentParser(
        prog="python -m mars_openhands.control.inprocess",
        description=f"Check {CONFIG_ENV} (JSON of gateway settings, or @file.json) for the in-process "
                    "gateway; docs/gateway.md").parse_args(argv)
    try:
        config = config_from_env()
        check_runtime(config, is_in_process=True)
    except ValueError as e:
        print(f"{CONFIG_ENV}: {str(e).removeprefix(CONFIG_ENV + ': ')}".replace(
            "--stream-path", "stream_path"), file=sys.stderr)
        return 2
    from mars_openhands.control.app import settings_line

    print(f"{CONFIG_ENV} ok: {settings_line(config, is_in_process=True)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
