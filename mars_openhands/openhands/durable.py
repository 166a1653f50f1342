"""OpenHands tasks on the durable runtime: the ``openhands`` driver (design.md §11; docs/tasks.md).

:func:`run_openhands_task` runs one OpenHands conversation inside the task's workflow. Its LLM is
a :class:`DurableLLM` (an SDK ``LLM`` subclass, as the SDK's own ``TestLLM``): every ``completion``
is a runtime LLM step, so after a restart the recorded responses are returned instead of asking the
model. Its tools are the evented MARS tools with one more wrapper, :class:`DurableExecutor`: every
call goes through the runtime's gate, approvals and effect protocol, and a recorded observation is
returned instead of running the tool again. On a restart the conversation is rebuilt from the task's
log this way (the same responses and observations, in order) and goes on live after the last
recorded step.

Pointed at a MARS gateway (its ``GET /mars/v1/healthz`` answers as one), a task takes the path a
plain ``openhands run --backend mars`` takes: the session header and turn metadata on its LLM
calls, ``session_start`` / tool events / ``session_end`` posted to the gateway (so the gateway
keeps the session, its turn count and the engine's pinned KV through the tool calls), and the
task's session token (kept in the runtime's database: a resumed task, in any process, sends the
same) on both. Any other endpoint gets the ``url`` backend (the session header only).

Known limits: a replayed terminal command is not run again, so the shell of a resumed conversation
starts fresh (working directory, exported variables); the file editor's undo history starts empty
(a retried ``undo_edit`` fails, and says that its first attempt may have undone the edit). A file
edit retried after a restart is answered without running when its effect is in the file already
(:meth:`DurableExecutor._retry_answer`): the editor's ``create`` refuses an existing file, and its
``insert`` would insert its lines twice.
The command guard runs in the gate, so the tool wrapper's own check is off here.
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from openhands.sdk import LLM
from openhands.sdk.llm import LLMResponse, Message
from openhands.sdk.tool import ToolExecutor, register_tool
from pydantic import PrivateAttr

from mars_openhands.openhands.credentials import SESSION_CREDENTIALS
from mars_openhands.openhands.executor import (
    EventedExecutor,
    EventSender,
    MarsFileEditorTool,
    MarsTaskTrackerTool,
    MarsTerminalTool,
    WrappingExecutor,
    _denied_observation,
    _text_observation,
)
from mars_openhands.openhands.llm import Backend, LLMSettings, build_session_llm
from mars_openhands.openhands.quiet import quiet_sdk_logs
from mars_openhands.openhands.runner import (
    RunConfig,
    _build_conversation,
    _status_of,
    events_url_for,
    session_credentials,
)
from mars_openhands.runtime.agent import session_id_of
from mars_openhands.runtime.engine import AgentOutcome
from mars_openhands.runtime.run import ExecContext, TaskRun
from mars_openhands.stream.events import SessionEnd, SessionStart, now_stamps

__all__ = ["DurableExecutor", "DurableLLM", "backend_of", "register_durable_tools",
           "run_openhands_task"]

_RUNS: dict[str, TaskRun] = {}  # task id -> its TaskRun while the conversation runs (tool lookup)
_RUNS_LOCK = threading.Lock()


def _usage_of(response: LLMResponse) -> dict[str, Any]:
    usage = getattr(response.raw_response, "usage", None)
    get = (lambda k: getattr(usage, k, 0) or 0) if usage is not None else (lambda k: 0)
    cost = getattr(response.metrics, "accumulated_cost", None)
    return {"prompt_tokens": int(get("prompt_tokens")), "completion_tokens": int(get("completion_tokens")),
            **({"cost_usd": float(cost)} if cost else {})}


def _rebuild(recorded: dict[str, Any]) -> LLMResponse:
    """An ``LLMResponse`` from its recorded form (message, usage, raw response dict)."""
    from litellm.types.utils import ModelResponse
    from openhands.sdk.llm.utils.metrics import MetricsSnapshot

    return LLMResponse(message=Message.model_validate(recorded["message"]),
                       metrics=MetricsSnapshot.model_validate(recorded["metrics"]),
                       raw_response=ModelResponse(**recorded["raw"]))


_LOST_UNDO_NOTE = ("[runtime] this undo_edit of {path} was retried after a restart: its first attempt "
                   "may have undone the last edit already, and the editor's undo history does not "
                   "survive a restart. View the file to see its state, then edit it directly.")


def _edit_path(arguments: dict[str, Any], workspace: Path) -> Path:
    """The file a file-editor call names (its ``path``; a relative one under ``workspace``)."""
    return Path(os.path.normpath(workspace / str(arguments.get("path", ""))))


def _create_retry_answer(path: Path, arguments: dict[str, Any]) -> tuple[str, bool] | None:
    """The answer ``(text, is_error)`` to a retried ``create`` of ``path``, or ``None`` to run it.

    Pure but for reading ``path``. The file editor refuses to ``create`` over an existing file, so
    a retry whose first attempt wrote the file would fail. Here, when the file holds exactly
    ``file_text`` (no newline translation; UTF-8, as the editor writes a new file), the retry is
    answered as applied; when it holds anything else the answer is the conflict, an error that
    says so; when it cannot be read (missing, a directory) the editor runs and answers.
    """
    try:
        data = path.read_bytes()
    except OSError:
        return None
    file_text = str(arguments.get("file_text", ""))
    try:
        is_same = data.decode("utf-8") == file_text
    except UnicodeDecodeError:
        is_same = False
    if is_same:
        return (f"[runtime] the create of {arguments.get('path')} was already applied before a "
                "restart (the file holds exactly this file_text)"), False
    return (f"File already exists at: {arguments.get('path')}, and its content differs from this "
            "create's file_text. Cannot overwrite files using command `create`: view the file, then "
            "edit it with `str_replace`. [runtime: checked when the create was retried after a "
            "restart]"), True


def _insert_applied(text: str, insert_line: Any, new_str: str) -> bool:
    """Whether ``text`` has, right after its first ``insert_line`` lines, the lines the file
    editor's ``insert`` of ``new_str`` writes there (each line of ``new_str`` ended by a newline).
    Pure."""
    if not isinstance(insert_line, int) or insert_line < 0:
        return False
    lines = text.split("\n")
    if len(lines) <= insert_line:
        return False
    block = "".join(f"{line}\n" for line in new_str.split("\n"))
    return "\n".join(lines[insert_line:]).startswith(block)


class DurableLLM(LLM):
    """An SDK LLM whose completions are runtime LLM steps (recorded; replayed after a restart)."""

    _mars_task_id: str | None = PrivateAttr(default=None)

    def bind(self, task_id: str) -> DurableLLM:
        """Route completions through task ``task_id``'s runtime (see :data:`_RUNS`). Mutates self."""
        self._mars_task_id = task_id
        return self

    def completion(self, messages: list[Message], tools: Sequence[Any] | None = None,
                   *args: Any, **kwargs: Any) -> LLMResponse:
        run = _RUNS.get(self._mars_task_id or "")
        if run is None:  # not inside a durable task (e.g. a title request): a plain call
            return super().completion(messages, tools, *args, **kwargs)

        def request() -> dict[str, Any]:
            response = super(DurableLLM, self).completion(messages, tools, *args, **kwargs)
            return {"message": response.message.model_dump(mode="json"), "usage": _usage_of(response),
                    "metrics": response.metrics.model_dump(mode="json"),
                    "raw": response.raw_response.model_dump(mode="json")}

        summary = {"num_messages": len(messages), "num_tools": len(tools or [])}
        return _rebuild(run.llm(request, summary))

    def uses_responses_api(self) -> bool:
        """Chat completions only: the recorded form is a chat completion."""
        return False


