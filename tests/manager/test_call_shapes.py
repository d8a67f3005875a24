"""Upstream TensorRT-LLM's call shapes: an executor written for it calls ours unchanged.

Covers `copy_batch_block_offsets` (the same entries as `get_block_offsets(ids,
"cpp")`, written in place; every bad input an explicit error that leaves the
destination unchanged), `add_dummy_requests` in upstream's positional order
(default `is_gen=False`, the draft manager's dummies all or nothing with the
target's), `request_context` switching what requests present and what a legacy
mirror is sized from, the `KVPoolConfig` rename with its deprecated alias, and
strings accepted where an enum or dtype is.
"""
from __future__ import annotations

import inspect
import subprocess
import sys

import pytest

from support import strict
import torch

import tensorrt_llm_draftkv
from tensorrt_llm_draftkv import (
    DraftKVCacheManagerV2,
    KVCacheManagerV2,
    KVCacheResizeError,
    KVPoolConfig,
    LayerGroupConfig,
    LlmRequest,
    LlmRequestState,
    MissingKVCacheError,
    ScheduledRequests,
    SpeculativeDecodingMode as Mode,
    request_context,
)
from tensorrt_llm_draftkv import config as config_module
from tensorrt_llm_draftkv.manager.planner import PoolGeometry, trail_tokens_for
from tensorrt_llm_draftkv.request import ContextView

SENTINEL = -7  # what the caller's destination holds before a copy


def pool_config(window=8, p=4, pages=(64, 64), guard=False, max_seq_len=64, dtype=torch.float32) -> KVPoolConfig:
    return KVPoolConfig(
        layer_groups=(LayerGroupConfig(2, window=window), LayerGroupConfig(1, window=None)),
        pages_per_group=pages,
        tokens_per_block=p,
        num_kv_heads=1,
        head_dim=2,
        max_seq_len=max_seq_len,
        guard_page=guard,
        dtype=dtype,
    )


def make_target(guard=False, pages=(64, 64), draft=0, extra=0, window=8) -> KVCacheManagerV2:
    return KVCacheManagerV2.from_pool_config(
        pool_config(window=window, pages=pages, guard=guard), max_draft_len=draft, num_extra_kv_tokens=extra
    )


def make_draft(mode="dflash", sizing="history", pages=(64, 64), draft=0, extra=0, window=8) -> DraftKVCacheManagerV2:
    return DraftKVCacheManagerV2.from_pool_config(
        pool_config(window=window, pages=pages),
        spec_mode=mode,
        max_draft_len=draft,
        num_extra_kv_tokens=extra,
        sizing=sizing,
    )


def state(mgr) -> tuple:
    """Every cache, and every pool's free list in order (a rollback restores the order too)."""
    return (
        {rid: mgr.get_cache(rid).checkpoint() for rid in mgr.request_ids()},
        [pool.free_order() for pool in mgr.pools()],
        [pool.held_pages() for pool in mgr.pools()],
    )


def live_batch(mgr, prompt=30, chunk=8):
    """Two requests past their prompt (generation) and one mid-prefill (context), on `mgr`."""
    gens = [LlmRequest(rid, prompt_len=prompt) for rid in (5, 2)]
    for req in gens:
        req.target_view.chunk_size = chunk
        while req.is_context_init_state:
            mgr.prepare_resources(ScheduledRequests(context_requests=[req]))
            req.advance_context_chunk(chunk)
            mgr.update_context_resources(ScheduledRequests(context_requests=[req]))
            if req.target_view.position >= req.prompt_len:
                req.state = LlmRequestState.GENERATION_IN_PROGRESS
                req.tokens.append(1)
    mgr.prepare_resources(ScheduledRequests(generation_requests=gens))
    ctx = LlmRequest(9, prompt_len=20, target_view=ContextView(0, 12))
    mgr.prepare_resources(ScheduledRequests(context_requests=[ctx]))
    return [ctx], gens


def destination(mgr, rows, cols, *, dtype=torch.int32, pools=None) -> torch.Tensor:
    pools = mgr.num_pools if pools is None else pools
    return torch.full((pools, rows, 2, cols), SENTINEL, dtype=dtype)


