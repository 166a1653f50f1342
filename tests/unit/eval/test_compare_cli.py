"""``mars-openhands compare`` command-line behaviour (eval/compare.py, eval/compare_setup.py): argument
errors, default traces, an existing ``--out``, skipped trace files, Ctrl-C, and the help text."""

from __future__ import annotations

import argparse
import json
import shutil
from pathlib import Path

import pandas as pd
import pytest
from compare_helpers import small_workload

import eval.compare as compare
import eval.compare_setup as compare_setup
from eval.compare import add_compare_subcommand
from eval.compare_setup import DEFAULT_TRACES, clear_previous_results, default_traces_dir
from eval.sweep import CompareInterrupted, run_compare
from eval.sweep_options import CompareOptions, GpuSetup
from eval.workloads.format import save_workload
from mars_openhands.cli_signals import Terminated

TRACE_FIXTURES = Path(__file__).parents[2] / "fixtures" / "traces"


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="mars-openhands")
    add_compare_subcommand(parser.add_subparsers(dest="command"))
    return parser


def _run(argv: list[str]) -> int:
    args = _parser().parse_args(["compare", *argv])
    return args.func(args)


# ----------------------------------------------------------------------------- default traces
def test_no_default_traces_names_a_path_once_when_both_candidates_are_the_same(tmp_path, monkeypatch) -> None:
    """Run from the repository root, both candidates are one folder: it was listed twice."""
    monkeypatch.setattr(compare_setup, "_REPO_ROOT", tmp_path)
    with pytest.raises(FileNotFoundError) as info:
        default_traces_dir({}, tmp_path)
    assert str(info.value).count(str((tmp_path / DEFAULT_TRACES).resolve())) == 1
    assert f"tried {(tmp_path / DEFAULT_TRACES).resolve()}); pass --traces DIR" in str(info.value)


def test_default_traces_prefers_the_env_var_then_the_repo_then_the_cwd(tmp_path, monkeypatch) -> None:
    repo, cwd = tmp_path / "a" / "repo", tmp_path / "b" / "cwd"
    repo.mkdir(parents=True)
    cwd.mkdir(parents=True)
    monkeypatch.setattr(compare_setup, "_REPO_ROOT", repo)
    assert default_traces_dir({"MARS_TRACES_DIR": "/some/where"}, cwd) == Path("/some/where")
    (cwd / DEFAULT_TRACES).mkdir(parents=True)
    assert default_traces_dir({}, cwd) == (cwd / DEFAULT_TRACES).resolve()
    (repo / DEFAULT_TRACES).mkdir(parents=True)
    assert default_traces_dir({}, cwd) == (repo / DEFAULT_TRACES).resolve()


