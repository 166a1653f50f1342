"""The dependency direction of style.md, checked on every file's imports.

Allowed (may import →):
  stream    → stdlib, pydantic (pyzmq/pandas/pyarrow only lazily, inside functions)
  policy    → stream
  engine    → policy, stream, vllm, torch
  control   → policy, stream (never vllm, torch or openhands)
  openhands → stream, runtime, OpenHands SDK (never vllm, torch, control internals)
  runtime   → stream, policy, DBOS (+ its SQLAlchemy) (never vllm, torch, OpenHands, control, engine)
  serve     → control, engine, policy, stream, Ray (never openhands, runtime); nothing imports it
  eval      → anything
Nothing in mars_openhands imports eval (the top-level CLI lives in eval/cli.py for that reason).
Top-level standard-library-only modules (cli_style, process_tree, process_host) belong to no layer.

Imports by name count too: ``importlib.import_module("pkg.mod")``, ``__import__("pkg.mod")`` and a
dotted string that names a module (``"pkg.mod"``, ``"pkg.mod:attr"``: a lazy loader's registry entry)
are checked like ``import pkg.mod`` inside a function, so a registry cannot hide an upward import.
"""

from __future__ import annotations

import ast
import re
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
    "serve": {"openhands", "mars_openhands.openhands", "mars_openhands.runtime", "eval"},
}
# Ray Serve is the serve layer's alone (the cluster layer under it): no other layer imports Ray or
# the serve layer.
for _layer in ("stream", "policy", "engine", "control", "openhands", "runtime"):
    FORBIDDEN[_layer] |= {"ray", "mars_openhands.serve"}
# Third-party modules a layer may import only inside functions (lazily), never at module level.
LAZY_ONLY: dict[str, set[str]] = {"stream": {"zmq", "pandas", "pyarrow", "numpy"},
                                   "runtime": {"pandas", "pyarrow", "matplotlib", "rich"}}
# Upward imports by name that are known and listed here until they are inverted: (file, module) ->
# why. An entry names one file and one module, so any other string import of a higher layer fails.
# (None now: the runtime's 'openhands' driver, once resolved by name in runtime/engine.py, is a
# package entry point that pyproject.toml declares for the OpenHands layer.)
KNOWN_STRING_IMPORTS: dict[tuple[str, str], str] = {}
# The only modules the runtime may import at all, besides the standard library and itself.
# process_tree and process_host are top-level, standard-library-only process plumbing that belongs
# to no layer (a runner's tool commands end with it: mars_openhands/process_host.py).
RUNTIME_ALLOWED = ("mars_openhands.runtime", "mars_openhands.stream", "mars_openhands.policy",
                   "mars_openhands.process_tree", "mars_openhands.process_host", "mars_openhands", "pydantic", "dbos", "sqlalchemy", "pandas", "pyarrow",
                   "matplotlib", "rich")


