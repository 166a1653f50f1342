"""StreamRecorder: JSONL + Parquet round trip, bad events, crash-safety, threads."""

from __future__ import annotations

import json
import threading
from pathlib import Path

import pytest
from stream_samples import sample_dict, sample_events

from mars_openhands.stream.events import EVENT_TYPES, EventError, parse_event
from mars_openhands.stream.reader import iter_events, read_stream
from mars_openhands.stream.recorder import StreamRecorder


@pytest.mark.parametrize("kind", list(EVENT_TYPES))
@pytest.mark.parametrize("suffix", [".jsonl", ".parquet"])
def test_round_trip_per_kind(tmp_path: Path, kind: str, suffix: str) -> None:
    event = parse_event(sample_dict(kind, 4))
    with StreamRecorder(tmp_path / "stream.jsonl") as recorder:
        recorder.record(event)
        recorder.record(sample_dict(kind, 5))  # dicts are validated and accepted too
    path = tmp_path / f"stream{suffix}"
    back = list(iter_events(path))
    assert back == [event, parse_event(sample_dict(kind, 5))]
    frame = read_stream(path)
    assert list(frame["kind"]) == [kind, kind]
    for name, value in event.model_dump().items():
        assert frame[name].iloc[0] == value, name


def test_all_kinds_in_one_stream_keep_order(tmp_path: Path) -> None:
    events = sample_events()
    with StreamRecorder(tmp_path / "stream.jsonl", batch_size_events=3) as recorder:
        for event in events:
            recorder.record(event)
        assert recorder.num_events == len(events)
    assert list(iter_events(tmp_path / "stream.jsonl")) == events
    assert list(iter_events(tmp_path / "stream.parquet")) == events
    lines = (tmp_path / "stream.jsonl").read_text().splitlines()
    assert [json.loads(line)["kind"] for line in lines] == list(EVENT_TYPES)


@pytest.mark.parametrize(
    ("bad", "field"),
    [
        ({"num_prompt_tokens": None}, "num_prompt_tokens"),
        ({"num_prompt_tokens": "lots"}, "num_prompt_tokens"),
        ({"request_id": 5}, "request_id"),
        ({"extra_field": 1}, "extra_field"),
        ({"kind": "no_such_kind"}, "no_such_kind"),
    ],
)
def test_bad_event_raises_and_file_stays_appendable(tmp_path: Path, bad: dict, field: str) -> None:
    good = sample_events()[:3]
    with StreamRecorder(tmp_path / "stream.jsonl", batch_size_events=1) as recorder:
        for event in good[:2]:
            recorder.record(event)
        with pytest.raises(EventError, match=field):
            recorder.record({**sample_dict("queued"), **bad})
        assert list(iter_events(tmp_path / "stream.jsonl")) == good[:2]  # already on disk, intact
        recorder.record(good[2])
        assert recorder.num_events == 3
    assert list(iter_events(tmp_path / "stream.jsonl")) == good
    assert len(read_stream(tmp_path / "stream.parquet")) == 3


def test_missing_field_and_non_event_are_rejected(tmp_path: Path) -> None:
    data = sample_dict("first_token")
    del data["ttft_s"]
    with StreamRecorder(tmp_path / "s.jsonl", write_parquet=False) as recorder:
        with pytest.raises(EventError, match="ttft_s"):
            recorder.record(data)
        with pytest.raises(EventError, match="cannot record a str"):
            recorder.record("queued")  # type: ignore[arg-type]
        assert recorder.num_events == 0
    assert (tmp_path / "s.jsonl").read_text() == ""
    assert not (tmp_path / "s.parquet").exists()


def test_existing_file_is_refused_unless_append(tmp_path: Path) -> None:
    path = tmp_path / "stream.jsonl"
    events = sample_events()
    with StreamRecorder(path, write_parquet=False) as recorder:
        recorder.record(events[0])
    with pytest.raises(FileExistsError, match="append=True"):
        StreamRecorder(path)
    with StreamRecorder(path, append=True, write_parquet=False) as recorder:
        recorder.record(events[1])
    assert list(iter_events(path)) == events[:2]


def test_append_after_crash_cuts_the_truncated_line(tmp_path: Path) -> None:
    path = tmp_path / "stream.jsonl"
    events = sample_events()
    full = events[0].model_dump_json() + "\n"
    path.write_text(full + events[1].model_dump_json()[:25])  # a crash mid-write
    with StreamRecorder(path, append=True) as recorder:
        recorder.record(events[2])
    assert list(iter_events(path)) == [events[0], events[2]]
    assert list(iter_events(tmp_path / "stream.parquet")) == [events[0], events[2]]


def test_timer_flushes_without_close(tmp_path: Path) -> None:
    path = tmp_path / "stream.jsonl"
    recorder = StreamRecorder(
        path, batch_size_events=1000, flush_interval_s=0.02, write_parquet=False
    )
    try:
        recorder.record(sample_events()[0])
        assert path.read_text() == ""  # buffered, below the batch size
        deadline = threading.Event()
        for _ in range(200):  # up to 2 s
            if path.read_text():
                break
            deadline.wait(0.01)
        assert len(path.read_text().splitlines()) == 1
    finally:
        recorder.close()


def test_record_after_close_raises(tmp_path: Path) -> None:
    recorder = StreamRecorder(tmp_path / "stream.jsonl", write_parquet=False)
    recorder.close()
    recorder.close()  # idempotent
    with pytest.raises(ValueError, match="closed"):
        recorder.record(sample_events()[0])


def test_concurrent_recording_from_threads(tmp_path: Path) -> None:
    num_threads, per_thread = 8, 500
    barrier = threading.Barrier(num_threads)

    def work(thread_index: int, recorder: StreamRecorder) -> None:
        barrier.wait()
        for i in range(per_thread):
            data = sample_dict("tool_start", i)
            recorder.record({**data, "tool_call_id": f"{thread_index}:{i}"})

    with StreamRecorder(tmp_path / "stream.jsonl", batch_size_events=7,
                        flush_interval_s=0.001) as recorder:
        threads = [threading.Thread(target=work, args=(t, recorder)) for t in range(num_threads)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        assert recorder.num_events == num_threads * per_thread
    frame = read_stream(tmp_path / "stream.parquet")
    assert len(frame) == num_threads * per_thread
    assert frame["tool_call_id"].is_unique
    for t in range(num_threads):  # each thread's events stay in its own order
        mine = frame[frame["tool_call_id"].str.startswith(f"{t}:")]
        assert [int(c.split(":")[1]) for c in mine["tool_call_id"]] == list(range(per_thread))


def test_a_parquet_stream_path_is_refused_before_anything_is_written(tmp_path) -> None:
    """The Parquet copy goes to ``path.with_suffix('.parquet')``: for a .parquet path that is the
    JSONL file itself, and the conversion would fail only at close, after the whole run."""
    path = tmp_path / "stream.parquet"
    with pytest.raises(ValueError, match=r"stream\.jsonl"):
        StreamRecorder(path)
    assert not path.exists()
    with StreamRecorder(path, write_parquet=False) as recorder:  # JSONL only: any name is fine
        assert recorder.path == path
