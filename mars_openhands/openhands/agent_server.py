"""``python -m mars_openhands.openhands.agent_server [agent-server flags]``: the stock OpenHands
agent-server with MARS tool events and session lifecycle (design.md §3, §10).

It (1) imports the stock tool modules and then registers the evented, policy-checked tools under
the stock names ``terminal``, ``file_editor`` and ``task_tracker`` (the other way round, the
agent-server's tool router re-registers the stock tools over ours at start-up: no tool events),
(2) tracks each conversation for ``session_start`` / ``session_end``
(:mod:`mars_openhands.openhands.lifecycle`), then (3) runs the stock agent-server's own ``main``
with the given flags (``--host``, ``--port``, ``--import-modules``, ...; ``--help`` lists them).

Configured from the environment (the OpenHands app passes it through ``OH_AGENT_SERVER_ENV``;
``mars-openhands openhands app-env`` prints it):

* ``MARS_EVENTS_URL``: the gateway's ``http://host:port/mars/v1/events`` (unset: no posting);
* ``MARS_EVENTS_PATH``: a JSONL file every event is also appended to (optional);
* ``MARS_POLICY``: ``on`` (default) or ``off``, the pre-tool policy check;
* ``MARS_SESSION_POLL_S``: seconds between conversation status reads (default 0.2);
* ``MARS_BROWSER``: ``auto`` (default): where Chromium is missing, a conversation gets no browser
  tools (one warning) instead of failing to start, as the stock server does when the OpenHands
  app asks for them (it always does); ``stock``: the stock browser tools, as they are;
* ``MARS_AGENT_SERVER_HOST``: the address the server binds when no ``--host`` is given (default
  ``127.0.0.1``: the stock 1.34 server binds all interfaces, and the app's process sandbox passes
  only ``--port``). Our Docker image sets ``0.0.0.0``: inside a container the app's port mapping
  reaches only the container's own interfaces, and what the host exposes is that mapping.

``--mars-check`` prints what would be registered and where events go (one JSON object) and exits
0 without starting a server: the Docker image's entrypoint is tested that way where no Docker
daemon runs.
"""

from __future__ import annotations

import os

from mars_openhands.openhands.quiet import quiet_environment, replacing_stock_tool  # noqa: E402

# Before the SDK import below: LiteLLM otherwise fetches its price map at import (~12 s of retries
# without network, as in a sandbox), and the SDK prints its banner.
quiet_environment()

import json  # noqa: E402
import logging  # noqa: E402
import sys  # noqa: E402
from collections.abc import Mapping, Sequence  # noqa: E402
from importlib import metadata  # noqa: E402
from typing import Any  # noqa: E402

from openhands.sdk.tool import ToolDefinition, register_tool  # noqa: E402

from mars_openhands.openhands.executor import (  # noqa: E402
    ENV_EVENTS_PATH,
    ENV_EVENTS_URL,
    ENV_POLICY,
    EventSender,
    register_evented_tools,
)
from mars_openhands.openhands.lifecycle import (  # noqa: E402
    DEFAULT_POLL_INTERVAL_S,
    ConversationLifecycle,
)

__all__ = ["DEFAULT_HOST", "ENV_BROWSER", "ENV_HOST", "ENV_SESSION_POLL_S",
           "OptionalBrowserToolSet", "bind_argv", "check_report", "install", "main"]

ENV_SESSION_POLL_S = "MARS_SESSION_POLL_S"
"""Seconds between the lifecycle's conversation status reads."""
ENV_BROWSER = "MARS_BROWSER"
"""``auto`` (default) or ``stock``: see :class:`OptionalBrowserToolSet`."""
ENV_HOST = "MARS_AGENT_SERVER_HOST"
"""The address the agent-server binds when its command line has no ``--host``."""
DEFAULT_HOST = "127.0.0.1"
"""Loopback, as everything else we start: the app reaches its process sandbox's server there."""
_PROG = "python -m mars_openhands.openhands.agent_server"
logger = logging.getLogger(__name__)


class OptionalBrowserToolSet(ToolDefinition):
    """The stock browser tool set where Chromium is installed, else no tools (logged once per
    conversation). Registered over the stock name (``browser_tool_set``) with ``MARS_BROWSER=auto``.

    The OpenHands app 1.11 adds the browser to every conversation; without Chromium the stock
    tool set raises while the agent is built, so the conversation never starts.
    """

    @classmethod
    def create(cls, conv_state: Any = None, **params: Any) -> Sequence[ToolDefinition]:
        from openhands.tools.browser_use import BrowserToolSet

        if BrowserToolSet.is_usable():
            return BrowserToolSet.create(conv_state=conv_state, **params)
        logger.warning("Chromium is not installed: conversation %s runs without browser tools "
                       "(%s=stock keeps the stock behaviour: it fails to start)",
                       getattr(conv_state, "id", "?"), ENV_BROWSER)
        return []


def _register_optional_browser() -> None:
    from openhands.tools.browser_use import BrowserToolSet  # registers the stock one first

    OptionalBrowserToolSet.user_selectable = getattr(BrowserToolSet, "user_selectable", True)
    OptionalBrowserToolSet.catalog_description = getattr(BrowserToolSet, "catalog_description", "")
    with replacing_stock_tool(BrowserToolSet.name):
        register_tool(BrowserToolSet.name, OptionalBrowserToolSet)


