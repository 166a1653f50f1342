"""Run OpenHands agents on tasks against a MARS gateway, a vLLM server or any OpenAI-compatible URL.

One task = a problem statement plus a repository (copied into a fresh workspace) or an existing
workspace directory. :func:`run_task` runs one OpenHands conversation in this process (terminal, file
editor and task tracker tools, wrapped for events and the policy check) and returns a
:class:`TaskResult`: status, patch (``git diff`` against the starting commit) or changed files, the
task's CPU-plane event stream, timings. :func:`run_tasks` starts many tasks at a fixed arrival rate,
each in its own process and workspace.

Session lifecycle on the stream: ``session_start`` before the first LLM call, then per tool call
``tool_enqueued`` / ``tool_start`` / ``tool_end`` (from the tool wrapper), then ``session_end``
(with the task's status) after the tools are closed and their events flushed, so the gateway sees
the end last and can release the session's KV and admission slot at once.
"""

from __future__ import annotations

import inspect
import json
import os
import shutil
import subprocess
import sys
import time
import uuid
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

from mars_openhands.cli_signals import stop_children
from mars_openhands.openhands.credentials import (
    SESSION_CREDENTIALS,
    SessionCredentials,
    new_session_token,
    persisted_token,
)
from mars_openhands.openhands.endpoint import preflight
from mars_openhands.openhands.executor import (
    EventedToolsCallback,
    EventSender,
    register_evented_tools,
)
from mars_openhands.openhands.llm import ENV_API_KEY, LLMSettings, TurnTracker, build_session_llm
from mars_openhands.process_tree import kill_tree
from mars_openhands.stream.events import SessionEnd, SessionStart, now_stamps

__all__ = ["LLMCall", "RunConfig", "TaskResult", "TaskSpec", "events_url_for", "run_task",
           "run_tasks", "session_credentials"]

TaskStatus = Literal["finished", "error", "stuck", "max_iterations", "timeout"]


class TaskSpec(BaseModel):
    """One agent task. Exactly one of ``repo`` / ``workspace`` must be set."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    task_id: str
    problem_statement: str
    repo: str | None = None
    """A git repository (local path or URL) copied/cloned into a fresh workspace; the patch is the
    ``git diff`` against its checked-out commit (``base_commit`` if given)."""
    base_commit: str | None = None
    workspace: str | None = None
    """An existing directory the agent works in directly (its changes are listed, not diffed)."""
    session_id: str | None = None
    """UUID to use as the conversation and session id (default: a new one)."""

    @field_validator("session_id")
    @classmethod
    def _session_id_is_uuid(cls, value: str | None) -> str | None:
        if value is not None:
            try:
                uuid.UUID(value)
            except ValueError:
                raise ValueError(f"session_id must be a UUID (it is the OpenHands conversation "
                                 f"id), got {value!r}; omit it to get a new one") from None
        return value


class RunConfig(BaseModel):
    """How tasks run. Frozen; unknown keys are an error."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    llm: LLMSettings
    events_url: str | None = None
    """Where CPU-plane events go (default for ``mars``: ``<gateway>/mars/v1/events``; otherwise none)."""
    out_dir: str
    """Per-task directories (workspace, events.jsonl, result.json) are created under it."""
    max_iterations: int = Field(100, ge=1)
    """Agent steps per task before it is stopped (status ``max_iterations``)."""
    policy: bool = True
    """Run the pre-tool policy check (deny dangerous commands)."""
    terminal_type: Literal["tmux", "subprocess"] | None = "subprocess"
    """OpenHands terminal backend; ``subprocess`` keeps the shell a child of the task process (so the
    policy's pid rule recognises the session's own processes). ``None``: the SDK picks (tmux where
    installed). A tmux terminal is a pool of panes: parallel calls need no session lock."""
    tool_concurrency_limit: int = Field(1, ge=1)
    """Tool calls of one LLM response run at most this many at a time (the SDK's
    ``Agent.tool_concurrency_limit``; its default 1 runs them one by one). Above 1 they run side
    by side where the tools' declared resources allow it: a tmux terminal, different files."""
    task_timeout_s: float = Field(3600.0, gt=0)
    """Wall-clock limit per task process in :func:`run_tasks`, seconds."""
    tool_timeout_s: float | None = Field(None, gt=0)
    """The task's bound on one tool call, seconds (``session_start.tool_timeout_s``): past it with
    no ``tool_end`` the gateway closes the call as interrupted, so a killed task frees its slot;
    a call with its own timeout sends its own bound. ``None``: the gateway's default."""


