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

from collections.abc import Iterable

__all__ = ["blocks_for_tokens", "context_fits", "shrunk_chunk_tokens", "unsplit_mm_chunk_tokens"]


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


def unsplit_mm_chunk_tokens(num_tokens: int, max_tokens: int, start_tokens: int,
                            mm_ranges: Iterable[tuple[int, int]]) -> int:
    """A policy-capped prefill chunk moved off any multimodal item it would split. Pure.

    vLLM's ``disable_chunked_mm_input`` (which vLLM forces for models whose encoder attention
    needs a whole image) rolls a chunk back to before an item it would end inside, but only when
    the chunk starts before that item: it counts on its own budget (>= the largest item, checked
    at start-up) to cover an item the chunk starts on. A policy's cap (a quantum, a shrunk chunk)
    breaks that (issue 33: Autellix scheduled 624 of an 800-token image). So a capped chunk that
    would end inside an item ``[offset, offset + length)``

    * stops before it when the item starts after the chunk (vLLM's own roll-back), else
    * covers the whole item (the chunk starts on it), up to ``max_tokens`` (vLLM's uncapped
      chunk, which vLLM then treats as it would without the cap). ::

        |<- start ->|<-- capped chunk -->|
                    |   [==== item ====]            -> ends before the item
                    [==== item ====]                 -> extended to the item's end

    Args:
        num_tokens: the policy's chunk, tokens (>= 1).
        max_tokens: vLLM's chunk before the policy's cap, tokens (>= ``num_tokens``).
        start_tokens: tokens before the chunk (computed + prefix hit).
        mm_ranges: ``(offset, length)`` of each multimodal item in the prompt, tokens.

    Returns:
        The chunk, tokens (>= 1 when ``num_tokens`` >= 1).

    >>> unsplit_mm_chunk_tokens(624, 800, 400, [(400, 800)])   # starts on the image: whole image
    800
    >>> unsplit_mm_chunk_tokens(500, 1024, 0, [(400, 800)])    # would end inside: stop before it
    400
    >>> unsplit_mm_chunk_tokens(300, 1024, 0, [(400, 800)])    # ends before it: unchanged
    300
    """
    end = start_tokens + num_tokens
    for offset, length in sorted(mm_ranges):
        item_end = offset + length
        if not start_tokens < item_end or not offset < end < item_end:
            continue  # the item is done, or the chunk does not end inside it
        if offset > start_tokens:
            return offset - start_tokens
        return min(max_tokens, item_end - start_tokens)
    return num_tokens
