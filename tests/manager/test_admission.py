"""Admission: the per-request charge is an upper bound for every request admission lets in.

The estimator charges a request pages per layer group; a pool is sized as that
charge times the requests it holds. Two requests the aligned charge does not
cover: (a) a DFlash/DSpark mirror first seen past position 0 at a start off the
chunk grid (one page more than charged), (b) a PARD / draft-target one-model
mirror first seen past 0, which keeps the old sizing and backs all of
`[0, start + chunk)`. A third: a full-attention group whose request generates up
to max_seq_len (the charge's cap leaves out the step headroom). `check_admission`
refuses them with the numbers; a hypothesis test drives a real manager whose pool
is exactly the charge and checks that everything admitted fits, and that every
refusal is a real overrun.

Coordinates: absolute token positions; page counts per layer group.
"""
from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

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
from tensorrt_llm_draftkv.manager.admission import (
    AdmissionRefused,
    generation_peak_pages,
    held_pages,
    mirror_peak_pages,
    prompt_phase_sizes,
    request_charge,
)
from tensorrt_llm_draftkv.manager.budget import group_pages_per_request, windowed_pages_per_request
from tensorrt_llm_draftkv.manager.rules import DraftPoolTraits
from tensorrt_llm_draftkv.request import ContextView
from tensorrt_llm_draftkv.runtime import LifeCycle
from support import ceil_div




def manager(
    windows, pages, *, p, mode, d, e, sinks=0, max_seq_len=1 << 20, joint=False, sizing="history"
) -> DraftKVCacheManagerV2:
    if isinstance(pages, int):
        pages = (pages,) * len(windows)
    config = KVPoolConfig(
        layer_groups=tuple(LayerGroupConfig(1, window=w, sink_blocks=sinks) for w in windows),
        pages_per_group=tuple(pages),
        tokens_per_block=p,
        num_kv_heads=1,
        head_dim=1,
        max_seq_len=max_seq_len,
    )
    return DraftKVCacheManagerV2.from_pool_config(
        config, spec_mode=mode, max_draft_len=d, num_extra_kv_tokens=e, joint_kv_cache_reuse=joint, sizing=sizing
    )


def ctx(req) -> ScheduledRequests:
    return ScheduledRequests(context_requests=[req])


def gen(req) -> ScheduledRequests:
    return ScheduledRequests(generation_requests=[req])


def state(mgr) -> tuple:
    return ({rid: mgr.get_cache(rid).checkpoint() for rid in mgr.request_ids()}, mgr.free_pages())


# =============================================================================================
# (a) DFlash/DSpark first seen past 0, off the chunk grid: 387 pages against a charge of 386.
# =============================================================================================
BIG = dict(p=32, d=7, e=8, max_seq_len=524288 + 1024)


@pytest.mark.parametrize("mode", [Mode.DSPARK, Mode.DFLASH])
def test_a_trail_mirror_first_seen_off_the_chunk_grid_is_refused_with_the_numbers(mode):
    probe = manager((4096,), 4096, mode=mode, **BIG)
    assert probe.windows == (4096 + 32,)  # the trail page
    charge = probe.pages_per_request_charge(8192)
    assert charge == (386,)
    req = LlmRequest(7, prompt_len=20000, target_view=ContextView(6425, 8192))
    with pytest.raises(AdmissionRefused) as info:
        probe.check_admission(req, chunk=8192)
    err = info.value
    assert (err.request_id, err.group, err.needed_pages, err.charged_pages) == (7, 0, 387, 386)
    msg = str(err)
    for part in ("request 7", "387", "386", "6425", "8192", "gcd(chunk, P) = 32"):
        assert part in msg, (part, msg)
    assert isinstance(err, ValueError)
    # The refusal is real: a pool sized at the charge fails this request's first resize.
    mgr = manager((4096,), charge, mode=mode, **BIG)
    with pytest.raises(KVCacheResizeError):
        mgr.prepare_resources(ctx(req))
    # One page more than charged, exactly: held = ceil((6425 + 8192 + 8) / 32) - (6425 + 1 - 4128) // 32.
    assert mirror_peak_pages(
        mgr.policy, [g.life_cycle for g in mgr.layer_groups], 32, prompt_len=20000, chunk=8192, start=6425,
        max_draft_len=7, num_extra_kv_tokens=8, include_generation=False,
    ) == (458 - 71,)
    big = manager((4096,), 387, mode=mode, **BIG)
    big.prepare_resources(ctx(req))
    assert big.get_cache(7).num_held_pages(0) == 387
    # The unaligned charge allows every start: 387 pages, and the request is admitted.
    unaligned = probe.pages_per_request_charge(8192, aligned=False)
    assert unaligned == (387,)
    big.check_admission(req, chunk=8192, charge=unaligned)


