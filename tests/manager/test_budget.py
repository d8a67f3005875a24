"""Estimators: never below the peak the real cache holds, and no over-charge.

The sweep runs one request per random geometry through the REAL manager
(chunked prefill in fixed chunks, then generation with random acceptance),
measures the pages each layer group holds after every manager call, and
compares with `budget.group_pages_per_request`.

What "passes every page alignment" means
-----------------------------------------
A step with history h and headroom H (tokens above h) makes a windowed group
(effective window W, trail included) hold the ordinals from
`(h + 1 - W) // P` (or the sinks) to `ceil((h + H) / P) - 1`. For h past the
point where the window has released everything but the sinks
(h >= W - 1 + sinks * P) the count depends only on the *alignment*
`(h + 1 - W) mod P` and on H. A schedule "passes every page alignment" of a
term when it contains a step with that term's headroom at every alignment the
term ranges over — in particular at the worst one:

* generation term, H = 1 + drafts + extra, h free: the generation phase passes
  every alignment only if history advances by single tokens for P consecutive
  steps after the release (a step that accepts k drafts jumps k + 1 residues and
  may skip the worst one). The sweep inserts such a run of rejected drafts.
* context term, H = chunk + drafts + extra: every chunk carries the extra
  tokens, only the LAST chunk the drafts (docs/design.md), so a non-last chunk puts
  chunk + extra above its start. With drafts the term is reached only by a
  full-size last chunk starting at the worst alignment; without drafts any full
  chunk at the worst alignment reaches it. With fixed chunks of c tokens the
  starts are multiples of c, so the alignments reachable are those of k*c
  (`chunk_alignment=True`); with `chunk_alignment=False` every residue is assumed
  reachable, which a fixed-chunk schedule realises only when gcd(c, P) = 1. The
  sweep picks, for most geometries, the prompt length that puts a full last
  chunk on the worst reachable alignment (found by brute force over positions,
  not from the estimator's formula).

Besides, the context phase's peak is derived by brute force from the chunk
schedule and the sizing rule, so equality with the estimator is asserted
wherever ANY chunk (a non-last one included) reached the worst alignment.

When the schedule provably passed the worst alignment the estimator must equal
the measured peak (no over-charge); in every case it must be >= the peak.
"""
from __future__ import annotations

import math
import random

import pytest
import torch

from tensorrt_llm_draftkv import (
    DraftKVCacheManagerV2,
    KVPoolConfig,
    KVCacheManagerV2,
    LayerGroupConfig,
    LlmRequest,
    LlmRequestState,
    ScheduledRequests,
    SpeculativeDecodingMode,
)
from tensorrt_llm_draftkv.manager import rules
from tensorrt_llm_draftkv.manager.rules import step_headroom
from tensorrt_llm_draftkv.manager.budget import (
    bytes_per_page,
    bytes_per_token,
    full_attention_pages_per_request,
    group_pages_per_request,
    max_concurrency,
    max_tokens_to_quota,
    pages_for_quota,
    quota_to_max_tokens,
    windowed_pages_per_request,
)
from support import ceil_div




# -- brute force ---------------------------------------------------------------------------------------------
def held_count(h: int, cap: int, window: int | None, sinks: int, p: int) -> int:
    """Pages a group holds at (history h, capacity cap), by looking at every block's positions."""
    count = 0
    first = h + 1 - window if window is not None else None
    for i in range(ceil_div(cap, p)):
        if window is None or i < sinks or (i + 1) * p - 1 >= first:
            count += 1
    return count


def brute_term(window: int, sinks: int, p: int, headroom: int, alignment: int) -> int:
    """Max held over every history h that is a multiple of `alignment` (one full period past release)."""
    start = window - 1 + sinks * p
    period = p * alignment  # residues of (h + 1 - W) mod P repeat with this period in h
    best = 0
    for h in range(0, start + period + alignment):
        if h % alignment == 0:
            best = max(best, held_count(h, h + headroom, window, sinks, p))
    return best


