"""Unit tests for the tiny local model writer (no server, no vllm import needed)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from mars_openhands.engine.harness.tiny_model import (
    BOS_TOKEN_ID,
    EOS_TOKEN_ID,
    NUM_BYTE_TOKENS,
    VOCAB_SIZE,
    build_tokenizer,
    tiny_model_config,
    write_tiny_model,
)

TOKENIZER = build_tokenizer()


@settings(max_examples=300, deadline=None)
@given(st.text())
def test_any_text_round_trips_one_token_per_utf8_byte(text: str) -> None:
    ids = TOKENIZER.encode(text).ids
    assert ids[0] == BOS_TOKEN_ID
    # Special-token strings inside the text become their special ids, so compare the
    # decoded text with special tokens kept.
    assert TOKENIZER.decode(ids[1:], skip_special_tokens=False) == text


@settings(max_examples=200, deadline=None)
@given(st.binary())
def test_every_byte_is_its_own_token(data: bytes) -> None:
    # Ids 0..255 are byte values; decoding them yields the bytes back (as UTF-8 text
    # when valid, with U+FFFD replacement otherwise).
    decoded = TOKENIZER.decode(list(data))
    assert decoded == data.decode("utf-8", errors="replace")


def test_plain_text_encodes_to_its_utf8_bytes_after_bos() -> None:
    text = "héllo, MARS 🙂\n\t"
    assert TOKENIZER.encode(text).ids == [BOS_TOKEN_ID, *text.encode("utf-8")]


def test_special_tokens_have_fixed_ids_and_vocab_matches_config() -> None:
    assert TOKENIZER.get_vocab_size() == VOCAB_SIZE
    assert TOKENIZER.token_to_id("<bos>") == BOS_TOKEN_ID == NUM_BYTE_TOKENS
    assert TOKENIZER.token_to_id("<eos>") == EOS_TOKEN_ID
    assert TOKENIZER.decode([104, 105, EOS_TOKEN_ID]) == "hi"  # specials skipped by default


def test_config_fields_follow_arguments() -> None:
    cfg = tiny_model_config(num_layers=3, hidden_size=128, max_position_embeddings=1024)
    assert cfg["architectures"] == ["LlamaForCausalLM"]
    assert cfg["num_hidden_layers"] == 3
    assert cfg["hidden_size"] == 128
    assert cfg["head_dim"] == 128 // cfg["num_attention_heads"]
    assert cfg["max_position_embeddings"] == 1024
    assert cfg["vocab_size"] == VOCAB_SIZE
    assert (cfg["bos_token_id"], cfg["eos_token_id"]) == (BOS_TOKEN_ID, EOS_TOKEN_ID)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"num_layers": 0}, "num_layers"),
        ({"hidden_size": 65}, "multiple of num_attention_heads"),
        ({"num_attention_heads": 4, "num_key_value_heads": 3}, "num_key_value_heads"),
        ({"hidden_size": 48, "num_attention_heads": 2}, "head size"),
    ],
)
def test_bad_shapes_raise_with_the_value(kwargs: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        tiny_model_config(**kwargs)


def test_written_dir_is_complete_and_deterministic(tmp_path: Path) -> None:
    a = write_tiny_model(tmp_path / "a", num_layers=1, max_position_embeddings=2048)
    b = write_tiny_model(tmp_path / "b", num_layers=1, max_position_embeddings=2048)
    names = sorted(p.name for p in a.iterdir())
    assert names == sorted(
        [
            "config.json",
            "generation_config.json",
            "special_tokens_map.json",
            "tokenizer.json",
            "tokenizer_config.json",
        ]
    )
    for name in names:
        assert (a / name).read_bytes() == (b / name).read_bytes(), name
    assert json.loads((a / "config.json").read_text())["num_hidden_layers"] == 1
    tok_cfg = json.loads((a / "tokenizer_config.json").read_text())
    assert tok_cfg["model_max_length"] == 2048
    assert "add_generation_prompt" in tok_cfg["chat_template"]


def test_transformers_loads_it_and_renders_the_chat_template(tmp_path: Path) -> None:
    transformers = pytest.importorskip("transformers")
    tok = transformers.AutoTokenizer.from_pretrained(write_tiny_model(tmp_path))
    assert len(tok) == VOCAB_SIZE
    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}]
    text = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert text == "<bos><|system|>be brief<|end|><|user|>hi<|end|><|assistant|>"
    ids = tok(text, add_special_tokens=False).input_ids
    assert ids[0] == BOS_TOKEN_ID and len(ids) == 6 + len("be brief") + len("hi")


def test_module_imports_without_vllm_or_torch() -> None:
    code = (
        "import sys, mars_openhands.engine.harness.tiny_model as m; "
        "m.build_tokenizer(); "
        "print(sorted(n for n in ('vllm', 'torch', 'transformers') if n in sys.modules))"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=60
    )
    assert out.stdout.strip() == "[]", out.stdout + out.stderr
