"""Triton kernels for draft-KV block tables, their torch references and dispatch.

``decode_draft_block_table`` turns one pool's exported block offsets into page
tables and extents; ``rebase_block_table`` shifts rows past their base pages;
``prepare_paged_latent`` does a DFlash generation step's whole preparation in
one launch, from decoded tables (two-step form) or straight from the exported
block offsets (one-pass form: decode, extents, rebase and preparation in one
pass) or straight from a manager's device block table (ring form).
``BoundPreparation`` and ``BoundRingPreparation`` relaunch one one-pass or ring
call over fixed tensors without checking it again. ``prepare_ring_staged`` (and
``BoundStagedRing``) is the ring form with each row's scalars staged by the host,
so the launch makes two rounds of device reads instead of three. Each kernel has a
``*_reference`` twin in plain torch; see ``spec_tail_kernels.py`` for the
coordinates and the dispatch rules.
"""
from ._dispatch import HAVE_TRITON, LAUNCH_COUNTS, triton_runs
from .bound_preparation import BoundPreparation
from .bound_ring import BoundRingPreparation
from .reference import ring_entries
from .staged_ring import (
    ROW_SCALARS,
    ROW_WIDTH,
    BoundStagedRing,
    prepare_ring_staged,
    prepare_ring_staged_reference,
    stage_row_scalars,
)
from .spec_tail_kernels import (
    BlockTables,
    PagedLatentPrep,
    RebasedTables,
    decode_draft_block_table,
    decode_draft_block_table_reference,
    prepare_paged_latent,
    prepare_paged_latent_one_pass_reference,
    prepare_paged_latent_reference,
    prepare_paged_latent_ring_reference,
    rebase_block_table,
    rebase_block_table_reference,
)

__all__ = [
    "BoundPreparation",
    "BoundRingPreparation",
    "BoundStagedRing",
    "HAVE_TRITON",
    "LAUNCH_COUNTS",
    "BlockTables",
    "PagedLatentPrep",
    "ROW_SCALARS",
    "ROW_WIDTH",
    "RebasedTables",
    "decode_draft_block_table",
    "decode_draft_block_table_reference",
    "prepare_paged_latent",
    "prepare_paged_latent_one_pass_reference",
    "prepare_paged_latent_reference",
    "prepare_paged_latent_ring_reference",
    "prepare_ring_staged",
    "prepare_ring_staged_reference",
    "rebase_block_table",
    "rebase_block_table_reference",
    "ring_entries",
    "stage_row_scalars",
    "triton_runs",
]
