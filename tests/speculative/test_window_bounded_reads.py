"""A long prompt on a short drafter window: the generation step's read rows hold only the request's pages.

A 70,001-token prompt on a 1,024-token DFlash draft window (32-token pages): by
the time the first generation step runs, the mirror has released every page
below the window. Upstream's layout (``read_bound="base"``) still hands a
consumer rows from the slot base, thousands of ordinals wide, whose entries are
released (-1, or page 0 under the ``cpp`` export, a page another request may
own), with ``read_lens`` covering the whole prompt. The default rows start at the
window, so a kernel that reads ``[0, read_lens + block_size)`` tokens of them,
and nothing else, stays on the request's own pages.
"""
from __future__ import annotations

import pytest

from executor_fixture import DraftExecutor

PROMPT, WINDOW, P, BS, STEPS = 70_001, 1024, 32, 4, 16


def run(backend: str, read_bound: str, fused: bool = False):
    loop = DraftExecutor.build(windows=(WINDOW,), tokens_per_block=P, block_size=BS, pages=400,
                               max_seq_len=PROMPT + 256, max_batch_size=2, backend=backend, fused=fused)
    loop.meta.read_bound = read_bound
    first = loop.add_context_request(1, PROMPT, chunk=4096)  # chunked prefill: the pool holds the window only
    loop.add_context_request(2, 2000, chunk=1024)  # a neighbour whose pages the released entries may name
    while not first.is_generation_in_progress_state:
        loop.step(chunks={1: 4096, 2: 1024})
    seen = []
    for _ in range(STEPS):
        loop.step(accepted={1: 1, 2: 2})
        prep = loop.worker.generation_prep()[0]
        row = loop.meta.row_index(1)
        # the row after the step: update_resources has trimmed the block's headroom page, so only the
        # ordinals it still has are compared here (the fixture checked every entry during the step)
        row_now = loop.dm.get_batch_cache_indices([1])[0]
        held = set(row_now) - {-1}
        length, shift = int(prep.read_lens[row]), int(prep.shift[row])
        cols = -(-(length + BS) // P)  # what a consumer of [0, read_lens + block) reads
        entries = [e for j, e in enumerate(prep.read_rows[row, :cols].tolist()) if shift + j < len(row_now)]
        seen.append((length, len(prep.read_rows[row]), sum(e not in held for e in entries), len(entries)))
    loop.ledger.assert_clean()  # the drafter's reads and, by default, every read-row entry: its own pages
    return seen


@pytest.mark.parametrize("backend", ["cpp", "python"])
def test_default_rows_cover_only_the_window_and_the_requests_pages(backend):
    seen = run(backend, "window")
    for length, width, foreign, _ in seen:
        assert length < WINDOW - BS + P  # the window's context from its first page, not the prompt
        assert width == WINDOW // P + 1  # ceil(W / P) + 1 columns, whatever the prompt length
        assert foreign == 0


def test_upstream_layout_is_kept_and_reads_released_pages():
    """``read_bound="base"``: the rows of the pre-window layout, wide as the prompt, mostly released."""
    seen = run("cpp", "base")
    for length, width, foreign, read in seen:
        assert length > PROMPT  # the whole prompt (plus accepted tokens) from base 0
        assert width >= PROMPT // P
        assert foreign > 0.9 * read  # almost every entry below the window is released


def test_fused_path_agrees():
    assert run("cpp", "window", fused=True) == run("cpp", "window", fused=False)
