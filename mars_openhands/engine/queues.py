"""Waiting queues for the scheduler plugins (vLLM's ``RequestQueue`` contract).

vLLM's ``schedule()`` only peeks/pops the front, prepends requests it skipped or preempted, and
removes finished ones. Policies whose keys change over time (aging, session service) cannot live in
a heap with static keys, so :class:`PolicyRequestQueue` is a deque that the scheduler re-sorts once
per step, before ``super().schedule()``, with the policy's key (:meth:`PolicyRequestQueue.reorder`).

Mental model: between two ``reorder`` calls the queue behaves exactly like vLLM's
``FCFSRequestQueue`` (append at the back, prepend at the front). Each request also carries an order
number: increasing for ``add_request``, *decreasing negative* for ``prepend_request``; a policy key
may use it (the MARS preview puts prepended requests first, at level 0).

With ``is_priority_order`` (the user's ``--scheduling-policy priority``) it behaves like vLLM's
``PriorityRequestQueue`` instead: always sorted by ``(priority, arrival_time, request_id)``
(``Request.__lt__``), and a prepended request goes to its place in that order, not to the front.
"""

from __future__ import annotations

import bisect
import itertools
from collections import deque
from collections.abc import Callable, Iterable, Iterator
from typing import TYPE_CHECKING, Any

from vllm.v1.core.sched.request_queue import RequestQueue

if TYPE_CHECKING:
    from vllm.v1.request import Request

__all__ = ["PolicyRequestQueue"]


def _priority_order(request: Request) -> tuple[int, float, str]:
    """vLLM's priority order (``Request.__lt__``): smaller priority, then earlier arrival."""
    return (request.priority, request.arrival_time, request.request_id)


class PolicyRequestQueue(RequestQueue):
    """FCFS deque that can be stably re-sorted by a policy key once per step.

    Args:
        is_priority_order: keep the queue in vLLM's priority order (``--scheduling-policy
            priority``) instead of FCFS; the scheduler must then not :meth:`reorder` it.
    """

    def __init__(self, is_priority_order: bool = False) -> None:
        self.is_priority_order = is_priority_order
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
        """Append at the back (in priority order: insert at its place)."""
        self._order[request.request_id] = next(self._add_seq)
        self._insert(request, at_front=False)
        self.is_dirty = True

    def _insert(self, request: Request, at_front: bool) -> None:
        if self.is_priority_order:
            # after equal keys, as vLLM's heap keeps them (the key includes the request id)
            self._queue.insert(bisect.bisect_right(self._queue, _priority_order(request),
                                                   key=_priority_order), request)
        elif at_front:
            self._queue.appendleft(request)
        else:
            self._queue.append(request)

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
        """Put at the front (vLLM: a preempted or skipped request); in priority order, at its
        place (as vLLM's ``PriorityRequestQueue``)."""
        self._order[request.request_id] = next(self._prepend_seq)
        self._insert(request, at_front=True)

    def prepend_requests(self, requests: Iterable[Request]) -> None:
        """Prepend each of ``requests`` in turn, so they end up at the front in *reverse* order:
        vLLM's ``FCFSRequestQueue.prepend_requests`` is ``extendleft``, and ``schedule()``
        relies on it (it gathers the requests it skips with ``appendleft``, so prepending that
        deque restores their original order)."""
        for request in requests:
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

    def __getitem__(self, index: int) -> Request:
        """The request at ``index`` in queue order (vLLM's FCFS queue is a deque). Raises
        IndexError."""
        return self._queue[index]

    def __bool__(self) -> bool:
        return bool(self._queue)

    def __len__(self) -> int:
        return len(self._queue)

    def __iter__(self) -> Iterator[Request]:
        return iter(self._queue)
