"""Only ``mars_openhands/engine/seams/`` names vLLM's privates (style.md "Plugins on stock vLLM"):
every other module of the package, and the simulator, reads them through a seam."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

pytest.importorskip("vllm")

from mars_openhands.engine.seams import PRIVATE_NAMES  # noqa: E402

ROOT = Path(__file__).resolve().parents[3]
SEAMS = ROOT / "mars_openhands" / "engine" / "seams"
_SEAM_MODULES = {"blocks", "compat", "hooks", "fast_paths"}


def _is_seam_call(node: ast.Attribute) -> bool:
    """``seams.blocks.X`` / ``fast_paths.X``: a seam named like the private it reads."""
    value = node.value
    if isinstance(value, ast.Name):
        return value.id in _SEAM_MODULES
    return isinstance(value, ast.Attribute) and value.attr in _SEAM_MODULES


def _private_reads(path: Path) -> list[str]:
    tree = ast.parse(path.read_text(), filename=str(path))
    return [f"{path.relative_to(ROOT)}:{node.lineno} .{node.attr}" for node in ast.walk(tree)
            if isinstance(node, ast.Attribute) and node.attr in PRIVATE_NAMES
            and not _is_seam_call(node)]


def _checked_files() -> list[Path]:
    files = sorted((ROOT / "mars_openhands").rglob("*.py")) + sorted((ROOT / "eval").rglob("*.py"))
    return [p for p in files if SEAMS not in p.parents]


def test_no_module_outside_the_seams_names_a_vllm_private() -> None:
    found = [hit for path in _checked_files() for hit in _private_reads(path)]
    assert not found, "vLLM privates named outside engine/seams/ (add a seam):\n" + "\n".join(found)


def test_the_check_sees_a_private_read(tmp_path: Path) -> None:
    """The check must flag a direct read, and pass the seam that reads it, or it proves nothing."""
    probe = ROOT / "mars_openhands" / "engine" / "schedulers" / "base.py"
    code = ("x = s.kv_cache_manager.watermark_blocks\n"
            "y = seams.blocks.watermark_blocks(s)\nz = fast_paths.raw_block_key\n")
    tree = ast.parse(code)
    hits = [n.attr for n in ast.walk(tree) if isinstance(n, ast.Attribute)
            and n.attr in PRIVATE_NAMES and not _is_seam_call(n)]
    assert hits == ["watermark_blocks"] and probe.exists()
