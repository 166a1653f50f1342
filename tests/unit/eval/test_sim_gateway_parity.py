"""The simulator and the gateway make the same admission decisions (control/plane.py).

A small workload under CPU and KV pressure runs once through :mod:`eval.sim` (virtual time, the
real vLLM scheduler). Everything a live gateway would have been sent during that run is then
replayed, in the simulator's order and at its virtual times, through the real gateway's ASGI app
(``Gateway.app``: the proxy hot path and ``POST /mars/v1/events``) on an injected clock:

* ``session_start``, then the session's first request (``POST /v1/completions``, a prompt whose
  byte-size estimate is the simulated turn's prompt tokens);
* ``tool_enqueued`` / ``tool_start`` / ``tool_end`` as posted events, and after ``tool_end`` the
  session's next request;
* the engine's answer to a request when the simulated engine finished it (the replica client holds
  each request until then);
* before every simulated admission tick, the KV the simulated engine reported (an ``engine_step``:
  the tick's ``kv_usage`` is ``num_used_blocks / num_gpu_blocks``), then ``Gateway.tick()``;
* ``session_end`` as a posted event.

The gateway must admit the same sessions at the same virtual times, in the same order, and every
tick must report the same window, counts, overload flags and signals. A simulator with its own copy
of the tick, KV budget, session end or token bookkeeping would drift from the gateway here.
"""

from __future__ import annotations

import asyncio
import json
from typing import Any

import pytest

pytest.importorskip("vllm")
httpx = pytest.importorskip("httpx")

from eval.sim import (  # noqa: E402
    LinearStepTimeModel,
    SimConfig,
    SimResult,
    Simulator,
    gateway_config,
)
from eval.workloads.format import Session, Turn, Workload, WorkloadMeta  # noqa: E402
from mars_openhands.control.app import Gateway  # noqa: E402
from mars_openhands.control.plane import AdmissionReport  # noqa: E402
from mars_openhands.engine.harness.inproc_engine import InprocEngineParams  # noqa: E402
from mars_openhands.policy.admission import AdmissionParams  # noqa: E402
from mars_openhands.policy.reorder import ReorderParams  # noqa: E402
from mars_openhands.stream.events import EngineStep  # noqa: E402

NUM_GPU_BLOCKS = 256
_CPU_KINDS = ("tool_enqueued", "tool_start", "tool_end", "session_end")


def _workload() -> Workload:
    """Ten sessions 0.25 s apart with different first prompts (the reorder sees them), 3-5 turns
    and tools of 1-2.6 s on one tool worker: the window fills, tool waits set the CPU overload, and
    four long contexts at once exceed the KV set threshold."""
    sessions = []
    for i in range(10):
        num_turns = 3 + i % 3
        turns = [Turn(prompt_tokens_appended=(2000 - 80 * i if k == 0 else 60 + 10 * k),
                      output_tokens=40 + (3 * i + k) % 9, tool_name="bash",
                      tool_duration_s=1.0 + 0.4 * ((i + k) % 5))
                 for k in range(num_turns - 1)]
        turns.append(Turn(prompt_tokens_appended=40, output_tokens=8))
        sessions.append(Session(session_id=f"s{i}", arrival_s=0.25 * i, turns=tuple(turns)))
    return Workload(meta=WorkloadMeta(source="test"), sessions=tuple(sessions))


CONFIG = SimConfig(
    engine=InprocEngineParams(num_gpu_blocks=NUM_GPU_BLOCKS, max_model_len=8192),
    num_tool_workers=1, is_admission_enabled=True,
    admission=AdmissionParams(window_max=4, window_init=4, window_min=1, cpu_set_wait_s=1.0,
                              cpu_clear_wait_s=0.5, cpu_set_backlog_ratio=4.0),
    reorder=ReorderParams(starvation_s=3.0),
)
TIMER = LinearStepTimeModel(overhead_s=0.02)


class _ClockedSink:
    """Keeps each event with the simulator's exact virtual time (``t_mono_ns`` is rounded)."""

    def __init__(self) -> None:
        self.sim: Simulator | None = None
        self.events: list[tuple[float, Any]] = []

    def emit(self, event: Any) -> None:
        assert self.sim is not None
        self.events.append((self.sim.now_s, event))

    def close(self) -> None:
        """Nothing to release."""


class _Response:
    status_code = 200
    content_type = "application/json"
    headers: list[tuple[bytes, bytes]] = []

    async def read(self) -> bytes:
        return b'{"choices": []}'

    def close(self) -> None:
        """Nothing to release."""


