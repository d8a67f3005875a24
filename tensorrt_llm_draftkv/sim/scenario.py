"""The embedded scenarios: tiny model dimensions, long prompts, the runs to compare."""
from __future__ import annotations

from dataclasses import dataclass, field, replace

from ..config import SpeculativeDecodingMode


@dataclass(frozen=True)
class SimSetup:
    """Geometry of the tiny target, the drafter and both pools.

    Pools are sized by the estimator for `pool_requests` concurrent requests,
    exactly as a deployment would size them; nothing is padded for the demo.
    """

    drafter: SpeculativeDecodingMode = SpeculativeDecodingMode.DFLASH
    tokens_per_block: int = 32
    target_window: int | None = 4096
    draft_window: int = 4096
    chunk: int = 8192
    max_draft_len: int = 7
    vocab_size: int = 256
    target_dim: int = 32
    draft_kv_heads: int = 1
    draft_head_dim: int = 16
    pool_requests: int = 8
    max_new_tokens: int = 128
    drafter_slots: int = 8
    trail_page: bool = True
    device: str = "cpu"
    max_seq_len: int = 524288 + 1024

    @property
    def block_size(self) -> int:
        return self.max_draft_len + 1

    @property
    def draft_extra_tokens(self) -> int:
        """The drafter appends its block above the accepted tokens in the same step."""
        return self.block_size


@dataclass(frozen=True)
class RunSpec:
    """One run: prompts arriving in order, at most `max_concurrency` in flight."""

    name: str
    mode: str  # "aggregated" or "disaggregated"
    prompts: tuple[int, ...]
    max_concurrency: int
    drafter_slots: int | None = None
    draft_window: int | None = None  # overrides the setup's for this run
    max_new_tokens: int | None = None  # overrides the setup's for this run

    def setup_for(self, setup: SimSetup) -> SimSetup:
        """The setup this run uses: the scenario's, with this run's overrides."""
        changes = {}
        if self.draft_window is not None:
            changes["draft_window"] = self.draft_window
        if self.max_new_tokens is not None:
            changes["max_new_tokens"] = self.max_new_tokens
        return replace(setup, **changes) if changes else setup

    def __post_init__(self) -> None:
        if self.mode not in ("aggregated", "disaggregated"):
            raise ValueError(f"run {self.name}: mode must be 'aggregated' or 'disaggregated', got {self.mode!r}")
        if not self.prompts or min(self.prompts) < 1:
            raise ValueError(f"run {self.name}: prompts must be positive token counts, got {self.prompts}")


@dataclass(frozen=True)
class Scenario:
    setup: SimSetup = field(default_factory=SimSetup)
    runs: tuple[RunSpec, ...] = ()

    def with_setup(self, **changes) -> "Scenario":
        return replace(self, setup=replace(self.setup, **changes))


DEFAULT_SCENARIO = Scenario(
    runs=(
        # A chat-sized request owns the low draft pages while a 16k prompt, which
        # even the legacy pool can hold, decodes on the generation worker.
        RunSpec("disagg-16k", "disaggregated", (1000, 16385), 2),
        # Long prompts, most of them not page multiples (seeds then trail by up to
        # P - 1 tokens; 131,071 is one short of a window boundary).
        RunSpec("agg-long", "aggregated", (32768, 131071, 131072, 262145, 524287), 3, drafter_slots=2),
        RunSpec("disagg-long", "disaggregated", (32768, 131071, 262145, 524287), 2),
        # More requests in flight than the generation worker has drafter slots:
        # slots are evicted and reseeded there, at odd positions.
        RunSpec(
            "disagg-evict", "disaggregated", (1023, 2049, 3001, 4095, 5119), 4, drafter_slots=2, max_new_tokens=48
        ),
        # A short draft window and long generations: a seeded slot's window reaches
        # below the seed page, which only the trail page keeps backed.
        RunSpec(
            "disagg-window", "disaggregated", (1023, 4095, 8191), 3, draft_window=256, max_new_tokens=384
        ),
    )
)


def prompt_seed(length: int, occurrence: int) -> int:
    """Prompts are identified by length and occurrence, so every run sees the same texts."""
    return 7919 * length + occurrence


def prompt_seeds(prompts: tuple[int, ...]) -> list[int]:
    seen: dict[int, int] = {}
    seeds = []
    for length in prompts:
        seeds.append(prompt_seed(length, seen.get(length, 0)))
        seen[length] = seen.get(length, 0) + 1
    return seeds
