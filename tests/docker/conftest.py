"""Fixtures of the Docker sandbox tests (``make docker-test``): a private Docker engine and the
agent-server image built in it by the offline path, one of each per session.

These tests run in ``.venv-openhands-app`` (the OpenHands app 1.11, agent-server / SDK /
``openhands-workspace`` 1.34.0, the versions the image runs). In any other env they are not
collected at all (not skipped): the unit and integration targets collect ``tests/``. Where they
run they never skip: a missing engine is installed (root, Debian's ``docker.io``), and one that
cannot be installed fails the session with one line saying why.
"""

from __future__ import annotations

import atexit
import importlib.util
import re
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.docker._engine import (
    AgentServerImage,
    EngineUnavailable,
    PrivateDockerd,
    ensure_engine,
)


def _is_app_env() -> bool:
    try:
        return all(importlib.util.find_spec(m) is not None
                   for m in ("openhands.app_server", "openhands.workspace"))
    except ModuleNotFoundError:
        return False


if not _is_app_env():
    collect_ignore_glob = ["test_*.py"]

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="session")
def docker_engine() -> Iterator[PrivateDockerd]:
    """A running :class:`PrivateDockerd`, removed with all it made at the
    end of the session (also at interpreter exit, should the session die first)."""
    try:
        note = ensure_engine()
    except EngineUnavailable as exc:
        pytest.fail(f"Docker tests: {exc}", pytrace=False)
    engine = PrivateDockerd()
    atexit.register(engine.stop)
    try:
        start = time.monotonic()
        engine.start()
        print(f"\n  docker engine: {note}; dockerd up in {time.monotonic() - start:.1f} s "
              f"({engine.root}, bridge {engine.bridge} {engine.gateway_ip})")
        yield engine
    finally:
        start = time.monotonic()
        engine.stop()
        atexit.unregister(engine.stop)
        print(f"\n  docker engine removed in {time.monotonic() - start:.1f} s")


@pytest.fixture(scope="session")
def agent_server_image(docker_engine: PrivateDockerd) -> AgentServerImage:
    """Our agent-server image, built the way a user without Docker Hub builds it (``--offline``:
    Debian's packages and PyPI's wheels, cached by content in the user's cache directory)."""
    start = time.monotonic()
    out = subprocess.run([str(ROOT / "scripts" / "build_agent_server_image.sh"), "--offline"],
                         capture_output=True, text=True, timeout=1500, cwd=ROOT,
                         env={**docker_engine.env, "MARS_PYTHON": sys.executable})
    log = out.stdout + out.stderr
    assert out.returncode == 0, f"the image build failed:\n{log[-4000:]}"
    took = time.monotonic() - start
    built = re.search(r"^built (\S+) FROM (\S+);", out.stdout, re.M)
    assert built and "(offline path:" in out.stdout, log[-3000:]
    print(f"\n  agent-server image {built.group(1)} FROM {built.group(2)} in {took:.0f} s")
    return AgentServerImage(tag=built.group(1), base=built.group(2), build_s=took, log=log)
