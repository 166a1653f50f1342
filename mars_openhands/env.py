"""Every ``MARS_`` environment variable of the project, declared once (style.md "Config").

A variable is read where it is used, through its entry here (``GATEWAY_API_KEY.get()``) or, for the
older readers, by the name declared here; ``tests/unit/test_env_registry.py`` fails on a
``"MARS_..."`` name in the package, ``eval/`` or ``benchmarks/`` that is not declared. A bad value
fails loudly: :meth:`EnvVar.get_secret` refuses a key with whitespace or control characters,
naming the variable. Standard library only: every layer may import it.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass

from mars_openhands.cli_style import is_usable_key

__all__ = ["API_KEY", "REGISTRY", "EnvVar", "GATEWAY_ADMIN_KEY", "GATEWAY_API_KEY", "GATEWAY_CONFIG"]

REGISTRY: dict[str, EnvVar] = {}
"""Name → declaration of every ``MARS_`` variable (filled at import, never changed after)."""


@dataclass(frozen=True)
class EnvVar:
    """One environment variable: its name, what it sets, and who reads it."""

    name: str
    description: str
    reader: str
    """The file (module or script, as a path from the repository root) that reads it."""

    def get(self, environ: Mapping[str, str] | None = None) -> str | None:
        """The value, or ``None`` when unset or empty. Pure."""
        value = (os.environ if environ is None else environ).get(self.name, "")
        return value or None

    def get_secret(self, environ: Mapping[str, str] | None = None) -> str | None:
        """The value of a key variable (``None``: unset or empty), checked.

        Raises:
            ValueError: the value has whitespace or non-printable characters (a key pasted with
                its newline), naming the variable.
        """
        value = self.get(environ)
        if value is not None and not is_usable_key(value):
            raise ValueError(f"{self.name} has whitespace or control characters ({len(value)} "
                             "characters); set it to the key alone, e.g. export "
                             f"{self.name}=$(python -c 'import secrets; print(secrets.token_urlsafe(32))')")
        return value


def _declare(name: str, description: str, reader: str) -> EnvVar:
    assert name.startswith("MARS_") and name not in REGISTRY, f"bad or duplicate env var {name}"
    var = REGISTRY[name] = EnvVar(name, description, reader)
    return var


GATEWAY_API_KEY = _declare(
    "MARS_GATEWAY_API_KEY", "the standalone gateway's API key (--api-key): OpenAI routes and "
    "POST /mars/v1/events need Authorization: Bearer <key>", "mars_openhands/control/cli.py")
GATEWAY_ADMIN_KEY = _declare(
    "MARS_GATEWAY_ADMIN_KEY", "the gateway's admin key (--admin-key): GET /mars/v1/state with "
    "session ids needs Authorization: Bearer <key> (both gateways)",
    "mars_openhands/control/cli.py, mars_openhands/control/inprocess.py")
GATEWAY_CONFIG = _declare(
    "MARS_GATEWAY_CONFIG", "the in-process gateway's settings (JSON or @file.json)",
    "mars_openhands/control/inprocess.py")
API_KEY = _declare("MARS_API_KEY", "API key the OpenHands LLM client, `replay` and `compare --backend URL` send (Authorization: Bearer)",
                   "mars_openhands/openhands/llm.py, eval/replay.py, eval/backends.py")
_declare("MARS_EVENTS_URL", "the gateway's POST /mars/v1/events URL for OpenHands tools",
         "mars_openhands/openhands/executor.py")
_declare("MARS_EVENTS_PATH", "JSONL file the OpenHands tools append their events to",
         "mars_openhands/openhands/executor.py")
_declare("MARS_POLICY", "on/off: the pre-tool policy check of the OpenHands tools",
         "mars_openhands/openhands/executor.py")
_declare("MARS_SESSION_POLL_S", "seconds between the agent-server's conversation polls",
         "mars_openhands/openhands/agent_server.py")
_declare("MARS_AGENT_SERVER_HOST", "the address our agent-server entry binds when no --host is given "
         "(default 127.0.0.1; the Docker image sets 0.0.0.0)", "mars_openhands/openhands/agent_server.py")
_declare("MARS_BROWSER", "auto/on/off: the browser tool in agent-server conversations",
         "mars_openhands/openhands/agent_server.py")
_declare("MARS_OPENHANDS_LOG_LEVEL", "level of the OpenHands SDK's logs under our commands (default WARNING)",
         "mars_openhands/openhands/quiet.py")
_declare("MARS_WORKSPACE", "workspace of the policy check when the event has none",
         "mars_openhands/openhands/policy_check.py")
_declare("MARS_TASK_OUT_DIR", "where durable OpenHands tasks write their output",
         "mars_openhands/openhands/durable.py")
_declare("MARS_TASKS_DB", "the durable-task database URL", "mars_openhands/runtime/config.py")
_declare("MARS_RUNTIME_CRASH_AT", "crash-injection points of the durable runtime (tests)",
         "mars_openhands/runtime/crash.py")
_declare("MARS_RUNTIME_CRASH_LOG", "where injected crashes are logged (tests)",
         "mars_openhands/runtime/crash.py")
_declare("MARS_IDEMPOTENCY_KEY", "set for a durable tool call's command: its idempotency key",
         "mars_openhands/runtime/tools.py")
_declare("MARS_TASK_ID", "set for a durable tool call's command: its task id",
         "mars_openhands/runtime/tools.py")
_declare("MARS_SERVE_NODE_IP", "the address an engine replica of `mars-openhands serve` reports when it "
         "runs outside a Ray node (tests); inside Ray the node's own IP", "mars_openhands/serve/engine.py")
_declare("MARS_SERVER_OWNER_PID", "set in every vLLM server the project starts: its owner's pid",
         "mars_openhands/engine/harness/launch.py")
_declare("MARS_TRACES_DIR", "directory of the agent traces", "eval/compare_setup.py")
_declare("MARS_SIM_FAST_PATHS", "0 turns the simulator's fast paths off", "eval/sim.py")
_declare("MARS_PYTHON311", "Python 3.11 for the engine env", "scripts/setup.sh")
_declare("MARS_PYTHON312", "Python >= 3.12 for the OpenHands envs", "scripts/setup.sh")
_declare("MARS_FORCE_SETUP", "1 reinstalls the envs", "scripts/setup.sh")
