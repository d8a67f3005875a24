"""Upstream's constructor: the signature verbatim, and the pools it builds from the model's shape and the budget.

An executor written for TensorRT-LLM builds its managers with `KVCacheManagerV2(kv_cache_config,
kv_cache_type, *, num_layers, ...)`; `is_draft=True` with a drafter's spec_config gives the draft
manager. These tests pin the signature against upstream's, then what each argument does here.
"""
from __future__ import annotations

import inspect
import warnings

import pytest
import torch

from tensorrt_llm_draftkv import DraftKVCacheManagerV2, KVCacheManagerV2
from tensorrt_llm_draftkv import SpeculativeDecodingMode as Mode
from tensorrt_llm_draftkv.bindings import CacheType, DataType
from tensorrt_llm_draftkv.llmapi import (
    DFlashDecodingConfig,
    DSparkDecodingConfig,
    Eagle3DecodingConfig,
    KvCacheConfig,
    MTPDecodingConfig,
    PARDDecodingConfig,
    get_num_extra_kv_tokens,
    should_use_separate_draft_kv_cache,
)
from tensorrt_llm_draftkv.manager import budget
from tensorrt_llm_draftkv.mapping import Mapping

E = inspect.Parameter.empty
# Upstream's KVCacheManagerV2.__init__ (tensorrt_llm/_torch/pyexecutor/kv_cache/kv_cache_manager_v2.py),
# name, kind and default, in its order.
UPSTREAM_INIT = [
    ("kv_cache_config", "POSITIONAL_OR_KEYWORD", E),
    ("kv_cache_type", "POSITIONAL_OR_KEYWORD", E),
    ("num_layers", "KEYWORD_ONLY", E),
    ("num_kv_heads", "KEYWORD_ONLY", E),
    ("head_dim", "KEYWORD_ONLY", E),
    ("tokens_per_block", "KEYWORD_ONLY", E),
    ("max_seq_len", "KEYWORD_ONLY", E),
    ("max_batch_size", "KEYWORD_ONLY", E),
    ("mapping", "KEYWORD_ONLY", E),
    ("dtype", "KEYWORD_ONLY", DataType.HALF),
    ("spec_config", "KEYWORD_ONLY", None),
    ("layer_mask", "KEYWORD_ONLY", None),
    ("vocab_size", "KEYWORD_ONLY", None),
    ("max_num_tokens", "KEYWORD_ONLY", 8192),
    ("model_config", "KEYWORD_ONLY", None),
    ("max_beam_width", "KEYWORD_ONLY", 1),
    ("is_draft", "KEYWORD_ONLY", False),
    ("kv_connector_manager", "KEYWORD_ONLY", None),
    ("execution_stream", "KEYWORD_ONLY", None),
    ("is_disagg", "KEYWORD_ONLY", False),
    ("enable_stats", "KEYWORD_ONLY", False),
    ("num_reserved_index_slots", "KEYWORD_ONLY", 1),
    ("disable_overlap_scheduler", "KEYWORD_ONLY", False),
    ("kv_events_config", "KEYWORD_ONLY", None),
    ("is_estimating_kv_cache", "KEYWORD_ONLY", False),
    ("cold_page_codec_provider", "KEYWORD_ONLY", None),
    ("joint_kv_cache_reuse", "KEYWORD_ONLY", False),
    ("max_cuda_graph_batch_size", "KEYWORD_ONLY", None),
    ("kwargs", "VAR_KEYWORD", E),
]


def shape(fn) -> list[tuple[str, str, object]]:
    params = list(inspect.signature(fn).parameters.values())[1:]
    return [(p.name, p.kind.name, p.default) for p in params]


def test_the_constructor_is_upstreams_argument_for_argument():
    assert shape(KVCacheManagerV2.__init__) == UPSTREAM_INIT
    # the draft manager is the same constructor (upstream has one class)
    assert DraftKVCacheManagerV2.__init__ is KVCacheManagerV2.__init__


def build(kv_cache_config: KvCacheConfig, **kw) -> KVCacheManagerV2:
    args = dict(num_layers=4, num_kv_heads=8, head_dim=16, tokens_per_block=32, max_seq_len=65536, max_batch_size=4,
                mapping=Mapping(), dtype=DataType.BF16, device="cpu")
    args.update(kw)
    return KVCacheManagerV2(kv_cache_config, CacheType.SELF, **args)