def test_requests_on_the_chunk_grid_and_a_generation_init_are_admitted_at_the_charge():
    """The first-hour geometry (window 4096, P = 32, 7 drafts, 8 extra tokens); the simulator's own
    charge is checked against this manager's in tests/sim/test_draft_charge.py."""
    mgr = manager((4096,), 4096, mode=Mode.DFLASH, **BIG)
    assert mgr.pages_per_request_charge(8192) == (386,)
    # Requests on the chunk grid are admitted: from 0, and from a start on the grid.
    for start in (0, 8192, 16384):
        mgr.check_admission(LlmRequest(1, prompt_len=524288, target_view=ContextView(start, 8192)), chunk=8192)
    mgr.check_admission(LlmRequest(2, prompt_len=524288, state=LlmRequestState.DISAGG_GENERATION_INIT), chunk=8192)


def test_request_charge_wraps_the_group_estimator():
    groups = (LayerGroupConfig(1, window=100, sink_blocks=1), LayerGroupConfig(1), LayerGroupConfig(1, window=7))
    kwargs = dict(max_seq_len=5000, chunk=48, max_draft_len=3, num_extra_kv_tokens=2)
    for aligned in (True, False):
        got = request_charge(groups, 16, trail_tokens=16, aligned=aligned, **kwargs)
        want = tuple(
            group_pages_per_request(g.window, 16, trail_tokens=16, sink_blocks=g.sink_blocks, chunk_alignment=aligned, **kwargs)
            for g in groups
        )
        assert got == want


# =============================================================================================
# (b) PARD / draft-target one-model first seen past 0: the old sizing backs [0, start + chunk).
# =============================================================================================
SMALL = dict(p=16, d=3, e=1, max_seq_len=4096)


@pytest.mark.parametrize("mode", [Mode.PARD, Mode.DRAFT_TARGET_ONE_MODEL])
def test_an_old_sizing_mirror_first_seen_past_zero_is_refused_with_the_numbers(mode):
    probe = manager((64,), 4096, mode=mode, **SMALL)
    charge = probe.pages_per_request_charge(32)
    assert charge == (7,)
    req = LlmRequest(12, prompt_len=400, target_view=ContextView(144, 32))
    before = state(probe)
    with pytest.raises(AdmissionRefused) as info:
        probe.check_admission(req, chunk=32)
    assert state(probe) == before and probe.request_ids() == []  # nothing changed
    err = info.value
    # capacity 144 + 32 + 1 = 177 tokens, all backed: 12 pages.
    assert (err.request_id, err.needed_pages, err.charged_pages) == (12, 12, 7)
    msg = str(err)
    for part in ("request 12", "12 pages", "charges 7", "144", "chunks of 32", "[0, 177)", mode.label):
        assert part in msg, (part, msg)
    mgr = manager((64,), charge, mode=mode, **SMALL)
    with pytest.raises(KVCacheResizeError):
        mgr.prepare_resources(ctx(req))
    # The same request is covered when the pool joins the target's block reuse (history = start),
    # and for DFlash (history = start, one trail page charged).
    manager((64,), 4096, mode=mode, joint=True, **SMALL).check_admission(req, chunk=32)
    manager((64,), 4096, mode=Mode.DFLASH, **SMALL).check_admission(req, chunk=32)


