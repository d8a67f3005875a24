"""Random real-traffic workloads against the four invariants, with the independent owner map.

One hypothesis test mixes every corner case at once: prompt lengths and
windows that are not page multiples, prefixes this worker did not compute,
disaggregated requests, a clamped drafter context, warmup dummies of several
sizes, slot eviction and reseed, accepted and rejected drafts (optimistic
commits rolled back), request completion, both export backends, a guard page,
and rejected calls (unknown ids in batches, a generation request without a
mirror, a repeated dummy id). After every operation:

1. every block-table entry the drafter read or wrote is a page its request
   holds, by the checker's own page -> owner map (fed by pool events);
2. every slot read exactly what it stored;
3. pages held + pages free = pool size, the map equals the rows, and finishing
   every request returns every page;
4. every rejected call raised and left every structure bit-identical.
"""
from __future__ import annotations

import pytest

from support import strict
import torch
from hypothesis import event, given, settings
from hypothesis import strategies as st

from tensorrt_llm_draftkv import LlmRequest, LlmRequestState, ScheduledRequests, SpeculativeDecodingMode
from tensorrt_llm_draftkv.request import ContextView
from draftkv_sim import DraftLoop, phrase_stream




def everything(loop: DraftLoop):
    """Every structure a rejected call must leave bit-identical."""
    dm, meta, chk = loop.dm, loop.meta, loop.checker
    return (
        {rid: dm.get_cache(rid).checkpoint() for rid in dm.request_ids()},
        [(p.free_order(), sorted(p.held_pages())) for p in dm.pools()],
        [layer.clone() for p in dm.pools() for layer in p.layers],
        meta.slots.live_requests(),
        meta.slots.free_slots,
        meta.slots.ctx_len_host,
        meta.slots.base_pages_host,
        [meta.slots.offsets_host[s] for s in range(meta.num_slots)],
        meta.slots.ctx_len.tolist(),
        meta.slots.base_pages.tolist(),
        dict(chk.page_holders.holders_of),
        chk.summary(),
    )


def same(a, b) -> bool:
    if isinstance(a, torch.Tensor):
        return torch.equal(a, b)
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(same(x, y) for x, y in zip(a, b))
    return a == b


def rejected(loop: DraftLoop, call, errors=(KeyError, ValueError, RuntimeError)) -> None:
    before = everything(loop)
    with pytest.raises(errors):
        call()
    assert same(everything(loop), before), "a rejected call changed state"


@st.composite
def geometries(draw):
    P = draw(st.sampled_from([4, 8, 16]))
    window = draw(st.integers(P + 1, 12 * P))  # a page multiple or not
    windows = draw(st.sampled_from([(None,), (window,), (window, None)]))
    return dict(
        P=P,
        windows=windows,
        backend=draw(st.sampled_from(["cpp", "python"])),
        guard_page=draw(st.booleans()),
        joint=draw(st.booleans()),
        mode=draw(st.sampled_from([SpeculativeDecodingMode.DFLASH, SpeculativeDecodingMode.DSPARK])),
        max_ctx_len=draw(st.one_of(st.none(), st.integers(P, 30 * P))),
    )


OPS = ["add_ctx", "add_disagg", *["step"] * 8, "evict", "finish", "reject"]