def test_a_target_manager_groups_layers_by_window_in_model_order():
    cfg = KvCacheConfig(max_tokens=8192, max_attention_window=[1024, 65536], enable_block_reuse=False)
    mgr = build(cfg)
    assert type(mgr) is KVCacheManagerV2 and not mgr.is_draft
    # the window list repeats over the layers: 0, 2 windowed; 1, 3 full (a window >= max_seq_len)
    assert mgr.windows == (1024, None)
    assert [(s.group, s.index) for s in mgr.layer_slots] == [(0, 0), (1, 0), (0, 1), (1, 1)]
    assert mgr.config.num_kv_heads == 8 and mgr.config.head_dim == 16 and mgr.config.dtype == torch.bfloat16
    assert mgr.config.kv_factor == 2 and not mgr.block_reuse
    # every layer's storage is its own tensor of its group's pool
    assert mgr.get_buffers(0).data_ptr() == mgr.layer_groups[0].pool.layers[0].data_ptr()
    assert mgr.get_buffers(3).data_ptr() == mgr.layer_groups[1].pool.layers[1].data_ptr()


def test_the_budget_is_the_smallest_given_and_a_window_takes_no_more_than_its_requests_hold():
    bytes_per_token = 4 * 2 * 8 * 16 * 2  # layers * K/V * heads * head_dim * bf16
    cfg = KvCacheConfig(max_tokens=1 << 16, max_attention_window=[256, 65536])
    mgr = build(cfg, max_num_tokens=512)
    windowed_cap = 4 * budget.group_pages_per_request(256, 32, max_seq_len=65536, chunk=512)
    even = (1 << 16) // 32
    assert mgr.free_pages()[0] == windowed_cap < even
    # what the windowed group does not take goes to the full-attention group (same bytes per page)
    assert mgr.free_pages()[1] == even + (even - windowed_cap)
    assert mgr._upstream_args.budget_source == "max_tokens"
    # max_gpu_total_bytes smaller than max_tokens' bytes: it wins
    small = build(KvCacheConfig(max_tokens=1 << 16, max_gpu_total_bytes=bytes_per_token * 2048))
    assert small.free_pages() == (2048 // 32,) and small._upstream_args.budget_source == "max_gpu_total_bytes"


def test_tensor_parallelism_splits_the_heads_and_a_layer_mask_keeps_the_drafter_layers():
    mgr = build(KvCacheConfig(max_tokens=4096), mapping=Mapping(world_size=4, tp_size=4, rank=2))
    assert mgr.config.num_kv_heads == 2
    masked = build(KvCacheConfig(max_tokens=4096, max_attention_window=[64, 65536, 65536, 128]),
                   layer_mask=[False, True, False, True])
    assert masked.num_local_layers == 2 and masked.windows == (None, 128)


def test_a_draft_manager_is_built_by_is_draft_with_the_drafters_config():
    spec = DFlashDecodingConfig(max_draft_len=7)
    cfg = KvCacheConfig(max_tokens=8192, max_attention_window=[4096])
    draft = build(cfg, num_layers=5, num_kv_heads=4, head_dim=128, spec_config=spec, is_draft=True)
    assert type(draft) is DraftKVCacheManagerV2 and draft.is_draft
    assert draft.spec_mode is Mode.DFLASH and draft.sizing.value == "history"
    # the DFlash trail page widens the window by one page; the block fits above the drafts
    assert draft.draft_slot_trail_tokens == 32 and draft.windows == (4096 + 32,)
    assert draft.max_draft_len == 7 and draft.num_extra_kv_tokens == 8 >= get_num_extra_kv_tokens(spec) == 6
    # the same config for the target side: upstream's extra tokens, no trail page
    target = build(cfg, num_layers=5, num_kv_heads=4, head_dim=128, spec_config=spec)
    assert type(target) is KVCacheManagerV2 and target.num_extra_kv_tokens == 6 and target.windows == (4096,)
    legacy = build(cfg, spec_config=spec, is_draft=True, sizing="legacy")
    assert legacy.sizing.value == "legacy" and legacy.draft_slot_trail_tokens == 0


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(kv_cache_type=CacheType.CROSS), "cross-attention caches are not supported"),
        (dict(mapping=Mapping(world_size=2, pp_size=2)), r"pipeline and context parallelism are not supported \(pp_size=2"),
        (dict(max_beam_width=4), r"beam search is not supported \(max_beam_width=4"),
        (dict(kv_connector_manager=object()), "KV cache connectors are not supported"),
        (dict(is_draft=True), "is_draft=True needs the drafter's spec_config"),
        (dict(layer_mask=[False] * 4), "layer_mask keeps none of the 4 layers"),
        (dict(num_kv_heads=[8, 8, 4, 8]), r"different num_kv_heads \(\[4, 8\]\)"),
        (dict(max_batch_size=0), "max_batch_size must be >= 1, got 0"),
    ],
)
def test_what_is_not_implemented_is_refused_naming_the_argument(kwargs, message):
    cache_type = kwargs.pop("kv_cache_type", CacheType.SELF)
    args = dict(num_layers=4, num_kv_heads=8, head_dim=16, tokens_per_block=32, max_seq_len=65536, max_batch_size=4,
                mapping=Mapping(), device="cpu")
    args.update(kwargs)
    with pytest.raises(ValueError, match=message):
        KVCacheManagerV2(KvCacheConfig(max_tokens=4096), cache_type, **args)


