"""``workload`` subcommand through argparse, as the top-level CLI will wire it."""

from __future__ import annotations

import argparse
import shutil
from pathlib import Path

import pytest

from eval.workloads.cli import add_workload_subcommand
from eval.workloads.format import load_workload

FIXTURES = Path(__file__).parents[2] / "fixtures" / "traces"


def _run(*argv: str) -> int:
    parser = argparse.ArgumentParser(prog="mars-openhands")
    add_workload_subcommand(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(["workload", *argv])
    return args.func(args)


def test_from_traces_with_arrivals(tmp_path: Path, capsys) -> None:
    out = tmp_path / "w.json"
    assert _run("from-traces", str(FIXTURES / "good"), "-o", str(out), "--arrival", "fixed",
                "--rate", "0.5", "--tool-time-factor", "0.1") == 0
    workload = load_workload(out)
    assert [s.arrival_s for s in workload.sessions] == [0.0, 2.0]
    assert workload.sessions[0].turns[0].tool_duration_s == pytest.approx(0.25)
    assert "wrote" in capsys.readouterr().out


def test_a_malformed_trace_is_skipped_with_a_warning_naming_it(tmp_path: Path, capsys) -> None:
    """One malformed file aborted the whole folder unless --skip-malformed was given."""
    src = tmp_path / "src"
    src.mkdir()
    shutil.copy(FIXTURES / "good" / "demo__repo-1.traj.json", src)
    shutil.copy(FIXTURES / "malformed" / "missing_usage.traj.json", src)
    out = tmp_path / "w.jsonl"
    assert _run("from-traces", str(src), "-o", str(out)) == 0
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith(f"warning: {src}: skipped 1 trajectory file(s): "
                                                   "missing_usage.traj.json; first: missing_usage.traj.json")
    assert "extra.response.usage" in err
    assert len(load_workload(out).sessions) == 1
    assert _run("from-traces", str(src), "-o", str(out), "--skip-malformed") == 0  # the old flag still works


def test_malformed_traces_exit_2_and_write_nothing_when_asked_or_when_every_file_is(tmp_path: Path, capsys) -> None:
    src = tmp_path / "src"
    src.mkdir()
    shutil.copy(FIXTURES / "malformed" / "missing_usage.traj.json", src)
    out = tmp_path / "w.jsonl"
    assert _run("from-traces", str(src), "-o", str(out)) == 2  # nothing usable
    assert "no usable trajectory" in capsys.readouterr().err
    shutil.copy(FIXTURES / "good" / "demo__repo-1.traj.json", src)
    assert _run("from-traces", str(src), "-o", str(out), "--no-skip-malformed") == 2
    err = capsys.readouterr().err
    assert "missing_usage.traj.json" in err and "extra.response.usage" in err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["src"]


def test_synth_and_stats(tmp_path: Path, capsys) -> None:
    out = tmp_path / "w.jsonl.gz"
    assert _run("synth", "--kind", "swebench", "--sessions", "4", "--seed", "2", "-o", str(out),
                "--max-turns", "5", "--arrival", "poisson", "--rate", "1") == 0
    workload = load_workload(out)
    assert len(workload.sessions) == 4 and all(s.num_turns <= 5 for s in workload.sessions)
    capsys.readouterr()
    assert _run("stats", str(out)) == 0
    printed = " ".join(capsys.readouterr().out.split())  # rich wraps at the terminal width
    assert "4 sessions" in printed and "tool" in printed


@pytest.mark.parametrize("command", ["synth", "from-traces"])
def test_zero_caps_mean_no_cap_as_in_compare(tmp_path: Path, command: str) -> None:
    """compare --max-turns 0 means no limit; workload --max-turns 0 was refused."""
    source = ["--kind", "swebench", "--sessions", "3"] if command == "synth" else [str(FIXTURES / "good")]
    capped, uncapped = tmp_path / "all.json", tmp_path / "zero.json"
    assert _run(command, *source, "-o", str(capped)) == 0
    zeros = ["--max-turns", "0", "--max-context-tokens", "0", *(["--sessions", "0"] if command == "from-traces"
                                                                 else [])]
    assert _run(command, *source, "-o", str(uncapped), *zeros) == 0
    full, zero = load_workload(capped), load_workload(uncapped)
    assert [s.turns for s in zero.sessions] == [s.turns for s in full.sessions]


def test_stats_of_a_one_turn_workload_prints_no_nan(tmp_path: Path, capsys) -> None:
    """One turn, so no tool call and no appended tokens: the tools title said 'nan% of calls'."""
    import re

    from eval.workloads.format import Session, Turn, Workload, WorkloadMeta, save_workload

    path = tmp_path / "one.json"
    save_workload(Workload(meta=WorkloadMeta(source="test"), sessions=(
        Session(session_id="a", arrival_s=0.0, turns=(Turn(prompt_tokens_appended=10, output_tokens=2),)),)), path)
    assert _run("stats", str(path)) == 0
    printed = " ".join(capsys.readouterr().out.split())  # rich wraps a title to its table's width
    assert not re.search(r"\bnan\b", printed), printed
    assert "tools (no tool calls)" in printed and "1 sessions, 1 turns" in printed


def test_bad_arguments_exit_2(tmp_path: Path, capsys) -> None:
    assert _run("synth", "--kind", "swebench", "--sessions", "2", "-o", str(tmp_path / "w.json"),
                "--arrival", "poisson") == 2
    assert "needs --rate" in capsys.readouterr().err
    assert _run("stats", str(tmp_path / "missing.json")) == 2
    assert not (tmp_path / "w.json").exists()


@pytest.mark.parametrize(("argv", "expected"), [
    # each was a raw pydantic dump ("1 validation error for FixedRateArrivals; rate_per_s; ...")
    (["--arrival", "fixed", "--rate", "-1"], "--rate: expected a number > 0, got '-1'"),
    (["--arrival", "poisson", "--rate", "nan"], "--rate: expected a finite number, got 'nan'"),
    (["--arrival", "burst", "--burst-size", "0", "--burst-interval-s", "1"],
     "--burst-size: expected an integer >= 1, got '0'"),
    (["--arrival", "burst", "--burst-size", "2", "--burst-interval-s", "-1"],
     "--burst-interval-s: expected a number >= 0, got '-1'"),
    (["--max-turns", "-1"], "--max-turns: expected an integer >= 0 (0 = no limit), got '-1'"),
    (["--max-context-tokens", "1"], "--max-context-tokens: Input should be greater than or equal to 2 (got 1)"),
    # each was accepted, and the flag ignored
    (["--rate", "3"], "--rate 3: is the rate of --arrival fixed or poisson, and no --arrival is given; add "
     "--arrival fixed (evenly spaced) or --arrival poisson"),
    (["--arrival", "burst", "--burst-size", "2", "--burst-interval-s", "1", "--rate", "3"],
     "--rate 3: is the rate of --arrival fixed or poisson, and --arrival burst has none"),
    (["--arrival", "poisson", "--rate", "1", "--burst-size", "2"],
     "--burst-size: needs --arrival burst (got --arrival poisson)"),
])
@pytest.mark.parametrize("command", ["synth", "from-traces"])
def test_arrival_and_cap_errors_are_one_line_naming_the_flag(tmp_path: Path, capsys, command, argv, expected) -> None:
    from eval.cli import main

    out = tmp_path / "w.json"
    source = ["--kind", "swebench", "--sessions", "2"] if command == "synth" else [str(FIXTURES / "good")]
    try:
        code = main(["workload", command, *source, "-o", str(out), *argv])
    except SystemExit as e:  # argparse's own errors (the flag types)
        code = e.code
    err = capsys.readouterr().err
    assert code == 2
    assert err.count("\n") == 1 and err.startswith(f"mars-openhands workload {command}: error: {expected}"), err
    assert not out.exists()


@pytest.mark.parametrize("top", ["-1", "0", "two"])
def test_stats_top_below_1_is_rejected_with_exit_2(tmp_path: Path, capsys, top: str) -> None:
    out = tmp_path / "w.json"
    assert _run("synth", "--kind", "swebench", "--sessions", "2", "-o", str(out)) == 0
    with pytest.raises(SystemExit) as info:
        _run("stats", str(out), "--top", top)
    assert info.value.code == 2
    assert "argument --top: " in capsys.readouterr().err


def _help(command: str) -> str:
    parser = argparse.ArgumentParser(prog="mars-openhands")
    workload = add_workload_subcommand(parser.add_subparsers(dest="command", required=True))
    leaf = next(a for a in workload._actions if isinstance(a, argparse._SubParsersAction))
    return " ".join(leaf.choices[command].format_help().split())


def test_max_context_tokens_help_describes_what_the_cap_does(tmp_path: Path) -> None:
    text = _help("from-traces")
    assert "last turn whose prompt + output fits" in text and "shrunk" in text
    assert "--top N" in _help("stats") and "N >= 1" in _help("stats")
    # ... and that is what happens: a first turn over the cap is shrunk to it, output <= half
    out = tmp_path / "w.json"
    assert _run("from-traces", str(FIXTURES / "good"), "-o", str(out),
                "--max-context-tokens", "10") == 0
    for session in load_workload(out).sessions:
        (turn,) = session.turns
        assert turn.prompt_tokens_appended + turn.output_tokens == 10
        assert turn.output_tokens <= 5 and turn.tool_name is None


def test_mix_interleaves_files_and_a_single_file_is_exit_2(tmp_path: Path, capsys) -> None:
    agents, prompts, out = tmp_path / "a.json", tmp_path / "r.json", tmp_path / "mix.json"
    assert _run("synth", "--kind", "swebench", "--sessions", "3", "--seed", "1", "-o", str(agents),
                "--max-turns", "3") == 0
    assert _run("synth", "--kind", "repobench", "--sessions", "3", "--seed", "1", "-o", str(prompts)) == 0
    assert _run("mix", str(agents), str(prompts), "-o", str(out), "--seed", "1") == 0
    kinds = sorted(s.session_id.split("-")[0] for s in load_workload(out).sessions)
    assert kinds == ["repobench"] * 3 + ["swebench"] * 3
    capsys.readouterr()
    assert _run("mix", str(agents), "-o", str(tmp_path / "x.json")) == 2
    assert "at least two" in capsys.readouterr().err and not (tmp_path / "x.json").exists()