class LLMCall(BaseModel):
    """One LLM call of a task, from the SDK's metrics (``response_latencies``, ``token_usages``)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    response_id: str
    latency_s: float
    num_prompt_tokens: int = 0
    num_completion_tokens: int = 0


class TaskResult(BaseModel):
    """What one task produced."""

    model_config = ConfigDict(extra="forbid")

    task_id: str
    session_id: str
    status: TaskStatus
    error: str | None = None
    workspace: str
    patch: str | None = None
    """``git diff`` of the workspace against the starting commit (repo tasks)."""
    files_changed: list[str] = Field(default_factory=list)
    num_llm_calls: int = 0
    num_tool_calls: int = 0
    num_denied: int = 0
    wall_s: float = 0.0
    """Task time: conversation start to end, seconds."""
    tool_s: float = 0.0
    """Sum of tool execution time (tool_start → tool_end), seconds."""
    events_path: str
    """JSONL of this task's CPU-plane events (as sent to the gateway)."""
    num_events_lost: int = 0
    """Events the gateway never accepted after the sender's retries (in ``events_lost.jsonl``)."""
    conversation_dir: str | None = None
    """The OpenHands conversation as persisted by the SDK (events, state): what ran."""
    resumed: bool = False
    """This run went on with a conversation an earlier run of the task persisted (its events are
    added to the earlier run's in ``events.jsonl``)."""
    events: list[dict[str, Any]] = Field(default_factory=list)
    llm_s: float = 0.0
    """Sum of the agent's LLM call latencies as the SDK measured them (request to whole answer,
    admission wait at a gateway included), seconds."""
    llm_calls: list[LLMCall] = Field(default_factory=list)
    """Each LLM call the SDK recorded, in order."""
    num_prompt_tokens: int = 0
    """Prompt tokens over the task's LLM calls (the endpoint's ``usage``)."""
    num_completion_tokens: int = 0


def _llm_calls(conversation: Any) -> list[LLMCall]:
    """The conversation's LLM calls from the SDK's combined metrics; ``[]`` where the SDK has
    none (SDK 1.14 has no ``conversation_stats``)."""
    stats = getattr(conversation, "conversation_stats", None)
    if stats is None:
        return []
    metrics = stats.get_combined_metrics()
    usage = {u.response_id: u for u in getattr(metrics, "token_usages", [])}
    return [LLMCall(response_id=r.response_id, latency_s=float(r.latency),
                    num_prompt_tokens=getattr(usage.get(r.response_id), "prompt_tokens", 0),
                    num_completion_tokens=getattr(usage.get(r.response_id), "completion_tokens", 0))
            for r in metrics.response_latencies]


def events_url_for(settings: LLMSettings) -> str | None:
    """The gateway events endpoint for ``mars`` (``<base without /v1>/mars/v1/events``), else ``None``."""
    if settings.backend != "mars":
        return None
    root = settings.base_url.rstrip("/")
    return (root[: -len("/v1")] if root.endswith("/v1") else root) + "/mars/v1/events"


def _git(workspace: Path, *args: str) -> str:
    return subprocess.run(["git", *args], cwd=workspace, check=True, capture_output=True,
                          text=True).stdout


def _git_error(e: subprocess.CalledProcessError) -> str:
    """git's own message (its last stderr line) and the command, one line."""
    lines = [line for line in (e.stderr or "").splitlines() if line.strip()]
    command = " ".join(str(a) for a in e.cmd[:3]) if isinstance(e.cmd, list) else str(e.cmd)
    return f"{command} failed: {lines[-1].strip() if lines else f'exit {e.returncode}'}"


