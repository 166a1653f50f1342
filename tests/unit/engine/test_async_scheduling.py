"""Our schedulers under vLLM's async scheduling (issue 33, item 1).

Two kinds of test, both on :class:`~tests.unit.engine.async_engine.AsyncEngineLoop` (vLLM's
``step_with_batch_queue``: step ``N+1`` is scheduled before step ``N``'s output is applied):

* the race itself, built on purpose: a request of a resident ``mars`` session is preempted by KV
  pressure while its last token is in flight, so it finishes while mars holds it (residency);
  and a held request is aborted between ``schedule()`` and ``update_from_output``;
* the property over every shipped policy and ``SEEDS`` random workloads each
  (:mod:`tests.unit.engine.async_property`, which says what is checked);
  ``benchmarks/bench_async_property.py`` runs many more seeds.
"""

from __future__ import annotations

import pytest

pytest.importorskip("vllm")

from vllm.sampling_params import SamplingParams  # noqa: E402
from vllm.v1.request import Request, RequestStatus  # noqa: E402

from mars_openhands.engine import MarsPreviewScheduler, MarsScheduler  # noqa: E402
from mars_openhands.engine.schedulers.thunderagent import ThunderAgentScheduler  # noqa: E402
from mars_openhands.stream.transport import ListSink  # noqa: E402
from tests.unit.engine.async_engine import AsyncEngineLoop  # noqa: E402
from tests.unit.engine.async_property import (  # noqa: E402
    check_final,
    check_invariants,
    policy_names,
    run_seeds,
)
from tests.unit.engine.harness import Harness  # noqa: E402

SEEDS = 1000
"""Random workloads per policy in the unit suite (~10-40 ms each)."""
BS = 4


def _request(h: Harness, rid: str, sid: str | None, num_prompt: int, max_tokens: int,
             extra: dict | None = None) -> Request:
    params = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
    params.extra_args = extra
    return Request(rid, h.tokens(num_prompt), params, None, block_hasher=h.block_hasher,
                   session_id=sid)


def _finish_while_held(num_prompt_x: int, max_tokens: int) -> tuple[Harness, AsyncEngineLoop, dict]:
    """A session-less request ``x`` (older, outside residency) grows to 44 tokens, the whole
    pool of 11 blocks; the resident session ``b`` (younger: mars's victim) to 8 +
    ``max_tokens``. When ``x`` needs a block, ``b`` is preempted and held by residency, maybe
    with its last token in flight (``num_prompt_x`` shifts when ``x`` needs a block)."""
    h = Harness(MarsScheduler, num_blocks=12, block_size=BS, max_num_seqs=4,
                max_num_batched_tokens=32, mars={"residency": {"budget_usage": 1.0}})
    loop = AsyncEngineLoop(h.scheduler, lambda r: 11)
    requests = {"x": _request(h, "x", None, num_prompt_x, 44 - num_prompt_x),
                "b": _request(h, "b", "b", 8, max_tokens, {"mars_turn": 0, "mars_last_step": 1})}
    loop.add_request(requests["x"])
    loop.step()
    h.clock.advance(0.01)
    loop.add_request(requests["b"])

    def step() -> None:
        check_invariants(h.scheduler)
        h.clock.advance(0.01)

    loop.drain(500, on_step=step)
    return h, loop, requests


def test_a_request_preempted_with_its_last_token_in_flight_finishes_while_held() -> None:
    """mars + async scheduling: the held request is stopped by its in-flight token (vLLM only
    removes it from its own queues); it must leave mars's hold, not come back into ``waiting``
    (before the fix: ``RuntimeError: Invalid request status: FINISHED_LENGTH_CAPPED``)."""
    hits = []
    for num_prompt_x in range(24, 29):
        for max_tokens in range(3, 8):
            h, loop, requests = _finish_while_held(num_prompt_x, max_tokens)
            assert loop.finished == {"x": "length", "b": "length"}, loop.finished
            check_final(h, loop, requests)
            hits += loop.finished_while_held
    assert "b" in hits, "the race (a held request finished by its in-flight token) never happened"


