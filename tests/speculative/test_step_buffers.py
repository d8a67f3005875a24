"""`StepBuffers`: the generation step's inputs and outputs kept in place.

A bound launch keys on the tensors it was given, so the same batch size must get the
very same view objects step after step, holding the new values; a larger batch grows
the buffers (new objects) and must still read right.
"""
from __future__ import annotations

import torch

from tensorrt_llm_draftkv.speculative.step_buffers import StepBuffers


def test_the_same_batch_size_gets_the_same_views_with_new_values():
    buffers = StepBuffers(torch.device("cpu"))
    ids = buffers.slot_ids([3, 1, 2])
    counts = buffers.num_new([0, 4, 1])
    out = buffers.out(0, 3, 9, 4, 5)
    assert ids.tolist() == [3, 1, 2] and counts.tolist() == [0, 4, 1]
    assert out.read_rows.shape == (3, 9) and out.query_pos.shape == (3, 4) and out.store_pages.shape == (3, 5)
    again = buffers.slot_ids([2, 3, 1])
    assert again is ids and ids.tolist() == [2, 3, 1]
    assert buffers.num_new([5, 5, 0]) is counts and counts.tolist() == [5, 5, 0]
    assert buffers.out(0, 3, 9, 4, 5) is out
    assert buffers.out(1, 3, 9, 4, 5) is not out  # another pool: its own buffers
    out.read_rows.fill_(-3)
    assert buffers.out(1, 3, 9, 4, 5).read_rows.data_ptr() != out.read_rows.data_ptr()


def test_a_larger_batch_grows_the_buffers_and_a_smaller_one_reads_its_prefix():
    buffers = StepBuffers(torch.device("cpu"))
    small = buffers.slot_ids(list(range(8)))
    big = buffers.slot_ids(list(range(100, 130)))
    assert big.tolist() == list(range(100, 130)) and big.data_ptr() != small.data_ptr()
    assert buffers.slot_ids([100, 101]).tolist() == [100, 101]  # unchanged prefix: nothing written
    assert buffers.slot_ids([7, 101]).tolist() == [7, 101]
    assert buffers.num_new(list(range(40))).tolist() == list(range(40))
    wide = buffers.out(0, 40, 9, 4, 5)
    assert wide.read_rows.shape == (40, 9)
    assert buffers.num_new([]).numel() == 0
