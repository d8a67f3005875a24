"""One executor's view of a DFlash drafter with its own draft KV pool: every call, in order.

    python examples/executor_step.py          # CPU, a few seconds, no model

A target manager (a hybrid pool: full-attention and sliding-window layers) and
a draft manager (the drafter's own windowed pool) are sized by the package's
estimator for two concurrent requests. Request 0 goes through chunked prefill
and generation steps. Request 1 arrives as a disaggregated generation worker
gets it (its prompt was computed elsewhere) and joins the generation batch.
Every step makes the executor's calls in order:

    target.prepare_resources(batch)         # size the target caches
    draft.prepare_resources(batch)          # size the draft mirrors (request_context(True, batch) inside)
    meta.prepare_step(batch, draft)              # rows -> drafter slots; fresh generation slots get a base
    ...target forward...                    # here: random K/V at the target's pages
    meta.advance_slot_for_context(req, positions) # context rows: where the drafter stores the chunk's K/V
    meta.prepare_generation({rid: n})       # generation rows: where the n accepted tokens and the block go
    target.update_context_resources(batch); target.update_resources(batch)
    draft.update_context_resources(batch);  draft.update_resources(batch)

There is no model: the target and the drafter write random K/V into the pool
tensors at exactly the addresses the managers and the metadata hand out, and
acceptance is drawn at random. At the end both requests are freed
(`free_resources` in both managers, `meta.free`) and every pool is checked to
be fully free.
"""
from __future__ import annotations

import torch

from tensorrt_llm_draftkv import (
    BAD_PAGE_INDEX,
    DFlashDraftSlots,
    DraftKVCacheManagerV2,
    KVCacheManagerV2,
    KVPoolConfig,
    LayerGroupConfig,
    LlmRequest,
    LlmRequestState,
    ScheduledRequests,
    SpeculativeDecodingMode,
)
from tensorrt_llm_draftkv.manager.budget import group_pages_per_request

P = 32  # tokens per page
BLOCK = 8  # a DFlash block: the bonus token and 7 mask tokens, so up to 7 drafts
MAX_DRAFT = BLOCK - 1
CHUNK = 2048  # prefill chunk; chunks start at multiples of it
WINDOW = 1024  # sliding window of the target's windowed layers and of the drafter
MAX_SEQ = 16384
REQUESTS = 2  # both pools are sized for this many requests at once
VOCAB = 1000
NEW_TOKENS = 24
gen = torch.Generator().manual_seed(0)

# -- the pools, sized by the estimator -------------------------------------------------------------
target_groups = (LayerGroupConfig(2), LayerGroupConfig(2, window=WINDOW))  # full attention, sliding window
draft_groups = (LayerGroupConfig(1, window=WINDOW),)  # the drafter's layer(s)


def pages_per_request(group: LayerGroupConfig, *, extra: int = 0, trail: int = 0) -> int:
    """The estimator's charge: the most pages one request holds in this group, prefill and generation."""
    return group_pages_per_request(
        group.window, P, max_seq_len=MAX_SEQ, chunk=CHUNK, max_draft_len=MAX_DRAFT,
        num_extra_kv_tokens=extra, trail_tokens=trail, chunk_alignment=True,
    )


target = KVCacheManagerV2.from_pool_config(
    KVPoolConfig(
        target_groups,
        pages_per_group=tuple(REQUESTS * pages_per_request(g) for g in target_groups),
        tokens_per_block=P, num_kv_heads=2, head_dim=16, dtype=torch.float16, max_seq_len=MAX_SEQ,
    ),
    max_draft_len=MAX_DRAFT,
)
# The draft pool: DFlash keeps one trail page below its window (a seeded slot trails its request by < P
# tokens) and needs room for the block above the accepted tokens (num_extra_kv_tokens = BLOCK).
draft_charge = pages_per_request(draft_groups[0], extra=BLOCK, trail=P)
draft = DraftKVCacheManagerV2.from_pool_config(
    KVPoolConfig(
        draft_groups,
        pages_per_group=(REQUESTS * draft_charge,),
        tokens_per_block=P, num_kv_heads=1, head_dim=16, dtype=torch.float16, max_seq_len=MAX_SEQ,
    ),
    spec_mode=SpeculativeDecodingMode.DFLASH,
    max_draft_len=MAX_DRAFT,
    num_extra_kv_tokens=BLOCK,  # sizing="history" (the fix) is the default
)
assert draft.pages_per_request_charge(CHUNK) == (draft_charge,)  # the manager charges what we sized
meta = DFlashDraftSlots(REQUESTS, block_size=BLOCK, tokens_per_block=P, max_ctx_len=MAX_SEQ, draft_manager=draft)


