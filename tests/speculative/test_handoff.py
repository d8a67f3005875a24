"""The drafter-context handoff, library side: ranges, bytes, the wire header, and seeding a slot with [lo, m).

Every range is checked against a real draft manager's generation-init mirror
(what it backs after `prepare_disagg_gen_init`), not against a formula.
"""
from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from tensorrt_llm_draftkv import LlmRequest, LlmRequestState, ScheduledRequests
from tensorrt_llm_draftkv.speculative.handoff import (
    HANDOFF_VERSION,
    HEADER_INTS,
    DrafterContextGeometry,
    DrafterContextMismatch,
    HandoffForm,
    handoff_bytes,
)
from tensorrt_llm_draftkv.speculative.handoff_seed import mirror_backed_from
from executor_fixture import DraftExecutor
from support import ceil_div, tokens


def geometry_of(loop: DraftExecutor, form: HandoffForm = HandoffForm.KV, hidden_size: int = 0) -> DrafterContextGeometry:
    return DrafterContextGeometry.of_pool(loop.dm, form, hidden_size=hidden_size)


def gen_init(loop: DraftExecutor, rid: int, m: int) -> LlmRequest:
    """A generation worker's new request of an m-token prompt (tokens: the prompt and the first output)."""
    req = LlmRequest(rid, m, tokens=tokens(m + 1, rid), state=LlmRequestState.DISAGG_GENERATION_INIT)
    assert loop.dm.prepare_disagg_gen_init(req)
    req.state = LlmRequestState.GENERATION_IN_PROGRESS
    return req


def backed_below(loop: DraftExecutor, rid: int, m: int, group: int) -> list[int]:
    """Ordinals the mirror backs that hold a position below m."""
    row = loop.dm.get_cache(rid).block_row(group)
    P = loop.dm.config.tokens_per_block
    return [i for i, page in enumerate(row) if page >= 0 and i * P < m]


