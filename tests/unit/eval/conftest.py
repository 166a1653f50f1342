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


@pytest.fixture
def not_found_endpoint():
    """``http://127.0.0.1:PORT`` of a server that is up and answers every request 404 (so a
    replay reaches it, and every session ends with an HTTP error)."""
    import threading
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

    class NotFound(BaseHTTPRequestHandler):
        def _answer(self) -> None:
            self.rfile.read(int(self.headers.get("content-length") or 0))
            self.send_response(404)
            self.send_header("content-length", "0")
            self.end_headers()

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
