"""HTTP client for the replicas: the one place that knows the client library (aiohttp).

House rule: a well-kept library beats our own code here, even a slower one. aiohttp (already a
vLLM dependency) is used in its cheapest form: one ``ClientSession`` over one ``TCPConnector`` for
the gateway's lifetime (keep-alive pool per replica, idle connections dropped after
``keepalive_timeout_s``), no cookie jar, no decompression (bytes are relayed as the replica sent
them), no automatic ``User-Agent`` / ``Accept-Encoding`` headers, parsed URLs cached per replica
path, and streams read with ``content.iter_any()`` (whatever arrived, no line splitting).
A second session that never pools serves only the one retry of :meth:`UpstreamClient.post`.
Because it is aiohttp, ``https://`` replica URLs work too.

Timeouts: ``connect_timeout_s`` bounds connecting; ``read_timeout_s`` is aiohttp's ``sock_read``,
the longest silence tolerated between bytes (waiting for the headers included), re-armed by every
read; there is no total timeout (a long stream is fine as long as it keeps sending).

Failures are mapped to three exceptions the gateway understands: :class:`UpstreamUnreachableError`
(nothing was sent: safe to retry on another replica), :class:`UpstreamTimeoutError` (the replica was
silent for ``read_timeout_s``) and :class:`UpstreamBrokenError` (the connection broke after the
request was sent: not retried, the request may have run).

Cancelling a :meth:`UpstreamClient.post` or a read (the gateway does so when the agent disconnects)
closes that request's connection, so vLLM sees a disconnect and aborts the request.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Mapping

import aiohttp
from yarl import URL

from mars_openhands.cli_style import redact_url

__all__ = [
    "UpstreamBrokenError",
    "UpstreamClient",
    "UpstreamError",
    "UpstreamResponse",
    "UpstreamTimeoutError",
    "UpstreamUnreachableError",
    "NOT_RELAYED_HEADERS",
]


class UpstreamError(Exception):
    """A replica could not serve the request; ``str()`` says what happened."""


class UpstreamUnreachableError(UpstreamError):
    """Connecting failed (refused, reset, connect timeout): nothing reached the replica."""


class UpstreamTimeoutError(UpstreamError):
    """The replica sent nothing for the read timeout."""


class UpstreamBrokenError(UpstreamError):
    """The connection broke mid-request or mid-response."""


_ERRORS = (TimeoutError, aiohttp.ClientError)
"""What aiohttp raises for a failed request."""


_CLOSED_BEFORE_RESPONSE = (aiohttp.ClientOSError, aiohttp.ServerDisconnectedError,
                           aiohttp.ClientConnectionResetError)
"""What aiohttp raises when a connection closes before the response headers (or, as the
``ClientConnectorError`` subclass of ``ClientOSError``, cannot be opened)."""


def _map(error: BaseException, url: str) -> UpstreamError:
    """The gateway's exception for an aiohttp failure on ``url`` (its password hidden, in the
    error's text too: :func:`~mars_openhands.cli_style.redact_url`)."""
    error_text, url = redact_url(repr(error)), redact_url(url)
    if isinstance(error, aiohttp.ClientConnectorError | aiohttp.ConnectionTimeoutError):
        return UpstreamUnreachableError(f"cannot connect for {url}: {error_text}")
    if isinstance(error, aiohttp.InvalidURL | aiohttp.NonHttpUrlClientError):
        return UpstreamUnreachableError(
            f"bad replica URL {url!r} ({error_text}); give an http:// or https:// URL")
    if isinstance(error, aiohttp.ServerTimeoutError | TimeoutError):
        return UpstreamTimeoutError(f"no bytes from {url} within the read timeout: {error_text}")
    return UpstreamBrokenError(f"connection to {url} broke: {error_text}")


NOT_RELAYED_HEADERS = frozenset((b"content-type", b"content-length", b"transfer-encoding", b"connection",
                                 b"keep-alive", b"date", b"server"))
"""Response headers the gateway sets itself (its server adds date/server/framing); the replica's
other headers (``x-request-id``, CORS, ...) are relayed to the agent."""


class UpstreamResponse:
    """A response whose body has not been read yet. Call :meth:`close` (idempotent) when done.

    Attributes:
        status_code: HTTP status.
        content_type: the ``content-type`` header, if any.
        headers: the replica's other headers to relay, lower-case names (see
            :data:`NOT_RELAYED_HEADERS`).
    """

    __slots__ = ("_resp", "_url", "status_code", "content_type", "headers")

    def __init__(self, resp: aiohttp.ClientResponse, url: str) -> None:
        self._resp = resp
        self._url = url
        self.status_code = resp.status
        self.content_type: str | None = resp.headers.get("content-type")
        self.headers = [(k.lower(), v) for k, v in resp.raw_headers if k.lower() not in NOT_RELAYED_HEADERS]

    async def read(self) -> bytes:
        """The whole body; the connection goes back to the pool. Raises UpstreamError."""
        try:
            return await self._resp.read()
        except _ERRORS as e:
            raise _map(e, self._url) from None

    async def read_chunk(self) -> bytes:
        """The body bytes that arrived next (de-chunked), ``b""`` at its end. Cancel-safe: a
        cancelled read loses nothing, :meth:`iter_chunks` goes on from there. Raises
        UpstreamError."""
        try:
            return await self._resp.content.readany()
        except _ERRORS as e:
            raise _map(e, self._url) from None

    async def iter_chunks(self) -> AsyncIterator[bytes]:
        """Body bytes as they arrive (de-chunked; one item per socket read). Raises UpstreamError."""
        try:
            async for chunk in self._resp.content.iter_any():
                yield chunk
        except _ERRORS as e:
            raise _map(e, self._url) from None

    def close(self) -> None:
        """Drop the connection if the body was not fully read (the replica sees a disconnect);
        a fully read response already returned its connection to the pool."""
        self._resp.close()


