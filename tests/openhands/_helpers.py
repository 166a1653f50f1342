"""Helpers for the OpenHands adapter tests: an events collector and servers on background threads."""

from __future__ import annotations

import contextlib
import json
import os
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

from tests.proc_tree import reap_with_this_process
from tests.unit.control.gateway_helpers import wait_until as wait_for  # noqa: F401 (re-exported)

ROOT = Path(__file__).resolve().parents[2]
"""The repository root."""


async def read_asgi_body(receive: Any) -> bytes:
    """A whole ASGI request body (every ``http.request`` message's bytes, in order)."""
    chunks = []
    while True:
        message = await receive()
        chunks.append(message.get("body", b""))
        if not message.get("more_body"):
            return b"".join(chunks)


def replaying(body: bytes, receive: Any) -> Any:
    """An ASGI ``receive`` that gives the app ``body`` (already read) first, then whatever the
    client's ``receive`` gives (a disconnect)."""
    sent = False

    async def replay() -> Any:
        nonlocal sent
        if sent:
            return await receive()
        sent = True
        return {"type": "http.request", "body": body, "more_body": False}

    return replay


def turn_calling(name: str, **arguments: object) -> Any:
    """A recorded playback turn with one call of tool ``name`` (``RecordedTurn``)."""
    from mars_openhands.openhands.playback import RecordedToolCall, RecordedTurn

    return RecordedTurn(content=f"calling {name}",
                        tool_calls=(RecordedToolCall(name=name, arguments=arguments),))


def run_tasks(*args: str, db: str, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    """``mars-openhands tasks <args> --db <db>`` in a subprocess (this interpreter, ``env`` added
    to the environment), its output captured; at most 300 s."""
    return subprocess.run([sys.executable, "-m", "eval.cli", "tasks", *args, "--db", db],
                          cwd=ROOT, capture_output=True, text=True, timeout=300,
                          env={**os.environ, **env})


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class EventCollector:
    """``POST /mars/v1/events`` on a stdlib HTTP server; keeps every accepted event (parsed JSON).

    Args:
        status_code: the answer to every post.
        fail_first: answer the first this many posts with ``fail_status`` (and keep nothing).
        port: listen here (``0``: a free port).
        delay_s: wait this long before keeping a post's events and answering (a slow gateway).
    """

    def __init__(self, status_code: int = 200, fail_first: int = 0, fail_status: int = 503,
                 port: int = 0, delay_s: float = 0.0) -> None:
        self.events: list[dict[str, Any]] = []
        self.posts: list[tuple[dict[str, str], list[dict[str, Any]]]] = []
        """(lower-cased headers, events) of every post, in arrival order."""
        self.num_posts = 0
        self.status_code = status_code
        collector = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:  # noqa: N802 (http.server's name)
                body = self.rfile.read(int(self.headers.get("content-length", 0)))
                data = json.loads(body)
                time.sleep(delay_s)
                collector.num_posts += 1
                status = fail_status if collector.num_posts <= fail_first else collector.status_code
                events = data if isinstance(data, list) else data.get("events", [data])
                collector.posts.append(({k.lower(): v for k, v in self.headers.items()}, events))
                if status < 400:
                    collector.events.extend(events)
                self.send_response(status)
                self.end_headers()
                self.wfile.write(b"{}")

            def log_message(self, *args: Any) -> None:
                pass

        self._server = ThreadingHTTPServer(("127.0.0.1", port), Handler)
        self.url = f"http://127.0.0.1:{self._server.server_address[1]}/mars/v1/events"
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True)

    def __enter__(self) -> EventCollector:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._server.shutdown()
        self._server.server_close()


@contextmanager
def serve_app(app: Any) -> Iterator[str]:
    """Serve an ASGI app with uvicorn on a free port in a thread; yields ``http://127.0.0.1:port``."""
    import uvicorn

    port = free_port()
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started:
        if time.monotonic() > deadline:
            raise RuntimeError("test server did not start within 30 s")
        time.sleep(0.01)
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join(10)


TOKEN_HEADER = "x-mars-session-token"


