"""The estimators charge the trail page: per request, in the quota conversion and in the budget split.

The figure to reproduce (docs/design.md, "Trail page"): a drafter of 5 layers, 4 KV heads x 128,
bf16, 32-token pages, a 4,096-token window: the trail page costs 320 KiB per
request, 0.78 % of the window.
"""
from __future__ import annotations

import math

import pytest
import torch

from tensorrt_llm_draftkv import (
    DraftKVCacheManagerV2,
    KVCacheResizeError,
    KVPoolConfig,
    LayerGroupConfig,
    LlmRequest,
    LlmRequestState,
    ScheduledRequests,
    SpeculativeDecodingMode as Mode,
)
from tensorrt_llm_draftkv.__main__ import main as cli_main
from tensorrt_llm_draftkv.manager.rules import step_headroom
from tensorrt_llm_draftkv.manager.budget import (
    AffineCost,
    bytes_per_page,
    bytes_per_token,
    full_attention_pages_per_request,
    group_pages_per_request,
    max_tokens_to_quota,
    pages_for_quota,
    quota_to_max_tokens,
    split_budget,
    trail_cost,
    windowed_pages_per_request,
)
from tensorrt_llm_draftkv.manager.plan_format import format_report
from tensorrt_llm_draftkv.manager.planner import PoolGeometry, plan_pool, trail_tokens_for
from tensorrt_llm_draftkv.request import ContextView
from support import ceil_div

KIB = 1024




