"""Task sources in their native formats (eval.task_sources): SWE-bench rows + a repo mirror,
GitTaskBench configs, RepoBench samples; fixtures written here, malformed inputs included."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pandas as pd
import pytest

from eval.task_sources import (
    TaskSourceError,
    load_gittaskbench,
    load_repobench,
    load_swebench,
    load_tasks,
    materialize,
    read_rows,
)


def _git_repo(path: Path, files: dict[str, str]) -> str:
    """A tiny git repository with one commit; returns its sha."""
    path.mkdir(parents=True)
    for name, text in files.items():
        (path / name).parent.mkdir(parents=True, exist_ok=True)
        (path / name).write_text(text)
    env = ["-c", "user.name=t", "-c", "user.email=t@t"]
    subprocess.run(["git", "init", "-q", str(path)], check=True)
    subprocess.run(["git", "-C", str(path), "add", "-A"], check=True)
    subprocess.run(["git", "-C", str(path), *env, "commit", "-qm", "base"], check=True)
    return subprocess.run(["git", "-C", str(path), "rev-parse", "HEAD"], check=True,
                          capture_output=True, text=True).stdout.strip()


@pytest.fixture()
def mirror(tmp_path: Path) -> tuple[Path, dict[str, str]]:
    """A mirror with two layouts: owner__name and owner/name."""
    root = tmp_path / "mirror"
    shas = {"pydicom/pydicom": _git_repo(root / "pydicom__pydicom", {"pydicom/config.py": "x = 1\n"}),
            "sqlfluff/sqlfluff": _git_repo(root / "sqlfluff" / "sqlfluff", {"src/a.py": "a = 1\n"})}
    return root, shas


def _swe_rows(shas: dict[str, str]) -> list[dict]:
    return [{"instance_id": "pydicom__pydicom-901", "repo": "pydicom/pydicom",
             "base_commit": shas["pydicom/pydicom"], "problem_statement": "logging is configured",
             "patch": "diff ...", "FAIL_TO_PASS": "[]", "version": "1.0"},
            {"instance_id": "sqlfluff__sqlfluff-1517", "repo": "sqlfluff/sqlfluff",
             "base_commit": shas["sqlfluff/sqlfluff"], "problem_statement": "L003 is wrong"}]


def _write_jsonl(path: Path, rows: list) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


@pytest.mark.parametrize("fmt", ["jsonl", "json", "parquet"])
def test_swebench_rows_in_each_format(tmp_path, mirror, fmt):
    root, shas = mirror
    rows = _swe_rows(shas)
    path = tmp_path / f"lite.{fmt}"
    if fmt == "jsonl":
        _write_jsonl(path, rows)
    elif fmt == "json":
        path.write_text(json.dumps(rows))
    else:
        pd.DataFrame(rows).to_parquet(path)
    tasks = load_swebench(path, root)
    assert [t.task_id for t in tasks] == ["pydicom__pydicom-901", "sqlfluff__sqlfluff-1517"]
    assert tasks[0].repo == str((root / "pydicom__pydicom").resolve())
    assert tasks[1].repo == str((root / "sqlfluff" / "sqlfluff").resolve())
    assert tasks[0].base_commit == shas["pydicom/pydicom"]
    assert tasks[0].trace_id == "pydicom__pydicom-901" and tasks[0].source == "swebench"
    assert materialize(tasks[0], tmp_path / "unused") == {"repo": tasks[0].repo,
                                                          "base_commit": tasks[0].base_commit}
    assert not (tmp_path / "unused").exists()


@pytest.mark.parametrize(("mutate", "message"), [
    (lambda r: r.pop("base_commit"), "line 1 (instance_id pydicom__pydicom-901): missing field 'base_commit'"),
    (lambda r: r.update(problem_statement=""), "field 'problem_statement' must be non-empty text"),
    (lambda r: r.update(repo=42), "field 'repo' must be non-empty text, got int"),
    (lambda r: r.update(repo="nobody/nothing"), "field 'repo' = 'nobody/nothing' has no git clone"),
    (lambda r: r.update(base_commit="0" * 40), "field 'base_commit' = '" + "0" * 40 + "' is not a commit"),
    (lambda r: r.pop("instance_id"), "line 1: missing field 'instance_id'"),
])
def test_swebench_bad_rows_name_file_row_and_field(tmp_path, mirror, mutate, message):
    root, shas = mirror
    rows = _swe_rows(shas)
    mutate(rows[0])
    path = _write_jsonl(tmp_path / "rows.jsonl", rows)
    with pytest.raises(TaskSourceError) as info:
        load_swebench(path, root)
    assert str(info.value).startswith(f"{path}: ")
    assert message in str(info.value)
    assert "\n" not in str(info.value)


def test_malformed_files(tmp_path, mirror):
    root, _ = mirror
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"instance_id": "a"}\n{not json\n')
    with pytest.raises(TaskSourceError, match=r"bad.jsonl: line 2: not JSON"):
        list(read_rows(bad))
    scalar = tmp_path / "scalar.jsonl"
    scalar.write_text("[1, 2]\n")
    with pytest.raises(TaskSourceError, match=r"line 1: expected a JSON object, got list"):
        list(read_rows(scalar))
    with pytest.raises(TaskSourceError, match=r"missing.jsonl: no such file"):
        load_swebench(tmp_path / "missing.jsonl", root)
    with pytest.raises(TaskSourceError, match=r"unknown dataset format '.csv'"):
        list(read_rows(_write_jsonl(tmp_path / "rows.csv", [])))
    broken = tmp_path / "broken.parquet"
    broken.write_bytes(b"PAR1 not really")
    with pytest.raises(TaskSourceError, match=r"broken.parquet: not a readable Parquet file"):
        list(read_rows(broken))
    with pytest.raises(TaskSourceError, match=r"not a directory .*--repos-dir"):
        load_swebench(bad, tmp_path / "no-mirror")


def test_duplicate_ids_and_dispatch(tmp_path, mirror):
    root, shas = mirror
    rows = _swe_rows(shas)
    path = _write_jsonl(tmp_path / "dup.jsonl", [rows[0], rows[0]])
    with pytest.raises(TaskSourceError, match="appears twice"):
        load_swebench(path, root)
    path = _write_jsonl(tmp_path / "ok.jsonl", rows)
    assert [t.task_id for t in load_tasks("swebench", path, root, limit=1)] == ["pydicom__pydicom-901"]
    with pytest.raises(TaskSourceError, match="need --repos-dir"):
        load_tasks("swebench", path)
    with pytest.raises(TaskSourceError, match="unknown task source 'humaneval'; expected one of swebench"):
        load_tasks("humaneval", path)


# ----------------------------------------------------------------------------- GitTaskBench
def _gittaskbench(root: Path, configs: dict[str, dict]) -> Path:
    (root / "code_base" / "Faker" / "faker").mkdir(parents=True)
    (root / "code_base" / "Faker" / "README.md").write_text("Faker makes fake data\n")
    (root / "code_base" / "Faker" / "faker" / "__init__.py").write_text("VERSION = '1'\n")
    for task_id, config in configs.items():
        (root / "queries" / task_id / "input").mkdir(parents=True)
        (root / "queries" / task_id / "query.json").write_text(json.dumps(config))
    return root


def _faker_config(task_id: str = "Faker_01", **update) -> dict:
    config = {"task_id": task_id, "task_description": "Generate 100 fake users as CSV",
              "prompt_file": f"/GitTaskBench/queries/{task_id}/task_meta/openhands_prompt.md",
              "repositories": [{"name": "Faker", "path": "/GitTaskBench/code_base/Faker",
                                "url": "https://github.com/joke2k/faker"}],
              "working_sub_directory_name": f"/{task_id}",
              "file_paths": {"input_files": [{"path": "", "description": ""}]}}
    config.update(update)
    return config


def test_gittaskbench_configs(tmp_path):
    root = _gittaskbench(tmp_path / "GitTaskBench", {
        "Faker_01": _faker_config(),
        "Faker_02": _faker_config("Faker_02", file_paths={"input_files": [
            {"path": "/GitTaskBench/queries/Faker_02/input/names.txt", "description": "names"}]})})
    (root / "queries" / "Faker_02" / "input" / "names.txt").write_text("ann\nbob\n")
    meta = root / "queries" / "Faker_02" / "task_meta"
    meta.mkdir()
    (meta / "openhands_prompt.md").write_text("Use the Faker repository to write users.csv")
    tasks = load_gittaskbench(root)
    assert [t.task_id for t in tasks] == ["Faker_01", "Faker_02"]
    assert tasks[0].problem_statement.startswith("Generate 100 fake users as CSV")
    assert tasks[1].problem_statement.startswith("Use the Faker repository")  # the prompt file wins
    assert "./Faker" in tasks[0].problem_statement
    fields = materialize(tasks[1], tmp_path / "ws")
    workspace = Path(fields["workspace"])
    assert (workspace / "Faker" / "faker" / "__init__.py").read_text() == "VERSION = '1'\n"
    assert (workspace / "input" / "names.txt").read_text() == "ann\nbob\n"
    with pytest.raises(FileExistsError):
        materialize(tasks[1], tmp_path / "ws")


@pytest.mark.parametrize(("config", "message"), [
    (_faker_config(repositories=[]), "field 'repositories' is empty"),
    ({k: v for k, v in _faker_config().items() if k != "task_description"},
     "config: missing field 'task_description'"),
    (_faker_config(repositories=[{"name": "Nope", "path": "/GitTaskBench/code_base/Nope"}]),
     "field 'repositories[0].path' = '/GitTaskBench/code_base/Nope': no such directory"),
    (_faker_config(repositories=[{"path": "/GitTaskBench/code_base/Faker"}]),
     "repositories[0]: missing field 'name'"),
    (_faker_config(file_paths={"input_files": [{"path": "/GitTaskBench/queries/x.png"}]}),
     "field 'file_paths.input_files[0].path' = '/GitTaskBench/queries/x.png': no such file"),
])
def test_gittaskbench_bad_configs(tmp_path, config, message):
    root = _gittaskbench(tmp_path / "g", {"Faker_01": config})
    with pytest.raises(TaskSourceError) as info:
        load_gittaskbench(root)
    assert str(info.value).startswith(str(root / "queries" / "Faker_01" / "query.json"))
    assert message in str(info.value)


def test_gittaskbench_missing_tree_and_bad_json(tmp_path):
    with pytest.raises(TaskSourceError, match="not a GitTaskBench checkout"):
        load_gittaskbench(tmp_path)
    (tmp_path / "queries").mkdir()
    with pytest.raises(TaskSourceError, match="no task configs"):
        load_gittaskbench(tmp_path)
    (tmp_path / "queries" / "T_01").mkdir()
    (tmp_path / "queries" / "T_01" / "query.json").write_text('{"task_id": "T_01",')
    with pytest.raises(TaskSourceError, match=r"T_01/query.json: not JSON"):
        load_gittaskbench(tmp_path)


# ----------------------------------------------------------------------------- RepoBench
def _repobench_v11() -> dict:
    return {"repo_name": "alice/geo", "file_path": "geo/shapes.py",
            "context": [{"identifier": "Point", "path": "geo/point.py",
                         "snippet": "class Point:\n    def __init__(self, x, y): ..."}],
            "import_statement": "from geo.point import Point",
            "token_num": 321, "cropped_code": "def origin():\n", "all_code": "...",
            "next_line": "    return Point(0, 0)", "gold_snippet_index": 0, "level": "2k"}


@pytest.mark.parametrize("fmt", ["jsonl", "parquet"])
def test_repobench_samples_as_tasks(tmp_path, fmt):
    v1 = {"repo_name": "bob/calc", "file_path": "calc/ops.py", "context": ["def add(a, b): ..."],
          "import_statement": "", "code": "def sub(a, b):\n", "next_line": "    return a - b",
          "gold_snippet_index": 0}
    path = tmp_path / f"rb.{fmt}"
    if fmt == "jsonl":
        _write_jsonl(path, [_repobench_v11(), v1])
    else:  # a split file holds one version (Arrow cannot mix v1.1's objects with v1's strings)
        v1["context"] = [{"path": "context/snippet_0.txt", "snippet": "def add(a, b): ..."}]
        v1["cropped_code"] = v1.pop("code")
        pd.DataFrame([_repobench_v11(), v1]).to_parquet(path)
    tasks = load_repobench(path)
    assert [t.task_id for t in tasks] == ["repobench-0-alice__geo", "repobench-1-bob__calc"]
    assert tasks[0].expected == "    return Point(0, 0)"
    assert "geo/shapes.py" in tasks[0].problem_statement
    workspace = Path(materialize(tasks[0], tmp_path / "ws0")["workspace"])
    assert (workspace / "geo" / "shapes.py").read_text() == "from geo.point import Point\ndef origin():\n"
    assert (workspace / "geo" / "point.py").read_text().startswith("class Point:")
    workspace = Path(materialize(tasks[1], tmp_path / "ws1")["workspace"])
    assert (workspace / "context" / "snippet_0.txt").read_text() == "def add(a, b): ...\n"
    assert (workspace / "calc" / "ops.py").read_text() == "def sub(a, b):\n"


@pytest.mark.parametrize(("mutate", "message"), [
    (lambda r: r.pop("next_line"), "line 1: missing field 'next_line'"),
    (lambda r: r.pop("cropped_code"), "missing field 'cropped_code' (v1.1) or 'code' (v1)"),
    (lambda r: r.update(file_path="../../etc/passwd"), "field 'file_path' = '../../etc/passwd' is not a path"),
    (lambda r: r.update(context="oops"), "field 'context' must be a list, got str"),
    (lambda r: r.update(context=[{"path": "a.py"}]), "field 'context[0]' must be text or an object"),
    (lambda r: r.pop("repo_name"), "line 1: missing field 'repo_name'"),
])
def test_repobench_bad_samples(tmp_path, mutate, message):
    row = _repobench_v11()
    mutate(row)
    path = _write_jsonl(tmp_path / "rb.jsonl", [row])
    with pytest.raises(TaskSourceError) as info:
        load_repobench(path)
    assert str(info.value).startswith(f"{path}: ")
    assert message in str(info.value)
