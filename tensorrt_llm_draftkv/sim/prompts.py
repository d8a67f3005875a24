"""Prompts built from repeated random phrases, one private phrase bank per request.

Inside a phrase every token is distinct, so attention over the context can
continue a phrase exactly; banks differ between requests, so reading another
request's context predicts the wrong continuation.
"""
from __future__ import annotations

import torch


def phrase_bank(seed: int, vocab_size: int, num_phrases: int, phrase_len: int) -> torch.Tensor:
    """`[num_phrases, phrase_len]` distinct token ids drawn from the vocabulary."""
    if num_phrases * phrase_len > vocab_size:
        raise ValueError(
            f"{num_phrases} phrases of {phrase_len} distinct tokens need a vocabulary of "
            f"{num_phrases * phrase_len}, got {vocab_size}"
        )
    gen = torch.Generator().manual_seed(seed)
    return torch.randperm(vocab_size, generator=gen)[: num_phrases * phrase_len].view(num_phrases, phrase_len)


def phrase_prompt(
    seed: int, length: int, *, vocab_size: int = 256, num_phrases: int = 6, phrase_len: int = 24
) -> torch.Tensor:
    """`length` token ids: phrases of the request's own bank in random order (int64)."""
    if length < 1:
        raise ValueError(f"a prompt needs >= 1 token, got {length}")
    bank = phrase_bank(seed, vocab_size, num_phrases, phrase_len)
    gen = torch.Generator().manual_seed(seed + 1)
    picks = torch.randint(0, num_phrases, (length // phrase_len + 1,), generator=gen)
    return bank[picks].reshape(-1)[:length].clone()
