"""The evented tool executor: exact timing, event order, denials, transport failures."""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("openhands.sdk", reason="needs the OpenHands env (.venv-openhands)")

from openhands.sdk.tool import ToolExecutor  # noqa: E402
from openhands.tools.terminal import TerminalAction, TerminalObservation  # noqa: E402

from mars_openhands.openhands.executor import EventedExecutor, EventSender  # noqa: E402
from mars_openhands.openhands.policy_check import PolicyConfig  # noqa: E402
from mars_openhands.stream.events import parse_event  # noqa: E402
from tests.openhands._helpers import EventCollector, free_port  # noqa: E402

pytestmark = pytest.mark.openhands

TOLERANCE_NS = 10_000_000  # the 10 ms


class ProbeExecutor(ToolExecutor):
    """Sleeps, records its own entry/exit instants (monotonic ns), and the commands it ran."""

    def __init__(self, sleep_s: float, fail: bool = False) -> None:
        self.sleep_s = sleep_s
        self.fail = fail
        self.calls: list[tuple[str, int, int]] = []

    def __call__(self, action: Any, conversation: Any = None) -> Any:
        t_in = time.monotonic_ns()
        time.sleep(self.sleep_s)
        if self.fail:
            self.calls.append((action.command, t_in, time.monotonic_ns()))
            raise RuntimeError("tool crashed")
        observation = TerminalObservation.from_text(text="done", command=action.command, exit_code=0)
        self.calls.append((action.command, t_in, time.monotonic_ns()))
        return observation


def _wrap(inner: ToolExecutor, sender: EventSender, tmp_path: Path) -> EventedExecutor:
    return EventedExecutor(inner, "terminal", TerminalObservation, "sess-1", sender, tmp_path,
                           PolicyConfig())


def test_tool_events_match_the_executors_own_timing(tmp_path: Path) -> None:
    probe = ProbeExecutor(sleep_s=0.05)
    with EventCollector() as collector:
        sender = EventSender(collector.url, tmp_path / "events.jsonl")
        wrapped = _wrap(probe, sender, tmp_path)
        for i in range(5):
            wrapped(TerminalAction(command=f"echo {i}"))
        sender.close()
    events = [parse_event(e) for e in collector.events]
    assert [e.kind for e in events] == ["tool_enqueued", "tool_start", "tool_end"] * 5
    for i, (command, t_in, t_out) in enumerate(probe.calls):
        enqueued, start, end = events[3 * i: 3 * i + 3]
        assert start.tool_call_id == end.tool_call_id == enqueued.tool_call_id
        assert start.session_id == "sess-1" and end.tool_name == "terminal" and end.status == "ok"
        assert 0 <= t_in - start.t_mono_ns < TOLERANCE_NS, (command, t_in - start.t_mono_ns)
        assert 0 <= end.t_mono_ns - t_out < TOLERANCE_NS, (command, end.t_mono_ns - t_out)
        assert end.duration_s == pytest.approx((end.t_mono_ns - start.t_mono_ns) / 1e9)
        assert end.duration_s >= 0.05
        assert start.queue_wait_s == pytest.approx((start.t_mono_ns - enqueued.t_mono_ns) / 1e9)
    # The local log holds exactly what was posted.
    logged = [parse_event(line) for line in (tmp_path / "events.jsonl").read_text().splitlines()]
    assert logged == events
    assert sender.num_post_errors == 0 and sender.num_sent == 15


def test_denied_command_is_not_executed_and_reported(tmp_path: Path) -> None:
    probe = ProbeExecutor(sleep_s=0.0)
    target = tmp_path.parent / "outside-the-workspace.txt"
    with EventCollector() as collector:
        sender = EventSender(collector.url)
        observation = _wrap(probe, sender, tmp_path)(TerminalAction(command=f"echo x > {target}"))
        sender.close()
    assert probe.calls == []  # the inner executor never ran
    assert not target.exists()
    assert isinstance(observation, TerminalObservation) and observation.is_error
    assert "write_outside_workspace" in observation.text and "NOT executed" in observation.text
    kinds = [(e["kind"], e.get("status")) for e in collector.events]
    assert kinds == [("tool_enqueued", None), ("tool_end", "denied")]