# =============================================================================================
# copy_batch_block_offsets
# =============================================================================================
def test_copy_batch_block_offsets_signature_is_upstreams():
    params = list(inspect.signature(KVCacheManagerV2.copy_batch_block_offsets).parameters.values())
    assert [p.name for p in params] == [
        "self", "dst_tensor", "request_ids", "beam_width", "num_contexts", "num_seqs", "max_blocks"
    ]
    assert params[-1].default is None
    assert all(p.kind is inspect.Parameter.POSITIONAL_OR_KEYWORD for p in params)


@pytest.mark.parametrize("guard", [False, True])
def test_copy_writes_what_get_block_offsets_gives_and_nothing_else(guard):
    mgr = make_target(guard=guard, window=5)
    ctx, gens = live_batch(mgr)
    ids = [r.py_request_id for r in [*ctx, *gens]]  # contexts first, as upstream
    want = mgr.get_block_offsets(ids, "cpp")
    width = mgr.config.max_blocks_per_seq
    assert want.shape == (2, 3, 2, width)
    dst = destination(mgr, rows=5, cols=width + 3)  # larger than needed on both axes
    mgr.copy_batch_block_offsets(dst, ids, 1, len(ctx), len(ids))
    assert torch.equal(dst[:, :3, :, :width], want)
    assert (dst[:, 3:] == SENTINEL).all()  # rows past num_seqs untouched
    assert (dst[:, :, :, width:] == SENTINEL).all()  # columns past the width untouched
    # unbacked entries resolve to page 0, or to the guard page when the pool has one
    python = mgr.get_block_offsets(ids, "python")
    for g, pool in enumerate(mgr.pools()):
        unbacked = python[g, :, 0] < 0
        assert unbacked.any()
        fill = 0 if pool.guard_page_index is None else pool.guard_page_index * 2
        written = dst[g, :3, :, :width]
        assert (written[:, 0][unbacked] == fill).all() and (written[:, 1][unbacked] == fill + 1).all()


def test_copy_rows_follow_the_ids_order():
    mgr = make_target()
    ctx, gens = live_batch(mgr)
    ids = [9, 2, 5]
    dst = destination(mgr, 3, mgr.config.max_blocks_per_seq)
    mgr.copy_batch_block_offsets(dst, ids, 1, 1, 3)
    for i, rid in enumerate(ids):
        assert torch.equal(dst[:, i], mgr.get_block_offsets([rid])[:, 0])


def test_copy_with_max_blocks_writes_that_width():
    mgr = make_target()
    ctx, gens = live_batch(mgr)  # 31 + 1 tokens for the generation requests: 8 blocks of 4
    ids = [9, 5, 2]
    spans = max(len(mgr.get_cache(rid).block_row(g)) for rid in ids for g in range(2))
    dst = destination(mgr, 3, 12)
    mgr.copy_batch_block_offsets(dst, ids, 1, 1, 3, max_blocks=spans + 1)
    assert torch.equal(dst[:, :, :, : spans + 1], mgr.get_block_offsets(ids)[:, :, :, : spans + 1])
    assert (dst[:, :, :, spans + 1 :] == SENTINEL).all()
    # a narrower bound than some request spans: explicit, naming the request and both numbers
    dst = destination(mgr, 3, 12)
    with pytest.raises(ValueError, match=rf"request \d+ spans {spans} blocks, more than max_blocks={spans - 1}"):
        mgr.copy_batch_block_offsets(dst, ids, 1, 1, 3, max_blocks=spans - 1)
    assert (dst == SENTINEL).all()


def test_copy_of_an_empty_batch_changes_nothing():
    mgr = make_target()
    dst = destination(mgr, 2, mgr.config.max_blocks_per_seq)
    mgr.copy_batch_block_offsets(dst, [], 1, 0, 0)
    assert (dst == SENTINEL).all()


