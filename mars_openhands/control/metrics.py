"""Prometheus text format: reading vLLM's ``/metrics`` and writing the gateway's own.

vLLM 0.32 (``vllm/v1/metrics/loggers.py``) exports, per engine: ``vllm:kv_cache_usage_perc`` (a
0..1 fraction despite the name; it is ``1 - free / total`` blocks, and evictable prefix-cache blocks
count as free, so it already excludes them), ``vllm:num_requests_running``,
``vllm:num_requests_waiting`` and ``vllm:cache_config_info`` (labels ``num_gpu_blocks``,
``block_size``), plus the Prometheus client's ``process_start_time_seconds``.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

__all__ = ["EngineMetrics", "parse_vllm_metrics", "render_prometheus"]

_SAMPLE = re.compile(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)(\{[^}]*\})?\s+([^\s]+)")
_LABEL = re.compile(r'([a-zA-Z_][a-zA-Z0-9_]*)="((?:[^"\\]|\\.)*)"')


@dataclass(frozen=True)
class EngineMetrics:
    """What the gateway reads from one replica's ``/metrics``. ``None``: not exported."""

    kv_usage: float | None = None
    """0..1, max over the replica's engines."""
    num_running: int | None = None
    num_waiting: int | None = None
    num_gpu_blocks: int | None = None
    block_size_tokens: int | None = None
    process_start_s: float | None = None


def _labels(text: str | None) -> dict[str, str]:
    return dict(_LABEL.findall(text or ""))


def _to_int(value: str | None) -> int | None:
    try:
        return int(float(value)) if value not in (None, "", "None") else None
    except ValueError:
        return None


def parse_vllm_metrics(text: str) -> EngineMetrics:
    """Parse the samples the gateway needs from vLLM's Prometheus text. Pure.

    Several engines (data parallel) are combined: max usage, summed queues.
    """
    usage: float | None = None
    running = waiting = blocks = block_size = None
    start: float | None = None
    for line in text.splitlines():
        if not line or line[0] == "#":
            continue
        m = _SAMPLE.match(line)
        if m is None:
            continue
        name, labels, raw = m.group(1), m.group(2), m.group(3)
        try:
            value = float(raw)
        except ValueError:
            continue
        if name == "vllm:kv_cache_usage_perc":
            usage = value if usage is None else max(usage, value)
        elif name == "vllm:num_requests_running":
            running = (running or 0) + int(value)
        elif name == "vllm:num_requests_waiting":
            waiting = (waiting or 0) + int(value)
        elif name == "vllm:cache_config_info":
            info = _labels(labels)
            blocks = _to_int(info.get("num_gpu_blocks")) or blocks
            block_size = _to_int(info.get("block_size")) or block_size
        elif name == "process_start_time_seconds":
            start = value
    if usage is not None:
        usage = min(1.0, max(0.0, usage))
    return EngineMetrics(usage, running, waiting, blocks, block_size, start)


def _escape(value: str) -> str:
    return value.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")


def render_prometheus(
    metrics: list[tuple[str, str, str, list[tuple[dict[str, str], float]]]],
) -> str:
    """Render ``[(name, type, help, [(labels, value), ...]), ...]`` as Prometheus text. Pure."""
    lines: list[str] = []
    for name, kind, help_text, samples in metrics:
        lines.append(f"# HELP {name} {help_text}")
        lines.append(f"# TYPE {name} {kind}")
        for labels, value in samples:
            label_text = ",".join(f'{k}="{_escape(v)}"' for k, v in labels.items())
            lines.append(f"{name}{{{label_text}}} {value}" if label_text else f"{name} {value}")
    return "\n".join(lines) + "\n"
