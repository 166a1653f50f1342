"""The docs' result blocks come from recorded runs (eval/result_blocks.py): every block re-renders
from its committed record, a hand-edited figure fails, and measured result tables live in blocks."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
from pathlib import Path

import pandas as pd
import pytest

from eval.report import METRICS, goodput_column
from eval.result_blocks import (
    BLOCKS,
    RECORD_DIR,
    BlockError,
    doc_files,
    find_blocks,
    is_ancestor,
    load_record,
    publish_record,
    record_run,
    render,
    rows_digest,
    save_record,
    write_blocks,
)

ROOT = Path(__file__).resolve().parents[3]
DOCS = doc_files(ROOT)
FOUND = [(path, name, body) for path in DOCS for name, body in find_blocks(path.read_text(encoding="utf-8"))]


def test_the_readme_has_the_quick_and_default_job_blocks() -> None:
    readme = {name for path, name, _ in FOUND if path.name == "README.md"}
    assert {"quick", "default-job"} <= readme


@pytest.mark.parametrize(("path", "name", "body"), FOUND, ids=[f"{p.name}:{n}" for p, n, _ in FOUND])
def test_every_block_is_its_record_rendered(path: Path, name: str, body: str) -> None:
    assert name in BLOCKS, f"{path.name}: unknown result block {name!r}; known: {', '.join(BLOCKS)}"
    record_path = ROOT / RECORD_DIR / f"{BLOCKS[name][0]}.json"
    assert record_path.is_file(), f"{path.name}: block {name!r} has no recorded run ({record_path})"
    record = load_record(record_path)  # raises when its rows were edited
    assert body == render(name, record), (
        f"{path.name}: block {name!r} differs from its record; a figure edited by hand? Re-render with "
        "`python -m eval.result_blocks render`, or record a new run")


@pytest.mark.parametrize("record_path", sorted((ROOT / RECORD_DIR).glob("*.json")), ids=lambda p: p.name)
def test_each_record_names_a_commit_of_this_history(record_path: Path) -> None:
    record = load_record(record_path)
    assert re.fullmatch(r"[0-9a-f]{7,40}", record["commit"]), record["commit"]
    assert re.fullmatch(r"\d{4}-\d{2}-\d{2}", record["date"])
    assert record["command"].startswith("mars-openhands compare")
    if shutil.which("git") is None or not (ROOT / ".git").exists():
        pytest.skip("not a git checkout")
    shallow = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "--is-shallow-repository"],
                             capture_output=True, text=True).stdout.strip()
    if shallow == "true":
        pytest.skip("a shallow clone lacks the history")
    assert is_ancestor(record["commit"], ROOT), f"{record_path.name}: {record['commit']} is not in HEAD's history"


_MEASURED = re.compile(r"^\|[^\n]*\b(E2E|goodput|slowdown|preemptions|task time)\b", re.I | re.M)


def test_measured_result_tables_of_the_readme_are_all_in_blocks() -> None:
    """A table of measured figures (its header names E2E, goodput, slowdown, preemptions or task
    time) outside a result block has no recorded run behind it."""
    text = (ROOT / "README.md").read_text(encoding="utf-8")
    outside = re.sub(r"<!-- ([a-z0-9-]+):begin -->.*?<!-- \1:end -->", "", text, flags=re.S)
    outside = re.sub(r"```.*?```", "", outside, flags=re.S)
    assert not _MEASURED.findall(outside), "README.md: a table of measured figures outside a result block: " + \
        "; ".join(m.group(0)[:80] for m in _MEASURED.finditer(outside))


# -- records and rendering on a small run ------------------------------------------------------------

def _results_dir(tmp_path: Path, commit: str = "abc1234", status: str = "ok") -> Path:
    rows = []
    for load in (1.0, 1.2):
        for policy, label, base, e2e in (("fcfs", "fcfs", True, 300.0), ("thunderagent", "thunderagent", True, 240.0),
                                         ("mars", "mars+adm", False, 200.0)):
            row = {"run_id": f"{label}__load{load:g}", "gpu": "h100_sxm", "label": label, "policy": policy,
                   "is_admission_enabled": policy == "mars", "is_baseline": base, "is_reference": False,
                   "load_x": load, "rate_per_s": 0.01 * load, "status": status if label == "fcfs" else "ok",
                   "wall_s": 5.0, "num_sessions": 74, "num_completed": 74}
            for m in METRICS:
                row[m.column] = (e2e * load) if not m.is_higher_better else 0.01 * 200.0 / e2e
            row["reprefill_tokens"] = 1_234_567
            row["num_preemptions"] = 3
            rows.append(row)
    out = tmp_path / "run"
    out.mkdir(parents=True)
    pd.DataFrame(rows).to_parquet(out / "results.parquet")
    facts = {"commit": commit, "date": "2026-12-05", "command": "mars-openhands compare --quick --out x",
             "sessions": 74, "turns": 5939, "seed": 0, "jobs": 2, "base rate": "0.01 sessions/s",
             "base rate search": "bracketed (probes: 0.005/s→1.1, 0.01/s→1.9, 0.02/s→4.0)",
             "wall (s) of the ideal times, knee search and runs (excl. workload loading)": "158",
             "wall (s) per phase": "ideal 16, knee 43, runs 96"}
    (out / "run.json").write_text(json.dumps({"facts": facts}))
    return out


def test_quick_block_shows_the_run_its_commit_and_the_gains(tmp_path) -> None:
    record = record_run(_results_dir(tmp_path), "quick")
    text = render("quick", record)
    assert all(len(line) <= 100 for line in text.splitlines() if not line.startswith("|"))  # prose wrapped
    flat = " ".join(text.split())
    assert flat.startswith("`mars-openhands compare --quick --out x` with 2 worker processes (`--jobs 2` "
                           "reproduces it anywhere) at abc1234 on 2026-12-05")
    assert "FCFS knee 0.01 sessions/s, found in 3 probes" in flat
    assert "158 s (ideal times 16 s, knee search 43 s, runs 96 s)" in flat
    assert "| 1.2×: mars (+ admission) | 240 |" in text and "1.23 M" in text
    assert "against it mars (+ admission) is 1.20× in mean E2E" in flat  # thunderagent 288 / mars 240
    assert goodput_column(3.0)  # the column the table reads exists in METRICS


def test_quick_block_of_a_two_gpu_run_has_a_table_and_gains_per_gpu(tmp_path) -> None:
    """A run on two GPUs (compare without --quick) crashed render_quick with 'The truth value of
    a Series is ambiguous' (every label twice in paper_comparison)."""
    one = _results_dir(tmp_path / "a")
    table = pd.read_parquet(one / "results.parquet")
    other = table.assign(gpu="h200_sxm", run_id="h200_sxm__" + table["run_id"])
    pd.concat([table, other], ignore_index=True).to_parquet(one / "results.parquet")
    text = render("quick", record_run(one, "quick"))
    assert "| H100 SXM |" in text and "| H200 SXM |" in text
    assert " ".join(text.split()).count("against it mars (+ admission) is 1.20× in mean E2E") == 2