# --------------------------------------------------------------------------- ranges against a real mirror
@settings(max_examples=25, deadline=None)
@given(
    m=st.integers(1, 1500),
    window=st.one_of(st.none(), st.integers(1, 400)),
    P=st.sampled_from([1, 7, 16, 32]),
    trail=st.booleans(),
)
def test_the_sent_range_covers_exactly_the_pages_the_generation_mirror_backs_below_m(m, window, P, trail):
    loop = DraftExecutor.build(windows=(window,), tokens_per_block=P, pages=4096, max_seq_len=4096, trail_page=trail)
    gen_init(loop, 1, m)
    geometry = geometry_of(loop)
    lo, hi = geometry.group_range(0, m)
    kept = None if window is None else window + loop.dm.draft_slot_trail_tokens
    assert hi == m and 0 <= lo <= m
    if lo == m:  # a one-token window keeps nothing below the next query
        assert kept == 1
        return
    # every sent position sits on a backed page, and the sent positions touch every backed page below m
    assert sorted({s // P for s in range(lo, m)}) == backed_below(loop, 1, m, 0)
    # the first sent position is the lowest one the first generation query's window (trail included) spans
    assert lo == (0 if kept is None else max(0, m + 1 - kept))
    assert mirror_backed_from(loop.dm, 1, m) == backed_below(loop, 1, m, 0)[0] * P <= lo


def test_a_full_attention_group_sends_the_whole_prompt_and_the_seed_starts_at_the_highest_group_start():
    loop = DraftExecutor.build(windows=(64, None), tokens_per_block=16, pages=512)
    gen_init(loop, 3, 1000)
    geometry = geometry_of(loop)
    assert geometry.group_range(1, 1000) == (0, 1000)
    lo0, _ = geometry.group_range(0, 1000)
    assert lo0 == 1000 + 1 - (64 + 16)
    assert geometry.seed_start(1000) == lo0  # one base for every group: the highest first page
    assert geometry.hidden_range(1000) == (0, 1000)  # one hidden state feeds both groups


# --------------------------------------------------------------------------- bytes of both forms
@pytest.mark.parametrize("m", [1, 100, 4096, 131071, 131072, 524287])
def test_both_forms_count_the_bytes_of_the_tensors_they_would_send(m):
    geometry = DrafterContextGeometry(
        tokens_per_block=32, windows=(4096, None), layers=(5, 1), num_kv_heads=4, head_dim=128,
        dtype="bfloat16", trail_tokens=32, hidden_size=3 * 4096,
    )
    sizes = handoff_bytes(geometry, m)
    kv = [torch.empty(hi - lo, n, 2, 4, 128, dtype=torch.bfloat16)
          for (lo, hi), n in zip(geometry.ranges(m), geometry.layers)]
    lo, hi = geometry.hidden_range(m)
    hidden = torch.empty(hi - lo, 3 * 4096, dtype=torch.bfloat16)
    assert sizes.kv == sum(t.nbytes for t in kv)
    assert sizes.hidden == hidden.nbytes
    assert sizes.full_kv == sum(torch.empty(m, n, 2, 4, 128, dtype=torch.bfloat16).nbytes for n in (5, 1))
    assert sizes.full_hidden == torch.empty(m, 3 * 4096, dtype=torch.bfloat16).nbytes
    assert sizes.smaller_form is (HandoffForm.HIDDEN if sizes.hidden < sizes.kv else HandoffForm.KV)


def test_windowed_kv_stays_under_five_percent_of_the_whole_prompt_from_131072_tokens():
    geometry = DrafterContextGeometry(
        tokens_per_block=32, windows=(4096,), layers=(5,), num_kv_heads=4, head_dim=128, trail_tokens=32
    )
    for m in (131072, 131073, 262145, 524287):
        sizes = handoff_bytes(geometry, m)
        lo, hi = geometry.group_range(0, m)
        assert sizes.kv == (hi - lo) * 5 * 2 * 4 * 128 * 2
        assert sizes.kv <= 0.05 * sizes.full_kv


# --------------------------------------------------------------------------- the wire header
@settings(max_examples=30, deadline=None)
@given(
    windows=st.lists(st.one_of(st.none(), st.integers(1, 1 << 20)), min_size=1, max_size=8),
    P=st.integers(1, 256),
    heads=st.integers(1, 64),
    dim=st.integers(1, 512),
    dtype=st.sampled_from(["bfloat16", "float16", "float32"]),
    hidden=st.integers(0, 1 << 16),
    form=st.sampled_from(list(HandoffForm)),
)
def test_the_header_round_trips_every_field(windows, P, heads, dim, dtype, hidden, form):
    if form is HandoffForm.HIDDEN and hidden == 0:
        hidden = 1
    geometry = DrafterContextGeometry(
        tokens_per_block=P, windows=tuple(windows), layers=tuple(range(1, len(windows) + 1)), num_kv_heads=heads,
        head_dim=dim, dtype=dtype, trail_tokens=P, form=form, hidden_size=hidden,
    )
    wire = geometry.to_wire()
    assert len(wire) == HEADER_INTS and wire[0] == HANDOFF_VERSION
    assert DrafterContextGeometry.from_wire(wire) == geometry


def test_a_header_of_another_version_is_refused_naming_this_workers_geometry():
    geometry = DrafterContextGeometry(tokens_per_block=16, windows=(256,), layers=(3,), num_kv_heads=1, head_dim=8)
    wire = geometry.to_wire()
    wire[0] = HANDOFF_VERSION + 1
    with pytest.raises(DrafterContextMismatch, match=f"version {HANDOFF_VERSION + 1}") as err:
        DrafterContextGeometry.from_wire(wire, expected=geometry)
    assert geometry.describe() in str(err.value)
    with pytest.raises(ValueError, match="version"):
        DrafterContextGeometry.from_wire(wire)


@pytest.mark.parametrize(
    "change, field",
    [
        ({"windows": (512,)}, "windows"),
        ({"tokens_per_block": 32}, "tokens_per_block"),
        ({"trail_tokens": 0}, "trail_tokens"),
        ({"num_kv_heads": 2}, "num_kv_heads"),
        ({"head_dim": 16}, "head_dim"),
        ({"dtype": "float16"}, "dtype"),
        ({"layers": (2,)}, "layers"),
    ],
)
def test_a_context_for_another_geometry_is_refused_naming_both(change, field):
    import dataclasses

    mine = DrafterContextGeometry(
        tokens_per_block=16, windows=(256,), layers=(3,), num_kv_heads=1, head_dim=8, dtype="float32",
        trail_tokens=16,
    )
    sent = dataclasses.replace(mine, **change)
    with pytest.raises(DrafterContextMismatch) as err:
        mine.check_compatible(sent, request_id=42)
    text = str(err.value)
    assert "request 42" in text and field in text
    assert mine.describe() in text and sent.describe() in text
    assert err.value.sent == sent and err.value.expected == mine
    mine.check_compatible(dataclasses.replace(mine))  # the same geometry passes


# --------------------------------------------------------------------------- seeding a slot with [lo, m)
def seeded_loop(m: int, window: int = 64, P: int = 16) -> tuple[DraftExecutor, LlmRequest, DrafterContextGeometry]:
    loop = DraftExecutor.build(windows=(window,), tokens_per_block=P, pages=256)
    req = gen_init(loop, 5, m)
    return loop, req, geometry_of(loop)


def state_of(loop: DraftExecutor) -> tuple:
    slots = loop.meta.slots
    return (slots.ctx_len_host, slots.base_pages_host, slots.offsets_host, slots.live_requests(),
            slots.pending_context_seed(5))


@pytest.mark.parametrize("m", [200, 207, 208, 209])
def test_a_seeded_slot_starts_at_the_prompt_end_with_its_base_on_the_first_received_page(m):
    loop, req, geometry = seeded_loop(m)
    lo = geometry.seed_start(m)
    start = loop.meta.seed_context(5, lo, m, loop.dm)
    assert tuple(start) == (m, lo // 16, 0)
    batch = ScheduledRequests(generation_requests=[req])
    loop.dm.prepare_resources(batch)
    loop.meta.prepare_step(batch, loop.dm)
    assert loop.meta.slots.slot_state(5) == (m, lo // 16) and loop.meta.slots.slot_offset(5) == 0
    assert loop.meta.seeds[5] == start and loop.meta.slots.last_context_seeded == (5,)
    assert loop.meta.slots.pending_context_seed(5) is None  # used once
    prep = loop.meta.generation_prep()[0]
    # the read rows start at the seeded base or the window's first page, whichever is higher
    first = max(lo // 16, (m + loop.meta.block_size - 64) // 16)
    assert prep.shift.tolist() == [first] and prep.read_lens.tolist() == [m - first * 16]
    held = set(loop.dm.get_batch_cache_indices([5])[0]) - {-1}
    assert set(prep.read_rows[0].tolist()) - {-1} <= held
    # a slot lost afterwards is reseeded empty: the received context seeds only the first slot
    loop.meta.evict(5)
    loop.meta.prepare_step(batch, loop.dm)
    L, b = loop.meta.slots.slot_state(5)
    assert L == b * 16 == (m // 16) * 16 and loop.meta.slots.last_context_seeded == ()


@pytest.mark.parametrize("m", [200, 207, 208])
def test_a_seed_below_what_the_mirror_backs_or_above_its_end_is_refused_and_changes_nothing(m):
    loop, req, geometry = seeded_loop(m)
    backed = mirror_backed_from(loop.dm, 5, m)
    before = state_of(loop)
    with pytest.raises(ValueError, match=rf"request 5: .*\[{backed - 1}, {m}\).*backs pages only from {backed // 16}"):
        loop.meta.seed_context(5, backed - 1, m, loop.dm)
    with pytest.raises(ValueError, match=rf"request 5: .*\[{m + 1}, {m}\)"):
        loop.meta.seed_context(5, m + 1, m, loop.dm)
    with pytest.raises(ValueError, match=rf"request 5: .*does not back page {ceil_div(m + 64, 16) - 1}"):
        loop.meta.seed_context(5, backed, m + 64, loop.dm)  # past what the mirror holds
    assert state_of(loop) == before
    # a request that already holds a slot is refused too, its slot untouched
    batch = ScheduledRequests(generation_requests=[req])
    loop.dm.prepare_resources(batch)
    loop.meta.prepare_step(batch, loop.dm)
    before = state_of(loop)
    with pytest.raises(ValueError, match="request 5: .*already holds slot"):
        loop.meta.seed_context(5, backed, m, loop.dm)
    assert state_of(loop) == before


def test_a_seed_whose_end_is_not_the_rows_position_fails_prepare_and_changes_nothing():
    loop, req, geometry = seeded_loop(300)
    loop.meta.seed_context(5, geometry.seed_start(300), 300, loop.dm)
    req.tokens.append(1)  # the row now sits at 301
    batch = ScheduledRequests(generation_requests=[req])
    loop.dm.prepare_resources(batch)
    before = state_of(loop)
    with pytest.raises(ValueError, match="request 5: its received drafter context ends at 300, but its first "
                                         "generation row sits at position 301"):
        loop.meta.prepare_step(batch, loop.dm)
    assert state_of(loop) == before