BAD_COPIES = {
    # name: (call arguments after dst, destination factory, error type, message pattern)
    "beam_width": (([9, 5], 2, 1, 2), None, ValueError, r"beam_width 1 only .*got beam_width=2"),
    "num_seqs": (([9, 5], 1, 1, 3), None, ValueError, r"num_seqs=3 but 2 request ids .* make 2 rows"),
    "num_contexts_negative": (([9, 5], 1, -1, 2), None, ValueError, r"num_contexts=-1 must be between 0 and num_seqs=2"),
    "num_contexts_too_many": (([9, 5], 1, 3, 2), None, ValueError, r"num_contexts=3 must be between 0 and num_seqs=2"),
    "num_seqs_not_int": (([9, 5], 1, 1, 2.0), None, TypeError, r"num_seqs must be an int, got 2.0"),
    "max_blocks": (([9, 5], 1, 1, 2, -1), None, ValueError, r"max_blocks must be an int >= 0 or None, got -1"),
    "dtype": (([9, 5], 1, 1, 2), dict(dtype=torch.int64), ValueError, r"must be torch.int32, got torch.int64"),
    "pools": (([9, 5], 1, 1, 2), dict(pools=3), ValueError, r"shape \[3, 4, 2, 16\], needs \[num_pools=2, >= num_seqs=2, 2, >= 16\]"),
    "rows": (([9, 5], 1, 1, 2), dict(rows=1), ValueError, r"shape \[2, 1, 2, 16\], needs \[num_pools=2, >= num_seqs=2"),
    "cols": (([9, 5], 1, 1, 2), dict(cols=15), ValueError, r"shape \[2, 4, 2, 15\], needs .*>= 16\] \(max_blocks_per_seq=16\)"),
    "cols_max_blocks": (([9, 5], 1, 1, 2, 20), None, ValueError, r"needs .*>= 20\] \(max_blocks=20\)"),
    "not_4d": (([9, 5], 1, 1, 2), dict(shape=(2, 4, 32)), ValueError, r"shape \[2, 4, 32\], needs"),
    "kv_axis": (([9, 5], 1, 1, 2), dict(shape=(2, 4, 3, 16)), ValueError, r"shape \[2, 4, 3, 16\], needs"),
    "missing": (([9, 77], 1, 1, 2), None, MissingKVCacheError, r"copy_batch_block_offsets names request 77"),
}


@pytest.mark.parametrize("case", list(BAD_COPIES))
def test_bad_copies_raise_explicitly_and_leave_the_destination(case):
    mgr = make_target()
    live_batch(mgr)
    args, shape, error, pattern = BAD_COPIES[case]
    width = mgr.config.max_blocks_per_seq
    assert width == 16
    shape = shape or {}
    if "shape" in shape:
        dst = torch.full(shape["shape"], SENTINEL, dtype=torch.int32)
    else:
        dst = destination(mgr, shape.get("rows", 4), shape.get("cols", width), dtype=shape.get("dtype", torch.int32),
                          pools=shape.get("pools"))
    before, manager_before = dst.clone(), state(mgr)
    with pytest.raises(error, match=pattern):
        mgr.copy_batch_block_offsets(dst, *args)
    assert torch.equal(dst, before)
    assert state(mgr) == manager_before


def test_copy_refuses_a_destination_on_another_device():
    mgr = make_target()
    live_batch(mgr)
    dst = torch.empty((2, 2, 2, 16), dtype=torch.int32, device="meta")
    with pytest.raises(ValueError, match=r"dst_tensor is on meta, this manager's pools on cpu"):
        mgr.copy_batch_block_offsets(dst, [9, 5], 1, 1, 2)
    with pytest.raises(TypeError, match=r"dst_tensor must be a torch.Tensor, got list"):
        mgr.copy_batch_block_offsets([[0]], [9, 5], 1, 1, 2)


# =============================================================================================
# add_dummy_requests
# =============================================================================================
UPSTREAM_DUMMY_PARAMS = [  # upstream's KVCacheManagerV2.add_dummy_requests, in its order
    ("request_ids", inspect.Parameter.empty),
    ("token_nums", None),
    ("is_gen", False),
    ("materialize_history", False),
    ("prepare_resource", True),
    ("max_num_draft_tokens", 0),
    ("kv_reserve_draft_tokens", None),
    ("use_mrope", False),
    ("max_beam_width", 1),
    ("encoder_output_lens", None),
    ("draft_kv_cache_manager", None),
    ("capture_sampling_params", None),
]


