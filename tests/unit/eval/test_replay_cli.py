"""``mars-openhands replay`` command-line behaviour: config error lines, a refused run that
writes nothing, ``--help`` and Ctrl-C.

(The replay driver itself and the flag generation are tested in ``test_replay.py``.)
"""

from __future__ import annotations

import argparse
import json
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from eval.replay import EXIT_BAD_INPUT, EXIT_INTERRUPTED, add_replay_subcommand
from eval.workloads.format import save_workload
from eval.workloads.synth import synthesize
from mars_openhands.stream.reader import read_stream
from tests.proc_tree import reap_with_this_process


def _cli(*argv: str) -> int:
    parser = argparse.ArgumentParser()
    add_replay_subcommand(parser.add_subparsers())
    args = parser.parse_args(["replay", *argv])
    return args.func(args)


@pytest.fixture
def workload_path(tmp_path: Path) -> Path:
    path = tmp_path / "w.json"
    save_workload(synthesize("swebench", 2, 0), path)
    return path


@pytest.mark.parametrize(
    "flags, expected",
    [
        (["--num-tool-workers", "-1"],
         ["mars-openhands replay: error: --num-tool-workers: Input should be greater than or equal to 1 (got -1)"]),
        (["--endpoint-url", "notaurl"],
         ["mars-openhands replay: error: --endpoint-url: endpoint_url must be an http(s) server root such as "
          "http://127.0.0.1:8000, got 'notaurl'"]),
        (["--max-connections", "0", "--request-timeout-s", "-2"],
         ["mars-openhands replay: error: --max-connections: Input should be greater than or equal to 1 (got 0)",
          "mars-openhands replay: error: --request-timeout-s: Input should be greater than 0 (got -2.0)"]),
        # no host, or not parseable: accepted, then every session ended with a connection error
        (["--endpoint-url", "http://"],
         ["mars-openhands replay: error: --endpoint-url: endpoint_url must be an http(s) server root such as "
          "http://127.0.0.1:8000, got 'http://'"]),
        (["--endpoint-url", "http://127.0.0.1:99999"],
         ["mars-openhands replay: error: --endpoint-url: endpoint_url is not a URL (Port out of range 0-65535); "
          "give an http(s) server root such as http://127.0.0.1:8000, got 'http://127.0.0.1:99999'"]),
        (["--token-id-low", "9", "--token-id-high", "4"],
         ["mars-openhands replay: error: --token-id-high: token_id_high (4) must be > token_id_low (9); set them to a "
          "range of valid ids of the served model's vocab (got 4)"]),
    ],
)
def test_bad_config_flags_are_one_line_each_naming_the_flag(
        workload_path: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str],
        flags: list[str], expected: list[str]) -> None:
    code = _cli(str(workload_path), "-o", str(tmp_path / "s.jsonl"), "--endpoint-url",
                "http://127.0.0.1:9", "--model", "m", *flags)
    err = capsys.readouterr().err
    assert code == EXIT_BAD_INPUT
    assert err.splitlines() == expected
    assert "pydantic" not in err and "input_value" not in err
    assert not (tmp_path / "s.jsonl").exists()


def test_a_run_refused_up_front_leaves_no_file_so_the_rerun_works(
        workload_path: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str], not_found_endpoint: str) -> None:
    """Sessions that do not fit refuse the run before any request; it left an empty stream (and
    its Parquet copy), so the rerun the message suggests failed with "already exists"."""
    out = tmp_path / "run" / "s.jsonl"
    argv = [str(workload_path), "-o", str(out), "--endpoint-url", not_found_endpoint, "--model", "m",
            "--no-show-progress", "--request-timeout-s", "5"]
    assert _cli(*argv, "--max-model-len-tokens", "10") == EXIT_BAD_INPUT
    err = capsys.readouterr().err
    assert "2 of 2 sessions need more than max_model_len = 10" in err and len(err.splitlines()) == 1
    assert not (tmp_path / "run").exists()  # not even the folder it would have made
    assert _cli(*argv, "--max-model-len-tokens", "10", "--overflow", "end_session") == 1  # the rerun
    assert "already exists" not in capsys.readouterr().err
    assert out.is_file() and out.with_suffix(".parquet").is_file() and out.with_suffix(".result.json").is_file()