def prepare_workspace(task: TaskSpec, task_dir: Path) -> tuple[Path, str | None]:
    """Return ``(workspace, base_commit)``; copies ``task.repo`` into ``task_dir/workspace``.

    Raises:
        ValueError: neither or both of ``repo`` / ``workspace`` are set, ``workspace`` is
            missing, or ``git clone`` / ``checkout`` failed (git's own message, one line).
    """
    if (task.repo is None) == (task.workspace is None):
        raise ValueError(f"task {task.task_id!r}: set exactly one of repo / workspace")
    if task.workspace is not None:
        workspace = Path(task.workspace).resolve()
        if not workspace.is_dir():
            raise ValueError(f"task {task.task_id!r}: workspace {workspace} is not a directory")
        return workspace, None
    workspace = task_dir / "workspace"
    try:
        subprocess.run(["git", "clone", "--quiet", task.repo, str(workspace)], check=True,
                       capture_output=True, text=True)
        if task.base_commit:
            _git(workspace, "checkout", "--quiet", task.base_commit)
        return workspace.resolve(), _git(workspace, "rev-parse", "HEAD").strip()
    except subprocess.CalledProcessError as e:
        raise ValueError(f"task {task.task_id!r}: {_git_error(e)}") from None


def _snapshot(workspace: Path) -> dict[str, float]:
    return {str(p.relative_to(workspace)): p.stat().st_mtime for p in workspace.rglob("*")
            if p.is_file() and ".git" not in p.parts}


def _changes(workspace: Path, base_commit: str | None, before: dict[str, float]) -> tuple[str | None, list[str]]:
    if base_commit is not None:
        _git(workspace, "add", "-A")
        patch = _git(workspace, "diff", "--cached", base_commit)
        names = _git(workspace, "diff", "--cached", "--name-only", base_commit).split()
        _git(workspace, "reset", "--quiet")
        return patch, names
    after = _snapshot(workspace)
    return None, sorted(k for k in after.keys() | before.keys() if before.get(k) != after.get(k))


def _build_conversation(config: RunConfig, workspace: Path, session_id: str, events_path: Path,
                        llm: Any = None, tool_prefix: str = "mars",
                        extra_tool_params: dict[str, Any] | None = None,
                        conversation_dir: Path | None = None,
                        sender: EventSender | None = None,
                        session_token: str | None = None) -> tuple[Any, TurnTracker]:
    """The OpenHands conversation for one task (wrapped tools, per-session LLM) and its turn tracker.

    ``llm`` replaces the per-session LLM, ``tool_prefix`` the registered tool names
    (``<prefix>_terminal``, ...) and ``extra_tool_params`` adds tool spec params; the durable
    runtime's adapter (``durable.py``) passes all three. ``conversation_dir``: where the SDK
    persists the conversation (its events and state), ``None``: not persisted. ``sender``: the
    task's event sender; with one, every other tool the agent runs (custom, MCP, ``think``) is
    evented too (:class:`~mars_openhands.openhands.executor.EventedToolsCallback`).
    ``session_token``: sent on the per-session LLM's calls (see :func:`session_credentials`).
    """
    from openhands.sdk import Agent, Conversation, Tool

    register_evented_tools()
    llm = llm if llm is not None else build_session_llm(config.llm, session_id,
                                                        session_token=session_token)
    tool_params: dict[str, Any] = {
        "mars_events_url": config.events_url or events_url_for(config.llm),
        "mars_events_path": str(events_path), "mars_session_id": session_id,
        "mars_policy": "on" if config.policy else "off", "mars_workspace": str(workspace),
        **(extra_tool_params or {}),
    }
    terminal_params = dict(tool_params)
    if config.terminal_type is not None:
        terminal_params["terminal_type"] = config.terminal_type
    tools = [Tool(name=f"{tool_prefix}_terminal", params=terminal_params),
             Tool(name=f"{tool_prefix}_file_editor", params=tool_params),
             Tool(name=f"{tool_prefix}_task_tracker", params=tool_params)]
    agent_kwargs: dict[str, Any] = {"llm": llm, "tools": tools}
    if config.tool_concurrency_limit != 1 and "tool_concurrency_limit" in Agent.model_fields:
        agent_kwargs["tool_concurrency_limit"] = config.tool_concurrency_limit
    agent = Agent(**agent_kwargs)
    callbacks: list[Any] = [TurnTracker(llm)]
    evented = None
    if sender is not None:
        evented = EventedToolsCallback(session_id, sender, workspace)
        callbacks.append(evented)
    kwargs: dict[str, Any] = {"agent": agent, "workspace": str(workspace),
                              "conversation_id": uuid.UUID(session_id),
                              "callbacks": callbacks,
                              "max_iteration_per_run": config.max_iterations}
    accepted = inspect.signature(Conversation.__new__).parameters
    if conversation_dir is not None and "persistence_dir" in accepted:  # the SDK keeps it there
        kwargs["persistence_dir"] = str(conversation_dir)
    if "visualizer" in accepted or "visualize" not in accepted:
        kwargs["visualizer"] = None
    else:
        kwargs["visualize"] = False
    conversation = Conversation(**kwargs)
    if evented is not None:
        evented.agent = getattr(conversation, "agent", agent)
    tracker = callbacks[0]
    for event in _events_of(conversation):  # a resumed conversation: count its earlier turns
        tracker(event)
    return conversation, tracker


