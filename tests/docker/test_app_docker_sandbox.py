"""The OpenHands app (``openhands-ai`` 1.11) with its Docker sandbox and a MARS backend, end to end.

As ``tests/openhands/test_app_e2e.py`` (the process sandbox), with the app set up from what
``mars-openhands openhands app-env --sandbox docker`` prints: the app starts each sandbox as a
container of our agent-server image (built offline in the test engine, ``conftest.py``), whose
tool calls and LLM calls reach the gateway at ``host.docker.internal``. Besides, the app gets what
any Docker sandbox needs: ``DOCKER_HOST`` (the test engine), ``SANDBOX_HOST_PORT`` (its own port,
for the containers' webhooks), ``SANDBOX_STARTUP_GRACE_SECONDS`` (its default 15 s is short for
an agent-server starting on a busy 2-core machine) and ``SANDBOX_CONTAINER_URL_PATTERN`` with
``127.0.0.1`` (the app believes it runs in a container where ``/.dockerenv`` exists, as on this
project's machines, and then rewrites ``localhost`` to ``host.docker.internal``, which this host
cannot resolve: it never sees the sandbox start). Checked in the gateway's stream and at the
engine: the same as with the process sandbox (tool events and turns, the session's end, the title
request a side request, the slot released), and the tools ran in the container.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import uuid
from pathlib import Path

import httpx
import pytest

from mars_openhands.openhands.playback import RecordedToolCall, RecordedTurn, Script
from tests.docker._engine import AgentServerImage, PrivateDockerd
from tests.openhands._helpers import (
    assert_app_conversation,
    free_port,
    playback_behind_gateway,
    serve_process,
    session_events,
    start_app_conversation,
    wait_for,
)

pytestmark = [pytest.mark.docker, pytest.mark.openhands, pytest.mark.integration,
              pytest.mark.timeout(1500)]  # a cold image build is in the first one

ROOT = Path(__file__).resolve().parents[2]
NOTE = "/workspace/project/note.txt"  # the sandbox's working directory (the app's spec)


def _script() -> Script:
    def turn(command: str) -> RecordedTurn:
        return RecordedTurn(content="calling terminal", tool_calls=(
            RecordedToolCall(name="terminal", arguments={"command": command}),))

    return Script(name="app-docker", turns=(turn("echo mars > note.txt && cat note.txt"),
                                            turn("wc -c note.txt")))


def _app_env(gateway_url: str) -> dict:
    out = subprocess.run([sys.executable, "-m", "eval.cli", "openhands", "app-env",
                          "--gateway", gateway_url, "--sandbox", "docker", "--format", "json"],
                         capture_output=True, text=True, timeout=120, cwd=ROOT,
                         env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert out.returncode == 0, out.stderr[-2000:]
    return json.loads(out.stdout)


def test_an_app_conversation_in_a_docker_sandbox_reaches_the_gateway(
        docker_engine: PrivateDockerd, agent_server_image: AgentServerImage,
        tmp_path: Path) -> None:
    with playback_behind_gateway([_script()], host="0.0.0.0") as (gateway, sink):
        settings = _app_env(f"http://127.0.0.1:{gateway.config.port}")
        image = (f"{settings['app_env']['AGENT_SERVER_IMAGE_REPOSITORY']}:"
                 f"{settings['app_env']['AGENT_SERVER_IMAGE_TAG']}")
        assert image == agent_server_image.tag  # app-env names the image the script built
        port = free_port()
        (tmp_path / "home").mkdir()
        env = {**docker_engine.env, **settings["app_env"], "PYTHONPATH": str(ROOT),
               "OPENHANDS_SUPPRESS_BANNER": "1", "LITELLM_LOCAL_MODEL_COST_MAP": "True",
               "OH_PERSISTENCE_DIR": str(tmp_path / "app"), "HOME": str(tmp_path / "home"),
               "SANDBOX_HOST_PORT": str(port), "SANDBOX_STARTUP_GRACE_SECONDS": "240",
               "SANDBOX_CONTAINER_URL_PATTERN": "http://127.0.0.1:{port}"}
        argv = [sys.executable, "-m", "uvicorn", "openhands.app_server.app:app", "--host",
                "0.0.0.0", "--port", str(port)]  # the containers' webhooks come to the bridge
        try:
            with serve_process(argv, f"http://127.0.0.1:{port}", tmp_path / "app.log", env,
                               tmp_path, timeout_s=300), \
                    httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=60) as client:
                stored = client.post("/api/v1/settings", json=settings["settings"])
                assert stored.status_code == 200, stored.text
                t0 = time.monotonic()
                sid = str(uuid.UUID(start_app_conversation(client, "write a note", 420)))
                wait_for(lambda: [e for e in session_events(sink, sid)
                                  if e.kind == "session_end"], 300, f"session_end of {sid}")
                print(f"\n  app conversation {sid} in a container: started to session_end in "
                      f"{time.monotonic() - t0:.1f} s")
                [container] = docker_engine.containers(image)
                note = docker_engine.docker("exec", container, "cat", NOTE)
                requests = httpx.get(f"{gateway.config.replicas[0].url}/playback/requests").json()
                state = gateway.gateway.state()
        finally:  # the app leaves its sandboxes running; the next test counts containers
            ids = docker_engine.docker("ps", "-aq").stdout.split()
            if ids:
                docker_engine.docker("rm", "-f", *ids)
    assert note.stdout == "mars\n", note.stderr  # the tools ran in the container
    assert_app_conversation(sink, sid, requests, state)
