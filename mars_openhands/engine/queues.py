"""Waiting queues for the scheduler plugins (vLLM's ``RequestQueue`` contract).

vLLM's ``schedule()`` only peeks/pops the front, prepends requests it skipped or preempted, and
removes finished ones. Policies whose keys change over time (aging, session service) cannot live in
a heap with static keys, so :class:`PolicyRequestQueue` is a deque that the scheduler re-sorts once
per step, before ``super().schedule()``, with the policy's key (:meth:`PolicyRequestQueue.reorder`).

Mental model: between two ``reorder`` calls the queue behaves exactly like vLLM's
``FCFSRequestQueue`` (append at the back, prepend at the front). Each request also carries an order
number: increasing for ``add_request``, *decreasing negative* for ``prepend_request``; a policy key
may use it (the MARS preview puts prepended requests first, at level 0).
"""

from __future__ import annotations

import itertools
from collections import deque
from collections.abc import Callable, Iterable, Iterator
from typing import TYPE_CHECKING, Any

from vllm.v1.core.sched.request_queue import RequestQueue

if TYPE_CHECKING:
    from vllm.v1.request import Request

__all__ = ["PolicyRequestQueue"]


class PolicyRequestQueue(RequestQueue):
    """FCFS deque that can be stably re-sorted by a policy key once per step."""

    def __init__(self) -> None:
        self._queue: deque[Request] = deque()
        self._order: dict[str, int] = {}
        self._add_seq = itertools.count(1)
        self._prepend_seq = itertools.count(-1, -1)
        self.is_dirty = False
        """True when a request was added since the last :meth:`reorder`."""

    def order_of(self, request: Request) -> int:
        """Order number: > 0 in arrival order for added requests, < 0 (most recent first) for
        prepended ones."""
        return self._order.get(request.request_id, 0)

    def reorder(self, key: Callable[[Request], Any]) -> None:
        """Stably sort the queue by ``key(request)`` (smallest first). Mutates."""
        if len(self._queue) > 1:
            self._queue = deque(sorted(self._queue, key=key))
        self.is_dirty = False

    def add_request(self, request: Request) -> None:
        """Append at the back."""
        self._order[request.request_id] = next(self._add_seq)
        self._queue.append(request)
        self.is_dirty = True

    def pop_request(self) -> Request:
        """Pop the front. Raises IndexError when empty."""
        request = self._queue.popleft()
        self._order.pop(request.request_id, None)
        return request

    def peek_request(self) -> Request:
        """The front without removing it. Raises IndexError when empty."""
        if not self._queue:
            raise IndexError("peek from an empty queue")
        return self._queue[0]

    def prepend_request(self, request: Request) -> None:
        """Put at the front (vLLM: a preempted or skipped request)."""
        self._order[request.request_id] = next(self._prepend_seq)
        self._queue.appendleft(request)

    def prepend_requests(self, requests: Iterable[Request]) -> None:
        """Put ``requests`` at the front, keeping their relative order (as vLLM's FCFS queue)."""
        for request in reversed(list(requests)):
            self.prepend_request(request)

    def remove_request(self, request: Request) -> None:
        """Remove one request (no error if absent)."""
        self.remove_requests((request,))

    def remove_requests(self, requests: Iterable[Request]) -> None:
        """Remove several requests (absent ones are ignored, as in vLLM's FCFS queue)."""
        ids = {r.request_id for r in requests}
        if not ids:
            return
        self._queue = deque(r for r in self._queue if r.request_id not in ids)
        for rid in ids:
            self._order.pop(rid, None)

    def __bool__(self) -> bool:
        return bool(self._queue)

    def __len__(self) -> int:
        return len(self._queue)

    def __iter__(self) -> Iterator[Request]:
        return iter(self._queue)
