"""The replica HTTP client's failure mapping and its one retry (control/upstream.py)."""

from __future__ import annotations

import asyncio

import pytest

from mars_openhands.control.upstream import (
    UpstreamBrokenError,
    UpstreamClient,
    UpstreamUnreachableError,
)

OK = b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: 2\r\n\r\n{}"


async def serve(behaviours: list[str]) -> tuple[asyncio.AbstractServer, int, list[str]]:
    """A raw HTTP server: each connection follows the next behaviour ('close' or 'ok')."""
    seen: list[str] = []

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        behaviour = behaviours.pop(0) if behaviours else "ok"
        seen.append(behaviour)
        await reader.readuntil(b"\r\n\r\n")
        if behaviour == "ok":
            writer.write(OK)
            await writer.drain()
        writer.close()

    server = await asyncio.start_server(handle, "127.0.0.1", 0)
    return server, server.sockets[0].getsockname()[1], seen


def test_connection_closed_before_response_is_retried_once() -> None:
    async def scenario() -> None:
        server, port, seen = await serve(["close", "ok"])
        client = UpstreamClient(1.0, 5.0)
        try:
            resp = await client.post(f"http://127.0.0.1:{port}/x", b"{}", {})
            assert resp.status_code == 200 and await resp.read() == b"{}"
            assert seen == ["close", "ok"]
        finally:
            await client.close()
            server.close()

    asyncio.run(scenario())


def test_two_closes_are_a_broken_upstream() -> None:
    async def scenario() -> None:
        server, port, _ = await serve(["close", "close"])
        client = UpstreamClient(1.0, 5.0)
        try:
            with pytest.raises(UpstreamBrokenError):
                await client.post(f"http://127.0.0.1:{port}/x", b"{}", {})
        finally:
            await client.close()
            server.close()

    asyncio.run(scenario())


def test_refused_is_unreachable() -> None:
    async def scenario() -> None:
        server, port, _ = await serve([])
        server.close()
        await server.wait_closed()
        client = UpstreamClient(1.0, 5.0)
        try:
            with pytest.raises(UpstreamUnreachableError):
                await client.post(f"http://127.0.0.1:{port}/x", b"{}", {})
        finally:
            await client.close()

    asyncio.run(scenario())
