"""The replica HTTP client (control/upstream.py): failure mapping, its one retry, timeouts,
keep-alive reuse, aborts on cancel, and TLS for https:// URLs."""

from __future__ import annotations

import asyncio

import pytest

from mars_openhands.control.upstream import (
    UpstreamBrokenError,
    UpstreamClient,
    UpstreamError,
    UpstreamTimeoutError,
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
            with pytest.raises(UpstreamUnreachableError, match=f"127.0.0.1:{port}"):
                await client.post(f"http://127.0.0.1:{port}/x", b"{}", {})
        finally:
            await client.close()

    asyncio.run(scenario())


def test_silence_is_a_timeout_and_chunked_streams_are_decoded() -> None:
    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        while True:  # keep-alive: serve requests on this connection until /stall
            request = await reader.readuntil(b"\r\n\r\n")
            await reader.readexactly(2)  # the b"{}" body
            writer.write(b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\n"
                         b"transfer-encoding: chunked\r\n\r\n5\r\nhello\r\n")
            await writer.drain()
            if b"/stall" in request:
                await asyncio.sleep(2.0)
                break
            await asyncio.sleep(0.05)
            writer.write(b"6\r\n world\r\n0\r\n\r\n")
            await writer.drain()
        writer.close()

    async def scenario() -> None:
        server = await asyncio.start_server(handle, "127.0.0.1", 0)
        port = server.sockets[0].getsockname()[1]
        client = UpstreamClient(1.0, 0.3)
        try:
            resp = await client.post(f"http://127.0.0.1:{port}/ok", b"{}", {})
            assert resp.content_type == "text/event-stream"
            assert b"".join([c async for c in resp.iter_chunks()]) == b"hello world"
            resp = await client.post(f"http://127.0.0.1:{port}/stall", b"{}", {})
            chunks = resp.iter_chunks()
            assert await chunks.__anext__() == b"hello"
            loop = asyncio.get_running_loop()
            t0 = loop.time()
            with pytest.raises(UpstreamTimeoutError):
                await chunks.__anext__()
            assert 0.2 <= loop.time() - t0 < 1.5
            resp.close()
        finally:
            await client.close()
            server.close()

    asyncio.run(scenario())


async def read_request(reader: asyncio.StreamReader) -> bytes:
    """One request's head and its ``content-length`` body (raises IncompleteReadError at EOF)."""
    head = await reader.readuntil(b"\r\n\r\n")
    length = next((int(line.split(b":")[1]) for line in head.split(b"\r\n")
                   if line.lower().startswith(b"content-length:")), 0)
    await reader.readexactly(length)
    return head


def test_keep_alive_reuses_one_connection() -> None:
    connections: list[int] = []

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        connections.append(0)
        try:
            while True:
                await read_request(reader)
                connections[-1] += 1
                writer.write(OK)
                await writer.drain()
        except asyncio.IncompleteReadError:
            writer.close()

    async def scenario() -> None:
        server = await asyncio.start_server(handle, "127.0.0.1", 0)
        port = server.sockets[0].getsockname()[1]
        client = UpstreamClient(1.0, 5.0)
        try:
            for _ in range(3):
                resp = await client.post(f"http://127.0.0.1:{port}/x", b"{}", {})
                assert await resp.read() == b"{}"
                resp.close()  # after a full read: back to the pool, not closed
            status, body, content_type = await client.get(f"http://127.0.0.1:{port}/m", 1.0)
            assert (status, body, content_type) == (200, b"{}", "application/json")
            assert connections == [4]
        finally:
            await client.close()
            server.close()

    asyncio.run(scenario())


def test_silence_before_the_headers_is_a_timeout() -> None:
    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await read_request(reader)
        await asyncio.sleep(2.0)
        writer.close()

    async def scenario() -> None:
        server = await asyncio.start_server(handle, "127.0.0.1", 0)
        port = server.sockets[0].getsockname()[1]
        client = UpstreamClient(1.0, 0.3)
        loop = asyncio.get_running_loop()
        try:
            t0 = loop.time()
            with pytest.raises(UpstreamTimeoutError):
                await client.post(f"http://127.0.0.1:{port}/x", b"{}", {})
            assert 0.2 <= loop.time() - t0 < 1.5
            t0 = loop.time()
            with pytest.raises(UpstreamTimeoutError):  # get's own read timeout
                await client.get(f"http://127.0.0.1:{port}/metrics", 0.2)
            assert 0.1 <= loop.time() - t0 < 1.5
        finally:
            await client.close()
            server.close()

    asyncio.run(scenario())


@pytest.mark.parametrize("stream", [False, True])
def test_server_gone_mid_body_is_broken(stream: bool) -> None:
    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await read_request(reader)
        writer.write(b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\n"
                     b"transfer-encoding: chunked\r\n\r\n5\r\nhello\r\n")
        await writer.drain()
        await asyncio.sleep(0.05)
        writer.transport.abort()  # the replica process dies: no terminating chunk

    async def scenario() -> None:
        server = await asyncio.start_server(handle, "127.0.0.1", 0)
        port = server.sockets[0].getsockname()[1]
        client = UpstreamClient(1.0, 5.0)
        try:
            resp = await client.post(f"http://127.0.0.1:{port}/x", b"{}", {})
            assert resp.status_code == 200
            with pytest.raises(UpstreamBrokenError):
                if stream:
                    assert [c async for c in resp.iter_chunks()] == [b"hello"]
                else:
                    await resp.read()
            resp.close()
        finally:
            await client.close()
            server.close()

    asyncio.run(scenario())


@pytest.mark.parametrize("where", ["headers", "body"])
def test_cancel_closes_the_connection(where: str) -> None:
    """The gateway cancels on a client disconnect; the replica must see its connection close."""
    saw_eof = asyncio.Event()

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await read_request(reader)
        if where == "body":
            writer.write(b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\n"
                         b"transfer-encoding: chunked\r\n\r\n5\r\nhello\r\n")
            await writer.drain()
        if await reader.read() == b"":  # blocks until the client closes
            saw_eof.set()
        writer.close()

    async def scenario() -> None:
        server = await asyncio.start_server(handle, "127.0.0.1", 0)
        port = server.sockets[0].getsockname()[1]
        client = UpstreamClient(1.0, 30.0)
        got_first = asyncio.Event()

        async def consume() -> None:
            resp = await client.post(f"http://127.0.0.1:{port}/x", b"{}", {})
            try:
                async for _ in resp.iter_chunks():
                    got_first.set()
            finally:
                resp.close()

        try:
            task = asyncio.create_task(consume())
            if where == "body":
                await asyncio.wait_for(got_first.wait(), 2.0)
            else:
                await asyncio.sleep(0.2)
            assert not saw_eof.is_set()
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task
            await asyncio.wait_for(saw_eof.wait(), 2.0)
        finally:
            await client.close()
            server.close()

    asyncio.run(scenario())


def test_https_urls_speak_tls() -> None:
    """No certificate here: the check is that an https:// URL opens with a TLS ClientHello."""
    first_bytes: list[bytes] = []

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        first_bytes.append(await reader.read(3))
        writer.close()

    async def scenario() -> None:
        server = await asyncio.start_server(handle, "127.0.0.1", 0)
        port = server.sockets[0].getsockname()[1]
        client = UpstreamClient(1.0, 2.0)
        try:
            with pytest.raises(UpstreamError):
                await client.post(f"https://127.0.0.1:{port}/x", b"{}", {})
        finally:
            await client.close()
            server.close()
        # TLS record type 22 (handshake), version 3.x; a plain request would start with b"POS".
        assert first_bytes and first_bytes[0][:1] == b"\x16" and first_bytes[0][1:2] == b"\x03"

    asyncio.run(scenario())


def test_retry_after_a_close_uses_a_new_connection_not_another_pooled_one() -> None:
    """When a replica dies, its other pooled connections are dead too: the retry must connect."""
    accepted: list[int] = []
    closed_one: list[bool] = []

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        accepted.append(len(accepted))
        try:
            while True:
                head = await read_request(reader)
                if b"/die" in head and not closed_one:
                    closed_one.append(True)
                    writer.transport.abort()
                    return
                await asyncio.sleep(0.05)  # the warm-up pair overlaps: two pooled connections
                writer.write(OK)
                await writer.drain()
        except (asyncio.IncompleteReadError, ConnectionError):
            writer.close()

    async def scenario() -> None:
        server = await asyncio.start_server(handle, "127.0.0.1", 0)
        port = server.sockets[0].getsockname()[1]
        client = UpstreamClient(1.0, 5.0)

        async def one(path: str) -> bytes:
            resp = await client.post(f"http://127.0.0.1:{port}{path}", b"{}", {})
            try:
                return await resp.read()
            finally:
                resp.close()

        try:
            assert await asyncio.gather(one("/a"), one("/b")) == [b"{}", b"{}"]
            assert len(accepted) == 2
            assert await one("/die") == b"{}"
            assert closed_one and len(accepted) == 3
        finally:
            await client.close()
            server.close()

    asyncio.run(scenario())
