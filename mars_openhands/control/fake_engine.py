"""A fake vLLM OpenAI server: the gateway's failure tests and its benchmark's noise-free baseline.

It answers ``/v1/chat/completions`` and ``/v1/completions`` (whole or SSE-streamed), ``/v1/models``,
``/health`` and ``/metrics`` (``vllm:kv_cache_usage_perc``, ``vllm:cache_config_info``,
``process_start_time_seconds``) like vLLM 0.32, records what it received (``session_id``,
``vllm_xargs``) and, like vLLM's ``with_cancellation``, aborts a request whose client disconnects
(counted in ``num_aborted``). Behaviour is set at run time with ``POST /fake/config`` (``api_key``:
``/v1/*`` need ``Authorization: Bearer <key>``, as vLLM's ``--api-key``); what it saw is read with
``GET /fake/requests`` (with each request's ``authorization`` header). :class:`FakeEngineProcess` runs it in a subprocess so that tests can
SIGKILL it like a crashed replica.

Never used in production; it imports nothing from vLLM.
"""

from __future__ import annotations

import argparse
import asyncio
import importlib
import json
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import AsyncIterator
from types import TracebackType
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from mars_openhands.cli_signals import end_with_parent

__all__ = ["FakeEngineProcess", "build_fake_engine_app", "main"]