class SessionTokenContract:
    """ASGI middleware enforcing the gateway's credential contract (issue 33 item 6) in front of
    a gateway, until the gateway does it itself; records what every call carried.

    * with ``api_key``: ``POST /v1/*`` and ``POST /mars/v1/events`` need
      ``Authorization: Bearer <api_key>`` (401 otherwise);
    * a session is bound to the first ``X-Mars-Session-Token`` seen for it; a later LLM call or
      event post of it with another token or none is refused (403); a ``session_end`` accepted
      ends the binding (the gateway forgets the session);
    * an event post holds the events of one session (400 otherwise).

    A refused call changes nothing (it never reaches the gateway).

    Attributes:
        calls: ``{"kind": "llm"|"events", "session_id", "token", "authorization", "status"}``
            per call, in arrival order (``status`` 0: passed to the gateway).
    """

    def __init__(self, app: Any, api_key: str | None = None) -> None:
        self.app = app
        self.api_key = api_key
        self.bound: dict[str, str] = {}
        self.calls: list[dict[str, Any]] = []

    def refused(self) -> list[dict[str, Any]]:
        """The calls refused so far."""
        return [c for c in self.calls if c["status"]]

    def tokens_of(self, session_id: str, kind: str | None = None) -> list[str | None]:
        """The token every call of ``session_id`` carried (of ``kind``), in order."""
        return [c["token"] for c in self.calls if c["session_id"] == session_id
                and (kind is None or c["kind"] == kind)]

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        path = scope.get("path", "")
        kind = ("events" if path == "/mars/v1/events" else "llm" if path.startswith("/v1/")
                else None)
        if scope["type"] != "http" or scope.get("method") != "POST" or kind is None:
            await self.app(scope, receive, send)
            return
        body = await read_asgi_body(receive)
        headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope["headers"]}
        status, session_id, ends = self._check(kind, headers, body)
        self.calls.append({"kind": kind, "session_id": session_id, "status": status,
                           "token": headers.get(TOKEN_HEADER),
                           "authorization": headers.get("authorization")})
        if status:
            payload = json.dumps({"error": {"message": f"contract: refused ({status})"}}).encode()
            await send({"type": "http.response.start", "status": status,
                        "headers": [(b"content-type", b"application/json")]})
            await send({"type": "http.response.body", "body": payload})
            return
        if ends:
            self.bound.pop(session_id, None)
        await self.app(scope, replaying(body, receive), send)

    def _check(self, kind: str, headers: dict[str, str], body: bytes) -> tuple[int, Any, bool]:
        """``(status, session_id, has_session_end)``; status 0 passes the call on."""
        from mars_openhands.control.metadata import extract_session_id

        if self.api_key is not None and headers.get("authorization") != f"Bearer {self.api_key}":
            return 401, None, False
        try:
            data = json.loads(body or b"null")
        except ValueError:
            return 0, None, False  # the gateway answers malformed bodies itself
        if kind == "events":
            events = data if isinstance(data, list) else []
            sessions = {e.get("session_id") for e in events if isinstance(e, dict)}
            if len(sessions) != 1:
                return (400 if len(sessions) > 1 else 0), None, False
            session_id = sessions.pop()
            ends = any(e.get("kind") == "session_end" for e in events)
        else:
            try:
                session_id, _ = extract_session_id(headers, data if isinstance(data, dict) else {})
            except Exception:
                return 0, None, False
            ends = False
        if session_id is None:
            return 0, None, False
        token = headers.get(TOKEN_HEADER)
        bound = self.bound.get(session_id)
        if bound is not None and token != bound:
            return 403, session_id, False
        if bound is None and token:
            self.bound[session_id] = token
        return 0, session_id, ends


class ToolEndDropper:
    """ASGI middleware: takes every ``tool_end`` whose ``tool_call_id`` starts with
    :attr:`call_id_prefix` and that was stamped before :attr:`until_mono_ns` out of
    ``POST /mars/v1/events`` bodies and passes the rest on (an empty post is answered
    ``{"accepted": 0}``): a ``tool_end`` lost on its way, as when its runner is killed before the
    post. The sender is answered 200, so it neither retries nor counts the event lost. By stamp,
    not by arrival: a killed runner's post that arrives late is dropped all the same.

    Attributes:
        until_mono_ns: ``time.monotonic_ns()`` (one clock for the machine's processes) from
            which on nothing is dropped; ``None``: drop them all.
        dropped: the ``tool_call_id`` of every ``tool_end`` taken out, in order.
    """

    def __init__(self, call_id_prefix: str) -> None:
        self.call_id_prefix = call_id_prefix
        self.until_mono_ns: int | None = None
        self.dropped: list[str] = []
        self.app: Any = None

    def wrap(self, app: Any) -> ToolEndDropper:
        """Put this in front of ``app``. Mutates self; returns it."""
        self.app = app
        return self

    def _drops(self, event: Any) -> bool:
        return (isinstance(event, dict) and event.get("kind") == "tool_end"
                and str(event.get("tool_call_id", "")).startswith(self.call_id_prefix)
                and (self.until_mono_ns is None or event.get("t_mono_ns", 0) < self.until_mono_ns))

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] != "http" or scope.get("path") != "/mars/v1/events":
            await self.app(scope, receive, send)
            return
        chunks = []
        while True:
            message = await receive()
            chunks.append(message.get("body", b""))
            if not message.get("more_body"):
                break
        events = json.loads(b"".join(chunks))
        kept = [e for e in events if not self._drops(e)]
        self.dropped += [e["tool_call_id"] for e in events if self._drops(e)]
        if not kept:
            await send({"type": "http.response.start", "status": 200,
                        "headers": [(b"content-type", b"application/json")]})
            await send({"type": "http.response.body", "body": b'{"accepted": 0}'})
            return
        body = json.dumps(kept).encode()
        headers = [(k, v) for k, v in scope["headers"] if k.lower() != b"content-length"]
        scope = {**scope, "headers": [*headers, (b"content-length", str(len(body)).encode())]}

        await self.app(scope, replaying(body, receive), send)


