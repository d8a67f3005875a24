"""Helpers the test modules share (import as `from support import ...`; tests/conftest.py puts this folder on the path)."""
from __future__ import annotations

from dataclasses import replace

from tensorrt_llm_draftkv.sim import SimSetup, phrase_stream

# Chunk 512, windows 256/256, 16-token pages, 64 new tokens: each simulator run takes a fraction of a second.
SMALL = replace(
    SimSetup(),
    chunk=512,
    target_window=256,
    draft_window=256,
    tokens_per_block=16,
    max_new_tokens=64,
    pool_requests=4,
    max_seq_len=8192,
)


def ceil_div(a: int, b: int) -> int:
    return -(-a // b)


def truth(n: int, seed: int = 0) -> list[int]:
    """A ground-truth token stream of repeated phrases (64-token vocabulary)."""
    return phrase_stream(n, vocab_size=64, phrase_len=8, num_phrases=6, seed=seed)
