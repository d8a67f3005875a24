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


#: Seeds of shared prefixes live far from the per-request ones (`scenario.prompt_seed`), so a prefix
#: never repeats a request's own phrase bank by accident.
PREFIX_SEED_BASE = 1 << 40


def prefix_seed(length: int) -> int:
    """The seed of a shared prefix of `length` tokens: every run with that prefix sees the same text."""
    return PREFIX_SEED_BASE + 7919 * length


def shared_prefix_prompts(
    prefix_len: int,
    tail_lens: list[int] | tuple[int, ...],
    tail_seeds: list[int],
    *,
    vocab_size: int = 256,
    prefix: int | None = None,
) -> list[torch.Tensor]:
    """Prompt i = one common prefix of `prefix_len` tokens (positions `[0, prefix_len)`) followed by
    tail i (positions `[prefix_len, prefix_len + tail_lens[i])`).

    The prefix comes from its own seed (`prefix`, default `prefix_seed(prefix_len)`), each tail from its
    own seed (`tail_seeds[i]`): the same call always builds the same tokens. `prefix_len` 0 gives the
    tails alone (plain `phrase_prompt`s).
    """
    if prefix_len < 0:
        raise ValueError(f"a shared prefix needs >= 0 tokens, got {prefix_len}")
    if len(tail_lens) != len(tail_seeds):
        raise ValueError(f"{len(tail_lens)} tails but {len(tail_seeds)} tail seeds")
    tails = [phrase_prompt(seed, n, vocab_size=vocab_size) for seed, n in zip(tail_seeds, tail_lens)]
    if prefix_len == 0:
        return tails
    head = phrase_prompt(prefix_seed(prefix_len) if prefix is None else prefix, prefix_len, vocab_size=vocab_size)
    return [torch.cat([head, tail]) for tail in tails]
