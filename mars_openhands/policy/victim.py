"""Priority-aligned preemption victims (MARS §4.3; the MARS preview's ``preempt_key``).

vLLM preempts by recompute: the victim's blocks are freed and it re-prefills later. The preview
evicts ``argmax (level', KV blocks, arrival)``: the lowest-priority request first, among equals
the one holding the most KV (frees the most per eviction), then the latest arrival; a decoding
request gets ``level' = -1`` so it is evicted last (its work is nearly done and latency-visible).
"""

from __future__ import annotations

from mars_openhands.policy.levels import DECODE_VICTIM_LEVEL

__all__ = ["victim_key"]


def victim_key(
    level: int, is_decode: bool, num_blocks: int, arrival_time_s: float
) -> tuple[int, int, float]:
    """Sort key of a running request; the *largest* key is preempted first. Pure.

    Args:
        level: the request's MLFQ level (larger = lower priority).
        is_decode: the prompt is fully computed.
        num_blocks: KV blocks the request holds (or an estimate).
        arrival_time_s: arrival time (any clock shared by all running requests).

    >>> sorted([victim_key(0, True, 90, 1.0), victim_key(2, False, 10, 2.0),
    ...         victim_key(2, False, 30, 0.5)], reverse=True)[0]
    (2, 30, 0.5)
    """
    return (DECODE_VICTIM_LEVEL if is_decode else level, num_blocks, arrival_time_s)