def test_add_dummy_requests_signature_is_upstreams():
    params = list(inspect.signature(KVCacheManagerV2.add_dummy_requests).parameters.values())[1:]
    positional = [(p.name, p.default) for p in params if p.kind is inspect.Parameter.POSITIONAL_OR_KEYWORD]
    assert positional == UPSTREAM_DUMMY_PARAMS
    ours = [(p.name, p.kind, p.default) for p in params if p.kind is not inspect.Parameter.POSITIONAL_OR_KEYWORD]
    assert ours == [("num_extra_decoding_steps", inspect.Parameter.KEYWORD_ONLY, 0),
                    ("history_hint", inspect.Parameter.KEYWORD_ONLY, None)]


def test_dummies_default_to_context_requests_as_upstream():
    mgr = make_target(draft=2, extra=1)
    (ctx,) = mgr.add_dummy_requests([1], [6], max_num_draft_tokens=2)
    assert ctx.state is LlmRequestState.CONTEXT_INIT and ctx.is_dummy and ctx.py_draft_tokens == []
    (gen,) = mgr.add_dummy_requests([2], [6], True, False, True, 2)
    assert gen.state is LlmRequestState.GENERATION_IN_PROGRESS and gen.py_draft_tokens == [1, 1]
    for rid in (1, 2):
        assert mgr.get_cache(rid).capacity == 6 + 2 + 1
    # upstream's default token count: 1 + max_num_draft_tokens
    (d,) = mgr.add_dummy_requests([3], None, True, False, True, 2)
    assert d.prompt_len == 3 and mgr.get_cache(3).capacity == 3 + 2 + 1


def test_extra_decoding_steps_add_capacity_and_use_mrope_is_ignored():
    plain, flagged = make_target(extra=1), make_target(extra=1)
    plain.add_dummy_requests([1], [10], True, False, True, 2)
    flagged.add_dummy_requests([1], [10], True, False, True, 2, None, True)  # use_mrope: no meaning here
    assert state(plain) == state(flagged)
    plain.add_dummy_requests([2], [10], True, False, True, 2, None, False, 1, num_extra_decoding_steps=3)
    assert plain.get_cache(2).capacity == 10 + 2 + 1 + 3


def test_prepare_resource_false_reserves_nothing_in_either_manager():
    target, draft = make_target(), make_draft()
    before = (state(target), state(draft))
    made = target.add_dummy_requests([1, 2], [5, 7], True, False, False, draft_kv_cache_manager=draft)
    assert [(d.py_request_id, d.prompt_len, d.is_dummy) for d in made] == [(1, 5, True), (2, 7, True)]
    assert (state(target), state(draft)) == before


@pytest.mark.parametrize("sizing", ["history", "legacy"])
def test_the_draft_manager_gets_the_same_dummies(sizing):
    window, tokens, drafts = 8, 40, 2
    target = make_target(draft=drafts, extra=1, window=window)
    draft = make_draft("dflash", sizing, draft=drafts, window=window)
    made = target.add_dummy_requests([7, 8], [tokens, tokens], True, False, True, drafts,
                                     draft_kv_cache_manager=draft, history_hint=tokens - 1)
    assert [d.py_request_id for d in made] == [7, 8]
    assert target.request_ids() == draft.request_ids() == [7, 8]
    for rid in (7, 8):
        t, d = target.get_cache(rid), draft.get_cache(rid)
        assert (t.capacity, t.history_length) == (tokens + drafts + 1, tokens - 1)
        # the mirror: the draft manager's own extra tokens (0) and its own hint rule
        want_history = tokens - 1 if sizing == "history" else 0
        assert (d.capacity, d.history_length) == (tokens + drafts, want_history)
    # the same as adding them to the draft manager alone
    alone = make_draft("dflash", sizing, draft=drafts, window=window)
    alone.add_dummy_requests([7, 8], [tokens, tokens], True, False, True, drafts, history_hint=tokens - 1)
    assert state(alone) == state(draft)
    target.check_accounting()
    draft.check_accounting()


