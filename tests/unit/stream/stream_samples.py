"""Shared samples for the stream tests: one fully populated event per kind."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta
from typing import Any

from mars_openhands.stream.events import EVENT_TYPES, Event, parse_event

_T0 = datetime(2026, 11, 30, 5, 0, 0, 123456, tzinfo=UTC)

# Every optional field set to a non-default value: a round trip that drops or retypes one fails.
_FIELDS_BY_KIND: dict[str, dict[str, Any]] = {
    "queued": {"request_id": "r1", "num_prompt_tokens": 812, "num_projected_blocks": 51},
    "first_scheduled": {"request_id": "r1", "prefill_start_delay_s": 0.25,
                        "num_cached_tokens": 640},
    "first_token": {"request_id": "r1", "ttft_s": 0.5},
    "finished": {"request_id": "r1", "num_prompt_tokens": 812, "num_output_tokens": 97,
                 "num_blocks_freed": 3, "num_blocks_retained": 48, "finish_reason": "stop",
                 "e2e_s": 2.75},
    "preempted": {"request_id": "r2", "num_blocks_freed": 12, "num_computed_tokens": 190},
    "aborted": {"request_id": "gw-3", "reason": "client_disconnect", "stage": "upstream",
                "is_slot_released": True, "elapsed_s": 1.5},
    "kv_retained": {"request_id": "r1", "num_blocks": 48, "ttl_s": 3.5, "reason": "value>cost"},
    "kv_released": {"num_blocks": 48, "reason": "resumed", "held_s": 1.25, "num_reused_blocks": 40},
    "engine_step": {"num_gpu_blocks": 1000, "num_used_blocks": 600, "num_free_blocks": 352,
                    "num_retained_blocks": 48, "num_running": 7, "num_waiting": 3,
                    "num_projected_blocks": 900, "step_time_s": 0.031},
    "session_start": {"tool_timeout_s": 90.0},
    "session_end": {"status": "error"},
    "tool_enqueued": {"tool_name": "terminal", "tool_call_id": "c1", "timeout_s": 40.0},
    "tool_start": {"tool_name": "terminal", "tool_call_id": "c1", "queue_wait_s": 0.125,
                   "timeout_s": 35.0},
    "tool_end": {"tool_name": "terminal", "tool_call_id": "c1", "duration_s": 4.5,
                 "status": "timeout"},
    "replica_replaced": {"replica": "engine-1", "url": "http://10.0.0.3:9000",
                         "previous_incarnation": "0123456789ab", "incarnation": "ba9876543210"},
    "admission_update": {"window": 12, "num_admitted": 11, "num_waiting": 4, "cpu_overloaded": True,
                         "kv_overloaded": False, "tool_backlog_ratio": 1.5, "tool_wait_ema_s": 0.75,
                         "kv_usage": 0.875},
}


def sample_dict(kind: str, index: int = 0) -> dict[str, Any]:
    """A valid event dict of ``kind``; ``index`` varies the timestamps and the session."""
    return {
        "kind": kind,
        "t_mono_ns": 10_000_000_000 + index * 1_000_003,
        "t_wall": (_T0 + timedelta(microseconds=index * 1001)).isoformat(),
        "session_id": f"s{index % 5}",
        "turn": index % 7,
        "source": "engine:0" if index % 2 else "agent",
        **_FIELDS_BY_KIND[kind],
    }


def sample_events() -> list[Event]:
    """One event per kind, in ``EVENT_TYPES`` order."""
    return [parse_event(sample_dict(kind, i)) for i, kind in enumerate(EVENT_TYPES)]

