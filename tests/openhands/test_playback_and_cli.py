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
TOOLS = [{"type": "function", "function": {"name": "terminal", "parameters": {
    "type": "object", "properties": {"command": {"type": "string"}}}}}]


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
        r = client.post("/v1/chat/completions", json={"model": "playback", "messages": messages,
                                                      "tools": TOOLS},
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


def test_streamed_turns_are_server_sent_events_litellm_reads() -> None:
    """The OpenHands app always streams: a streamed turn is the same turn as chunks, and LiteLLM
    (what the SDK calls) reassembles the text and the tool call."""
    import litellm

    script = Script(name="s", turns=(RecordedTurn(content="looking", tool_calls=(
        RecordedToolCall(name="terminal", arguments={"command": "ls -la"}),)),))
    with serve_app(build_playback_app([script])) as url:
        with httpx.Client(base_url=url) as client:
            raw = client.post("/v1/chat/completions", json={
                "messages": [{"role": "user", "content": "go"}], "tools": TOOLS, "stream": True,
                "stream_options": {"include_usage": True}})
            assert raw.status_code == 200 and raw.headers["content-type"].startswith("text/event-stream")
            assert raw.text.rstrip().endswith("data: [DONE]") and '"usage"' in raw.text
            requests = client.get("/playback/requests").json()["requests"]
        assert requests[-1]["stream"] is True and requests[-1]["turn"] == 0
        chunks = list(litellm.completion(
            model="openai/playback", api_base=f"{url}/v1", api_key="x", stream=True, tools=TOOLS,
            messages=[{"role": "user", "content": "go"}]))
        message = litellm.stream_chunk_builder(chunks).choices[0].message
    assert message.content == "looking"
    [call] = message.tool_calls
    assert call.function.name == "terminal" and json.loads(call.function.arguments) == {"command": "ls -la"}


def test_a_request_without_tools_is_answered_with_text_and_takes_no_turn() -> None:
    """A title request (no tools) gets text, and the session's next agent turn is still turn 0."""
    script = Script(name="s", turns=(RecordedTurn(tool_calls=(
        RecordedToolCall(name="terminal", arguments={"command": "ls"}),)),))
    with serve_app(build_playback_app([script])) as url, httpx.Client(base_url=url) as client:
        body = {"messages": [{"role": "user", "content": "go"}]}
        title = client.post("/v1/chat/completions", json=body, headers={"x-litellm-session-id": "c"})
        message = title.json()["choices"][0]["message"]
        assert message["content"] and "tool_calls" not in message
        turn = client.post("/v1/chat/completions", json={**body, "tools": TOOLS},
                           headers={"x-litellm-session-id": "c"}).json()["choices"][0]["message"]
        assert turn["tool_calls"][0]["function"]["name"] == "terminal"
        assert [r["is_side"] for r in client.get("/playback/requests").json()["requests"]] == [True, False]


def test_playback_is_reachable_from_the_cli_with_help(capsys) -> None:
    from eval.cli import main as top_main

    with pytest.raises(SystemExit) as done:
        top_main(["openhands", "playback", "--help"])
    assert done.value.code == 0
    out = capsys.readouterr().out
    assert "--script" in out and "--upstream-url" in out and "--max-turns" in out


def test_a_missing_script_is_one_line_naming_where_the_traces_are(tmp_path: Path, capsys) -> None:
    from eval.cli import main as top_main

    assert top_main(["openhands", "playback", "--script", str(tmp_path / "nope.traj.json.gz"),
                     "--check"]) == 2
    err = capsys.readouterr().err
    assert "no such file" in err and "../shared/data/traces" in err and "Traceback" not in err
    assert len(err.strip().splitlines()) == 1


def _documented_playback_argv() -> list[str]:
    """The ``playback`` command of docs/openhands.md's playback section, as argv (no shell)."""
    import shlex

    text = (Path(__file__).parents[2] / "docs" / "openhands.md").read_text()
    command = next(block for block in text.split("```bash")[1:] if "openhands playback" in block)
    line = command.split("```")[0].replace("\\\n", " ").strip().splitlines()[0]
    argv = shlex.split(line)
    return argv[argv.index("playback") + 1:]


@pytest.mark.skipif(not TRACES.exists(), reason="bundled traces not present")
def test_the_documented_playback_command_finds_its_trace_from_the_repo_root(tmp_path: Path,
                                                                           monkeypatch, capsys) -> None:
    """The docs' command, run from a repository root whose ../shared holds the traces (the layout
    the README describes), loads its trace (it named a path that did not exist: a traceback)."""
    from eval.cli import main as top_main

    argv = _documented_playback_argv()
    script = Path(argv[argv.index("--script") + 1])
    marker = Path("shared/data/traces/mini-swe-agent")
    relative = Path(*script.parts[script.parts.index("mini-swe-agent") + 1:])
    layout = tmp_path / marker / relative
    layout.parent.mkdir(parents=True)
    layout.symlink_to(TRACES / relative)
    (tmp_path / "repo").mkdir()
    monkeypatch.chdir(tmp_path / "repo")
    monkeypatch.setattr("mars_openhands.openhands.playback._REPO_ROOT", tmp_path / "repo")
    assert top_main(["openhands", "playback", *argv, "--check"]) == 0, capsys.readouterr().err
    assert json.loads(capsys.readouterr().out)["num_turns"] > 0


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
        (["--tasks", str(bad_task)], f"--tasks {bad_task}:1: invalid task: problem_statement: required; add the key"),
        (["--problem", "p", "--workspace", str(tmp_path / "missing")], "is not a directory"),
    ]
    for extra, expected in cases:
        assert run_from_args(_parse(base + extra)) == 2
        err = capsys.readouterr().err
        assert expected in err and "Traceback" not in err and len(err.strip().splitlines()) == 1
    assert not (tmp_path / "o").exists()  # nothing started


