"""The OpenHands env's commands print their own output only (mars_openhands/openhands/quiet.py):
no LiteLLM price-map downloads, no SDK banner or INFO lines, no "Cost calculation failed", and no
"Duplicate tool name registered" from our intended registration over the stock tool names."""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("openhands.sdk", reason="needs the OpenHands env (.venv-openhands)")
pytest.importorskip("dbos", reason="needs DBOS Transact (the 'runtime' extra)")

from mars_openhands.openhands.playback import (  # noqa: E402
    RecordedToolCall,
    RecordedTurn,
    Script,
    build_playback_app,
)
from mars_openhands.openhands.quiet import (  # noqa: E402
    quiet_environment,
    quiet_sdk_logs,
    replacing_stock_tool,
)
from tests.openhands._helpers import serve_app  # noqa: E402

pytestmark = [pytest.mark.openhands, pytest.mark.timeout(300)]
ROOT = Path(__file__).resolve().parents[2]
NOISE = ("LiteLLM", "OpenHands SDK v", "Cost calculation failed", "Duplicate tool name",
         "No persistence_dir", "INFO")


def _clean_env(tmp_path: Path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items()
           if k not in ("LITELLM_LOCAL_MODEL_COST_MAP", "OPENHANDS_SUPPRESS_BANNER", "MARS_OPENHANDS_LOG_LEVEL")}
    return {**env, "MARS_TASK_OUT_DIR": str(tmp_path / "out"), "HOME": str(tmp_path / "home")}


def test_quiet_environment_sets_defaults_only() -> None:
    environ = {"OPENHANDS_SUPPRESS_BANNER": "0"}
    quiet_environment(environ)
    assert environ == {"OPENHANDS_SUPPRESS_BANNER": "0", "LITELLM_LOCAL_MODEL_COST_MAP": "True"}
    with pytest.raises(ValueError, match="MARS_OPENHANDS_LOG_LEVEL"):
        quiet_sdk_logs({"MARS_OPENHANDS_LOG_LEVEL": "LOUD"})


def test_only_the_expected_duplicate_is_dropped(caplog) -> None:
    registry = logging.getLogger("openhands.sdk.tool.registry")
    with caplog.at_level(logging.WARNING, logger="openhands.sdk.tool.registry"), replacing_stock_tool("terminal"):
        registry.warning("Duplicate tool name registered: terminal")
        registry.warning("Duplicate tool name registered: file_editor")
    assert [r.getMessage() for r in caplog.records] == ["Duplicate tool name registered: file_editor"]
    assert not registry.filters


def test_a_durable_openhands_task_prints_only_its_steps(tmp_path: Path) -> None:
    workspace = tmp_path / "calc"
    workspace.mkdir()
    (workspace / "calc.py").write_text("def add(a, b):\n    return a - b\n")
    script = Script(name="fix", turns=(
        RecordedTurn(content="fix", tool_calls=(RecordedToolCall(
            name="terminal", arguments={"command": "sed -i 's/a - b/a + b/' calc.py"}),)),))
    task = {"task_id": "quiet-1", "problem_statement": "add() subtracts; fix it", "workspace": str(workspace),
            "agent": {"kind": "openhands", "base_url": "", "model": "playback"},
            "acceptance": {"command": "python3 -c 'from calc import add; assert add(2, 3) == 5'"}}
    with serve_app(build_playback_app([script])) as url:
        task["agent"]["base_url"] = f"{url}/v1"
        (tmp_path / "task.json").write_text(json.dumps(task))
        proc = subprocess.run([sys.executable, "-m", "eval.cli", "tasks", "submit", str(tmp_path / "task.json"),
                               "--db", str(tmp_path / "tasks.sqlite")], cwd=ROOT, capture_output=True,
                              text=True, timeout=240, env=_clean_env(tmp_path))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    output = proc.stdout + proc.stderr
    assert not [n for n in NOISE if n in output], output
    assert output.splitlines()[0].startswith("[quiet-1] submitted")
    assert '"status": "succeeded"' in output


def test_the_agent_server_registers_over_the_stock_names_without_a_warning(tmp_path: Path) -> None:
    proc = subprocess.run([sys.executable, "-m", "mars_openhands.openhands.agent_server", "--mars-check"],
                          cwd=ROOT, capture_output=True, text=True, timeout=120, env=_clean_env(tmp_path))
    assert proc.returncode == 0, proc.stderr
    report = json.loads(proc.stdout.splitlines()[-1])
    assert report["tools"]["terminal"].startswith("mars_openhands.")  # ours serve the stock name
    assert "Duplicate tool name" not in proc.stderr and "LiteLLM" not in proc.stderr, proc.stderr