def build_fake_engine_app(name: str = "fake") -> FastAPI:
    """The fake engine's FastAPI app (state lives in the app, none at module level)."""
    app = FastAPI(docs_url=None, redoc_url=None, openapi_url=None)
    cfg: dict[str, Any] = {"kv_usage": 0.0, "delay_s": 0.0, "num_chunks": 3, "chunk_delay_s": 0.0,
                           "num_gpu_blocks": 1000, "block_size": 16, "fail_status": 0,
                           "api_key": None, "done_linger_s": 0.0}
    seen: dict[str, Any] = {"requests": [], "num_aborted": 0, "num_active": 0}
    started_s = time.time()

    def completion(body: dict[str, Any], chat: bool) -> dict[str, Any]:
        text = "ok"
        choice = ({"index": 0, "message": {"role": "assistant", "content": text},
                   "finish_reason": "stop"} if chat else
                  {"index": 0, "text": text, "finish_reason": "stop"})
        return {"id": "cmpl-fake", "object": "chat.completion" if chat else "text_completion",
                "model": body.get("model", name), "choices": [choice],
                "usage": {"prompt_tokens": 1, "completion_tokens": 1, "total_tokens": 2}}

    async def until_disconnect(request: Request) -> None:
        while (await request.receive())["type"] != "http.disconnect":
            pass

    def is_refused(request: Request) -> bool:
        """vLLM's ``--api-key`` check (``AuthenticationMiddleware``), when ``api_key`` is set."""
        return cfg["api_key"] is not None and (
            request.headers.get("authorization") != f"Bearer {cfg['api_key']}")

    async def handle(request: Request, chat: bool) -> Response:
        if is_refused(request):
            return JSONResponse({"error": "Unauthorized"}, 401)
        body = json.loads(await request.body())
        seen["requests"].append({"session_id": body.get("session_id"),
                                 "vllm_xargs": body.get("vllm_xargs"),
                                 "stream": bool(body.get("stream")), "body": body,
                                 "authorization": request.headers.get("authorization")})
        if cfg["fail_status"]:  # e.g. 400 as vLLM answers an unknown model or too many tokens
            return JSONResponse({"error": {"message": "fake refusal", "code": cfg["fail_status"]}},
                                cfg["fail_status"])
        # Like vLLM with --enable-request-id-headers: the request id comes back as a header.
        echo = {"x-request-id": rid} if (rid := request.headers.get("x-request-id")) else None
        seen["num_active"] += 1
        if body.get("stream"):
            return StreamingResponse(stream(request, body, chat), media_type="text/event-stream",
                                     headers=echo)
        try:
            if cfg["delay_s"] > 0:
                waiter = asyncio.ensure_future(until_disconnect(request))
                done, _ = await asyncio.wait({waiter}, timeout=cfg["delay_s"])
                if done:
                    seen["num_aborted"] += 1
                    return Response(status_code=499)
                waiter.cancel()
            return JSONResponse(completion(body, chat), headers=echo)
        finally:
            seen["num_active"] -= 1

    async def stream(request: Request, body: dict[str, Any], chat: bool) -> AsyncIterator[bytes]:
        # Chunks are due at fixed times from the request's arrival (delay + i x chunk delay), as
        # tokens from an engine that decodes independently of the API server: the cost of
        # writing a chunk does not push the next one back (with sleep-after-write pacing it did,
        # and a path that writes elsewhere, e.g. a relay, looked faster than direct).
        # (time.monotonic(), not loop.time(): uvloop caches the latter per loop iteration.)
        finished = False
        due_s = time.monotonic() + cfg["delay_s"]
        try:
            if cfg["delay_s"] > 0:
                await asyncio.sleep(cfg["delay_s"])
            for i in range(cfg["num_chunks"]):
                delta = ({"choices": [{"index": 0, "delta": {"content": f"t{i}"}}]} if chat else
                         {"choices": [{"index": 0, "text": f"t{i}"}]})
                yield f"data: {json.dumps(delta)}\n\n".encode()
                if cfg["chunk_delay_s"] > 0:
                    due_s += cfg["chunk_delay_s"]
                    await asyncio.sleep(max(0.0, due_s - time.monotonic()))
            yield b"data: [DONE]\n\n"
            finished = True
            if cfg["done_linger_s"] > 0:  # an engine slow to close the stream after its last event
                await asyncio.sleep(cfg["done_linger_s"])
        finally:
            seen["num_active"] -= 1
            if not finished:
                seen["num_aborted"] += 1

    # /raw/...: the same handlers under a path a gateway middleware does not intercept, so a
    # benchmark can reach the engine directly in the very process that runs the in-process gateway.
    @app.post("/v1/chat/completions")
    @app.post("/raw/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        return await handle(request, True)

    @app.post("/v1/completions")
    @app.post("/raw/v1/completions")
    async def completions(request: Request) -> Response:
        return await handle(request, False)

    @app.get("/v1/models")
    async def models(request: Request) -> Any:
        if is_refused(request):
            return JSONResponse({"error": "Unauthorized"}, 401)
        return {"object": "list", "data": [{"id": name, "object": "model"}]}

    @app.get("/health")
    async def health() -> Response:
        return Response(status_code=200)

    @app.get("/metrics")
    async def metrics() -> Response:
        text = (
            f'vllm:kv_cache_usage_perc{{engine="0",model_name="{name}"}} {cfg["kv_usage"]}\n'
            f'vllm:num_requests_running{{engine="0"}} {seen["num_active"]}\n'
            f'vllm:num_requests_waiting{{engine="0"}} 0\n'
            f'vllm:cache_config_info{{block_size="{cfg["block_size"]}",'
            f'num_gpu_blocks="{cfg["num_gpu_blocks"]}"}} 1.0\n'
            f"process_start_time_seconds {started_s}\n"
        )
        return Response(text, media_type="text/plain")

    @app.post("/fake/config")
    async def set_config(request: Request) -> dict[str, Any]:
        update = json.loads(await request.body())
        unknown = set(update) - set(cfg)
        if unknown:
            return JSONResponse({"error": f"unknown fake config keys {sorted(unknown)}"}, 400)
        cfg.update(update)
        return cfg

    @app.get("/fake/requests")
    async def requests() -> dict[str, Any]:
        return {"requests": seen["requests"], "num_aborted": seen["num_aborted"],
                "num_active": seen["num_active"]}

    return app


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class FakeEngineProcess:
    """The fake engine in a subprocess on ``127.0.0.1:<port>``; :meth:`kill` is a SIGKILL.

    Args:
        port: fixed port (so a restart reuses it); default a free one.
        name: served model name.
        startup_timeout_s: wait for ``/health``.
        middleware: dotted ASGI middleware classes added like vLLM's ``--middleware`` does (e.g.
            the in-process gateway, :class:`~mars_openhands.control.inprocess.MarsGatewayMiddleware`).
        env: extra environment of the process (e.g. ``MARS_GATEWAY_CONFIG``).
    """

    def __init__(self, port: int | None = None, name: str = "fake", startup_timeout_s: float = 30.0,
                 middleware: tuple[str, ...] = (), env: dict[str, str] | None = None):
        self.port = port or _free_port()
        self.name = name
        self.startup_timeout_s = startup_timeout_s
        self.middleware = middleware
        self.env = env
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        """``http://127.0.0.1:<port>``."""
        return f"http://127.0.0.1:{self.port}"

    def start(self) -> FakeEngineProcess:
        """Start the subprocess and wait until ``/health`` answers.

        Raises:
            RuntimeError: it exited or did not answer within ``startup_timeout_s``.
        """
        import httpx

        command = [sys.executable, "-m", "mars_openhands.control.fake_engine", "--port", str(self.port),
                   "--name", self.name, "--exit-with-parent", str(os.getpid())]
        for dotted in self.middleware:
            command += ["--middleware", dotted]
        self.proc = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                                     env={**os.environ, **(self.env or {})})
        deadline = time.monotonic() + self.startup_timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"fake engine exited with {self.proc.returncode} on {self.url}")
            try:
                if httpx.get(f"{self.url}/health", timeout=1.0).status_code == 200:
                    return self
            except httpx.HTTPError:
                time.sleep(0.05)
        self.kill()
        raise RuntimeError(f"fake engine did not answer on {self.url} in {self.startup_timeout_s} s")

    def configure(self, **values: Any) -> dict[str, Any]:
        """``POST /fake/config`` (kv_usage, delay_s, num_chunks, chunk_delay_s, done_linger_s, ...)."""
        import httpx

        resp = httpx.post(f"{self.url}/fake/config", json=values, timeout=5.0)
        resp.raise_for_status()
        return resp.json()

    def seen(self) -> dict[str, Any]:
        """``GET /fake/requests``: received requests, ``num_aborted``, ``num_active``."""
        import httpx

        return httpx.get(f"{self.url}/fake/requests", timeout=5.0).json()

    def kill(self) -> None:
        """SIGKILL the process (a crashed replica) and reap it. Idempotent."""
        if self.proc is not None and self.proc.poll() is None:
            os.kill(self.proc.pid, signal.SIGKILL)
        if self.proc is not None:
            self.proc.wait(timeout=10)

    def __enter__(self) -> FakeEngineProcess:
        return self.start()

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.kill()


def main(argv: list[str] | None = None) -> None:
    """``python -m mars_openhands.control.fake_engine --port N``."""
    import uvicorn

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--name", default="fake")
    parser.add_argument("--middleware", action="append", default=[],
                        help="dotted ASGI middleware class, added like vLLM's --middleware (repeatable)")
    parser.add_argument("--exit-with-parent", type=int, default=None, metavar="PID",
                        help="exit once the process PID (the one that started it) is gone, even "
                             "if it was SIGKILLed: a killed test leaves no fake engine behind")
    args = parser.parse_args(argv)
    if args.exit_with_parent is not None:
        end_with_parent(args.exit_with_parent)
    app = build_fake_engine_app(args.name)
    for dotted in args.middleware:
        module, _, name = dotted.rpartition(".")
        app.add_middleware(getattr(importlib.import_module(module), name))
    uvicorn.run(app, host="127.0.0.1", port=args.port, log_level="warning", access_log=False)


if __name__ == "__main__":
    main()