def test_a_full_attention_group_generating_up_to_max_seq_len_is_refused():
    """A third case: the full-attention charge for max_seq_len leaves out the step headroom."""
    mgr = manager((None,), 64, mode=Mode.DFLASH, **{**SMALL, "max_seq_len": 1024})
    assert mgr.pages_per_request_charge(256) == (64,)
    ok = LlmRequest(1, prompt_len=1000, target_view=ContextView(0, 256), max_new_tokens=20)
    mgr.check_admission(ok, chunk=256)  # the last step asks 1000 + 20 - 2 + 5 = 1023 slots: 64 pages
    req = LlmRequest(2, prompt_len=1000, target_view=ContextView(0, 256), max_new_tokens=24)
    with pytest.raises(AdmissionRefused, match=r"request 2 .*needs 65 pages.*charges 64.*generation steps") as info:
        mgr.check_admission(req, chunk=256)
    assert (info.value.needed_pages, info.value.charged_pages) == (65, 64)
    # Real: single-token steps in a pool of the charge fail once a step asks past 1024 slots
    # (history 1020: 1025 slots, 65 pages); the one admitted with 20 new tokens runs to the end.
    with pytest.raises(KVCacheResizeError, match="generation resize failed for request 1: could not resize to 1025"):
        drive(mgr, dict(prompt=1000, chunk=256, start=0, disagg=False, max_new=24, accepted=[0] * 24))
    mgr.free_resources(1)
    assert drive(mgr, dict(prompt=1000, chunk=256, start=0, disagg=False, max_new=20, accepted=[0] * 20))[1] == [64]


def test_a_legacy_generation_init_mirror_is_refused_naming_the_legacy_rules():
    config = KVPoolConfig((LayerGroupConfig(1, window=64),), (0,), tokens_per_block=16, num_kv_heads=1, head_dim=1)
    mgr = DraftKVCacheManagerV2.from_pool_config(config, spec_mode=Mode.DFLASH, max_draft_len=3, sizing="legacy")
    req = LlmRequest(5, prompt_len=1000, state=LlmRequestState.DISAGG_GENERATION_INIT)
    with pytest.raises(AdmissionRefused, match=r"request 5 refused.*generation-init.*legacy") as info:
        mgr.check_admission(req, chunk=64)
    assert info.value.needed_pages == ceil_div(1000 + 1 + 3, 16)  # the first step over no history


def test_only_new_requests_are_checked():
    mgr = manager((64,), 4096, mode=Mode.DFLASH, **SMALL)
    req = LlmRequest(1, prompt_len=10, state=LlmRequestState.GENERATION_IN_PROGRESS)
    with pytest.raises(ValueError, match="request 1"):
        mgr.check_admission(req, chunk=32)


def test_prompt_phase_sizes_follow_the_rules():
    policy = DraftPoolTraits(Mode.DFLASH)
    # chunks [64, 96), [96, 100): history = start on each, then the view's end, then update_resources.
    assert prompt_phase_sizes(policy, prompt_len=100, chunk=32, start=64, max_draft_len=3, num_extra_kv_tokens=1) == [
        (97, 64), (97, 96), (104, 96), (104, 100), (101, 100)
    ]
    pard = DraftPoolTraits(Mode.PARD)
    assert prompt_phase_sizes(pard, prompt_len=100, chunk=32, start=64)[0] == (96, 0)  # no history
    assert prompt_phase_sizes(pard, prompt_len=100, chunk=32, disagg_generation_init=True, max_draft_len=2) == [(103, 100)]
    assert held_pages(LifeCycle(16, 1), 4, 40, 30) == 10 - (3 - 1)  # ordinals 1, 2 stale; the sink stays


