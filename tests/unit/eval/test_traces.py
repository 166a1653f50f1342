"""mini-swe-agent loader on hand-made fixtures (expected turns computed by hand; see fixtures README)."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from eval.workloads.format import Turn, WorkloadFormatError
from eval.workloads.traces import TraceLoadReport, load_trace_dir, load_trajectory

FIXTURES = Path(__file__).parents[2] / "fixtures" / "traces"
REAL_TRACES = Path(__file__).parents[4] / "shared" / "data" / "traces" / "mini-swe-agent"  # ../shared of the repo


def test_plain_trajectory_gives_hand_computed_turns() -> None:
    session = load_trajectory(FIXTURES / "good" / "demo__repo-1.traj.json")
    assert session is not None
    assert session.session_id == "demo__repo-1"
    assert session.arrival_s == 0.0
    assert session.turns == (
        # turn 0: prompt = system + task = 1000; tool 102.5 - 100.0 s
        Turn(prompt_tokens_appended=1000, output_tokens=50, tool_name="pytest", tool_duration_s=2.5),
        # turn 1: 1250 - 1000 - 50 = 200 observation tokens; tool 105.25 - 105.0 s
        Turn(prompt_tokens_appended=200, output_tokens=30, tool_name="cat", tool_duration_s=0.25),
        # turn 2: 1400 - 1250 - 30 = 120; final (the submit command runs no tool message)
        Turn(prompt_tokens_appended=120, output_tokens=20),
    )


def test_guards_on_odd_values_are_applied_and_counted() -> None:
    report = TraceLoadReport()
    session = load_trajectory(FIXTURES / "good" / "nested" / "demo__repo-2.traj.json.gz", report)
    assert session is not None
    assert session.turns == (
        Turn(prompt_tokens_appended=800, output_tokens=40, tool_name="interrupt:FormatError",
             tool_duration_s=0.0),
        # 900 - 800 - 40 = 60; completion 0 -> 1; tool ended 0.5 s *before* the call -> 0 s
        Turn(prompt_tokens_appended=60, output_tokens=1, tool_name="pip", tool_duration_s=0.0),
        # 700 - 900 - 0 = -200 -> 0; the tool after the last call is dropped
        Turn(prompt_tokens_appended=0, output_tokens=25),
    )
    assert report.clamped == {
        "negative observation(s) clamped to 0 tokens": 1,
        "0-token completion(s) set to 1 token": 1,
        "negative tool duration(s) clamped to 0 s": 1,
        "tool call(s) after the last LLM call dropped": 1,
    }


def test_trajectory_without_llm_calls_is_skipped_with_a_note() -> None:
    report = TraceLoadReport()
    assert load_trajectory(FIXTURES / "empty" / "demo__repo-3.traj.json", report) is None
    assert report.notes() == ("skipped demo__repo-3.traj.json (no LLM call)",)


def test_directory_load_is_recursive_sorted_and_noted() -> None:
    workload = load_trace_dir(FIXTURES / "good")
    assert [s.session_id for s in workload.sessions] == ["demo__repo-1", "demo__repo-2"]
    assert workload.meta.source == f"traces:{FIXTURES / 'good'}"
    assert "1 negative observation(s) clamped to 0 tokens" in workload.meta.notes


def test_duplicate_instance_ids_get_their_folder(tmp_path: Path) -> None:
    for folder in ("run_a", "run_b"):
        (tmp_path / folder).mkdir()
        shutil.copy(FIXTURES / "good" / "demo__repo-1.traj.json", tmp_path / folder)
    workload = load_trace_dir(tmp_path)
    assert [s.session_id for s in workload.sessions] == ["demo__repo-1@run_a", "demo__repo-1@run_b"]


@pytest.mark.parametrize(("name", "message"), [
    ("missing_usage.traj.json", r"messages\[4\]: missing field 'extra.response.usage'"),
    ("bad_tokens.traj.json", r"messages\[4\]\.extra\.response\.usage\.prompt_tokens: expected a int, got '12x'"),
    ("truncated.traj.json.gz", "not a readable \\(gzip\\) JSON trajectory"),
    ("not_json.traj.json", "not a readable \\(gzip\\) JSON trajectory"),
    ("negative_tokens.traj.json", "token counts must be >= 0, got -5"),
])
def test_malformed_file_error_names_file_and_problem(name: str, message: str) -> None:
    with pytest.raises(WorkloadFormatError, match=message) as info:
        load_trajectory(FIXTURES / "malformed" / name)
    assert str(info.value).startswith(str(FIXTURES / "malformed" / name))


def test_a_trajectory_that_gives_an_invalid_session_says_why_in_one_line(tmp_path: Path) -> None:
    """A first prompt of 0 tokens (the session's own check) and an empty instance id; was
    ': Value error, turn 0 must ...' (an empty key) and no value."""
    import json

    data = json.loads((FIXTURES / "malformed" / "negative_tokens.traj.json").read_text())
    data["messages"][2]["extra"]["response"]["usage"]["prompt_tokens"] = 0
    path = tmp_path / "zero.traj.json"
    path.write_text(json.dumps(data))
    with pytest.raises(WorkloadFormatError) as info:
        load_trajectory(path)
    assert str(info.value) == (f"{path}: trajectory gives an invalid session: turn 0 must have "
                               "prompt_tokens_appended >= 1 (system + task prompt)")
    data["messages"][2]["extra"]["response"]["usage"]["prompt_tokens"] = 5
    data["instance_id"] = ""
    path.write_text(json.dumps(data))
    with pytest.raises(WorkloadFormatError) as info:
        load_trajectory(path)
    assert str(info.value) == (f"{path}: trajectory gives an invalid session: session_id: String should "
                               "have at least 1 character (got '')")


def test_directory_with_a_malformed_file_raises_or_skips() -> None:
    with pytest.raises(WorkloadFormatError, match="bad_tokens.traj.json"):
        load_trace_dir(FIXTURES / "malformed")
    with pytest.raises(WorkloadFormatError, match="no usable trajectory found"):
        load_trace_dir(FIXTURES / "malformed", on_error="skip")


def test_skip_keeps_the_good_files(tmp_path: Path) -> None:
    shutil.copy(FIXTURES / "good" / "demo__repo-1.traj.json", tmp_path)
    shutil.copy(FIXTURES / "malformed" / "truncated.traj.json.gz", tmp_path)
    workload = load_trace_dir(tmp_path, on_error="skip")
    assert [s.session_id for s in workload.sessions] == ["demo__repo-1"]
    assert any(n.startswith("skipped truncated.traj.json.gz (malformed:") for n in workload.meta.notes)


def test_missing_and_empty_directories(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match="does not exist"):
        load_trace_dir(tmp_path / "nope")
    with pytest.raises(WorkloadFormatError, match="0 file\\(s\\) matched"):
        load_trace_dir(tmp_path)


@pytest.mark.skipif(not REAL_TRACES.exists(), reason="bundled traces not present on this machine")
def test_real_trace_subset_matches_its_readme() -> None:
    workload = load_trace_dir(REAL_TRACES / "deepseek_chat_test_1-100")
    # README: 99 tasks, some deliberately not included; per task ~80 LLM calls, first prompt ~1.6k
    assert len(workload.sessions) == 74
    turns = sorted(s.num_turns for s in workload.sessions)
    assert 60 <= turns[len(turns) // 2] <= 90
    assert all(1300 <= s.turns[0].prompt_tokens_appended <= 4000 for s in workload.sessions)
    assert all(s.turns[-1].tool_name is None for s in workload.sessions)