# -- estimator formula vs brute force (no over-charge at the formula level) ------------------------------------
@pytest.mark.parametrize("seed", range(6))
def test_windowed_term_equals_brute_force_max(seed):
    rnd = random.Random(1000 + seed)
    for _ in range(60):
        p = rnd.choice([1, 2, 3, 4, 5, 8, 16])
        w = rnd.randint(1, 6 * p + 10)
        headroom = rnd.randint(1, 3 * p + 4)
        alignment = rnd.choice([1, 1, rnd.randint(1, 3 * p + 2)])
        assert windowed_pages_per_request(w, p, headroom, alignment) == brute_term(w, 0, p, headroom, alignment), (
            w,
            p,
            headroom,
            alignment,
        )
        if alignment == 1:
            assert windowed_pages_per_request(w, p, headroom) == ceil_div(w + headroom - 2, p) + 1


def test_group_estimator_equals_brute_force_with_sinks_and_trail():
    rnd = random.Random(7)
    for _ in range(300):
        p = rnd.choice([1, 2, 4, 5, 8])
        w = rnd.randint(1, 5 * p + 9)
        c = rnd.randint(1, 3 * p + 3)
        d, e = rnd.randint(0, 4), rnd.randint(0, 2)
        sinks = rnd.choice([0, 0, 1, 3])
        trail = rnd.choice([0, p])
        aligned = rnd.random() < 0.5
        max_seq = rnd.choice([10 ** 6, rnd.randint(1, 8 * p + w)])
        got = group_pages_per_request(
            w, p, max_seq_len=max_seq, chunk=c, max_draft_len=d, num_extra_kv_tokens=e, trail_tokens=trail,
            sink_blocks=sinks, chunk_alignment=aligned,
        )
        ctx = brute_term(w + trail, sinks, p, c + d + e, c if aligned else 1)
        gen = brute_term(w + trail, sinks, p, 1 + d + e, 1)
        assert got == min(ceil_div(max_seq, p), max(ctx, gen)), (w, p, c, d, e, sinks, trail, aligned, max_seq)
        full = group_pages_per_request(None, p, max_seq_len=max_seq, chunk=c, max_draft_len=d)
        assert full == ceil_div(max_seq, p)


# -- the sweep over the real manager ----------------------------------------------------------------------------
def _TrailTarget(config, **kw) -> KVCacheManagerV2:
    """The target manager with every window widened by one page (the estimator's `trail_tokens = P`)."""
    return KVCacheManagerV2.from_pool_config(config, trail_tokens=config.tokens_per_block, **kw)


def _worst_prompt(w_eff, sinks, p, c, headroom):
    """Prompt whose last, full chunk starts on the worst alignment reachable by multiples of c (brute force)."""
    k0 = ceil_div(w_eff - 1 + sinks * p, c)
    best_k, best = None, -1
    for k in range(k0, k0 + p + 1):
        h = k * c
        n = held_count(h, h + headroom, w_eff, sinks, p)
        if n > best:
            best_k, best = k, n
    return (best_k + 1) * c


def _context_steps(prompt, c, d, e):
    """(start, headroom) of every chunk of a fixed-chunk prefill: extra on every chunk, drafts on the last."""
    steps = []
    for start in range(0, prompt, c):
        size = min(c, prompt - start)
        last = start + size >= prompt
        steps.append((start, size + e + (d if last else 0)))
    return steps


