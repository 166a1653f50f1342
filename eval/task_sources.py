"""Agent task sources in their native formats, read from local copies (design.md §8).

The OpenHands benchmark (``mars-openhands openhands bench``, :mod:`eval.ohbench`) runs the same task
set against every policy. Tasks come from the benchmarks the MARS paper used, each read in the
format its authors publish, from files on this machine (nothing is downloaded):

* **SWE-bench** (princeton-nlp/SWE-bench, ``SWE-bench_Lite``, ...): dataset rows with
  ``instance_id``, ``repo`` (``owner/name``), ``base_commit`` and ``problem_statement`` (other
  columns such as ``patch`` or ``FAIL_TO_PASS`` are ignored), as JSON lines, a JSON list or Parquet
  (the Hugging Face split files). Repositories come from a local mirror folder holding one git
  clone per repository, as ``<mirror>/<owner>__<name>`` (the harness's naming),
  ``<mirror>/<owner>/<name>`` or ``<mirror>/<name>``; ``base_commit`` must exist in that clone.
* **GitTaskBench** (QuantaAlpha/GitTaskBench): its checkout, with ``queries/<task>/query.json``
  (``task_id``, ``task_description``, ``repositories`` = ``[{"name", "path", ...}]``, optional
  ``prompt_file``, ``file_paths.input_files``) and ``code_base/<name>/`` (the repositories). Paths
  in the configs are absolute inside the authors' container (``/GitTaskBench/...``); they are
  mapped to the local checkout. The task's workspace gets a copy of each repository under its
  name, and of its input files under ``input/``.
* **RepoBench** (Liu et al., ICLR 2024; ``tianyang/repobench_python_v1.1`` and the older
  ``repobench-c``): completion samples with ``repo_name``, ``file_path``, ``next_line``, the
  in-file code (``cropped_code`` in v1.1, ``code`` in v1), optional ``import_statement`` and
  ``context`` (cross-file snippets: ``{"path", "snippet", ...}`` objects in v1.1, strings in v1).
  Each sample becomes a task: its workspace holds the file up to the completion point and the
  cross-file snippets at their paths; the agent is asked to write the next line (kept as
  ``expected``). RepoBench is the paper's long-prefill load.

Every loader returns :class:`BenchTask` objects, validated up front: a missing file, an unreadable
row or a missing or mistyped field raises :class:`TaskSourceError`, one line naming the file, the
row and the field. :func:`materialize` builds a task's workspace and says what the OpenHands runner
gets (``repo`` + ``base_commit``, or an existing ``workspace``).
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
from collections.abc import Callable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

__all__ = [
    "SOURCES",
    "BenchTask",
    "TaskSourceError",
    "load_gittaskbench",
    "load_repobench",
    "load_swebench",
    "load_tasks",
    "materialize",
    "read_rows",
    "safe_dir_name",
]

SourceName = Literal["swebench", "gittaskbench", "repobench"]


class TaskSourceError(ValueError):
    """Bad or missing task input; ``str(error)`` is one line naming the file, row and field."""


class BenchTask(BaseModel):
    """One benchmark task, source-independent. Frozen; unknown keys are an error.

    Exactly one workspace origin is set: ``repo`` (a git clone to copy, at ``base_commit``), or
    ``copies`` and/or ``files`` (a fresh directory built by :func:`materialize`).
    """

    model_config = ConfigDict(frozen=True, extra="forbid", use_attribute_docstrings=True)

    task_id: str = Field(min_length=1)
    """Unique within a task set; names the task's output directory."""
    source: SourceName
    problem_statement: str = Field(min_length=1)
    """What the agent is told (the first user message)."""
    repo: str | None = None
    """Local git repository (SWE-bench: the mirror's clone) copied into the workspace."""
    base_commit: str | None = None
    """Commit of ``repo`` the workspace starts at."""
    copies: tuple[tuple[str, str], ...] = ()
    """``(destination relative to the workspace, local source path)``: directories or files copied
    in (GitTaskBench repositories and input files)."""
    files: tuple[tuple[str, str], ...] = ()
    """``(path relative to the workspace, text)``: files written (RepoBench samples)."""
    trace_id: str | None = None
    """Key of the recorded agent run for this task (SWE-bench: ``instance_id``), for playback."""
    expected: str | None = None
    """Reference answer when the source has one (RepoBench: ``next_line``)."""