def test_crashing_tool_reports_error_and_reraises(tmp_path: Path) -> None:
    sender = EventSender(None, tmp_path / "events.jsonl")
    with pytest.raises(RuntimeError, match="tool crashed"):
        _wrap(ProbeExecutor(0.01, fail=True), sender, tmp_path)(TerminalAction(command="ls"))
    events = [parse_event(line) for line in (tmp_path / "events.jsonl").read_text().splitlines()]
    assert [e.kind for e in events] == ["tool_enqueued", "tool_start", "tool_end"]
    assert events[-1].status == "error" and events[-1].duration_s >= 0.01


def test_policy_off_executes_everything(tmp_path: Path) -> None:
    probe = ProbeExecutor(0.0)
    wrapped = EventedExecutor(probe, "terminal", TerminalObservation, "s", EventSender(None),
                              tmp_path, policy=None)
    wrapped(TerminalAction(command="sudo true"))
    assert [c[0] for c in probe.calls] == ["sudo true"]


def test_gateway_errors_never_reach_the_agent(tmp_path: Path) -> None:
    with EventCollector(status_code=404) as collector:
        sender = EventSender(collector.url, max_retries=1, retry_backoff_s=0.01)
        _wrap(ProbeExecutor(0.0), sender, tmp_path)(TerminalAction(command="ls"))
        assert sender.flush(10)
        sender.close()
    assert collector.num_posts == 2 and sender.num_post_errors == 2 and sender.num_sent == 0
    assert sender.num_lost == 3  # enqueued, start, end


def test_events_are_retried_across_a_gateway_restart(tmp_path: Path) -> None:
    """Nothing listens while the tool runs (the gateway restarts); the events arrive once it is
    back, in order, and nothing is counted lost (they were dropped after one try)."""
    port = free_port()
    sender = EventSender(f"http://127.0.0.1:{port}/mars/v1/events", tmp_path / "events.jsonl",
                         retry_backoff_s=0.1)
    _wrap(ProbeExecutor(0.0), sender, tmp_path)(TerminalAction(command="ls"))
    time.sleep(0.4)  # a few refused attempts
    with EventCollector(port=port, fail_first=1) as collector:  # back, then one 503 while starting
        assert sender.flush(15)
        sender.close()
    assert [e["kind"] for e in collector.events] == ["tool_enqueued", "tool_start", "tool_end"]
    assert sender.num_post_errors >= 2 and sender.num_lost == 0 and sender.num_sent == 3
    assert not (tmp_path / "events_lost.jsonl").exists()


def test_events_given_up_on_are_counted_and_kept(tmp_path: Path) -> None:
    """A 400 (the gateway rejected the batch) is not retried; the events are written beside the
    log as lost, and close() returns although the gateway never accepts them."""
    with EventCollector(status_code=400) as collector:
        sender = EventSender(collector.url, tmp_path / "events.jsonl")
        _wrap(ProbeExecutor(0.0), sender, tmp_path)(TerminalAction(command="ls"))
        t0 = time.monotonic()
        sender.close()
    assert time.monotonic() - t0 < 5.0
    assert collector.num_posts == 1 and sender.num_lost == 3
    lost = [json.loads(line)["kind"] for line in (tmp_path / "events_lost.jsonl").read_text().splitlines()]
    assert lost == ["tool_enqueued", "tool_start", "tool_end"]


def test_close_gives_up_on_an_unreachable_gateway_within_its_timeout(tmp_path: Path) -> None:
    sender = EventSender(f"http://127.0.0.1:{free_port()}/mars/v1/events", tmp_path / "e.jsonl")
    _wrap(ProbeExecutor(0.0), sender, tmp_path)(TerminalAction(command="ls"))
    t0 = time.monotonic()
    sender.close(timeout_s=1.0)
    assert time.monotonic() - t0 < 3.0 and sender.num_lost == 3 and sender.num_sent == 0


def test_emit_does_not_wait_for_a_slow_endpoint(tmp_path: Path) -> None:
    # Unroutable: each post hangs until its 10 s timeout. A blocking emit would take >= 10 s.
    sender = EventSender("http://10.255.255.1:9/mars/v1/events", timeout_s=10.0)
    wrapped = _wrap(ProbeExecutor(0.0), sender, tmp_path)
    wrapped.end_wait_s = 0.0  # only emit() here; the bounded tool_end wait is tested below
    t0 = time.monotonic()
    for _ in range(20):
        wrapped(TerminalAction(command="ls"))
    assert time.monotonic() - t0 < 5.0  # posting happens on the sender thread
    sender.close(timeout_s=0.1)