class TurnHold:
    """ASGI middleware: holds the agent turns (``POST /v1/*`` with ``tools``) of ``session_id``
    after its first ``num_free`` until ``is_released()`` (polled every 50 ms), at most
    ``timeout_s``. A turn released while held is answered 503 and goes no further (it was held
    across its runner's kill: nobody waits for it); one held past ``timeout_s`` is passed on, so
    the test fails on its own assertions, never hangs. Turns arriving once released pass.

    Attributes:
        num_held: turns held so far.
    """

    def __init__(self, session_id: str, num_free: int, is_released: Any,
                 timeout_s: float = 120.0, is_answered_on_release: bool = False) -> None:
        self.session_id = session_id
        self.num_free = num_free
        self.is_released = is_released
        self.timeout_s = timeout_s
        self.is_answered_on_release = is_answered_on_release
        """A turn released while held goes on to the engine (its client still waits) instead of
        the 503."""
        self.num_held = 0
        self.num_seen = 0
        """Agent turns of the session seen while not released."""
        self.app: Any = None

    def wrap(self, app: Any) -> TurnHold:
        """Put this in front of ``app``. Mutates self; returns it."""
        self.app = app
        return self

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if (scope["type"] != "http" or not scope.get("path", "").startswith("/v1/")
                or self.is_released()):
            await self.app(scope, receive, send)
            return
        from mars_openhands.control.metadata import extract_session_id

        body = await read_asgi_body(receive)
        data = json.loads(body or b"{}")
        headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope["headers"]}
        if extract_session_id(headers, data)[0] == self.session_id and data.get("tools"):
            self.num_seen += 1
            if (self.num_seen > self.num_free and await self._held()
                    and not self.is_answered_on_release):
                await send({"type": "http.response.start", "status": 503,
                            "headers": [(b"content-type", b"application/json")]})
                await send({"type": "http.response.body", "body": b'{"error": "held"}'})
                return
        await self.app(scope, replaying(body, receive), send)

    async def _held(self) -> bool:
        """Wait until released (True) or ``timeout_s`` passed (False)."""
        import asyncio

        self.num_held += 1
        deadline = time.monotonic() + self.timeout_s
        while time.monotonic() < deadline:
            if self.is_released():
                return True
            await asyncio.sleep(0.05)
        return False


@contextmanager
def playback_behind_gateway(scripts: Any, api_key: str | None = None,
                            middleware: Any = None, **gateway: Any) -> Iterator[tuple[Any, Any]]:
    """The playback engine (a thread) behind a real MARS gateway (a thread) recording its stream
    into a ``ListSink``, with the credential contract (:class:`SessionTokenContract`, as
    ``gateway_server.contract``; ``api_key`` required when given) in front of the gateway, and
    ``middleware(app)`` in front of that when given (e.g. :meth:`ToolEndDropper.wrap`);
    yields ``(gateway_server, sink)``."""
    from mars_openhands.control.config import GatewayConfig, ReplicaConfig
    from mars_openhands.control.server import GatewayServer
    from mars_openhands.openhands.playback import build_playback_app
    from mars_openhands.stream.transport import ListSink

    sink = ListSink()
    with serve_app(build_playback_app(scripts)) as playback_url:
        config = GatewayConfig(replicas=[ReplicaConfig(url=playback_url)], port=0,
                               poll_interval_s=0.2, **gateway)
        server = GatewayServer(config, sink)
        server.contract = SessionTokenContract(server.gateway.app, api_key)
        # uvicorn loads it at start
        server._server.config.app = (server.contract if middleware is None
                                     else middleware(server.contract))
        with server:
            yield server, sink