def test_a_failing_draft_side_undoes_the_targets_dummies():
    target = make_target(draft=1)
    target.add_dummy_requests([1], [9], True)  # something already live, so free lists have an order
    draft = make_draft(pages=(3, 3), window=None, draft=1)  # too small for a 40-token dummy
    before = (state(target), state(draft))
    with pytest.raises(KVCacheResizeError, match=r"^Draft KV cache dummy resize failed for request 3"):
        strict(target, target.add_dummy_requests([2, 3], [4, 40], True, False, True, 1, draft_kv_cache_manager=draft))
    assert (state(target), state(draft)) == before
    assert target.request_ids() == [1] and draft.request_ids() == []
    # a dummy id the draft manager already holds: nothing added on either side
    draft.add_dummy_requests([4], [2])
    before = (state(target), state(draft))
    with pytest.raises(ValueError, match=r"Draft KV cache: dummy request 4 already has a cache; no dummy was added"):
        target.add_dummy_requests([5, 4], [4, 4], draft_kv_cache_manager=draft)
    assert (state(target), state(draft)) == before
    target.check_accounting()
    draft.check_accounting()


def test_bad_dummy_arguments_change_nothing():
    target, draft = make_target(), make_draft()
    target.add_dummy_requests([1], [4])
    before = (state(target), state(draft))
    with pytest.raises(ValueError, match=r"max_beam_width 1 only .*got max_beam_width=2"):
        target.add_dummy_requests([2], [4], True, False, True, 0, None, False, 2)
    with pytest.raises(ValueError, match=r"num_extra_decoding_steps \(-1\) must be >= 0"):
        target.add_dummy_requests([2], [4], num_extra_decoding_steps=-1)
    with pytest.raises(ValueError, match=r"max_num_draft_tokens \(-2\)"):
        target.add_dummy_requests([2], [4], max_num_draft_tokens=-2)
    with pytest.raises(ValueError, match=r"draft_kv_cache_manager is this manager itself"):
        target.add_dummy_requests([2], [4], draft_kv_cache_manager=target)
    with pytest.raises(TypeError, match=r"draft_kv_cache_manager must be a KVCacheManagerV2, got dict"):
        target.add_dummy_requests([2], [4], draft_kv_cache_manager={})
    with pytest.raises(ValueError, match=r"dummy request 3: token count must be >= 1, got 0"):
        target.add_dummy_requests([2, 3], [4, 0], draft_kv_cache_manager=draft)
    assert (state(target), state(draft)) == before


# =============================================================================================
# request_context
# =============================================================================================
def legacy_request(rid=1) -> LlmRequest:
    # the executor moved the target view to (32, 16); a separate draft engine left the draft view at (8, 8)
    return LlmRequest(rid, prompt_len=64, target_view=ContextView(32, 16), draft_view=ContextView(8, 8))


def test_request_context_switches_what_requests_present_and_restores_it():
    a, b = legacy_request(1), legacy_request(2)
    batch = ScheduledRequests(context_requests=[a], generation_requests=[b])
    presented = lambda r: (r.context_current_position, r.context_chunk_size, r.is_first_context_chunk)  # noqa: E731
    assert presented(a) == presented(b) == (32, 16, False)
    with request_context(True, batch):
        assert presented(a) == presented(b) == (8, 8, False)
    assert presented(a) == presented(b) == (32, 16, False)
    with pytest.raises(RuntimeError, match="boom"):
        with request_context(True, batch):
            assert presented(a) == (8, 8, False)
            raise RuntimeError("boom")
    assert presented(a) == presented(b) == (32, 16, False)
    assert not a.use_draft_model and not b.use_draft_model