def test_a_budget_that_buys_no_page_or_none_at_all_is_refused_with_the_numbers():
    with pytest.raises(ValueError, match=r"a budget of 100 bytes \(max_gpu_total_bytes\) buys no page"):
        build(KvCacheConfig(max_tokens=None, max_gpu_total_bytes=100))
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match=r"no KV cache budget: .*set KvCacheConfig.max_tokens or max_gpu_total_bytes"):
            build(KvCacheConfig(max_tokens=None), device="cpu")


def test_the_draft_class_refuses_to_be_a_target_and_unknown_keywords_are_named():
    with pytest.raises(ValueError, match="DraftKVCacheManagerV2 is the draft manager: pass is_draft=True"):
        DraftKVCacheManagerV2(KvCacheConfig(max_tokens=4096), CacheType.SELF, num_layers=1, num_kv_heads=1,
                              head_dim=8, tokens_per_block=32, max_seq_len=4096, max_batch_size=1,
                              mapping=Mapping(), device="cpu")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        build(KvCacheConfig(max_tokens=4096), some_new_upstream_option=3)
    assert any("ignoring keyword arguments ['some_new_upstream_option']" in str(w.message) for w in caught)


def test_a_k_only_cache_holds_one_tensor_per_token():
    mgr = KVCacheManagerV2(KvCacheConfig(max_tokens=4096), CacheType.SELFKONLY, num_layers=2, num_kv_heads=1,
                           head_dim=64, tokens_per_block=64, max_seq_len=4096, max_batch_size=2, mapping=Mapping(),
                           device="cpu")
    assert mgr.config.kv_factor == 1 and mgr.get_buffers(1).shape == (64, 1, 64, 1, 64)


# -- the speculative configs -------------------------------------------------------------------------------------
def test_which_drafters_keep_a_separate_draft_pool():
    assert should_use_separate_draft_kv_cache(None) is False
    for cfg in (DFlashDecodingConfig(max_draft_len=4), PARDDecodingConfig(max_draft_len=4),
                DSparkDecodingConfig(max_draft_len=4), MTPDecodingConfig(max_draft_len=1),
                Eagle3DecodingConfig(max_draft_len=3)):
        assert should_use_separate_draft_kv_cache(cfg) is True, cfg
    assert should_use_separate_draft_kv_cache(Eagle3DecodingConfig(max_draft_len=3, eagle3_one_model=False)) is False
    assert should_use_separate_draft_kv_cache(DSparkDecodingConfig(max_draft_len=4, draft_is_embedded_in_target=True)) is False
    assert should_use_separate_draft_kv_cache(DFlashDecodingConfig(max_draft_len=4, use_shared_kv_cache=True)) is False
    assert should_use_separate_draft_kv_cache(DFlashDecodingConfig(max_draft_len=4, allow_separate_draft_kv_cache=False)) is False
    assert DFlashDecodingConfig(max_draft_len=7).tokens_per_gen_step == 8
    assert Eagle3DecodingConfig(max_draft_len=3, eagle3_one_model=False).spec_dec_mode is Mode.EAGLE3


def test_the_mode_predicates_are_upstreams():
    expect = {
        "is_external_drafter": {"PARD", "DFLASH", "DSPARK", "DRAFT_TARGET_ONE_MODEL"},
        "is_parallel_draft": {"PARD", "DFLASH", "DSPARK"},
        "use_one_engine": {"MTP", "MTP_EAGLE_ONE_MODEL", "EAGLE3_ONE_MODEL", "SA", "PARD", "DFLASH", "DSPARK",
                           "DRAFT_TARGET_ONE_MODEL"},
        "is_mtp_one_model": {"MTP", "MTP_EAGLE_ONE_MODEL"},
        "has_draft_model": {"EAGLE3", "DRAFT_TARGET", "MTP_EAGLE"},
        "needs_kv_cache_recompute": {"EAGLE3", "MTP_EAGLE"},
        "support_dynamic_draft_len": {"MTP", "MTP_EAGLE_ONE_MODEL", "EAGLE3_ONE_MODEL", "PARD", "DFLASH",
                                      "DRAFT_TARGET_ONE_MODEL", "SA"},
        "has_spec_drafter": {"EAGLE3", "DRAFT_TARGET", "NGRAM", "USER_PROVIDED", "MTP_EAGLE"},
        "keeps_trail_page": {"DFLASH", "DSPARK"},
    }
    for predicate, members in expect.items():
        assert {m.name for m in Mode if getattr(m, predicate)()} == members, predicate
    assert Mode.from_string(None) is Mode.NONE and Mode.from_string("dflash") is Mode.DFLASH
    with pytest.raises(KeyError):
        Mode.from_string("medusa")
    assert Mode.parse("draft-target-one-model") is Mode.DRAFT_TARGET_ONE_MODEL and Mode.DSPARK.label == "dspark"
