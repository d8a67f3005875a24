"""The DFlash drafter side: slots and their bases, the toy drafter, the ownership checker.

``DFlashSpecMetadata`` (slots, seeding, rebased reads, rollback; its module
docstring lists the executor's calls in order), ``DFlashDrafter`` (stores target
hidden states as K/V in the draft pool and block-decodes drafts),
``TokenFeatures`` (deterministic stand-in for the target's hidden states),
``OwnershipChecker`` (invariants 1 and 2 on real tensors), the pure seeding and
store-start rules in ``slot_rules``, and ``DraftLoop``, a minimal executor loop
that drives them exactly in that order (tests and examples).
"""
from .dflash_metadata import (
    ContextStorePlan,
    DFlashSpecMetadata,
    NoFreeSlotError,
    Row,
    SlotSnapshot,
    required_extra_kv_tokens,
)
from .drafter import DFlashDrafter, DFlashDrafterConfig
from .features import TokenFeatures, acceptance, phrase_stream
from .loop import DraftLoop, StepResult
from .ownership import OwnershipChecker, OwnershipViolation
from .slot_rules import Seeding, SlotStart, context_store_start, generation_seed, page_aligned_seed

__all__ = [
    "ContextStorePlan",
    "DFlashDrafter",
    "DFlashDrafterConfig",
    "DFlashSpecMetadata",
    "DraftLoop",
    "NoFreeSlotError",
    "OwnershipChecker",
    "OwnershipViolation",
    "Row",
    "Seeding",
    "SlotSnapshot",
    "SlotStart",
    "StepResult",
    "TokenFeatures",
    "acceptance",
    "context_store_start",
    "generation_seed",
    "page_aligned_seed",
    "phrase_stream",
    "required_extra_kv_tokens",
]