def test_a_hand_edited_figure_or_row_is_caught(tmp_path) -> None:
    record = record_run(_results_dir(tmp_path), "quick")
    body = render("quick", record)
    edited = body.replace("| 240 |", "| 239 |", 1)
    assert edited != body and edited != render("quick", record)
    path = save_record(record, tmp_path)
    assert load_record(path)["rows"] == record["rows"]
    data = json.loads(path.read_text())
    data["rows"][0]["e2e_mean_s"] = 1.0
    path.write_text(json.dumps(data))
    with pytest.raises(BlockError, match="rows_sha256"):
        load_record(path)
    assert rows_digest(record["rows"]) == record["rows_sha256"]


def test_record_refuses_a_dirty_commit_a_failed_run_and_a_missing_run_json(tmp_path) -> None:
    with pytest.raises(BlockError, match="uncommitted"):
        record_run(_results_dir(tmp_path / "a", commit="abc1234+dirty"), "quick")
    with pytest.raises(BlockError, match="runs failed"):
        record_run(_results_dir(tmp_path / "b", status="failed"), "quick")
    (tmp_path / "c").mkdir()
    with pytest.raises(BlockError, match="run.json: missing"):
        pd.DataFrame({"a": [1]}).to_parquet(tmp_path / "c" / "results.parquet")
        record_run(tmp_path / "c", "quick")