# ----------------------------------------------------------------------------- rows
def read_rows(path: Path) -> Iterator[tuple[str, dict[str, Any]]]:
    """Rows of a dataset file: ``(where, row)`` with ``where`` = ``"line N"`` or ``"row N"``.

    Formats by suffix: ``.jsonl`` / ``.ndjson`` (one JSON object per line, blank lines skipped),
    ``.json`` (a list of objects, or one object), ``.parquet`` (pandas + pyarrow).

    Raises:
        TaskSourceError: the file is missing or unreadable, a line is not JSON, a row is not an
            object, or the suffix is none of the above.
    """
    if not path.is_file():
        raise TaskSourceError(f"{path}: no such file")
    suffix = path.suffix.lower()
    if suffix in (".jsonl", ".ndjson"):
        yield from _jsonl_rows(path)
    elif suffix == ".json":
        data = _json(path)
        rows = data if isinstance(data, list) else [data]
        for i, row in enumerate(rows):
            yield f"row {i}", _object(path, f"row {i}", row)
    elif suffix == ".parquet":
        import pandas as pd

        try:
            frame = pd.read_parquet(path)
        except Exception as e:  # pyarrow raises its own error types for a corrupt file
            raise TaskSourceError(f"{path}: not a readable Parquet file ({type(e).__name__}: "
                                  f"{str(e).splitlines()[0] if str(e) else ''})") from None
        for i, row in enumerate(frame.to_dict(orient="records")):
            yield f"row {i}", {k: _plain(v) for k, v in row.items()}
    else:
        raise TaskSourceError(f"{path}: unknown dataset format {suffix or '(no suffix)'!r}; "
                              "expected .jsonl, .json or .parquet")


def _jsonl_rows(path: Path) -> Iterator[tuple[str, dict[str, Any]]]:
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as e:
        raise TaskSourceError(f"{path}: cannot read it ({e})") from None
    for number, line in enumerate(text.split("\n"), start=1):  # not splitlines(): U+2028 in text
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as e:
            raise TaskSourceError(f"{path}: line {number}: not JSON ({e.msg} at column "
                                  f"{e.colno})") from None
        yield f"line {number}", _object(path, f"line {number}", row)


def _json(path: Path) -> Any:
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError) as e:
        raise TaskSourceError(f"{path}: cannot read it ({e})") from None
    except json.JSONDecodeError as e:
        raise TaskSourceError(f"{path}: not JSON ({e.msg} at line {e.lineno} column "
                              f"{e.colno})") from None


def _object(path: Path, where: str, row: Any) -> dict[str, Any]:
    if not isinstance(row, dict):
        raise TaskSourceError(f"{path}: {where}: expected a JSON object, got "
                              f"{type(row).__name__}")
    return row


def _plain(value: Any) -> Any:
    """numpy arrays / scalars from Parquet as lists / Python scalars (nested too). Pure."""
    if hasattr(value, "tolist"):
        value = value.tolist()
    if isinstance(value, list):
        return [_plain(v) for v in value]
    if isinstance(value, dict):
        return {k: _plain(v) for k, v in value.items()}
    return value


def _field(path: Path, where: str, row: Mapping[str, Any], name: str, kind: type = str,
           required: bool = True) -> Any:
    """``row[name]``, checked: present (if ``required``), of type ``kind``, non-empty if text.

    Raises:
        TaskSourceError: naming the file, row and field.
    """
    value = row.get(name)
    if value is None:
        if required:
            raise TaskSourceError(f"{path}: {where}: missing field {name!r}")
        return None
    if not isinstance(value, kind) or (kind is str and not value.strip()):
        expected = "non-empty text" if kind is str else kind.__name__
        raise TaskSourceError(f"{path}: {where}: field {name!r} must be {expected}, got "
                              f"{type(value).__name__} {str(value)[:60]!r}")
    return value


def _unique(tasks: Sequence[BenchTask], path: Path) -> list[BenchTask]:
    seen: set[str] = set()
    for task in tasks:
        if task.task_id in seen:
            raise TaskSourceError(f"{path}: task id {task.task_id!r} appears twice (field "
                                  "'task_id'/'instance_id' must be unique)")
        seen.add(task.task_id)
    return list(tasks)


