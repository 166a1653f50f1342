"""Routing, the event hub's validation/forwarding, and the config/CLI (control/)."""

from __future__ import annotations

import argparse
import json

import pytest
from pydantic import ValidationError

from mars_openhands.control.cli import add_gateway_subcommand, config_from_args
from mars_openhands.control.config import GatewayConfig, ReplicaConfig, parse_replica
from mars_openhands.control.hub import EventHub, parse_cpu_batch, validate_cpu_batch
from mars_openhands.control.metadata import BadRequestError
from mars_openhands.control.routing import NoReplicaError, Router
from mars_openhands.control.sessions import SessionRegistry
from mars_openhands.stream.events import ToolStart, now_stamps
from mars_openhands.stream.transport import ListSink

CFG = GatewayConfig(replicas=[ReplicaConfig(url="http://127.0.0.1:1"),
                              ReplicaConfig(url="http://127.0.0.1:2", events_address="ipc:///x")])


def ev(kind: str, sid: str | None = "s", **extra) -> dict:
    base = {"kind": kind, "t_mono_ns": 1, "t_wall": "2026-01-01T00:00:00Z", "source": "agent",
            "session_id": sid}
    return {**base, **extra}


def test_affinity_and_least_loaded() -> None:
    router, reg = Router(CFG), SessionRegistry()
    a, b, c = (reg.get_or_create(x, 0.0) for x in "abc")
    assert router.route(a).index == 0
    assert router.route(b).index == 1  # fewer sessions
    assert router.route(a).index == 0  # sticks
    router.replicas[1].kv_usage_polled = 0.9
    assert router.route(c).index == 0  # tie on sessions (1 vs 1)? 0 has a, 1 has b -> kv breaks it
    assert [r.num_sessions for r in router.replicas] == [2, 1]


def test_kv_usage_takes_the_newer_of_step_and_poll() -> None:
    r = Router(CFG).replicas[0]
    assert r.kv_usage(10.0, 2.0) is None
    r.kv_usage_polled, r.kv_usage_polled_mono_s = 0.2, 9.0
    r.kv_usage_step, r.kv_usage_step_mono_s = 0.95, 9.5  # a step after the poll: it wins
    assert r.kv_usage(10.0, 2.0) == 0.95
    # The engine went idle after that step (no more steps); the next poll sees the freed blocks.
    r.kv_usage_polled, r.kv_usage_polled_mono_s = 0.1, 9.8
    assert r.kv_usage(10.0, 2.0) == 0.1
    r.kv_usage_step, r.kv_usage_step_mono_s = 0.5, 9.9
    assert r.kv_usage(10.0, 2.0) == 0.5
    assert r.kv_usage(12.5, 2.0) == 0.1  # a stale step never wins


def test_failure_threshold_and_reroute() -> None:
    router, reg = Router(CFG), SessionRegistry()
    s = reg.get_or_create("s", 0.0)
    assert router.route(s).index == 0
    assert router.record_failure(0, "boom") is False  # threshold 2
    assert router.record_failure(0, "boom") is True
    assert router.route(s).index == 1 and router.replicas[0].num_sessions == 0
    assert router.record_failure(1, "dead", immediate=True) is True
    with pytest.raises(NoReplicaError, match="dead"):
        router.route(s)
    assert router.record_success(0) is True and router.route(s).index == 0


@pytest.mark.parametrize(
    "body, match, status",
    [(b"{nope", "not valid JSON", 400),
     (json.dumps(ev("bogus")).encode(), "unknown event kind 'bogus'", 400),
     (json.dumps(ev("engine_step")).encode(), r"event \[0\]", 400),
     (json.dumps([ev("session_start"), ev("tool_start", tool_name="x")]).encode(),
      r"event \[1\].*tool_call_id", 400),
     (json.dumps(ev("session_start", sid=None)).encode(), "session_id is required", 400),
     (json.dumps({"events": [ev("session_end")] * 5}).encode(), "max_events_per_post=4", 413),
     (json.dumps({"events": 5}).encode(), '"events" must be a list of event objects, got int', 400)],
)
def test_parse_cpu_batch_errors(body: bytes, match: str, status: int) -> None:
    with pytest.raises(BadRequestError, match=match) as info:
        parse_cpu_batch(body, max_events=4)
    assert info.value.status_code == status


@pytest.mark.parametrize("source, engine_sources", [
    ("gateway", ()), ("engine", ()), ("engine:0", ()), ("engine:r7", ()), ("gpu-a", ("gpu-a",))])
def test_an_agent_may_not_claim_the_gateways_or_an_engines_source(source, engine_sources) -> None:
    body = json.dumps([ev("session_start"), ev("session_end", source=source)]).encode()
    with pytest.raises(BadRequestError, match=rf"event \[1\] \(session_end\): source '{source}'"):
        parse_cpu_batch(body, 10, engine_sources)
    for own in ("agent", "replay", "gateway-client", "my-engine"):  # only the exact names are kept
        assert parse_cpu_batch(json.dumps(ev("session_end", source=own)).encode(), 10,
                               engine_sources)[0].source == own


