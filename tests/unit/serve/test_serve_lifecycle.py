"""``serve``'s lifecycle around signals (serve/app.py ``serve_forever``), with Ray faked.

Ray's driver installs its own SIGTERM handler at ``ray.init``; it aborts the process, so a signal
while the engines load (minutes) used to leave everything that had started. These tests put a
stand-in for that handler in place exactly where ``ray.init`` does.
"""

from __future__ import annotations

import os
import signal
import threading
import time
from typing import Any

import pytest

from mars_openhands.serve import app
from mars_openhands.serve.config import ServeConfig


def _fake_ray(monkeypatch: pytest.MonkeyPatch, signal_during_start: bool) -> dict[str, Any]:
    seen: dict[str, Any] = {"ray_handler": 0, "stops": 0, "start_finished": False}

    def fake_start(config: ServeConfig, on_ray_started: Any = None,
                   run_id: str | None = None) -> tuple[Any, str]:
        # ray.init: the driver's own handler replaces ours.
        signal.signal(signal.SIGTERM, lambda *_: seen.__setitem__("ray_handler", seen["ray_handler"] + 1))
        if on_ray_started is not None:
            on_ray_started()
        if signal_during_start:
            os.kill(os.getpid(), signal.SIGTERM)
        deadline = time.monotonic() + 3.0  # serve.run waiting for the engines (a Python loop)
        while time.monotonic() < deadline:
            time.sleep(0.01)
        seen["start_finished"] = True
        return object(), "http://127.0.0.1:1"

    def fake_stop(config: ServeConfig, run_id: str | None = None) -> None:
        seen["stops"] += 1

    monkeypatch.setattr(app, "start", fake_start)
    monkeypatch.setattr(app, "stop", fake_stop)
    return seen


def test_a_sigterm_while_the_engines_start_stops_what_started(monkeypatch, restore_handlers) -> None:
    seen = _fake_ray(monkeypatch, signal_during_start=True)
    # Old behaviour: Ray's handler took the signal and serve waited on; end that wait after 6 s.
    rescue = threading.Timer(6.0, os.kill, (os.getpid(), signal.SIGTERM))
    rescue.start()
    t0 = time.monotonic()
    try:
        rc = app.serve_forever(ServeConfig())
    finally:
        rescue.cancel()
    assert seen["ray_handler"] == 0, "the signal reached Ray's handler (it aborts: no clean-up)"
    assert rc == 128 + signal.SIGTERM and seen["stops"] == 1 and not seen["start_finished"]
    assert time.monotonic() - t0 < 2.5


def test_a_sigterm_once_serving_stops_cleanly(monkeypatch, restore_handlers, capsys) -> None:
    seen = _fake_ray(monkeypatch, signal_during_start=False)

    def signal_once_serving() -> None:  # after the "listening" line, however slow the machine
        deadline = time.monotonic() + 60
        while "listening on" not in capsys.readouterr().err and time.monotonic() < deadline:
            time.sleep(0.05)
        os.kill(os.getpid(), signal.SIGTERM)

    threading.Thread(target=signal_once_serving, daemon=True).start()
    rc = app.serve_forever(ServeConfig())
    assert rc == 0 and seen["stops"] == 1 and seen["start_finished"] and seen["ray_handler"] == 0
