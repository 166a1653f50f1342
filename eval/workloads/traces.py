"""Loader: mini-swe-agent trajectories (``*.traj.json[.gz]``) → a :class:`Workload` (design.md §8).

Source format: mini-swe-agent 1.x/2.x ``trajectory_format: "mini-swe-agent-1.1"`` as in
``shared/data/traces/mini-swe-agent`` (SWE-agent/mini-swe-agent PR #816, MIT; see its README). One
file is one session; ``instance_id`` is kept as the session id. Any folder of such files works, so a
user can point the loader at their own runs.

Per assistant message (one LLM call = one turn k), from ``extra.response.usage`` and timestamps::

    prompt_tokens(k) = prompt_tokens(k-1) + completion_tokens(k-1) + observation(k)
    prompt_tokens_appended(k) = observation(k)       (k >= 1; turn 0: prompt_tokens(0) = system + task)
    output_tokens(k) = completion_tokens(k)
    tool_duration_s(k) = last tool message's extra.timestamp - assistant extra.timestamp

Guards, each counted in the workload's ``meta.notes``: a negative observation (the provider dropped
part of the history, e.g. reasoning text, or counted differently) is clamped to 0 tokens; a
completion of 0 tokens becomes 1 (the format needs at least one output token); a negative tool
duration (clock skew between the agent and the environment, seen down to -1.1 s) is clamped to 0 s.
A turn followed by a user interrupt instead of a tool (e.g. ``FormatError``) gets tool name
``"interrupt:<type>"`` and duration 0; a user message *after* a tool (mini-swe-agent does not
record an LLM call whose tool call failed to parse, only its ``FormatError`` reply) simply adds to
the next turn's observation tokens. A tool that ran after the *last* LLM call (the next call
failed, e.g. ``InternalServerError``) is dropped: the final turn has no tool. A file without any LLM
call is skipped with a note. ``tool_name`` is :func:`tool_name_from_command` of the call's command.
"""

from __future__ import annotations

import gzip
import json
import os
import zlib
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from pydantic import ValidationError

from eval.workloads.format import Session, Turn, Workload, WorkloadFormatError, WorkloadMeta
from eval.workloads.tool_names import FALLBACK_TOOL_NAME, tool_name_from_command
from mars_openhands.cli_style import config_error_lines

__all__ = ["TRACE_PATTERNS", "TraceLoadReport", "load_trace_dir", "load_trajectory"]

TRACE_PATTERNS = ("*.traj.json", "*.traj.json.gz")
"""File name patterns searched (recursively) by :func:`load_trace_dir`."""


@dataclass
class TraceLoadReport:
    """Counts of the guards applied while loading (see the module docstring). Mutable accumulator."""

    clamped: Counter[str] = field(default_factory=Counter)
    skipped: list[str] = field(default_factory=list)

    def notes(self) -> tuple[str, ...]:
        """Human-readable notes for :attr:`WorkloadMeta.notes`. Pure."""
        notes = [f"{count} {what}" for what, count in sorted(self.clamped.items())]
        return tuple(notes + [f"skipped {s}" for s in self.skipped])


def _read_json(path: Path) -> Any:
    try:
        if path.suffix == ".gz":
            with gzip.open(path, "rt", encoding="utf-8") as f:
                return json.load(f)
        with open(path, encoding="utf-8") as f:
            return json.load(f)
    except (OSError, EOFError, zlib.error, UnicodeDecodeError, ValueError) as e:
        if isinstance(e, FileNotFoundError):
            raise
        raise WorkloadFormatError(f"{path}: not a readable (gzip) JSON trajectory: {e}") from None


def _get(path: Path, obj: Any, where: str, *keys: str | int) -> Any:
    """``obj[k0][k1]...`` or a :class:`WorkloadFormatError` naming the file and the field path."""
    for key in keys:
        try:
            obj = obj[key]
        except (KeyError, IndexError, TypeError):
            raise WorkloadFormatError(
                f"{path}: {where}: missing field {'.'.join(str(k) for k in keys)!r} "
                f"(expected a mini-swe-agent trajectory with extra.response.usage per LLM call)"
            ) from None
    return obj