def test_generation_peak_is_the_max_over_every_history_and_the_unaligned_count_without_a_limit():
    for p in (1, 4, 16):
        for window in (None, 1, 5, 16, 37, 64):
            for sinks in (0, 2):
                lc = LifeCycle(window, sinks)
                for prompt in (1, 30, 100):
                    for gh in (1, 4, 9):
                        for max_new in (1, 2, 3, 40, 200):
                            brute = 0 if max_new < 2 else max(
                                [held_pages(lc, p, prompt + gh, prompt)]
                                + [held_pages(lc, p, h + gh, h) for h in range(prompt + 1, prompt + max_new - 1)]
                                + [held_pages(lc, p, prompt + max_new, prompt + max_new - 1)]
                            )
                            got = generation_peak_pages(
                                lc, p, prompt_len=prompt, history=prompt, generation_headroom=gh, max_new_tokens=max_new
                            )
                            assert got == brute, (p, window, sinks, prompt, gh, max_new)
                        if window is None:
                            with pytest.raises(ValueError, match="max_new_tokens"):
                                generation_peak_pages(lc, p, prompt_len=prompt, history=prompt, generation_headroom=gh)
                        else:
                            unbounded = generation_peak_pages(lc, p, prompt_len=prompt, history=prompt, generation_headroom=gh)
                            assert unbounded == windowed_pages_per_request(window, p, gh, 1) + sinks


# =============================================================================================
# The property: admitted requests fit a pool of exactly the charge; refusals are real overruns.
# =============================================================================================
MODES = [Mode.DFLASH, Mode.DSPARK, Mode.PARD, Mode.DRAFT_TARGET_ONE_MODEL, Mode.MTP, Mode.EAGLE3_ONE_MODEL]


