"""Prefill chunk sizing: the per-request chunk hook vLLM calls for every chunk it sizes.

Source: design.md §2 (chunk sizing). vLLM routes each chunk through
``_mamba_block_aligned_split`` once ``seams.hooks.enable_chunk_hook`` turned its flag on; the
hook applies the policy's cap (``chunk_tokens``, e.g. an MLFQ level's quantum:
:meth:`ChunkSizing.cap_chunk_at_quantum`), scales it by a merged run's steps
(:mod:`.coalesce`), shrinks it to fit the free blocks (``chunk_shrinking``) and holds back a
preempted request until its whole context fits (``resume_when_context_fits``). A mixin of
:class:`~.base.MarsBaseScheduler` that reads its switches and per-step state.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from vllm.v1.request import RequestStatus

from mars_openhands.engine import seams
from mars_openhands.policy.chunking import (
    blocks_for_tokens,
    context_fits,
    shrunk_chunk_tokens,
    unsplit_mm_chunk_tokens,
)
from mars_openhands.policy.levels import quantum_tokens

if TYPE_CHECKING:
    from vllm.v1.request import Request

__all__ = ["ChunkSizing"]



class ChunkSizing:
    """Mixin of :class:`~.base.MarsBaseScheduler`: the chunk hook and its parts (module
    docstring). Must come before vLLM's ``Scheduler`` in the MRO (it overrides its split)."""

    def _mamba_block_aligned_split(
        self, request: Request, num_new_tokens: int,
        num_new_local_computed_tokens: int = 0, num_external_computed_tokens: int = 0,
        **kwargs: Any,
    ) -> int:
        """vLLM seam used as the per-request chunk hook (policy quantum, then shrink-to-fit).

        vLLM's own Mamba split runs first when the model needs it, and whenever the class has no
        chunk hook (then only vLLM sets the flag that routes chunks here)."""
        is_vllm_split = self._model_needs_mamba_split or not self._uses_chunk_hook
        if num_new_tokens <= 1 and not is_vllm_split:
            return num_new_tokens  # a decode (or a 1-token remainder): nothing to shape
        if is_vllm_split:
            num_new_tokens = super()._mamba_block_aligned_split(
                request, num_new_tokens, num_new_local_computed_tokens,
                num_external_computed_tokens, **kwargs)
            if num_new_tokens == 0:
                return 0
        start = request.num_computed_tokens + num_new_local_computed_tokens + num_external_computed_tokens
        if start >= max(request.num_prompt_tokens, request.num_tokens - 1):
            return num_new_tokens  # decode: one token, nothing to shape
        waiting = num_new_local_computed_tokens > 0 or request.status != RequestStatus.RUNNING
        if (waiting and request.num_preemptions and self.resume_when_context_fits
                and not self._can_resume(request)):
            return 0  # vLLM admits nothing more this step; the request stays first in line
        self._step_prefills.append(request.request_id)
        n = self.chunk_tokens(request, num_new_tokens, start) * self._call_steps
        if self.chunk_shrinking:
            n = self._shrink_to_fit(request, n, start, waiting=waiting)
        n = max(1, min(n, num_new_tokens))
        if n < num_new_tokens and request.mm_features and seams.hooks.is_chunked_mm_input_disabled(self):
            # vLLM's no-split check trusts its own chunk to cover an item it starts on
            n = unsplit_mm_chunk_tokens(n, num_new_tokens, start, (
                (f.mm_position.offset, f.mm_position.length) for f in request.mm_features))
        return n

    def _can_resume(self, request: Request) -> bool:
        """Whether a preempted waiting ``request`` may resume now: its whole context fits in the
        free blocks (its own cached prefix is among them, so it counts) beside the rest of the
        prompts already running (or admitted earlier in this step), or nothing runs (then
        nothing would free more room). Pure; O(running).

        Why: vLLM admits a request when its first chunk fits; two preempted long requests
        resumed together into the room finished requests left, and one was preempted again
        midway through its re-prefill, losing that work too (issue 16 kind 4). ::

            |<------------- request.num_tokens (prompt + outputs so far) ------------->|
            |<- cached (free, ref 0) ->|<------------- still to compute --------------->|
            blocks(num_tokens)  <=  free + reclaimable retained - watermark
                                    - sum over running r of (blocks(r.num_tokens) - blocks r holds)
        """
        if not self.running:
            return True
        bs = self.block_size
        unallocated = sum(max(0, blocks_for_tokens(r.num_tokens, bs) - seams.blocks.num_request_blocks(self, r.request_id))
                          for r in self.running)
        avail = (seams.blocks.num_free_blocks(self) + self._reclaimable_blocks(request)
                 - seams.blocks.watermark_blocks(self) - unallocated)
        return context_fits(request.num_tokens, bs, avail)

    def _shrink_to_fit(self, request: Request, n: int, start: int, waiting: bool) -> int:
        """Halve a prefill chunk (not below block_size) until its new blocks fit
        (:func:`~mars_openhands.policy.chunking.shrunk_chunk_tokens`, which has the diagram)."""
        bs = self.block_size
        held = 0 if waiting else seams.blocks.num_request_blocks(self, request.request_id)
        avail = seams.blocks.num_free_blocks(self) + self._reclaimable_blocks(request)
        if waiting:
            avail -= seams.blocks.watermark_blocks(self)
        return shrunk_chunk_tokens(n, start, bs, max(held, start // bs), avail)

    def cap_chunk_at_quantum(self, request: Request, level: int, num_new_tokens: int,
                             quanta_tokens: tuple[int, ...] | None = None) -> int:
        """Cap a prefill chunk at `level`'s MLFQ token quantum and remember the quantum.

        Shared by the MLFQ policies (MARS, MARS-preview); returns tokens, <= `num_new_tokens`.
        ``quanta_tokens`` overrides ``params.levels.quanta_tokens``.
        Mutates: ``self.req_state[request_id].quantum_tokens``.
        """
        quantum = quantum_tokens(level, self.params.levels, seams.hooks.max_num_scheduled_tokens(self),
                                 quanta_tokens)
        state = self.req_state.get(request.request_id)
        if state is not None:
            state.quantum_tokens = quantum
        return min(num_new_tokens, quantum)

    def _step_prefill_tokens(self, out: Any) -> int:
        """Prefill tokens scheduled in this step (the chunks that passed the chunk hook)."""
        if not self._step_prefills:
            return 0
        scheduled = out.num_scheduled_tokens
        return sum(scheduled.get(rid, 0) for rid in self._step_prefills)
