"""The README's shell blocks run when pasted: a block needing a GPU, a model or values of one's own
says so on its first line (and only there), and a recipe waits for every server it starts."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
README = (ROOT / "README.md").read_text(encoding="utf-8")
BLOCKS = re.findall(r"```bash\n(.*?)```", README, flags=re.S)
RUNNABLE = [b for b in BLOCKS if not b.startswith("# template:")]


def _first_line(block: str) -> str:
    return block.splitlines()[0][:80]


def test_the_readme_has_runnable_blocks_and_templates() -> None:
    assert len(RUNNABLE) >= 8 and len(BLOCKS) > len(RUNNABLE)


@pytest.mark.parametrize("block", BLOCKS, ids=_first_line)
def test_a_template_says_so_on_its_first_line_only(block: str) -> None:
    """A `# template:` line below runnable lines makes a pasted block run them, then fail."""
    later = [line for line in block.splitlines()[1:] if line.startswith("# template:")]
    assert not later, f"README block {_first_line(block)!r}: {later[0]!r} is not its first line; split the block"


@pytest.mark.parametrize("block", [b for b in RUNNABLE if "openhands playback --port" in b], ids=_first_line)
def test_a_recipe_waits_for_its_playback_engine(block: str) -> None:
    """The gateway's /healthz answers 200 before it has polled its replica, so waiting for the
    gateway alone lets the first request reach a playback engine still importing (a 503)."""
    port = re.search(r"openhands playback --port (\d+)", block).group(1)
    wait = block.find(f"curl -sf http://127.0.0.1:{port}/health")
    assert wait >= 0, f"README block {_first_line(block)!r}: no wait for the playback engine on port {port}"
    first_request = re.search(r"^ask\b|openhands run --backend|app-env --gateway|tasks submit", block, re.M)
    assert first_request, f"README block {_first_line(block)!r}: which line sends the first request?"
    assert wait < first_request.start(), f"README block {_first_line(block)!r}: waits for port {port} after its first request"
