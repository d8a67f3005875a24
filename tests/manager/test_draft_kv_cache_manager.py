"""DraftKVCacheManagerV2 on small real pools and with a recording cache.

Covers: which view a mirror reads (all seven modes, draft and target managers,
with `use_draft_model` flipped by `request_context`), the (capacity, history)
of every context/disagg resize seen through a recording cache, the trail page
and the widened windows, the explicit resize errors with their pool diagnostic,
failed resizes that leave every structure as it was, and `admit_mirror`.
"""
from __future__ import annotations

import contextlib

import pytest

from tensorrt_llm_draftkv import (
    BAD_PAGE_INDEX,
    DraftKVCacheManagerV2,
    KVCacheManagerV2,
    KVCacheResizeError,
    KVPoolConfig,
    LayerGroupConfig,
    LlmRequest,
    LlmRequestState,
    ScheduledRequests,
    SpeculativeDecodingMode as Mode,
    request_context,
)
from tensorrt_llm_draftkv.request import ContextView
from tensorrt_llm_draftkv.runtime import KVCache
from support import strict, ceil_div

ALL_MODES = list(Mode)
EXTERNAL = [Mode.PARD, Mode.DFLASH, Mode.DSPARK, Mode.DRAFT_TARGET_ONE_MODEL]
IN_STEP = [Mode.MTP, Mode.EAGLE3_ONE_MODEL, Mode.DRAFT_TARGET, Mode.EAGLE3, Mode.MTP_EAGLE]
TRAILING = [Mode.DFLASH, Mode.DSPARK]
NON_TRAILING_EXTERNAL = [Mode.PARD, Mode.DRAFT_TARGET_ONE_MODEL]


def config(windows=(None,), pages=256, p=16, sinks=0) -> KVPoolConfig:
    if isinstance(pages, int):
        pages = (pages,) * len(windows)
    return KVPoolConfig(
        layer_groups=tuple(LayerGroupConfig(1, window=w, sink_blocks=sinks) for w in windows),
        pages_per_group=tuple(pages),
        tokens_per_block=p,
        num_kv_heads=1,
        head_dim=1,
    )




def state(mgr) -> tuple:
    """Everything a resize may change: every cache and every pool's free count."""
    return (
        {rid: mgr.get_cache(rid).checkpoint() for rid in mgr.request_ids()},
        mgr.free_pages(),
        tuple(sorted(g.pool.free_order()) for g in mgr.layer_groups),
    )


def ctx(batch_reqs) -> ScheduledRequests:
    return ScheduledRequests(context_requests=list(batch_reqs))


def gen(batch_reqs) -> ScheduledRequests:
    return ScheduledRequests(generation_requests=list(batch_reqs))


class RecordingCache(KVCache):
    """A real KVCache that records every resize it is asked for."""

    def __init__(self, *args, log: list, **kwargs):
        super().__init__(*args, **kwargs)
        self.log = log

    def resize(self, capacity, history_length=None):
        self.log.append((capacity, history_length))
        return super().resize(capacity, history_length)


@pytest.fixture
def record(monkeypatch):
    """record(mgr) -> {request id: [(capacity, history), ...]} for every cache the manager makes."""

    def attach(mgr):
        logs: dict[int, list] = {}

        def new_cache(request_id):
            logs.setdefault(request_id, [])
            return RecordingCache(mgr.layer_groups, mgr.tokens_per_block, log=logs[request_id])

        monkeypatch.setattr(mgr.caches, "new", new_cache)
        return logs

    return attach


# =============================================================================================
# View selection: a behavioural check, through the capacity a prepare asks for.
# =============================================================================================
PROMPT = 200
DRAFT, EXTRA = 3, 1

# (target view, draft view): the capacities they imply differ in every scenario.
SCENARIOS = {
    # both at 0: the target chunk is 64 tokens, the untouched draft view the whole prompt
    "fresh": (ContextView(0, 64), ContextView(0, PROMPT)),
    # a separate engine put the draft view elsewhere than the executor put the target view
    "apart": (ContextView(64, 64), ContextView(128, PROMPT - 128)),
    # the target view on its last chunk, the draft view on a middle one
    "target_last": (ContextView(128, PROMPT - 128), ContextView(32, 32)),
}


def expected_capacity(view: ContextView) -> int:
    last = view.position + view.chunk_size >= PROMPT
    return view.position + view.chunk_size + EXTRA + (DRAFT if last else 0)