def test_request_context_switches_what_a_legacy_mirror_is_sized_from():
    draft = make_draft("dflash", "legacy", draft=2, window=None)
    req = legacy_request()
    batch = ScheduledRequests(context_requests=[req])
    cache = draft.caches.new(1)
    # outside any block the request presents its target view, and so the legacy mirror reads it
    assert draft.sizing_rules.view(req) == ContextView(32, 16)
    assert draft.sizing_rules.context(req, cache) == (32 + 16, None)
    with request_context(True, batch):
        assert draft.sizing_rules.view(req) == ContextView(8, 8)
        assert draft.sizing_rules.context(req, cache) == (8 + 8, None)
    assert draft.sizing_rules.view(req) == ContextView(32, 16)
    with pytest.raises(RuntimeError):
        with request_context(True, batch):
            assert draft.sizing_rules.context(req, cache) == (16, None)
            raise RuntimeError
    assert draft.sizing_rules.context(req, cache) == (48, None) and not req.use_draft_model


def test_the_history_sizing_of_an_external_drafter_reads_the_target_view_whatever_the_flag():
    draft = make_draft("dflash", "history", draft=2, window=None)
    req = legacy_request()
    batch = ScheduledRequests(context_requests=[req])
    for flag in (None, False, True):
        if flag is None:
            assert draft.sizing_rules.view(req) == ContextView(32, 16)
            continue
        with request_context(flag, batch):
            assert draft.sizing_rules.view(req) == ContextView(32, 16)


@pytest.mark.parametrize("flag", [None, False, True])
def test_a_draft_managers_prepare_opens_request_context_itself_as_upstream(flag):
    """Like upstream's _prepare_draft_resources: the legacy mirror reads the draft view, and the flag comes back."""
    draft = make_draft("dflash", "legacy", draft=2, window=None)
    req = legacy_request()
    batch = ScheduledRequests(context_requests=[req])
    if flag is None:
        draft.prepare_resources(batch)
    else:
        with request_context(flag, batch):
            draft.prepare_resources(batch)
            assert req.use_draft_model is flag
    assert draft.get_cache(1).capacity == 8 + 8 and req.use_draft_model is False
    # and when the prepare raises, the flag is restored too
    tiny = make_draft("dflash", "legacy", pages=(1, 1), window=None)
    with pytest.raises(KVCacheResizeError):
        tiny.prepare_resources(ScheduledRequests(context_requests=[legacy_request(2)]))
    assert tiny.request_ids() == []


# =============================================================================================
# KVPoolConfig (our pool geometry) and KvCacheConfig (upstream's LLM-API budget) are two names
# =============================================================================================
def test_kv_cache_config_is_upstreams_budget_and_kv_pool_config_our_geometry():
    from tensorrt_llm_draftkv.llmapi import KvCacheConfig as llmapi_config

    assert {"KVPoolConfig", "KvCacheConfig"} <= set(tensorrt_llm_draftkv.__all__)
    assert tensorrt_llm_draftkv.KvCacheConfig is llmapi_config and not hasattr(config_module, "KvCacheConfig")
    budget = tensorrt_llm_draftkv.KvCacheConfig(max_tokens=4096)
    assert (budget.free_gpu_memory_fraction, budget.enable_block_reuse, budget.tokens_per_block) == (0.9, True, 32)
    with pytest.raises(TypeError):
        tensorrt_llm_draftkv.KvCacheConfig(layer_groups=(LayerGroupConfig(1),), pages_per_group=(4,))
    with pytest.raises(AttributeError, match="has no attribute 'NoSuchConfig'"):
        tensorrt_llm_draftkv.NoSuchConfig  # noqa: B018


