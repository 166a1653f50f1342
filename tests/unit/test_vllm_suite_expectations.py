"""tests/vllm_suite: the expected-failures list and the runner's verdicts (no vLLM needed).

The suite itself runs in ``make vllm-suite`` (``tests/vllm_suite/run.py``); these check what must
hold of its list whatever the run: every class known, every entry with a reason, and the classes
whose scheduling is stock vLLM's (Fcfs, Infercept) failing nothing stock ``AsyncScheduler``
passes.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.load_file import ROOT, load_file


def _load(name: str, path: Path):
    return load_file(path, name)  # dataclasses resolve annotations through sys.modules


run = _load("vllm_suite_run", ROOT / "tests" / "vllm_suite" / "run.py")


def test_the_list_parses_and_every_entry_has_a_reason() -> None:
    expected = run.load_expectations()
    assert set(expected.failures) == set(run.CLASSES)
    assert expected.failures["AsyncScheduler"], "stock AsyncScheduler fails the sync-only tests"
    for entries in expected.failures.values():
        for test_id in entries:
            assert "::" in test_id and test_id.split("::")[0] in run.TEST_FILES, test_id


@pytest.mark.parametrize("name", run.STRICT_CLASSES)
def test_stock_scheduling_classes_fail_nothing_stock_asyncscheduler_passes(name: str) -> None:
    expected = run.load_expectations()
    extra = set(expected.failures[name]) - set(expected.failures["AsyncScheduler"])
    assert not extra, f"{name} lists failures stock AsyncScheduler does not have: {sorted(extra)}"


def test_stock_and_not_constructed_failures_apply_to_our_classes() -> None:
    expected = run.Expectations({"AsyncScheduler": {"s": "r"}, "FcfsScheduler": {"f": "r"}}, {},
                                {"n": "no __init__"})
    assert set(expected.listed("AsyncScheduler")) == {"s"}
    assert set(expected.listed("FcfsScheduler")) == {"s", "f", "n"}  # stock's apply to ours too


def test_judge_flags_unlisted_failures_listed_passes_and_listed_tests_that_did_not_run() -> None:
    outcomes = {"a.py::t1": "failed", "a.py::t2": "failed", "a.py::t3": "passed",
                "a.py::t4": "passed", "a.py::t5": "skipped"}
    listed = {"a.py::t1": "why", "a.py::t3": "why", "a.py::gone": "why"}
    verdict = run.judge("X", outcomes, listed)
    assert (verdict.num_passed, verdict.num_failed) == (2, 2)
    assert verdict.unexpected == ["a.py::t2"]
    assert verdict.now_passing == ["a.py::t3"]
    assert verdict.not_run == ["a.py::gone"]
    assert not verdict.ok
    assert run.judge("X", {"a.py::t1": "failed"}, {"a.py::t1": "why"}).ok


def test_a_bad_list_is_refused_naming_the_entry(tmp_path: Path) -> None:
    bad = tmp_path / "expected.toml"
    bad.write_text('[classes.NoSuchScheduler]\n"test_scheduler.py::t" = "x"\n')
    with pytest.raises(ValueError, match="unknown class"):
        run.load_expectations(bad)
    bad.write_text('[classes.FcfsScheduler]\n"test_scheduler.py::t" = " "\n')
    with pytest.raises(ValueError, match="needs a reason"):
        run.load_expectations(bad)


def test_missing_tests_fail_with_one_line_saying_to_run_setup(tmp_path: Path, capsys) -> None:
    assert run.main(["--dest", str(tmp_path / "absent")]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "scripts/setup.sh" in err[0]