def _events_of(conversation: Any) -> list[Any]:
    """The conversation's events so far (a resumed one's persisted events), ``[]`` if unreadable."""
    try:
        return list(conversation.state.events)
    except Exception:  # an SDK without a readable event log: nothing to seed from
        return []


def _has_user_message(conversation: Any) -> bool:
    """Whether the conversation already holds a user message (a resumed one: the problem)."""
    return any(getattr(e, "source", None) == "user" for e in _events_of(conversation))


def persisted_session(task_dir: Path, session_id: str | None = None) -> str | None:
    """The session id of the conversation an earlier run of the task persisted under
    ``task_dir/conversation`` (the SDK keeps one folder per conversation id), or ``None``.

    Args:
        task_dir: the task's output directory.
        session_id: the task's own session id, if it has one: only that conversation counts.

    Raises:
        ValueError: several conversations and no ``session_id`` to choose (one line).
    """
    root = task_dir / "conversation"
    found = []
    for state in sorted(root.glob("*/base_state.json")) if root.is_dir() else []:
        try:
            found.append(str(uuid.UUID(state.parent.name)))
        except ValueError:
            continue
    if session_id is not None:
        return session_id if session_id in found else None
    if len(found) > 1:
        raise ValueError(f"{root} holds {len(found)} conversations ({', '.join(found)}); give the "
                         "task the session_id of the one to resume, or --overwrite")
    return found[0] if found else None


def session_credentials(config: RunConfig, session_id: str,
                        token: str | None = None) -> SessionCredentials:
    """The session's credentials, registered for this process's event senders: ``token`` (a new
    one if ``None``) and the run's API key (the LLM's, which the gateway also takes on events).
    Forget them with ``SESSION_CREDENTIALS.forget(session_id)`` once the session ended.

    Mutates: :data:`~mars_openhands.openhands.credentials.SESSION_CREDENTIALS`.
    """
    credentials = SessionCredentials(token or new_session_token(),
                                     config.llm.api_key.get_secret_value())
    SESSION_CREDENTIALS.set(session_id, credentials)
    return credentials


def _status_of(conversation: Any) -> TaskStatus:
    status = str(getattr(conversation.state, "execution_status",
                         getattr(conversation.state, "agent_status", "error")))
    status = status.rsplit(".", 1)[-1].lower()
    if status in ("finished", "error", "stuck"):
        return status  # type: ignore[return-value]
    return "max_iterations"  # the run returned without finishing: the iteration cap stopped it


