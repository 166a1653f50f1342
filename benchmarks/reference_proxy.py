"""The floor for :mod:`bench_gateway`: a proxy with no logic on the gateway's own stack.

Raw ASGI on uvicorn (uvloop, httptools) forwarding the body to one upstream with one pooled aiohttp
session, answering with the whole upstream body (or relaying a stream chunk by chunk): what any
Python HTTP hop costs on this machine, with no session registry, admission, routing or metadata.
The benchmark measures it side by side with the direct path and the MARS gateway, so "added by the
gateway" splits into the hop and the gateway's own work.

Run: ``UPSTREAM_URL=http://127.0.0.1:8000 python -m uvicorn reference_proxy:app --loop uvloop
--http httptools --port 9000`` (from ``benchmarks/``).
"""

from __future__ import annotations

import os
from typing import Any

import aiohttp


class ReferenceProxy:
    """ASGI app: ``POST <path>`` → ``POST $UPSTREAM_URL<path>``; ``GET /healthz`` → 200."""

    def __init__(self, upstream_url: str) -> None:
        self.upstream_url = upstream_url.rstrip("/")
        self.session: aiohttp.ClientSession | None = None

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] == "lifespan":
            await self._lifespan(receive, send)
            return
        if scope["path"] == "/healthz":
            await send({"type": "http.response.start", "status": 200, "headers": []})
            await send({"type": "http.response.body", "body": b"ok"})
            return
        message = await receive()
        body = message.get("body", b"")
        while message.get("more_body", False):
            message = await receive()
            body += message.get("body", b"")
        assert self.session is not None
        async with self.session.post(self.upstream_url + scope["path"], data=body,
                                     headers={"content-type": "application/json"}) as resp:
            content_type = resp.headers.get("content-type", "application/json")
            headers = [(b"content-type", content_type.encode("latin-1"))]
            if not content_type.startswith("text/event-stream"):  # whole, like the gateway
                data = await resp.read()
                headers.append((b"content-length", str(len(data)).encode()))
                await send({"type": "http.response.start", "status": resp.status,
                            "headers": headers})
                await send({"type": "http.response.body", "body": data})
                return
            await send({"type": "http.response.start", "status": resp.status, "headers": headers})
            async for chunk in resp.content.iter_any():
                await send({"type": "http.response.body", "body": chunk, "more_body": True})
        await send({"type": "http.response.body", "body": b"", "more_body": False})

    async def _lifespan(self, receive: Any, send: Any) -> None:
        while True:
            message = await receive()
            if message["type"] == "lifespan.startup":
                self.session = aiohttp.ClientSession(
                    connector=aiohttp.TCPConnector(limit=0), auto_decompress=False,
                    skip_auto_headers=("Accept-Encoding", "User-Agent"))
                await send({"type": "lifespan.startup.complete"})
            elif message["type"] == "lifespan.shutdown":
                if self.session is not None:
                    await self.session.close()
                await send({"type": "lifespan.shutdown.complete"})
                return


app = ReferenceProxy(os.environ.get("UPSTREAM_URL", "http://127.0.0.1:8000"))
