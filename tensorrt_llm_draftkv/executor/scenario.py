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
        RunSpec("disagg-16k", "disaggregated", (1024, 16384), 2),
        RunSpec("agg-long", "aggregated", (32768, 131072, 131072, 262144, 524288), 3, drafter_slots=2),
        RunSpec("disagg-long", "disaggregated", (32768, 131072, 262144, 524288), 2),
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