def flipped(flag, batch):
    return contextlib.nullcontext() if flag is None else request_context(flag, batch)


def make_req(rid, scenario, use_draft_model=False) -> LlmRequest:
    target, draft = SCENARIOS[scenario]
    return LlmRequest(
        rid,
        prompt_len=PROMPT,
        target_view=ContextView(target.position, target.chunk_size),
        draft_view=ContextView(draft.position, draft.chunk_size),
        use_draft_model=use_draft_model,
    )


@pytest.mark.parametrize("mode", ALL_MODES)
@pytest.mark.parametrize("scenario", list(SCENARIOS))
@pytest.mark.parametrize("flip", [None, False, True])
@pytest.mark.parametrize("sizing", ["history", "legacy"])
def test_draft_manager_view_selection(mode, scenario, flip, sizing):
    mgr = DraftKVCacheManagerV2.from_pool_config(
        config(), spec_mode=mode, max_draft_len=DRAFT, num_extra_kv_tokens=EXTRA, sizing=sizing
    )
    reads_target = sizing == "history" and mode in EXTERNAL
    assert mgr._mirror_uses_draft_view is (not reads_target)
    req = make_req(1, scenario)
    batch = ctx([req])
    assert mgr.admit_mirror(req)
    with flipped(flip, batch):
        mgr.prepare_resources(batch)
    assert req.use_draft_model is False  # request_context restored the flag
    target, draft = SCENARIOS[scenario]
    want = expected_capacity(target if reads_target else draft)
    assert mgr.get_cache(1).capacity == want
    assert mgr.get_cache(1).num_held_pages() == ceil_div(want, 16)  # full attention: everything backed


@pytest.mark.parametrize("mode", ALL_MODES)
@pytest.mark.parametrize("scenario", list(SCENARIOS))
@pytest.mark.parametrize("flip", [None, False, True])
@pytest.mark.parametrize("use_draft_model", [False, True])
def test_target_managers_always_follow_the_target_view(mode, scenario, flip, use_draft_model):
    target_view = SCENARIOS[scenario][0]
    managers = [
        KVCacheManagerV2.from_pool_config(config(), max_draft_len=DRAFT, num_extra_kv_tokens=EXTRA),
        DraftKVCacheManagerV2.from_pool_config(
            config(), spec_mode=mode, max_draft_len=DRAFT, num_extra_kv_tokens=EXTRA, is_draft=False
        ),
    ]
    for mgr in managers:
        assert mgr._mirror_uses_draft_view is False
        req = make_req(2, scenario, use_draft_model=use_draft_model)
        batch = ctx([req])
        with flipped(flip, batch):
            mgr.prepare_resources(batch)
        assert mgr.get_cache(2).capacity == expected_capacity(target_view), type(mgr).__name__


@pytest.mark.parametrize("mode", ALL_MODES)
@pytest.mark.parametrize("flip", [None, True])
def test_update_context_resources_follows_the_view_the_mirror_reads(mode, flip):
    """History after a chunk follows the mirror's view: the target's for external drafters."""
    mgr = DraftKVCacheManagerV2.from_pool_config(config(windows=(32,)), spec_mode=mode, max_draft_len=DRAFT)
    req = LlmRequest(3, prompt_len=PROMPT, target_view=ContextView(0, 64))  # draft view stays (0, 200)
    batch = ctx([req])
    with flipped(flip, batch):
        mgr.prepare_resources(batch)
    req.advance_context_chunk(64)  # the executor advances the target view only
    assert req.target_view.position == 64 and req.draft_view.position == 0
    with flipped(flip, batch):
        mgr.update_context_resources(batch)
    assert mgr.get_cache(3).history_length == (64 if mode in EXTERNAL else 0)


