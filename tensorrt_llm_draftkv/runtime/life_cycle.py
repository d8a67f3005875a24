"""Life cycles: which block ordinals a sliding window has made stale.

All coordinates here are absolute token positions and block ordinals
(ordinal i covers positions [i*P, (i+1)*P)).
"""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class LifeCycle:
    """An attention window (None = full attention) and its sink blocks."""

    window: int | None = None
    sink_blocks: int = 0

    def __post_init__(self) -> None:
        if self.window is not None and self.window < 1:
            raise ValueError(f"attention window must be >= 1 token, got window={self.window}")
        if self.sink_blocks < 0:
            raise ValueError(f"sink_blocks must be >= 0, got {self.sink_blocks}")

    def widened(self, tokens: int) -> "LifeCycle":
        """The same life cycle keeping `tokens` more below its window (full attention unchanged)."""
        if tokens < 0:
            raise ValueError(f"cannot widen a window by a negative amount ({tokens} tokens)")
        if self.window is None or tokens == 0:
            return self
        return LifeCycle(self.window + tokens, self.sink_blocks)

    def stale_range(self, history: int, tokens_per_block: int) -> tuple[int, int]:
        """Block ordinals `[lo, hi)` no longer attended once `history` tokens are history.

        The next query sits at position `history` and sees `[history + 1 - W, history]`,
        so every block wholly below `history + 1 - W` is stale, except the sink blocks.
        Empty (lo == hi) for full attention.
        """
        if history < 0:
            raise ValueError(f"history length must be >= 0, got {history}")
        if tokens_per_block < 1:
            raise ValueError(f"tokens_per_block must be >= 1, got {tokens_per_block}")
        lo = min(-(-history // tokens_per_block), self.sink_blocks)
        if self.window is None:
            return lo, lo
        hi = max(lo, (history + 1 - self.window) // tokens_per_block)
        return lo, hi
