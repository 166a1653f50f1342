"""The versioned workload format: sessions of turns, with arrivals (design.md §8).

A workload is what the replay driver and the simulator consume: a list of agent sessions, each a
sequence of LLM calls ("turns") separated by tool calls, plus the session's arrival time. Token counts
are engine tokens of the replayed prompt; the replay sends synthetic token ids of these lengths.

Mental model of one session (turn k = the k-th LLM call, 0-based)::

    turn 0 prompt : |<------ appended_0 (system + task) ------>|
    turn 0 output :                                             |<- output_0 ->|  then tool_0 runs
    turn 1 prompt : |<- appended_0 ->|<- output_0 ->|<- appended_1 (tool_0's observation) ->|
    turn 1 output :                                                                          |<- output_1 ->| ...

    num_prompt_tokens(k) = sum(appended_0..k) + sum(output_0..k-1)

so a turn's prompt is the previous turn's prompt, its output and the new observation: the prefix a
prefix cache (or retained KV) can serve is everything but ``prompt_tokens_appended``. Every turn but
the last is followed by a tool call (``tool_name``, ``tool_duration_s``); the final turn has none.

Files: ``.json`` (one document), ``.jsonl`` (a header line ``{"format_version", "meta"}``, then one
session per line) and either with a ``.gz`` suffix. Writes go to a temporary file in the same folder
and are renamed into place, so a crash never leaves a half-written workload. A malformed file raises
:class:`WorkloadFormatError` naming the file, the line (JSONL) and the field.
"""

from __future__ import annotations

import gzip
import json
import os
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import IO, Annotated, Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from mars_openhands.cli_style import config_error_lines, keys_hint

__all__ = [
    "FORMAT_VERSION",
    "Session",
    "Turn",
    "Workload",
    "WorkloadFormatError",
    "WorkloadMeta",
    "load_workload",
    "save_workload",
]

FORMAT_VERSION = 1
"""Current workload format version; bump on any incompatible change and keep a reader for the old."""

NonNegInt = Annotated[int, Field(ge=0)]
NonNegFloat = Annotated[float, Field(ge=0.0, allow_inf_nan=False)]


class WorkloadFormatError(ValueError):
    """A workload or trace file is malformed; the message names the file, the field and the fix."""


class Turn(BaseModel):
    """One LLM call of a session and the tool call that follows it (none after the final turn)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    prompt_tokens_appended: NonNegInt
    """Tokens appended to the prompt since the previous turn's output (turn 0: system + task)."""
    output_tokens: Annotated[int, Field(ge=1)]
    """Tokens the turn generates (the replay sets ``max_tokens`` to this and ignores EOS)."""
    tool_name: str | None = None
    """Tool that runs after this turn (e.g. ``"pytest"``); ``None`` only on the final turn."""
    tool_duration_s: NonNegFloat = 0.0
    """Seconds the tool runs (execution only); 0 when ``tool_name`` is ``None``."""

    @model_validator(mode="after")
    def _no_duration_without_tool(self) -> Turn:
        if self.tool_name is None and self.tool_duration_s != 0.0:
            raise ValueError(
                f"tool_duration_s is {self.tool_duration_s} but tool_name is null; "
                "a turn without a tool must have tool_duration_s 0"
            )
        if self.tool_name is not None and not self.tool_name.strip():
            raise ValueError("tool_name must be a non-empty name or null, got an empty string")
        return self