# ----------------------------------------------------------------------------- SWE-bench
def load_swebench(path: Path, repos_dir: Path) -> list[BenchTask]:
    """SWE-bench dataset rows as tasks; repositories from the local mirror ``repos_dir``.

    Args:
        path: ``.jsonl`` / ``.json`` / ``.parquet`` rows (``instance_id``, ``repo``,
            ``base_commit``, ``problem_statement``).
        repos_dir: folder of git clones (see the module docstring for the layouts).

    Raises:
        TaskSourceError: a bad file or row (see :func:`read_rows`), a missing or empty field, a
            repository with no clone in ``repos_dir``, or a ``base_commit`` that clone lacks.
    """
    if not repos_dir.is_dir():
        raise TaskSourceError(f"{repos_dir}: the SWE-bench repository mirror is not a directory "
                              "(--repos-dir: a folder with one git clone per repository)")
    tasks = []
    for where, row in read_rows(path):
        instance_id = _field(path, where, row, "instance_id")
        where = f"{where} (instance_id {instance_id})"
        repo = _field(path, where, row, "repo")
        base_commit = _field(path, where, row, "base_commit")
        problem = _field(path, where, row, "problem_statement")
        clone = _mirror_clone(path, where, repo, repos_dir)
        _check_commit(path, where, clone, base_commit)
        tasks.append(BenchTask(task_id=instance_id, source="swebench", problem_statement=problem,
                               repo=str(clone), base_commit=base_commit, trace_id=instance_id))
    return _unique(tasks, path)


def _mirror_clone(path: Path, where: str, repo: str, repos_dir: Path) -> Path:
    owner, _, name = repo.partition("/")
    candidates = [repos_dir / repo.replace("/", "__"), repos_dir / owner / name, repos_dir / name]
    for candidate in candidates if name else candidates[:1]:
        if (candidate / ".git").exists() or (candidate / "HEAD").is_file():
            return candidate.resolve()
    looked = ", ".join(str(c) for c in (candidates if name else candidates[:1]))
    raise TaskSourceError(f"{path}: {where}: field 'repo' = {repo!r} has no git clone in the "
                          f"mirror (looked for {looked}); clone it there or pass another "
                          "--repos-dir")


def _check_commit(path: Path, where: str, clone: Path, commit: str) -> None:
    probe = subprocess.run(["git", "-C", str(clone), "cat-file", "-e", f"{commit}^{{commit}}"],
                           capture_output=True, text=True)
    if probe.returncode != 0:
        raise TaskSourceError(f"{path}: {where}: field 'base_commit' = {commit!r} is not a commit "
                              f"of {clone} (fetch it into the mirror)")


# ----------------------------------------------------------------------------- GitTaskBench
_CONTAINER_ROOT = "/GitTaskBench/"
"""Prefix of every path in GitTaskBench's configs (its Docker image's checkout)."""


def _local(root: Path, config_path: str) -> Path:
    """A config path mapped to the local checkout ``root`` (absolute paths that exist stay). Pure
    apart from the existence check."""
    given = Path(config_path)
    if given.is_absolute() and given.exists():
        return given
    relative = config_path[len(_CONTAINER_ROOT):] if config_path.startswith(_CONTAINER_ROOT) \
        else config_path.lstrip("/")
    return root / relative


def load_gittaskbench(root: Path) -> list[BenchTask]:
    """GitTaskBench task configs (``root/queries/*/query.json``) as tasks.

    Args:
        root: the local GitTaskBench checkout (holding ``queries/`` and ``code_base/``).

    Raises:
        TaskSourceError: no ``queries`` folder or no task in it, an unreadable ``query.json``,
            a missing or mistyped field, or a repository or input file missing locally.
    """
    queries = root / "queries"
    if not queries.is_dir():
        raise TaskSourceError(f"{root}: not a GitTaskBench checkout (no queries/ folder)")
    configs = sorted(queries.glob("*/query.json"))
    if not configs:
        raise TaskSourceError(f"{queries}: no task configs (expected queries/<task>/query.json)")
    return _unique([_gittaskbench_task(root, path) for path in configs], queries)


