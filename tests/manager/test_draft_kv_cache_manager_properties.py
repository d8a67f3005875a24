"""Property: on a pool sized by the estimator, the `history` mirror never exceeds its charge and never fails.

Random prompt lengths, chunk sizes (fixed, or varying per chunk), windows, page
sizes, sink blocks, drafter modes, draft lengths, arrivals and acceptance. k
requests run concurrently, interleaved step by step through the executor loop
(prepare, advance, update_context_resources, update_resources), some of them
disaggregated generation-init requests. After every prepare:

* every request's pages in every group are at most the estimator's charge
  (`chunk_alignment=True` when the chunks are fixed, and `chunk_alignment=False`
  is always an upper bound);
* what is backed is exactly what the step's queries read, derived here from the
  window: ordinal i is backed iff it is a sink or overlaps [h + 1 - W', capacity);
* the history is the request's own (chunk start, or tokens - 1);
* the pools balance, and finishing every request returns every page.

Sizes stay small (P <= 16, W <= 256, prompts <= 4096, head_dim 1): the pools
allocate real storage.
"""
from __future__ import annotations

import pytest

hypothesis = pytest.importorskip("hypothesis")
from hypothesis import given, settings, strategies as st  # noqa: E402

from tensorrt_llm_draftkv import (  # noqa: E402
    BAD_PAGE_INDEX,
    DraftKVCacheManagerV2,
    KVPoolConfig,
    LayerGroupConfig,
    LlmRequest,
    LlmRequestState,
    ScheduledRequests,
    SpeculativeDecodingMode as Mode,
)
from tensorrt_llm_draftkv.manager.budget import group_pages_per_request  # noqa: E402
from tensorrt_llm_draftkv.request import ContextView  # noqa: E402
from support import ceil_div




def expected_backed(capacity: int, history: int, kept: int | None, sinks: int, p: int) -> list[int]:
    """Ordinals a step needs, from the window: sinks, and those overlapping [h + 1 - W', capacity)."""
    blocks = ceil_div(capacity, p)
    if kept is None:
        return list(range(blocks))
    lo = (history + 1 - kept) // p
    return [i for i in range(blocks) if i < sinks or i >= lo]


@st.composite
def scenarios(draw):
    p = draw(st.integers(1, 16))
    window = draw(st.integers(1, 256))
    sinks = draw(st.integers(0, 2))
    full_group = draw(st.booleans())
    mode = draw(st.sampled_from(list(Mode)))
    drafts = draw(st.integers(0, 7))
    extra = draw(st.integers(0, 2))
    chunk = draw(st.one_of(st.integers(16, 256), st.integers(257, 4096)))
    fixed_chunks = draw(st.booleans())
    k = draw(st.integers(1, 3))
    requests = draw(
        st.lists(
            st.tuples(
                st.sampled_from(["context", "context", "disagg"]),
                st.integers(1, 4096),  # prompt
                st.integers(1, 4),  # generation steps (each request runs at least one)
                st.integers(0, 6),  # arrival step
            ),
            min_size=k,
            max_size=k,
        )
    )
    return dict(
        p=p, window=window, sinks=sinks, full_group=full_group, mode=mode, drafts=drafts, extra=extra,
        chunk=chunk, fixed_chunks=fixed_chunks, requests=requests,
    )


def charges(sc, trail: int, max_seq_len: int, aligned: bool) -> list[int]:
    windows = [sc["window"]] + ([None] if sc["full_group"] else [])
    return [
        group_pages_per_request(
            w,
            sc["p"],
            max_seq_len=max_seq_len,
            chunk=sc["chunk"],
            max_draft_len=sc["drafts"],
            num_extra_kv_tokens=sc["extra"],
            trail_tokens=trail if w is not None else 0,
            sink_blocks=sc["sinks"] if w is not None else 0,
            chunk_alignment=aligned,
        )
        for w in windows
    ]


