"""Metric definitions on a hand-made stream (every expected number computed by hand below).

Timeline (seconds after T0; ideal times A = 2, B = 1, C = 2):
  A: start 0; turn 0 first_token 0.5 (ttft 0.5), finished 1.0, kv_retained 10 blocks;
     tool queue wait 0.2, runs 1.8 s; kv_released resumed 10; turn 1 first_token (ttft 0.25),
     finished 4.0; session_end ok.                                  E2E 4.0, slowdown 2.0
  B: start 1; preempted 1.5; first_token ttft 1.0; finished 3.0; end ok.   E2E 2.0, slowdown 2.0
  C: start 2; first_token ttft 2.0; finished 10.0; kv_retained 4 → expired; end ok.
                                                                      E2E 8.0, slowdown 4.0
  D: start 3; first_token ttft 0.75; finished 5.0; kv_retained 6 → shutdown; no session_end.
  engine-only request without a session: first_token ttft 0.1, finished.
  first_scheduled: A0 0.25 (cached 0), B0 1.2, C0 3.0, A1 3.1 (cached 96 of A0's 100 + 5 − 1 = 104
  computed tokens), D0 3.5.
"""

from __future__ import annotations

import math
from datetime import UTC, datetime, timedelta

import numpy as np
import pandas as pd
import pytest

from eval.metrics import (
    compute_metrics,
    goodput_per_s,
    kv_retention_stats,
    session_table,
    summarize,
    ttft_table,
)
from mars_openhands.stream import events as ev
from mars_openhands.stream.reader import events_to_frame

T0 = datetime(2026, 1, 1, tzinfo=UTC)
IDEAL_S = {"A": 2.0, "B": 1.0, "C": 2.0}


def _at(t_s: float) -> dict:
    return {"t_mono_ns": int(t_s * 1e9), "t_wall": T0 + timedelta(seconds=t_s)}


def _events() -> list:
    E, R = "engine:0", "replay"
    return [
        ev.SessionStart(**_at(0.0), session_id="A", source=R),
        ev.RequestFirstScheduled(**_at(0.25), session_id="A", turn=0, source=E, request_id="a0",
                                 prefill_start_delay_s=0.25),
        ev.RequestFirstToken(**_at(0.5), session_id="A", turn=0, source=E, request_id="a0", ttft_s=0.5),
        ev.RequestFinished(**_at(1.0), session_id="A", turn=0, source=E, request_id="a0",
                           num_prompt_tokens=100, num_output_tokens=5),
        ev.KvRetained(**_at(1.0), session_id="A", turn=0, source=E, num_blocks=10, ttl_s=2.0, reason="value>cost"),
        ev.SessionStart(**_at(1.0), session_id="B", source=R),
        ev.ToolStart(**_at(1.2), session_id="A", turn=0, source=R, tool_name="pytest", tool_call_id="t",
                     queue_wait_s=0.2),
        ev.RequestFirstScheduled(**_at(1.2), session_id="B", turn=0, source=E, request_id="b0",
                                 prefill_start_delay_s=0.2),
        ev.RequestPreempted(**_at(1.5), session_id="B", turn=0, source=E, request_id="b0", num_blocks_freed=3),
        ev.RequestFirstToken(**_at(2.0), session_id="B", turn=0, source=E, request_id="b0", ttft_s=1.0),
        ev.SessionStart(**_at(2.0), session_id="C", source=R),
        ev.RequestFinished(**_at(3.0), session_id="B", turn=0, source=E, request_id="b0",
                           num_prompt_tokens=50, num_output_tokens=5),
        ev.ToolEnd(**_at(3.0), session_id="A", turn=0, source=R, tool_name="pytest", tool_call_id="t",
                   duration_s=1.8),
        ev.KvReleased(**_at(3.0), session_id="A", source=E, num_blocks=10, reason="resumed"),
        ev.RequestFirstScheduled(**_at(3.0), session_id="C", turn=0, source=E, request_id="c0",
                                 prefill_start_delay_s=1.0),
        ev.RequestFirstScheduled(**_at(3.1), session_id="A", turn=1, source=E, request_id="a1",
                                 prefill_start_delay_s=0.1, num_cached_tokens=96),
        ev.SessionEnd(**_at(3.1), session_id="B", source=R),
        ev.SessionStart(**_at(3.0), session_id="D", source=R),
        ev.RequestFirstScheduled(**_at(3.5), session_id="D", turn=0, source=E, request_id="d0",
                                 prefill_start_delay_s=0.5),
        ev.RequestFirstToken(**_at(3.25), session_id="A", turn=1, source=E, request_id="a1", ttft_s=0.25),
        ev.RequestFirstToken(**_at(3.5), session_id="C", turn=0, source=E, request_id="c0", ttft_s=2.0),
        ev.RequestFirstToken(**_at(3.6), source=E, request_id="x", ttft_s=0.1),
        ev.RequestFinished(**_at(3.7), source=E, request_id="x", num_prompt_tokens=5, num_output_tokens=1),
        ev.RequestFirstToken(**_at(3.75), session_id="D", turn=0, source=E, request_id="d0", ttft_s=0.75),
        ev.RequestFinished(**_at(4.0), session_id="A", turn=1, source=E, request_id="a1",
                           num_prompt_tokens=120, num_output_tokens=5),
        ev.SessionEnd(**_at(4.1), session_id="A", source=R),
        ev.RequestFinished(**_at(5.0), session_id="D", turn=0, source=E, request_id="d0",
                           num_prompt_tokens=10, num_output_tokens=5),
        ev.KvRetained(**_at(5.0), session_id="D", turn=0, source=E, num_blocks=6, ttl_s=2.0, reason="value>cost"),
        ev.KvRetained(**_at(6.0), session_id="C", turn=0, source=E, num_blocks=4, ttl_s=1.0, reason="value>cost"),
        ev.KvReleased(**_at(7.0), session_id="C", source=E, num_blocks=4, reason="expired"),
        ev.RequestFinished(**_at(10.0), session_id="C", turn=0, source=E, request_id="c0",
                           num_prompt_tokens=10, num_output_tokens=5),
        ev.SessionEnd(**_at(10.1), session_id="C", source=R),
        ev.KvReleased(**_at(11.0), session_id="D", source=E, num_blocks=6, reason="shutdown"),
    ]