def test_write_blocks_rewrites_only_between_the_markers(tmp_path) -> None:
    record = record_run(_results_dir(tmp_path), "quick")
    save_record(record, tmp_path)
    (tmp_path / "docs").mkdir(exist_ok=True)
    (tmp_path / "README.md").write_text("before\n<!-- quick:begin -->\nstale 1.18×\n<!-- quick:end -->\nafter\n")
    assert write_blocks(tmp_path) == [tmp_path / "README.md"]
    text = (tmp_path / "README.md").read_text()
    assert text.startswith("before\n<!-- quick:begin -->\n`mars-openhands compare") and text.endswith(
        "<!-- quick:end -->\nafter\n")
    assert "stale" not in text and write_blocks(tmp_path) == []  # idempotent
    (tmp_path / "README.md").write_text("<!-- default-job:begin -->\nx\n<!-- default-job:end -->\n")
    with pytest.raises(BlockError, match="no record"):
        write_blocks(tmp_path)


def test_compare_refuses_to_record_a_block_from_uncommitted_code(monkeypatch, capsys, tmp_path) -> None:
    import argparse

    import eval.compare as compare

    monkeypatch.setattr(compare, "source_commit", lambda: "abc1234+dirty")
    parser = argparse.ArgumentParser(prog="mars-openhands")
    compare.add_compare_subcommand(parser.add_subparsers(dest="command"))
    args = parser.parse_args(["compare", "--quick", "--readme-block", "quick", "--out", str(tmp_path / "out")])
    assert args.func(args) == 2
    assert capsys.readouterr().err == ("mars-openhands compare: error: --readme-block quick: the checkout is at "
                                       "abc1234+dirty; commit your changes first, so the block names code that "
                                       "exists\n")
    assert not (tmp_path / "out").exists()


def _compare(argv: list[str]) -> int:
    import argparse

    import eval.compare as compare

    parser = argparse.ArgumentParser(prog="mars-openhands")
    compare.add_compare_subcommand(parser.add_subparsers(dest="command"))
    args = parser.parse_args(["compare", *argv])
    args.argv = argv  # as the CLI records them
    return args.func(args)


@pytest.mark.parametrize("trim", [["--sessions", "2", "--max-turns", "2"], ["--quick", "--sessions", "2",
                                                                             "--max-turns", "2"]],
                         ids=["without --quick", "trimmed --quick"])
