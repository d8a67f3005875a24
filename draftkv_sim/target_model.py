"""A tiny deterministic target model with real paged attention.

One attention layer per layer of the target manager's pools, all computing
the same *induction* head: the key at position s is the embedding of token
s-1, the value the embedding of token s, the query at p the embedding of
token p. Attending over its window, position p finds earlier places where its
token occurred and predicts what followed them, so on prompts built from
repeated phrases it continues the phrase. A small fixed bigram bias breaks
ties deterministically. K/V live in the manager's pages and every access goes
through the request's block table: an unbacked entry inside the attended span
is an error, never a silent read of page 0.

Coordinates: absolute token positions; block ordinal = position // P.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from tensorrt_llm_draftkv.manager import KVCacheManagerV2
from tensorrt_llm_draftkv.runtime import BAD_PAGE_INDEX


@dataclass(frozen=True)
class TinyTargetConfig:
    vocab_size: int = 256
    dim: int = 32
    seed: int = 1234
    attention_scale: float = 40.0
    logit_scale: float = 4.0
    bigram_scale: float = 0.05


class UnbackedAccessError(RuntimeError):
    pass


class TinyTarget:
    """Greedy next-token predictions from K/V stored in a KVCacheManagerV2's pools."""

    def __init__(self, config: TinyTargetConfig, manager: KVCacheManagerV2) -> None:
        cache_cfg = manager.config
        if cache_cfg.num_kv_heads != 1 or cache_cfg.head_dim != config.dim:
            raise ValueError(
                f"the tiny target needs 1 KV head of dim {config.dim}; the pool has "
                f"{cache_cfg.num_kv_heads} heads of dim {cache_cfg.head_dim}"
            )
        self.config = config
        self.manager = manager
        gen = torch.Generator().manual_seed(config.seed)
        dtype, device = cache_cfg.dtype, cache_cfg.device
        emb = torch.randn(config.vocab_size, config.dim, generator=gen, dtype=torch.float64)
        self.embedding = (emb / emb.norm(dim=1, keepdim=True)).to(device=device, dtype=dtype)
        bigram = torch.randn(config.vocab_size, config.vocab_size, generator=gen, dtype=torch.float64)
        self.bigram = (config.bigram_scale * bigram).to(device=device, dtype=dtype)
        self.P = cache_cfg.tokens_per_block
        self.device = torch.device(device)

    # -- addressing ---------------------------------------------------------------
    def _flat_rows(self, request_id: int, group: int, start: int, end: int, what: str) -> tuple[torch.Tensor, torch.Tensor]:
        """Rows of the layer storage viewed as [pages * 2 * P, dim] holding K and V of [start, end)."""
        cache = self.manager.get_cache(request_id)
        lo_block, hi_block = start // self.P, (end - 1) // self.P + 1
        pages = torch.tensor(cache.block_row_slice(group, lo_block, hi_block), dtype=torch.long)
        pos = torch.arange(start, end)
        page_of = pages[pos // self.P - lo_block]
        if bool((page_of == BAD_PAGE_INDEX).any()):
            bad = int(pos[page_of == BAD_PAGE_INDEX][0])
            raise UnbackedAccessError(
                f"request {request_id}: {what} at position {bad}, which no page of layer group {group} backs"
            )
        key_rows = page_of * (2 * self.P) + pos % self.P
        return key_rows.to(self.device), (key_rows + self.P).to(self.device)

    def _layers(self, group: int) -> list[torch.Tensor]:
        return [layer.view(-1, self.config.dim) for layer in self.manager.layer_groups[group].pool.layers]

    # -- storage ------------------------------------------------------------------
    def write_kv(self, request_id: int, tokens: torch.Tensor, start: int, end: int) -> None:
        """Store K/V for positions [start, end) of a request (tokens: its token ids, on device)."""
        if end <= start:
            return
        pos = torch.arange(start, end, device=tokens.device)
        prev = tokens[(pos - 1).clamp(min=0)]
        keys = self.embedding[prev] * (pos > 0).unsqueeze(1).to(self.embedding.dtype)
        values = self.embedding[tokens[start:end]]
        self.write_kv_values(request_id, start, keys, values)

    def write_kv_values(
        self, request_id: int, start: int, keys: torch.Tensor, values: torch.Tensor, groups: list[int] | None = None
    ) -> None:
        """Store given K/V rows (shared by every layer) at positions [start, start + n)."""
        end = start + keys.shape[0]
        for g in range(self.manager.num_pools) if groups is None else groups:
            k_rows, v_rows = self._flat_rows(request_id, g, start, end, "write")
            for layer in self._layers(g):
                # Received K/V may arrive on the wire's device (gloo: CPU).
                layer.index_copy_(0, k_rows, keys.to(layer.device, layer.dtype))
                layer.index_copy_(0, v_rows, values.to(layer.device, layer.dtype))

    def expected_kv(self, tokens: torch.Tensor, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V this model writes at absolute `positions` of a request holding `tokens` (see `write_kv`)."""
        pos = positions.to(tokens.device)
        prev = tokens[(pos - 1).clamp(min=0)]
        keys = self.embedding[prev] * (pos > 0).unsqueeze(1).to(self.embedding.dtype)
        return keys, self.embedding[tokens[pos]]

    def check_reused(self, request_id: int, tokens: torch.Tensor, reused: int) -> int:
        """A request that starts past a prefix hit of `reused` tokens: every position below `reused` that its
        block table backs (in every layer of every group) must hold the K/V this model would write there for
        this request's tokens, because an earlier request with the same prefix computed them.

        Returns the positions checked; raises `RuntimeError` naming the request, group, position and page on
        the first mismatch.
        """
        if reused <= 0:
            return 0
        cache = self.manager.get_cache(request_id)
        checked = 0
        for g in range(self.manager.num_pools):
            row = torch.tensor(cache.block_row_slice(g, 0, reused // self.P), dtype=torch.long)
            ordinals = (row != BAD_PAGE_INDEX).nonzero().reshape(-1)
            if ordinals.numel() == 0:
                continue
            pos = (ordinals[:, None] * self.P + torch.arange(self.P)[None, :]).reshape(-1)
            key_rows = (row[pos // self.P] * (2 * self.P) + pos % self.P).to(self.device)
            want_k, want_v = self.expected_kv(tokens, pos.to(tokens.device))
            for layer in self._layers(g):
                for what, rows, want in (("K", key_rows, want_k), ("V", key_rows + self.P, want_v)):
                    bad = ~torch.isclose(layer.index_select(0, rows), want.to(layer.dtype)).all(dim=1)
                    if bool(bad.any()):
                        i = int(bad.nonzero()[0])
                        p = int(pos[i])
                        raise RuntimeError(
                            f"request {request_id}: reused target {what} at position {p} (layer group {g}, page "
                            f"{int(row[p // self.P])}) differs from what its tokens give; {int(bad.sum())} of "
                            f"{pos.numel()} reused positions differ (hit of {reused} tokens)"
                        )
            checked += pos.numel()
        return checked

    def read_kv(self, request_id: int, start: int, end: int, group: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V of positions [start, end) from one group's first layer, through the block table."""
        k_rows, v_rows = self._flat_rows(request_id, group, start, end, "read")
        layer = self._layers(group)[0]
        return layer.index_select(0, k_rows), layer.index_select(0, v_rows)

    # -- attention ----------------------------------------------------------------
    def predict(self, request_id: int, tokens: torch.Tensor, positions: list[int]) -> list[int]:
        """Greedy next token after each of `positions` (their K/V must be stored already).

        Every layer group attends over its own window through its own pages; the
        group outputs are summed, so a hybrid (windowed + full) target reads both.
        """
        if not positions:
            return []
        first, last = positions[0], positions[-1]
        q_pos = torch.as_tensor(positions, device=tokens.device)
        queries = self.embedding[tokens[q_pos]]
        out = torch.zeros_like(queries)
        for g, group in enumerate(self.manager.layer_groups):
            window = group.life_cycle.window
            lo = 0 if window is None else max(0, first + 1 - window)
            keys, values = self.read_kv(request_id, lo, last + 1, g)
            key_pos = torch.arange(lo, last + 1, device=keys.device)
            scores = self.config.attention_scale * (queries @ keys.T)
            visible = key_pos.unsqueeze(0) <= q_pos.unsqueeze(1)
            if window is not None:
                visible &= key_pos.unsqueeze(0) > (q_pos.unsqueeze(1) - window)
            scores = scores.masked_fill(~visible, float("-inf"))
            out += torch.softmax(scores, dim=-1) @ values
        logits = self.config.logit_scale * (out @ self.embedding.T) + self.bigram[tokens[q_pos]]
        return logits.argmax(dim=-1).tolist()