def test_a_bad_tasks_line_is_named_with_its_problems_and_no_secret(tmp_path: Path, capsys) -> None:
    """The line number, each problem with its key, an unknown key with the keys a task takes, a
    URL's password hidden (was '--tasks F: a task is invalid: colour: Extra inputs are not
    permitted', no line, and a bad value's URL printed whole)."""
    from mars_openhands.openhands.cli import run_from_args

    tasks = tmp_path / "tasks.jsonl"
    good = {"task_id": "a", "problem_statement": "p", "workspace": str(tmp_path)}
    bad = {"task_id": "b", "problem_statement": "p", "workspace": str(tmp_path),
           "session_id": "https://me:ghp_secret@github.com/o/r", "colour": "ghp_other_secret"}
    tasks.write_text(json.dumps(good) + "\n\n" + json.dumps(bad) + "\n")
    argv = ["openhands", "run", "--url", "http://127.0.0.1:9", "--model", "m", "--tasks", str(tasks),
            "--out", str(tmp_path / "o")]
    assert run_from_args(_parse(argv)) == 2
    err = capsys.readouterr().err
    assert err == (
        f"mars-openhands openhands run: error: --tasks {tasks}:3: invalid task: session_id: session_id "
        "must be a UUID (it is the OpenHands conversation id), got 'https://me:***@github.com/o/r'; omit "
        "it to get a new one; unknown key 'colour'; the keys are: task_id, problem_statement, repo, "
        "base_commit, workspace, session_id\n")
    tasks.write_text(json.dumps(good)[:-1] + ', "repo": "https://tok_secret@github.com/o/r"\n')  # cut
    assert run_from_args(_parse(argv)) == 2
    err = capsys.readouterr().err
    assert f"--tasks {tasks}:1: invalid task: Invalid JSON: " in err and "tok_secret" not in err


def test_run_tasks_rejects_bad_input(tmp_path: Path) -> None:
    config = RunConfig.model_validate({"llm": {"base_url": "http://x/v1", "model": "m"},
                                       "out_dir": str(tmp_path)})
    task = TaskSpec(task_id="a", problem_statement="p", workspace=str(tmp_path))
    with pytest.raises(ValueError, match="rps must be > 0"):
        run_tasks([task], config, rps=0)
    with pytest.raises(ValueError, match="distinct"):
        run_tasks([task, task], config, rps=1)
    other = TaskSpec(task_id="b", problem_statement="p", workspace=str(tmp_path))
    with pytest.raises(ValueError, match="one non-decreasing start per task"):
        run_tasks([task, other], config, rps=1, start_offsets_s=[0.0])
    with pytest.raises(ValueError, match="one non-decreasing start per task"):
        run_tasks([task, other], config, rps=1, start_offsets_s=[1.0, 0.5])
    with pytest.raises(ValueError, match="concurrency must be >= 1"):
        run_tasks([task], config, rps=1, concurrency=0)
    with pytest.raises(ValueError, match="session_id must be a UUID"):
        TaskSpec(task_id="a", problem_statement="p", workspace=".", session_id="not-a-uuid")
    with pytest.raises(ValueError, match="extra"):
        RunConfig.model_validate({"llm": {"base_url": "u", "model": "m"}, "out_dir": "o", "bogus": 1})


