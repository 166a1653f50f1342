"""Fixtures of the eval unit tests."""

from __future__ import annotations

import pytest


@pytest.fixture(scope="module")
def sim():
    """The ``eval.sim`` module (skips when vLLM is missing)."""
    return pytest.importorskip("eval.sim", reason="the sim backend needs vllm")


@pytest.fixture(autouse=True)
def _private_cache(tmp_path_factory, monkeypatch):
    """compare's content-hash cache goes to a per-test folder, never to the user's ~/.cache."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path_factory.mktemp("xdg-cache")))


@pytest.fixture
def closed_port_url() -> str:
    """``http://127.0.0.1:PORT`` where nothing listens: a port bound, then closed again."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return f"http://127.0.0.1:{s.getsockname()[1]}"


def _not_found_server(api_key: str | None = None):
    """A server that answers every request 404; with ``api_key``, 401 (vLLM's body) to a request
    without ``Authorization: Bearer <api_key>``. Yields its root URL."""
    import threading
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

    class NotFound(BaseHTTPRequestHandler):
        def _answer(self) -> None:
            self.rfile.read(int(self.headers.get("content-length") or 0))
            is_refused = api_key is not None and self.headers.get("authorization") != f"Bearer {api_key}"
            body = b'{"error":"Unauthorized"}' if is_refused else b""
            self.send_response(401 if is_refused else 404)
            self.send_header("content-length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        do_GET = do_POST = _answer

        def log_message(self, *args) -> None:  # quiet
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), NotFound)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()
        thread.join(timeout=5)


@pytest.fixture
def not_found_endpoint():
    """``http://127.0.0.1:PORT`` of a server that is up and answers every request 404 (so a
    replay reaches it, and every session ends with an HTTP error)."""
    yield from _not_found_server()


@pytest.fixture
def keyed_endpoint():
    """As :func:`not_found_endpoint`, behind the API key ``k3y``: 401 without it (a keyed gateway)."""
    yield from _not_found_server("k3y")