def install(environ: Mapping[str, str] = os.environ) -> ConversationLifecycle:
    """Register the evented tools under the stock names with a session lifecycle. Idempotent in
    effect (a second call replaces the first's lifecycle in the registry).

    Returns:
        The lifecycle the stock-named tools report to (its sender posts to ``MARS_EVENTS_URL``).

    Raises:
        ValueError: ``MARS_SESSION_POLL_S``, ``MARS_POLICY`` or ``MARS_BROWSER`` is malformed
            (names the variable).
    """
    raw_poll = environ.get(ENV_SESSION_POLL_S, str(DEFAULT_POLL_INTERVAL_S))
    try:
        poll_s = float(raw_poll)
    except ValueError:
        raise ValueError(f"{ENV_SESSION_POLL_S} must be a number of seconds, got {raw_poll!r}") from None
    if environ.get(ENV_POLICY, "on") not in ("on", "off", "1", "0", "true", "false"):
        raise ValueError(f"{ENV_POLICY} must be on or off, got {environ[ENV_POLICY]!r}")
    browser = environ.get(ENV_BROWSER, "auto")
    if browser not in ("auto", "stock"):
        raise ValueError(f"{ENV_BROWSER} must be auto or stock, got {browser!r}")
    if browser == "auto":
        _register_optional_browser()
    sender = EventSender(environ.get(ENV_EVENTS_URL) or None, environ.get(ENV_EVENTS_PATH) or None)
    lifecycle = ConversationLifecycle(sender, poll_interval_s=poll_s)
    register_evented_tools(override_defaults=True, lifecycle=lifecycle)
    return lifecycle


def bind_argv(argv: Sequence[str], environ: Mapping[str, str] = os.environ) -> list[str]:
    """``argv`` with ``--host`` added when it has none: ``$MARS_AGENT_SERVER_HOST``, else
    :data:`DEFAULT_HOST`. An explicit ``--host`` (``--host X`` or ``--host=X``) wins. Pure."""
    if any(arg == "--host" or arg.startswith("--host=") for arg in argv):
        return list(argv)
    return [*argv, "--host", environ.get(ENV_HOST) or DEFAULT_HOST]


def _host_of(argv: Sequence[str]) -> str | None:
    for i, arg in enumerate(argv):
        if arg.startswith("--host="):
            return arg.split("=", 1)[1]
        if arg == "--host" and i + 1 < len(argv):
            return argv[i + 1]
    return None


def check_report(environ: Mapping[str, str] = os.environ,
                 argv: Sequence[str] = ()) -> dict[str, Any]:
    """What serves the stock tool names once the agent-server's tool router is imported (it
    re-registers the stock tools at import, as at server start), and where events go. For
    ``--mars-check``; ``host``: the address the server would bind with ``argv``.

    Mutates: imports ``openhands.agent_server.tool_router`` (registers the stock presets).
    """
    import openhands.agent_server.tool_router  # noqa: F401  (what the server imports at start)
    from openhands.sdk.tool.registry import get_tool_module_qualnames

    def version(dist: str) -> str | None:
        try:
            return metadata.version(dist)
        except metadata.PackageNotFoundError:
            return None

    modules = get_tool_module_qualnames()
    names = ("terminal", "file_editor", "task_tracker", "browser_tool_set")
    tools = {name: modules.get(name) for name in names}
    return {"tools": tools, "events_url": environ.get(ENV_EVENTS_URL) or None,
            "events_path": environ.get(ENV_EVENTS_PATH) or None,
            "policy": environ.get(ENV_POLICY, "on"),
            "host": _host_of(bind_argv(argv, environ)),
            "openhands_agent_server": version("openhands-agent-server"),
            "openhands_sdk": version("openhands-sdk")}


def main(argv: Sequence[str] | None = None) -> int:
    """Install the MARS tools and lifecycle, then run the stock agent-server with ``argv``.

    Returns:
        The exit code (0 after ``--mars-check``; the agent-server's own otherwise, 2 on bad MARS
        settings, with one line on stderr).
    """
    argv = list(sys.argv[1:] if argv is None else argv)
    if "--help" in argv or "-h" in argv:
        print(__doc__.split("\n\n", 1)[1].strip() + "\n\nThe agent-server's own flags:\n")
    try:
        lifecycle = install()
    except ValueError as e:
        print(f"{_PROG}: {e}", file=sys.stderr)
        return 2
    if "--mars-check" in argv:
        print(json.dumps(check_report(argv=[a for a in argv if a != "--mars-check"])))
        lifecycle.close()
        return 0
    from openhands.agent_server.__main__ import main as agent_server_main

    # The agent-server parses sys.argv itself; without --host, 1.34 binds all interfaces.
    sys.argv = [_PROG, *(argv if "--help" in argv or "-h" in argv else bind_argv(argv))]
    try:
        agent_server_main()
    except SystemExit as e:  # --help, bad flags
        return e.code if isinstance(e.code, int) else 0
    finally:
        lifecycle.close()
    return 0


if __name__ == "__main__":
    # Run the imported module, not this __main__ copy: the tool classes registered must be
    # mars_openhands.openhands.agent_server's (the registry records their module).
    from mars_openhands.openhands.agent_server import main as _main

    sys.exit(_main())
