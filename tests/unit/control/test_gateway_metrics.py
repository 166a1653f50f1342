"""Reading vLLM's Prometheus text and rendering the gateway's (control/metrics.py)."""

from __future__ import annotations

from mars_openhands.control.metrics import parse_vllm_metrics, render_prometheus

# Shape of vLLM 0.32's /metrics (names from vllm/v1/metrics/loggers.py), two engines.
VLLM_TEXT = """\
# HELP vllm:kv_cache_usage_perc KV-cache usage. 1 means 100 percent usage.
# TYPE vllm:kv_cache_usage_perc gauge
vllm:kv_cache_usage_perc{engine="0",model_name="tiny"} 0.25
vllm:kv_cache_usage_perc{engine="1",model_name="tiny"} 0.5
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{engine="0",model_name="tiny"} 3.0
vllm:num_requests_running{engine="1",model_name="tiny"} 1.0
vllm:num_requests_waiting{engine="0",model_name="tiny"} 2.0
vllm:cache_config_info{block_size="16",cache_dtype="auto",num_gpu_blocks="2048",engine="0"} 1.0
process_start_time_seconds 1.7e+09
vllm:prompt_tokens_total{engine="0"} 123.0
"""


def test_parse_vllm_metrics() -> None:
    m = parse_vllm_metrics(VLLM_TEXT)
    assert m.kv_usage == 0.5  # max over engines
    assert (m.num_running, m.num_waiting) == (4, 2)
    assert (m.num_gpu_blocks, m.block_size_tokens) == (2048, 16)
    assert m.process_start_s == 1.7e9


def test_parse_missing_metrics_gives_none() -> None:
    m = parse_vllm_metrics("# nothing\nother_metric 1\n")
    assert m.kv_usage is None and m.num_gpu_blocks is None and m.num_running is None


def test_render_prometheus() -> None:
    text = render_prometheus([("a_b", "gauge", "help me", [({}, 1.5)]),
                              ("c", "counter", "h", [({"replica": 'r"0'}, 2)])])
    assert "# TYPE a_b gauge\na_b 1.5\n" in text
    assert 'c{replica="r\\"0"} 2' in text
