"""Deterministic token features standing in for the target model's hidden states.

A DFlash drafter projects the target's hidden states of every position whose
target K/V was computed. Here a hidden state is built from token identities
only, so a drafter with hand-set weights can *look things up* in its context
and any misaddressed read shows up as lower acceptance.

``hidden_states(tokens, positions, next_tokens)[i]`` is the concatenation of
``history + 1`` sections of ``dim`` numbers each:

* section ``k < history``: ``E[tokens[pos - k]]`` (zeros where ``pos - k < 0``),
* the last section: ``E[next_tokens[i]]``, the target's greedy next token at
  that position (for an accepted position it equals ``tokens[pos + 1]``).

``E`` is a fixed random ``vocab × dim`` table of unit rows, spread out so that
rows are as close to orthogonal as ``dim`` allows.
"""
from __future__ import annotations

import random
from typing import Sequence

import torch


class TokenFeatures:
    """``E`` (``vocab_size × dim``) and the hidden-state function built from it."""

    def __init__(
        self,
        vocab_size: int,
        dim: int,
        history: int,
        seed: int = 0,
        *,
        device: str | torch.device = "cpu",
        dtype: torch.dtype = torch.float32,
        candidates: int = 8192,
    ) -> None:
        if vocab_size < 2 or dim < 2 or history < 1:
            raise ValueError(
                f"need vocab_size >= 2, dim >= 2, history >= 1 (got {vocab_size}, {dim}, {history})"
            )
        self.vocab_size = vocab_size
        self.dim = dim
        self.history = history
        self.seed = seed
        # Farthest-point picks from a fixed random candidate set: every new row is
        # the candidate least similar to the rows already taken, so a content
        # match wins a softmax by a clear margin. Deterministic in `seed`.
        gen = torch.Generator().manual_seed(seed)
        cands = torch.randn(max(candidates, vocab_size), dim, generator=gen, dtype=torch.float64)
        cands = cands / cands.norm(dim=1, keepdim=True)
        chosen = [0]
        closest = cands @ cands[0]
        for _ in range(vocab_size - 1):
            i = int(torch.argmin(closest))
            chosen.append(i)
            closest = torch.maximum(closest, cands @ cands[i])
        table = cands[chosen]
        self.E = table.to(dtype=dtype, device=device)

    @property
    def feature_dim(self) -> int:
        return (self.history + 1) * self.dim

    def section(self, k: int) -> slice:
        """Columns of section ``k`` (``k == history`` is the next-token section)."""
        if not 0 <= k <= self.history:
            raise IndexError(f"section {k} out of range [0, {self.history}]")
        return slice(k * self.dim, (k + 1) * self.dim)

    def max_cross_similarity(self) -> float:
        gram = self.E.double() @ self.E.double().T
        gram.fill_diagonal_(-1.0)
        return float(gram.max())

    def to(self, device: str | torch.device) -> "TokenFeatures":
        self.E = self.E.to(device)
        return self

    def hidden_states(
        self, tokens: torch.Tensor, positions: torch.Tensor, next_tokens: torch.Tensor
    ) -> torch.Tensor:
        """``[N, (history + 1) * dim]`` hidden states of ``positions`` of ``tokens``."""
        tokens = torch.as_tensor(tokens, dtype=torch.long, device=self.E.device)
        positions = torch.as_tensor(positions, dtype=torch.long, device=self.E.device).reshape(-1)
        next_tokens = torch.as_tensor(next_tokens, dtype=torch.long, device=self.E.device).reshape(-1)
        if positions.numel() != next_tokens.numel():
            raise ValueError(f"{positions.numel()} positions but {next_tokens.numel()} next tokens")
        if positions.numel() and (int(positions.max()) >= tokens.numel() or int(positions.min()) < 0):
            raise IndexError(
                f"positions must lie in [0, {tokens.numel()}), got [{int(positions.min())}, {int(positions.max())}]"
            )
        n = positions.numel()
        out = torch.zeros(n, self.feature_dim, dtype=self.E.dtype, device=self.E.device)
        for k in range(self.history):
            src = positions - k
            ok = src >= 0
            ids = tokens[src.clamp_min(0)]
            out[:, self.section(k)] = torch.where(ok[:, None], self.E[ids], 0.0)
        out[:, self.section(self.history)] = self.E[next_tokens]
        return out


def phrase_stream(
    length: int,
    *,
    vocab_size: int,
    phrase_len: int,
    num_phrases: int,
    seed: int = 0,
) -> list[int]:
    """A token stream of randomly chosen phrases, each phrase of distinct tokens.

    Within a phrase the next token is a function of the current one, so a
    drafter that finds an earlier occurrence of its bonus token continues the
    phrase correctly until the phrase ends. Phrases share no token when the
    vocabulary is large enough (``phrase_len * num_phrases <= vocab_size``).
    """
    if phrase_len > vocab_size:
        raise ValueError(f"a phrase of {phrase_len} distinct tokens needs vocab_size >= {phrase_len}")
    rng = random.Random(seed)
    if phrase_len * num_phrases <= vocab_size:
        pool = rng.sample(range(vocab_size), phrase_len * num_phrases)
        phrases = [pool[i * phrase_len : (i + 1) * phrase_len] for i in range(num_phrases)]
    else:
        phrases = [rng.sample(range(vocab_size), phrase_len) for _ in range(num_phrases)]
    out: list[int] = []
    while len(out) < length:
        out.extend(rng.choice(phrases))
    return out[:length]


def acceptance(drafts: Sequence[int], truth: Sequence[int]) -> int:
    """Number of leading drafts equal to the truth."""
    n = 0
    for d, t in zip(drafts, truth):
        if d != t:
            break
        n += 1
    return n
