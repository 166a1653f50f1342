"""MarsScheduler over vLLM's host KV tier (OffloadingConnector, emulated copies) in the
in-process engine: with the tier, a displaced idle resident's cold resume costs the host→GPU load
of its stored blocks instead of their re-prefill, so mars displaces it for a waiting session where
it would keep it on GPU KV only, and the resume loads from the host.

Scenario (40 blocks, 39 usable): ``old`` (25 blocks) finishes a turn and starts ``ls``, whose calls
take 2 s; ``young`` (20 blocks) arrives 0.1 s later and does not fit beside it. Re-prefilling
``old``'s 400 tokens at the 0.01 s/token prior costs 4 s > the ~1.9 s its call has left, so on GPU
KV only ``old`` stays resident and ``young`` is held (test_mars_residency has the same case);
loading 25 blocks of 1 MiB at 50 GB/s costs ~0.5 ms, so with the tier ``old`` is displaced.
"""

from __future__ import annotations

import math

import pytest

pytest.importorskip("vllm")

from mars_openhands.engine.harness.inproc_engine import (  # noqa: E402
    InprocEngine,
    InprocEngineParams,
    SessionTokenStream,
)
from mars_openhands.engine.harness.offload.copies import Direction  # noqa: E402
from mars_openhands.engine.harness.offload.params import HostKvParams  # noqa: E402
from mars_openhands.stream.events import ToolStart, now_stamps  # noqa: E402

BS = 16
BLOCK_BYTES = 1 << 20
WORK_S = 0.01
MARS = {"mars": {"residency": {"output_reserve_tokens": 0, "budget_usage": 1.0},
                 "retention": {"reload_linear_s_per_token": 0.01}}}


class _Run:
    """An in-process engine on a virtual clock, with the sessions' token streams."""

    def __init__(self, host_kv: HostKvParams | None) -> None:
        self.now_s = 0.0
        self.engine = InprocEngine("MarsScheduler", InprocEngineParams(
            num_gpu_blocks=40, max_model_len=4096, host_kv=host_kv, additional_config=MARS),
            clock=lambda: self.now_s)
        self.streams: dict[str, SessionTokenStream] = {}
        self.scheduled: dict[str, int] = {}
        """Request id -> its new prefix-hit tokens when first scheduled (GPU cache + host)."""

    def turn(self, session: str, rid: str, new_tokens: int, output_tokens: int) -> None:
        stream = self.streams.setdefault(session, self.engine.stream(session))
        stream.append(new_tokens)
        prompt = len(stream)
        stream.append(output_tokens)
        self.engine.add_request(rid, stream, prompt, output_tokens, arrival_time_s=self.now_s,
                                extra_args={"mars_turn": 0, "mars_last_step": 0})

    def step(self) -> bool:
        """One engine step (an empty step waits for the next copy); False once idle."""
        if not self.engine.has_work():
            return False
        record = self.engine.schedule()
        if record.is_empty:
            self.engine.update(record)
            done_s = self.engine.next_copy_done_s()
            if not record.loaded_ids and not math.isinf(done_s):
                self.now_s = max(self.now_s, done_s)
            return not math.isinf(done_s) or bool(record.loaded_ids)
        self.scheduled.update({k: v for k, v in record.new_request_cached_tokens.items()
                               if k not in self.scheduled})
        self.now_s += self.engine.step_s(WORK_S)
        self.engine.update(record)
        return True

    def run(self, num_steps: int = 10_000) -> None:
        for _ in range(num_steps):
            if not self.step():
                return


def _scenario(host_kv: HostKvParams | None) -> _Run:
    run = _Run(host_kv)
    s = run.engine.scheduler
    for _ in range(50):
        s.tool_durations.observe("ls", 2.0)
    run.turn("old", "old0", 25 * BS, 4)
    run.run()
    s.on_stream_event(ToolStart(**now_stamps(), source="t", session_id="old", turn=0, tool_name="ls",
                                tool_call_id="c"), run.now_s)
    run.now_s += 0.1
    run.turn("young", "young0", 20 * BS, 4)
    for _ in range(3):
        run.step()
    return run


def test_without_the_tier_mars_keeps_the_idle_resident_and_holds_the_newcomer() -> None:
    run = _scenario(None)
    s = run.engine.scheduler
    assert "young" in s.held and "old" in s.resident and "old" in s.retained


def test_with_the_tier_mars_displaces_the_idle_resident_and_its_resume_loads_from_the_host() -> None:
    run = _scenario(HostKvParams(size_gib=1.0, kv_bytes_per_block=BLOCK_BYTES))
    s = run.engine.scheduler
    assert "old" not in s.resident and "old" not in s.retained and "young" in s.resident
    run.run()  # young's turn ends; it stays resident across its own tool call
    run.turn("young", "young1", 1 * BS, 2)  # young grows: old's freed blocks are evicted for it
    run.run()
    run.now_s += 2.0  # old's tool returns
    run.turn("old", "old1", 1 * BS, 2)
    run.run()
    assert run.engine.host_kv is not None
    loads = [c for c in run.engine.host_kv.worker.history if c.direction is Direction.LOAD]
    assert loads, "old's resume found nothing on the host"
    assert run.scheduled["old1"] >= 24 * BS  # its stored prompt came back (GPU cache + host)


def test_the_scheduler_reads_the_tier_the_harness_configures() -> None:
    from mars_openhands.engine.harness.offload import params
    from mars_openhands.engine.schedulers import host_tier

    assert host_tier.EXTRA_CONFIG_KEY == params.EXTRA_CONFIG_KEY
    defaults = HostKvParams(size_gib=1.0)
    assert (host_tier.DEFAULT_H2D_GB_PER_S, host_tier.DEFAULT_COPY_SLOWDOWN) == (
        defaults.h2d_gb_per_s, defaults.copy_slowdown)
    tier = HostKvParams(size_gib=1.0, kv_bytes_per_block=BLOCK_BYTES, h2d_gb_per_s=25.0, copy_slowdown=2.0)
    reload = _Run(tier).engine.scheduler.host_reload
    assert reload is not None
    assert reload.load_s_per_block == pytest.approx(BLOCK_BYTES / 25e9) and reload.copy_slowdown == 2.0
    assert _Run(None).engine.scheduler.host_reload is None
    # The tier's capacity in GPU blocks (vLLM's cpu_bytes_to_use over one block), reported in
    # engine_step for the admission window; 0 without one.
    assert _Run(tier).engine.scheduler.num_host_blocks == 2**30 // BLOCK_BYTES
    assert _Run(tier).engine.num_host_blocks() == 2**30 // BLOCK_BYTES
    assert _Run(None).engine.scheduler.num_host_blocks == 0