class _HeldEngine:
    """The gateway's replica client: notes when each request reaches the engine (on the virtual
    clock) and answers it once the simulated engine has finished that turn."""

    def __init__(self, clock: Any) -> None:
        self.clock = clock
        self.arrivals: list[tuple[float, str, int]] = []
        self._finished: dict[tuple[str, int], asyncio.Event] = {}

    def _done(self, session_id: str, turn: int) -> asyncio.Event:
        return self._finished.setdefault((session_id, turn), asyncio.Event())

    def finish(self, session_id: str, turn: int) -> None:
        self._done(session_id, turn).set()

    async def post(self, url: str, content: bytes, headers: Any) -> _Response:
        body = json.loads(content)
        session_id, turn = body["session_id"], body["vllm_xargs"]["mars_turn"]
        self.arrivals.append((self.clock(), session_id, turn))
        await self._done(session_id, turn).wait()
        return _Response()

    async def get(self, url: str, timeout_s: float | None = None, headers: Any = None) -> tuple:
        return 200, b"", "text/plain"

    async def close(self) -> None:
        """Nothing to close."""


def _simulate(workload: Workload) -> tuple[SimResult, list[tuple[float, Any]]]:
    sink = _ClockedSink()
    sim = Simulator(workload, CONFIG, TIMER, sink)
    sink.sim = sim
    return sim.run(), sink.events


def _owner(session_id: str) -> dict[str, str]:
    """The session's token header, as its own client sends it on every call."""
    return {"x-mars-session-token": f"token-of-{session_id}-0123456789abcdef"}


def _report(event: Any) -> AdmissionReport:
    return AdmissionReport(*(getattr(event, name) for name in AdmissionReport._fields))


async def _replay(workload: Workload, events: list[tuple[float, Any]]) -> tuple[list, list, list]:
    """Feed the simulated run to a real gateway; returns (engine arrivals, tick reports, each
    request's response or exception)."""
    now = [0.0]
    engine = _HeldEngine(lambda: now[0])
    gateway = Gateway(gateway_config(CONFIG), client_factory=lambda _: engine, clock=lambda: now[0])
    specs = {s.session_id: s for s in workload.sessions}
    requests: list[asyncio.Task] = []
    reports: list[AdmissionReport] = []
    await gateway.start()
    transport = httpx.ASGITransport(app=gateway.app)
    async with httpx.AsyncClient(transport=transport, base_url="http://gateway") as client:

        def send(session_id: str, turn: int) -> None:
            tokens = specs[session_id].turns[turn].prompt_tokens_appended
            body = {"model": "m", "prompt": "x" * (4 * tokens), "mars_session": session_id}
            requests.append(asyncio.create_task(client.post("/v1/completions", json=body,
                                                            headers=_owner(session_id))))

        for t_s, event in events:
            now[0] = t_s
            kind, sid = event.kind, event.session_id
            if kind == "session_start":
                await client.post("/mars/v1/events", json=event.model_dump(mode="json"),
                                  headers=_owner(sid))
                send(sid, 0)
            elif kind in _CPU_KINDS:
                r = await client.post("/mars/v1/events", json=event.model_dump(mode="json"),
                                      headers=_owner(sid))
                assert r.status_code == 200, r.text
                if kind == "tool_end":
                    send(sid, event.turn + 1)
            elif kind == "finished":
                engine.finish(sid, event.turn)
            elif kind == "admission_update":
                used = round(event.kv_usage * NUM_GPU_BLOCKS)
                gateway.on_engine_event(EngineStep.model_construct(
                    **event.model_dump(include={"t_mono_ns", "t_wall"}), source=CONFIG.engine_source,
                    session_id=None, turn=None, num_gpu_blocks=NUM_GPU_BLOCKS,
                    num_used_blocks=used, num_free_blocks=NUM_GPU_BLOCKS - used, num_running=0,
                    num_waiting=0))
                reports.append(gateway.tick().report)
            for _ in range(40):  # let the requests move (the clock stands still meanwhile)
                await asyncio.sleep(0)
        responses = await asyncio.gather(*requests, return_exceptions=True)
    await gateway.stop()
    return engine.arrivals, reports, responses


def test_the_gateway_admits_what_the_simulator_admitted_at_the_same_times() -> None:
    workload = _workload()
    result, events = _simulate(workload)
    records = result.sessions
    sim_updates = [_report(e) for _, e in events if e.kind == "admission_update"]
    arrivals, gateway_reports, responses = asyncio.run(_replay(workload, events))

    # The run exercised every signal: sessions waited, the window moved, both planes overloaded.
    waited = [sid for sid, r in records.items() if r.admitted_s > r.arrival_s]
    assert len(waited) >= 4, waited
    # C_cpu = ceil(1 * 2.5 / f) lets the window reach W_max (4) while the admitted sessions spend
    # under 5/6 of their time in tool calls (f), and caps it at 3 above
    assert {u.window for u in sim_updates} == {1, 2, 3, 4}
    assert any(u.cpu_overloaded for u in sim_updates) and any(u.kv_overloaded for u in sim_updates)

    admitted_at = {sid: t for t, sid, turn in arrivals if turn == 0}
    assert admitted_at == {sid: r.admitted_s for sid, r in records.items()}
    first_queued = [e.session_id for _, e in events if e.kind == "queued" and e.turn == 0]
    assert [sid for _, sid, turn in arrivals if turn == 0] == first_queued  # same admission order
    assert gateway_reports == sim_updates
    assert all(getattr(r, "status_code", None) == 200 for r in responses), responses