def run_task(task: TaskSpec, config: RunConfig) -> TaskResult:
    """Run one task in this process and return its result (also written to ``result.json``).

    A task whose directory holds the conversation of an earlier run (``conversation/``, kept by
    the SDK) resumes it: the same session id (the task's own, else the persisted one), the same
    workspace (a repo task's copy and starting commit), the earlier steps not run again, the
    problem not sent again; ``events.jsonl`` keeps the earlier run's events (each run is a
    session on the stream) and the result says ``resumed``.

    Raises:
        ValueError: bad task (see :func:`prepare_workspace`).
    """
    task_dir = Path(config.out_dir) / task.task_id
    task_dir.mkdir(parents=True, exist_ok=True)
    events_path = task_dir / "events.jsonl"
    try:
        previous = persisted_session(task_dir, task.session_id)
        session_id = task.session_id or previous or str(uuid.uuid4())
        workspace, base_commit, before = _task_workspace(task, task_dir, is_resumed=bool(previous))
    except ValueError as e:  # the task's own error (bad repo, base_commit), in its result
        return _write(_failed(task, task_dir.parent, "error", str(e)), task_dir)
    # A resumed conversation goes on with the token its LLM sent (the gateway may still bind
    # the session to it: a run killed before its session_end).
    token = persisted_token(task_dir / "conversation", session_id) if previous else None
    credentials = session_credentials(config, session_id, token)
    lifecycle = EventSender(config.events_url or events_url_for(config.llm), events_path)
    lifecycle.emit(SessionStart(**now_stamps(), session_id=session_id, source="agent",
                                tool_timeout_s=config.tool_timeout_s))
    lifecycle.flush()  # the gateway must know the session before tool events arrive
    t0 = time.monotonic()
    status: TaskStatus = "error"
    error = None
    conversation = None
    tracker = None
    calls: list[LLMCall] = []
    try:
        conversation, tracker = _build_conversation(config, workspace, session_id, events_path,
                                                    conversation_dir=task_dir / "conversation",
                                                    sender=lifecycle,
                                                    session_token=credentials.token)
        if not _has_user_message(conversation):  # a resumed conversation has its problem
            conversation.send_message(task.problem_statement)
        conversation.run()
        status = _status_of(conversation)
    except Exception as e:  # the task failed; report it, never lose the result
        error = f"{type(e).__name__}: {e}"
    finally:
        if conversation is not None:
            calls = _llm_calls(conversation)
            conversation.close()  # closes the tool wrappers, which flush their events
        wall_s = time.monotonic() - t0
        lifecycle.emit(SessionEnd(**now_stamps(), session_id=session_id, source="agent",
                                  status="ok" if status == "finished" else status))
        lifecycle.close()
        SESSION_CREDENTIALS.forget(session_id)
    result = _collect(task, session_id, status, error, workspace, base_commit, before, wall_s,
                      events_path, task_dir, tracker.num_responses if tracker else 0)
    return _write(result.model_copy(update={
        "resumed": previous is not None,
        "llm_calls": calls, "llm_s": sum(c.latency_s for c in calls),
        "num_prompt_tokens": sum(c.num_prompt_tokens for c in calls),
        "num_completion_tokens": sum(c.num_completion_tokens for c in calls)}), task_dir)


def _task_workspace(task: TaskSpec, task_dir: Path,
                    is_resumed: bool) -> tuple[Path, str | None, dict[str, float]]:
    """``(workspace, base_commit, snapshot)`` of a run: a fresh one (earlier outputs removed,
    the repository copied), or for a resumed run the earlier run's workspace and starting point.
    ``snapshot``: file mtimes of a ``workspace`` task when it first started (``files_changed``).

    Raises:
        ValueError: see :func:`prepare_workspace`.
    """
    snapshot_path = task_dir / "workspace_snapshot.json"
    base_path = task_dir / "base_commit"
    if is_resumed and (task.workspace is not None or (task_dir / "workspace").is_dir()):
        if task.workspace is not None:
            before = (json.loads(snapshot_path.read_text()) if snapshot_path.exists()
                      else _snapshot(Path(task.workspace).resolve()))
            return Path(task.workspace).resolve(), None, before
        workspace = (task_dir / "workspace").resolve()
        base = base_path.read_text().strip() if base_path.exists() else None
        return workspace, base or _git(workspace, "rev-parse", "HEAD").strip(), {}
    for name in ("events.jsonl", "events_lost.jsonl", "tool_timings.jsonl", "result.json",
                 snapshot_path.name, base_path.name):
        (task_dir / name).unlink(missing_ok=True)
    workspace, base_commit = prepare_workspace(task, task_dir)
    if base_commit is not None:
        base_path.write_text(base_commit + "\n")
        return workspace, base_commit, {}
    before = _snapshot(workspace)
    snapshot_path.write_text(json.dumps(before))
    return workspace, None, before


def _collect(task: TaskSpec, session_id: str, status: TaskStatus, error: str | None,
             workspace: Path, base_commit: str | None, before: dict[str, float], wall_s: float,
             events_path: Path, task_dir: Path, num_llm_calls: int) -> TaskResult:
    # JSONL lines end at "\n" only; str.splitlines() would also split at a raw U+2028 in a string.
    events = [json.loads(line) for line in events_path.read_text().split("\n") if line.strip()]
    lost_path = task_dir / "events_lost.jsonl"
    num_lost = (sum(1 for line in lost_path.read_text().split("\n") if line.strip())
                if lost_path.exists() else 0)
    patch, files = _changes(workspace, base_commit, before)
    ends = [e for e in events if e["kind"] == "tool_end"]
    result = TaskResult(
        task_id=task.task_id, session_id=session_id, status=status, error=error,
        workspace=str(workspace), patch=patch, files_changed=files,
        num_llm_calls=num_llm_calls, num_tool_calls=len(ends),
        num_denied=sum(1 for e in ends if e["status"] == "denied"),
        wall_s=wall_s, tool_s=sum(e["duration_s"] for e in ends),
        events_path=str(events_path), events=events, num_events_lost=num_lost,
        conversation_dir=str(task_dir / "conversation")
        if (task_dir / "conversation").exists() else None,
    )
    return _write(result, task_dir)


