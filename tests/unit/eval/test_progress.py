"""Progress lines when stderr is not a terminal (eval/progress.py)."""

from __future__ import annotations

import io

from eval.progress import LineProgress


def test_a_line_per_renamed_step_and_per_finished_task() -> None:
    out, now = io.StringIO(), [100.0]
    progress = LineProgress(out, clock=lambda: now[0])
    with progress:
        ideal = progress.add_task("ideal E2E", total=2)
        runs = progress.add_task("runs", total=2)
        progress.update(ideal, advance=1)  # neither renamed nor complete: quiet
        now[0] = 161.0
        progress.update(ideal, advance=1)
        progress.update(runs, advance=1, description="runs: fcfs__load1 done")
        progress.update(runs, advance=1, description="runs: mars+adm__load1 done")
        progress.update(runs, advance=1)  # past the total: printed once only
    assert out.getvalue().splitlines() == ["[01:01] ideal E2E (2/2)", "[01:01] runs: fcfs__load1 done (1/2)",
                                           "[01:01] runs: mars+adm__load1 done (2/2)"]


def test_compare_logs_each_finished_run_when_stderr_is_a_file(tmp_path, capsys) -> None:
    import argparse

    from compare_helpers import small_workload

    from eval.compare import add_compare_subcommand
    from eval.workloads.format import save_workload

    workload = tmp_path / "w.json"
    save_workload(small_workload(2, 2), workload)
    parser = argparse.ArgumentParser(prog="mars-openhands")
    add_compare_subcommand(parser.add_subparsers(dest="command"))
    args = parser.parse_args(["compare", "--workload", str(workload), "--base-rate", "0.5", "--gpu", "h100_sxm",
                              "--jobs", "1", "--policies", "fcfs", "--loads", "1,2", "--no-reference",
                              "--out", str(tmp_path / "out")])
    assert args.func(args) == 0
    err = capsys.readouterr().err
    assert "runs: fcfs__load1 done (1/2)" in err and "runs: fcfs__load2 done (2/2)" in err
