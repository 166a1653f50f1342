"""``mars-openhands openhands run``: OpenHands agents on tasks with ``--backend mars|vllm|url``;
``... playback`` (the playback engine) and ``... app-env`` (the OpenHands app's settings for a
MARS gateway, :mod:`mars_openhands.openhands.app_env`).

Also ``python -m mars_openhands.openhands.cli run-one --task T.json --config C.json`` (one task in
this process; what :func:`runner.run_tasks` starts per task) and ``... playback`` (the playback
engine, see ``playback.py``).

Tasks come from ``--tasks FILE`` (JSONL of :class:`TaskSpec`: ``task_id``, ``problem_statement``,
``repo`` or ``workspace``, optional ``base_commit``) or from one ``--problem`` plus ``--repo`` /
``--workspace``.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from mars_openhands.cli_signals import end_with_parent, sigterm_exits
from mars_openhands.cli_style import (
    CliParser,
    cli_error,
    config_error_lines,
    keys_hint,
    non_negative_float,
    positive_float,
    positive_fraction,
    positive_int,
)

__all__ = ["add_openhands_subcommand", "main"]

def _has_openhands_sdk() -> bool:
    # "openhands.sdk", not "openhands": with tests/ on sys.path, tests/openhands/ is an "openhands".
    try:
        return importlib.util.find_spec("openhands.sdk") is not None
    except ModuleNotFoundError:
        return False


if not _has_openhands_sdk():  # the top-level CLI lists it as unavailable
    raise ImportError("the OpenHands SDK is not installed here (needs Python >= 3.12 and the "
                      "'openhands' extra; use .venv-openhands)", name="openhands")


def _add_run_flags(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--backend", choices=("mars", "vllm", "url"), default="mars",
                        help="mars: through the MARS gateway (events posted to it); vllm: a vLLM "
                             "server directly (session_id + vllm_xargs in the body); url: any "
                             "OpenAI-compatible endpoint (session header only)")
    parser.add_argument("--url", required=True,
                        help="endpoint root, e.g. http://127.0.0.1:8000 (/v1 is added if missing)")
    parser.add_argument("--model", required=True, help="served model name")
    parser.add_argument("--api-key", default=os.environ.get("MARS_API_KEY", "EMPTY"),
                        help="API key (default $MARS_API_KEY or EMPTY); never written to --out")
    parser.add_argument("--temperature", type=non_negative_float, default=None,
                        help="sampling temperature sent with every LLM call (default: the server's)")
    parser.add_argument("--top-p", type=positive_fraction, default=None,
                        help="nucleus sampling top_p sent with every LLM call (default: the server's)")
    parser.add_argument("--max-output-tokens", type=positive_int, default=None, help="tokens per completion")
    parser.add_argument("--events-url", default=None,
                        help="CPU-plane events endpoint (default for mars: <url>/mars/v1/events)")
    parser.add_argument("--tasks", type=Path, default=None, help="JSONL of tasks")
    parser.add_argument("--problem", default=None, help="problem statement of a single task")
    parser.add_argument("--problem-file", type=Path, default=None, help="... read from a file")
    parser.add_argument("--repo", default=None, help="git repo to copy into the task's workspace")
    parser.add_argument("--base-commit", default=None,
                        help="with --repo: check this commit out in the task's copy (default: HEAD)")
    parser.add_argument("--workspace", default=None, help="existing directory to work in")
    parser.add_argument("--out", type=Path, required=True, help="output directory")
    parser.add_argument("--overwrite", action="store_true",
                        help="replace what an earlier run left in --out/<task_id> (default: refuse)")
    parser.add_argument("--resume", action="store_true",
                        help="tasks an earlier run left in --out go on with their conversation "
                             "(same session, workspace and steps so far)")
    parser.add_argument("--rps", type=positive_float, default=1.0,
                        help="task arrivals per second, at fixed gaps (default 1)")
    parser.add_argument("--max-iterations", type=positive_int, default=100,
                        help="agent steps per task before OpenHands stops it (default 100)")
    parser.add_argument("--no-policy", action="store_true", help="disable the pre-tool policy check")
    parser.add_argument("--terminal-type", choices=("subprocess", "tmux"), default="subprocess",
                        help="the agent's terminal: subprocess (default; one shell, calls take "
                             "turns) or tmux (a pane per parallel call)")
    parser.add_argument("--tool-concurrency", type=positive_int, default=1,
                        help="tool calls of one LLM response run at most this many at a time "
                             "(default 1, the SDK's: one by one)")
    parser.add_argument("--task-timeout-s", type=positive_float, default=3600.0,
                        help="wall-clock bound on one task, seconds; past it the task's process is "
                             "stopped and the task reported as error (default 3600)")
    parser.add_argument("--tool-timeout-s", type=positive_float, default=None,
                        help="bound on one tool call, seconds, sent with session_start: past it "
                             "with no tool_end the gateway closes the call as interrupted (a dead "
                             "agent); default: the gateway's --tool-call-timeout-s")


def _config_from(args: argparse.Namespace) -> Any:
    from mars_openhands.openhands.llm import LLMSettings
    from mars_openhands.openhands.runner import RunConfig

    url = args.url.rstrip("/")
    base_url = url if url.endswith("/v1") else url + "/v1"
    llm = LLMSettings(backend=args.backend, base_url=base_url, model=args.model,
                      api_key=args.api_key, temperature=args.temperature, top_p=args.top_p,
                      max_output_tokens=args.max_output_tokens)
    return RunConfig(llm=llm, events_url=args.events_url, out_dir=str(args.out),
                     max_iterations=args.max_iterations, policy=not args.no_policy,
                     terminal_type=args.terminal_type, tool_concurrency_limit=args.tool_concurrency,
                     task_timeout_s=args.task_timeout_s, tool_timeout_s=args.tool_timeout_s)


def _tasks_from(args: argparse.Namespace) -> list[Any]:
    from mars_openhands.openhands.runner import TaskSpec

    if args.tasks is not None:
        return _read_tasks(args.tasks)
    problem = args.problem_file.read_text() if args.problem_file else args.problem
    if not problem:
        raise ValueError("--tasks: no tasks given; pass --tasks FILE, or --problem/--problem-file with "
                         "--repo or --workspace")
    return [TaskSpec(task_id="task-0", problem_statement=problem, repo=args.repo,
                     base_commit=args.base_commit, workspace=args.workspace)]


def _read_tasks(path: Path) -> list[Any]:
    """The :class:`TaskSpec` of each non-blank line of a ``--tasks`` JSONL file.

    Raises:
        ValueError: an invalid line, one line naming the file, the line number and each problem
            (:func:`~mars_openhands.cli_style.config_error_lines`: ``--tasks t.jsonl:2: invalid
            task: problem_statement: required; add the key``; an unknown key lists the keys).
        OSError: the file cannot be read.
    """
    from pydantic import ValidationError

    from mars_openhands.openhands.runner import TaskSpec

    tasks = []
    for number, line in enumerate(path.read_text().splitlines(), start=1):
        if not line.strip():
            continue
        try:
            tasks.append(TaskSpec.model_validate_json(line))
        except ValidationError as e:
            problems = "; ".join(config_error_lines(e, key_prefix="", unknown_key_hint=keys_hint(TaskSpec)))
            raise ValueError(f"--tasks {path}:{number}: invalid task: {problems}") from None
    return tasks


def _checked_inputs(args: argparse.Namespace) -> tuple[list[Any], Any]:
    """The tasks and run config, checked before any task process starts.

    The flags' ranges (``--rps`` > 0, ...) are checked by their argparse types, at parsing.

    Raises:
        ValueError: an unreadable or invalid ``--tasks`` line (the message names the file, line
            and field), or a task's ``workspace`` that is not a directory.
    """
    try:
        tasks = _tasks_from(args)
    except OSError as e:
        raise ValueError(f"--tasks: cannot read {args.tasks} ({e.strerror or e})") from None
    for task in tasks:
        if task.workspace is not None and not Path(task.workspace).is_dir():
            raise ValueError(f"task {task.task_id}: workspace {task.workspace} is not a directory "
                             "(create it first, or give --repo to start from a copy)")
    return tasks, _config_from(args)


def run_from_args(args: argparse.Namespace) -> int:
    """``openhands run``: run the tasks, print one JSON summary line per task; exit 1 if any
    errored, 2 on bad input, 130 on Ctrl-C (one line: the task processes are stopped, and
    ``--resume`` goes on with their conversations)."""
    from mars_openhands.openhands.quiet import quiet_environment, quiet_sdk_logs

    quiet_environment()  # before the SDK import (LiteLLM's price-map download, the banner)
    from mars_openhands.openhands.runner import run_tasks

    quiet_sdk_logs()

    try:
        tasks, config = _checked_inputs(args)
        results = run_tasks(tasks, config, rps=args.rps, overwrite=args.overwrite,
                            resume=args.resume)
    except ValueError as e:  # pydantic's ValidationError too
        return max(cli_error("mars-openhands openhands run", line) for line in str(e).splitlines())
    except KeyboardInterrupt:  # run_tasks has stopped every task process (its except clause)
        print(f"mars-openhands openhands run: interrupted; the tasks were stopped and what they did "
              f"is in {args.out}: run the same command with --resume to go on with them",
              file=sys.stderr)
        return 130
    for r in results:
        print(json.dumps({"task_id": r.task_id, "status": r.status, "wall_s": round(r.wall_s, 3),
                          "tool_s": round(r.tool_s, 3), "llm_calls": r.num_llm_calls,
                          "tool_calls": r.num_tool_calls, "denied": r.num_denied,
                          "events_lost": r.num_events_lost, "files_changed": r.files_changed,
                          "error": r.error}))
    return 1 if any(r.status == "error" for r in results) else 0


def run_one_from_args(args: argparse.Namespace) -> int:
    """``run-one``: one task in this process (the per-task process of ``run_tasks``; the API key
    comes from ``MARS_API_KEY``)."""
    from pydantic import SecretStr

    from mars_openhands.openhands.llm import ENV_API_KEY
    from mars_openhands.openhands.runner import RunConfig, TaskSpec, run_task

    if getattr(args, "exit_with_parent", None) is not None:
        end_with_parent(args.exit_with_parent)  # a killed runner leaves no task running
    task = TaskSpec.model_validate_json(args.task.read_text())
    config = RunConfig.model_validate_json(args.config.read_text())
    # run_config.json holds "**********", never the key. Taken out of the environment before any
    # tool starts: the agent's terminal inherits this process's environment.
    api_key = os.environ.pop(ENV_API_KEY, None)
    if api_key:
        config = config.model_copy(update={"llm": config.llm.model_copy(
            update={"api_key": SecretStr(api_key)})})
    result = run_task(task, config)
    return 0 if result.status != "error" else 3


def _add_app_env(sub: Any) -> None:
    from mars_openhands.openhands.app_env import APP_AGENT_SERVER_VERSION, DEFAULT_IMAGE_REPOSITORY

    p = sub.add_parser("app-env", help="print what an OpenHands app user sets for a MARS backend",
                       description="The OpenHands app's environment and per-user LLM settings "
                                   "for a MARS gateway (docs/openhands.md, 'OpenHands app').")
    p.add_argument("--gateway", required=True, help="the gateway's root, e.g. http://127.0.0.1:8000")
    p.add_argument("--sandbox", choices=("process", "docker"), default="process",
                   help="process: the app runs agent-servers as local processes (no Docker); "
                        "docker: in containers of our agent-server image")
    p.add_argument("--model", default=None,
                   help="served model name (default: the gateway's first /v1/models entry)")
    p.add_argument("--api-key", default="EMPTY", help="the key the gateway expects (default EMPTY)")
    p.add_argument("--image-repository", default=DEFAULT_IMAGE_REPOSITORY, help="docker: image")
    p.add_argument("--agent-server-version", default=APP_AGENT_SERVER_VERSION,
                   help="docker: the agent-server version the app pins (image tag <v>-python)")
    p.add_argument("--app-url", default="http://localhost:3000", help="the app, for the curl line")
    p.add_argument("--format", choices=("shell", "json"), default="shell",
                   help="shell (default): export lines and the curl that sets a user's LLM, with "
                        "comments; json: the same settings as one object")
    p.add_argument("--no-check", action="store_true",
                   help="do not ask the gateway (needs --model)")
    p.set_defaults(func=app_env_from_args)


def app_env_from_args(args: argparse.Namespace) -> int:
    """``openhands app-env``: check the gateway, print the settings; exit 2 on bad input."""
    from mars_openhands.openhands.app_env import app_settings, render_shell

    try:
        model = args.model or (None if args.no_check else _first_model(args.gateway, args.api_key))
        if not args.no_check:
            from mars_openhands.openhands.endpoint import preflight

            preflight(args.gateway, args.api_key, "mars", flag="--gateway")
        if model is None:
            raise ValueError("--model is needed with --no-check")
        settings = app_settings(args.gateway, model, args.sandbox, args.api_key,
                                args.image_repository, args.agent_server_version)
    except ValueError as e:
        return cli_error("mars-openhands openhands app-env", str(e).splitlines()[0])
    print(settings.model_dump_json(indent=1) if args.format == "json"
          else render_shell(settings, args.app_url))
    return 0


def _first_model(gateway: str, api_key: str) -> str | None:
    """The gateway's first served model, or ``None`` when it cannot say (pre-flight says why)."""
    import httpx

    try:
        data = httpx.get(f"{gateway.rstrip('/').removesuffix('/v1')}/v1/models", timeout=5.0,
                         headers={"authorization": f"Bearer {api_key}"}).json()
        return str(data["data"][0]["id"])
    except (httpx.HTTPError, ValueError, KeyError, IndexError, TypeError):
        return None