def test_the_library_itself_never_uses_the_deprecated_name():
    code = (
        "import warnings; warnings.simplefilter('error', DeprecationWarning)\n"
        "import tensorrt_llm_draftkv, tensorrt_llm_draftkv.manager.kv_cache_manager\n"
        "import tensorrt_llm_draftkv.manager.draft_kv_cache_manager, tensorrt_llm_draftkv.manager.planner\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr


# =============================================================================================
# Strings where an enum or a dtype is
# =============================================================================================
def test_spec_mode_strings():
    by_name = make_draft("dflash", window=8)
    by_enum = make_draft(Mode.DFLASH, window=8)
    assert by_name.spec_mode is Mode.DFLASH and by_name.policy == by_enum.policy
    assert by_name.windows == by_enum.windows and by_name.draft_slot_trail_tokens == 4
    assert make_draft("DRAFT-TARGET-ONE-MODEL").spec_mode is Mode.DRAFT_TARGET_ONE_MODEL
    assert make_draft("Eagle3_One_Model").spec_mode is Mode.EAGLE3_ONE_MODEL
    with pytest.raises(ValueError, match=r"unknown speculative decoding mode 'medusa'; known: mtp, mtp_eagle, .*dflash, dspark, none, auto"):
        make_draft("medusa")
    with pytest.raises(TypeError, match=r"SpeculativeDecodingMode or a string, got int"):
        make_draft(3)
    geometry = PoolGeometry(layer_groups=(LayerGroupConfig(1, window=64),), num_kv_heads=1, head_dim=8,
                            dtype=torch.bfloat16, tokens_per_block=16)
    assert trail_tokens_for("dflash", geometry, True) == trail_tokens_for(Mode.DFLASH, geometry, True) == 16
    assert trail_tokens_for("pard", geometry, True) == 0


def test_dtype_strings():
    cfg = pool_config(dtype="bf16")
    assert cfg.dtype is torch.bfloat16 and cfg == pool_config(dtype=torch.bfloat16)
    assert pool_config(dtype="Float16").dtype is torch.float16
    mgr = KVCacheManagerV2.from_pool_config(cfg)
    assert all(layer.dtype is torch.bfloat16 for pool in mgr.pools() for layer in pool.layers)
    with pytest.raises(ValueError, match=r"unknown dtype 'int4'; known: bf16, bfloat16, .*fp8"):
        pool_config(dtype="int4")
    with pytest.raises(TypeError, match=r"a dtype is a torch.dtype or a string, got int"):
        pool_config(dtype=16)


# =============================================================================================
# One executor step written the upstream way
# =============================================================================================
def test_an_upstream_style_executor_step():
    drafts = 2
    target = make_target(draft=drafts, extra=1, window=8)
    draft = make_draft("dflash", "history", draft=drafts, window=8)
    width = target.config.max_blocks_per_seq

    # CUDA-graph warmup, upstream's call: generation dummies in both managers, then freed
    ids, token_nums = [1001, 1002], [20, 13]
    dummies = target.add_dummy_requests(ids, token_nums, True, False, True, drafts, None, False, 1, None, draft,
                                        history_hint=max(token_nums) - 1)
    assert all(d.is_generation_in_progress_state for d in dummies)
    for mgr in (target, draft):
        dst = torch.full((mgr.num_pools, 4, 2, width), SENTINEL, dtype=torch.int32)
        mgr.copy_batch_block_offsets(dst, ids, 1, 0, 2)
        assert torch.equal(dst[:, :2], mgr.get_block_offsets(ids))
        mgr.free_resources(ids)
        assert mgr.request_ids() == []

    # a step: one context chunk and one generation request
    gen = LlmRequest(1, prompt_len=12, target_view=ContextView(0, 12))
    for mgr in (target, draft):
        with request_context(mgr is draft, ScheduledRequests(context_requests=[gen])):
            mgr.prepare_resources(ScheduledRequests(context_requests=[gen]))
    gen.advance_context_chunk()
    for mgr in (target, draft):
        mgr.update_context_resources(ScheduledRequests(context_requests=[gen]))
    gen.state = LlmRequestState.GENERATION_IN_PROGRESS
    gen.tokens.append(7)
    ctx = LlmRequest(2, prompt_len=30, target_view=ContextView(0, 16))
    batch = ScheduledRequests(context_requests=[ctx], generation_requests=[gen])
    target.prepare_resources(batch)
    with request_context(True, batch):
        draft.prepare_resources(batch)
    ids = [r.py_request_id for r in batch.all_requests()]
    num_contexts, num_seqs = len(batch.context_requests), batch.batch_size
    for mgr in (target, draft):
        dst = torch.full((mgr.num_pools, 8, 2, width), SENTINEL, dtype=torch.int32)
        mgr.copy_batch_block_offsets(dst, ids, 1, num_contexts, num_seqs)
        assert torch.equal(dst[:, :num_seqs], mgr.get_block_offsets(ids, "cpp"))
        assert (dst[:, num_seqs:] == SENTINEL).all()
        mgr.check_accounting()
