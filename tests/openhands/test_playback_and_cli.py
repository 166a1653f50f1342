"""Playback scripts (JSON and mini-swe-agent traces), the playback server's turn logic, the CLI."""

from __future__ import annotations

import argparse
import gzip
import json
from pathlib import Path

import httpx
import pytest

pytest.importorskip("openhands.sdk", reason="needs the OpenHands env (.venv-openhands)")

from mars_openhands.openhands.cli import _config_from, _tasks_from, add_openhands_subcommand  # noqa: E402
from mars_openhands.openhands.playback import (  # noqa: E402
    RecordedToolCall,
    RecordedTurn,
    Script,
    build_playback_app,
    load_script,
    load_trace_script,
)
from mars_openhands.openhands.policy_check import is_safe_to_replay  # noqa: E402
from mars_openhands.openhands.runner import RunConfig, TaskSpec, events_url_for, run_tasks  # noqa: E402
from tests.openhands._helpers import serve_app  # noqa: E402

pytestmark = pytest.mark.openhands

TRACES = Path("/work/shared/data/traces/mini-swe-agent")


def _trace(tmp_path: Path, commands: list[str]) -> Path:
    messages = [{"role": "system", "content": "sys"}, {"role": "user", "content": "fix it"}]
    for i, command in enumerate(commands):
        messages.append({"role": "assistant", "content": f"step {i}", "tool_calls": [
            {"id": f"c{i}", "type": "function",
             "function": {"name": "bash", "arguments": json.dumps({"command": command})}}],
            "extra": {"response": {"usage": {"completion_tokens": 40 + i}}}})
        messages.append({"role": "tool", "content": "<returncode>0</returncode>", "tool_call_id": f"c{i}"})
    path = tmp_path / "x__y-1.traj.json.gz"
    with gzip.open(path, "wt") as f:
        json.dump({"instance_id": "x__y-1", "messages": messages}, f)
    return path


def test_trace_becomes_terminal_calls_without_dangerous_turns(tmp_path: Path) -> None:
    path = _trace(tmp_path, ["cd /testbed && ls", "sudo apt-get install foo", "grep -rn x /testbed/src"])
    script = load_trace_script(path, is_allowed=is_safe_to_replay)
    assert script.name == "x__y-1"
    assert [t.tool_calls[0].arguments["command"] for t in script.turns] == ["cd . && ls",
                                                                            "grep -rn x ./src"]
    assert {c.name for t in script.turns for c in t.tool_calls} == {"terminal"}
    assert [t.num_completion_tokens for t in script.turns] == [40, 42]
    assert load_script(path) .turns[1].tool_calls[0].arguments["command"] == "sudo apt-get install foo"


@pytest.mark.skipif(not TRACES.exists(), reason="bundled traces not present")
def test_bundled_trace_loads() -> None:
    path = next(TRACES.glob("*/*.traj.json.gz"))
    script = load_trace_script(path, max_turns=10, is_allowed=is_safe_to_replay)
    assert 0 < len(script.turns) <= 10
    assert all(is_safe_to_replay(c.arguments["command"]) for t in script.turns for c in t.tool_calls)


def test_server_plays_turn_by_assistant_count_and_binds_sessions() -> None:
    bound = Script(name="bound", session_id="s-b", turns=(RecordedTurn(content="b0"),))
    free = Script(name="free", turns=(RecordedTurn(content="f0", tool_calls=(
        RecordedToolCall(name="terminal", arguments={"command": "ls"}),)),))

    def ask(client: httpx.Client, session: str, num_assistant: int) -> dict:
        messages = [{"role": "user", "content": "go"}]
        messages += [{"role": "assistant", "content": "x"}] * num_assistant
        r = client.post("/v1/chat/completions", json={"model": "playback", "messages": messages},
                        headers={"X-Mars-Session": session})
        assert r.status_code == 200, r.text
        return r.json()["choices"][0]["message"]

    with serve_app(build_playback_app([bound, free])) as url, httpx.Client(base_url=url) as client:
        assert ask(client, "s-b", 0)["content"] == "b0"
        first = ask(client, "other", 0)
        assert first["content"] == "f0"
        assert json.loads(first["tool_calls"][0]["function"]["arguments"]) == {"command": "ls"}
        done = ask(client, "other", 1)  # past the end: finish
        assert done["tool_calls"][0]["function"]["name"] == "finish"
        streamed = client.post("/v1/chat/completions", json={"messages": [], "stream": True})
        assert streamed.status_code == 400 and "stream=false" in streamed.text


def _parse(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_openhands_subcommand(parser.add_subparsers(dest="command"))
    return parser.parse_args(argv)


def test_cli_builds_config_and_tasks(tmp_path: Path) -> None:
    args = _parse(["openhands", "run", "--backend", "mars", "--url", "http://gw:8000", "--model", "m",
                   "--problem", "fix", "--workspace", str(tmp_path), "--out", str(tmp_path / "o"),
                   "--temperature", "0.5", "--rps", "2"])
    config = _config_from(args)
    assert config.llm.base_url == "http://gw:8000/v1" and config.llm.temperature == 0.5
    assert events_url_for(config.llm) == "http://gw:8000/mars/v1/events"
    [task] = _tasks_from(args)
    assert task.workspace == str(tmp_path) and task.problem_statement == "fix"
    vllm = _config_from(_parse(["openhands", "run", "--backend", "vllm", "--url", "http://e:1/v1",
                                "--model", "m", "--out", "o"]))
    assert vllm.llm.base_url == "http://e:1/v1" and events_url_for(vllm.llm) is None


def test_cli_run_input_errors_are_one_line_and_exit_2(tmp_path: Path, capsys) -> None:
    from mars_openhands.openhands.cli import run_from_args

    base = ["openhands", "run", "--url", "http://127.0.0.1:9", "--model", "m",
            "--out", str(tmp_path / "o")]
    bad_task = tmp_path / "tasks.jsonl"
    bad_task.write_text('{"task_id": "t"}\n')
    cases = [
        (["--tasks", str(tmp_path / "nope.jsonl")], "--tasks: cannot read"),
        (["--tasks", str(bad_task)], "problem_statement: Field required"),
        (["--problem", "p", "--workspace", str(tmp_path), "--rps", "-1"], "--rps: must be > 0"),
        (["--problem", "p", "--workspace", str(tmp_path / "missing")], "is not a directory"),
    ]
    for extra, expected in cases:
        assert run_from_args(_parse(base + extra)) == 2
        err = capsys.readouterr().err
        assert expected in err and "Traceback" not in err and len(err.strip().splitlines()) == 1
    assert not (tmp_path / "o").exists()  # nothing started


def test_run_tasks_rejects_bad_input(tmp_path: Path) -> None:
    config = RunConfig.model_validate({"llm": {"base_url": "http://x/v1", "model": "m"},
                                       "out_dir": str(tmp_path)})
    task = TaskSpec(task_id="a", problem_statement="p", workspace=str(tmp_path))
    with pytest.raises(ValueError, match="rps must be > 0"):
        run_tasks([task], config, rps=0)
    with pytest.raises(ValueError, match="distinct"):
        run_tasks([task, task], config, rps=1)
    with pytest.raises(ValueError, match="session_id must be a UUID"):
        TaskSpec(task_id="a", problem_statement="p", workspace=".", session_id="not-a-uuid")
    with pytest.raises(ValueError, match="extra"):
        RunConfig.model_validate({"llm": {"base_url": "u", "model": "m"}, "out_dir": "o", "bogus": 1})
