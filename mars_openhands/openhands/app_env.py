"""``mars-openhands openhands app-env --gateway URL``: what an OpenHands app user sets for a MARS backend.

The OpenHands app (PyPI ``openhands-ai`` 1.11, which pins SDK / tools / agent-server 1.34.0) runs
one agent-server per sandbox and lets each user set the LLM. A MARS backend then takes two things:

* the **sandbox's agent-server is ours** (:mod:`mars_openhands.openhands.agent_server`: evented
  tools, session start and end) and knows the gateway's events URL:

  - process sandbox (no Docker): ``RUNTIME=process``, ``OH_SANDBOX_KIND=ProcessSandboxServiceInjector``,
    ``OH_SANDBOX_AGENT_SERVER_MODULE=mars_openhands.openhands.agent_server`` (the app's Python must
    have this package), ``OH_AGENT_SERVER_ENV={"MARS_EVENTS_URL": ...}``. App 1.11's process
    sandbox also needs ``patches/openhands-ai-1.11-process-sandbox.patch`` (see patches/README.md);
  - Docker sandbox: ``AGENT_SERVER_IMAGE_REPOSITORY`` / ``AGENT_SERVER_IMAGE_TAG`` naming an image
    built ``FROM`` the stock agent-server image with our module as its entrypoint
    (``docker/agent-server/Dockerfile``, ``scripts/build_agent_server_image.sh``), and the same
    ``OH_AGENT_SERVER_ENV``; addresses the container uses go through ``host.docker.internal``;
* the **LLM base URL is the gateway** (per user: ``POST /api/v1/settings`` with
  ``agent_settings_diff.llm``, or the UI's LLM settings). The session id needs nothing: the SDK
  sends the conversation id as ``x-litellm-session-id`` / ``prompt_cache_key``, and the app's
  title request (no tools) is a side request at the gateway.
"""

from __future__ import annotations

import json
import shlex
from typing import Any, Literal
from urllib.parse import urlsplit, urlunsplit

from pydantic import BaseModel, ConfigDict

from mars_openhands.cli_style import redact_url

__all__ = ["APP_AGENT_SERVER_VERSION", "AppSettings", "app_settings", "render_shell",
           "reachable_from_container"]

APP_AGENT_SERVER_VERSION = "1.34.0"
"""The agent-server version ``openhands-ai`` 1.11.0 pins (its Docker image tag is
``<version>-python``)."""
AGENT_SERVER_MODULE = "mars_openhands.openhands.agent_server"
DEFAULT_IMAGE_REPOSITORY = "mars-openhands/agent-server"
"""What ``scripts/build_agent_server_image.sh`` tags its image as."""
Sandbox = Literal["process", "docker"]


class AppSettings(BaseModel):
    """Everything an app user sets: the app process's environment and the user's LLM settings."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    sandbox: Sandbox
    app_env: dict[str, str]
    """Environment of the app process (set before starting it)."""
    settings: dict[str, Any]
    """Body of ``POST /api/v1/settings`` (the user's LLM: base URL = the gateway)."""
    notes: tuple[str, ...] = ()


def reachable_from_container(url: str) -> str:
    """``url`` with a loopback host replaced by ``host.docker.internal`` (a sandbox container's
    name for the host). Pure."""
    parts = urlsplit(url)
    if parts.hostname not in ("localhost", "127.0.0.1", "::1"):
        return url
    netloc = "host.docker.internal" + (f":{parts.port}" if parts.port else "")
    return urlunsplit(parts._replace(netloc=netloc))


def app_settings(gateway_url: str, model: str, sandbox: Sandbox = "process",
                 api_key: str = "EMPTY", image_repository: str = DEFAULT_IMAGE_REPOSITORY,
                 agent_server_version: str = APP_AGENT_SERVER_VERSION,
                 extra_agent_env: dict[str, str] | None = None) -> AppSettings:
    """The settings for an OpenHands app whose LLM calls and tool events go to ``gateway_url``.

    Args:
        gateway_url: the gateway's root as the app's host sees it (``http://127.0.0.1:8000``).
        model: the served model name (``openai/`` is prefixed for LiteLLM unless a provider
            prefix is there).
        sandbox: ``process`` (agent-servers as local processes) or ``docker``.
        api_key: the key the gateway (or its engines) expects.
        image_repository, agent_server_version: the Docker image (``docker`` only).
        extra_agent_env: more environment for the sandbox's agent-server (``MARS_POLICY``, ...).

    Raises:
        ValueError: ``gateway_url`` is not an ``http(s)://host[:port]`` URL.
    """
    parts = urlsplit(gateway_url.rstrip("/"))
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise ValueError(f"--gateway must be http(s)://host[:port], got {redact_url(repr(gateway_url))}")
    root = urlunsplit(parts).removesuffix("/v1")
    seen_root = reachable_from_container(root) if sandbox == "docker" else root
    agent_env = {"MARS_EVENTS_URL": f"{seen_root}/mars/v1/events", **(extra_agent_env or {})}
    head = model.split("/", 1)[0]
    llm_model = model if head in ("openai", "hosted_vllm", "litellm_proxy") else f"openai/{model}"
    settings = {"agent_settings_diff": {"llm": {"model": llm_model, "base_url": f"{seen_root}/v1",
                                                "api_key": api_key}}}
    if sandbox == "process":
        env = {"RUNTIME": "process", "OH_SANDBOX_KIND": "ProcessSandboxServiceInjector",
               "OH_SANDBOX_AGENT_SERVER_MODULE": AGENT_SERVER_MODULE}
        notes = ("the app's Python must have mars-openhands installed (the process sandbox runs "
                 f"python -m {AGENT_SERVER_MODULE})",
                 "openhands-ai 1.11's process sandbox needs a patch: python patches/apply.py "
                 "--python <the app's python> openhands-ai-process-sandbox (patches/README.md)")
    else:
        env = {"AGENT_SERVER_IMAGE_REPOSITORY": image_repository,
               "AGENT_SERVER_IMAGE_TAG": f"{agent_server_version}-python"}
        notes = (f"build the image first: scripts/build_agent_server_image.sh (tags "
                 f"{image_repository}:{agent_server_version}-python)",
                 "the sandbox container reaches the gateway at host.docker.internal; on Linux the "
                 "gateway must listen on an address the container can reach (--host 0.0.0.0)")
    env["OH_AGENT_SERVER_ENV"] = json.dumps(agent_env)
    return AppSettings(sandbox=sandbox, app_env=env, settings=settings, notes=notes)


def render_shell(settings: AppSettings, app_url: str = "http://localhost:3000") -> str:
    """The settings as commands to paste into a shell (comments say where each goes). Pure."""
    lines = [f"# OpenHands app (openhands-ai 1.11) with a MARS backend, {settings.sandbox} sandbox.",
             "# 1. The app's environment, before it starts "
             "(uvicorn openhands.app_server.app:app --port 3000):"]
    lines += [f"export {k}={shlex.quote(v)}" for k, v in settings.app_env.items()]
    lines += ["# 2. Each user's LLM: its base URL is the gateway (the UI's LLM settings, or):",
              f"curl -sS -X POST {app_url}/api/v1/settings -H 'content-type: application/json' "
              f"-d {shlex.quote(json.dumps(settings.settings))}"]
    lines += [f"# Note: {note}" for note in settings.notes]
    return "\n".join(lines)