def test_no_default_traces_is_one_error_line_naming_the_paths_and_the_fix(tmp_path, monkeypatch,
                                                                          capsys) -> None:
    monkeypatch.setattr(compare_setup, "_REPO_ROOT", tmp_path / "repo")
    monkeypatch.delenv("MARS_TRACES_DIR", raising=False)
    monkeypatch.chdir(tmp_path)
    assert _run(["--policies", "fcfs", "--base-rate", "1", "--out", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("mars-openhands compare: error: ")
    assert str((tmp_path / "repo" / DEFAULT_TRACES).resolve()) in err
    assert str((tmp_path / DEFAULT_TRACES).resolve()) in err
    assert "pass --traces DIR (a folder of mini-swe-agent *.traj.json) or set MARS_TRACES_DIR" in err
    assert not (tmp_path / "out").exists()


def test_help_states_the_default_traces_and_the_env_var_without_sphinx_markup() -> None:
    text = _parser()._subparsers._group_actions[0].choices["compare"].format_help()
    flat = " ".join(text.split())
    assert "MARS_TRACES_DIR" in flat and "deepseek_chat_test_1-100" in flat
    assert ":func:" not in text and ":mod:" not in text and "``" not in text and "*" not in text
    assert "find_base_rate searches" in flat and "(eval.backends; docs/compare.md)" in flat
    assert "design.md" not in flat  # a bare "design.md §7" means nothing to a user of the CLI
    assert "defaults below" not in flat and "defaults listed above" in flat
    assert "0 = no limit" in flat  # --sessions: what the argument error says too


# ----------------------------------------------------------------------------- argument errors
def test_out_that_is_a_file_is_one_error_line(tmp_path, capsys) -> None:
    target = tmp_path / "results.txt"
    target.write_text("keep me")
    assert _run(["--out", str(target)]) == 2
    assert capsys.readouterr().err == f"mars-openhands compare: error: --out {target}: is a file; give a directory\n"
    assert target.read_text() == "keep me"
    assert _run(["--out", str(target / "sub")]) == 2
    assert capsys.readouterr().err == f"mars-openhands compare: error: --out {target / 'sub'}: {target} is a file; give a directory\n"


@pytest.mark.parametrize(("flag", "value"), [
    ("--loads", "nan"), ("--loads", "inf"), ("--loads", "0.5,inf"), ("--loads", "1,,2"), ("--loads", "1,"),
    ("--base-rate", "nan"),
    ("--base-rate", "inf"), ("--knee-slowdown", "nan"), ("--time-scale", "inf"),
    ("--tool-time-factor", "nan"), ("--run-timeout", "inf"), ("--run-timeout", "0"), ("--sessions", "-3"),
    ("--seed", "-1"), ("--kv-blocks", "-5"), ("--kv-blocks", "0"),
])
def test_non_finite_or_negative_values_are_rejected_at_parsing(flag, value, capsys) -> None:
    with pytest.raises(SystemExit) as info:
        _parser().parse_args(["compare", flag, value])
    assert info.value.code == 2
    err = capsys.readouterr().err
    assert f"argument {flag}" in err and repr(value) in err


@pytest.mark.parametrize(("argv", "expected"), [
    (["--base-rate", "-0.1"], "mars-openhands compare: error: --base-rate: Input should be greater than 0 (got -0.1)"),
    (["--tool-workers", "0"], "mars-openhands compare: error: --tool-workers: Input should be greater than or equal to 1 (got 0)"),
    (["--knee-slowdown", "0"], "mars-openhands compare: error: --knee-slowdown: Input should be greater than 1 (got 0.0)"),
    (["--search-runs", "0"], "mars-openhands compare: error: --search-runs: Input should be greater than or equal to 1 (got 0)"),
])
def test_out_of_range_flags_are_one_line_per_error_naming_the_flag(tmp_path, capsys, argv, expected) -> None:
    assert _run([*argv, "--out", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err
    assert err == expected + "\n"
    assert not (tmp_path / "out").exists()


def test_several_bad_flags_give_one_line_each(tmp_path, capsys) -> None:
    assert _run(["--tool-workers", "0", "--search-runs", "0", "--out", str(tmp_path / "out")]) == 2
    lines = capsys.readouterr().err.splitlines()
    assert [line.split(":")[2].strip() for line in lines] == ["--tool-workers", "--search-runs"]
    assert not any("pydantic.dev" in line or "input_value" in line for line in lines)


def _synthetic(tmp_path: Path) -> Path:
    """Two swebench-like sessions (final contexts to ~88k tokens) as a workload file."""
    from eval.workloads.synth import synthesize
    path = tmp_path / "w.json"
    save_workload(synthesize("swebench", 2, 0), path)
    return path


def test_a_gpu_whose_kv_cannot_hold_the_longest_session_is_one_error_line(tmp_path, capsys) -> None:
    # 0.8 of an H100 leaves ~31k tokens of bf16 KV beside Qwen3-Coder's weights: vLLM would refuse
    # the --max-model-len of an 88k-token session. It used to be raised silently to the session.
    argv = ["--workload", str(_synthetic(tmp_path)), "--gpu", "h100_sxm", "--policies", "fcfs",
            "--absolute-rates", "--loads", "0.001", "--no-reference", "--no-cache"]
    assert _run([*argv, "--gpu-memory-utilization", "0.8", "--out", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "--gpu h100_sxm: its KV at --gpu-memory-utilization 0.8" in err
    assert "vLLM would refuse" in err and not (tmp_path / "out").exists()


def test_kv_below_the_longest_session_is_an_error_for_kv_blocks_and_labelled_when_scaled(tmp_path, capsys) -> None:
    workload = _synthetic(tmp_path)
    assert _run(["--workload", str(workload), "--kv-blocks", "100", "--out", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err
    assert "--kv-blocks 100: 1600 tokens of KV < the longest session's context" in err and err.count("\n") == 1
    from eval.workloads.format import load_workload
    args = _parser().parse_args(["compare", "--kv-scale", "0.01"])
    setup, scale, full = compare_setup.gpu_setup(args, "h100_sxm", load_workload(workload), 1.0)
    assert scale == 0.01 and setup.num_gpu_blocks > round(full * 0.01)
    assert "raised to the longest session's context" in setup.timing


def test_a_missing_workload_file_is_one_error_line_naming_the_flag(tmp_path, capsys) -> None:
    missing = tmp_path / "none.json"
    assert _run(["--workload", str(missing), "--out", str(tmp_path / "out")]) == 2
    assert capsys.readouterr().err == f"mars-openhands compare: error: --workload {missing}: no such file\n"


def test_unknown_gpu_names_the_compare_flag_and_its_choices(tmp_path, capsys) -> None:
    assert _run(["--gpu", "a100", "--out", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err
    assert err.startswith("mars-openhands compare: error: --gpu: unknown GPU 'a100'") and err.count("\n") == 1
    assert "h100_sxm" in err and "h200_nvl" in err and "emulated_gpu" not in err


# ----------------------------------------------------------------------------- runs (sim, tiny)
def _traces_with_a_bad_file(tmp_path: Path) -> Path:
    traces = tmp_path / "traces"
    traces.mkdir()
    shutil.copy(TRACE_FIXTURES / "good" / "demo__repo-1.traj.json", traces)
    shutil.copy(TRACE_FIXTURES / "malformed" / "not_json.traj.json", traces)
    return traces


def test_skipped_trace_files_are_warned_about_and_noted_in_the_summary(tmp_path, capsys, sim) -> None:
    traces = _traces_with_a_bad_file(tmp_path)
    out = tmp_path / "out"
    code = _run(["--traces", str(traces), "--policies", "fcfs", "--base-rate", "0.5", "--loads", "1",
                 "--sessions", "2", "--max-turns", "2", "--gpu", "h100_sxm", "--jobs", "1", "--out", str(out)])
    assert code == 0
    err = capsys.readouterr().err
    warning = [line for line in err.splitlines() if line.startswith("warning:")]
    assert len(warning) == 1
    assert "1 trajectory file(s) skipped; first: not_json.traj.json (malformed:" in warning[0]
    summary = (out / "summary.md").read_text()
    assert "- **skipped trace files**: 1 trajectory file(s) skipped; first: not_json.traj.json" in summary
    assert "excl. workload loading" in summary and "elapsed wall" not in summary


def test_the_unbounded_kv_reference_is_refused_on_a_live_backend(tmp_path, capsys) -> None:
    code = _run(["--backend", "emulated", "--policies", "fcfs,unbounded-kv", "--base-rate", "0.1",
                 "--out", str(tmp_path / "out")])
    assert code == 2
    assert "unbounded-KV reference runs only in the simulator" in capsys.readouterr().err


def test_rerun_into_the_same_out_replaces_only_the_compare_files(tmp_path, capsys, sim) -> None:
    workload = tmp_path / "w.json"
    save_workload(small_workload(2, 2), workload)
    out = tmp_path / "out"
    argv = ["--workload", str(workload), "--base-rate", "0.5", "--sessions", "2", "--max-turns", "2",
            "--gpu", "h100_sxm", "--jobs", "1", "--out", str(out)]
    assert _run([*argv, "--policies", "fcfs,autellix", "--loads", "1,2"]) == 0
    (out / "my-notes.txt").write_text("mine")
    assert "replacing" not in capsys.readouterr().err
    assert _run([*argv, "--policies", "fcfs", "--loads", "1"]) == 0
    assert f"replacing the previous results in {out}" in capsys.readouterr().err
    assert sorted(p.name for p in out.iterdir()) == sorted([
        "fcfs__load1.parquet", "unbounded-kv__load1.parquet", "results.parquet", "summary.md", "run.json",
        "my-notes.txt",
        "e2e_vs_load.png", "e2e_cdf.png", "goodput_vs_alpha.png"])
    # The unbounded-KV reference joins every simulator sweep (not a baseline; its own row).
    results = pd.read_parquet(out / "results.parquet")
    assert list(results["run_id"]) == ["fcfs__load1", "unbounded-kv__load1"]
    assert list(results["is_reference"]) == [False, True] and not results["is_baseline"].iloc[1]
    assert _run([*argv, "--policies", "fcfs", "--loads", "1", "--no-reference"]) == 0
    assert list(pd.read_parquet(out / "results.parquet")["run_id"]) == ["fcfs__load1"]


def test_clear_previous_results_deletes_only_what_compare_writes(tmp_path) -> None:
    names = ["fcfs__load1.parquet", "mars+adm__load0.5.parquet", "summary.md", "run.json", "e2e_cdf.png",
             "e2e_vs_load.png", "goodput_vs_alpha.png"]
    for name in names:
        (tmp_path / name).write_text("x")
    keep = ["other.parquet", "notes.md", "plot.png", "fcfsx__load1.parquet"]
    for name in keep:
        (tmp_path / name).write_text("x")
    assert not clear_previous_results(tmp_path)  # no results.parquet: not a previous compare
    assert all((tmp_path / n).exists() for n in names)
    pd.DataFrame({"run_id": ["custom-run"]}).to_parquet(tmp_path / "results.parquet")
    (tmp_path / "custom-run.parquet").write_text("x")
    (tmp_path / "server-logs").mkdir()
    (tmp_path / "server-logs" / "server-fcfs.log").write_text("x")
    assert clear_previous_results(tmp_path)
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(keep)


def test_ctrl_c_keeps_the_finished_runs_and_raises_with_the_count(tmp_path, sim) -> None:
    calls = []

    def interrupted_on_the_second_run(workload, config, timer, sink=None):
        calls.append(config.policy)
        if len(calls) == 2:
            raise KeyboardInterrupt
        return sim.simulate(workload, config, timer, sink)

    options = CompareOptions(policies=("fcfs", "autellix"), loads=(1.0, 2.0), num_gpu_blocks=512,
                             base_rate_per_s=1.0, admission="off")
    with pytest.raises(CompareInterrupted) as info:
        run_compare(small_workload(2, 2), options, sim.LinearStepTimeModel(), tmp_path,
                    ideal_s={"s0": 1.0, "s1": 1.0}, simulate_fn=interrupted_on_the_second_run)
    assert (info.value.num_finished, info.value.num_runs) == (1, 4)
    assert list(pd.read_parquet(tmp_path / "results.parquet")["run_id"]) == ["fcfs__load1"]
    assert (tmp_path / "fcfs__load1.parquet").exists() and (tmp_path / "e2e_cdf.png").exists()
    summary = (tmp_path / "summary.md").read_text()
    assert "| fcfs |" in summary
    assert summary.startswith("# mars-openhands compare\n\n**INTERRUPTED**: stopped by Ctrl-C (SIGINT): 1 of 4 "
                              "runs finished (fcfs__load1); the tables hold only those")
    assert "INTERRUPTED" not in summary.split("\n", 3)[3]  # said once, at the top
    assert json.loads((tmp_path / "run.json").read_text())["facts"]["interrupted"].startswith("stopped by")


def test_sigterm_in_the_runs_is_an_interrupted_sweep_with_status_143(tmp_path, sim) -> None:
    calls = []

    def terminated_on_the_third_run(workload, config, timer, sink=None):
        calls.append(config.policy)
        if len(calls) == 3:
            raise Terminated()
        return sim.simulate(workload, config, timer, sink)

    options = CompareOptions(policies=("fcfs", "autellix"), loads=(1.0, 2.0), num_gpu_blocks=512,
                             base_rate_per_s=1.0, admission="off")
    with pytest.raises(CompareInterrupted) as info:
        run_compare(small_workload(2, 2), options, sim.LinearStepTimeModel(), tmp_path,
                    ideal_s={"s0": 1.0, "s1": 1.0}, simulate_fn=terminated_on_the_third_run)
    assert (info.value.num_finished, info.value.exit_status, info.value.has_results) == (2, 143, True)
    assert "**INTERRUPTED**: stopped by SIGTERM: 2 of 4 runs finished" in (tmp_path / "summary.md").read_text()


def test_an_interrupted_run_is_never_recorded_as_a_result_block(tmp_path, sim) -> None:
    from eval.result_blocks import BlockError, record_run

    calls = []

    def interrupted(workload, config, timer, sink=None):
        calls.append(config.policy)
        if len(calls) == 2:
            raise KeyboardInterrupt
        return sim.simulate(workload, config, timer, sink)

    options = CompareOptions(policies=("fcfs", "autellix"), loads=(1.0,), num_gpu_blocks=512,
                             base_rate_per_s=1.0, admission="off")
    with pytest.raises(CompareInterrupted):
        run_compare(small_workload(2, 2), options, sim.LinearStepTimeModel(), tmp_path,
                    ideal_s={"s0": 1.0, "s1": 1.0}, simulate_fn=interrupted, meta={"commit": "abc1234"})
    with pytest.raises(BlockError, match="interrupted"):
        record_run(tmp_path, "quick")


@pytest.mark.parametrize(("signal_error", "line", "code"), [
    (KeyboardInterrupt, "interrupted: 0 of 4 runs finished; no results written\n", 130),
    (Terminated, "terminated: 0 of 4 runs finished; no results written\n", 143)], ids=["SIGINT", "SIGTERM"])
def test_a_signal_before_any_run_says_nothing_was_written_and_leaves_no_folder(tmp_path, capsys, monkeypatch,
                                                                               signal_error, line, code) -> None:
    """Ctrl-C in the first phase printed 'partial results in OUT' beside an empty OUT; SIGTERM
    printed nothing (a traceback-free exit 143 with no word)."""
    import eval.sweep as sweep

    def stopped(*args, **kwargs):
        raise signal_error()

    workload = tmp_path / "w.json"
    save_workload(small_workload(2, 2), workload)
    monkeypatch.setattr(sweep._Sweep, "_ideal_times", stopped)
    monkeypatch.setattr(compare, "gpu_setups", lambda args, spec, w, s, loaded: (
        [GpuSetup("h100_sxm", None, 64, "test timing")], None, "Full workload"))
    out = tmp_path / "out"
    assert _run(["--workload", str(workload), "--policies", "fcfs,mars", "--loads", "1,2", "--base-rate", "1",
                 "--gpu", "h100_sxm", "--no-reference", "--jobs", "1", "--out", str(out)]) == code
    assert capsys.readouterr().err.endswith(line)
    assert not out.exists()


def test_ctrl_c_at_the_cli_is_one_line_and_exit_130(tmp_path, capsys, monkeypatch) -> None:
    workload = tmp_path / "w.json"
    save_workload(small_workload(2, 2), workload)

    def interrupted(*args, **kwargs):
        raise CompareInterrupted(3, 4)

    monkeypatch.setattr(compare, "run_sweep", interrupted)
    monkeypatch.setattr(compare, "gpu_setups", lambda args, spec, w, s, loaded: (
        [GpuSetup("h100_sxm", None, 64, "test timing")], None, "Full workload"))
    out = tmp_path / "out"
    code = _run(["--workload", str(workload), "--policies", "fcfs,mars", "--loads", "1,2",
                 "--base-rate", "1", "--gpu", "h100_sxm", "--no-reference", "--out", str(out)])
    assert code == 130
    err = capsys.readouterr().err
    assert f"interrupted: 3 of 4 runs finished; partial results in {out}\n" in err
    assert "Traceback" not in err
