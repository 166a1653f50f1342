"""policy.chunking: chunk shrinking and whole-context resume, as block arithmetic."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from mars_openhands.policy.chunking import blocks_for_tokens, context_fits, shrunk_chunk_tokens


@pytest.mark.parametrize(("n", "start", "covered", "avail", "out"), [
    (1024, 0, 0, 64, 1024),    # fits as is
    (1024, 0, 0, 63, 512),     # one block short: halved once
    (1024, 0, 0, 0, 16),       # nothing free: down to one block, not below
    (1000, 40, 2, 10, 125),    # 1000 -> 500 -> 250 -> 125: ceil(165/16) - 2 = 9 <= 10
    (16, 0, 0, -5, 16),        # a one-block chunk is left to vLLM
    (100, 160, 10, 0, 16),     # covered blocks count: 100 -> ... -> 16 (one new block needed)
])
def test_shrunk_chunk_tokens(n: int, start: int, covered: int, avail: int, out: int) -> None:
    assert shrunk_chunk_tokens(n, start, 16, covered, avail) == out


@given(st.integers(1, 1 << 16), st.integers(0, 1 << 16), st.integers(-8, 4096))
def test_shrunk_chunk_fits_or_is_one_block(n: int, start: int, avail: int) -> None:
    bs = 16
    covered = start // bs
    out = shrunk_chunk_tokens(n, start, bs, covered, avail)
    assert 1 <= out <= n
    assert out <= bs or blocks_for_tokens(start + out, bs) - covered <= avail


@pytest.mark.parametrize(("tokens", "avail", "fits"), [
    (0, 0, True), (1, 0, False), (16, 1, True), (17, 1, False), (100, -1, False),
])
def test_context_fits(tokens: int, avail: int, fits: bool) -> None:
    assert context_fits(tokens, 16, avail) is fits