@pytest.mark.parametrize("cls", [MarsScheduler, MarsPreviewScheduler, ThunderAgentScheduler])
def test_a_held_request_aborted_while_a_step_runs_leaves_its_hold(cls: type) -> None:
    """An abort that arrives between ``schedule()`` and ``update_from_output`` finishes a
    request our scheduler holds (residency, window overflow, paused program): vLLM's own abort
    path frees it, and it leaves the hold (the base's ``_free_request``)."""
    mars = {"window": {"enabled": True, "size": 1}} if cls is MarsPreviewScheduler else {}
    if cls is ThunderAgentScheduler:
        mars = {"thunderagent": {"buffer_per_program_tokens": 10_000}}  # every program waits
    h = Harness(cls, num_blocks=40, block_size=BS, max_num_seqs=4, max_num_batched_tokens=32,
                mars=mars)
    s = h.scheduler
    loop = AsyncEngineLoop(s, lambda r: 11)
    requests = {}
    for i in range(3):
        requests[f"r{i}"] = _request(h, f"r{i}", f"s{i}", 20, 6, {"mars_turn": 0})
        loop.add_request(requests[f"r{i}"])
    held = [r.request_id for r in s.held_requests()]
    assert held, f"{cls.__name__} holds none of the three requests"
    loop.step()
    loop.abort(held, during_next_step=True)
    loop.step()
    check_invariants(s)
    assert {r.request_id for r in s.held_requests()}.isdisjoint(held)
    assert all(loop.finished.get(rid) == "abort" for rid in held)
    for rid in requests:
        if rid not in loop.finished:
            loop.abort([rid])
    loop.drain(200, on_step=lambda: h.clock.advance(1.0))
    check_final(h, loop, requests)


def test_abort_of_everything_also_finishes_held_requests() -> None:
    """``finish_requests(None, ...)`` (vLLM: abort all) finishes the held ones too."""
    h = Harness(MarsScheduler, num_blocks=40, block_size=BS, max_num_seqs=4,
                max_num_batched_tokens=32, mars={"residency": {"budget_usage": 0.2}})
    s = h.scheduler
    for i in range(3):
        s.add_request(_request(h, f"r{i}", f"s{i}", 20, 6, {"mars_turn": 0}))
    s.schedule()
    assert s.held
    aborted = s.finish_requests(None, RequestStatus.FINISHED_ABORTED)
    assert sorted(r.request_id for r in aborted) == ["r0", "r1", "r2"]
    assert not s.held and not list(s.held_requests()) and not s.requests


def test_a_streaming_input_update_of_a_held_request_is_not_held_as_another_request() -> None:
    """vLLM streaming input (``resumable`` requests): the next input chunk arrives through
    ``add_request`` with the same id, and vLLM queues it on the live request. mars used to hold
    that update object too (a second request with the same id in its hold)."""
    h = Harness(MarsScheduler, num_blocks=40, block_size=BS, max_num_seqs=4,
                max_num_batched_tokens=32, mars={"residency": {"budget_usage": 0.05}})
    s = h.scheduler
    params = SamplingParams(max_tokens=4, ignore_eos=True)
    params.extra_args = {"mars_turn": 0}
    first = Request("r0", h.tokens(20), params, None, block_hasher=h.block_hasher,
                    session_id="s0", resumable=True)
    s.add_request(first)
    assert [r.request_id for r in s.held_requests()] == ["r0"]  # non-resident: held
    s.add_request(Request("r0", h.tokens(8), params, None, block_hasher=h.block_hasher,
                          session_id="s0", resumable=True))
    assert list(s.held_requests()) == [first] and len(first.streaming_queue) == 1
    check_invariants(s)


def test_a_prefix_cache_reset_releases_retained_kv_instead_of_raising() -> None:
    """``reset_prefix_cache(reset_running_requests=True)`` (``/reset_prefix_cache``, vLLM's
    ``pause_scheduler(clear_cache=True)`` after a weight update) with KV retained: our pins
    made vLLM's reset fail and raise; the retained KV is released ("reset") first."""
    h = Harness(MarsScheduler, num_blocks=64, pipeline_depth=2, mars={"residency": {"enabled": False}})
    s = h.scheduler
    sink = ListSink()
    s.set_telemetry_sink(sink, engine_steps=False)
    r0 = h.add(h.make_request("s1", h.tokens(100), 4, {"mars_turn": 0}))
    h.run_until_finished(r0.request_id)
    assert "s1" in s.retained
    r1 = h.add(h.make_request("s2", h.tokens(50), 20, {"mars_turn": 0}))
    h.step()
    h.step()
    assert s.reset_prefix_cache(reset_running_requests=True)
    assert not s.retained and r1.status == RequestStatus.PREEMPTED
    assert [e.reason for e in sink.events if e.kind == "kv_released"] == ["reset"]
    h.run_until_done()
    h.assert_no_leaks()


@pytest.mark.parametrize("policy", policy_names())
def test_async_scheduling_property(policy: str) -> None:
    """No scheduler call raises, every request finishes exactly once, nothing is left
    (:mod:`tests.unit.engine.async_property`), over ``SEEDS`` random workloads."""
    failures = run_seeds(policy, range(SEEDS))
    assert not failures, (f"{len(failures)}/{SEEDS} seeds failed for {policy}; first: "
                          + "; ".join(f"seed {f.seed}: {f.error}" for f in failures[:3]))
