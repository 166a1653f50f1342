"""``EmulatedOffloadingSpec``: vLLM's CPU offloading spec with emulated copies (vLLM's public
``spec_module_path`` plug point; no fork).

The scheduler side is vLLM's own, inherited unchanged from ``CPUOffloadingSpec``: the
``CPUOffloadingManager`` (LRU or ARC, ``store_threshold``, its ``cache_policy_module_path``) over
``num_chunks`` host chunks. Only the worker differs: ``CPUOffloadingSpec.get_worker`` needs CUDA
(it raises on the CPU build), so :meth:`EmulatedOffloadingSpec.get_worker` returns an
:class:`EmulatedOffloadingWorker`, which moves no bytes and finishes each copy after ``bytes /
bandwidth`` on a clock the caller sets (:class:`~.copies.CopyStreams`).

Host capacity: ``num_chunks = floor(cpu_bytes_to_use / (kv_bytes_per_block × blocks_per_chunk))``
as vLLM computes it, with the model's block bytes (:attr:`HostKvParams.kv_bytes_per_block`) when the
engine's own KV cache is a stand-in (the simulator's), else vLLM's padded chunk size.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

from vllm.v1.kv_offload.base import (
    CanonicalKVCaches,
    GPULoadStoreSpec,
    LoadStoreSpec,
    OffloadingWorker,
    TransferResult,
)
from vllm.v1.kv_offload.config import OffloadingConfig
from vllm.v1.kv_offload.cpu.spec import CPUOffloadingSpec

from mars_openhands.engine.harness.offload.copies import GB, CopyDone, CopyStreams, Direction
from mars_openhands.engine.harness.offload.params import EXTRA_CONFIG_KEY, HostKvParams

__all__ = ["EmulatedOffloadingSpec", "EmulatedOffloadingWorker"]


class EmulatedOffloadingWorker(OffloadingWorker):
    """vLLM's ``OffloadingWorker`` contract with emulated copies.

    Args:
        params: bandwidths of the host tier.
        bytes_per_block: bytes one GPU block's copy moves.
        clock: seconds now (the simulator's virtual clock; default ``time.monotonic``). Set
            :attr:`clock` before the first copy.
    """

    def __init__(self, params: HostKvParams, bytes_per_block: int,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.params = params
        self.bytes_per_block = bytes_per_block
        self.clock = clock
        self.copies = CopyStreams(params.d2h_gb_per_s * GB, params.h2d_gb_per_s * GB,
                                  params.duplex_gb_per_s * GB, now_s=clock())
        self.stall_s = 0.0
        """Seconds the engine waited in :meth:`wait` since the last :meth:`take_stall_s`."""
        self.num_bytes = {Direction.STORE: 0, Direction.LOAD: 0}
        """Bytes submitted per direction so far."""
        self.history: list[CopyDone] = []
        """Every finished copy, in finishing order (tests, the fidelity benchmark)."""

    def _submit(self, direction: Direction, job_id: int, gpu_spec: GPULoadStoreSpec) -> bool:
        num_bytes = len(gpu_spec.block_ids) * self.bytes_per_block
        self.num_bytes[direction] += num_bytes
        self.copies.submit(direction, job_id, num_bytes, self.clock())
        return True

    def submit_store(self, job_id: int, src_spec: GPULoadStoreSpec, dst_spec: LoadStoreSpec) -> bool:
        """GPU → host: queue the copy of ``src_spec``'s blocks. Mutates."""
        return self._submit(Direction.STORE, job_id, src_spec)

    def submit_load(self, job_id: int, src_spec: LoadStoreSpec, dst_spec: GPULoadStoreSpec) -> bool:
        """Host → GPU: queue the copy into ``dst_spec``'s blocks. Mutates."""
        return self._submit(Direction.LOAD, job_id, dst_spec)

    def get_finished(self) -> list[TransferResult]:
        """Copies finished by the clock now, once each. Mutates."""
        self.copies.advance(self.clock())
        done = self.copies.take_done()
        self.history.extend(done)
        return [TransferResult(d.job_id, True, d.num_bytes, d.done_s - d.submit_s) for d in done]

    def wait(self, job_ids: set[int]) -> None:
        """Block until ``job_ids`` finish (vLLM flushes a preempted request's stores before its
        blocks are reused): the copies run on, and the wait is charged to the engine's step
        (:meth:`take_stall_s`). Mutates."""
        now_s = self.clock()
        self.copies.advance(now_s)
        until_s = max([now_s, *(self.copies.done_s(j) for j in job_ids)])
        self.copies.advance(until_s)
        self.stall_s += until_s - now_s

    def take_stall_s(self) -> float:
        """Seconds waited in :meth:`wait` since the last call. Mutates."""
        out, self.stall_s = self.stall_s, 0.0
        return out

    def busy_for_s(self) -> float:
        """Seconds from the clock now until every queued copy finishes (0 if idle). Pure."""
        now_s = max(self.clock(), self.copies.now_s)
        return max(0.0, self.copies.busy_until_s() - now_s) if self.copies.is_busy() else 0.0

    def next_done_s(self) -> float:
        """Clock time of the next copy's finish (``inf`` if none). Pure."""
        return self.copies.next_done_s()


class EmulatedOffloadingSpec(CPUOffloadingSpec):
    """``CPUOffloadingSpec`` whose worker emulates the copies (module docstring).

    ``kv_connector_extra_config[EXTRA_CONFIG_KEY]`` holds :class:`HostKvParams`.

    Raises:
        ValueError: the extra config lacks :data:`EXTRA_CONFIG_KEY`.
    """

    def __init__(self, config: OffloadingConfig) -> None:
        super().__init__(config)
        raw: Any = self.extra_config.get(EXTRA_CONFIG_KEY)
        if raw is None:
            raise ValueError(f"kv_connector_extra_config needs {EXTRA_CONFIG_KEY!r} (HostKvParams) "
                             "for the emulated offloading spec; build it with HostKvParams.extra_config()")
        self.params = HostKvParams.model_validate(raw)
        self.bytes_per_gpu_block = (self.params.kv_bytes_per_block
                                    or config.worker_kv_bytes_per_block)
        if self.params.kv_bytes_per_block is not None:
            chunk = self.params.kv_bytes_per_block * self.blocks_per_chunk
            self.kv_bytes_per_chunk = chunk
            self.num_chunks = int(self.extra_config["cpu_bytes_to_use"]) // chunk
        self._emulated_worker: EmulatedOffloadingWorker | None = None

    def get_worker(self, kv_caches: CanonicalKVCaches | None) -> EmulatedOffloadingWorker:
        """The emulated worker (one per spec; ``kv_caches`` is not read: no bytes move)."""
        if self._emulated_worker is None:
            self._emulated_worker = EmulatedOffloadingWorker(self.params, self.bytes_per_gpu_block)
        return self._emulated_worker
