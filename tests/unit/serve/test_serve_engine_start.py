"""What a user sees when an engine cannot start, and what is left on disk (serve/engine.py,
serve/cli.py), without Ray or vLLM: ``--model`` checked before Ray, an engine's failed start
that keeps its vLLM log and says where, and the engines' temporary directories removed on every
stop path.

Each test failed on the code before the fix (see the docstrings).
"""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path

import pytest

from mars_openhands.serve import app
from mars_openhands.serve import engine as engine_mod
from mars_openhands.serve.cli import add_serve_subcommand, config_from_args, run_from_args


@pytest.fixture
def tmp_root(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """``tempfile.gettempdir()`` (where engines make their directories) is ``tmp_path``."""
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    return tmp_path


def _parse(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_serve_subcommand(parser.add_subparsers(dest="command"))
    return parser.parse_args(["serve", "--port", "1", *argv])  # port 1: never free to bind,
    # but the port check runs after the model's


# ---------------------------------------------------------------------------- --model before Ray
@pytest.mark.parametrize(("model", "why"), [
    ("/nonexistent/model", "no such model directory, and not a Hugging Face model id"),
    ("./models/x", "no such model directory"),
    ("a/b/c", "no such model directory"),
    ("{dir}", "the directory has no config.json"),
    ("{file}", "a file, not a model directory"),
])
def test_a_bad_model_is_one_line_and_exit_2_before_ray(model: str, why: str, tmp_path: Path,
                                                       capsys, monkeypatch) -> None:
    """``--model /nonexistent/model`` started Ray and the engines, failed after ~100 s of
    retries and printed only "Failed to update the deployments ['engine-0']"."""
    (tmp_path / "empty").mkdir()
    (tmp_path / "weights.bin").write_text("")
    model = model.format(dir=tmp_path / "empty", file=tmp_path / "weights.bin")
    monkeypatch.setattr(app, "serve_forever", lambda config: pytest.fail("Ray would start"))
    assert run_from_args(_parse("--model", model)) == 2
    [line] = capsys.readouterr().err.splitlines()
    assert line.startswith(f"mars-openhands serve: error: --model {model}: ") and why in line


def test_a_model_directory_is_made_absolute_and_an_id_is_left_to_the_engines(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A relative directory reaches each engine as an absolute path (vLLM runs in the
    repository's directory), under the name the user gave; a Hugging Face id is not checked
    here (vLLM downloads it, or finds it in its cache); on a cluster nothing is checked here."""
    (tmp_path / "m").mkdir()
    (tmp_path / "m" / "config.json").write_text("{}")
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr("mars_openhands.control.config.check_port_free", lambda *a: None)
    config = config_from_args(_parse("--model", "m"))
    assert (config.model, config.served_model_name) == (str(tmp_path / "m"), "m")
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    assert config_from_args(_parse("--model", "Qwen/Qwen3-8B")).model == "Qwen/Qwen3-8B"
    assert config_from_args(_parse("--model", "/nonexistent/model", "--ray-address",
                                   "ray://head:10001")).model == "/nonexistent/model"


def test_an_uncached_id_is_refused_when_offline(monkeypatch: pytest.MonkeyPatch) -> None:
    from huggingface_hub import constants

    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    with pytest.raises(ValueError, match=r"^--model no-org/no-such-model-x: not in the local "
                                         "Hugging Face cache, and HF_HUB_OFFLINE is set"):
        engine_mod.checked_model("no-org/no-such-model-x")
    assert engine_mod.checked_model("tiny") == "tiny"