def _run_request(rnd, geometry):
    """Drive one request; return per-group peaks, the generation-phase peak, max capacity, and the trace check."""
    p, w, sinks, c, d, e, prompt, kind = (geometry[k] for k in ("p", "w", "sinks", "c", "d", "e", "prompt", "kind"))
    config = KVPoolConfig(
        layer_groups=(LayerGroupConfig(1, window=w, sink_blocks=sinks), LayerGroupConfig(1, window=None)),
        pages_per_group=(100_000, 100_000),
        tokens_per_block=p,
        num_kv_heads=1,
        head_dim=1,
        max_seq_len=1 << 20,
    )
    if kind == "target":
        mgr = KVCacheManagerV2.from_pool_config(config, max_draft_len=d, num_extra_kv_tokens=e)
    elif kind == "trail":
        mgr = _TrailTarget(config, max_draft_len=d, num_extra_kv_tokens=e)
    else:
        mgr = DraftKVCacheManagerV2.from_pool_config(
            config, spec_mode=SpeculativeDecodingMode.DSPARK, max_draft_len=d, num_extra_kv_tokens=e
        )
    w_eff = mgr.layer_groups[0].life_cycle.window
    assert w_eff == w + geometry["trail"]
    rid = 1
    req = LlmRequest(rid, prompt_len=prompt)
    req.target_view.chunk_size = min(c, prompt)
    peak = [0, 0]
    gen_peak = 0
    max_cap = 0
    ctx_batch = ScheduledRequests(context_requests=[req])
    gen_batch = ScheduledRequests(generation_requests=[req])

    def observe():
        nonlocal max_cap
        cache = mgr.get_cache(rid)
        h, cap = cache.history_length, cache.capacity
        max_cap = max(max_cap, cap)
        for g, win, s in ((0, w_eff, sinks), (1, None, 0)):
            n = cache.num_held_pages(g)
            assert n == held_count(h, cap, win, s, p), (geometry, g, h, cap)
            peak[g] = max(peak[g], n)
        assert mgr.pools()[0].num_held == cache.num_held_pages(0)
        return cache.num_held_pages(0)

    # chunked prefill in fixed chunks of c
    while True:
        mgr.prepare_resources(ctx_batch)
        observe()
        last = req.is_last_context_chunk
        req.advance_context_chunk(c)
        mgr.update_context_resources(ctx_batch)
        observe()
        if last:
            break
    req.state = LlmRequestState.GENERATION_IN_PROGRESS
    req.tokens.append(0)
    mgr.update_resources(gen_batch)
    observe()
    # generation with random acceptance, with one run of P single-token steps after the release
    released = w_eff - 1 + sinks * p
    stop = max(prompt, released) + 3 * p + (d + 1) * rnd.randint(0, 6)
    single_run = 0
    while True:
        h = req.max_beam_num_tokens - 1
        mgr.prepare_resources(gen_batch)
        gen_peak = max(gen_peak, observe())
        if h >= released and single_run < p:
            accepted = 0
            single_run += 1
        else:
            accepted = rnd.choice([0, d, rnd.randint(0, d)])
        req.py_num_accepted_draft_tokens = accepted
        req.tokens.extend([0] * (accepted + 1))
        mgr.update_resources(gen_batch)
        observe()
        if single_run >= p and req.max_beam_num_tokens - 1 >= stop:
            break
    mgr.free_resources(rid)
    mgr.check_accounting()
    assert all(pool.num_held == 0 for pool in mgr.pools())
    return peak, gen_peak, max_cap


def _geometries(n, seed):
    rnd = random.Random(seed)
    out = []
    for i in range(n):
        p = rnd.choice([1, 2, 3, 4, 4, 5, 8, 8, 16])
        w = rnd.randint(1, min(100, 8 * p + 20))
        c = rnd.randint(1, min(40, 3 * p + 5))
        d = rnd.choice([0, 0, 1, 3, 5])
        e = rnd.choice([0, 0, 1, 2])
        sinks = rnd.choice([0, 0, 0, 1, 2])
        kind = rnd.choice(["target", "target", "trail", "dspark"])
        trail = p if kind in ("trail", "dspark") else 0
        w_eff = w + trail
        constructed = rnd.random() < 0.7
        if constructed:
            prompt = _worst_prompt(w_eff, sinks, p, c, c + d + e)
        else:
            prompt = rnd.randint(1, w_eff + 4 * c + 2 * p)
        out.append(dict(p=p, w=w, sinks=sinks, c=c, d=d, e=e, prompt=prompt, kind=kind, trail=trail,
                        constructed=constructed, seed=rnd.randrange(1 << 30), index=i))
    return out