def test_compare_refuses_a_readme_block_run_that_is_not_the_blocks_command(monkeypatch, capsys, tmp_path,
                                                                           trim) -> None:
    """The user's two commands: a two-GPU trimmed run rewrote docs/results/quick.json (then crashed),
    and a trimmed --quick run replaced the published block. Both are refused before anything runs."""
    import eval.compare as compare

    ran = []
    monkeypatch.setattr(compare, "source_commit", lambda: "abc1234")
    monkeypatch.setattr(compare, "_load_and_run", lambda *a, **k: ran.append(a) or 0)
    before = (ROOT / RECORD_DIR / "quick.json").read_bytes()
    out = tmp_path / "bk"
    assert _compare(["--readme-block", "quick", *trim, "--out", str(out)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("mars-openhands compare: error: --readme-block quick: not the "
                                                   "block's recorded command `mars-openhands compare --quick")
    assert "--sessions 2 (recorded: 0); --max-turns 2 (recorded: 0)" in err
    assert ("--quick not given (recorded: given)" in err) == ("--quick" not in trim)
    assert not ran and not out.exists() and (ROOT / RECORD_DIR / "quick.json").read_bytes() == before


def test_compare_runs_a_readme_block_command_that_differs_only_where_it_may(monkeypatch, capsys, tmp_path) -> None:
    import eval.compare as compare

    ran = []
    monkeypatch.setattr(compare, "source_commit", lambda: "abc1234")
    monkeypatch.setattr(compare, "recorded_command", lambda name: "mars-openhands compare --quick --jobs 2 "
                        "--out runs/quick --readme-block quick")
    monkeypatch.setattr(compare, "_load_and_run", lambda *a, **k: ran.append(a) or 0)
    monkeypatch.setenv("MARS_TRACES_DIR", str(tmp_path))  # a clean clone has no ../shared traces
    assert _compare(["--readme-block", "quick", "--quick", "--out", str(tmp_path / "o"), "--jobs", "3",
                     "--no-cache"]) == 0
    assert len(ran) == 1, capsys.readouterr().err


def _fake_sweep(results_dir: Path):
    """A run_sweep that leaves the results of :func:`_results_dir` in its ``out`` folder."""
    def run_sweep(workload, options, setups, out, **kwargs):
        shutil.copytree(results_dir, out, dirs_exist_ok=True)
        (Path(out) / "summary.md").write_text("# summary\n")
        return pd.read_parquet(Path(out) / "results.parquet")
    return run_sweep


def test_a_block_that_fails_to_render_leaves_the_record_and_the_docs_as_they_were(monkeypatch, capsys,
                                                                                  tmp_path) -> None:
    """The record used to be written before the blocks rendered: a rendering error left a new
    docs/results/quick.json beside the old README block."""
    import functools

    from compare_helpers import small_workload

    import eval.compare as compare
    import eval.result_blocks as result_blocks
    from eval.sweep_options import GpuSetup
    from eval.workloads.format import save_workload

    root = tmp_path / "repo"
    old = record_run(_results_dir(tmp_path / "old"), "quick")
    save_record(old, root)
    (root / "README.md").write_text("<!-- quick:begin -->\n" + render("quick", old) + "<!-- quick:end -->\n")
    files = {p: p.read_bytes() for p in (root / "README.md", root / RECORD_DIR / "quick.json")}
    new_run = _results_dir(tmp_path / "new", commit="def5678")

    def broken(record):
        raise ValueError("boom")

    workload = tmp_path / "w.json"
    save_workload(small_workload(2, 2), workload)
    argv = ["--workload", str(workload), "--quick", "--base-rate", "1", "--out", str(tmp_path / "out"),
            "--readme-block", "quick"]
    monkeypatch.setattr(compare, "source_commit", lambda: "def5678")
    monkeypatch.setattr(compare, "recorded_command", lambda name: "mars-openhands compare " + " ".join(argv))
    monkeypatch.setattr(compare, "gpu_setups", lambda args, spec, w, s, loaded: (
        [GpuSetup("h100_sxm", None, 64, "test timing")], None, "Full workload"))
    monkeypatch.setattr(compare, "run_sweep", _fake_sweep(new_run))
    monkeypatch.setattr(compare, "publish_record", functools.partial(result_blocks.publish_record, root=root))
    monkeypatch.setitem(result_blocks.BLOCKS, "quick", ("quick", broken))
    with pytest.raises(ValueError, match="boom"):
        _compare(argv)
    assert {p: p.read_bytes() for p in files} == files
    assert not [p.name for p in (root / RECORD_DIR).iterdir() if p.name != "quick.json"]  # no temp file left


def test_publish_record_writes_the_record_and_its_blocks_together(tmp_path) -> None:
    old, new = (record_run(_results_dir(tmp_path / n, commit=c), "quick") for n, c in (("a", "abc1234"),
                                                                                       ("b", "def5678")))
    save_record(old, tmp_path)
    (tmp_path / "README.md").write_text("x\n<!-- quick:begin -->\n" + render("quick", old) + "<!-- quick:end -->\n")
    assert publish_record(new, tmp_path) == [tmp_path / RECORD_DIR / "quick.json", tmp_path / "README.md"]
    assert load_record(tmp_path / RECORD_DIR / "quick.json")["commit"] == "def5678"
    assert "at def5678 on" in " ".join((tmp_path / "README.md").read_text().split())
    assert sorted(p.name for p in tmp_path.rglob(".*")) == []