# =============================================================================================
# Context resize with a recording cache.
# =============================================================================================
@pytest.mark.parametrize("mode", EXTERNAL)
@pytest.mark.parametrize("with_update", [False, True])
def test_continuation_chunks_pass_the_chunk_start_as_history(record, mode, with_update):
    mgr = DraftKVCacheManagerV2.from_pool_config(
        config(windows=(64,)), spec_mode=mode, max_draft_len=DRAFT, num_extra_kv_tokens=EXTRA
    )
    logs = record(mgr)
    req = LlmRequest(9, prompt_len=100, target_view=ContextView(0, 48))
    batch = ctx([req])
    expected = []
    for start, chunk, last in [(0, 48, False), (48, 48, False), (96, 4, True)]:
        assert (req.target_view.position, req.target_view.chunk_size) == (start, chunk)
        mgr.prepare_resources(batch)
        expected.append((start + chunk + EXTRA + (DRAFT if last else 0), start))
        assert logs[9] == expected
        req.advance_context_chunk(48)
        if with_update:
            mgr.update_context_resources(batch)
            expected.append((start + chunk + EXTRA + (DRAFT if last else 0), start + chunk))
            assert logs[9] == expected
    assert mgr.get_cache(9).history_length == (100 if with_update else 96)


@pytest.mark.parametrize("mode", IN_STEP)
def test_draft_view_mirrors_keep_the_old_resize_without_history(record, mode):
    mgr = DraftKVCacheManagerV2.from_pool_config(
        config(windows=(64,)), spec_mode=mode, max_draft_len=DRAFT, num_extra_kv_tokens=EXTRA
    )
    logs = record(mgr)
    req = LlmRequest(9, prompt_len=100, target_view=ContextView(0, 48))
    batch = ctx([req])
    req.sync_draft_view()
    mgr.prepare_resources(batch)
    req.advance_context_chunk(48)
    req.sync_draft_view()
    mgr.update_context_resources(batch)  # history follows the (synced) draft view
    mgr.prepare_resources(batch)
    # Neither chunk is the last (96 < 100): the extra slots on each, no drafts.
    assert logs[9] == [(0 + 48 + EXTRA, None), (48 + EXTRA, 48), (48 + 48 + EXTRA, None)]
    assert mgr.get_cache(9).history_length == 48


@pytest.mark.parametrize("mode", TRAILING)
@pytest.mark.parametrize("start, chunk", [(256, 64), (256, 144), (1000, 37)])
def test_dflash_dspark_mirror_first_seen_past_zero_takes_the_start_as_history(record, mode, start, chunk):
    mgr = DraftKVCacheManagerV2.from_pool_config(
        config(windows=(64,)), spec_mode=mode, max_draft_len=DRAFT, num_extra_kv_tokens=EXTRA
    )
    assert mgr._draft_slot_trail_tokens == 16  # a trail page on this pool
    logs = record(mgr)
    prompt = 400 if start < 400 else start + chunk
    req = LlmRequest(4, prompt_len=prompt, target_view=ContextView(start, chunk))
    mgr.prepare_resources(ctx([req]))
    last = start + chunk >= prompt
    assert logs[4] == [(start + chunk + EXTRA + (DRAFT if last else 0), start)]
    # The prefix it did not compute is trimmed by the (widened) window, not backed.
    row = mgr.get_cache(4).block_row(0)
    lo = (start + 1 - 64 - 16) // 16
    assert all(page == BAD_PAGE_INDEX for page in row[:lo])
    assert all(page != BAD_PAGE_INDEX for page in row[lo:])


@pytest.mark.parametrize("mode", NON_TRAILING_EXTERNAL)
def test_pard_and_draft_target_first_seen_past_zero_keep_the_old_sizing(record, mode):
    mgr = DraftKVCacheManagerV2.from_pool_config(
        config(windows=(64,)), spec_mode=mode, max_draft_len=DRAFT, num_extra_kv_tokens=EXTRA
    )
    assert mgr._draft_slot_trail_tokens == 0  # no trail page
    logs = record(mgr)
    req = LlmRequest(4, prompt_len=400, target_view=ContextView(256, 64))
    batch = ctx([req])
    mgr.prepare_resources(batch)
    # Not the last chunk (320 < 400): the extra slots, no drafts.
    assert logs[4] == [(256 + 64 + EXTRA, None)]
    assert mgr.get_cache(4).num_held_pages() == ceil_div(256 + 64 + EXTRA, 16)  # the whole [0, 321) backed
    # Once it holds [0, start), the next chunk is a continuation.
    req.advance_context_chunk(64)
    mgr.prepare_resources(batch)
    assert logs[4][-1] == (320 + 64 + EXTRA, 320)