def _is_type_checking(node: ast.stmt) -> bool:
    """`if TYPE_CHECKING:` blocks never run, so their imports cost nothing at run time."""
    test = getattr(node, "test", None)
    return isinstance(node, ast.If) and (
        (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING")
        or (isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")
    )


_DOTTED = re.compile(r"[A-Za-z_]\w*(?:\.[A-Za-z_]\w*)+(?::[A-Za-z_]\w*)?")
"""A string that names a module by its dotted path, optionally ``:attribute``."""
_LOADERS = frozenset({"import_module", "__import__"})


def _string_imports(tree: ast.AST) -> list[str]:
    """Modules named by string: the literal argument of ``import_module``/``__import__``, and every
    string constant that is a whole dotted path (``"pkg.mod"``, ``"pkg.mod:attr"``); docstrings and
    prose never match (they hold spaces), nor do the pieces of an f-string."""
    in_fstring = {id(c) for node in ast.walk(tree) if isinstance(node, ast.JoinedStr)
                  for c in ast.walk(node)}
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and node.args and isinstance(node.args[0], ast.Constant):
            name = node.func.attr if isinstance(node.func, ast.Attribute) else getattr(node.func, "id", "")
            if name in _LOADERS and isinstance(node.args[0].value, str):
                found.append(node.args[0].value)
                continue
        if (isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in in_fstring
                and _DOTTED.fullmatch(node.value)):
            found.append(node.value.partition(":")[0])
    return found


def _imports(path: Path, root: Path = ROOT, *, by_name: bool = True) -> list[tuple[str, bool]]:
    """Return (module, is_module_level) for every import in `path`; relative imports resolved.

    With ``by_name``, imports by name (:func:`_string_imports`) too, as not module level (they run
    when called); any dotted string counts, so only a check against banned names should read them.
    """
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
    if by_name:
        out += [(module, False) for module in dict.fromkeys(_string_imports(tree))]
    return out


def _matches(module: str, banned: str) -> bool:
    return module == banned or module.startswith(banned + ".")


def _layer_files(layer: str) -> list[Path]:
    return sorted((PKG / layer).rglob("*.py"))


def _violations(paths: list[Path], banned: set[str], lazy_only: set[str] = frozenset(),
                root: Path = ROOT) -> list[str]:
    """One line per import in ``paths`` of a ``banned`` module (by statement or by name, unless in
    :data:`KNOWN_STRING_IMPORTS`) or of a ``lazy_only`` one at module level."""
    violations = []
    for path in paths:
        rel = path.relative_to(root).as_posix()
        for module, is_top in _imports(path, root):
            if any(_matches(module, b) for b in banned) and (rel, module) not in KNOWN_STRING_IMPORTS:
                violations.append(f"{rel} imports {module}")
            if is_top and any(_matches(module, b) for b in lazy_only):
                violations.append(f"{rel} imports {module} at module level")
    return violations


@pytest.mark.parametrize("layer", sorted(FORBIDDEN))
def test_layer_imports_follow_dependency_direction(layer: str) -> None:
    violations = _violations(_layer_files(layer), FORBIDDEN[layer], LAZY_ONLY.get(layer, set()))
    assert not violations, "dependency direction broken (see style.md):\n" + "\n".join(violations)


def test_the_plugin_never_imports_the_harness() -> None:
    """``engine/`` is two houses: the vLLM plugin (schedulers, seams, telemetry, queues, the entry
    point) and the harness that runs vLLM without a GPU (``engine/harness``). The plugin never
    imports the harness, so a server's engine core loads none of it; only the package's face
    (``engine/__init__.py``) names the emulated executor for ``--distributed-executor-backend``."""
    engine = PKG / "engine"
    plugin = [p for p in sorted(engine.rglob("*.py"))
              if "harness" not in p.relative_to(engine).parts and p != engine / "__init__.py"]
    violations = _violations(plugin, {"mars_openhands.engine.harness"})
    assert not violations, "the plugin imports the harness:\n" + "\n".join(violations)


def test_the_package_never_imports_eval() -> None:
    """``eval`` is the top layer: no file of ``mars_openhands`` (its own top-level modules too, which
    belong to no layer) imports it, by statement or by name."""
    violations = _violations(sorted(PKG.rglob("*.py")), {"eval"})
    assert not violations, "mars_openhands imports the eval layer:\n" + "\n".join(violations)


def test_known_string_imports_still_exist() -> None:
    """An entry of :data:`KNOWN_STRING_IMPORTS` whose import is gone must go too (or it would excuse
    a new one)."""
    stale = [key for key in KNOWN_STRING_IMPORTS if key[1] not in dict(_imports(ROOT / key[0]))]
    assert not stale, f"remove these from KNOWN_STRING_IMPORTS: {stale}"


def test_checker_sees_violations(tmp_path: Path) -> None:
    """The checker itself must flag a forbidden import, or the test above proves nothing."""
    f = tmp_path / "mars_openhands" / "policy" / "probe.py"
    f.parent.mkdir(parents=True)
    f.write_text("import vllm\nfrom ..engine import x\nif TYPE_CHECKING:\n    import zmq\n")
    found = dict(_imports(f, root=tmp_path))
    assert found == {"vllm": True, "mars_openhands.engine": True, "zmq": False}
    assert _matches("mars_openhands.engine", "mars_openhands.engine")


def test_checker_sees_imports_by_name(tmp_path: Path) -> None:
    """A registry of dotted names, import_module and __import__ hide an upward import from the
    import graph; the check above must still fail on each (the top-level CLI once did this)."""
    cli = tmp_path / "mars_openhands" / "cli.py"
    cli.parent.mkdir(parents=True)
    cli.write_text(
        '"""A top-level CLI. See eval.compare (prose: not an import)."""\n'
        "import importlib\n"
        'SUBCOMMANDS = (("mars_openhands.control.cli", "add_gateway_subcommand"),\n'
        '               ("eval.compare", "add_compare_subcommand"))\n'
        'DRIVER = "eval.sim:simulate"\n'
        "def build(name: str) -> None:\n"
        '    importlib.import_module("eval.replay")\n'
        '    __import__("eval.workloads")\n'
        '    print(f"eval.{name}", "not.a module path")\n')
    found = _imports(cli, root=tmp_path)
    assert ("eval.compare", False) in found and ("eval.sim", False) in found
    assert ("eval.replay", False) in found and ("eval.workloads", False) in found
    assert not any(m.startswith(("eval.name", "not.")) for m, _ in found)
    violations = _violations([cli], {"eval"}, root=tmp_path)
    assert sorted(violations) == sorted(f"mars_openhands/cli.py imports eval.{m}"
                                        for m in ("compare", "sim", "replay", "workloads"))
    runtime = tmp_path / "mars_openhands" / "runtime" / "engine.py"
    runtime.parent.mkdir()
    runtime.write_text('DRIVERS = {"openhands": ("mars_openhands.openhands.durable:run", "")}\n')
    assert _violations([runtime], FORBIDDEN["runtime"], root=tmp_path) == [
        "mars_openhands/runtime/engine.py imports mars_openhands.openhands.durable"]
    policy = tmp_path / "mars_openhands" / "policy" / "lazy.py"
    policy.parent.mkdir()
    policy.write_text('TARGET = "mars_openhands.engine.schedulers.mars:MarsScheduler"\n')
    assert _violations([policy], FORBIDDEN["policy"], root=tmp_path) == [
        "mars_openhands/policy/lazy.py imports mars_openhands.engine.schedulers.mars"]


def test_the_shared_error_formatter_is_standard_library_only() -> None:
    """``mars_openhands/cli_style.py`` belongs to no layer: every layer's command line and config
    loader imports it (``policy.params`` formats ``--additional-config mars`` errors with it), so it
    may import nothing but the standard library, or it would carry an upward import into them."""
    imports = {module for module, _ in _imports(PKG / "cli_style.py", by_name=False)}
    outside = sorted(m for m in imports if m.split(".")[0] not in sys.stdlib_module_names | {"__future__"})
    assert not outside, f"cli_style imports beyond the standard library: {outside}"


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
        for module, _ in _imports(path, by_name=False):  # a file name like "tasks.sqlite" is no import
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
