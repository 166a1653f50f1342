"""The OpenHands app (``openhands-ai`` 1.11, process sandbox) with a MARS backend, end to end.

Set up only from what ``mars-openhands openhands app-env --gateway URL`` prints: the app process's
environment (its process sandbox runs ``python -m mars_openhands.openhands.agent_server``) and the
user's LLM settings (base URL = the gateway). One conversation over the app's REST API, the
playback engine behind a real gateway; checked in the gateway's recorded stream: the tool events
and the session end of that conversation, and at the engine: the app's title request is a side
request, the agent's turns are 0, 1, 2.

Runs in ``.venv-openhands-app`` (``make openhands-app-test``), where setup applied
``patches/openhands-ai-1.11-process-sandbox.patch`` (without it the app never sees the sandbox
running).
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

pytest.importorskip("openhands.app_server", reason="needs the OpenHands app (.venv-openhands-app)")

from mars_openhands.openhands.playback import RecordedToolCall, RecordedTurn, Script  # noqa: E402
from tests.openhands._helpers import (  # noqa: E402
    assert_app_conversation,
    free_port,
    playback_behind_gateway,
    serve_process,
    session_events,
    start_app_conversation,
    wait_for,
)

pytestmark = [pytest.mark.openhands, pytest.mark.integration, pytest.mark.timeout(900)]

ROOT = Path(__file__).resolve().parents[2]


def _script(workspace_note: str) -> Script:
    def turn(name: str, **arguments: object) -> RecordedTurn:
        return RecordedTurn(content=f"calling {name}",
                            tool_calls=(RecordedToolCall(name=name, arguments=dict(arguments)),))

    return Script(name="app", turns=(
        turn("terminal", command=f"echo {workspace_note} > note.txt && cat note.txt && env > env.txt"),
        turn("terminal", command="wc -c note.txt"),
    ))


API_KEY = "sk-app-gateway-33"


def _app_env(gateway_url: str) -> dict:
    out = subprocess.run([sys.executable, "-m", "eval.cli", "openhands", "app-env",
                          "--gateway", gateway_url, "--api-key", API_KEY, "--format", "json"],
                         capture_output=True,
                         text=True, timeout=120, cwd=ROOT,
                         env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert out.returncode == 0, out.stderr[-2000:]
    return json.loads(out.stdout)


def _patch_applied() -> bool:
    out = subprocess.run([sys.executable, str(ROOT / "patches" / "apply.py"), "--python",
                          sys.executable, "--check", "openhands-ai-process-sandbox"],
                         capture_output=True, text=True)
    return out.returncode == 0 and "already applied" in out.stdout


def test_an_app_conversation_reaches_the_gateway(tmp_path: Path) -> None:
    assert _patch_applied(), ("patches/openhands-ai-1.11-process-sandbox.patch is not applied to "
                              "this env: run scripts/setup.sh openhands-app (or patches/apply.py)")
    with playback_behind_gateway([_script("mars")], api_key=API_KEY) as (gateway, sink):
        settings = _app_env(gateway.url)
        port = free_port()
        (tmp_path / "home").mkdir()
        env = {**os.environ, **settings["app_env"], "PYTHONPATH": str(ROOT),
               "OPENHANDS_SUPPRESS_BANNER": "1", "LITELLM_LOCAL_MODEL_COST_MAP": "True",
               "OH_PERSISTENCE_DIR": str(tmp_path / "app"), "HOME": str(tmp_path / "home"),
               "OH_SANDBOX_BASE_WORKING_DIR": str(tmp_path / "sandboxes"),
               "OH_SANDBOX_BASE_PORT": str(free_port())}
        url = f"http://127.0.0.1:{port}"
        argv = [sys.executable, "-m", "uvicorn", "openhands.app_server.app:app", "--host",
                "127.0.0.1", "--port", str(port)]
        with serve_process(argv, url, tmp_path / "app.log", env, tmp_path, timeout_s=300), \
                httpx.Client(base_url=url, timeout=60) as client:
            stored = client.post("/api/v1/settings", json=settings["settings"])
            assert stored.status_code == 200, stored.text
            t0 = time.monotonic()
            sid = str(uuid.UUID(start_app_conversation(client, "write a note")))
            wait_for(lambda: [e for e in session_events(sink, sid) if e.kind == "session_end"],
                     300, f"session_end of {sid} in the gateway's stream")
            print(f"\n  app conversation {sid}: started to session_end in "
                  f"{time.monotonic() - t0:.1f} s")
            requests = httpx.get(f"{gateway.config.replicas[0].url}/playback/requests").json()
            state = gateway.gateway.state()
    ours = assert_app_conversation(sink, sid, requests, state)
    assert all(r["stream"] for r in ours if not r["is_side"])  # the app streams its turns
    # Issue 33 item 6: the conversation's calls (the title's too) and event posts carried its own
    # token and the user's key, with nothing set for it; its terminal did not see the token.
    contract = gateway.contract
    assert contract.refused() == []
    tokens = contract.tokens_of(sid)
    assert len(contract.tokens_of(sid, "llm")) == len(ours) and contract.tokens_of(sid, "events")
    assert len(set(tokens)) == 1 and tokens[0] is not None and len(tokens[0]) >= 22, tokens
    assert {c["authorization"] for c in contract.calls if c["session_id"] == sid} == {
        f"Bearer {API_KEY}"}
    env_files = list((tmp_path / "sandboxes").rglob("env.txt"))
    assert env_files and all(tokens[0] not in f.read_text() for f in env_files)