def _write(result: TaskResult, task_dir: Path) -> TaskResult:
    (task_dir / "result.json").write_text(result.model_dump_json(indent=1))
    return result


def _check_run(tasks: Sequence[TaskSpec], config: RunConfig, rps: float, overwrite: bool,
               resume: bool = False) -> None:
    """Input checks of :func:`run_tasks` (see there); with ``overwrite``, deletes reused task
    directories; with ``resume``, keeps them."""
    if overwrite and resume:
        raise ValueError("--overwrite and --resume exclude each other: --resume goes on with the "
                         "tasks' conversations, --overwrite starts them again")
    if rps <= 0:
        raise ValueError(f"rps must be > 0 tasks per second, got {rps} (--rps)")
    ids = [t.task_id for t in tasks]
    duplicates = sorted({i for i in ids if ids.count(i) > 1})
    if duplicates:
        raise ValueError(f"task_id values must be distinct (each task gets out_dir/<task_id>); "
                         f"repeated: {', '.join(duplicates)}")
    out = Path(config.out_dir)
    used = [i for i in ids if (out / i).exists()]
    if used and not (overwrite or resume):
        raise ValueError(f"--out {out} already holds task {used[0]} ({out / used[0]}"
                         f"{', and ' + str(len(used) - 1) + ' more' if len(used) > 1 else ''}); "
                         "pass --resume to go on with its conversation, --overwrite to replace "
                         "its results and workspace, or choose another --out")
    for task_id in used if overwrite else ():
        shutil.rmtree(out / task_id)


def run_tasks(tasks: Sequence[TaskSpec], config: RunConfig, rps: float,
              python: str | None = None, overwrite: bool = False,
              check_endpoint: bool = True, start_offsets_s: Sequence[float] | None = None,
              concurrency: int | None = None,
              extra_env: dict[str, str] | None = None, resume: bool = False) -> list[TaskResult]:
    """Run tasks concurrently, each in its own process, started at a fixed rate of ``rps`` per second.

    Task ``i`` starts at ``i / rps`` seconds (open loop), or at ``start_offsets_s[i]`` (e.g. Poisson
    arrivals), or, with ``concurrency``, as soon as fewer than that many tasks run (closed loop,
    in order; ``rps`` and ``start_offsets_s`` are then ignored). Each process runs
    ``python -m mars_openhands.openhands.cli run-one`` with the task and config as JSON files;
    the API key reaches it as ``MARS_API_KEY`` (``run_config.json`` holds ``**********``).

    Args:
        tasks: the tasks (distinct ``task_id``).
        config: shared run config.
        rps: arrival rate, tasks per second (> 0).
        python: interpreter for the task processes (default: this one).
        overwrite: delete what an earlier run left in ``out_dir/<task_id>`` (else refuse).
        resume: a task whose ``out_dir/<task_id>`` exists goes on with the conversation its
            earlier run persisted there (same session id and workspace; see :func:`run_task`).
        check_endpoint: run :func:`preflight` first.
        start_offsets_s: per-task start times, seconds after the first start (non-decreasing).
        concurrency: at most this many tasks at once (>= 1).
        extra_env: added to the task processes' environment (their tools inherit it).

    Returns:
        Results in task order; a process that died or timed out yields status ``error`` /
        ``timeout`` with its own error (from its ``result.json``, else its log's last line).

    Raises:
        ValueError: ``rps`` <= 0, duplicate task ids, a reused task directory without
            ``overwrite`` or ``resume`` (or both), ``start_offsets_s`` of another length or
            decreasing, ``concurrency``
            < 1, or a failed pre-flight check; one line each, before any task starts.
    """
    _check_run(tasks, config, rps, overwrite, resume)
    if start_offsets_s is not None and (len(start_offsets_s) != len(tasks) or any(
            b < a for a, b in zip(start_offsets_s, start_offsets_s[1:], strict=False))):
        raise ValueError(f"start_offsets_s must hold one non-decreasing start per task "
                         f"({len(tasks)}), got {list(start_offsets_s)[:5]}...")
    if concurrency is not None and concurrency < 1:
        raise ValueError(f"concurrency must be >= 1 task, got {concurrency} (--concurrency)")
    if check_endpoint:
        llm = config.llm
        preflight(llm.base_url, llm.api_key.get_secret_value(), llm.backend)
    out = Path(config.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / "run_config.json").write_text(config.model_dump_json(indent=1))
    env = {**os.environ, "LITELLM_LOCAL_MODEL_COST_MAP": "True", "OPENHANDS_SUPPRESS_BANNER": "1",
           ENV_API_KEY: config.llm.api_key.get_secret_value(), **(extra_env or {})}
    procs: list[tuple[TaskSpec, subprocess.Popen[bytes], float]] = []
    offsets = list(start_offsets_s) if start_offsets_s is not None else [i / rps for i in
                                                                          range(len(tasks))]
    t0 = time.monotonic()
    try:
        for i, task in enumerate(tasks):
            if concurrency is None:
                time.sleep(max(0.0, t0 + offsets[i] - time.monotonic()))
            else:
                while sum(1 for _, p, _ in procs if p.poll() is None) >= concurrency:
                    time.sleep(0.05)
            procs.append((task, _start_task(task, out, python, env), time.monotonic()))
        return [_wait(task, proc, started, config, out) for task, proc, started in procs]
    except BaseException:  # Ctrl-C, SIGTERM (cli_signals.sigterm_exits), an error: no task outlives us
        _stop_tasks([proc for _, proc, _ in procs])
        raise


