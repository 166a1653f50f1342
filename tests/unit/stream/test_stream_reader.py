"""read_stream / iter_events: dtypes, corrupt and truncated lines, the checked-in fixture."""

from __future__ import annotations

from pathlib import Path

import pandas as pd
import pytest
from stream_samples import sample_events

from mars_openhands.stream.events import EVENT_TYPES
from mars_openhands.stream.reader import (
    StreamReadError,
    column_dtypes,
    iter_events,
    jsonl_to_parquet,
    read_stream,
)
from mars_openhands.stream.recorder import StreamRecorder

FIXTURE = Path(__file__).parents[2] / "fixtures" / "stream" / "stream_v1.jsonl"


def _write_lines(path: Path, text: str) -> Path:
    path.write_text(text, encoding="utf-8")
    return path


def test_dtypes_and_columns(tmp_path: Path) -> None:
    events = sample_events()
    with StreamRecorder(tmp_path / "stream.jsonl") as recorder:
        for event in events:
            recorder.record(event)
    for suffix in (".jsonl", ".parquet"):
        frame = read_stream(tmp_path / f"stream{suffix}")
        assert list(frame.columns) == list(column_dtypes())
        assert frame["t_mono_ns"].dtype == "int64"
        assert isinstance(frame["t_wall"].dtype, pd.DatetimeTZDtype)
        assert str(frame["t_wall"].dt.tz) == "UTC"
        assert frame["num_prompt_tokens"].dtype == "Int64"
        assert frame["cpu_overloaded"].dtype == "boolean"
        assert frame["ttft_s"].dtype == "float64"
        # a field the kind lacks is null; one it has keeps its value
        queued = frame[frame["kind"] == "queued"].iloc[0]
        assert queued["num_prompt_tokens"] == 812 and pd.isna(queued["ttft_s"])
    pd.testing.assert_frame_equal(read_stream(tmp_path / "stream.jsonl"),
                                  read_stream(tmp_path / "stream.parquet"))


def test_empty_stream_has_all_columns(tmp_path: Path) -> None:
    with StreamRecorder(tmp_path / "stream.jsonl"):
        pass
    for suffix in (".jsonl", ".parquet"):
        frame = read_stream(tmp_path / f"stream{suffix}")
        assert len(frame) == 0 and list(frame.columns) == list(column_dtypes())


def test_corrupt_middle_line_names_the_line_number(tmp_path: Path) -> None:
    good = [e.model_dump_json() for e in sample_events()[:3]]
    path = _write_lines(tmp_path / "s.jsonl", f"{good[0]}\n{good[1]}\n{{not json\n{good[2]}\n")
    with pytest.raises(StreamReadError, match=r"s\.jsonl:3: event is not valid JSON"):
        read_stream(path)
    with pytest.raises(StreamReadError, match=r"s\.jsonl:3:"):  # never skipped: not the tail
        read_stream(path, skip_truncated_tail=True)


def test_invalid_event_line_names_line_and_field(tmp_path: Path) -> None:
    good = sample_events()[0].model_dump_json()
    bad = good.replace('"num_prompt_tokens":812', '"num_prompt_tokens":"x"')
    path = _write_lines(tmp_path / "s.jsonl", f"{good}\n\n{bad}\n")
    expected = r"s\.jsonl:3: invalid queued event: num_prompt_tokens"
    with pytest.raises(StreamReadError, match=expected):
        list(iter_events(path))


def test_truncated_final_line(tmp_path: Path) -> None:
    events = sample_events()
    complete = "".join(e.model_dump_json() + "\n" for e in events[:4])
    text = complete + events[4].model_dump_json()[:30]  # a crash mid-write
    path = _write_lines(tmp_path / "s.jsonl", text)
    with pytest.raises(StreamReadError, match=r"s\.jsonl:5: truncated.*skip_truncated_tail=True"):
        read_stream(path)
    assert list(iter_events(path, skip_truncated_tail=True)) == events[:4]
    assert list(read_stream(path, skip_truncated_tail=True)["kind"]) == list(EVENT_TYPES)[:4]


def test_complete_final_line_without_newline_is_kept(tmp_path: Path) -> None:
    events = sample_events()[:2]
    path = _write_lines(tmp_path / "s.jsonl", "\n".join(e.model_dump_json() for e in events))
    assert list(iter_events(path)) == events


def test_unsupported_suffix(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match=r"\.jsonl or \.parquet"):
        read_stream(tmp_path / "stream.csv")


_KINDS_AFTER_V1 = {"aborted", "replica_replaced"}
"""Kinds added after stream_v1.jsonl was written."""


def test_old_shape_fixture_reads_back(tmp_path: Path) -> None:
    """stream_v1.jsonl was written by the first event shape; it must stay readable."""
    events = list(iter_events(FIXTURE))
    assert {e.kind for e in events} == set(EVENT_TYPES) - _KINDS_AFTER_V1
    frame = read_stream(FIXTURE)
    assert len(frame) == len(events) == 16
    assert frame["t_wall"].is_monotonic_increasing
    finished = frame[frame["kind"] == "finished"].iloc[0]
    assert finished["num_blocks_retained"] == 48 and finished["session_id"] == "sess-a"
    assert jsonl_to_parquet(FIXTURE, tmp_path / "fixture.parquet") == 16
    assert list(iter_events(tmp_path / "fixture.parquet")) == events
