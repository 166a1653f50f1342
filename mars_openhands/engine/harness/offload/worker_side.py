"""The worker side of vLLM's ``OffloadingConnector`` for engines without a model runner (the
in-process engine, the emulated executor): what vLLM's ``KVConnectorModelRunnerMixin`` does
around each forward pass, with :class:`~.spec.EmulatedOffloadingWorker` doing the copies.

Per engine step, in vLLM's order (``gpu_model_runner.execute_model`` and
``_get_kv_connector_output``): at the step's start ``handle_preemptions`` (flush a preempted
request's stores), ``bind_connector_metadata``, ``start_load_kv`` (submit the stores deferred from
the previous step, then this step's loads); at its end ``wait_for_save`` (defer this step's
stores), ``get_finished`` (copies done by the end), ``build_connector_worker_meta``. The
scheduler side then reads the :class:`KVConnectorOutput` in ``update_from_output``: a finished
load moves its request from ``WAITING_FOR_REMOTE_KVS`` back to the waiting queue.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
from vllm.distributed.kv_transfer.kv_connector.v1.offloading_connector import OffloadingConnector
from vllm.v1.outputs import KVConnectorOutput

from mars_openhands.engine.harness.offload.copies import slowed_step_s
from mars_openhands.engine.harness.offload.spec import (
    EmulatedOffloadingSpec,
    EmulatedOffloadingWorker,
)

__all__ = ["HostKvWorkerSide"]


class HostKvWorkerSide:
    """vLLM's worker-role ``OffloadingConnector`` over the emulated copies, on ``clock``.

    Args:
        vllm_config: the engine's config (its ``kv_transfer_config`` names our spec).
        kv_cache_config: the engine's KV cache config.
        clock: seconds now (virtual in the simulator).

    Raises:
        ValueError: the config's spec is not :class:`EmulatedOffloadingSpec`.
    """

    def __init__(self, vllm_config: Any, kv_cache_config: Any, clock: Callable[[], float]) -> None:
        self.connector = OffloadingConnector(vllm_config, KVConnectorRole.WORKER, kv_cache_config)
        connector_worker = self.connector.connector_worker
        assert connector_worker is not None
        spec = connector_worker.spec
        if not isinstance(spec, EmulatedOffloadingSpec):
            raise ValueError(f"the host KV tier needs spec_name EmulatedOffloadingSpec, got {type(spec).__name__}")
        # vLLM sets it in register_kv_caches from the GPU tensors; there are none to register.
        self.worker: EmulatedOffloadingWorker = spec.get_worker(None)
        self.worker.clock = clock
        self.worker.copies.now_s = clock()
        connector_worker.worker = self.worker
        self.params = spec.params

    def begin_step(self, scheduler_output: Any) -> None:
        """The step starts now: flush preempted stores, submit deferred stores and the loads.
        Mutates."""
        meta = scheduler_output.kv_connector_metadata
        assert meta is not None, "a scheduler with a KV connector always builds its metadata"
        self.connector.handle_preemptions(meta)
        self.connector.bind_connector_metadata(meta)
        self.connector.start_load_kv(None)

    def step_s(self, work_s: float) -> float:
        """Seconds the step takes: the flush wait, then ``work_s`` slowed while copies run
        (:func:`~.copies.slowed_step_s`). Call after :meth:`begin_step`. Mutates (takes the
        wait)."""
        stall_s = self.worker.take_stall_s()
        return stall_s + slowed_step_s(work_s, self.worker.busy_for_s(), self.params.copy_slowdown)

    def end_step(self, scheduler_output: Any) -> KVConnectorOutput:
        """The step ends now: defer its stores, report the copies done by now. Mutates."""
        self.connector.wait_for_save()
        sending, recving = self.connector.get_finished(scheduler_output.finished_req_ids)
        out = KVConnectorOutput(finished_sending=sending or None, finished_recving=recving or None,
                                kv_connector_worker_meta=self.connector.build_connector_worker_meta())
        self.connector.clear_connector_metadata()
        return out

    def next_done_s(self) -> float:
        """Clock time of the next copy's finish (``inf`` if none). Pure."""
        return self.worker.next_done_s()

    def is_busy(self) -> bool:
        """True while a copy is queued or running. Pure."""
        return self.worker.copies.is_busy()

    def is_idle(self) -> bool:
        """No copy queued or running and no flush wait still to charge to a step (:meth:`step_s`):
        a step now runs at full speed. Pure."""
        return not self.is_busy() and self.worker.stall_s == 0.0
