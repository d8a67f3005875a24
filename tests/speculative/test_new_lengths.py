"""The generation step's new slot lengths: the batch-wide path (rows' room known) against the per-row one.

`addressing._new_lengths` takes a batch-wide path when the caller passes each row's mirror capacity:
valid counts, one row per slot, generation rows only. It must give the same lengths, and call the
per-row room check (which raises) for exactly the rows without room; any other batch takes the
per-row path and its errors.
"""
from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from tensorrt_llm_draftkv.speculative.addressing import Row, _new_lengths
from tensorrt_llm_draftkv.speculative.slot_table import SlotTable

BLOCK, MAX_NEW = 4, 3


def _table(lengths: list[int], *, arena: bool) -> SlotTable:
    table = SlotTable(len(lengths), 1, tokens_per_block=8, max_ctx_len=40, device=torch.device("cpu"))
    table.private_arena = arena
    table._ctx_host = list(lengths) + [0]
    return table


class _Req:
    def __init__(self, rid: int) -> None:
        self.py_request_id = rid


@settings(deadline=None, max_examples=80)
@given(
    data=st.lists(st.tuples(st.integers(0, 60), st.integers(0, MAX_NEW), st.integers(0, 80), st.booleans()),
                  min_size=1, max_size=8),
    arena=st.booleans(),
)
def test_the_batch_path_gives_the_per_row_lengths_and_room_checks(data, arena):
    table = _table([d[0] for d in data], arena=arena)
    rows = [Row(_Req(i), i, "generation", proposing) for i, (_, _, _, proposing) in enumerate(data)]
    counts = [d[1] for d in data]
    capacities = [d[2] for d in data]
    short: list[tuple[int, int]] = []

    def check_room(row: Row, new: int) -> None:  # records instead of raising: every call is compared
        if new + BLOCK > capacities[row.slot]:
            short.append((row.slot, new))

    per_row = _new_lengths(table, rows, counts, MAX_NEW, check_room)
    expected_short, short[:] = list(short), []
    batch = _new_lengths(table, rows, counts, MAX_NEW, check_room, (capacities, BLOCK))
    assert batch == per_row
    assert short == expected_short


def test_bad_counts_and_shared_slots_take_the_per_row_path_and_its_errors():
    table = _table([5, 9], arena=False)
    rows = [Row(_Req(1), 0, "generation", True), Row(_Req(2), 1, "generation", True)]
    room = ([100, 100], BLOCK)
    with pytest.raises(ValueError, match=r"request 2 commits 4 tokens; allowed 0..3"):
        _new_lengths(table, rows, [1, 4], MAX_NEW, lambda row, new: None, room)
    shared = [Row(_Req(1), 0, "generation", True), Row(_Req(2), 0, "generation", True)]
    with pytest.raises(ValueError, match="rows sharing slot 0 disagree"):
        _new_lengths(table, shared, [1, 2], MAX_NEW, lambda row, new: None, room)
    context = [Row(_Req(1), 0, "context", True), Row(_Req(2), 1, "generation", True)]
    with pytest.raises(ValueError, match="request 1 is a context row"):
        _new_lengths(table, context, [1, 0], MAX_NEW, lambda row, new: None, room)


@settings(deadline=None, max_examples=60)
@given(
    slots=st.lists(st.tuples(st.integers(0, 200), st.integers(0, 12)), min_size=1, max_size=8),
    arena=st.booleans(),
)
def test_raised_bases_are_each_slots_clamped_base(slots, arena):
    """`raise_bases` (the batch's bases in one pass, one device copy) leaves every slot's base, host and device,
    at `clamped_base` of its new length, and no other slot's."""
    table = _table([0] * len(slots), arena=arena)
    table._base_host = [b for _, b in slots] + [3]
    table.base_pages.copy_(torch.tensor(table._base_host))
    lengths = {i: length for i, (length, _) in enumerate(slots) if i % 2 == 0 or length > 50}
    want = [table.clamped_base(lengths[i], b) if i in lengths else b for i, (_, b) in enumerate(slots)] + [3]
    table.raise_bases(lengths)
    assert table._base_host == want
    assert table.base_pages.tolist() == want