@pytest.fixture
def stream() -> pd.DataFrame:
    return events_to_frame(_events())


def test_session_table(stream: pd.DataFrame) -> None:
    table = session_table(stream, IDEAL_S)
    assert list(table.index) == ["A", "B", "C", "D"]
    assert table["e2e_s"].loc[["A", "B", "C", "D"]].tolist() == pytest.approx([4.0, 2.0, 8.0, 2.0])
    assert table["is_complete"].tolist() == [True, True, True, False]
    assert table["num_turns"].tolist() == [2, 1, 1, 1]
    assert table.loc["A", ["tool_s", "tool_queue_wait_s"]].tolist() == pytest.approx([1.8, 0.2])
    assert table["num_preemptions"].tolist() == [0, 1, 0, 0]
    assert table["slowdown"].loc[["A", "B", "C"]].tolist() == pytest.approx([2.0, 2.0, 4.0])
    assert table.loc["D", "status"] is None


def test_missing_ideal_is_an_error(stream: pd.DataFrame) -> None:
    with pytest.raises(ValueError, match=r"no ideal time for 1 completed session\(s\), e.g. \['C'\]"):
        session_table(stream, {"A": 2.0, "B": 1.0})


def test_compute_metrics_hand_computed(stream: pd.DataFrame) -> None:
    m = compute_metrics(stream, IDEAL_S, alphas=(1.0, 3.0, 5.0))
    assert (m.num_sessions, m.num_completed) == (4, 3)
    assert m.makespan_s == pytest.approx(10.0)            # last completed end 10 − first arrival 0
    assert m.throughput_sessions_per_s == pytest.approx(0.3)
    # E2E [2, 4, 8]: linear percentiles at ranks 0.9·2 = 1.8, 1.9, 1.98
    assert (m.e2e_s.count, m.e2e_s.mean, m.e2e_s.p50) == (3, pytest.approx(14 / 3), 4.0)
    assert (m.e2e_s.p90, m.e2e_s.p95, m.e2e_s.p99) == pytest.approx((7.2, 7.6, 7.92))
    # TTFT over every first_token: [0.5, 1.0, 0.25, 2.0, 0.1, 0.75]
    assert m.ttft_s.count == 6 and m.ttft_s.mean == pytest.approx(4.6 / 6)
    assert m.ttft_s.p50 == pytest.approx(0.625)
    assert m.slowdown is not None and m.slowdown.mean == pytest.approx(8 / 3)
    # E2E <= α·ideal: α=1 none; α=3 A (4 <= 6), B (2 <= 3); α=5 all three
    assert m.goodput_per_s == pytest.approx({1.0: 0.0, 3.0: 0.2, 5.0: 0.3})
    assert m.tool_wait_share == pytest.approx(2.0 / 14.0)
    assert m.tool_queue_wait_share == pytest.approx(0.2 / 14.0)
    assert m.num_preemptions == 1
    assert m.preemptions_per_request == pytest.approx(1 / 6)  # 6 finished events


