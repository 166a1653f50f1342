"""Task drivers: ``chat`` is the runtime's own; every other kind comes from the
``mars_openhands.task_drivers`` entry points (the runtime names no higher layer's module)."""

from __future__ import annotations

import importlib.metadata

import pytest

from mars_openhands.runtime import engine
from mars_openhands.runtime.agent import run_chat_agent
from mars_openhands.runtime.engine import DriverUnavailableError, driver_kinds, load_driver


def test_chat_is_the_runtimes_own_and_openhands_an_entry_point() -> None:
    assert load_driver("chat") is run_chat_agent
    entries = {ep.name: ep.value for ep in
                importlib.metadata.entry_points(group=engine.DRIVER_ENTRY_POINTS)}
    assert entries.get("openhands") == "mars_openhands.openhands.durable:run_openhands_task", (
        "the package's metadata lacks the driver entry point: reinstall it (scripts/setup.sh)")
    assert driver_kinds() == ["chat", "openhands"]


def test_unknown_kind_and_a_missing_entry_point_say_what_to_do(monkeypatch: pytest.MonkeyPatch) -> None:
    with pytest.raises(DriverUnavailableError, match=r"unknown task kind 'nope'; supported: \['chat'"):
        load_driver("nope")
    monkeypatch.setattr(engine, "_driver_entry_points", dict)  # an env installed before it existed
    with pytest.raises(DriverUnavailableError, match="no driver installed here.*scripts/setup.sh.*"
                                                       "OpenHands env"):
        load_driver("openhands")


def test_a_driver_that_cannot_import_here_names_its_env(monkeypatch: pytest.MonkeyPatch) -> None:
    class _Missing:
        def load(self) -> None:
            raise ModuleNotFoundError("No module named 'openhands.sdk'", name="openhands.sdk")

    monkeypatch.setattr(engine, "_driver_entry_points", lambda: {"openhands": _Missing()})
    with pytest.raises(DriverUnavailableError,
                       match=r"cannot run in this environment \(openhands.sdk is missing\).*"
                             r"\.venv-openhands"):
        load_driver("openhands")