@contextmanager
def serve_process(argv: list[str], url: str, log_path: Any, env: dict[str, str], cwd: Any,
                  ready_path: str = "/alive", timeout_s: float = 120.0) -> Iterator[Any]:
    """Run ``argv`` (a server) until ``url + ready_path`` answers 200; yields the process, then
    terminates it (killed after 10 s).

    Raises:
        RuntimeError: it exited or did not answer within ``timeout_s`` (with its log's tail).
    """
    import subprocess

    import httpx

    with open(log_path, "wb") as log:
        proc = subprocess.Popen(argv, env=env, cwd=cwd, stdout=log, stderr=subprocess.STDOUT,
                                start_new_session=True)
    reap_with_this_process(proc.pid)  # a killed pytest leaves no server (and no sandbox of it)
    try:
        deadline = time.monotonic() + timeout_s
        while True:
            if proc.poll() is not None or time.monotonic() > deadline:
                tail = open(log_path, errors="replace").read()[-3000:]
                raise RuntimeError(f"{argv[:4]} exited ({proc.returncode}) or timed out:\n{tail}")
            try:
                if httpx.get(url + ready_path, timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            time.sleep(0.25)
        yield proc
    finally:  # the whole process group: the app's sandboxes are its children
        import os
        import signal

        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(5)
        with contextlib.suppress(ProcessLookupError):  # children that outlived the leader
            os.killpg(proc.pid, signal.SIGKILL)


def session_events(sink: Any, session_id: str) -> list[Any]:
    """The CPU-plane events of one session in a gateway's recorded stream, in order."""
    cpu = ("session_start", "session_end", "tool_enqueued", "tool_start", "tool_end")
    return [e for e in list(sink.events) if e.kind in cpu and e.session_id == session_id]


def assert_app_conversation(sink: Any, session_id: str, requests: dict[str, Any],
                            state: dict[str, Any]) -> list[dict[str, Any]]:
    """The OpenHands app's two-terminal-call conversation as the gateway and the playback engine
    saw it: session_start ... session_end (ok), two terminal calls (turns 0 and 1) with their
    queue and start events, agent turns numbered 0, 1, 2 (not one ahead of the agent) with the
    previous tool on turn 1, the title as a side request, the slot released at the end (not at
    the timeout). ``requests``: the playback engine's ``/playback/requests``; ``state``: the
    gateway's state. Returns the session's requests to the engine.

    Raises:
        AssertionError: any of it differs.
    """
    events = session_events(sink, session_id)
    kinds = [e.kind for e in events]
    assert kinds[0] == "session_start" and kinds[-1] == "session_end", kinds
    assert events[-1].status == "ok"
    ends = [e for e in events if e.kind == "tool_end"]
    assert [(e.tool_name, e.status, e.turn) for e in ends] == [("terminal", "ok", 0),
                                                               ("terminal", "ok", 1)]
    assert kinds.count("tool_start") == 2 and kinds.count("tool_enqueued") == 2
    ours = [r for r in requests["requests"] if r["session_id"] == session_id]
    agent = [r["vllm_xargs"] for r in ours if not r["is_side"]]
    assert [x["mars_turn"] for x in agent] == [0, 1, 2]  # not one ahead of the agent
    assert agent[1]["mars_prev_tool"] == "terminal"
    side = [r["vllm_xargs"] for r in ours if r["is_side"]]
    assert side and all(x == {"mars_side": 1} for x in side)  # the title request
    assert session_id not in state["sessions"]  # the slot was released at the end, not at the timeout
    return ours


def start_app_conversation(client: Any, text: str, timeout_s: float = 300.0) -> str:
    """Start one conversation over the OpenHands app's REST API (``client``: an ``httpx.Client``
    on the app); returns its id once the app says it is ready.

    Raises:
        AssertionError: the app refused it or its start task ended in ``ERROR`` (its detail).
    """
    task = client.post("/api/v1/app-conversations", json={
        "initial_message": {"content": [{"type": "text", "text": text}]}})
    assert task.status_code == 200, task.text

    def ready() -> dict | None:
        found = client.get("/api/v1/app-conversations/start-tasks",
                           params={"ids": task.json()["id"]}).json()
        current = found[0] if isinstance(found, list) else found
        assert current.get("status") != "ERROR", current.get("detail")
        return current if current.get("status") == "READY" else None

    return str(wait_for(ready, timeout_s, "the app's conversation start task")["app_conversation_id"])
