"""The DFlash drafter's side of the draft pool: slots, their bases, and each step's addressing.

``DFlashSpecMetadata`` keeps the slots and prepares every step; ``slot_rules``
holds the pure rules for where a slot starts.
"""
from .dflash_metadata import (
    ContextStorePlan,
    DFlashSpecMetadata,
    NoFreeSlotError,
    Row,
    SlotSnapshot,
    required_extra_kv_tokens,
)
from .slot_rules import Seeding, SlotStart, context_store_start, generation_seed, page_aligned_seed

__all__ = [
    "ContextStorePlan",
    "DFlashSpecMetadata",
    "NoFreeSlotError",
    "Row",
    "Seeding",
    "SlotSnapshot",
    "SlotStart",
    "context_store_start",
    "generation_seed",
    "page_aligned_seed",
    "required_extra_kv_tokens",
]
