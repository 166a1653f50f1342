"""Every ``MARS_`` environment variable is declared in ``mars_openhands/env.py`` (style.md "Config")."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from mars_openhands.env import GATEWAY_API_KEY, REGISTRY

ROOT = Path(__file__).resolve().parents[2]
_QUOTED_NAME = re.compile(r"""["'](MARS_[A-Z0-9_]+)["']""")


def _env_names(text: str) -> set[str]:
    """Quoted ``MARS_...`` names in ``text``, less the module's own constants (``__all__``)."""
    return {n for n in _QUOTED_NAME.findall(text) if not re.search(rf"^{n} = ", text, re.M)}


def test_every_mars_variable_in_the_code_is_declared() -> None:
    files = [p for d in ("mars_openhands", "eval", "benchmarks") for p in (ROOT / d).rglob("*.py")]
    used = {name: path for path in files for name in _env_names(path.read_text())}
    missing = {name: str(path.relative_to(ROOT)) for name, path in used.items() if name not in REGISTRY}
    assert not missing, f"declare these in mars_openhands/env.py: {missing}"


def test_a_key_with_a_newline_fails_loudly() -> None:
    assert GATEWAY_API_KEY.get_secret({}) is None and GATEWAY_API_KEY.get_secret({GATEWAY_API_KEY.name: ""}) is None
    assert GATEWAY_API_KEY.get_secret({GATEWAY_API_KEY.name: "k-1"}) == "k-1"
    with pytest.raises(ValueError, match="MARS_GATEWAY_API_KEY has whitespace"):
        GATEWAY_API_KEY.get_secret({GATEWAY_API_KEY.name: "key\n"})