def _gittaskbench_task(root: Path, path: Path) -> BenchTask:
    config = _object(path, "config", _json(path))
    where = "config"
    task_id = _field(path, where, config, "task_id")
    description = _field(path, where, config, "task_description")
    repositories = _field(path, where, config, "repositories", list)
    if not repositories:
        raise TaskSourceError(f"{path}: field 'repositories' is empty (a task needs its repository)")
    copies = []
    for i, repo in enumerate(repositories):
        entry = _object(path, f"repositories[{i}]", repo)
        name = _field(path, f"repositories[{i}]", entry, "name")
        source = _local(root, _field(path, f"repositories[{i}]", entry, "path"))
        if not source.is_dir():
            raise TaskSourceError(f"{path}: field 'repositories[{i}].path' = {entry['path']!r}: "
                                  f"no such directory {source} (is code_base/{name} checked out?)")
        copies.append((name, str(source)))
    copies += _gittaskbench_inputs(root, path, config)
    prompt = description
    prompt_file = _field(path, where, config, "prompt_file", required=False)
    if prompt_file and _local(root, prompt_file).is_file():
        prompt = _local(root, prompt_file).read_text(encoding="utf-8")
    names = ", ".join(f"./{name}" for name, _ in copies if not name.startswith("input/"))
    statement = f"{prompt}\n\nRepositories: {names}. Input files, if any: ./input/."
    return BenchTask(task_id=task_id, source="gittaskbench", problem_statement=statement,
                     copies=tuple(copies), trace_id=task_id)


def _gittaskbench_inputs(root: Path, path: Path, config: Mapping[str, Any]) -> list[tuple[str, str]]:
    file_paths = config.get("file_paths") or {}
    inputs = file_paths.get("input_files") if isinstance(file_paths, dict) else None
    out = []
    for i, item in enumerate(inputs or []):
        given = item.get("path") if isinstance(item, dict) else None
        if not given:  # the configs carry {"path": "", "description": ""} for "no input"
            continue
        source = _local(root, given)
        if not source.exists():
            raise TaskSourceError(f"{path}: field 'file_paths.input_files[{i}].path' = {given!r}: "
                                  f"no such file {source}")
        out.append((f"input/{source.name}", str(source)))
    return out


# ----------------------------------------------------------------------------- RepoBench
_REPOBENCH_PROMPT = (
    "Repository-level code completion (RepoBench). The file {file_path} stops where code must be "
    "completed. Read it and the other files of this repository that it uses, then append exactly "
    "one line to {file_path}: the next line of code. Do not change anything else.")


def load_repobench(path: Path) -> list[BenchTask]:
    """RepoBench completion samples as tasks (see the module docstring).

    Task ids: ``repobench-<row>-<repo_name with / as __>``.

    Raises:
        TaskSourceError: a bad file or row, a missing or mistyped field (``repo_name``,
            ``file_path``, ``next_line``, ``cropped_code`` or ``code``, ``context``), or a
            ``file_path`` / context ``path`` that leaves the workspace.
    """
    tasks = []
    for index, (where, row) in enumerate(read_rows(path)):
        repo = _field(path, where, row, "repo_name")
        file_path = _safe_relative(path, where, "file_path", _field(path, where, row, "file_path"))
        next_line = row.get("next_line")
        if not isinstance(next_line, str):
            raise TaskSourceError(f"{path}: {where}: missing field 'next_line' (text)"
                                  if next_line is None else
                                  f"{path}: {where}: field 'next_line' must be text, got "
                                  f"{type(next_line).__name__}")
        code_field = "cropped_code" if "cropped_code" in row else "code"
        code = row.get(code_field)
        if not isinstance(code, str):
            raise TaskSourceError(f"{path}: {where}: missing field 'cropped_code' (v1.1) or "
                                  "'code' (v1): the in-file code before the completion point")
        imports = row.get("import_statement") or ""
        head = f"{imports}\n" if imports and not code.startswith(imports) else ""
        files = {file_path: head + code.rstrip("\n") + "\n"}
        for i, snippet in enumerate(_context(path, where, row)):
            if snippet[0] != file_path:
                files[snippet[0]] = files.get(snippet[0], "") + snippet[1].rstrip("\n") + "\n"
            else:
                raise TaskSourceError(f"{path}: {where}: field 'context[{i}].path' is the file "
                                      f"being completed ({file_path})")
        tasks.append(BenchTask(
            task_id=f"repobench-{index}-{repo.replace('/', '__')}", source="repobench",
            problem_statement=_REPOBENCH_PROMPT.format(file_path=file_path),
            files=tuple(sorted(files.items())), expected=next_line))
    return _unique(tasks, path)