def _number(path: Path, value: Any, where: str, kind: type = int) -> Any:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or (kind is int and value != int(value)):
        raise WorkloadFormatError(f"{path}: {where}: expected a {kind.__name__}, got {value!r}")
    if value < 0 and kind is int:
        raise WorkloadFormatError(f"{path}: {where}: token counts must be >= 0, got {value}")
    return kind(value)


@dataclass
class _Call:
    """One parsed LLM call and what followed it."""

    prompt_tokens: int
    completion_tokens: int
    timestamp_s: float
    command: str | None
    tool_end_s: float | None = None
    interrupt: str | None = None


def _parse_calls(path: Path, messages: list[Any]) -> list[_Call]:
    calls: list[_Call] = []
    for i, message in enumerate(messages):
        where = f"messages[{i}]"
        role = _get(path, message, where, "role")
        if role == "assistant":
            usage = _get(path, message, where, "extra", "response", "usage")
            extra = message["extra"]
            stamp = extra.get("timestamp", extra["response"].get("created"))
            calls.append(_Call(
                prompt_tokens=_number(path, _get(path, usage, where, "prompt_tokens"),
                                      f"{where}.extra.response.usage.prompt_tokens"),
                completion_tokens=_number(path, _get(path, usage, where, "completion_tokens"),
                                          f"{where}.extra.response.usage.completion_tokens"),
                timestamp_s=_number(path, stamp, f"{where}.extra.timestamp", float),
                command=_command(message),
            ))
        elif role == "tool" and calls:
            stamp = _get(path, message, where, "extra", "timestamp")
            calls[-1].tool_end_s = _number(path, stamp, f"{where}.extra.timestamp", float)
        elif role == "user" and calls:
            extra = message.get("extra") or {}
            calls[-1].interrupt = str(extra.get("interrupt_type", "user"))
    return calls


def _command(message: dict[str, Any]) -> str | None:
    """The ``command`` argument of the first tool call, or ``None`` if absent or unparseable."""
    for action in (message.get("extra") or {}).get("actions") or []:
        if isinstance(action, dict) and isinstance(action.get("command"), str):
            return action["command"]
    for call in message.get("tool_calls") or []:
        try:
            return json.loads(call["function"]["arguments"])["command"]
        except (KeyError, TypeError, ValueError):
            continue
    return None


def _to_turns(calls: list[_Call], report: TraceLoadReport) -> tuple[Turn, ...]:
    turns = []
    for k, call in enumerate(calls):
        appended = call.prompt_tokens
        if k > 0:
            appended -= calls[k - 1].prompt_tokens + calls[k - 1].completion_tokens
            if appended < 0:
                report.clamped["negative observation(s) clamped to 0 tokens"] += 1
                appended = 0
        output = call.completion_tokens
        if output == 0:
            report.clamped["0-token completion(s) set to 1 token"] += 1
            output = 1
        turns.append(Turn(prompt_tokens_appended=appended, output_tokens=output,
                          **_tool(call, is_final=k == len(calls) - 1, report=report)))
    return tuple(turns)


def _tool(call: _Call, is_final: bool, report: TraceLoadReport) -> dict[str, Any]:
    if is_final:
        if call.tool_end_s is not None:
            report.clamped["tool call(s) after the last LLM call dropped"] += 1
        return {}
    if call.tool_end_s is None:  # an interrupt (format error) or a call that ran no tool
        return {"tool_name": f"interrupt:{call.interrupt or 'none'}", "tool_duration_s": 0.0}
    duration_s = call.tool_end_s - call.timestamp_s
    if duration_s < 0:
        report.clamped["negative tool duration(s) clamped to 0 s"] += 1
        duration_s = 0.0
    name = tool_name_from_command(call.command) if call.command else FALLBACK_TOOL_NAME
    return {"tool_name": name, "tool_duration_s": duration_s}


