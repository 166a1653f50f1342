"""The dependency direction of style.md, checked on every file's imports.

Allowed (may import →):
  stream    → stdlib, pydantic (pyzmq/pandas/pyarrow only lazily, inside functions)
  policy    → stream
  engine    → policy, stream, vllm, torch
  control   → policy, stream (never vllm, torch or openhands)
  openhands → stream, runtime, OpenHands SDK (never vllm, torch, control internals)
  runtime   → stream, policy, DBOS (+ its SQLAlchemy) (never vllm, torch, OpenHands, control, engine)
  eval      → anything
"""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PKG = ROOT / "mars_openhands"

# layer → top-level modules that layer must never import (at module level or lazily).
FORBIDDEN: dict[str, set[str]] = {
    "stream": {"vllm", "torch", "openhands", "mars_openhands.policy", "mars_openhands.engine",
               "mars_openhands.control", "mars_openhands.openhands", "mars_openhands.runtime", "eval",
               "fastapi", "httpx", "dbos"},
    "policy": {"vllm", "torch", "openhands", "mars_openhands.engine", "mars_openhands.control",
               "mars_openhands.openhands", "mars_openhands.runtime", "eval", "fastapi", "httpx",
               "zmq", "dbos"},
    "engine": {"openhands", "mars_openhands.control", "mars_openhands.openhands", "eval"},
    "control": {"vllm", "torch", "openhands", "mars_openhands.engine", "mars_openhands.openhands",
                "mars_openhands.runtime", "eval"},
    "openhands": {"vllm", "torch", "mars_openhands.engine", "mars_openhands.policy", "eval"},
    "runtime": {"vllm", "torch", "openhands", "mars_openhands.openhands", "mars_openhands.engine",
                "mars_openhands.control", "eval", "fastapi", "httpx", "litellm"},
}
# Third-party modules a layer may import only inside functions (lazily), never at module level.
LAZY_ONLY: dict[str, set[str]] = {"stream": {"zmq", "pandas", "pyarrow", "numpy"},
                                   "runtime": {"pandas", "pyarrow", "matplotlib", "rich"}}
# The only modules the runtime may import at all, besides the standard library and itself.
RUNTIME_ALLOWED = ("mars_openhands.runtime", "mars_openhands.stream", "mars_openhands.policy",
                   "mars_openhands", "pydantic", "dbos", "sqlalchemy", "pandas", "pyarrow",
                   "matplotlib", "rich")


def _is_type_checking(node: ast.stmt) -> bool:
    """`if TYPE_CHECKING:` blocks never run, so their imports cost nothing at run time."""
    test = getattr(node, "test", None)
    return isinstance(node, ast.If) and (
        (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING")
        or (isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")
    )


def _imports(path: Path, root: Path = ROOT) -> list[tuple[str, bool]]:
    """Return (module, is_module_level) for every import in `path`; relative imports resolved."""
    tree = ast.parse(path.read_text(), filename=str(path))
    pkg_parts = path.relative_to(root).with_suffix("").parts[:-1]
    top_level = {id(n) for n in tree.body}
    for node in tree.body:  # imports under module-level `if`/`try` count as module level too,
        if isinstance(node, (ast.If, ast.Try)) and not _is_type_checking(node):  # but not typing-only
            top_level.update(id(n) for n in ast.walk(node))
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out += [(a.name, id(node) in top_level) for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = ".".join(pkg_parts[: len(pkg_parts) - node.level + 1])
                mod = f"{base}.{node.module}" if node.module else base
            else:
                mod = node.module or ""
            out.append((mod, id(node) in top_level))
    return out


def _matches(module: str, banned: str) -> bool:
    return module == banned or module.startswith(banned + ".")


def _layer_files(layer: str) -> list[Path]:
    return sorted((PKG / layer).rglob("*.py"))


@pytest.mark.parametrize("layer", sorted(FORBIDDEN))
def test_layer_imports_follow_dependency_direction(layer: str) -> None:
    violations = []
    for path in _layer_files(layer):
        for module, is_top in _imports(path):
            if any(_matches(module, b) for b in FORBIDDEN[layer]):
                violations.append(f"{path.relative_to(ROOT)} imports {module}")
            if is_top and any(_matches(module, b) for b in LAZY_ONLY.get(layer, ())):
                violations.append(f"{path.relative_to(ROOT)} imports {module} at module level")
    assert not violations, "dependency direction broken (see style.md):\n" + "\n".join(violations)


def test_checker_sees_violations(tmp_path: Path) -> None:
    """The checker itself must flag a forbidden import, or the test above proves nothing."""
    f = tmp_path / "mars_openhands" / "policy" / "probe.py"
    f.parent.mkdir(parents=True)
    f.write_text("import vllm\nfrom ..engine import x\nif TYPE_CHECKING:\n    import zmq\n")
    found = dict(_imports(f, root=tmp_path))
    assert found == {"vllm": True, "mars_openhands.engine": True, "zmq": False}
    assert _matches("mars_openhands.engine", "mars_openhands.engine")


def test_stream_and_policy_import_cold_without_vllm_or_torch() -> None:
    """`stream` and `policy` load in a fresh interpreter without pulling vllm, torch or pandas."""
    code = (
        "import sys, pkgutil, importlib\n"
        "import mars_openhands.stream as s, mars_openhands.policy as p\n"
        "for pkg in (s, p):\n"
        "    for m in pkgutil.walk_packages(pkg.__path__, pkg.__name__ + '.'):\n"
        "        importlib.import_module(m.name)\n"
        "bad = sorted(m for m in ('vllm', 'torch', 'pandas', 'zmq') if m in sys.modules)\n"
        "assert not bad, bad\n"
    )
    r = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True)
    assert r.returncode == 0, r.stderr


def test_importing_engine_package_does_not_import_vllm() -> None:
    """`import mars_openhands.engine` is cheap: vLLM loads only when a class is asked for."""
    code = "import sys, mars_openhands.engine\nassert 'vllm' not in sys.modules\n"
    r = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True)
    assert r.returncode == 0, r.stderr


def test_runtime_imports_only_its_allowlist() -> None:
    """`runtime` is stdlib + pydantic + DBOS (its storage) + stream/policy; report libs lazily."""
    stdlib = sys.stdlib_module_names
    violations = []
    for path in _layer_files("runtime"):
        for module, _ in _imports(path):
            top = module.split(".")[0]
            if top in stdlib or top == "__future__":
                continue
            if not any(_matches(module, allowed) for allowed in RUNTIME_ALLOWED):
                violations.append(f"{path.relative_to(ROOT)} imports {module}")
    assert not violations, "runtime imports outside its allowlist:\n" + "\n".join(violations)


def test_importing_runtime_package_needs_no_dbos() -> None:
    """`import mars_openhands.runtime` (and its pure modules) is cheap: DBOS loads with the engine."""
    code = ("import sys, mars_openhands.runtime, mars_openhands.runtime.effects, "
            "mars_openhands.runtime.gate, mars_openhands.runtime.task\n"
            "assert 'dbos' not in sys.modules and 'sqlalchemy' not in sys.modules\n")
    r = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