@st.composite
def cases(draw):
    p = draw(st.sampled_from([1, 4, 16, 32]))
    n_groups = draw(st.integers(1, 2))
    windows = tuple(draw(st.one_of(st.none(), st.integers(1, 4 * p + 48))) for _ in range(n_groups))
    chunk = draw(st.integers(1, 3 * p + 40))
    prompt = draw(st.integers(1, min(320, 24 * chunk)))
    start = draw(st.one_of(st.just(0), st.integers(0, (prompt - 1) // p).map(lambda k: k * p)))
    max_new = draw(st.integers(2, 6))
    d = draw(st.integers(0, 4))
    return dict(
        p=p,
        windows=windows,
        sinks=draw(st.integers(0, 2)),
        chunk=chunk,
        prompt=prompt,
        start=start,
        mode=draw(st.sampled_from(MODES)),
        joint=draw(st.booleans()),
        # the fix; now and then the legacy rules, which the replay follows as well
        sizing=draw(st.sampled_from(["history", "history", "history", "legacy"])),
        d=d,
        e=draw(st.integers(0, 4)),
        disagg=draw(st.integers(0, 4)) == 0,
        max_new=max_new,
        max_seq_len=prompt + max_new + draw(st.integers(0, 2 * p + 8)),
        accepted=draw(st.lists(st.integers(0, d), min_size=max_new, max_size=max_new)),
    )


def drive(mgr: DraftKVCacheManagerV2, case) -> tuple[list[int], list[int]]:
    """Run one request to the end of its generation; per-group peaks of the prompt phase and overall.

    Raises KVCacheResizeError where a prepare fails; asserts every update's own resize succeeded.
    """
    n = mgr.num_pools
    peaks = [[0] * n, [0] * n]

    def observe(phase: int) -> None:
        cache = mgr.get_cache(1)
        for g in range(n):
            peaks[phase][g] = max(peaks[phase][g], cache.num_held_pages(g))
        mgr.check_accounting()

    def settled() -> None:  # update_resources got its slot (the full-pool fallback leaves capacity at history)
        cache = mgr.get_cache(1)
        assert cache.history_length + 1 <= cache.capacity <= cache.history_length + mgr.generation_headroom

    prompt, chunk = case["prompt"], case["chunk"]
    if case["disagg"]:
        req = LlmRequest(1, prompt_len=prompt, state=LlmRequestState.DISAGG_GENERATION_INIT, max_new_tokens=case["max_new"])
        assert mgr.prepare_disagg_gen_init(req)
        observe(0)
        req.state = LlmRequestState.GENERATION_IN_PROGRESS
        req.tokens.append(1)
    else:
        start = case["start"]
        req = LlmRequest(
            1, prompt_len=prompt, target_view=ContextView(start, min(chunk, prompt - start)), max_new_tokens=case["max_new"]
        )
        while True:
            req.sync_draft_view()  # one-engine drafters keep the draft view in step
            mgr.prepare_resources(ctx(req))
            observe(0)
            view = req.target_view
            last = view.position + view.chunk_size >= prompt
            req.advance_context_chunk(chunk)
            req.sync_draft_view()
            if last:
                req.state = LlmRequestState.GENERATION_IN_PROGRESS
                req.tokens.append(1)
            mgr.update_context_resources(ctx(req))
            observe(0)
            if last:
                break
        mgr.update_resources(ctx(req))
        settled()
        observe(0)
    for accepted in case["accepted"]:
        if req.num_generated >= req.max_new_tokens:
            break
        mgr.prepare_resources(gen(req))
        observe(1)
        req.tokens += [1] * min(accepted + 1, req.max_new_tokens - req.num_generated)
        mgr.update_resources(gen(req))
        settled()
        observe(1)
    mgr.free_resources(1)
    assert all(pool.num_held == 0 for pool in mgr.pools())
    return peaks[0], [max(a, b) for a, b in zip(*peaks)]


@settings(deadline=None, max_examples=500)
@given(cases())
def test_admitted_requests_fit_a_pool_of_the_charge_and_refusals_are_real(case):
    kw = dict(p=case["p"], mode=case["mode"], d=case["d"], e=case["e"], sinks=case["sinks"],
              max_seq_len=case["max_seq_len"], joint=case["joint"], sizing=case["sizing"])
    charge = manager(case["windows"], 0, **kw).pages_per_request_charge(case["chunk"])
    probe = manager(case["windows"], charge, **kw)  # admission answers for a pool of exactly the charge
    req = LlmRequest(
        1,
        prompt_len=case["prompt"],
        state=LlmRequestState.DISAGG_GENERATION_INIT if case["disagg"] else LlmRequestState.CONTEXT_INIT,
        target_view=ContextView(case["start"], min(case["chunk"], case["prompt"] - case["start"])),
        max_new_tokens=case["max_new"],
    )
    peak_args = dict(
        prompt_len=case["prompt"], chunk=case["chunk"], start=case["start"], max_draft_len=case["d"],
        num_extra_kv_tokens=case["e"], disagg_generation_init=case["disagg"],
    )
    lifecycles = [g.life_cycle for g in probe.layer_groups]
    context_peak = mirror_peak_pages(probe.policy, lifecycles, case["p"], include_generation=False, **peak_args)
    peak = mirror_peak_pages(probe.policy, lifecycles, case["p"], max_new_tokens=case["max_new"], **peak_args)
    try:
        probe.check_admission(req, chunk=case["chunk"])
        admitted = True
    except AdmissionRefused as err:
        admitted = False
        assert "request 1 " in str(err) and f"{err.needed_pages} pages" in str(err) and err.needed_pages > err.charged_pages
        assert err.needed_pages == peak[err.group] and err.charged_pages == charge[err.group]
    assert admitted == all(n <= c for n, c in zip(peak, charge))
    if admitted:
        # A pool of exactly the charge: no resize fails, nothing above the charge.
        mgr = manager(case["windows"], charge, **kw)
        observed_context, observed = drive(mgr, case)
        assert all(o <= c for o, c in zip(observed, charge)), (observed, charge)
    else:
        # Single-token steps visit every history: the peak is then reached exactly.
        case = {**case, "accepted": [0] * len(case["accepted"])}
        mgr = manager(case["windows"], tuple(n + 8 for n in peak), **kw)
        observed_context, observed = drive(mgr, case)
        assert any(o > c for o, c in zip(observed, charge)), (observed, charge)
    assert list(context_peak) == observed_context  # the prompt phase is exact
    if not any(case["accepted"]):
        assert list(peak) == observed  # and so is generation, when every step accepts no draft
    assert all(o <= n for o, n in zip(observed, peak))  # else it is an upper bound
