"""pytest plugin that runs vLLM's own scheduler tests against one of our scheduler classes.

Loaded by ``tests/vllm_suite/run.py`` (``-p plugin``) into a pytest process whose rootdir is the
extracted vLLM test tree (``.vllm-tests/``, see ``scripts/fetch_vllm_tests.py``). vLLM's test
files are not edited; everything happens from outside:

* **The class swap.** ``--mars-scheduler-cls module:Class`` (or ``vllm:AsyncScheduler``, the
  reference). After collection, every loaded ``tests.*`` module's names ``Scheduler`` and
  ``AsyncScheduler`` that are vLLM's classes are rebound to that class, so each scheduler the
  tests build (``create_scheduler`` in ``tests/v1/core/utils.py``, and the direct
  ``Scheduler(...)`` calls of a few test files) is ours. A test asking for the synchronous
  ``Scheduler`` then gets an async one: those expectations are stock ``AsyncScheduler``'s too,
  and ``expected_failures.toml`` lists them under ``[AsyncScheduler]``.
* **Offline models.** :mod:`fake_models` writes the models the tests name into a temp dir and
  sets ``VLLM_MODEL_REDIRECT_PATH``; ``HF_HUB_OFFLINE=1`` makes any Hub access an error.
* **No torchvision.** The stub of :mod:`fake_models` on ``sys.path``; transformers' image
  processor factory is told torchvision is absent, so it builds the PIL processors (vLLM runs
  them once on a dummy image to size the encoder budget).
* **vLLM's conftest fixtures the files use** (``caplog_vllm``) and its markers: defined here
  (vLLM's ``tests/conftest.py`` imports model runners, datasets and the network).
* **Outcomes.** ``--mars-outcomes PATH``: one JSON object ``{nodeid: "passed"|"failed"|"skipped"}``
  written at the end of the session, a test failed when any of its phases failed.
"""

from __future__ import annotations

import importlib
import json
import logging
import os
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

_HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(_HERE))
from fake_models import write_fake_models, write_torchvision_stub  # noqa: E402


def pytest_addoption(parser: pytest.Parser) -> None:
    group = parser.getgroup("mars-vllm-suite")
    group.addoption("--mars-scheduler-cls", default="vllm:AsyncScheduler",
                    help="module:Class swapped in for vLLM's Scheduler/AsyncScheduler "
                         "(vllm:AsyncScheduler = stock, the reference)")
    group.addoption("--mars-outcomes", default=None, help="write {nodeid: outcome} JSON here")


def _offline_environment() -> None:
    """Fake models, the torchvision stub, offline Hub; set before vLLM is imported. Mutates
    ``os.environ`` and ``sys.path`` (inherited by vLLM's model-inspection subprocess)."""
    if os.environ.get("MARS_VLLM_SUITE_ENV") == "1":
        return
    root = Path(tempfile.mkdtemp(prefix="mars-vllm-suite-"))
    stub = write_torchvision_stub(root / "stubs")
    sys.path.insert(0, str(stub))
    os.environ["PYTHONPATH"] = os.pathsep.join(
        p for p in (str(stub), os.environ.get("PYTHONPATH")) if p)
    os.environ.update({
        "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "HF_HOME": str(root / "hf"),
        "VLLM_CACHE_ROOT": str(root / "vllm-cache"),
        "VLLM_MODEL_REDIRECT_PATH": str(write_fake_models(root / "models")),
        "MARS_VLLM_SUITE_ENV": "1",
    })


def _pil_image_processors() -> None:
    """transformers picks the torchvision image processors when ``find_spec("torchvision")``
    succeeds (the stub); make its factory pick the PIL ones."""
    import transformers.models.auto.image_processing_auto as auto

    auto.is_torchvision_available = lambda: False


def _load_class(spec: str) -> type:
    module_name, _, attr = spec.partition(":")
    if module_name == "vllm":
        module_name = "vllm.v1.core.sched.async_scheduler"
    try:
        return getattr(importlib.import_module(module_name), attr)
    except (ImportError, AttributeError) as e:
        raise pytest.UsageError(f"--mars-scheduler-cls {spec!r}: {e}") from e


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "cpu_test: vLLM's marker (runs on CPU)")
    config.addinivalue_line("markers", "skip_global_cleanup: vLLM's marker")
    _offline_environment()
    _pil_image_processors()
    path = config.getoption("--mars-outcomes")
    if path:
        config.pluginmanager.register(_OutcomeRecorder(Path(path)), "mars-outcomes")


def pytest_collection_finish(session: pytest.Session) -> None:
    """Rebind ``Scheduler``/``AsyncScheduler`` in the collected vLLM test modules."""
    from vllm.v1.core.sched.async_scheduler import AsyncScheduler
    from vllm.v1.core.sched.scheduler import Scheduler

    cls = _load_class(session.config.getoption("--mars-scheduler-cls"))
    if cls is AsyncScheduler:
        targets = {Scheduler}
    else:
        targets = {Scheduler, AsyncScheduler}
    for name, module in list(sys.modules.items()):
        if name != "tests" and not name.startswith("tests."):
            continue
        for attr in ("Scheduler", "AsyncScheduler"):
            if getattr(module, attr, None) in targets:
                setattr(module, attr, cls)


class _OutcomeRecorder:
    """Records each test's outcome (failed if any phase failed) and writes them at the end."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.outcomes: dict[str, str] = {}

    def pytest_runtest_logreport(self, report: pytest.TestReport) -> None:
        if report.failed:
            self.outcomes[report.nodeid] = "failed"
        elif report.when == "call" or report.skipped:
            self.outcomes.setdefault(report.nodeid, report.outcome)

    def pytest_sessionfinish(self) -> None:
        self.path.write_text(json.dumps(self.outcomes, indent=1, sort_keys=True))


@pytest.fixture()
def caplog_vllm(caplog: pytest.LogCaptureFixture) -> Iterator[pytest.LogCaptureFixture]:
    """vLLM's fixture (its ``tests/conftest.py``): vLLM's log records, INFO and up, in caplog."""
    logger = logging.getLogger("vllm")
    previous = logger.propagate
    logger.propagate = True
    try:
        with caplog.at_level(logging.INFO):
            yield caplog
    finally:
        logger.propagate = previous