def test_agent_ttft_slo_goodput_admission_wait_and_reprefill(stream: pd.DataFrame) -> None:
    from eval.metrics import admission_wait_s, agent_ttft_table, reprefill_tokens, ttft_slo_goodput

    ttft = agent_ttft_table(stream).set_index(["session_id", "turn"])["ttft_s"]
    # sent at arrival (turn 0) or at the previous tool's end (A1: tool_end 3.0); C's engine said 2.0
    assert ttft.to_dict() == pytest.approx({("A", 0): 0.5, ("B", 0): 1.0, ("A", 1): 0.25,
                                            ("C", 0): 1.5, ("D", 0): 0.75})
    table = session_table(stream, IDEAL_S)
    # completed sessions' turns: A0 0.5, A1 0.25, B0 1.0, C0 1.5 over a makespan of 10 s
    assert ttft_slo_goodput(stream, table, 0.6) == pytest.approx((0.5, 0.2))
    assert ttft_slo_goodput(stream, table, 10.0) == pytest.approx((1.0, 0.4))
    with pytest.raises(ValueError, match="TTFT SLO must be > 0 s"):
        ttft_slo_goodput(stream, table, 0.0)
    assert admission_wait_s(stream).to_dict() == pytest.approx({"A": 0.25, "B": 0.2, "C": 1.0, "D": 0.5})
    # A1: min(120, 100 + 5 - 1) - 96 cached = 8; B0's preemption reports no count: its prompt, 50
    assert reprefill_tokens(stream) == 58
    m = compute_metrics(stream, IDEAL_S)
    assert m.admission_wait_max_s == pytest.approx(1.0) and m.admission_wait_s.count == 4
    assert m.reprefill_tokens == 58 and m.ttft_slo[10.0] == pytest.approx((1.0, 0.4))


def test_kv_retention_hit_ratio(stream: pd.DataFrame) -> None:
    kv = kv_retention_stats(stream)
    assert (kv.num_retained, kv.num_released, kv.num_hits) == (3, 2, 1)  # shutdown is unresolved
    # This stream predates num_reused_blocks: its "resumed" release counts whole.
    assert kv.hit_ratio == kv.hit_block_ratio == pytest.approx(10 / 14)
    assert kv.resume_ratio == pytest.approx(0.5)
    assert kv.released_by_reason == {"resumed": 1, "expired": 1, "shutdown": 1}


def test_kv_retention_hit_ratio_counts_reused_tokens_not_whole_resumes(stream: pd.DataFrame) -> None:
    """Issue 16 kind 3: the resume reused 3 of its 10 blocks (the next turn rewrote the rest)."""
    measured = stream.copy()
    released = measured["kind"] == "kv_released"
    measured.loc[released, "num_reused_blocks"] = np.where(
        measured.loc[released, "reason"] == "resumed", 3, 0)
    kv = kv_retention_stats(measured)
    assert kv.hit_ratio == pytest.approx(3 / 14) and kv.num_reused_blocks == 3
    assert kv.hit_block_ratio == pytest.approx(10 / 14)  # the old, optimistic count