class DurableExecutor(WrappingExecutor):
    """Wraps a (evented) tool executor: each call is a runtime tool step of task ``task_id``.
    Other attributes read through to ``inner`` (:class:`WrappingExecutor`).

    Tool events across a kill (what the gateway sees): every attempt made in this process is
    reported by the evented ``inner`` (``tool_enqueued`` / ``tool_start`` / ``tool_end`` with the
    call's id), a retried edit answered without running (found already applied, or a ``create``'s
    conflict; :meth:`_retry_answer`) included: a first attempt killed after its edit and before
    its ``tool_end`` was posted is closed by the retry's. An outcome recorded before a kill is replayed with no events: its ``tool_end`` was
    posted before it was recorded (the evented executor waits for the post, at most its
    ``end_wait_s``), and one still unposted then is closed by the gateway at ``session_end``
    (status ``interrupted``).
    """

    def __init__(self, inner: ToolExecutor, tool_name: str, observation_type: Any, task_id: str) -> None:
        self.inner = inner
        self.tool_name = tool_name
        self.observation_type = observation_type
        self.task_id = task_id

    def __call__(self, action: Any, conversation: Any = None) -> Any:
        run = _RUNS.get(self.task_id)
        if run is None:
            raise RuntimeError(f"durable tool of task {self.task_id} called outside its workflow")
        arguments = action.model_dump(mode="json", exclude_none=True)

        def execute(ctx: ExecContext) -> dict[str, Any]:
            t0 = time.monotonic()
            answer = self._retry_answer(arguments, run.workspace) if ctx.is_retry else None
            if answer is not None:
                text, is_error = answer
                observation = self._reported(action, conversation, _text_observation(
                    self.observation_type, action, text=text, is_error=is_error))
            else:
                observation = self.inner(action, conversation)
                if ctx.is_retry and self._is_lost_undo(arguments, observation):
                    observation = _text_observation(
                        self.observation_type, action, is_error=True,
                        text=f"{observation.text}\n{_LOST_UNDO_NOTE.format(path=arguments.get('path'))}")
            is_error = bool(getattr(observation, "is_error", False))
            return {"status": "error" if is_error else "ok", "text": observation.text[:4000],
                    "observation": observation.model_dump(mode="json"),
                    "duration_s": time.monotonic() - t0}

        result = run.tool(self.tool_name, arguments, execute)
        if "observation" in result:
            return self.observation_type.model_validate(result["observation"])
        return _denied_observation(self.observation_type, action, result.get("text", result["status"]))

    def _reported(self, action: Any, conversation: Any, observation: Any) -> Any:
        """``observation`` as the answer of this attempt, reported by the evented ``inner`` (its
        tool events); as it is when ``inner`` emits none."""
        if isinstance(self.inner, EventedExecutor):
            return self.inner.call_with(action, conversation, lambda *_: observation)
        return observation

    def _retry_answer(self, arguments: dict[str, Any], workspace: Path) -> tuple[str, bool] | None:
        """The answer ``(text, is_error)`` to a retried file edit, given without running it, or
        ``None`` to run it (see :func:`_create_retry_answer` and :meth:`_edit_already_applied`)."""
        if self.tool_name != "file_editor":
            return None
        if arguments.get("command") == "create":
            return _create_retry_answer(_edit_path(arguments, workspace), arguments)
        if self._edit_already_applied(arguments, workspace):
            return (f"[runtime] the edit of {arguments.get('path')} was already applied before a "
                    "restart"), False
        return None

    def _edit_already_applied(self, arguments: dict[str, Any], workspace: Path) -> bool:
        """A repeated ``str_replace`` or ``insert`` whose edit is in the file already (idempotent
        by content). ``str_replace``: the new text is there once and every ``old_str`` left is part
        of it (a ``new_str`` that contains its ``old_str``, e.g. an appended line, still has it
        after the edit). ``insert``: the lines it inserts are at ``insert_line`` (as the
        runtime's own editor decides, ``runtime/tools.py``; lines that were there before the first
        attempt read the same, and the retry is then not applied: an approximation)."""
        command = arguments.get("command")
        if self.tool_name != "file_editor" or command not in ("str_replace", "insert"):
            return False
        try:
            text = _edit_path(arguments, workspace).read_text()
        except (OSError, UnicodeDecodeError):
            return False
        new = str(arguments.get("new_str", ""))
        if command == "insert":
            return _insert_applied(text, arguments.get("insert_line"), new)
        old = str(arguments.get("old_str", ""))
        return bool(new) and bool(old) and text.count(new) == 1 and text.count(old) == new.count(old)

    def _is_lost_undo(self, arguments: dict[str, Any], observation: Any) -> bool:
        """A retried ``undo_edit`` that failed: this process's editor has no undo history (it does
        not survive a restart), so the retry fails whether or not the first attempt undid."""
        return (self.tool_name == "file_editor" and arguments.get("command") == "undo_edit"
                and bool(getattr(observation, "is_error", False)))

    def close(self) -> None:
        """Close the inner executor (it flushes its events)."""
        self.inner.close()