class UpstreamClient:
    """Pooled keep-alive connections to the replicas (aiohttp sessions, created here).

    Create it inside the running event loop that uses it; call :meth:`close` when done.

    Args:
        connect_timeout_s: seconds to connect.
        read_timeout_s: seconds of silence tolerated while reading (headers or body).
        keepalive_timeout_s: idle seconds before a pooled connection is dropped (below uvicorn's,
            hence vLLM's, 5 s, so the pool rarely hands out a connection the server is closing).
    """

    def __init__(self, connect_timeout_s: float, read_timeout_s: float,
                 keepalive_timeout_s: float = 4.0) -> None:
        self.connect_timeout_s = connect_timeout_s
        self.read_timeout_s = read_timeout_s
        self._timeout = aiohttp.ClientTimeout(total=None, connect=connect_timeout_s,
                                              sock_read=read_timeout_s)
        self._urls: dict[str, URL] = {}
        self._session = self._new_session(
            aiohttp.TCPConnector(limit=0, keepalive_timeout=keepalive_timeout_s))
        # For the one retry after a connection closed before the response: always a new
        # connection, so the retry cannot land on another pooled connection of a server that just
        # died (it then fails to connect, "unreachable", and the gateway moves on).
        self._fresh_session = self._new_session(aiohttp.TCPConnector(limit=0, force_close=True))

    def _new_session(self, connector: aiohttp.TCPConnector) -> aiohttp.ClientSession:
        return aiohttp.ClientSession(
            connector=connector, timeout=self._timeout, auto_decompress=False,
            cookie_jar=aiohttp.DummyCookieJar(), skip_auto_headers=("Accept-Encoding", "User-Agent"),
        )

    def _url(self, url: str) -> URL:
        """``url`` parsed once (the gateway sends to a handful of replica paths).

        Raises:
            UpstreamUnreachableError: ``url`` cannot be parsed.
        """
        parsed = self._urls.get(url)
        if parsed is None:
            try:
                parsed = self._urls[url] = URL(url)
            except ValueError as e:
                raise UpstreamUnreachableError(
                    f"bad replica URL {redact_url(repr(url))} ({redact_url(str(e))}); give an http:// "
                    "or https:// URL") from None
        return parsed

    async def post(self, url: str, content: bytes, headers: Mapping[str, str]) -> UpstreamResponse:
        """Send a POST and return once the status line and headers arrived. Raises UpstreamError.

        A pooled keep-alive connection can be closed by the server just as it is reused (the
        request never reached the application); such a failure before any response is retried
        once, on a new connection (aiohttp retries by itself only idempotent methods). A dead
        server then shows up as unreachable.
        """
        session = self._session
        for attempt in (0, 1):
            try:
                resp = await session.post(self._url(url), data=content, headers=headers)
            except _CLOSED_BEFORE_RESPONSE as e:
                if attempt == 1 or isinstance(e, aiohttp.ClientConnectorError):
                    raise _map(e, url) from None
                session = self._fresh_session
                continue
            except _ERRORS as e:
                raise _map(e, url) from None
            return UpstreamResponse(resp, url)
        raise AssertionError("unreachable: the loop returns or raises")

    async def get(self, url: str, timeout_s: float | None = None,
                  headers: Mapping[str, str] | None = None) -> tuple[int, bytes, str | None]:
        """GET a small resource: (status, body, content type). Raises UpstreamError.

        Args:
            url: the resource.
            timeout_s: read timeout (seconds of silence) for this request; default
                ``read_timeout_s``. Connecting is bounded by ``connect_timeout_s`` as usual.
            headers: request headers (e.g. the replica's ``authorization``).
        """
        timeout = (aiohttp.ClientTimeout(total=None, connect=self.connect_timeout_s,
                                         sock_read=timeout_s) if timeout_s else self._timeout)
        try:
            async with self._session.get(self._url(url), timeout=timeout, headers=headers) as resp:
                return resp.status, await resp.read(), resp.headers.get("content-type")
        except _ERRORS as e:
            raise _map(e, url) from None

    async def close(self) -> None:
        """Close the sessions and every pooled connection. Idempotent."""
        await self._session.close()
        await self._fresh_session.close()