def test_recorded_prompts_are_recorded_lengths_and_prefix_consistent(tmp_path: Path) -> None:
    """upstream_prompt=recorded: the engine gets token ids of the recorded prompt length (capped),
    turn k+1's prompt extends turn k's prompt and the engine's output ids, a retry gets the same
    prompt, and the request log joins each answer's id to its handling time."""
    from fastapi import FastAPI

    engine = FastAPI()
    asked: list[dict] = []

    @engine.post("/v1/completions")
    async def complete(body: dict) -> dict:
        asked.append(body)
        out = [7] * body["max_tokens"]
        return {"choices": [{"text": "", "token_ids": out}],
                "usage": {"prompt_tokens": len(body["prompt"]), "completion_tokens": len(out),
                          "total_tokens": len(body["prompt"]) + len(out)}}

    call = RecordedToolCall(name="terminal", arguments={"command": "ls"})
    turns = (RecordedTurn(tool_calls=(call,), num_prompt_tokens=50, num_completion_tokens=5),
             RecordedTurn(tool_calls=(call,), num_prompt_tokens=90, num_completion_tokens=4),
             RecordedTurn(tool_calls=(call,), num_prompt_tokens=500, num_completion_tokens=3))
    script = Script(name="s", turns=turns)
    with serve_app(engine) as engine_url:
        from mars_openhands.openhands.playback import PlaybackConfig

        config = PlaybackConfig(upstream_url=engine_url, upstream_model="m",
                                upstream_prompt="recorded", max_prompt_tokens=120)
        with serve_app(build_playback_app([script], config)) as url, \
                httpx.Client(base_url=url) as client:
            def ask(session: str, num_assistant: int) -> dict:
                messages = [{"role": "user", "content": "go"}]
                messages += [{"role": "assistant", "content": "x"}] * num_assistant
                r = client.post("/v1/chat/completions", headers={"X-Mars-Session": session},
                                json={"messages": messages, "tools": TOOLS})
                assert r.status_code == 200, r.text
                return r.json()
            answers = [ask("a", 0), ask("a", 1), ask("a", 1), ask("a", 2), ask("b", 0)]
            log = client.get("/playback/requests").json()["requests"]
    prompts = [body["prompt"] for body in asked]
    assert [len(p) for p in prompts] == [50, 90, 90, 120, 50]
    assert prompts[1][:55] == prompts[0] + [7] * 5  # prompt_0 + out_0, then fresh ids
    assert prompts[2] == prompts[1]  # a retried turn
    assert prompts[3][:94] == prompts[1] + [7] * 4  # capped at max_prompt_tokens = 120
    assert prompts[4] != prompts[0] and all(0 <= i < 256 for p in prompts for i in p)
    assert all(body["return_token_ids"] and body["ignore_eos"] for body in asked)
    assert [a["usage"]["prompt_tokens"] for a in answers] == [50, 90, 90, 120, 50]
    assert [r["response_id"] for r in log] == [a["id"] for a in answers]
    assert all(r["handle_s"] >= 0 and r["received_wall_s"] > 0 for r in log)


def test_trace_turns_keep_the_recorded_prompt_length(tmp_path: Path) -> None:
    path = _trace(tmp_path, ["ls"])
    data = json.loads(gzip.open(path, "rt").read())
    data["messages"][2]["extra"]["response"]["usage"]["prompt_tokens"] = 1234
    with gzip.open(path, "wt") as f:
        json.dump(data, f)
    assert load_trace_script(path).turns[0].num_prompt_tokens == 1234