def test_gpu_kind_rejected_from_agents() -> None:
    body = json.dumps(ev("kv_released", num_blocks=1, reason="expired")).encode()
    with pytest.raises(BadRequestError, match="cannot be posted by agents"):
        parse_cpu_batch(body, 10)


def test_unknown_session_is_404_but_start_in_same_batch_is_fine() -> None:
    events = parse_cpu_batch(json.dumps([ev("session_start", "n"), ev("session_end", "n")]).encode(), 10)
    validate_cpu_batch(events, lambda sid: False)
    events = parse_cpu_batch(json.dumps([ev("session_end", "ghost")]).encode(), 10)
    with pytest.raises(BadRequestError, match="unknown session 'ghost'") as info:
        validate_cpu_batch(events, lambda sid: False)
    assert info.value.status_code == 404


def test_hub_records_and_forwards_per_replica() -> None:
    sinks: dict[str, ListSink] = {}

    def factory(address: str) -> ListSink:
        sinks[address] = ListSink()
        return sinks[address]

    record = ListSink()
    hub = EventHub(CFG, record, publisher_factory=factory)
    e = ToolStart(**now_stamps(), source="agent", session_id="s", tool_name="t", tool_call_id="1")
    hub.record(e)
    assert hub.forward(1, e) and not hub.forward(0, e) and not hub.forward(None, e)
    assert record.events == [e] and sinks["ipc:///x"].events == [e]


def test_parse_replica_and_bad_configs() -> None:
    r = parse_replica("http://127.0.0.1:9/,events=tcp://127.0.0.1:5,name=a,source=engine:7")
    assert (r.url, r.events_address, r.name, r.engine_source) == (
        "http://127.0.0.1:9", "tcp://127.0.0.1:5", "a", "engine:7")
    with pytest.raises(ValueError, match="bad --replica option"):
        parse_replica("http://x,color=red")
    with pytest.raises(ValidationError, match="http:// or https://"):
        ReplicaConfig(url="127.0.0.1:8000")
    with pytest.raises(ValidationError, match="distinct"):
        GatewayConfig(replicas=[ReplicaConfig(url="http://a"), ReplicaConfig(url="http://a")])
    with pytest.raises(ValidationError, match="Extra inputs"):
        GatewayConfig(replicas=[ReplicaConfig(url="http://a")], colour="red")
    with pytest.raises(ValidationError, match="not loopback-only"):
        parse_replica("http://127.0.0.1:9,events=bogus://x")
    with pytest.raises(ValidationError, match="not loopback-only"):
        GatewayConfig(replicas=[ReplicaConfig(url="http://a")], engine_events_address="127.0.0.1:5")
    # Checked with the configuration, not at start-up (it was a traceback after the app started).
    for address in ("tcp://8.8.8.8:5", "tcp://0.0.0.0:5600", "inproc://x"):
        with pytest.raises(ValidationError, match="not loopback-only"):
            parse_replica(f"http://127.0.0.1:9,events={address}")
        with pytest.raises(ValidationError, match="not loopback-only"):
            GatewayConfig(replicas=[ReplicaConfig(url="http://a")], engine_events_address=address)
    assert GatewayConfig(replicas=[ReplicaConfig(url="http://a", events_address="ipc:///tmp/r0.sock")],
                         engine_events_address="tcp://127.0.0.1:*")
    key = "k" * 32
    with pytest.raises(ValidationError, match="the admin key equals the API key"):
        GatewayConfig(replicas=[ReplicaConfig(url="http://a")], api_key=key, admin_key=key)
    assert GatewayConfig(replicas=[ReplicaConfig(url="http://a")], api_key=key, admin_key="a" * 32).admin_key
    with pytest.raises(ValidationError, match="give a .jsonl path"):  # the stream is JSONL
        GatewayConfig(replicas=[ReplicaConfig(url="http://a")], stream_path="runs/x/s.parquet")


def test_cli_flags_come_from_the_model(tmp_path) -> None:
    parser = argparse.ArgumentParser()
    sub = parser.add_subparsers(dest="command")
    gw = add_gateway_subcommand(sub)
    help_text = gw.format_help()
    for flag in ("--admission-window-max", "--reorder-starvation-s", "--num-tool-workers",
                 "--no-is-admission-enabled", "--session-idle-timeout-s"):
        assert flag in help_text
    assert "W_max" in help_text  # field docstrings are the help
    cfg_file = tmp_path / "gw.toml"
    cfg_file.write_text('port = 9100\n[admission]\nwindow_max = 8\nwindow_init = 8\nwindow_min = 2\n')
    args = parser.parse_args(["gateway", "--config", str(cfg_file), "--replica", "http://127.0.0.1:1",
                              "--admission-window-init", "5", "--reorder-starvation-s", "none"])
    cfg = config_from_args(args)
    assert (cfg.port, cfg.admission.window_max, cfg.admission.window_init) == (9100, 8, 5)
    assert cfg.reorder.starvation_s is None
    with pytest.raises(SystemExit):
        parser.parse_args(["gateway", "--admission-window-max", "lots"])
