"""The ``chat`` driver: a minimal tool-calling agent over any OpenAI-compatible endpoint.

Each turn sends the conversation to ``/chat/completions`` (tools: ``terminal``, ``file_editor``,
``finish``) through :meth:`TaskRun.llm`, then runs the returned tool calls through
:meth:`TaskRun.tool` with the runtime's own tools (``tools.py``). The messages are rebuilt from the
step outputs on every run (replayed ones included), so the model's context is a function of the log.
It serves tasks where no OpenHands env is at hand, and the crash-matrix tests (with the playback
engine's scripted answers).
"""

from __future__ import annotations

import hashlib
import json
import urllib.error
import urllib.request
import uuid
from typing import Any

from mars_openhands.runtime.run import AgentOutcome, ExecContext, TaskRun
from mars_openhands.runtime.tools import TOOL_SCHEMAS, run_tool

__all__ = ["SESSION_TOKEN_HEADER", "chat_request", "run_chat_agent", "session_id_of"]

SESSION_TOKEN_HEADER = "X-Mars-Session-Token"
"""The gateway's session-token header (as ``openhands/credentials.py``'s ``TOKEN_HEADER``): a
gateway started with ``--api-key`` binds the session to the first token it sees."""

SYSTEM_PROMPT = ("You are a coding agent. Work in the workspace with the terminal and file_editor "
                 "tools; call finish when the task is done.")


def session_id_of(task_id: str, explicit: str | None = None) -> str:
    """The task's session / conversation UUID: ``explicit``, else derived from the task id. Pure."""
    return explicit or str(uuid.uuid5(uuid.NAMESPACE_URL, f"mars-task:{task_id}"))


def chat_request(run: TaskRun, messages: list[dict[str, Any]], session_id: str) -> dict[str, Any]:
    """POST the conversation to the task's endpoint; return ``{"message", "usage"}``.

    Raises:
        RuntimeError: the endpoint failed or answered without a choice (the message says which).
    """
    agent = run.spec.agent
    body: dict[str, Any] = {"model": agent.model, "messages": messages, "tools": TOOL_SCHEMAS,
                            "stream": False}
    if agent.temperature is not None:
        body["temperature"] = agent.temperature
    request = urllib.request.Request(
        agent.base_url.rstrip("/") + "/chat/completions", data=json.dumps(body).encode(),
        headers={"content-type": "application/json", "authorization": f"Bearer {agent.api_key}",
                 "x-mars-session": session_id, SESSION_TOKEN_HEADER: run.session_token()},
        method="POST")
    try:
        with urllib.request.urlopen(request, timeout=agent.request_timeout_s) as response:
            data = json.loads(response.read())
    except (urllib.error.URLError, OSError, json.JSONDecodeError) as e:
        raise RuntimeError(f"LLM endpoint {agent.base_url} failed: {e}") from e
    if not data.get("choices"):
        raise RuntimeError(f"LLM endpoint {agent.base_url} answered without choices: {str(data)[:300]}")
    message = data["choices"][0]["message"]
    return {"message": {k: message[k] for k in ("role", "content", "tool_calls") if k in message},
            "usage": data.get("usage") or {}}


def _digest(messages: list[dict[str, Any]]) -> str:
    return hashlib.sha256(json.dumps(messages, sort_keys=True).encode()).hexdigest()


def _run_calls(run: TaskRun, calls: list[dict[str, Any]],
               messages: list[dict[str, Any]]) -> AgentOutcome | None:
    """Run one turn's tool calls; append their observations. Returns an outcome on ``finish``."""
    for call in calls:
        name = call["function"]["name"]
        try:
            args = json.loads(call["function"].get("arguments") or "{}")
        except json.JSONDecodeError as e:
            messages.append({"role": "tool", "tool_call_id": call["id"],
                             "content": f"arguments are not JSON: {e}"})
            continue
        if name == "finish":
            return AgentOutcome(status="finished", message=str(args.get("message", "")))

        def execute(ctx: ExecContext, name: str = name, args: dict[str, Any] = args) -> dict[str, Any]:
            return run_tool(name, args, run.workspace, ctx.key, run.task_id, ctx.timeout_s,
                            ctx.is_retry, run.config.max_output_chars)

        result = run.tool(name, args, execute)
        messages.append({"role": "tool", "tool_call_id": call["id"],
                         "content": f"[{result['status']}] {result.get('text', '')}"})
    return None


def run_chat_agent(run: TaskRun) -> AgentOutcome:
    """Drive the task with the chat loop until ``finish``, a turn without tool calls, or the cap.

    Raises:
        TaskEndedError: from the runtime (budget, deadline, policy).
        RuntimeError: the endpoint failed (after the step's own tries).
    """
    session_id = session_id_of(run.task_id, run.spec.session_id)
    messages: list[dict[str, Any]] = [{"role": "system", "content": SYSTEM_PROMPT},
                                      {"role": "user", "content": run.spec.problem_statement}]
    for turn in range(run.spec.agent.max_iterations):
        snapshot = list(messages)
        response = run.llm(lambda m=snapshot: chat_request(run, m, session_id),
                           {"num_messages": len(snapshot), "messages_sha256": _digest(snapshot)})
        message = response["message"]
        messages.append(message)
        if not message.get("tool_calls"):
            return AgentOutcome(status="finished", message=str(message.get("content") or ""))
        outcome = _run_calls(run, message["tool_calls"], messages)
        if outcome is not None:
            return outcome
        run.checkpoint(f"turn {turn}", {"num_messages": len(messages)})
    return AgentOutcome(status="max_iterations", message=f"stopped after {run.spec.agent.max_iterations} turns")