def test_the_observation_returns_only_after_its_tool_end_reached_the_gateway(tmp_path: Path) -> None:
    """Issue 16 kind 2: the SDK's next LLM call follows a tool's return by ~20 ms; a background
    post of tool_end lost that race on a slow gateway, and the next turn went without the tool."""
    with EventCollector(delay_s=0.15) as collector:
        sender = EventSender(collector.url)
        wrapped = _wrap(ProbeExecutor(0.0), sender, tmp_path)
        for i in range(3):
            wrapped(TerminalAction(command=f"echo {i}"))
            kinds = [e["kind"] for e in collector.events]
            assert kinds[-1] == "tool_end" and kinds.count("tool_end") == i + 1, kinds
        sender.close()
    assert wrapped.num_end_wait_timeouts == 0


def test_the_wait_for_tool_end_is_bounded_when_the_gateway_hangs(tmp_path: Path) -> None:
    sender = EventSender("http://10.255.255.1:9/mars/v1/events", timeout_s=10.0)
    wrapped = _wrap(ProbeExecutor(0.0), sender, tmp_path)
    wrapped.end_wait_s = 0.3
    t0 = time.monotonic()
    observation = wrapped(TerminalAction(command="ls"))
    assert 0.3 <= time.monotonic() - t0 < 2.0 and not observation.is_error
    assert wrapped.num_end_wait_timeouts == 1
    sender.close(timeout_s=0.1)


def test_a_tool_call_with_its_own_timeout_sends_a_bound(tmp_path: Path) -> None:
    from mars_openhands.openhands.executor import TOOL_BOUND_SLACK_S

    with EventCollector() as collector:
        sender = EventSender(collector.url)
        wrapped = _wrap(ProbeExecutor(0.0), sender, tmp_path)
        wrapped(TerminalAction(command="sleep 0", timeout=30.0))
        wrapped(TerminalAction(command="ls"))
        sender.close()
    starts = [e for e in collector.events if e["kind"] == "tool_start"]
    assert [e.get("timeout_s") for e in starts] == [30.0 + TOOL_BOUND_SLACK_S, None]
    # An unset optional field is not posted: a gateway older than the field still accepts it.
    assert "timeout_s" not in starts[1] and "turn" not in starts[1]


class _Agent:
    """What EventedToolsCallback reads of an SDK agent: ``tools_map``."""

    def __init__(self, tools: list[Any]) -> None:
        self.tools_map = {t.name: t for t in tools}


class _ActionEvent:
    def __init__(self, tool_name: str, action: Any) -> None:
        self.tool_name = tool_name
        self.action = action


def test_every_other_tool_is_evented_when_the_agent_calls_it(tmp_path: Path) -> None:
    """Issue 16 kind 2: custom and MCP tools (here the SDK's own think tool, a real
    ToolDefinition with its real executor) emit tool events once the agent calls them; finish
    and tools wrapped already are left alone."""
    from openhands.sdk.tool.builtins import FinishTool, ThinkAction, ThinkTool

    from mars_openhands.openhands.executor import EventedToolsCallback

    think = ThinkTool.create()[0]
    finish = FinishTool.create()[0]
    with EventCollector() as collector:
        sender = EventSender(collector.url)
        callback = EventedToolsCallback("sess-x", sender, tmp_path)
        callback.agent = _Agent([think, finish])
        action = ThinkAction(thought="plan the fix")
        callback(_ActionEvent("think", action))
        callback(_ActionEvent("think", action))  # idempotent
        callback(_ActionEvent("finish", None))
        observation = think(action, None)  # what the agent then runs: the same tool object
        sender.close()
    assert callback.wrapped == ["think"] and isinstance(think.executor, EventedExecutor)
    assert not isinstance(finish.executor, EventedExecutor)
    assert not observation.is_error
    events = [parse_event(e) for e in collector.events]
    assert [(e.kind, e.tool_name, e.session_id) for e in events] == [
        ("tool_enqueued", "think", "sess-x"), ("tool_start", "think", "sess-x"),
        ("tool_end", "think", "sess-x")]
    assert events[-1].status == "ok"
