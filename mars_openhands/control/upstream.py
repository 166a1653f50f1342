"""HTTP client for the replicas: the one place that knows the client library (aiohttp).

Why aiohttp and not httpx on this path: measured on this machine (same process, same fake
engine, ``time.process_time`` per request), an httpx ``AsyncClient`` POST costs ~2.3 ms of CPU and
an aiohttp one ~0.75 ms (both inflated by a loaded machine; the ratio, ~3x, is what matters). The
proxy hot path pays it once per request, and the gateway's budget is 1 ms at p50. aiohttp is already
a vLLM dependency.

Failures are mapped to three exceptions the gateway understands: :class:`UpstreamUnreachableError`
(nothing was sent: safe to retry on another replica), :class:`UpstreamTimeoutError` (the replica was
silent for ``read_timeout_s``) and :class:`UpstreamBrokenError` (the connection broke after the
request was sent: not retried, the request may have run).
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Mapping

import aiohttp

__all__ = [
    "UpstreamBrokenError",
    "UpstreamClient",
    "UpstreamError",
    "UpstreamResponse",
    "UpstreamTimeoutError",
    "UpstreamUnreachableError",
]


class UpstreamError(Exception):
    """A replica could not serve the request; ``str()`` says what happened."""


class UpstreamUnreachableError(UpstreamError):
    """Connecting failed (refused, reset, connect timeout): nothing reached the replica."""


class UpstreamTimeoutError(UpstreamError):
    """The replica sent nothing for the read timeout."""


class UpstreamBrokenError(UpstreamError):
    """The connection broke mid-request or mid-response."""


def _map(error: BaseException) -> UpstreamError:
    if isinstance(error, aiohttp.ClientConnectorError | aiohttp.ConnectionTimeoutError):
        return UpstreamUnreachableError(repr(error))
    if isinstance(error, aiohttp.ServerTimeoutError | TimeoutError):
        return UpstreamTimeoutError(repr(error))
    return UpstreamBrokenError(repr(error))


class UpstreamResponse:
    """A response whose body has not been read yet. Call :meth:`close` (idempotent) when done."""

    def __init__(self, resp: aiohttp.ClientResponse) -> None:
        self._resp = resp
        self.status_code = resp.status
        self.content_type: str | None = resp.headers.get("content-type")

    async def read(self) -> bytes:
        """The whole body. Raises UpstreamError."""
        try:
            return await self._resp.read()
        except (TimeoutError, aiohttp.ClientError) as e:
            raise _map(e) from None

    async def iter_chunks(self) -> AsyncIterator[bytes]:
        """Body chunks as they arrive. Raises UpstreamError."""
        try:
            async for chunk in self._resp.content.iter_any():
                yield chunk
        except (TimeoutError, aiohttp.ClientError) as e:
            raise _map(e) from None

    def close(self) -> None:
        """Drop the connection if the body was not fully read (the replica sees a disconnect)."""
        self._resp.close()


class UpstreamClient:
    """Pooled keep-alive connections to the replicas.

    Args:
        connect_timeout_s: seconds to connect.
        read_timeout_s: seconds of silence tolerated while reading.
        keepalive_timeout_s: idle seconds before a pooled connection is dropped.
    """

    def __init__(self, connect_timeout_s: float, read_timeout_s: float,
                 keepalive_timeout_s: float = 4.0) -> None:
        self._timeout = aiohttp.ClientTimeout(total=None, connect=connect_timeout_s,
                                              sock_read=read_timeout_s)
        self._session = aiohttp.ClientSession(
            # Below uvicorn's (vLLM's) 5 s keep-alive timeout, so the pool rarely hands out a
            # connection the server is closing.
            connector=aiohttp.TCPConnector(limit=0, keepalive_timeout=keepalive_timeout_s),
            timeout=self._timeout, auto_decompress=False,
            skip_auto_headers=("Accept-Encoding", "User-Agent"),
        )

    async def post(self, url: str, content: bytes, headers: Mapping[str, str]) -> UpstreamResponse:
        """Send a POST and return once the status line and headers arrived. Raises UpstreamError.

        A pooled keep-alive connection can be closed by the server just as it is reused (the
        request never reached the application); such a failure before any response is retried
        once on a fresh connection. A dead server then shows up as unreachable.
        """
        for attempt in (0, 1):
            try:
                return UpstreamResponse(await self._session.post(url, data=content, headers=headers))
            except (aiohttp.ClientOSError, aiohttp.ServerDisconnectedError) as e:
                if attempt == 1 or isinstance(e, aiohttp.ClientConnectorError):
                    raise _map(e) from None
            except (TimeoutError, aiohttp.ClientError) as e:
                raise _map(e) from None
        raise AssertionError("unreachable: the loop returns or raises")

    async def get(self, url: str, timeout_s: float | None = None) -> tuple[int, bytes, str | None]:
        """GET a small resource: (status, body, content type). Raises UpstreamError."""
        timeout = aiohttp.ClientTimeout(total=timeout_s) if timeout_s else None
        try:
            async with self._session.get(url, timeout=timeout) as resp:
                return resp.status, await resp.read(), resp.headers.get("content-type")
        except (TimeoutError, aiohttp.ClientError) as e:
            raise _map(e) from None

    async def close(self) -> None:
        """Close every pooled connection."""
        await self._session.close()