def _durable(base: type) -> type:
    """A tool class that builds ``base``'s tools and wraps each executor in :class:`DurableExecutor`."""
    class Durable(base):  # type: ignore[misc, valid-type]
        @classmethod
        def create(cls, conv_state: Any = None, **params: Any) -> Sequence[Any]:
            task_id = str(params.pop("mars_task_id"))
            return [tool.set_executor(DurableExecutor(tool.executor, tool.name, tool.observation_type, task_id))
                    for tool in base.create(conv_state=conv_state, **params)]

    Durable.__name__ = Durable.__qualname__ = f"Durable{base.__name__}"
    return Durable


_DURABLE_CLASSES: dict[str, type] = {"terminal": _durable(MarsTerminalTool),
                              "file_editor": _durable(MarsFileEditorTool),
                              "task_tracker": _durable(MarsTaskTrackerTool)}


def register_durable_tools() -> None:
    """Register ``mars_durable_terminal`` / ``_file_editor`` / ``_task_tracker`` (idempotent)."""
    for name, cls in _DURABLE_CLASSES.items():
        register_tool(f"mars_durable_{name}", cls)


def backend_of(base_url: str, api_key: str = "EMPTY", timeout_s: float = 5.0) -> Backend:
    """``mars`` when ``base_url`` is a MARS gateway (``GET <root>/mars/v1/healthz`` answers with
    its ``healthy_replicas``, with or without a healthy one), else ``url``. Asks once, over HTTP.
    """
    import httpx

    root = base_url.rstrip("/").removesuffix("/v1")
    try:
        response = httpx.get(f"{root}/mars/v1/healthz", timeout=timeout_s,
                             headers={"authorization": f"Bearer {api_key}"})
        body = response.json()
    except (httpx.HTTPError, ValueError):
        return "url"
    return "mars" if isinstance(body, dict) and "healthy_replicas" in body else "url"