def test_without_ideals_slowdown_and_goodput_are_absent(stream: pd.DataFrame) -> None:
    m = compute_metrics(stream)
    assert m.slowdown is None and m.goodput_per_s is None
    with pytest.raises(ValueError, match="goodput needs ideal times"):
        goodput_per_s(session_table(stream), 3.0)
    with pytest.raises(ValueError, match="alpha must be > 0"):
        goodput_per_s(session_table(stream, IDEAL_S), 0.0)


def test_ttft_table_rows(stream: pd.DataFrame) -> None:
    table = ttft_table(stream)
    assert list(table.columns) == ["session_id", "turn", "request_id", "ttft_s"]
    assert table.loc[table["request_id"] == "a1", "turn"].item() == 1


def test_empty_run() -> None:
    stream = events_to_frame([ev.SessionStart(**_at(0.0), session_id="A", source="replay")])
    m = compute_metrics(stream, {"A": 1.0})
    assert (m.num_sessions, m.num_completed) == (1, 0)
    assert math.isnan(m.makespan_s) and math.isnan(m.throughput_sessions_per_s)
    assert m.e2e_s.count == 0 and m.kv_retention.hit_ratio is None
    assert summarize([float("nan"), 1.0]).count == 1


def test_same_metrics_after_a_jsonl_round_trip(tmp_path, stream: pd.DataFrame) -> None:
    from mars_openhands.stream.reader import read_stream

    path = tmp_path / "run.jsonl"
    path.write_text("".join(e.model_dump_json() + "\n" for e in _events()))
    assert compute_metrics(read_stream(path), IDEAL_S) == compute_metrics(stream, IDEAL_S)


def _shifted_run(origin: datetime) -> pd.DataFrame:
    """Sixteen sessions with µs-resolution times (as the simulator writes them: ``wall_origin`` +
    the virtual offset), recorded from ``origin``."""
    rng = np.random.default_rng(7)
    events = []
    for i in range(16):
        start_s = float(rng.uniform(0.0, 5000.0))
        end_s = start_s + float(rng.uniform(1.0, 900.0))

        def at(t_s: float) -> dict:
            return {"t_mono_ns": int(round(t_s * 1e9)), "t_wall": origin + timedelta(seconds=t_s)}

        sid = f"s{i}"
        events += [ev.SessionStart(**at(start_s), session_id=sid, source="replay"),
                   ev.RequestFirstScheduled(**at(start_s + 0.1), session_id=sid, turn=0, source="engine:0",
                                            request_id=f"{sid}r", prefill_start_delay_s=0.1),
                   ev.RequestFirstToken(**at(start_s + 0.3), session_id=sid, turn=0, source="engine:0",
                                        request_id=f"{sid}r", ttft_s=0.3),
                   ev.RequestFinished(**at(end_s), session_id=sid, turn=0, source="engine:0",
                                      request_id=f"{sid}r", num_prompt_tokens=10, num_output_tokens=5),
                   ev.SessionEnd(**at(end_s), session_id=sid, source="replay")]
    return events_to_frame(events)


def test_metrics_do_not_depend_on_the_runs_wall_origin() -> None:
    """Two runs of the same schedule started at different wall times (two policies that tie, or
    one policy run twice) must give bit-equal metrics, else a tie-break between policies (the best
    baseline) flips between runs. Failed before: times were float epoch seconds (~1.8e9, a step of
    2.4e-7 s), so an E2E's rounding depended on the origin."""
    ideal = {f"s{i}": 100.0 for i in range(16)}
    origins = [datetime(2026, 12, 5, 4, 0, tzinfo=UTC) + timedelta(microseconds=k * 123_457) for k in range(6)]
    metrics = [compute_metrics(_shifted_run(o), ideal) for o in origins]
    assert all(m == metrics[0] for m in metrics[1:])
    tables = [session_table(_shifted_run(o), ideal) for o in origins]
    for table in tables[1:]:
        assert table["e2e_s"].tolist() == tables[0]["e2e_s"].tolist()
    assert tables[0]["arrival_s"].min() == 0.0  # seconds from the run's first event, not the epoch