SWEEP = _geometries(240, seed=20240601)


@pytest.mark.parametrize("part", range(4))
def test_estimator_sweep_never_below_and_tight(part):
    """>= 200 geometries in all (4 parts of 60): never below the peak; equal where the worst alignment was passed."""
    checked_aligned_eq = checked_unaligned_eq = checked_gen_eq = checked_non_last_eq = 0
    for geometry in SWEEP[part::4]:
        rnd = random.Random(geometry["seed"])
        peak, gen_peak, max_cap = _run_request(rnd, geometry)
        p, w, sinks, c, d, e, trail = (geometry[k] for k in ("p", "w", "sinks", "c", "d", "e", "trail"))
        kwargs = dict(max_seq_len=max_cap, chunk=c, max_draft_len=d, num_extra_kv_tokens=e, trail_tokens=trail,
                      sink_blocks=sinks)
        est_unaligned = group_pages_per_request(w, p, chunk_alignment=False, **kwargs)
        est_aligned = group_pages_per_request(w, p, chunk_alignment=True, **kwargs)
        label = f"geometry {geometry}: peak {peak}, aligned {est_aligned}, unaligned {est_unaligned}"
        # never below the peak
        assert est_aligned >= peak[0], label
        assert est_unaligned >= est_aligned, label
        # full attention: exactly the pages of the longest capacity
        assert group_pages_per_request(None, p, **kwargs) == peak[1] == ceil_div(max_cap, p), label
        # generation passed every alignment (the run of single-token steps after the release):
        # its term is exactly what the generation phase held
        w_eff = w + trail
        gen_term = min(ceil_div(max_cap, p), windowed_pages_per_request(w_eff, p, 1 + d + e) + sinks)
        assert gen_peak == gen_term, label
        checked_gen_eq += 1
        if est_aligned == gen_term:  # generation-dominated (or tied): equality for any prompt
            assert peak[0] == est_aligned, label
        # the context phase, derived from the schedule and the sizing rule by brute force over positions;
        # the windowed peak is the larger of it and the generation phase's (updates only release)
        ctx_held = [held_count(s, s + hr, w_eff, sinks, p) for s, hr in _context_steps(geometry["prompt"], c, d, e)]
        assert peak[0] == max(max(ctx_held), gen_peak), (label, ctx_held)
        if max(ctx_held) == est_aligned:  # some chunk (last or not) reached the worst alignment
            assert peak[0] == est_aligned, label
            if est_aligned > gen_term and ctx_held.index(est_aligned) < len(ctx_held) - 1:
                checked_non_last_eq += 1  # reached by a non-last chunk (chunk + extra above its start)
        if geometry["constructed"]:
            # a full last chunk started on the worst alignment reachable by multiples of c
            assert peak[0] == est_aligned, label
            checked_aligned_eq += 1
            if math.gcd(c, p) == 1:  # multiples of c reach every residue: the unaligned charge is reached too
                assert est_unaligned == est_aligned, label
                assert peak[0] == est_unaligned, label
                checked_unaligned_eq += 1
        elif peak[0] < est_aligned:
            # over-charge only where the request did not reach the worst alignment: the last chunk is
            # short, or starts elsewhere, or the prompt ends before the window released
            last = geometry["prompt"] - (ceil_div(geometry["prompt"], c) - 1) * c
            start = geometry["prompt"] - last
            reached = held_count(start, start + c + d + e, w_eff, sinks, p)
            assert last < c or reached < est_aligned or start < w_eff - 1 + sinks * p, label
    assert checked_aligned_eq >= 25 and checked_unaligned_eq >= 3 and checked_gen_eq == len(SWEEP[part::4])
    assert checked_non_last_eq >= 2  # the extra on non-last chunks is exercised where it decides the peak


