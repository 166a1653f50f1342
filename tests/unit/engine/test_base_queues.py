"""PolicyRequestQueue: vLLM's RequestQueue contract plus stable per-step re-sorting."""

from __future__ import annotations

import pytest

pytest.importorskip("vllm")

from vllm.sampling_params import SamplingParams  # noqa: E402
from vllm.v1.request import Request  # noqa: E402

from mars_openhands.engine.queues import PolicyRequestQueue  # noqa: E402


def _req(rid: str, n: int = 4) -> Request:
    return Request(rid, list(range(n)), SamplingParams(max_tokens=1), None)


def test_fcfs_contract_and_order_numbers() -> None:
    q = PolicyRequestQueue()
    a, b, c, d = (_req(x) for x in "abcd")
    for r in (a, b, c):
        q.add_request(r)
    assert q.is_dirty and len(q) == 3 and bool(q) and q.peek_request() is a
    q.prepend_requests([d])
    assert [r.request_id for r in q] == ["d", "a", "b", "c"]
    assert q.order_of(d) < 0 < q.order_of(a) < q.order_of(b)
    q.remove_requests([b, _req("absent")])
    q.remove_request(c)
    assert q.pop_request() is d and q.pop_request() is a and not q
    with pytest.raises(IndexError):
        q.peek_request()
    with pytest.raises(IndexError):
        q.pop_request()


def test_reorder_is_stable_and_clears_dirty() -> None:
    q = PolicyRequestQueue()
    reqs = [_req(f"r{i}", n) for i, n in enumerate([30, 10, 30, 10])]
    for r in reqs:
        q.add_request(r)
    q.reorder(lambda r: r.num_prompt_tokens)
    assert [r.request_id for r in q] == ["r1", "r3", "r0", "r2"] and not q.is_dirty
    popped = q.pop_request()
    q.add_request(reqs[1].__class__("late", [1], SamplingParams(max_tokens=1), None))
    q.prepend_request(popped)  # vLLM re-queues a skipped request at the front
    assert q.peek_request() is popped and q.is_dirty


def test_prepend_requests_matches_vllm_fcfs_queue() -> None:
    """vLLM's FCFSRequestQueue.prepend_requests is ``extendleft`` (the iterable ends up at the
    front in reverse), and ``schedule()`` relies on it: it collects skipped requests with
    ``appendleft`` and prepends that deque, so they come back in their original order (issue 33:
    ours kept the deque's order, which reversed them)."""
    from vllm.v1.core.sched.request_queue import FCFSRequestQueue

    ours, stock = PolicyRequestQueue(), FCFSRequestQueue()
    reqs = {x: _req(x) for x in "abcdef"}
    for q in (ours, stock):
        for x in "ab":
            q.add_request(reqs[x])
        q.prepend_requests(reqs[x] for x in "cde")  # a one-shot iterable, as vLLM may pass
        q.prepend_request(reqs["f"])
    assert [r.request_id for r in ours] == [r.request_id for r in stock] == list("fedcab")
    assert ours[0] is stock[0] is reqs["f"] and ours[-1] is stock[-1] is reqs["b"]  # a deque's indexing
    # order numbers follow the queue: the most recently prepended first
    assert ours.order_of(reqs["f"]) < ours.order_of(reqs["e"]) < ours.order_of(reqs["c"]) < 0


def test_priority_order_matches_vllm_priority_queue() -> None:
    """``--scheduling-policy priority``: the queue keeps vLLM's ``PriorityRequestQueue`` order
    (priority, arrival, id), for added and prepended requests alike."""
    from vllm.v1.core.sched.request_queue import PriorityRequestQueue

    def req(rid: str, priority: int, arrival_s: float) -> Request:
        return Request(rid, [1, 2], SamplingParams(max_tokens=1), None, arrival_time=arrival_s,
                       priority=priority)

    ours, stock = PolicyRequestQueue(is_priority_order=True), PriorityRequestQueue()
    reqs = [req("a", 1, 1.0), req("b", 0, 2.0), req("c", 1, 0.5), req("d", -1, 3.0),
            req("e", 0, 2.0)]
    for q in (ours, stock):
        for r in reqs[:3]:
            q.add_request(r)
        q.prepend_request(reqs[3])
        q.prepend_requests(reqs[4:])
    assert [r.request_id for r in ours] == [r.request_id for r in stock] == list("dbeca")
    assert ours.pop_request().request_id == "d" and ours.peek_request().request_id == "b"
