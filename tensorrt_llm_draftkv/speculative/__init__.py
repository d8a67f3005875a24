"""The DFlash drafter's side of the draft pool: slots, their bases, and each step's addressing.

``slot_start`` holds the pure rules for where a slot starts, ``slot_table`` the
slots themselves, ``addressing`` where each row reads and writes, and
``DFlashDraftSlots`` drives them step by step; ``DFlashWorker`` and
``DFlashSpecMetadata`` are upstream's executor-facing objects over them; ``handoff``
describes the drafter context a disaggregated context worker hands over.
"""
from .addressing import ContextStorePlan, Row, required_extra_kv_tokens
from .dflash_metadata import DFlashSpecMetadata
from .dflash_worker import CUDA_GRAPH_DUMMY_REQUEST_ID, DFlashWorker
from .draft_slots import DFlashDraftSlots
from .handoff import (
    DrafterContextGeometry,
    DrafterContextMismatch,
    DrafterHandoff,
    HandoffBytes,
    HandoffForm,
    handoff_bytes,
)
from .slot_start import Seeding, SlotStart, StartRules, context_store_start, generation_seed, page_aligned_seed
from .slot_snapshot import SlotSnapshot
from .slot_table import NoFreeSlotError, SlotTable
from .spec_metadata import SpecMetadata
from .worker_pool import DraftStoreRefused

__all__ = [
    "CUDA_GRAPH_DUMMY_REQUEST_ID",
    "ContextStorePlan",
    "DFlashDraftSlots",
    "DFlashSpecMetadata",
    "DFlashWorker",
    "DraftStoreRefused",
    "DrafterContextGeometry",
    "DrafterContextMismatch",
    "DrafterHandoff",
    "HandoffBytes",
    "HandoffForm",
    "NoFreeSlotError",
    "Row",
    "Seeding",
    "SlotSnapshot",
    "SlotStart",
    "SlotTable",
    "SpecMetadata",
    "StartRules",
    "context_store_start",
    "generation_seed",
    "handoff_bytes",
    "page_aligned_seed",
    "required_extra_kv_tokens",
]
