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
    shared_page_writes: int = 0  # drafter writes to shared or published pages (block reuse)
    slot_reseeds: int = 0
    max_seed_lag_tokens: int = 0
    handoff_seeds: int = 0  # generation slots seeded from a received drafter context
    reseeds_without_handoff: int = 0  # reseeds after a slot loss of requests that had one: nothing to draw on
    handoff_fallbacks: int = 0  # drafter contexts of another geometry dropped for the empty seed (fallback on)
    drafter_bytes_sent: int = 0  # drafter-context bytes the generation worker received and wrote
    full_drafter_bytes: int = 0  # what the drafter context of every whole prompt would have cost
    #: per request: (prompt length, drafter-context bytes received, bytes of its whole prompt's drafter context)
    drafter_bytes_by_request: dict[int, tuple[int, int, int]] = field(default_factory=dict)
    #: per request: prompt tokens a prefix hit let it skip (block reuse; on the context worker when disaggregated)
    reused_tokens: dict[int, int] = field(default_factory=dict)
    reused_positions_checked: int = 0  # target K/V positions of reused pages checked against the tokens
    #: generation worker (disaggregated): per request, the prefix its own pools adopted at generation init
    gen_reused_tokens: dict[int, int] = field(default_factory=dict)
    gen_reused_positions_checked: int = 0  # target K/V positions of those pages checked against the tokens
    handoff_bytes_sent: int = 0  # target K/V + drafter context the generation worker received
    handoff_bytes_without_gen_reuse: int = 0  # what the same handoff would have cost without the round trip
    #: disaggregated runs: the transfer engine (`nixl` or `torch`); per request that failed in transfer, why
    transport: str | None = None
    transfer_failures: dict[int, str] = field(default_factory=dict)
    transfer_bytes: int = 0  # context worker: bytes its transfers moved (every layer's pages, auxiliary slots)
    transfer_pages: int = 0  # context worker: pages (per layer group) its transfers wrote
    #: pages still held (every pool of both managers) once every request finished; -1 if not checked
    pages_held_at_end: int = -1
    cached_free_pages_at_end: int = 0  # of the rest: published pages kept for later hits
    peak_draft_pages_per_request: int = 0
    skipped_warmups: int = 0
    generation_steps: int = 0
    accepted_tokens: int = 0
    generated_tokens: int = 0
    steps: int = 0
    wall_s: float = 0.0
    draft_pool_occupancy: list[int] = field(default_factory=list)
    #: per step, beside `draft_pool_occupancy`: the requests holding a draft mirror (what the estimate is per)
    draft_requests_per_step: list[int] = field(default_factory=list)
    outputs: dict[int, list[int]] = field(default_factory=dict)
    #: disaggregated runs (the generation worker's stats): the context worker's own, outputs dropped
    context_worker: "RunStats | None" = None

    @property
    def pages_held_by_both(self) -> int:
        """Pages still held at the end on this worker and, when disaggregated, on the context worker too
        (-1 if either was not checked: a request did not finish)."""
        counts = [self.pages_held_at_end]
        if self.context_worker is not None:
            counts.append(self.context_worker.pages_held_at_end)
        return -1 if min(counts) < 0 else sum(counts)

    @property
    def acceptance_length(self) -> float:
        """Mean tokens a generation step adds per request (accepted drafts + the bonus)."""
        return self.accepted_tokens / self.generation_steps if self.generation_steps else 0.0

    @property
    def prefill_tokens_saved(self) -> int:
        """Prompt tokens no worker computed thanks to prefix hits (target and drafter)."""
        return sum(self.reused_tokens.values())

    @property
    def handoff_bytes_saved(self) -> int:
        """Handoff bytes the generation worker's prefix hits kept off the wire."""
        return self.handoff_bytes_without_gen_reuse - self.handoff_bytes_sent

    @property
    def tokens_per_s(self) -> float:
        return self.generated_tokens / self.wall_s if self.wall_s > 0 else 0.0


#: What the drafter's ownership checker and slot bookkeeping report into RunStats.
SPECULATOR_COUNTERS = (
    "foreign_page_accesses",
    "stale_reads",
    "unbacked_accesses",
    "accounting_errors",
    "shared_page_writes",
    "slot_reseeds",
    "max_seed_lag_tokens",
    "handoff_seeds",
    "reseeds_without_handoff",
)