# =============================================================================================
# The estimator, against a brute-force maximum over histories.
# =============================================================================================
def brute_peak(window: int, p: int, headroom: int, alignment: int) -> int:
    """Most ordinals overlapping [h + 1 - W, h + headroom) over every history h ≡ 0 (mod alignment)."""
    period = alignment * p // math.gcd(alignment, p)
    best = 0
    for h in range(0, window + 3 * period + p, alignment):
        lo = max(0, (h + 1 - window) // p)
        hi = ceil_div(h + headroom, p)
        best = max(best, hi - lo)
    return best


@pytest.mark.parametrize("p", [1, 3, 8, 16])
@pytest.mark.parametrize("alignment", [1, 2, 5, 8, 16, 24, 40])
def test_windowed_pages_per_request_is_the_exact_peak(p, alignment):
    for window in (1, 2, 7, 16, 17, 33, 64):
        for headroom in (1, 2, 5, 16, 40):
            assert windowed_pages_per_request(window, p, headroom, alignment) == brute_peak(
                window, p, headroom, alignment
            ), (window, headroom)


def test_the_unaligned_charge_bounds_every_alignment():
    for window in (1, 9, 33, 100):
        for p in (1, 4, 16):
            for alignment in (1, 3, 8, 64, 100):
                aligned = windowed_pages_per_request(window, p, 50, alignment)
                assert aligned <= windowed_pages_per_request(window, p, 50, 1)


def test_group_charge_pieces():
    # full attention: the whole sequence
    assert group_pages_per_request(None, 32, max_seq_len=1000, chunk=256) == full_attention_pages_per_request(1000, 32) == 32
    # sinks are charged on top, and the full-attention charge caps everything
    base = group_pages_per_request(64, 16, max_seq_len=1 << 16, chunk=32)
    assert group_pages_per_request(64, 16, max_seq_len=1 << 16, chunk=32, sink_blocks=2) == base + 2
    assert group_pages_per_request(64, 16, max_seq_len=48, chunk=32) == 3
    # the trail widens the window by its tokens
    assert group_pages_per_request(64, 16, max_seq_len=1 << 16, chunk=32, trail_tokens=16) == windowed_pages_per_request(
        80, 16, 32, 1
    )
    assert step_headroom(8192, 7, 1) == 8200 and step_headroom(0, 7, 1) == 9
    with pytest.raises(ValueError):
        windowed_pages_per_request(0, 16, 1)


# =============================================================================================
# The trail page's cost.
# =============================================================================================
GROUP = LayerGroupConfig(5, window=4096)
GEOMETRY = PoolGeometry((GROUP,), num_kv_heads=4, head_dim=128, dtype=torch.bfloat16, tokens_per_block=32)


@pytest.mark.parametrize("chunk, drafts, aligned", [(8192, 7, True), (8192, 7, False), (1, 0, False), (2048, 3, True)])
def test_trail_page_costs_320_kib_per_request_0_78_percent_of_the_window(chunk, drafts, aligned):
    page_bytes = bytes_per_page(GROUP, tokens_per_block=32, num_kv_heads=4, head_dim=128, dtype=torch.bfloat16)
    assert page_bytes == 5 * 2 * 4 * 128 * 2 * 32 == 320 * KIB
    trail = trail_tokens_for(Mode.DSPARK, GEOMETRY, is_draft_pool=True)
    assert trail == 32
    kwargs = dict(max_seq_len=524288, chunk=chunk, max_draft_len=drafts, chunk_alignment=aligned)
    with_trail = group_pages_per_request(4096, 32, trail_tokens=trail, **kwargs)
    without = group_pages_per_request(4096, 32, trail_tokens=0, **kwargs)
    assert with_trail - without == 1  # one page per windowed group per request
    trail_bytes = (with_trail - without) * page_bytes
    assert trail_bytes == trail_cost([page_bytes]) == 320 * KIB
    window_bytes = 4096 * bytes_per_token(GROUP, num_kv_heads=4, head_dim=128, dtype=torch.bfloat16)
    assert window_bytes == 40 * KIB * KIB
    percent = 100.0 * trail_bytes / window_bytes
    assert percent == pytest.approx(0.78125)
    assert f"{percent:.2f} %" == "0.78 %"


def test_the_planner_reports_the_same_trail_cost():
    report = plan_pool(
        "draft", GEOMETRY, budget_bytes=1 << 30, max_seq_len=524288, chunk=8192, max_draft_len=7,
        trail_tokens=trail_tokens_for(Mode.DSPARK, GEOMETRY, True),
    )
    assert report.trail_bytes_per_request == 320 * KIB
    text = format_report(report, 32)
    assert "320 KiB" in text and "0.78 %" in text
    no_trail = plan_pool("draft", GEOMETRY, budget_bytes=1 << 30, max_seq_len=524288, chunk=8192, max_draft_len=7)
    assert report.groups[0].pages_per_request == no_trail.groups[0].pages_per_request + 1
    assert report.bytes_per_request - no_trail.bytes_per_request == 320 * KIB


def test_the_plan_command_prints_the_figure(capsys):
    assert cli_main(["plan"]) == 0
    out = capsys.readouterr().out
    assert "320 KiB" in out and "0.78 %" in out


@pytest.mark.parametrize("mode", list(Mode))
@pytest.mark.parametrize("windows", [(None,), (4096,), (4096, None)])
def test_planner_trail_tokens_match_the_manager(mode, windows):
    groups = tuple(LayerGroupConfig(1, window=w) for w in windows)
    geometry = PoolGeometry(groups, 1, 1, torch.float32, 32)
    mgr = DraftKVCacheManagerV2.from_pool_config(
        KVPoolConfig(groups, (1,) * len(groups), tokens_per_block=32, num_kv_heads=1, head_dim=1), spec_mode=mode
    )
    assert trail_tokens_for(mode, geometry, is_draft_pool=True) == mgr._draft_slot_trail_tokens
    assert trail_tokens_for(mode, geometry, is_draft_pool=False) == 0


# =============================================================================================
# Quota conversion and the budget split charge the trail as a per-request intercept.
# =============================================================================================
def test_quota_conversions_round_trip():
    assert pages_for_quota(10 * 320 * KIB + 5, 320 * KIB) == 10
    assert quota_to_max_tokens(10 * 320 * KIB + 5, 320 * KIB, 32) == 320
    assert max_tokens_to_quota(321, 320 * KIB, 32) == 11 * 320 * KIB
    cost = AffineCost(per_token=10 * KIB, per_request=320 * KIB)
    assert cost.bytes_for(4096, 8) == 4096 * 10 * KIB + 8 * 320 * KIB
    assert cost.max_tokens_for(cost.bytes_for(4096, 8), 8) == 4096
    assert cost.max_tokens_for(cost.bytes_for(4096, 8) + 10 * KIB - 1, 8) == 4096
    with pytest.raises(ValueError, match="per-request cost"):
        cost.max_tokens_for(8 * 320 * KIB - 1, 8)
    with pytest.raises(ValueError, match="per-request costs"):
        split_budget(100, AffineCost(1), cost, 8)


# A small draft geometry, so the real pool of the plan can be driven.
P, W, CHUNK, DRAFTS, PROMPT, N = 16, 256, 128, 3, 1024, 4
DRAFT_GROUP = LayerGroupConfig(2, window=W)
TARGET_GROUP = LayerGroupConfig(4, window=None)


def run_lockstep(pages: int) -> dict[int, int]:
    """N identical DFlash requests in lockstep on a draft pool of `pages`; peak pages per request."""
    config = KVPoolConfig((DRAFT_GROUP,), (pages,), tokens_per_block=P, num_kv_heads=1, head_dim=1)
    mgr = DraftKVCacheManagerV2.from_pool_config(config, spec_mode=Mode.DFLASH, max_draft_len=DRAFTS)
    reqs = [LlmRequest(i, prompt_len=PROMPT, target_view=ContextView(0, CHUNK)) for i in range(N)]
    peak = {i: 0 for i in range(N)}
    for step in range(PROMPT // CHUNK + 4):
        ctx = [r for r in reqs if r.is_context_init_state]
        gen = [r for r in reqs if r.is_generation_in_progress_state]
        batch = ScheduledRequests(ctx, gen)
        mgr.prepare_resources(batch)
        for r in reqs:
            peak[r.py_request_id] = max(peak[r.py_request_id], mgr.get_cache(r.py_request_id).num_held_pages())
        for r in ctx:
            r.advance_context_chunk(CHUNK)
            if r.target_view.position >= PROMPT:
                r.state = LlmRequestState.GENERATION_IN_PROGRESS
                r.tokens.append(1)
        for r in gen:
            r.tokens += [1] * (1 + DRAFTS)
        mgr.update_context_resources(ScheduledRequests(ctx))
        mgr.update_resources(batch)
    mgr.check_accounting()
    return peak


def test_split_budget_with_the_trail_intercept_supports_n_requests_without_it_one_page_short():
    kw = dict(num_kv_heads=2, head_dim=8, dtype=torch.float16)
    draft_page = bytes_per_page(DRAFT_GROUP, tokens_per_block=P, **kw)
    draft_token = bytes_per_token(DRAFT_GROUP, **kw)
    target_token = bytes_per_token(TARGET_GROUP, **kw)
    charge = dict(max_seq_len=1 << 16, chunk=CHUNK, max_draft_len=DRAFTS, chunk_alignment=True)
    pages_plain = group_pages_per_request(W, P, trail_tokens=0, **charge)
    pages_trail = group_pages_per_request(W, P, trail_tokens=P, **charge)
    assert pages_trail == pages_plain + 1
    planned_tokens = N * pages_plain * P  # the token slots the plan gives each pool

    target = AffineCost(per_token=target_token)
    with_intercept = AffineCost(per_token=draft_token, per_request=trail_cost([draft_page]))
    without = AffineCost(per_token=draft_token)

    # With the intercept: a budget for the planned tokens, plus less than one token of slack.
    total = target.bytes_for(planned_tokens, N) + with_intercept.bytes_for(planned_tokens, N)
    split = split_budget(total + target_token + draft_token - 1, target, with_intercept, N)
    assert split.max_tokens == planned_tokens
    assert split.target_bytes == target_token * planned_tokens
    assert split.draft_bytes == draft_token * planned_tokens + N * draft_page
    assert with_intercept.max_tokens_for(split.draft_bytes, N) == planned_tokens
    draft_pages = pages_for_quota(split.draft_bytes, draft_page)
    assert draft_pages == N * pages_trail
    peak = run_lockstep(draft_pages)  # must not raise
    assert peak == {i: pages_trail for i in range(N)}

    # Without it: the same planned tokens buy one page per request less, and the pool fails.
    total = target.bytes_for(planned_tokens, N) + without.bytes_for(planned_tokens, N)
    split = split_budget(total, target, without, N)
    assert split.max_tokens == planned_tokens
    draft_pages = pages_for_quota(split.draft_bytes, draft_page)
    assert draft_pages == N * pages_trail - N
    with pytest.raises(KVCacheResizeError, match=r"^Draft KV cache context resize failed for request \d+"):
        run_lockstep(draft_pages)