def _context(path: Path, where: str, row: Mapping[str, Any]) -> list[tuple[str, str]]:
    """Cross-file snippets as ``(relative path, text)``; v1 string snippets go to ``context/``."""
    context = row.get("context")
    if context is None:
        return []
    if not isinstance(context, list):
        raise TaskSourceError(f"{path}: {where}: field 'context' must be a list, got "
                              f"{type(context).__name__}")
    out = []
    for i, item in enumerate(context):
        if isinstance(item, str):  # RepoBench v1: snippets without paths
            out.append((f"context/snippet_{i}.txt", item))
        elif isinstance(item, dict) and isinstance(item.get("snippet"), str) \
                and isinstance(item.get("path"), str):
            out.append((_safe_relative(path, where, f"context[{i}].path", item["path"]),
                        item["snippet"]))
        else:
            raise TaskSourceError(f"{path}: {where}: field 'context[{i}]' must be text or an "
                                  "object with text 'path' and 'snippet'")
    return out


def _safe_relative(path: Path, where: str, field: str, value: str) -> str:
    relative = Path(value.lstrip("/"))
    if not value.strip() or ".." in relative.parts:
        raise TaskSourceError(f"{path}: {where}: field {field!r} = {value!r} is not a path inside "
                              "the repository")
    return relative.as_posix()


# ----------------------------------------------------------------------------- dispatch
SOURCES: Mapping[str, str] = {
    "swebench": "SWE-bench dataset rows (.jsonl/.json/.parquet) + --repos-dir mirror",
    "gittaskbench": "a GitTaskBench checkout (queries/*/query.json, code_base/)",
    "repobench": "RepoBench completion samples (.jsonl/.json/.parquet)",
}
"""Source name → what ``--tasks`` points at."""


def load_tasks(source: str, path: Path, repos_dir: Path | None = None,
               limit: int | None = None) -> list[BenchTask]:
    """Load ``source``'s tasks from ``path``; the first ``limit`` (in file order) if given.

    Raises:
        TaskSourceError: an unknown ``source`` (lists the known ones), SWE-bench without
            ``repos_dir``, or the loader's own errors.
    """
    loaders: dict[str, Callable[[], list[BenchTask]]] = {
        "swebench": lambda: load_swebench(path, _need(repos_dir)),
        "gittaskbench": lambda: load_gittaskbench(path),
        "repobench": lambda: load_repobench(path),
    }
    if source not in loaders:
        raise TaskSourceError(f"unknown task source {source!r}; expected one of "
                              f"{', '.join(SOURCES)}")
    tasks = loaders[source]()
    return tasks[:limit] if limit is not None else tasks


def _need(repos_dir: Path | None) -> Path:
    if repos_dir is None:
        raise TaskSourceError("SWE-bench tasks need --repos-dir (the folder of local git clones)")
    return repos_dir


_SAFE_NAME = re.compile(r"[^A-Za-z0-9._-]+")


def materialize(task: BenchTask, workspace: Path) -> dict[str, str | None]:
    """Build ``task``'s workspace if it has no ``repo``; return the runner's task fields.

    Args:
        task: the task.
        workspace: the directory to create for copy/file tasks (must not exist yet).

    Returns:
        ``{"repo", "base_commit"}`` for repository tasks (the runner clones them itself), else
        ``{"workspace"}`` = ``workspace``, now holding the copies and files.

    Raises:
        FileExistsError: ``workspace`` exists already.
    """
    if task.repo is not None:
        return {"repo": task.repo, "base_commit": task.base_commit}
    workspace.mkdir(parents=True, exist_ok=False)
    for destination, source in task.copies:
        target = workspace / destination
        target.parent.mkdir(parents=True, exist_ok=True)
        if Path(source).is_dir():
            shutil.copytree(source, target, symlinks=True)
        else:
            shutil.copy2(source, target)
    for relative, text in task.files:
        target = workspace / relative
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_text(text, encoding="utf-8")
    return {"workspace": str(workspace.resolve())}


def safe_dir_name(task_id: str) -> str:
    """``task_id`` as a file name (runs of other characters become ``_``). Pure.

    >>> safe_dir_name("a/b c")
    'a_b_c'
    """
    return _SAFE_NAME.sub("_", task_id)