class Session(BaseModel):
    """One agent session (one task): its arrival time and its turns, in order."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    session_id: Annotated[str, Field(min_length=1)]
    """Stable id (the trace's instance id, or ``"<kind>-<index>"`` for synthetic sessions)."""
    arrival_s: NonNegFloat = 0.0
    """Seconds after the start of the run at which the session's first turn is submitted."""
    turns: Annotated[tuple[Turn, ...], Field(min_length=1)]
    """The session's LLM calls in order; the last one is final and has no tool."""

    @model_validator(mode="after")
    def _tools_between_turns(self) -> Session:
        *middle, final = self.turns
        if final.tool_name is not None:
            raise ValueError(
                f"final turn {len(self.turns) - 1} has tool_name {final.tool_name!r}; the final "
                "turn of a session must have no tool (tool_name null, tool_duration_s 0)"
            )
        for k, turn in enumerate(middle):
            if turn.tool_name is None:
                raise ValueError(
                    f"turn {k} is not final but has no tool_name; every turn but the last is "
                    "followed by a tool call (use a name such as 'none' with duration 0)"
                )
        if self.turns[0].prompt_tokens_appended < 1:
            raise ValueError("turn 0 must have prompt_tokens_appended >= 1 (system + task prompt)")
        return self

    @property
    def num_turns(self) -> int:
        """Number of LLM calls."""
        return len(self.turns)

    def num_prompt_tokens(self, turn: int) -> int:
        """Full prompt length of ``turn`` in tokens (see the module diagram). Pure.

        Raises:
            IndexError: ``turn`` is not in ``range(num_turns)``.
        """
        if not 0 <= turn < len(self.turns):
            raise IndexError(f"turn {turn} out of range for session {self.session_id!r} "
                             f"with {len(self.turns)} turns")
        head = self.turns[: turn + 1]
        return sum(t.prompt_tokens_appended for t in head) + sum(t.output_tokens for t in head[:-1])

    @property
    def max_context_tokens(self) -> int:
        """Largest KV footprint of the session in tokens: final prompt + final output."""
        return self.num_prompt_tokens(len(self.turns) - 1) + self.turns[-1].output_tokens

    @property
    def total_tool_s(self) -> float:
        """Sum of tool durations in seconds."""
        return sum(t.tool_duration_s for t in self.turns)


class WorkloadMeta(BaseModel):
    """Provenance of a workload: where it came from and how to regenerate it."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    source: Annotated[str, Field(min_length=1)]
    """E.g. ``"traces:/path/to/dir"`` or ``"synth:swebench"``."""
    seed: int | None = None
    """Seed of the generator and/or the arrival process (``None`` if nothing was random)."""
    generator: dict[str, Any] | None = None
    """Generator parameters as JSON (a synthetic kind's params model dumped), if synthetic."""
    arrival: dict[str, Any] | None = None
    """Arrival process as JSON (see :mod:`eval.workloads.arrivals`), if one was applied."""
    notes: tuple[str, ...] = ()
    """Human-readable notes: skipped files, clamped values, trims applied."""


class Workload(BaseModel):
    """A versioned set of sessions plus provenance; what replay and the simulator consume."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    format_version: int = FORMAT_VERSION
    """Format of this document; readers reject versions they do not know."""
    meta: WorkloadMeta
    sessions: tuple[Session, ...]

    @field_validator("format_version")
    @classmethod
    def _known_version(cls, value: int) -> int:
        if value != FORMAT_VERSION:
            raise ValueError(
                f"unsupported workload format_version {value}; this mars-openhands reads version "
                f"{FORMAT_VERSION} (regenerate the workload or upgrade mars-openhands)"
            )
        return value

    @model_validator(mode="after")
    def _unique_ids(self) -> Workload:
        seen: set[str] = set()
        for session in self.sessions:
            if session.session_id in seen:
                raise ValueError(f"duplicate session_id {session.session_id!r}; ids must be unique")
            seen.add(session.session_id)
        return self

    @property
    def num_turns(self) -> int:
        """Total LLM calls over all sessions."""
        return sum(s.num_turns for s in self.sessions)


# ----------------------------------------------------------------------------- files
def _open_text(path: Path, mode: str, compress: bool) -> IO[str]:
    if compress:
        return gzip.open(path, mode + "t", encoding="utf-8")  # type: ignore[return-value]
    return open(path, mode, encoding="utf-8")


def _is_jsonl(path: Path) -> bool:
    suffixes = path.suffixes[-2:] if path.suffix == ".gz" else path.suffixes[-1:]
    if suffixes and suffixes[0] in (".jsonl", ".json"):
        return suffixes[0] == ".jsonl"
    raise WorkloadFormatError(
        f"{path}: unsupported workload file name; use a .json, .jsonl, .json.gz or .jsonl.gz suffix"
    )


def _describe(error: ValidationError, model: type[BaseModel]) -> str:
    """The problems of a document validated as ``model``, joined into one line: ``field.path:
    message (got value)``, an unknown key with the keys its section takes
    (:func:`~mars_openhands.cli_style.config_error_lines`)."""
    return "; ".join(config_error_lines(error, key_prefix="", unknown_key_hint=keys_hint(model)))


def save_workload(workload: Workload, path: str | os.PathLike[str]) -> Path:
    """Write ``workload`` to ``path`` atomically (temporary file in the same folder, then rename).

    The suffix selects the format (see the module docstring). Mutates: the file system only.

    Returns:
        The path written.

    Raises:
        WorkloadFormatError: unsupported suffix (nothing is written).
        OSError: the folder cannot be created or is not writable (nothing is left behind).
    """
    path = Path(path)
    as_jsonl = _is_jsonl(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp_name = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    os.close(fd)
    tmp = Path(tmp_name)
    umask = os.umask(0)
    os.umask(umask)
    os.chmod(tmp, 0o666 & ~umask)  # mkstemp makes 0600; give the file the usual permissions
    try:
        with _open_text(tmp, "w", compress=path.suffix == ".gz") as f:
            _write(workload, f, as_jsonl)
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    return path


def _write(workload: Workload, f: IO[str], as_jsonl: bool) -> None:
    if not as_jsonl:
        f.write(workload.model_dump_json(indent=1))
        f.write("\n")
        return
    header = {"format_version": workload.format_version, "meta": workload.meta.model_dump(mode="json")}
    f.write(json.dumps(header) + "\n")
    for session in workload.sessions:
        f.write(session.model_dump_json() + "\n")


def load_workload(path: str | os.PathLike[str]) -> Workload:
    """Read and validate a workload file written by :func:`save_workload` (or by hand).

    Raises:
        WorkloadFormatError: invalid JSON, a missing/unknown/out-of-range field, an unknown
            ``format_version`` or duplicate ids; the message names the file, the line (JSONL) and
            the field path, e.g. ``w.jsonl:3: invalid session: turns.2.output_tokens: Input should
            be greater than or equal to 1 (got 0)``; an unknown key lists the keys of its section.
        FileNotFoundError: no such file.
    """
    path = Path(path)
    as_jsonl = _is_jsonl(path)
    try:
        with _open_text(path, "r", compress=path.suffix == ".gz") as f:
            if as_jsonl:
                return _read_jsonl(path, f)
            text = f.read()
    except (OSError, EOFError, UnicodeDecodeError) as e:
        if isinstance(e, FileNotFoundError):
            raise
        raise WorkloadFormatError(f"{path}: cannot read workload: {e}") from None
    try:
        return Workload.model_validate_json(text)
    except ValidationError as e:
        raise WorkloadFormatError(f"{path}: invalid workload: {_describe(e, Workload)}") from None


def _read_jsonl(path: Path, f: IO[str]) -> Workload:
    lines = _numbered_lines(f)
    first = next(lines, None)
    if first is None:
        raise WorkloadFormatError(f"{path}: empty file; expected a header line "
                                  '{"format_version": ..., "meta": {...}}')
    header = _json_line(path, *first)
    if not isinstance(header, dict) or "meta" not in header:
        raise WorkloadFormatError(f"{path}:{first[0]}: first line must be the header "
                                  '{"format_version": ..., "meta": {...}}')
    sessions = []
    for line_number, line in lines:
        try:
            sessions.append(Session.model_validate_json(line))
        except ValidationError as e:
            raise WorkloadFormatError(f"{path}:{line_number}: invalid session: {_describe(e, Session)}") from None
    try:
        return Workload(**header, sessions=tuple(sessions))
    except ValidationError as e:
        raise WorkloadFormatError(f"{path}: invalid workload: {_describe(e, Workload)}") from None
    except TypeError as e:  # header keys that are not fields of Workload
        raise WorkloadFormatError(f"{path}:{first[0]}: invalid header: {e}") from None


def _numbered_lines(f: IO[str]) -> Iterator[tuple[int, str]]:
    for line_number, line in enumerate(f, start=1):
        if line.strip():
            yield line_number, line


def _json_line(path: Path, line_number: int, line: str) -> Any:
    try:
        return json.loads(line)
    except ValueError as e:
        raise WorkloadFormatError(f"{path}:{line_number}: not valid JSON: {e}") from None
