"""Fixtures for the gateway tests: fake vLLM replicas in subprocesses and a gateway factory."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import pytest
from gateway_helpers import FAKE_DEFAULTS, fast_config

from mars_openhands.control.fake_engine import FakeEngineProcess
from mars_openhands.control.server import GatewayServer
from mars_openhands.stream.transport import ListSink


@pytest.fixture(scope="module")
def fakes() -> Iterator[list[FakeEngineProcess]]:
    """Two fake replicas shared by a module (tests use distinct session ids)."""
    with FakeEngineProcess() as a, FakeEngineProcess() as b:
        yield [a, b]


@pytest.fixture()
def clean_fakes(fakes: list[FakeEngineProcess]) -> list[FakeEngineProcess]:
    for fake in fakes:
        fake.configure(**FAKE_DEFAULTS)
    return fakes


@pytest.fixture()
def gateway_factory() -> Iterator[Callable[..., tuple[GatewayServer, ListSink]]]:
    servers: list[GatewayServer] = []

    def make(urls: list[str], **overrides: Any) -> tuple[GatewayServer, ListSink]:
        sink = ListSink()
        server = GatewayServer(fast_config(urls, **overrides), sink).start()
        servers.append(server)
        return server, sink

    yield make
    for server in servers:
        server.stop()