def test_sweep_is_large_and_varied():
    assert len(SWEEP) >= 200
    kinds = {g["kind"] for g in SWEEP}
    assert kinds == {"target", "trail", "dspark"}
    assert any(g["sinks"] for g in SWEEP) and any(g["w"] < g["p"] for g in SWEEP)
    assert any(g["d"] + g["e"] > g["p"] for g in SWEEP)


def test_chunk_alignment_true_can_be_below_the_unaligned_charge():
    """A fixed-chunk schedule provably never reaches the unaligned worst case (P=8, c=8, W=9)."""
    # starts are multiples of 8: (h + 1 - 9) mod 8 == 0 always, the best alignment
    assert group_pages_per_request(9, 8, max_seq_len=10**6, chunk=8, chunk_alignment=True) == 2
    assert group_pages_per_request(9, 8, max_seq_len=10**6, chunk=8, chunk_alignment=False) == 3
    assert brute_term(9, 0, 8, 8, 8) == 2 and brute_term(9, 0, 8, 8, 1) == 3


# -- worked figure, bytes, quotas, concurrency --------------------------------------------------------------------
def test_worked_trail_figure_320_kib_0_78_percent():
    """5 layers, 4 KV heads x 128, bf16, P=32, W=4096: the trail page costs 320 KiB per request, 0.78 % of the window."""
    group = LayerGroupConfig(5, window=4096)
    page = bytes_per_page(group, tokens_per_block=32, num_kv_heads=4, head_dim=128, dtype=torch.bfloat16)
    assert page == 5 * 2 * 4 * 128 * 2 * 32
    kwargs = dict(max_seq_len=524288, chunk=8192, max_draft_len=7)
    with_trail = group_pages_per_request(4096, 32, trail_tokens=32, **kwargs)
    without = group_pages_per_request(4096, 32, trail_tokens=0, **kwargs)
    assert with_trail - without == 1
    trail_bytes = (with_trail - without) * page
    assert trail_bytes == 320 * 1024
    window_bytes = 4096 * bytes_per_token(group, num_kv_heads=4, head_dim=128, dtype=torch.bfloat16)
    assert f"{100 * trail_bytes / window_bytes:.2f}" == "0.78"


@pytest.mark.parametrize("w,p", [(4096, 32), (100, 16), (5, 8), (33, 1)])
def test_trail_is_exactly_one_page_per_windowed_group(w, p):
    for c in (1, p, 3 * p + 1):
        for aligned in (False, True):
            kw = dict(max_seq_len=10**7, chunk=c, max_draft_len=3, chunk_alignment=aligned)
            assert group_pages_per_request(w, p, trail_tokens=p, **kw) == group_pages_per_request(w, p, **kw) + 1
    # full attention: no trail charge
    assert group_pages_per_request(None, p, max_seq_len=999, chunk=4, trail_tokens=p) == ceil_div(999, p)


def test_bytes_per_token_and_page():
    g = LayerGroupConfig(3)
    assert bytes_per_token(g, num_kv_heads=2, head_dim=64, dtype=torch.float16) == 3 * 2 * 2 * 64 * 2
    assert bytes_per_token(g, num_kv_heads=2, head_dim=64, dtype=torch.float32, kv_factor=1) == 3 * 1 * 2 * 64 * 4
    assert bytes_per_page(g, tokens_per_block=16, num_kv_heads=2, head_dim=64, dtype=torch.float8_e4m3fn) == 3 * 2 * 2 * 64 * 16
    # consistent with the real pool's storage
    from tensorrt_llm_draftkv.runtime import PagePool

    pool = PagePool(1, tokens_per_block=16, num_layers=3, num_kv_heads=2, head_dim=64, dtype=torch.float16)
    real = sum(layer[0].numel() * layer.element_size() for layer in pool.layers)
    assert real == bytes_per_page(g, tokens_per_block=16, num_kv_heads=2, head_dim=64, dtype=torch.float16)


