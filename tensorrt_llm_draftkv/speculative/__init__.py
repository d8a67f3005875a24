"""The DFlash drafter's side of the draft pool: slots, their bases, and each step's addressing.

``slot_rules`` holds the pure rules for where a slot starts, ``slot_table`` the
slots themselves, ``addressing`` where each row reads and writes, and
``DFlashSpecMetadata`` drives them step by step for the executor; ``handoff``
describes the drafter context a disaggregated context worker hands over.
"""
from .addressing import ContextStorePlan, Row, required_extra_kv_tokens
from .dflash_metadata import DFlashSpecMetadata
from .handoff import (
    DrafterContextGeometry,
    DrafterContextMismatch,
    DrafterHandoff,
    HandoffBytes,
    HandoffForm,
    handoff_bytes,
)
from .slot_rules import Seeding, SlotStart, StartRules, context_store_start, generation_seed, page_aligned_seed
from .slot_table import NoFreeSlotError, SlotSnapshot, SlotTable

__all__ = [
    "ContextStorePlan",
    "DFlashSpecMetadata",
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
    "StartRules",
    "context_store_start",
    "generation_seed",
    "handoff_bytes",
    "page_aligned_seed",
    "required_extra_kv_tokens",
]