def _run_config(run: TaskRun, task_dir: Path) -> RunConfig:
    agent = run.spec.agent
    llm = LLMSettings(backend=backend_of(agent.base_url, agent.api_key), base_url=agent.base_url,
                      model=agent.model, api_key=agent.api_key, temperature=agent.temperature,
                      timeout_s=int(agent.request_timeout_s))
    return RunConfig(llm=llm, out_dir=str(task_dir), max_iterations=agent.max_iterations, policy=False)


def run_openhands_task(run: TaskRun) -> AgentOutcome:
    """The ``openhands`` driver: one OpenHands conversation over the task's workspace.

    The conversation's CPU-plane events (``events.jsonl``) go to ``$MARS_TASK_OUT_DIR/<task_id>/``
    (default ``/tmp/mars-tasks/<task_id>/``), and to the gateway when the task's endpoint is one
    (``session_start`` first, ``session_end`` last, each run of the task a session of its own).

    Raises:
        TaskEndedError: from the runtime (budget, deadline, policy).
    """
    task_dir = Path(os.environ.get("MARS_TASK_OUT_DIR") or Path("/tmp") / "mars-tasks") / run.task_id
    task_dir.mkdir(parents=True, exist_ok=True)
    quiet_sdk_logs(in_memory_conversations=True)  # the task's log is the runtime's, not the SDK's
    session_id = session_id_of(run.task_id, run.spec.session_id)
    config = _run_config(run, task_dir)
    register_durable_tools()
    credentials = session_credentials(config, session_id, run.session_token())
    base = build_session_llm(config.llm, session_id, session_token=credentials.token)
    llm = DurableLLM(**{name: getattr(base, name) for name in base.model_fields_set}).bind(run.task_id)
    events_path = task_dir / "events.jsonl"
    sender = EventSender(events_url_for(config.llm), events_path)
    sender.emit(SessionStart(**now_stamps(), session_id=session_id, source="agent"))
    sender.flush()  # the gateway must know the session before tool events arrive
    with _RUNS_LOCK:
        _RUNS[run.task_id] = run
    conversation = None
    status = "error"
    try:
        conversation, _ = _build_conversation(config, run.workspace, session_id, events_path,
                                              llm=llm, tool_prefix="mars_durable",
                                              extra_tool_params={"mars_task_id": run.task_id},
                                              sender=sender)
        conversation.send_message(run.spec.problem_statement)
        conversation.run()
        status = _status_of(conversation)
    finally:
        if conversation is not None:
            conversation.close()
        with _RUNS_LOCK:
            _RUNS.pop(run.task_id, None)
        sender.emit(SessionEnd(**now_stamps(), session_id=session_id, source="agent",
                               status="ok" if status == "finished" else status))
        sender.close()
        SESSION_CREDENTIALS.forget(session_id)
    mapped = {"finished": "finished", "stuck": "stuck", "error": "error"}.get(status, "max_iterations")
    return AgentOutcome(status=mapped, message=f"OpenHands conversation {status}")  # type: ignore[arg-type]
