"""The agent-server image for the app's Docker sandbox, tested where no Docker daemon runs.

Checked: our Dockerfile against the stock agent-server Dockerfile this env installed (same
interpreter, user and tools in the image it builds FROM), the build script's context (a Dockerfile
and a wheel of this checkout, nothing else), and the entrypoint itself, run from that wheel alone
with the arguments the app passes.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import zipfile
from importlib import metadata
from pathlib import Path

import pytest

pytest.importorskip("openhands.agent_server", reason="needs openhands-agent-server in this env")

import openhands.agent_server  # noqa: E402

from mars_openhands.openhands.app_env import (  # noqa: E402
    AGENT_SERVER_MODULE,
    APP_AGENT_SERVER_VERSION,
    DEFAULT_IMAGE_REPOSITORY,
    app_settings,
)

pytestmark = [pytest.mark.openhands, pytest.mark.timeout(600)]

ROOT = Path(__file__).resolve().parents[2]
OURS = (ROOT / "docker" / "agent-server" / "Dockerfile").read_text()
STOCK = (Path(openhands.agent_server.__file__).parent / "docker" / "Dockerfile").read_text()


def _instruction(text: str, keyword: str) -> list[str]:
    return [line.split(None, 1)[1] for line in text.splitlines() if line.startswith(keyword + " ")]


def _stage(text: str, name: str) -> str:
    """The lines of one ``FROM ... AS name`` stage of a Dockerfile."""
    match = re.search(rf"^FROM \S+ AS {name}\n(.*?)(?=^FROM |\Z)", text, re.M | re.S)
    assert match, f"no stage {name}"
    return match.group(1)


def test_the_image_is_the_stock_python_image_with_our_module_as_entrypoint() -> None:
    [base_arg] = [a for a in _instruction(OURS, "ARG") if a.startswith("AGENT_SERVER_IMAGE=")]
    base = base_arg.split("=", 1)[1]
    assert base == f"ghcr.io/openhands/agent-server:{APP_AGENT_SERVER_VERSION}-python"
    assert _instruction(OURS, "FROM") == ["${AGENT_SERVER_IMAGE}"]
    # The stock "-python" image runs the agent-server from its venv: ours runs our module there.
    [stock_entry] = _instruction(_stage(STOCK, "source"), "ENTRYPOINT")
    [our_entry] = _instruction(OURS, "ENTRYPOINT")
    assert json.loads(our_entry) == [
        AGENT_SERVER_MODULE if arg == "openhands.agent_server" else arg
        for arg in json.loads(stock_entry)]
    user = re.search(r"^ARG USERNAME=(\S+)", STOCK, re.M).group(1)
    assert f"--chown={user}:{user}" in OURS  # the stock image's user owns its venv
    # uv is in the image the "source" stage builds on (base-image, from base-image-minimal).
    assert "/uv /uvx /bin/" in _stage(STOCK, "base-image-minimal") + _stage(STOCK, "base-image")
    assert "uv pip install --python /agent-server/.venv/bin/python" in OURS


def test_the_app_settings_name_the_image_the_script_builds() -> None:
    script = (ROOT / "scripts" / "build_agent_server_image.sh").read_text()
    tag = re.search(r'^tag="([^"]+)"', script, re.M).group(1)
    docker = app_settings("http://127.0.0.1:8000", "m", sandbox="docker")
    env = docker.app_env
    assert f"{env['AGENT_SERVER_IMAGE_REPOSITORY']}:{env['AGENT_SERVER_IMAGE_TAG']}" == tag
    assert env["AGENT_SERVER_IMAGE_REPOSITORY"] == DEFAULT_IMAGE_REPOSITORY
    assert json.loads(env["OH_AGENT_SERVER_ENV"]) == {
        "MARS_EVENTS_URL": "http://host.docker.internal:8000/mars/v1/events"}
    assert docker.settings["agent_settings_diff"]["llm"]["base_url"] == "http://host.docker.internal:8000/v1"
    if "openhands-ai" in {d.metadata["Name"] for d in metadata.distributions()}:
        assert metadata.version("openhands-agent-server") == APP_AGENT_SERVER_VERSION  # the pin


def test_the_build_context_runs_as_the_entrypoint_without_docker(tmp_path: Path) -> None:
    context = tmp_path / "context"
    out = subprocess.run([str(ROOT / "scripts" / "build_agent_server_image.sh"), "--dry-run",
                          "--context", str(context)], capture_output=True, text=True, timeout=300,
                         env={**os.environ, "MARS_PYTHON": sys.executable})
    assert out.returncode == 0, out.stderr[-2000:]
    assert "docker build --build-arg AGENT_SERVER_IMAGE=ghcr.io/openhands/agent-server:" in out.stdout
    [wheel] = context.glob("mars_openhands-*.whl")
    assert sorted(p.name for p in context.iterdir()) == ["Dockerfile", wheel.name]
    assert "mars_openhands/openhands/agent_server.py" in zipfile.ZipFile(wheel).namelist()
    # What `uv pip install` puts in the image's venv, and the ENTRYPOINT with the app's arguments,
    # with this env's agent-server standing in for the image's (no checkout on the path).
    site = tmp_path / "site"
    subprocess.run([sys.executable, "-m", "pip", "install", "--quiet", "--no-deps",
                    "--disable-pip-version-check", "--target", str(site), str(wheel)], check=True)
    [entry] = _instruction(OURS, "ENTRYPOINT")
    argv = [sys.executable if a.endswith("/bin/python") else a for a in json.loads(entry)[2:]]
    image_env = dict(line.split("=", 1) for line in _instruction(OURS, "ENV"))
    assert image_env == {"MARS_AGENT_SERVER_HOST": "0.0.0.0"}  # port mapping needs it (issue 34)
    env = {**os.environ, "PYTHONPATH": str(site), "OPENHANDS_SUPPRESS_BANNER": "1",
           "MARS_EVENTS_URL": "http://host.docker.internal:8000/mars/v1/events", **image_env}
    check = subprocess.run([*argv, "--port", "8000", "--mars-check"], capture_output=True,
                           text=True, env=env, cwd=tmp_path, timeout=300)
    assert check.returncode == 0, check.stderr[-2000:]
    report = json.loads(check.stdout.strip().splitlines()[-1])
    assert report["tools"]["terminal"] == "mars_openhands.openhands.executor"
    assert report["events_url"] == "http://host.docker.internal:8000/mars/v1/events"
    assert report["host"] == "0.0.0.0"
    helped = subprocess.run([*argv, "--help"], capture_output=True, text=True, env=env,
                            cwd=tmp_path, timeout=300)
    assert helped.returncode == 0 and "--port" in helped.stdout and "MARS_EVENTS_URL" in helped.stdout
