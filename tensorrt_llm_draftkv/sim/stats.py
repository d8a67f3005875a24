"""What an executor run reports: counts, the drafter's checker and slot counters, outputs."""
from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class RunStats:
    """Counts of one executor run; `outputs`: each finished request's generated tokens."""

    finished: int = 0
    resize_failures: int = 0
    refused_requests: int = 0  # refused at admission (the pool's charge does not cover them)
    first_error: str = ""
    foreign_page_accesses: int = 0
    stale_reads: int = 0
    unbacked_accesses: int = 0
    accounting_errors: int = 0
    slot_reseeds: int = 0
    max_seed_lag_tokens: int = 0
    handoff_seeds: int = 0  # generation slots seeded from a received drafter context
    reseeds_without_handoff: int = 0  # reseeds after a slot loss of requests that had one: nothing to draw on
    handoff_fallbacks: int = 0  # drafter contexts of another geometry dropped for the empty seed (fallback on)
    drafter_bytes_sent: int = 0  # drafter-context bytes the generation worker received and wrote
    full_drafter_bytes: int = 0  # what the drafter context of every whole prompt would have cost
    #: per request: (prompt length, drafter-context bytes received, bytes of its whole prompt's drafter context)
    drafter_bytes_by_request: dict[int, tuple[int, int, int]] = field(default_factory=dict)
    peak_draft_pages_per_request: int = 0
    skipped_warmups: int = 0
    generation_steps: int = 0
    accepted_tokens: int = 0
    generated_tokens: int = 0
    steps: int = 0
    wall_s: float = 0.0
    draft_pool_occupancy: list[int] = field(default_factory=list)
    outputs: dict[int, list[int]] = field(default_factory=dict)

    @property
    def acceptance_length(self) -> float:
        """Mean tokens a generation step adds per request (accepted drafts + the bonus)."""
        return self.accepted_tokens / self.generation_steps if self.generation_steps else 0.0

    @property
    def tokens_per_s(self) -> float:
        return self.generated_tokens / self.wall_s if self.wall_s > 0 else 0.0


#: What the drafter's ownership checker and slot bookkeeping report into RunStats.
SPECULATOR_COUNTERS = (
    "foreign_page_accesses",
    "stale_reads",
    "unbacked_accesses",
    "accounting_errors",
    "slot_reseeds",
    "max_seed_lag_tokens",
    "handoff_seeds",
    "reseeds_without_handoff",
)
