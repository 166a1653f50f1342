"""Process-level behaviour: cold import without heavy deps, a real crash, Parquet without pyarrow."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from stream_samples import sample_events

from mars_openhands.stream.reader import StreamReadError, iter_events, read_stream
from mars_openhands.stream.recorder import StreamRecorder

REPO = Path(__file__).parents[3]


def _run(code: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], cwd=REPO,
                          capture_output=True, text=True, timeout=120)


def test_stream_imports_without_heavy_dependencies() -> None:
    result = _run("""
        import sys
        import mars_openhands.stream
        from mars_openhands.stream import recorder, reader, transport
        heavy = sorted({m.split(".")[0] for m in sys.modules}
                       & {"pandas", "pyarrow", "numpy", "zmq", "vllm", "torch"})
        print(heavy)
    """)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "[]"


def test_hard_crash_keeps_flushed_events(tmp_path: Path) -> None:
    path = tmp_path / "stream.jsonl"
    result = _run(f"""
        import os, sys
        sys.path.insert(0, {str(Path(__file__).parent)!r})
        from stream_samples import sample_dict
        from mars_openhands.stream.recorder import StreamRecorder
        recorder = StreamRecorder({str(path)!r}, batch_size_events=100, flush_interval_s=60.0)
        for i in range(1000):
            recorder.record(sample_dict("engine_step", i))
        recorder.flush()
        for i in range(5):  # buffered only: lost in the crash
            recorder.record(sample_dict("engine_step", 1000 + i))
        with open({str(path)!r}, "a") as f:  # what a crash in the middle of a write leaves
            f.write('{{"kind": "engine_st')
        os._exit(3)  # no close(), no atexit, no finally
    """)
    assert result.returncode == 3, result.stderr
    assert not (tmp_path / "stream.parquet").exists()
    with pytest.raises(StreamReadError, match="truncated"):
        read_stream(path)
    frame = read_stream(path, skip_truncated_tail=True)
    assert len(frame) == 1000 and (frame["kind"] == "engine_step").all()
    with StreamRecorder(path, append=True) as recorder:  # the next run continues the stream
        recorder.record(sample_events()[0])
    assert len(read_stream(tmp_path / "stream.parquet")) == 1001


def test_parquet_without_pyarrow_fails_loudly_but_keeps_jsonl(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setitem(sys.modules, "pyarrow", None)  # makes `import pyarrow` raise ImportError
    recorder = StreamRecorder(tmp_path / "stream.jsonl")
    recorder.record(sample_events()[0])
    with pytest.raises(ImportError, match="write_parquet=False"):
        recorder.close()
    assert recorder.closed
    assert list(iter_events(tmp_path / "stream.jsonl")) == sample_events()[:1]
    assert not (tmp_path / "stream.parquet").exists()