# -- what a model would write -----------------------------------------------------------------------
def write_kv(manager: KVCacheManagerV2, group: int, pages: torch.Tensor, offsets: torch.Tensor) -> None:
    """Random K and V at (page, offset) in every layer of one pool; unbacked (-1) entries are skipped."""
    pages, offsets = pages.long(), offsets.long()
    keep = (pages != BAD_PAGE_INDEX) & (offsets >= 0)
    pages, offsets = pages[keep], offsets[keep]
    for layer in manager.layer_groups[group].pool.layers:  # [pages, K/V, heads, P, head_dim]
        kv = torch.randn(len(pages), 2, layer.shape[2], layer.shape[4], generator=gen).to(layer.dtype)
        layer[pages, :, :, offsets, :] = kv


def target_forward(req: LlmRequest, start: int, end: int) -> int:
    """The target's K/V of absolute positions [start, end) at its pages; returns the next token.

    Positions a sliding window has already released have no page (-1) and are skipped.
    """
    cache = target.get_cache(req.py_request_id)
    positions = torch.arange(start, end)
    for g in range(target.num_pools):
        row = torch.tensor(cache.block_row_slice(g, 0, (end - 1) // P + 1))
        write_kv(target, g, row[positions // P], positions % P)
    return int(torch.randint(VOCAB, (1,), generator=gen))


def random_tokens(n: int) -> list[int]:
    return torch.randint(VOCAB, (n,), generator=gen).tolist()


# -- one executor step --------------------------------------------------------------------------------
def update(batch: ScheduledRequests) -> None:
    """After the forward: history follows the context position, then the tokens (both managers)."""
    target.update_context_resources(batch)
    target.update_resources(batch)
    draft.update_context_resources(batch)
    draft.update_resources(batch)


def context_step(req: LlmRequest) -> None:
    """One prefill chunk [position, position + chunk_size) of the target view."""
    batch = ScheduledRequests(context_requests=[req])
    target.prepare_resources(batch)
    draft.prepare_resources(batch)
    meta.prepare_step(batch, draft)
    start = req.target_view.position
    end = start + req.target_view.chunk_size
    first = target_forward(req, start, end)
    # The drafter's K/V of the chunk (from the target's hidden states) at the slot's store targets.
    plan = meta.advance_slot_for_context(req, torch.arange(start, end))
    for g in range(draft.num_pools):
        write_kv(draft, g, plan.pages[g], plan.offsets)
    req.advance_context_chunk(CHUNK)
    if end == req.prompt_len:  # the last chunk gives the first output token
        req.tokens.append(first)
        req.state = LlmRequestState.GENERATION_IN_PROGRESS
    update(batch)
    report(f"context [{start}, {end})", batch)


def generation_step(batch: ScheduledRequests) -> None:
    """Verify each row's drafts, store the accepted tokens and the next block, propose new drafts."""
    target.prepare_resources(batch)
    draft.prepare_resources(batch)
    meta.prepare_step(batch, draft)
    for rid, seed in meta.seeds.items():
        print(f"  request {rid}: fresh slot seeded at L={seed.ctx_len} with base b={seed.base_pages} pages")
    new: dict[int, list[int]] = {}
    for req in batch.generation_requests:
        n, drafts = req.max_beam_num_tokens, req.py_draft_tokens
        bonus = target_forward(req, n - 1, n + len(drafts))  # the last token and the drafts
        accepted = int(torch.randint(len(drafts) + 1, (1,), generator=gen))
        new[req.py_request_id] = (drafts[:accepted] + [bonus])[: req.max_new_tokens - req.num_generated]
    # Where the accepted tokens' drafter K/V go, what the block decode reads, and where the block goes.
    preps = meta.prepare_generation({rid: len(tokens) for rid, tokens in new.items()})
    for req in batch.generation_requests:
        rid = req.py_request_id
        row, count = meta.row_index(rid), len(new[rid])
        for g, prep in enumerate(preps):
            write_kv(draft, g, prep.store_pages[row, :count], prep.store_offsets[row, :count])
            # The block decode attends over prep.read_rows[row] (rebased past the slot's base) up to
            # prep.read_lens[row] tokens, and appends the block's K/V at prep.query_pos[row] on the
            # unrebased row meta.tables[g].tables[row].
            q = prep.query_pos[row]
            table = meta.tables[g].tables[row]
            write_kv(draft, g, table[q // P], q % P)
        req.tokens.extend(new[rid])
        req.py_draft_tokens = random_tokens(MAX_DRAFT)  # the drafter's proposal for the next step
    update(batch)
    report("generation", batch)


def report(what: str, batch: ScheduledRequests) -> None:
    for req in batch.all_requests():
        rid = req.py_request_id
        held = draft.get_cache(rid).num_held_pages()
        assert held <= draft_charge, (rid, held, draft_charge)  # the fix: a mirror never exceeds its charge
        print(
            f"{what:<22} request {rid}: {req.max_beam_num_tokens:>5} tokens, target pages "
            f"{target.get_cache(rid).num_held_pages():>3}, draft pages {held:>3}/{draft_charge}"
        )


def finish(req: LlmRequest) -> None:
    req.state = LlmRequestState.GENERATION_COMPLETE
    target.free_resources(req)
    draft.free_resources(req)
    meta.free(req.py_request_id)


# -- the life cycle -------------------------------------------------------------------------------------
def main() -> None:
    # Request 0: a 5000-token prompt in chunks of 2048 on this (aggregated) executor.
    prompt = random_tokens(5000)
    req = LlmRequest(0, prompt_len=len(prompt), tokens=prompt, max_new_tokens=NEW_TOKENS)
    req.target_view.chunk_size = CHUNK  # the scheduler's first chunk
    while req.state == LlmRequestState.CONTEXT_INIT:
        context_step(req)
    generation_step(ScheduledRequests(generation_requests=[req]))

    # Request 1: a disaggregated generation worker receives a 3001-token prompt, its first token
    # and the target K/V its windows read; both pools build its caches with the prompt as history.
    prompt = random_tokens(3001)
    m = len(prompt)
    other = LlmRequest(
        1, prompt_len=m, tokens=prompt + random_tokens(1), state=LlmRequestState.DISAGG_GENERATION_INIT,
        max_new_tokens=NEW_TOKENS,
    )
    assert target.prepare_disagg_gen_init(other)
    assert draft.prepare_disagg_gen_init(other)
    # The received target K/V: [m + 1 - WINDOW, m) in the windowed layers, all of [0, m) in the others.
    target_forward(other, 0, m)
    other.state = LlmRequestState.GENERATION_IN_PROGRESS  # the transfer is complete: it decodes now
    report("disagg gen init", ScheduledRequests(generation_requests=[other]))

    running = [req, other]
    while running:
        generation_step(ScheduledRequests(generation_requests=list(running)))
        for r in [r for r in running if r.num_generated >= r.max_new_tokens]:
            finish(r)
            running.remove(r)
            print(f"request {r.py_request_id} finished: {r.num_generated} tokens generated")

    for name, manager in (("target", target), ("draft", draft)):
        for g, pool in enumerate(manager.pools()):
            assert pool.num_free == pool.total, f"{name} pool {g}: {pool.num_held} pages still held"
    assert not draft.request_ids() and not target.request_ids() and not meta.slots.live_requests()
    print(f"every page is free again: target pools {target.free_pages()}, draft pool {draft.free_pages()}")


if __name__ == "__main__":
    main()