@settings(max_examples=80, deadline=None)
@given(geometries(), st.data())
def test_random_real_traffic_keeps_every_invariant(geo, data):
    P = geo["P"]
    loop = DraftLoop.build(
        windows=geo["windows"],
        tokens_per_block=P,
        pages=400,
        backend=geo["backend"],
        guard_page=geo["guard_page"],
        joint_kv_cache_reuse=geo["joint"],
        spec_mode=geo["mode"],
        max_ctx_len=geo["max_ctx_len"],
        max_batch_size=4,
        max_seq_len=2048,
    )
    chk, dm, meta = loop.checker, loop.dm, loop.meta
    next_id = 0
    for _ in range(data.draw(st.integers(20, 60))):
        op = data.draw(st.sampled_from(OPS))
        live = list(loop.requests)
        event(op if (op in ("add_ctx", "add_disagg") and len(live) < 4) or (op != "reject" and live) else "other")
        if op == "add_ctx" and len(live) < 4:
            prompt = data.draw(st.integers(2, 20 * P))
            start = data.draw(st.sampled_from([0, 0, P * (prompt // (2 * P)), prompt // 2]))
            start = min(start, prompt - 1)
            chunk = data.draw(st.one_of(st.none(), st.integers(1, 6 * P)))
            seed = data.draw(st.integers(0, 99))
            loop.add_context_request(next_id, phrase_stream(prompt + 160, vocab_size=64, phrase_len=8, num_phrases=6, seed=seed), prompt, chunk=chunk, start=start)
            next_id += 1
        elif op == "add_disagg" and len(live) < 4:
            prompt = data.draw(st.integers(1, 25 * P))
            seed = data.draw(st.integers(0, 99))
            loop.add_disagg_request(next_id, phrase_stream(prompt + 160, vocab_size=64, phrase_len=8, num_phrases=6, seed=seed), prompt)
            next_id += 1
        elif op == "step" and live:
            gen = [r for r in live if loop.requests[r].is_generation_in_progress_state]
            cap = data.draw(st.integers(0, 3))
            optimistic = [r for r in gen if data.draw(st.booleans())]
            dummies = data.draw(st.integers(0, 3))
            sizes = [data.draw(st.integers(1, 30 * P)) for _ in range(dummies)]
            chunk = data.draw(st.integers(1, 6 * P))
            loop.step(
                chunks={r: chunk for r in live},
                accept_cap=lambda rid: cap,
                optimistic=optimistic,
                dummies=dummies,
                dummy_tokens=sizes or 1,
            )
            for rid in list(loop.requests):
                if loop.requests[rid].is_generation_in_progress_state and loop.remaining(rid) < meta.block_size + 1:
                    loop.finish(rid)
        elif op == "evict" and live:
            holders = [r for r in live if meta.slots.has_slot(r)]
            if holders:
                loop.evict(data.draw(st.sampled_from(holders)))
        elif op == "finish" and live:
            loop.finish(data.draw(st.sampled_from(live)))
        elif op == "reject":
            reject_one(loop, data, live)
        # invariants after every operation
        chk.assert_clean()
        assert chk.check_rows() == 0 and chk.check_accounting() == 0
        dm.check_accounting()
        meta.slots.check_host_mirror()
        if meta.rows and dm.request_ids():
            ids = [r for r in dm.request_ids()]
            assert chk.check_export(ids, dm.get_block_offsets(ids, geo["backend"]), geo["backend"]) == 0
    for rid in list(loop.requests):
        loop.finish(rid)
    chk.assert_clean()
    assert dm.request_ids() == [] and chk.page_holders.holders_of == {}
    for pool in dm.pools():
        assert pool.num_free == pool.total and pool.num_held == 0


def reject_one(loop: DraftLoop, data, live: list[int]) -> None:
    dm, meta = loop.dm, loop.meta
    stranger = LlmRequest(10_000, prompt_len=50, state=LlmRequestState.GENERATION_IN_PROGRESS)
    stranger.tokens.append(1)
    stranger.target_view = ContextView(50, 0)
    known = [loop.requests[r] for r in live]
    kind = data.draw(st.sampled_from(["update", "update_ctx", "free", "missing_mirror", "dummy_twice", "evict"]))
    if kind in ("update", "update_ctx"):  # as upstream, an update skips a request with no mirror here
        before = everything(loop)
        if kind == "update":
            dm.update_resources(ScheduledRequests(generation_requests=[stranger]))
        else:
            dm.update_context_resources(ScheduledRequests(context_requests=[stranger]))
        assert same(everything(loop), before) and not dm.has_cache(10_000)
    elif kind == "free":
        rejected(loop, lambda: dm.free_resources([*live, 10_000]))
    elif kind == "missing_mirror":
        ctx = [r for r in known if r.is_context_init_state]
        rejected(loop, lambda: dm.prepare_resources(ScheduledRequests(context_requests=ctx, generation_requests=[stranger])))
    elif kind == "dummy_twice" and dm.request_ids():
        taken = dm.request_ids()[0]
        rejected(loop, lambda: dm.add_dummy_requests([20_000, taken], [5, 5], max_num_draft_tokens=dm.max_draft_len))
    elif kind == "dummy_twice":  # a pool too small for the second dummy: the first is undone
        huge = 10 * dm.pools()[0].total * dm.tokens_per_block
        rejected(loop, lambda: strict(dm, dm.add_dummy_requests([20_000, 20_001], [5, huge], max_num_draft_tokens=1)))
    else:
        rejected(loop, lambda: meta.evict(10_000))
