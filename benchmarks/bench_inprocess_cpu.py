"""CPU time the in-process gateway adds per request, without sockets (control/inprocess.py).

Calls the ASGI app directly in one event loop: the fake engine app (control/fake_engine.py,
answering at once) wrapped in ``MarsGatewayMiddleware``, once on the gateway's path
(``/v1/chat/completions``: session, admission, metadata, in-process call) and once on
``/raw/v1/chat/completions`` (the same handler, passed through untouched). Requests run back to back
in blocks of ``--requests``, the two paths alternating, ``--repeats`` times; the report is the
per-request time of each path and their difference, the gateway's own CPU cost per request (the
loop never waits on I/O, so wall time is CPU time).

Usage::

    .venv/bin/python benchmarks/bench_inprocess_cpu.py            # whole and streamed responses
    .venv/bin/python benchmarks/bench_inprocess_cpu.py --requests 200 --repeats 2   # quick
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

PATHS = {"direct": "/raw/v1/chat/completions", "in-process gateway": "/v1/chat/completions"}


async def _call(app: Any, path: str, body: bytes, session: str) -> list[dict[str, Any]]:
    """One request through ``app``; returns the messages it sent."""
    sent = False

    async def receive() -> dict[str, Any]:
        nonlocal sent
        if not sent:
            sent = True
            return {"type": "http.request", "body": body, "more_body": False}
        await asyncio.Event().wait()  # never disconnects
        raise AssertionError("unreachable")

    out: list[dict[str, Any]] = []

    async def send(message: dict[str, Any]) -> None:
        out.append(message)

    scope = {"type": "http", "asgi": {"version": "3.0", "spec_version": "2.4"}, "http_version": "1.1",
             "method": "POST", "scheme": "http", "path": path, "raw_path": path.encode(),
             "query_string": b"", "root_path": "", "client": ("127.0.0.1", 1), "server": ("127.0.0.1", 2),
             "headers": [(b"content-type", b"application/json"), (b"x-mars-session", session.encode()),
                         (b"content-length", str(len(body)).encode())], "state": {}}
    await app(scope, receive, send)
    return out


async def _measure(stream: bool, requests: int, repeats: int) -> dict[str, list[float]]:
    from mars_openhands.control.fake_engine import build_fake_engine_app
    from mars_openhands.control.inprocess import CONFIG_ENV, MarsGatewayMiddleware

    os.environ[CONFIG_ENV] = json.dumps({"num_tool_workers": 64, "poll_interval_s": 3600,
                                         "admission": {"window_max": 128, "window_init": 128}})
    middleware = MarsGatewayMiddleware(build_fake_engine_app())
    await middleware._ensure_started()
    body = json.dumps({"model": "fake", "stream": stream,
                       "messages": [{"role": "user", "content": "hello " * 50}]}).encode()
    try:
        for path in PATHS.values():  # warm-up
            for i in range(100):
                await _call(middleware, path, body, f"w{i % 16}")
        per_request_us: dict[str, list[float]] = {name: [] for name in PATHS}
        for _ in range(repeats):
            for name, path in PATHS.items():
                t0 = time.perf_counter()
                for i in range(requests):
                    messages = await _call(middleware, path, body, f"s{i % 16}")
                    if messages[0].get("status") != 200:
                        raise RuntimeError(f"{path} answered {messages[0]}")
                per_request_us[name].append((time.perf_counter() - t0) / requests * 1e6)
        return per_request_us
    finally:
        await middleware.gateway.stop()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=2000, help="requests per block (default 2000)")
    parser.add_argument("--repeats", type=int, default=5, help="blocks per path (default 5)")
    args = parser.parse_args()
    import uvloop

    for stream in (False, True):
        result = uvloop.run(_measure(stream, args.requests, args.repeats))
        medians = {name: statistics.median(v) for name, v in result.items()}
        spread = "  ".join(f"{name} {min(v):.0f}-{max(v):.0f}" for name, v in result.items())
        print(f"{'stream' if stream else 'whole '}: direct {medians['direct']:.0f} us/request, "
              f"in-process gateway {medians['in-process gateway']:.0f} us/request, added "
              f"{medians['in-process gateway'] - medians['direct']:+.0f} us (median of {args.repeats} "
              f"blocks of {args.requests}; range {spread})", flush=True)


if __name__ == "__main__":
    main()