def load_trajectory(path: str | os.PathLike[str], report: TraceLoadReport | None = None,
                    session_id: str | None = None) -> Session | None:
    """Parse one mini-swe-agent trajectory into a :class:`Session` (arrival 0 s).

    Args:
        path: a ``.traj.json`` or ``.traj.json.gz`` file.
        report: accumulator for guard counts and skips (mutated), or ``None``.
        session_id: override the id (default: the file's ``instance_id``).

    Returns:
        The session, or ``None`` when the trajectory has no LLM call (recorded in ``report``).

    Raises:
        WorkloadFormatError: unreadable/invalid JSON, or a missing or ill-typed field; the message
            names the file and the field (e.g. ``messages[4].extra.response.usage``).
        FileNotFoundError: no such file.
    """
    path = Path(path)
    report = report if report is not None else TraceLoadReport()
    data = _read_json(path)
    if not isinstance(data, dict):
        raise WorkloadFormatError(f"{path}: expected a JSON object trajectory, got {type(data).__name__}")
    instance_id = session_id or _get(path, data, "trajectory", "instance_id")
    messages = _get(path, data, "trajectory", "messages")
    if not isinstance(messages, list):
        raise WorkloadFormatError(f"{path}: 'messages' must be a list, got {type(messages).__name__}")
    calls = _parse_calls(path, messages)
    if not calls:
        report.skipped.append(f"{path.name} (no LLM call)")
        return None
    try:
        return Session(session_id=str(instance_id), arrival_s=0.0, turns=_to_turns(calls, report))
    except ValidationError as e:  # e.g. a first prompt of 0 tokens
        problems = "; ".join(config_error_lines(e, key_prefix=""))
        raise WorkloadFormatError(f"{path}: trajectory gives an invalid session: {problems}") from None


def _find_files(directory: Path) -> list[Path]:
    files = {p for pattern in TRACE_PATTERNS for p in directory.rglob(pattern) if p.is_file()}
    return sorted(files)


def load_trace_dir(directory: str | os.PathLike[str], *,
                   on_error: Literal["raise", "skip"] = "raise") -> Workload:
    """Load every trajectory under ``directory`` (recursively) into one workload, sorted by path.

    All sessions arrive at 0 s; apply an arrival process with
    :func:`eval.workloads.arrivals.with_arrivals`. An ``instance_id`` found in several files (e.g.
    a rerun folder) becomes ``"<instance_id>@<folder relative to directory>"`` for every copy.

    Args:
        directory: a folder of ``*.traj.json[.gz]`` files, or a single such file.
        on_error: ``"raise"`` stops at the first malformed file; ``"skip"`` skips it with a note.

    Raises:
        WorkloadFormatError: a malformed file (``on_error="raise"``), or no trajectory found.
        FileNotFoundError: ``directory`` does not exist.
    """
    directory = Path(directory)
    if not directory.exists():
        raise FileNotFoundError(f"trace folder {directory} does not exist")
    files = [directory] if directory.is_file() else _find_files(directory)
    report = TraceLoadReport()
    loaded: list[tuple[Path, Session]] = []
    for path in files:
        try:
            session = load_trajectory(path, report)
        except WorkloadFormatError as e:
            if on_error == "raise":
                raise
            report.skipped.append(f"{path.name} (malformed: {e})")
            continue
        if session is not None:
            loaded.append((path, session))
    if not loaded:
        raise WorkloadFormatError(
            f"{directory}: no usable trajectory found (looked for {' or '.join(TRACE_PATTERNS)}, "
            f"{len(files)} file(s) matched; skipped: {report.skipped})")
    counts = Counter(s.session_id for _, s in loaded)
    root = directory if directory.is_dir() else directory.parent
    sessions = tuple(
        s if counts[s.session_id] == 1
        else s.model_copy(update={"session_id": f"{s.session_id}@{p.parent.relative_to(root)}"})
        for p, s in loaded
    )
    meta = WorkloadMeta(source=f"traces:{directory}", notes=report.notes())
    return Workload(meta=meta, sessions=sessions)