def add_openhands_subcommand(subparsers: Any) -> argparse.ArgumentParser:
    """Register ``openhands`` (with ``run`` and ``playback``) on the top-level CLI's subparsers."""
    parser = subparsers.add_parser("openhands", help="run OpenHands agents with the MARS backend flag")
    sub = parser.add_subparsers(dest="openhands_command", metavar="<openhands-command>")
    run = sub.add_parser("run", help="run tasks at --rps, each in its own process and workspace",
                         description="Run OpenHands agents on tasks, each in its own process and "
                                     "workspace, arriving at --rps, against a MARS gateway, a vLLM "
                                     "server or any OpenAI-compatible endpoint (--backend); prints "
                                     "one JSON line per task (docs/openhands.md, 'Running tasks').")
    _add_run_flags(run)
    run.set_defaults(func=run_from_args)
    _add_playback(sub)
    _add_app_env(sub)
    return parser


def _add_playback(sub: Any) -> None:
    from mars_openhands.openhands.playback import add_playback_flags

    add_playback_flags(sub.add_parser(
        "playback", help="serve recorded assistant turns (no model needed)",
        description="An OpenAI-compatible server answering with recorded assistant turns "
                    "(docs/openhands.md, 'Playback')."))


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m mars_openhands.openhands.cli {run,run-one,playback} ...``."""
    parser = CliParser(prog="mars-openhands-openhands")
    sub = parser.add_subparsers(dest="command", required=True)
    run = sub.add_parser("run")
    _add_run_flags(run)
    run.set_defaults(func=run_from_args)
    one = sub.add_parser("run-one")
    one.add_argument("--task", type=Path, required=True)
    one.add_argument("--config", type=Path, required=True)
    one.add_argument("--exit-with-parent", type=int, default=None, metavar="PID",
                     help="end this task (its process tree: the agent's tools too) once the "
                          "runner PID is gone, even if it was SIGKILLed")
    one.set_defaults(func=run_one_from_args)
    _add_playback(sub)
    args = parser.parse_args(argv)
    with sigterm_exits():  # SIGTERM unwinds: `run` stops its task processes
        return int(args.func(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