def _stop_tasks(procs: list[subprocess.Popen[bytes]], grace_s: float = 5.0) -> None:
    """SIGTERM the process group of every task still running (each unwinds and ends its tools),
    then freeze and SIGKILL the whole process tree of each still running after ``grace_s``
    seconds: its terminal's shell runs in a session of its own, out of the group's reach
    (:func:`~mars_openhands.cli_signals.stop_children`). Mutates: signals processes."""
    stop_children(procs, grace_s, signal_group=True)


def _start_task(task: TaskSpec, out: Path, python: str | None,
                env: dict[str, str]) -> subprocess.Popen[bytes]:
    """Start ``task``'s ``run-one`` process (own process group, log in ``process.log``; it ends
    its whole process tree once this process is gone: ``--exit-with-parent``)."""
    (out / task.task_id).mkdir(parents=True, exist_ok=True)
    task_file = out / task.task_id / "task.json"
    task_file.write_text(task.model_dump_json())
    log = (out / task.task_id / "process.log").open("wb")
    return subprocess.Popen(
        [python or sys.executable, "-m", "mars_openhands.openhands.cli", "run-one",
         "--task", str(task_file), "--config", str(out / "run_config.json"),
         "--exit-with-parent", str(os.getpid())],  # a SIGKILLed runner leaves no task running
        stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True)


def _wait(task: TaskSpec, proc: subprocess.Popen[bytes], started_s: float, config: RunConfig,
          out: Path) -> TaskResult:
    try:
        proc.wait(timeout=max(1.0, started_s + config.task_timeout_s - time.monotonic()))
    except subprocess.TimeoutExpired:
        kill_tree(proc.pid, 0.0)  # the task with its tools, in sessions of their own too
        proc.wait()
        return _failed(task, out, "timeout", f"task exceeded task_timeout_s={config.task_timeout_s}")
    result_path = out / task.task_id / "result.json"
    if result_path.exists():  # the task's own account, errors included (exit 3)
        return TaskResult.model_validate_json(result_path.read_text())
    log_path = out / task.task_id / "process.log"
    return _failed(task, out, "error", f"task process exited {proc.returncode}: "
                   f"{_last_line(log_path)} (see {log_path})")


def _last_line(path: Path) -> str:
    """The last non-empty line of a log (a traceback's exception), or ``"no output"``."""
    try:
        lines = [line.strip() for line in path.read_text(errors="replace").splitlines() if line.strip()]
    except OSError:
        return "no output"
    return lines[-1][:500] if lines else "no output"


def _failed(task: TaskSpec, out: Path, status: TaskStatus, error: str) -> TaskResult:
    return TaskResult(task_id=task.task_id, session_id=task.session_id or "", status=status,
                      error=error, workspace=task.workspace or str(out / task.task_id / "workspace"),
                      events_path=str(out / task.task_id / "events.jsonl"))
