"""Prefill chunk sizing against free KV (MARS preview's chunk shrinking; issue 16 kind 4).

Mental model: vLLM admits a prefill chunk when its blocks fit, and preempts someone when they do
not. Two rules keep that from wasting work. *Shrinking* (the MARS preview): before any
preemption, halve a chunk (never below one block) until its new blocks fit. *Whole-context
resume*: a preempted request resumes only when its whole context fits beside the prompts already
running, so it is not preempted again midway through its re-prefill. Both are block arithmetic on
counts the scheduler reads from vLLM (:mod:`mars_openhands.engine.seams`); nothing here reads
vLLM.

Region diagram of one chunk (tokens)::

    |<--- start (computed + hit) --->|<--- n (this chunk) --->|
    |<- covered blocks ->|           |<- need new blocks ---->|
"""

from __future__ import annotations

__all__ = ["blocks_for_tokens", "context_fits", "shrunk_chunk_tokens"]


def blocks_for_tokens(num_tokens: int, block_size: int) -> int:
    """Blocks that hold ``num_tokens`` tokens (ceiling division). Pure.

    >>> blocks_for_tokens(0, 16), blocks_for_tokens(1, 16), blocks_for_tokens(32, 16)
    (0, 1, 2)
    """
    return -(-num_tokens // block_size)


def shrunk_chunk_tokens(num_tokens: int, start_tokens: int, block_size: int,
                        num_covered_blocks: int, num_available_blocks: int) -> int:
    """Halve a prefill chunk (not below ``block_size``) until its new blocks fit. Pure.

    Args:
        num_tokens: the chunk the policy chose, tokens (>= 1).
        start_tokens: tokens before the chunk (computed + prefix hit).
        block_size: tokens per KV block.
        num_covered_blocks: blocks the request already has for its context.
        num_available_blocks: blocks it may still get (free + reclaimable, minus the watermark
            for a waiting request); may be negative.

    Returns:
        Tokens, ``<= num_tokens``; a chunk of ``block_size`` or less is returned as is even if
        it does not fit (vLLM then preempts or waits, as it would).

    >>> shrunk_chunk_tokens(1024, 0, 16, 0, 20)  # 64 blocks -> 32 -> 16 fits in 20
    256
    >>> shrunk_chunk_tokens(8, 0, 16, 0, 0)
    8
    """
    n = num_tokens
    while n > block_size and blocks_for_tokens(start_tokens + n, block_size) - num_covered_blocks > num_available_blocks:
        n = max(block_size, n // 2)
    return n


def context_fits(num_tokens: int, block_size: int, num_available_blocks: int) -> bool:
    """Whether a whole context of ``num_tokens`` fits in ``num_available_blocks``. Pure.

    ``num_available_blocks``: free + reclaimable retained - watermark - the blocks the running
    requests still need for their own contexts (may be negative)::

        blocks(num_tokens)  <=  free + reclaimable retained - watermark
                                - sum over running r of (blocks(r.num_tokens) - blocks r holds)

    >>> context_fits(160, 16, 10), context_fits(161, 16, 10)
    (True, False)
    """
    return blocks_for_tokens(num_tokens, block_size) <= num_available_blocks
