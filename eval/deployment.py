"""The deployment a comparison stands for: the model profile (with its own weight dtype), the KV
cache dtype and vLLM's ``--gpu-memory-utilization`` (issue 31, item 1).

These three settings decide the KV pool, and the KV pool decides capacity at SLO more than most
differences between policies: on an H100 SXM with Qwen3-Coder-30B-A3B, ``--gpu-memory-utilization
0.95`` gives 10,127 KV blocks instead of 7,396 (+37%) and ``--kv-cache-dtype fp8`` 14,793 (2×).
``compare`` takes them as flags (:func:`add_deployment_flags`), resolves them once into a frozen
:class:`Deployment`, and from there builds every GPU's profile (KV blocks,
:func:`mars_openhands.engine.harness.executor.profiles.estimate_kv_capacity`) and step-time model
(:class:`eval.sweep_options.ProfileTimer`); :meth:`Deployment.describe` is the sentence every
report's scope line ends with.

Mental model: a deployment is a *model profile key plus two vLLM settings*; the GPU varies within
one report, the deployment does not. Without the flags it is the harness's one configuration so
far (Qwen3-Coder-30B-A3B, bf16 weights and KV, 0.9), and every number stays what it was.

Region diagram of one GPU's memory under vLLM (aiconfigurator's memory model)::

    | weights | activations + runtime | KV pool            | left to other processes   |
    |<------------ gpu_memory_utilization × memory ------->|<-- (1 - utilization) × mem ->|
    KV blocks = floor(KV pool bytes / (bytes_per_token × 16)); bytes_per_token halves with fp8
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from mars_openhands.engine.harness.executor.profiles import KV_CACHE_DTYPES, MODELS, GpuProfile

if TYPE_CHECKING:  # eval.sweep_options imports pandas, which `openhands bench`'s env may lack
    from eval.sweep_options import ProfileTimer

__all__ = [
    "DEFAULT_GPU_MEMORY_UTILIZATION",
    "DEFAULT_MODEL",
    "Deployment",
    "add_deployment_flags",
    "deployment_from_args",
    "memory_fraction",
    "parse_model",
]

DEFAULT_MODEL = "qwen3-coder-30b-a3b-instruct"
"""The model of the bundled traces' deployment (design.md §9)."""
DEFAULT_GPU_MEMORY_UTILIZATION = 0.9
"""vLLM's default ``--gpu-memory-utilization`` (``CacheConfig.gpu_memory_utilization``)."""
_PREFERRED_DTYPE = "bf16"
"""The weight dtype a bare model name means when the model has several (``qwen3-30b-a3b``)."""
_KV_DTYPE_OF_BYTES = {bytes_: name for name, (bytes_, _) in KV_CACHE_DTYPES.items()}


def _model_choices() -> str:
    """``name[/dtype]`` of every model profile, for error messages. Pure."""
    names = sorted({name for name, _ in MODELS})
    return ", ".join(f"{n} ({'/'.join(sorted(d for m, d in MODELS if m == n))})" for n in names)


def parse_model(text: str) -> tuple[str, str]:
    """``--model``'s value as a model profile key ``(name, weight dtype)``. Pure.

    ``NAME`` takes the model's only weight dtype, or bf16 where it has several
    (``gpt-oss-120b`` → mxfp4, ``qwen3-30b-a3b`` → bf16); ``NAME/DTYPE`` names one
    (``qwen3-30b-a3b/fp8``).

    Raises:
        ValueError: an unknown name or dtype; the message starts with ``--model`` and lists
            every model with its dtypes.
    """
    name, _, dtype = text.strip().partition("/")
    dtypes = sorted(d for m, d in MODELS if m == name)
    if not dtypes:
        raise ValueError(f"--model: unknown model {text!r}; choose one of {_model_choices()}")
    if not dtype:
        dtype = _PREFERRED_DTYPE if _PREFERRED_DTYPE in dtypes else dtypes[0]
    if (name, dtype) not in MODELS:
        raise ValueError(f"--model: {name} has no {dtype!r} weights; choose one of "
                         f"{', '.join(f'{name}/{d}' for d in dtypes)}")
    return name, dtype


def memory_fraction(text: str) -> float:
    """An ``argparse`` type: a fraction in (0, 1] (``--gpu-memory-utilization``).

    Raises:
        argparse.ArgumentTypeError: not a number, or outside (0, 1].
    """
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a fraction in (0, 1], got {text!r}") from None
    if not 0.0 < value <= 1.0:  # nan fails this too
        raise argparse.ArgumentTypeError(f"expected a fraction in (0, 1] of the GPU's memory "
                                         f"(vLLM's default {DEFAULT_GPU_MEMORY_UTILIZATION}), got {text!r}")
    return value


