"""SchedulerParams parsing and the MARS vllm_xargs metadata (policy/params.py, policy/types.py)."""

from __future__ import annotations

import pytest

from mars_openhands.policy.params import SchedulerParams, parse_scheduler_params
from mars_openhands.policy.session import inferred_tool_duration_s
from mars_openhands.policy.types import TurnMeta, parse_turn_meta


def test_defaults_match_design() -> None:
    p = parse_scheduler_params(None)
    assert p.levels.prompt_thresholds_tokens == (2048, 8192, 32768)
    assert p.levels.quanta_tokens == (2048, 1024, 512, 256)
    assert p.levels.aging_interval_s == 30.0 and p.window.size == 30
    assert p.retention.reload_linear_s_per_token == 0.0002 and p.retention.min_tool_samples == 100
    assert parse_scheduler_params({}) == p and parse_scheduler_params(p) is p


@pytest.mark.parametrize(("raw", "match"), [
    ({"levels": {"quanta_tokens": [1, 2]}}, r"mars\.levels.*quanta_tokens needs"),
    ({"retention": {"price_free_usage": 1.5}}, r"mars\.retention\.price_free_usage"),
    ({"window": {"size": 0}}, r"mars\.window\.size"),
    ({"bogus": True}, r"unknown key 'mars\.bogus'; 'mars' takes: levels, mars, retention"),
    ("nope", r"must be a JSON object"),
])
def test_errors_name_the_key(raw, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        parse_scheduler_params(raw)


def test_errors_are_config_error_lines() -> None:
    """A bad value says its key and value; an unknown key lists its section's keys and never
    shows its value (was 'mars.levels.agng: Extra inputs are not permitted (got 1)' for every
    key, and a check across sections printed the whole dict under 'mars.:')."""
    def message(raw) -> str:
        with pytest.raises(ValueError) as info:
            parse_scheduler_params(raw)
        return str(info.value)

    assert message({"window": {"size": 0}, "levels": {"agng": "sk-typo"}}) == (
        "invalid --additional-config mars: unknown key 'mars.levels.agng'; 'mars.levels' takes: "
        "prompt_thresholds_tokens, quanta_tokens, aging_interval_s; mars.window.size: Input should be "
        "greater than or equal to 1 (got 0)")
    assert message({"mars": {"quanta_tokens": [1, 2, 3]}}) == (
        "invalid --additional-config mars: mars.quanta_tokens needs levels.num_levels = 4 entries, got 3")
    assert message({"telemetry": {"source": 3}}) == (
        "invalid --additional-config mars: mars.telemetry.source: Input should be a valid string (got 3)")


def test_params_are_frozen() -> None:
    p = SchedulerParams()
    with pytest.raises(ValueError):
        p.levels.aging_interval_s = 1.0  # type: ignore[misc]


@pytest.mark.parametrize(("extra", "meta"), [
    (None, TurnMeta()),
    ({"kv_transfer_params": None}, TurnMeta()),
    ({"mars_turn": 2}, TurnMeta(turn=2)),
    ({"mars_turn": 2, "mars_last_step": 1}, TurnMeta(turn=2, is_last_step=True)),
    ({"mars_turn": 0, "mars_last_step": False}, TurnMeta(turn=0, is_last_step=False)),
    ({"mars_side": True}, TurnMeta(is_side=True)), ({"mars_side": 0}, TurnMeta()),
    ({"mars_prev_tool": "bash", "mars_prev_tool_s": 1.5},
     TurnMeta(prev_tool="bash", prev_tool_s=1.5)),
    ({"mars_prev_tool": "bash", "mars_prev_tool_s": 2}, TurnMeta(prev_tool="bash", prev_tool_s=2.0)),
    ({"mars_turn": 4, "mars_session_age_s": 12}, TurnMeta(turn=4, session_age_s=12.0)),
])
def test_turn_meta_valid(extra, meta: TurnMeta) -> None:
    assert parse_turn_meta(extra) == meta


@pytest.mark.parametrize(("extra", "key"), [
    ({"mars_turn": -1}, "mars_turn"), ({"mars_turn": 1.5}, "mars_turn"),
    ({"mars_last_step": 2}, "mars_last_step"), ({"mars_prev_tool": ""}, "mars_prev_tool"),
    ({"mars_prev_tool_s": "nan"}, "mars_prev_tool_s"), ({"mars_prev_tool_s": -1}, "mars_prev_tool_s"),
    ({"mars_sesion": "x"}, "mars_sesion"), ({"mars_session_age_s": -0.5}, "mars_session_age_s"),
    ({"mars_session_age_s": "3"}, "mars_session_age_s"),
])
def test_turn_meta_invalid_names_the_key(extra, key: str) -> None:
    with pytest.raises(ValueError, match=key):
        parse_turn_meta(extra)


@pytest.mark.parametrize(("extra", "key"), [
    # accepted before: a bool, a numeric string, a float that is an integer (1e300 too)
    ({"mars_turn": True}, "mars_turn"), ({"mars_turn": "3"}, "mars_turn"),
    ({"mars_turn": 2.0}, "mars_turn"), ({"mars_turn": 1e300}, "mars_turn"),
    ({"mars_turn": 2**31}, "mars_turn"), ({"mars_turn": "abc"}, "mars_turn"),
    ({"mars_last_step": "1"}, "mars_last_step"), ({"mars_last_step": 1.0}, "mars_last_step"),
    ({"mars_side": "title"}, "mars_side"), ({"mars_side": "1"}, "mars_side"),
    ({"mars_side": 2}, "mars_side"), ({"mars_prev_tool_s": "1.5"}, "mars_prev_tool_s"),
    ({"mars_prev_tool_s": True}, "mars_prev_tool_s"), ({"mars_prev_tool_s": 10**400}, "mars_prev_tool_s"),
    ({"mars_prev_tool": ["bash"]}, "mars_prev_tool"),
])
def test_turn_meta_types_are_strict_and_each_error_has_its_own_hint(extra, key: str) -> None:
    with pytest.raises(ValueError) as e:
        parse_turn_meta(extra)
    message = str(e.value)
    assert message.startswith(f"invalid vllm_xargs {key}=") and len(message) < 200, message
    hint = message[message.index("(send vllm_xargs"):]
    assert f'"{key}"' in hint, message  # was {"mars_turn": 0, ...} for every key
    if key != "mars_turn":
        assert "mars_turn" not in hint, message


@pytest.mark.parametrize(("last", "arrival", "reported", "out"), [
    (None, 5.0, None, None), (2.0, 5.0, None, 3.0), (2.0, 5.0, 1.0, 1.0), (6.0, 5.0, None, 0.0),
])
def test_inferred_tool_duration(last, arrival, reported, out) -> None:
    assert inferred_tool_duration_s(last, arrival, reported) == out


def test_every_shared_scheduler_key_is_documented() -> None:
    """docs/schedulers.md lists each key of SchedulerParams that is not a policy's own sub-table."""
    from pathlib import Path

    from mars_openhands.policy.params import SchedulerParams, TelemetryParams, WindowParams

    text = (Path(__file__).parents[3] / "docs" / "schedulers.md").read_text()
    own = {"levels", "mars", "autellix", "continuum", "infercept", "thunderagent"}  # documented per policy below it
    keys = [k for k in SchedulerParams.model_fields if k not in own]
    keys = [*(k for k in keys if k not in ("telemetry", "window")),
            *(f"telemetry.{k}" for k in TelemetryParams.model_fields),
            *(f"window.{k}" for k in WindowParams.model_fields)]
    missing = [k for k in keys if f"`{k}`" not in text and f"`{k.split('.')[0]}.*`" not in text]
    assert not missing, f"undocumented in docs/schedulers.md: {missing}"
