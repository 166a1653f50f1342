"""Event model: per-kind JSON round trip and the EventError messages."""

from __future__ import annotations

import json
from datetime import datetime

import pytest
from stream_samples import sample_dict, sample_events

from mars_openhands.stream.events import EVENT_TYPES, EventError, parse_event


@pytest.mark.parametrize("kind", list(EVENT_TYPES))
def test_json_round_trip_per_kind(kind: str) -> None:
    event = parse_event(sample_dict(kind, 3))
    assert type(event) is EVENT_TYPES[kind]
    again = parse_event(event.model_dump_json())
    assert again == event
    assert parse_event(event.model_dump_json().encode()) == event


def test_samples_cover_every_kind() -> None:
    assert [e.kind for e in sample_events()] == list(EVENT_TYPES)


@pytest.mark.parametrize(
    ("change", "expected"),
    [
        ({"num_prompt_tokens": None}, "num_prompt_tokens"),  # wrong type (None for a required int)
        ({"num_prompt_tokens": "many"}, "num_prompt_tokens"),  # wrong type
        ({"num_prompt_tokens": -1}, "num_prompt_tokens"),  # out of bounds
        ({"bogus_field": 1}, "bogus_field"),  # unknown field
        ({"kind": "nonsense"}, "unknown event kind 'nonsense'"),
        ({"kind": ["queued"]}, "unknown event kind"),
        ({"t_wall": "2026-11-30T05:00:00"}, "t_wall must be timezone-aware"),
    ],
)
def test_bad_event_message_names_the_field(change: dict, expected: str) -> None:
    data = {**sample_dict("queued"), **change}
    with pytest.raises(EventError, match=expected.replace("(", r"\(")):
        parse_event(data)
    with pytest.raises(EventError, match=expected.replace("(", r"\(")):
        parse_event(json.dumps(data))


def test_missing_field_and_missing_kind_are_named() -> None:
    data = sample_dict("tool_end")
    del data["duration_s"]
    with pytest.raises(EventError, match="invalid tool_end event: duration_s: Field required"):
        parse_event(data)
    del data["kind"]
    with pytest.raises(EventError, match="no 'kind' field; expected one of .*tool_end"):
        parse_event(data)


def test_non_object_and_bad_json_raise_event_error() -> None:
    with pytest.raises(EventError, match="JSON object"):
        parse_event("[1, 2]")
    with pytest.raises(EventError, match="not valid JSON"):
        parse_event(b'{"kind": "queued", ')


def test_t_wall_is_normalized_to_utc() -> None:
    event = parse_event({**sample_dict("session_start"), "t_wall": "2026-11-30T07:00:00+02:00"})
    assert event.t_wall == datetime.fromisoformat("2026-11-30T05:00:00+00:00")
    assert event.t_wall.utcoffset().total_seconds() == 0


def test_fuzzed_events_parse_or_fail_with_an_event_error_naming_the_field() -> None:
    """Issue 16 "Fuzz" (event schema): any field of any kind replaced by any JSON value, dropped,
    or joined by an unknown one either parses or raises EventError naming it, never anything
    else."""
    from hypothesis import given, settings
    from hypothesis import strategies as st

    from tests.unit.stream.stream_samples import sample_dict

    values = st.recursive(st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=8),
                          lambda c: st.lists(c, max_size=2) | st.dictionaries(st.text(max_size=4), c,
                                                                              max_size=2),
                          max_leaves=4)

    @settings(max_examples=400, deadline=None, derandomize=True)
    @given(kind=st.sampled_from(sorted(EVENT_TYPES)), how=st.sampled_from(["set", "drop", "add"]),
           pick=st.integers(0, 100), value=values)
    def check(kind: str, how: str, pick: int, value: object) -> None:
        data = sample_dict(kind)
        fields = sorted(set(data) - {"kind"})
        field = fields[pick % len(fields)] if how != "add" else "not_a_field"
        if how == "drop":
            data.pop(field)
        else:
            data[field] = value
        try:
            parse_event(data)
        except EventError as e:
            assert field in str(e), (field, str(e))

    check()