@dataclass(frozen=True)
class Deployment:
    """One deployment: model profile, KV cache dtype, memory utilization. Frozen, picklable.

    Attributes:
        model: model profile name (a name of ``MODELS``).
        dtype: its weight dtype key (with ``model``, a key of ``MODELS``).
        kv_cache_dtype: ``"bf16"``/``"fp8"`` where it differs from the model's own KV dtype,
            else ``None`` (so an explicit ``--kv-cache-dtype bf16`` is the default run, cache
            keys included).
        gpu_memory_utilization: fraction of the GPU's memory vLLM may use, in (0, 1].
    """

    model: str = DEFAULT_MODEL
    dtype: str = "bf16"
    kv_cache_dtype: str | None = None
    gpu_memory_utilization: float = DEFAULT_GPU_MEMORY_UTILIZATION

    def profile(self, gpu: str) -> GpuProfile:
        """The :class:`GpuProfile` of this deployment on ``gpu``.

        Raises:
            pydantic.ValidationError: an unknown ``gpu`` (check it first).
        """
        return GpuProfile(gpu=gpu, model=self.model, dtype=self.dtype, kv_cache_dtype=self.kv_cache_dtype,
                          gpu_memory_utilization=self.gpu_memory_utilization)

    def timer(self, gpu: str) -> ProfileTimer:
        """The picklable step-time model of this deployment on ``gpu`` (memory does not enter it)."""
        from eval.sweep_options import ProfileTimer  # pandas: see the import above

        return ProfileTimer(gpu, self.model, self.dtype, self.kv_cache_dtype)

    @property
    def kv_dtype(self) -> str:
        """The KV cache dtype in effect (``"bf16"`` or ``"fp8"``): the flag's, else the model's."""
        if self.kv_cache_dtype is not None:
            return self.kv_cache_dtype
        return _KV_DTYPE_OF_BYTES[MODELS[(self.model, self.dtype)].kv_dtype_bytes]

    @property
    def kv_bytes_per_token(self) -> int:
        """KV bytes per token on one GPU (TP 1); the same on every GPU profile."""
        return self.profile("h100_sxm").kv_bytes_per_token

    def describe(self) -> str:
        """The sentence every report's scope line ends with. Pure.

        Example:
            >>> Deployment().describe()
            'Deployment: qwen3-coder-30b-a3b-instruct (bf16 weights), KV cache bf16 (96 KiB/token), gpu-memory-utilization 0.9.'
        """
        return (f"Deployment: {self.model} ({self.dtype} weights), KV cache {self.kv_dtype} "
                f"({self.kv_bytes_per_token / 1024:g} KiB/token), gpu-memory-utilization "
                f"{self.gpu_memory_utilization:g}.")

    def facts(self) -> dict[str, Any]:
        """The deployment as ``run.json`` / ``summary.md`` facts (name → value). Pure."""
        return {"model": f"{self.model}/{self.dtype}", "kv cache dtype": self.kv_dtype,
                "kv bytes per token": self.kv_bytes_per_token,
                "gpu memory utilization": self.gpu_memory_utilization}


def add_deployment_flags(parser: argparse.ArgumentParser) -> None:
    """Add ``--model``, ``--kv-cache-dtype`` and ``--gpu-memory-utilization`` to ``parser``."""
    parser.add_argument(
        "--model", default=DEFAULT_MODEL, metavar="NAME[/DTYPE]",
        help=f"model profile, NAME or NAME/WEIGHT_DTYPE (default {DEFAULT_MODEL}); one of "
             f"{_model_choices()}. A bare NAME takes its bf16 weights, or its only dtype "
             "(gpt-oss-120b: mxfp4 experts, bf16 attention and KV)")
    parser.add_argument(
        "--kv-cache-dtype", choices=tuple(KV_CACHE_DTYPES), default=None,
        help="vLLM's --kv-cache-dtype (default: the model's own, bf16 but for qwen3-30b-a3b/fp8). fp8 "
             "halves the KV bytes per token (Qwen3-Coder 96 -> 48 KiB), so the same memory holds 2x the "
             "tokens; step times use aiconfigurator's measured fp8-KV attention kernels (vLLM 0.24.0, "
             "H100/H200 SXM: decode at long contexts faster, prefill a few percent slower). Accuracy "
             "loss of fp8 KV is not modelled")
    parser.add_argument(
        "--gpu-memory-utilization", type=memory_fraction, default=DEFAULT_GPU_MEMORY_UTILIZATION, metavar="F",
        help=f"vLLM's --gpu-memory-utilization, in (0, 1] (default {DEFAULT_GPU_MEMORY_UTILIZATION}, "
             "vLLM's): the share of the GPU's memory for weights, activations and KV; the KV pool is "
             "what is left of it (H100 SXM, Qwen3-Coder bf16: 7,396 blocks at 0.9, 10,127 at 0.95)")


def deployment_from_args(args: argparse.Namespace) -> Deployment:
    """The :class:`Deployment` of the parsed flags (``model``, ``kv_cache_dtype``,
    ``gpu_memory_utilization``). Pure.

    Raises:
        ValueError: see :func:`parse_model`.
    """
    model, dtype = parse_model(args.model)
    own = _KV_DTYPE_OF_BYTES[MODELS[(model, dtype)].kv_dtype_bytes]
    kv = args.kv_cache_dtype if args.kv_cache_dtype not in (None, own) else None
    return Deployment(model, dtype, kv, args.gpu_memory_utilization)