def test_quota_max_tokens_round_trip():
    rnd = random.Random(3)
    for _ in range(500):
        p = rnd.choice([1, 4, 16, 32, 64])
        page = rnd.randint(1, 10_000) * p
        tokens = rnd.randint(0, 10**6)
        quota = max_tokens_to_quota(tokens, page, p)
        assert quota % page == 0
        back = quota_to_max_tokens(quota, page, p)
        assert tokens <= back < tokens + p  # whole pages: rounded up by less than one page
        assert back == ceil_div(tokens, p) * p
        assert max_tokens_to_quota(back, page, p) == quota  # a whole-page count is a fixed point
        q = rnd.randint(0, 10**9)
        t = quota_to_max_tokens(q, page, p)
        assert max_tokens_to_quota(t, page, p) <= q < max_tokens_to_quota(t, page, p) + page
        assert pages_for_quota(q, page) == q // page


def test_max_concurrency_brute_force():
    for pool_pages in range(0, 60):
        for per_request in range(1, 12):
            best = max(n for n in range(0, pool_pages + 1) if n * per_request <= pool_pages)
            assert max_concurrency(pool_pages, per_request) == best


def test_max_concurrency_requests_fit_the_real_pool():
    """max_concurrency requests driven in lockstep at the worst alignment never run out of pages."""
    p, w, c, d = 4, 10, 4, 2
    per_request = group_pages_per_request(w, p, max_seq_len=10**6, chunk=c, max_draft_len=d, chunk_alignment=True)
    pool_pages = 3 * per_request + per_request - 1
    n = max_concurrency(pool_pages, per_request)
    assert n == 3
    config = KVPoolConfig(layer_groups=(LayerGroupConfig(1, window=w),), pages_per_group=(pool_pages,), tokens_per_block=p)
    mgr = KVCacheManagerV2.from_pool_config(config, max_draft_len=d)
    prompt = _worst_prompt(w, 0, p, c, c + d)
    reqs = [LlmRequest(i, prompt_len=prompt) for i in range(n)]
    for r in reqs:
        r.target_view.chunk_size = c
    batch = ScheduledRequests(context_requests=reqs)
    peak = 0
    while True:
        mgr.prepare_resources(batch)
        peak = max(peak, mgr.pools()[0].num_held)
        last = reqs[0].is_last_context_chunk
        for r in reqs:
            r.advance_context_chunk(c)
        mgr.update_context_resources(batch)
        if last:
            break
    assert peak == n * per_request  # the estimator is reached, and the pool held it
    mgr.check_accounting()


# -- argument checks -------------------------------------------------------------------------------------------
def test_estimator_bad_arguments_name_numbers():
    with pytest.raises(ValueError, match=r"window must be >= 1, got 0"):
        windowed_pages_per_request(0, 4, 3)
    with pytest.raises(ValueError, match=r"tokens_per_block must be >= 1, got 0"):
        windowed_pages_per_request(8, 0, 3)
    with pytest.raises(ValueError, match=r"headroom must be >= 1, got 0"):
        windowed_pages_per_request(8, 4, 0)
    with pytest.raises(ValueError, match=r"max_seq_len must be >= 1, got 0"):
        full_attention_pages_per_request(0, 4)
    with pytest.raises(ValueError, match=r"-1"):
        step_headroom(-1)
    with pytest.raises(ValueError, match=r"-5"):
        pages_for_quota(-5, 10)
    with pytest.raises(ValueError, match=r"page_bytes must be >= 1, got 0"):
        pages_for_quota(5, 0)
    with pytest.raises(ValueError, match=r"-3"):
        max_tokens_to_quota(-3, 10, 4)
    with pytest.raises(ValueError, match=r"pool_pages must be >= 0, got -1"):
        max_concurrency(-1, 3)
    with pytest.raises(ValueError, match=r"pages_per_request must be >= 1, got 0"):
        max_concurrency(10, 0)


def test_step_headroom():
    assert step_headroom(8192, 7, 0) == 8199
    assert step_headroom(0, 3, 1) == 5  # a generation step dominates an empty chunk
    assert step_headroom(1, 0, 0) == 1
    assert rules.step_headroom(16, 2, 3) == 21
