"""Workload format: validation, hand-computed prompt lengths, file round trips, atomic writes."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from eval.workloads import format as workload_format
from eval.workloads.format import (
    FORMAT_VERSION,
    Session,
    Turn,
    Workload,
    WorkloadFormatError,
    WorkloadMeta,
    load_workload,
    save_workload,
)


def _session(session_id: str = "s0", arrival_s: float = 0.0) -> Session:
    return Session(session_id=session_id, arrival_s=arrival_s, turns=(
        Turn(prompt_tokens_appended=100, output_tokens=10, tool_name="pytest", tool_duration_s=2.5),
        Turn(prompt_tokens_appended=20, output_tokens=5, tool_name="cat", tool_duration_s=0.25),
        Turn(prompt_tokens_appended=7, output_tokens=3),
    ))


def _workload(num_sessions: int = 2) -> Workload:
    meta = WorkloadMeta(source="test", seed=7, notes=("hand-made",))
    return Workload(meta=meta, sessions=tuple(_session(f"s{i}", float(i)) for i in range(num_sessions)))


def test_prompt_lengths_follow_the_cumulative_rule() -> None:
    session = _session()
    # turn 1: 100 + 10 + 20; turn 2: 130 + 5 + 7
    assert [session.num_prompt_tokens(k) for k in range(3)] == [100, 130, 142]
    assert session.max_context_tokens == 145
    assert session.total_tool_s == pytest.approx(2.75)
    with pytest.raises(IndexError, match="turn 3 out of range"):
        session.num_prompt_tokens(3)


@pytest.mark.parametrize(("turns", "message"), [
    ([{"prompt_tokens_appended": 5, "output_tokens": 1, "tool_name": "ls", "tool_duration_s": 1.0}],
     "final turn 0 has tool_name 'ls'"),
    ([{"prompt_tokens_appended": 5, "output_tokens": 1}, {"prompt_tokens_appended": 5, "output_tokens": 1}],
     "turn 0 is not final but has no tool_name"),
    ([{"prompt_tokens_appended": 0, "output_tokens": 1}], "turn 0 must have prompt_tokens_appended >= 1"),
    ([{"prompt_tokens_appended": 5, "output_tokens": 0}], "output_tokens"),
    ([{"prompt_tokens_appended": 5, "output_tokens": 1, "tool_duration_s": 3.0}],
     "tool_duration_s is 3.0 but tool_name is null"),
    ([], "turns"),
])
def test_invalid_sessions_are_rejected(turns: list[dict], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        Session(session_id="x", turns=turns)


def test_duplicate_ids_and_unknown_versions_are_rejected() -> None:
    meta = WorkloadMeta(source="t")
    with pytest.raises(ValueError, match="duplicate session_id 's0'"):
        Workload(meta=meta, sessions=(_session("s0"), _session("s0")))
    with pytest.raises(ValueError, match=f"reads version {FORMAT_VERSION}"):
        Workload(format_version=FORMAT_VERSION + 1, meta=meta, sessions=())


@pytest.mark.parametrize("name", ["w.json", "w.jsonl", "w.json.gz", "w.jsonl.gz"])
def test_round_trip(tmp_path: Path, name: str) -> None:
    workload = _workload(3)
    path = save_workload(workload, tmp_path / name)
    assert load_workload(path) == workload
    assert [p.name for p in tmp_path.iterdir()] == [name]  # no temporary file left


def test_unsupported_suffix_is_an_error_and_writes_nothing(tmp_path: Path) -> None:
    with pytest.raises(WorkloadFormatError, match=r"w\.yaml: unsupported workload file name"):
        save_workload(_workload(), tmp_path / "w.yaml")
    assert list(tmp_path.iterdir()) == []


def test_failed_write_leaves_the_old_file_and_no_temporary(tmp_path: Path, monkeypatch) -> None:
    path = save_workload(_workload(1), tmp_path / "w.jsonl")
    before = path.read_bytes()

    def crash_midway(workload, f, as_jsonl):  # write a partial file, then fail
        f.write('{"format_version": 1, "meta"')
        raise OSError("disk full")

    monkeypatch.setattr(workload_format, "_write", crash_midway)
    with pytest.raises(OSError, match="disk full"):
        save_workload(_workload(3), path)
    assert path.read_bytes() == before
    assert [p.name for p in tmp_path.iterdir()] == ["w.jsonl"]


def test_malformed_jsonl_names_file_line_and_field(tmp_path: Path) -> None:
    path = save_workload(_workload(2), tmp_path / "w.jsonl")
    lines = path.read_text().splitlines()
    session = json.loads(lines[2])
    session["turns"][1]["output_tokens"] = 0
    lines[2] = json.dumps(session)
    path.write_text("\n".join(lines) + "\n")
    with pytest.raises(WorkloadFormatError, match=r"w\.jsonl:3: invalid session: turns\.1\.output_tokens"):
        load_workload(path)


@pytest.mark.parametrize(("text", "message"), [
    ("", "empty file"),
    ("[1, 2]\n", "first line must be the header"),
    ('{"format_version": 1, "meta": {"source": "x"}}\n{not json\n', "w.jsonl:2: invalid session"),
    ('{"format_version": 9, "meta": {"source": "x"}}\n', "format_version: unsupported"),
    ('{"format_version": 1, "meta": {"source": "x", "colour": 1}}\n',
     "w.jsonl: invalid workload: unknown key 'meta.colour'; 'meta' takes: source, seed, generator, arrival, notes"),
])
def test_malformed_jsonl_header(tmp_path: Path, text: str, message: str) -> None:
    path = tmp_path / "w.jsonl"
    path.write_text(text)
    with pytest.raises(WorkloadFormatError, match=message) as info:
        load_workload(path)
    assert str(path) in str(info.value)


def test_a_bad_session_line_is_the_shared_formatters_lines(tmp_path: Path) -> None:
    """Each problem with its key path and value, an unknown key with the keys its section takes
    and not its value, a check of the whole session as its message (was 'turns.1.output_tokens:
    Input should be greater than or equal to 1' without the value, 'turns.0.colour: Extra inputs
    are not permitted')."""
    path = save_workload(_workload(1), tmp_path / "w.jsonl")
    header, line = path.read_text().splitlines()
    session = json.loads(line)
    session["turns"][1]["output_tokens"] = 0
    session["turns"][0]["colour"] = "red"
    path.write_text(f"{header}\n{json.dumps(session)}\n")
    with pytest.raises(WorkloadFormatError) as info:
        load_workload(path)
    assert str(info.value) == (
        f"{path}:2: invalid session: unknown key 'turns.0.colour'; 'turns.0' takes: prompt_tokens_appended, "
        "output_tokens, tool_name, tool_duration_s; turns.1.output_tokens: Input should be greater than "
        "or equal to 1 (got 0)")
    session = json.loads(line)
    session["turns"][-1]["tool_name"] = "cat"
    path.write_text(f"{header}\n{json.dumps(session)}\n")
    with pytest.raises(WorkloadFormatError) as info:
        load_workload(path)
    assert str(info.value).startswith(f"{path}:2: invalid session: final turn 2 has tool_name 'cat'; ")


def test_malformed_json_document_names_the_field(tmp_path: Path) -> None:
    path = save_workload(_workload(2), tmp_path / "w.json")
    doc = json.loads(path.read_text())
    doc["sessions"][1]["turns"][0]["prompt_tokens_appended"] = -3
    path.write_text(json.dumps(doc))
    with pytest.raises(WorkloadFormatError, match=r"w\.json: invalid workload: sessions\.1\.turns\.0\.prompt_tokens_appended"):
        load_workload(path)
    (tmp_path / "bad.json.gz").write_bytes(b"not gzip")
    with pytest.raises(WorkloadFormatError, match=r"bad\.json\.gz: cannot read workload"):
        load_workload(tmp_path / "bad.json.gz")


def test_models_are_frozen() -> None:
    session = _session()
    with pytest.raises(ValueError):
        session.arrival_s = 3.0  # type: ignore[misc]


def test_save_creates_missing_parent_folders(tmp_path: Path) -> None:
    path = save_workload(_workload(2), tmp_path / "runs" / "new" / "w.json")
    assert path.exists() and load_workload(path) == _workload(2)