@settings(max_examples=120)
@given(sc=scenarios(), data=st.data())
def test_history_mirror_stays_within_the_estimate_and_never_fails(sc, data):
    p, drafts, extra, chunk, mode = sc["p"], sc["drafts"], sc["extra"], sc["chunk"], sc["mode"]
    trail = p if mode.keeps_trail_page() else 0  # a windowed group is always present
    k = len(sc["requests"])
    max_seq_len = max(prompt + 1 + steps * (1 + drafts) + drafts + extra for _, prompt, steps, _ in sc["requests"])
    aligned = charges(sc, trail, max_seq_len, aligned=True)
    loose = charges(sc, trail, max_seq_len, aligned=False)
    assert all(a <= b for a, b in zip(aligned, loose))
    charge = aligned if sc["fixed_chunks"] else loose
    groups = [LayerGroupConfig(1, window=sc["window"], sink_blocks=sc["sinks"])]
    if sc["full_group"]:
        groups.append(LayerGroupConfig(1, window=None))
    config = KVPoolConfig(
        layer_groups=tuple(groups),
        pages_per_group=tuple(k * c for c in charge),
        tokens_per_block=p,
        num_kv_heads=1,
        head_dim=1,
        max_seq_len=max_seq_len,
    )
    mgr = DraftKVCacheManagerV2.from_pool_config(config, spec_mode=mode, max_draft_len=drafts, num_extra_kv_tokens=extra)
    assert mgr._draft_slot_trail_tokens == trail
    kept = list(mgr.windows)
    in_step = not mode.is_external_drafter()  # MTP / Eagle3 / two-model: the draft view kept in step

    def next_chunk() -> int:
        return chunk if sc["fixed_chunks"] else data.draw(st.integers(1, chunk), label="chunk")

    pending = sorted(enumerate(sc["requests"]), key=lambda item: item[1][3])
    active: list[LlmRequest] = []
    steps_left: dict[int, int] = {}
    step = 0
    while pending or active:
        while pending and pending[0][1][3] <= step:
            rid, (kind, prompt, gen_steps, _) = pending.pop(0)
            steps_left[rid] = gen_steps
            if kind == "disagg":
                req = LlmRequest(rid, prompt_len=prompt, state=LlmRequestState.DISAGG_GENERATION_INIT)
                assert mgr.admit_mirror(req)
                assert mgr.prepare_disagg_gen_init(req)
                cache = mgr.get_cache(rid)
                assert (cache.capacity, cache.history_length) == (prompt + 1 + drafts + extra, prompt)
                req.state = LlmRequestState.GENERATION_IN_PROGRESS
                req.tokens.append(1)  # the context worker's token
            else:
                req = LlmRequest(rid, prompt_len=prompt, target_view=ContextView(0, min(next_chunk(), prompt)))
            active.append(req)
        ctx = [r for r in active if r.is_context_init_state]
        gen = [r for r in active if r.is_generation_in_progress_state]
        batch = ScheduledRequests(ctx, gen)
        if in_step:
            for r in ctx:
                r.sync_draft_view()
        mgr.prepare_resources(batch)  # never fails on this pool
        for r in batch.all_requests():
            cache = mgr.get_cache(r.py_request_id)
            if r in ctx:
                start = r.target_view.position
                last = start + r.target_view.chunk_size >= r.prompt_len
                want_cap = start + r.target_view.chunk_size + extra + (drafts if last else 0)
                want_hist = start
            else:
                want_hist = r.max_beam_num_tokens - 1
                want_cap = want_hist + 1 + drafts + extra
            assert (cache.capacity, cache.history_length) == (want_cap, want_hist)
            for g in range(mgr.num_pools):
                row = cache.block_row(g)
                got = [i for i, page in enumerate(row) if page != BAD_PAGE_INDEX]
                sinks = sc["sinks"] if kept[g] is not None else 0
                assert got == expected_backed(cache.capacity, cache.history_length, kept[g], sinks, p), g
                assert len(got) <= charge[g] <= loose[g]
        mgr.check_accounting()
        # The executor advances every request.
        for r in ctx:
            r.advance_context_chunk(next_chunk())
            if in_step:
                r.sync_draft_view()
            if r.target_view.position >= r.prompt_len:
                r.state = LlmRequestState.GENERATION_IN_PROGRESS
                r.tokens.append(1)
        for r in gen:
            accepted = data.draw(st.integers(0, drafts), label="accepted")
            r.tokens += [1] * (1 + accepted)
            steps_left[r.py_request_id] -= 1
        mgr.update_context_resources(ScheduledRequests(ctx))
        mgr.update_resources(batch)
        for r in list(active):
            if r.is_generation_in_progress_state:
                assert mgr.get_cache(r.py_request_id).history_length == r.max_beam_num_tokens - 1
                if steps_left[r.py_request_id] <= 0:
                    mgr.free_resources(r)
                    active.remove(r)
        step += 1
    assert mgr.request_ids() == []
    assert mgr.free_pages() == tuple(k * c for c in charge)
    mgr.check_accounting()


@settings(max_examples=60)
@given(
    p=st.integers(1, 16),
    window=st.integers(1, 256),
    mode=st.sampled_from([Mode.DFLASH, Mode.DSPARK, Mode.PARD, Mode.DRAFT_TARGET_ONE_MODEL]),
    drafts=st.integers(0, 7),
    chunk=st.integers(16, 1024),
    prompt=st.integers(1, 4096),
)
def test_legacy_needs_the_whole_prompt_where_history_needs_the_window(p, window, mode, drafts, chunk, prompt):
    """The same request on both rule sets: legacy backs [0, prompt + drafts) at once."""
    pages = 4096 // p + 64
    cfg = KVPoolConfig((LayerGroupConfig(1, window=window),), (pages,), tokens_per_block=p, num_kv_heads=1, head_dim=1)
    legacy = DraftKVCacheManagerV2.from_pool_config(cfg, spec_mode=mode, max_draft_len=drafts, sizing="legacy")
    history = DraftKVCacheManagerV2.from_pool_config(cfg, spec_mode=mode, max_draft_len=drafts)
    req_l = LlmRequest(1, prompt_len=prompt, target_view=ContextView(0, min(chunk, prompt)))
    req_h = LlmRequest(1, prompt_len=prompt, target_view=ContextView(0, min(chunk, prompt)))
    legacy.prepare_resources(ScheduledRequests([req_l]))
    assert legacy.get_cache(1).num_held_pages() == ceil_div(prompt + drafts, p)
    peak = 0
    while req_h.target_view.position < prompt:
        history.prepare_resources(ScheduledRequests([req_h]))
        peak = max(peak, history.get_cache(1).num_held_pages())
        req_h.advance_context_chunk(chunk)
    bound = group_pages_per_request(
        window, p, max_seq_len=prompt + drafts, chunk=chunk, max_draft_len=drafts,
        trail_tokens=history._draft_slot_trail_tokens, chunk_alignment=True,
    )
    assert peak <= bound <= ceil_div(prompt + drafts, p)