@pytest.mark.parametrize("mode", ALL_MODES)
def test_legacy_rules_size_every_mirror_from_the_draft_view_without_history(record, mode):
    mgr = DraftKVCacheManagerV2.from_pool_config(
        config(windows=(64,)), spec_mode=mode, max_draft_len=DRAFT, num_extra_kv_tokens=EXTRA, sizing="legacy"
    )
    assert mgr._draft_slot_trail_tokens == 0
    logs = record(mgr)
    req = LlmRequest(4, prompt_len=400, target_view=ContextView(256, 64))
    mgr.prepare_resources(ctx([req]))
    assert logs[4] == [(400 + DRAFT + EXTRA, None)]  # the whole prompt as one chunk from 0


@pytest.mark.parametrize("mode", ALL_MODES)
@pytest.mark.parametrize("prompt", [1, 100, 4097])
def test_disagg_gen_init_sizing_under_both_views(record, mode, prompt):
    mgr = DraftKVCacheManagerV2.from_pool_config(
        config(windows=(64,)), spec_mode=mode, max_draft_len=DRAFT, num_extra_kv_tokens=EXTRA
    )
    logs = record(mgr)
    # The views disagree (a context-worker leftover); the generation-init sizing reads neither.
    req = LlmRequest(
        5,
        prompt_len=prompt,
        state=LlmRequestState.DISAGG_GENERATION_INIT,
        target_view=ContextView(prompt // 2, 1),
        draft_view=ContextView(0, prompt),
    )
    with request_context(True, ctx([req])):
        assert mgr.admit_mirror(req)
        assert mgr.prepare_disagg_gen_init(req)
    assert logs[5] == [(prompt + 1 + DRAFT + EXTRA, prompt)]
    cache = mgr.get_cache(5)
    assert (cache.capacity, cache.history_length) == (prompt + 1 + DRAFT + EXTRA, prompt)


@pytest.mark.parametrize("mode", ALL_MODES)
def test_disagg_gen_init_legacy_is_a_whole_prompt_chunk_from_zero(record, mode):
    mgr = DraftKVCacheManagerV2.from_pool_config(
        config(windows=(64,), pages=512), spec_mode=mode, max_draft_len=DRAFT, num_extra_kv_tokens=EXTRA, sizing="legacy"
    )
    logs = record(mgr)
    req = LlmRequest(5, prompt_len=4097, state=LlmRequestState.DISAGG_GENERATION_INIT)
    assert mgr.prepare_disagg_gen_init(req)
    assert logs[5] == [(4097 + DRAFT + EXTRA, None)]
    assert mgr.get_cache(5).num_held_pages() == ceil_div(4097 + DRAFT + EXTRA, 16)


def test_target_manager_disagg_gen_init_matches():
    mgr = KVCacheManagerV2.from_pool_config(config(windows=(64,)), max_draft_len=DRAFT, num_extra_kv_tokens=EXTRA)
    req = LlmRequest(5, prompt_len=4097, state=LlmRequestState.DISAGG_GENERATION_INIT)
    assert mgr.prepare_disagg_gen_init(req)
    cache = mgr.get_cache(5)
    assert (cache.capacity, cache.history_length) == (4097 + 1 + DRAFT + EXTRA, 4097)


# =============================================================================================
# Trail page and windows.
# =============================================================================================
WINDOW_LAYOUTS = [(None,), (64,), (64, None), (None, 100), (64, 200)]


@pytest.mark.parametrize("mode", ALL_MODES)
@pytest.mark.parametrize("windows", WINDOW_LAYOUTS)
@pytest.mark.parametrize("sizing", ["history", "legacy"])
@pytest.mark.parametrize("trail_page", [True, False])
@pytest.mark.parametrize("is_draft", [True, False])
def test_trail_tokens_widen_every_window_of_the_pool(mode, windows, sizing, trail_page, is_draft):
    mgr = DraftKVCacheManagerV2.from_pool_config(
        config(windows=windows, pages=8), spec_mode=mode, sizing=sizing, trail_page=trail_page, is_draft=is_draft
    )
    on = (
        mode in TRAILING
        and sizing == "history"
        and trail_page
        and is_draft
        and any(w is not None for w in windows)
    )
    trail = 16 if on else 0
    assert mgr._draft_slot_trail_tokens == trail
    assert mgr.windows == tuple(None if w is None else w + trail for w in windows)


def test_the_trail_page_keeps_exactly_one_more_page_below_the_window():
    held = {}
    for mode in (Mode.DFLASH, Mode.PARD):
        mgr = DraftKVCacheManagerV2.from_pool_config(config(windows=(64,)), spec_mode=mode)
        req = LlmRequest(1, prompt_len=256, state=LlmRequestState.DISAGG_GENERATION_INIT)
        assert mgr.prepare_disagg_gen_init(req)  # history 256, capacity 257
        row = mgr.get_cache(1).block_row(0)
        held[mode] = [i for i, page in enumerate(row) if page != BAD_PAGE_INDEX]
    # Window 64: the query at 256 sees [193, 256] -> ordinals 12..16.
    assert held[Mode.PARD] == list(range(12, 17))
    # Widened to 80: [177, 256] -> ordinals 11..16, one page more.
    assert held[Mode.DFLASH] == list(range(11, 17))


# =============================================================================================
# Errors: explicit, with the pool diagnostic; nothing changed, nothing leaked.
# =============================================================================================
def diagnostic_lines(mgr) -> list[str]:
    lines = []
    for rid in mgr.request_ids():
        cache = mgr.get_cache(rid)
        held = [cache.num_held_pages(g) for g in range(mgr.num_pools)]
        lines.append(
            f"request {rid}: capacity={cache.capacity} history={cache.history_length} "
            f"logical_blocks={ceil_div(cache.capacity, mgr.tokens_per_block)} held_pages={held}"
        )
    return lines


@pytest.mark.parametrize("mode", EXTERNAL + IN_STEP)
def test_a_mirror_that_cannot_grow_raises_with_the_pool_diagnostic(mode):
    # Group 0 windowed, group 1 full attention with only 10 pages.
    mgr = DraftKVCacheManagerV2.from_pool_config(
        config(windows=(64, None), pages=(40, 10)), spec_mode=mode, max_draft_len=DRAFT, num_extra_kv_tokens=EXTRA
    )
    a = LlmRequest(11, prompt_len=400, target_view=ContextView(0, 64))
    b = LlmRequest(12, prompt_len=32, target_view=ContextView(0, 32))
    for req in (a, b):
        req.sync_draft_view()
    mgr.prepare_resources(ctx([a, b]))  # a: 5 + 5 pages (64 + 1 tokens), b: 3 + 3 pages (32 + 4 tokens)
    a.advance_context_chunk(64)
    a.sync_draft_view()
    mgr.update_context_resources(ctx([a]))
    before = state(mgr)
    expected_lines = diagnostic_lines(mgr)
    assert mgr.admit_mirror(a) is False
    assert state(mgr) == before
    # a's second chunk [64, 128) is not its last (400): extra on it, no drafts.
    wanted = 64 + 64 + EXTRA
    held_a, held_b = ceil_div(64 + EXTRA, 16), ceil_div(32 + DRAFT + EXTRA, 16)
    assert (held_a, held_b) == (5, 3)
    assert ceil_div(wanted, 16) - held_a > 10 - held_a - held_b  # more full-attention pages than are free
    with pytest.raises(KVCacheResizeError) as info:
        mgr.prepare_resources(ctx([a]))  # needs 4 more full-attention pages, 2 free
    err = info.value
    msg = str(err)
    history = 64 if mode in EXTERNAL else None
    head = f"Draft KV cache context resize failed for request 11: could not resize to {wanted} tokens"
    assert msg.startswith(head), msg
    assert f"(history {'unchanged' if history is None else history})" in msg.splitlines()[0]
    assert (err.request_id, err.phase, err.capacity, err.history) == (11, "context", wanted, history)
    for line in expected_lines:
        assert line in msg, (line, msg)
    trail = mgr._draft_slot_trail_tokens
    assert f"[{64 + trail}, None]" in msg  # the windows the pool really keeps
    free0, free1 = mgr.free_pages()
    assert free1 == 10 - held_a - held_b == 2
    assert f"group 0: {free0}/40" in msg and f"group 1: {free1}/10" in msg
    assert "live caches: 2" in msg
    assert state(mgr) == before  # a failed resize leaves everything as it was
    mgr.check_accounting()


def test_generation_resize_error_names_the_generation_phase():
    mgr = DraftKVCacheManagerV2.from_pool_config(config(windows=(None,), pages=3), spec_mode=Mode.DFLASH, max_draft_len=DRAFT)
    req = LlmRequest(21, prompt_len=40, state=LlmRequestState.DISAGG_GENERATION_INIT)
    assert mgr.prepare_disagg_gen_init(req)  # 44 tokens: 3 pages, the whole pool
    req.state = LlmRequestState.GENERATION_IN_PROGRESS
    req.tokens += [1, 1, 1, 1, 1, 1, 1, 1, 1]  # 49 tokens: the next step needs 52 slots -> 4 pages
    before = state(mgr)
    assert mgr.admit_mirror(req) is False
    with pytest.raises(KVCacheResizeError, match=r"^Draft KV cache generation resize failed for request 21: "
                       r"could not resize to 52 tokens \(history unchanged\)") as info:
        mgr.prepare_resources(gen([req]))
    assert "request 21: capacity=44 history=40 logical_blocks=3 held_pages=[3]" in str(info.value)
    assert state(mgr) == before


@pytest.fixture
def full_pool():
    def make(mode, pages=6):
        mgr = DraftKVCacheManagerV2.from_pool_config(config(windows=(64,), pages=pages), spec_mode=mode, max_draft_len=DRAFT)
        hog = LlmRequest(1, prompt_len=92, target_view=ContextView(0, 92))  # 92 + 3 = 95 tokens -> 6 pages
        hog.sync_draft_view()
        mgr.prepare_resources(ctx([hog]))
        assert mgr.free_pages() == (0,)
        return mgr, hog

    return make


@pytest.mark.parametrize("mode", ALL_MODES)
@pytest.mark.parametrize("kind", ["context", "disagg", "dummy"])
def test_exhausted_pool_fails_explicitly_and_leaks_nothing(full_pool, mode, kind):
    mgr, hog = full_pool(mode)
    before = state(mgr)
    fresh = LlmRequest(2, prompt_len=20, target_view=ContextView(0, 20))
    fresh.sync_draft_view()
    if kind == "context":
        assert mgr.admit_mirror(fresh) is False
        call = lambda: mgr.prepare_resources(ctx([fresh]))  # noqa: E731
        phase, cap = "context", 23
    elif kind == "disagg":
        fresh.state = LlmRequestState.DISAGG_GENERATION_INIT
        assert mgr.admit_mirror(fresh) is False
        call = lambda: strict(mgr, mgr.prepare_disagg_gen_init(fresh))  # noqa: E731
        phase, cap = "generation", 24
    else:
        call = lambda: strict(mgr, mgr.add_dummy_requests([2], [20], is_gen=True, max_num_draft_tokens=DRAFT, history_hint=19))  # noqa: E731
        phase, cap = "dummy", 23
    assert state(mgr) == before  # admit_mirror changed nothing
    with pytest.raises(KVCacheResizeError, match=rf"^Draft KV cache {phase} resize failed for request 2: "
                       rf"could not resize to {cap} tokens"):
        call()
    assert not mgr.has_cache(2) and mgr.request_ids() == [1]
    assert state(mgr) == before
    mgr.check_accounting()
    # Nothing leaked: once the hog is gone the same request fits, and freeing it empties the pool.
    mgr.free_resources(hog)
    call()
    assert mgr.has_cache(2)
    mgr.free_resources(2)
    assert mgr.free_pages() == (6,) and mgr.request_ids() == []
    mgr.check_accounting()


def test_a_failed_dummy_batch_frees_the_dummies_it_made():
    mgr = DraftKVCacheManagerV2.from_pool_config(config(windows=(64,), pages=5), spec_mode=Mode.DFLASH, max_draft_len=DRAFT)
    with pytest.raises(KVCacheResizeError, match="dummy resize failed for request 8"):
        strict(mgr, mgr.add_dummy_requests([7, 8], [40, 40], max_num_draft_tokens=DRAFT))  # 3 pages each
    assert mgr.request_ids() == [] and mgr.free_pages() == (5,)


def test_capacity_below_history_is_a_value_error_and_the_fresh_mirror_is_dropped():
    mgr = DraftKVCacheManagerV2.from_pool_config(config(windows=(64,)), spec_mode=Mode.DFLASH)
    with pytest.raises(ValueError):
        mgr.add_dummy_requests([3], [10], history_hint=-1)
    assert not mgr.has_cache(3)


# =============================================================================================
# admit_mirror predicts prepare, changing nothing.
# =============================================================================================
@pytest.mark.parametrize("mode", ALL_MODES)
@pytest.mark.parametrize("pages", [4, 6, 8, 10, 12, 14, 16, 20, 24, 30])
def test_admit_mirror_agrees_with_what_prepare_then_does(mode, pages):
    mgr = DraftKVCacheManagerV2.from_pool_config(config(windows=(48,), pages=pages), spec_mode=mode, max_draft_len=DRAFT)
    other = LlmRequest(50, prompt_len=30, state=LlmRequestState.DISAGG_GENERATION_INIT)
    if mgr.admit_mirror(other):
        assert mgr.prepare_disagg_gen_init(other)
    reqs = [
        LlmRequest(1, prompt_len=150, target_view=ContextView(0, 40)),
        LlmRequest(2, prompt_len=100, state=LlmRequestState.DISAGG_GENERATION_INIT),
        LlmRequest(3, prompt_len=300, target_view=ContextView(160, 64)),  # first seen past 0
    ]
    outcomes = []
    for step in range(8):
        for req in reqs:
            if req.is_finished:
                continue
            if req.is_context_init_state:
                req.sync_draft_view()
            before = state(mgr)
            predicted = mgr.admit_mirror(req)
            assert state(mgr) == before
            try:
                if req.is_disagg_generation_init_state:
                    strict(mgr, mgr.prepare_disagg_gen_init(req))
                elif req.is_context_init_state:
                    mgr.prepare_resources(ctx([req]))
                else:
                    mgr.prepare_resources(gen([req]))
                ok = True
            except KVCacheResizeError:
                ok = False
                assert state(mgr) == before
            assert ok == predicted, (step, req.py_request_id)
            outcomes.append(ok)
            if not ok:
                continue
            # advance the request by one step
            if req.is_disagg_generation_init_state:
                req.state = LlmRequestState.GENERATION_IN_PROGRESS
                req.tokens.append(1)
            elif req.is_context_init_state:
                req.advance_context_chunk(40)
                req.sync_draft_view()
                mgr.update_context_resources(ctx([req]))
                if req.target_view.position >= req.prompt_len:
                    req.state = LlmRequestState.GENERATION_IN_PROGRESS
                    req.tokens.append(1)
                    mgr.update_resources(ctx([req]))
            else:
                req.tokens += [1] * (1 + step % (DRAFT + 1))
                mgr.update_resources(gen([req]))
            mgr.check_accounting()
    assert outcomes  # something was tried


@pytest.mark.parametrize("mode", EXTERNAL)
def test_joint_reuse_pool_counts_as_covering_the_prefix(record, mode):
    """A pool that joins the target's block reuse holds [0, start): every external mirror takes history."""
    mgr = DraftKVCacheManagerV2.from_pool_config(
        config(windows=(64,)), spec_mode=mode, max_draft_len=DRAFT, num_extra_kv_tokens=EXTRA, joint_kv_cache_reuse=True
    )
    logs = record(mgr)
    req = LlmRequest(4, prompt_len=400, target_view=ContextView(256, 64))
    mgr.prepare_resources(ctx([req]))
    assert logs[4] == [(256 + 64 + EXTRA, 256)]  # not the last chunk: extra, no drafts


@pytest.mark.parametrize("windows", [(None,), (8,)])
def test_update_resources_advances_history_even_when_the_next_slot_has_no_page(windows):
    """All drafts accepted on a full pool: history still follows the request, nothing is allocated."""
    mgr = DraftKVCacheManagerV2.from_pool_config(config(windows=windows, pages=3, p=4), spec_mode=Mode.DFLASH, max_draft_len=3)
    req = LlmRequest(1, prompt_len=4, state=LlmRequestState.DISAGG_GENERATION_INIT)
    assert mgr.prepare_disagg_gen_init(req)  # capacity 8, history 4
    req.state = LlmRequestState.GENERATION_IN_PROGRESS
    req.tokens.append(1)
    mgr.prepare_resources(gen([req]))  # capacity 4 + 4 = 8
    hog = LlmRequest(2, prompt_len=4, target_view=ContextView(0, 1))
    mgr.prepare_resources(ctx([hog]))  # takes the last free page
    assert mgr.free_pages() == (0,)
    req.tokens += [1] * 4  # the token and all 3 drafts accepted: 9 tokens, history 8
    mgr.update_resources(gen([req]))
    cache = mgr.get_cache(1)
    assert cache.history_length == 8 and cache.capacity == 8  # the slot at 8 waits for the next prepare
    mgr.check_accounting()
    with pytest.raises(KVCacheResizeError, match="generation resize failed for request 1: could not resize to 12 tokens"):
        mgr.prepare_resources(gen([req]))