@pytest.mark.parametrize("existing", [".jsonl", ".parquet", ".result.json"])
def test_an_existing_output_is_never_overwritten_and_refuses_the_run(
        workload_path: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str], existing: str) -> None:
    out = tmp_path / "s.jsonl"
    mine = out.with_suffix(existing)
    mine.write_text("the user's\n")
    assert _cli(str(workload_path), "-o", str(out), "--endpoint-url", "http://127.0.0.1:9", "--model", "m",
                "--max-model-len-tokens", "100000", "--no-show-progress") == EXIT_BAD_INPUT
    assert capsys.readouterr().err == (f"mars-openhands replay: error: --output {out}: {mine} already exists; "
                                       "one run yields one stream: choose a new path or run directory\n")
    assert mine.read_text() == "the user's\n" and sorted(p.name for p in tmp_path.iterdir()) == sorted(
        ["w.json", mine.name])


def test_help_shows_defaults_and_no_none_or_markup() -> None:
    parser = argparse.ArgumentParser(prog="mars-openhands")
    add_replay_subcommand(parser.add_subparsers())
    replay = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction)).choices["replay"]
    text = " ".join(replay.format_help().split())
    assert "None" not in text and "``" not in text and ":mod:" not in text
    for shown in ("(default: 512)", "(default: 600.0)", "(default: --stream)", "(default: sleep)",
                  "Not given: no cap", "Not given: no bound", "not given: read max_model_len"):
        assert shown in text, shown


@pytest.fixture
def hanging_endpoint() -> Iterator[str]:
    """``http://127.0.0.1:PORT`` of a server that accepts connections and never answers."""
    server = socket.create_server(("127.0.0.1", 0))
    server.settimeout(0.2)
    conns: list[socket.socket] = []
    stop = threading.Event()

    def accept() -> None:
        while not stop.is_set():
            try:
                conns.append(server.accept()[0])
            except TimeoutError:
                continue

    thread = threading.Thread(target=accept, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.getsockname()[1]}"
    stop.set()
    thread.join(timeout=5)
    for conn in conns:
        conn.close()
    server.close()


def test_ctrl_c_prints_one_line_exits_130_and_keeps_the_stream(
        workload_path: Path, tmp_path: Path, hanging_endpoint: str) -> None:
    stream = tmp_path / "run" / "stream.jsonl"
    proc = subprocess.Popen(
        [sys.executable, "-m", "eval.cli", "replay", str(workload_path), "-o",
         str(stream), "--endpoint-url", hanging_endpoint, "--model", "m",
         "--max-model-len-tokens", "100000", "--no-show-progress"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True,
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))  # as from a terminal
    reap_with_this_process(proc.pid)  # it waits on a hanging endpoint: not after a killed pytest
    try:
        deadline = time.monotonic() + 60  # until both sessions started (flushed every 1 s)
        while time.monotonic() < deadline and (
                not stream.exists() or stream.read_text().count("session_start") < 2):
            time.sleep(0.2)
        proc.send_signal(signal.SIGINT)
        _, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == EXIT_INTERRUPTED, err
    assert err.splitlines() == [f"interrupted; the stream so far is in {stream}"]
    events = [json.loads(line) for line in stream.read_text().splitlines()]
    ends = [e for e in events if e["kind"] == "session_end"]
    assert sorted(e["session_id"] for e in ends) == sorted(
        e["session_id"] for e in events if e["kind"] == "session_start")
    assert {e["status"] for e in ends} == {"cancelled"}
    assert len(read_stream(stream.with_suffix(".parquet"))) == len(events)
