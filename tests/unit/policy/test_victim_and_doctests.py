"""Priority-aligned victims (policy/victim.py) and the docstring examples of the policy modules."""

from __future__ import annotations

import doctest
import importlib

import pytest

from mars_openhands.policy.victim import victim_key


def test_decodes_are_evicted_last_then_level_blocks_arrival() -> None:
    running = {
        "decode-big": victim_key(3, True, 500, 0.0),
        "prefill-l1-small": victim_key(1, False, 10, 0.0),
        "prefill-l2-small-late": victim_key(2, False, 10, 9.0),
        "prefill-l2-big": victim_key(2, False, 90, 1.0),
        "prefill-l2-small": victim_key(2, False, 10, 5.0),
    }
    order = sorted(running, key=running.__getitem__, reverse=True)
    assert order == ["prefill-l2-big", "prefill-l2-small-late", "prefill-l2-small",
                     "prefill-l1-small", "decode-big"]


@pytest.mark.parametrize("module", [
    "mars_openhands.policy.params", "mars_openhands.policy.types", "mars_openhands.policy.levels",
    "mars_openhands.policy.retention", "mars_openhands.policy.estimators",
    "mars_openhands.policy.victim", "mars_openhands.policy.chunking", "mars_openhands.policy.session",
])
def test_docstring_examples(module: str) -> None:
    failures, tried = doctest.testmod(importlib.import_module(module))
    assert tried > 0 and failures == 0
