"""Trim/scale helpers on hand-made sessions."""

from __future__ import annotations

import pytest

from eval.workloads.format import Session, Turn, Workload, WorkloadMeta
from eval.workloads.transform import cap_session, mix_workloads, scale_workload, trim_workload


def _session(session_id: str = "s") -> Session:
    # prompts: 100, 100+10+20 = 130, 130+5+7 = 142; KV peak per turn: 110, 135, 145
    return Session(session_id=session_id, arrival_s=1.0, turns=(
        Turn(prompt_tokens_appended=100, output_tokens=10, tool_name="pytest", tool_duration_s=2.0),
        Turn(prompt_tokens_appended=20, output_tokens=5, tool_name="cat", tool_duration_s=0.5),
        Turn(prompt_tokens_appended=7, output_tokens=3),
    ))


def test_cap_turns_makes_the_last_kept_turn_final() -> None:
    capped = cap_session(_session(), max_turns=2)
    assert capped.num_turns == 2
    assert capped.turns[1] == Turn(prompt_tokens_appended=20, output_tokens=5)
    assert cap_session(_session(), max_turns=5) == _session()


@pytest.mark.parametrize(("cap", "num_turns"), [(145, 3), (144, 2), (135, 2), (134, 1), (110, 1)])
def test_cap_context_keeps_turns_that_fit(cap: int, num_turns: int) -> None:
    capped = cap_session(_session(), max_context_tokens=cap)
    assert capped.num_turns == num_turns
    assert capped.max_context_tokens <= cap
    assert capped.turns[-1].tool_name is None


def test_cap_below_the_first_turn_shrinks_it() -> None:
    capped = cap_session(_session(), max_context_tokens=16)
    assert capped.turns == (Turn(prompt_tokens_appended=8, output_tokens=8),)
    with pytest.raises(ValueError, match="max_context_tokens must be >= 2"):
        cap_session(_session(), max_context_tokens=1)
    with pytest.raises(ValueError, match="max_turns must be >= 1"):
        cap_session(_session(), max_turns=0)


def test_trim_and_scale_record_notes() -> None:
    workload = Workload(meta=WorkloadMeta(source="t"), sessions=tuple(_session(f"s{i}") for i in range(4)))
    trimmed = trim_workload(workload, num_sessions=2, max_turns=1)
    assert [s.session_id for s in trimmed.sessions] == ["s0", "s1"]
    assert all(s.num_turns == 1 for s in trimmed.sessions)
    assert trimmed.meta.notes[-1].startswith("trimmed: num_sessions=2 max_turns=1")
    scaled = scale_workload(workload, token_factor=0.5, tool_time_factor=0.1, arrival_factor=2.0)
    s = scaled.sessions[0]
    assert s.arrival_s == 2.0
    assert [(t.prompt_tokens_appended, t.output_tokens) for t in s.turns] == [(50, 5), (10, 2), (4, 2)]
    assert [t.tool_duration_s for t in s.turns] == pytest.approx([0.2, 0.05, 0.0])
    tiny = scale_workload(workload, token_factor=0.001)
    assert tiny.sessions[0].turns[0].prompt_tokens_appended == 1  # turn 0 keeps >= 1 prompt token
    assert tiny.sessions[0].turns[1].prompt_tokens_appended == 0
    with pytest.raises(ValueError, match="factors must be > 0"):
        scale_workload(workload, token_factor=0.0)


def _sessions():
    from hypothesis import strategies as st

    turn = st.tuples(st.integers(1, 500), st.integers(1, 200), st.floats(0, 100))
    return st.lists(turn, min_size=1, max_size=12).map(lambda ts: Session(session_id="p", turns=tuple(
        Turn(prompt_tokens_appended=a, output_tokens=o, tool_name=None if k == len(ts) - 1 else "t",
             tool_duration_s=0.0 if k == len(ts) - 1 else d)
        for k, (a, o, d) in enumerate(ts))))


def test_cap_session_properties() -> None:
    from hypothesis import given
    from hypothesis import strategies as st

    @given(_sessions(), st.integers(1, 12) | st.none(), st.integers(2, 3000) | st.none())
    def check(session: Session, max_turns: int | None, max_context_tokens: int | None) -> None:
        capped = cap_session(session, max_turns=max_turns, max_context_tokens=max_context_tokens)
        assert 1 <= capped.num_turns <= min(session.num_turns, max_turns or session.num_turns)
        assert capped.turns[-1].tool_name is None
        if max_context_tokens is not None:
            assert capped.max_context_tokens <= max_context_tokens
        n = capped.num_turns
        first_fits = max_context_tokens is None or (
            session.turns[0].prompt_tokens_appended + session.turns[0].output_tokens <= max_context_tokens)
        if first_fits:  # a prefix of the original whose last turn lost only its tool
            assert capped.turns[:-1] == session.turns[: n - 1]
            assert capped.turns[-1].prompt_tokens_appended == session.turns[n - 1].prompt_tokens_appended

    check()


def _workload(prefix: str, n: int) -> Workload:
    return Workload(meta=WorkloadMeta(source=prefix),
                    sessions=tuple(_session(f"{prefix}{k}") for k in range(n)))


def test_mix_interleaves_every_session_once_in_a_seeded_order() -> None:
    a, b = _workload("a", 20), _workload("b", 20)
    mixed = mix_workloads([a, b], seed=3)
    ids = [s.session_id for s in mixed.sessions]
    assert sorted(ids) == sorted(s.session_id for s in (*a.sessions, *b.sessions))
    assert ids[:20] != [s.session_id for s in a.sessions]  # interleaved, not concatenated
    assert sum(i.startswith("b") for i in ids[:20]) >= 5
    assert [s.session_id for s in mix_workloads([a, b], seed=3).sessions] == ids
    assert [s.session_id for s in mix_workloads([a, b], seed=4).sessions] != ids
    assert "mixed" in mixed.meta.notes[-1]


def test_mix_refuses_one_workload_and_repeated_session_ids() -> None:
    with pytest.raises(ValueError, match="at least two"):
        mix_workloads([_workload("a", 2)])
    with pytest.raises(ValueError, match="distinct"):
        mix_workloads([_workload("a", 2), _workload("a", 3)])
