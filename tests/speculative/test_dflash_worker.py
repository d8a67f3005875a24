"""`DFlashWorker` and `DFlashSpecMetadata` over a real draft pool, driven through upstream's calls only.

In the spirit of upstream's `test_dflash_dummy_slot`, `test_dflash_guided_rollback` and
`test_dflash_copy_skip`: dummies draft on dummy slots, a rolled-back step puts lengths and bases
back, the row -> slot table is copied only when it changes; and the store writes exactly the
pages each request's mirror holds, refusing any other.
"""
from __future__ import annotations

import dataclasses
import inspect
import warnings
from types import SimpleNamespace

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tensorrt_llm_draftkv import (CUDA_GRAPH_DUMMY_REQUEST_ID, CacheType, DataType, DFlashDecodingConfig,
                                  DFlashSpecMetadata, DFlashWorker, DraftStoreRefused, KVCacheManagerV2,
                                  KvCacheConfig, LlmRequestState, Mapping, ScheduledRequests)
from support import UpstreamRequest

P = 8
K = 3
WINDOW = 32
MAX_BATCH = 4
H, D = 2, 4


Req = UpstreamRequest


class ToyDrafter:
    """The projected hidden state is the K/V: `[n, 1 layer, 2, H, D]` flattened."""

    _num_attn_layers, _num_kv_heads, _head_dim, block_size = 1, H, D, K + 1

    def project_target_hidden(self, hidden):
        return hidden

    def precompute_context_kv(self, projected, positions):
        kv = projected.reshape(projected.shape[0], 1, 2, H, D)
        return kv[:, :, 0], kv[:, :, 1]


HIDDEN = 2 * H * D


class Rig:
    """A windowed draft manager, its worker and metadata, and the attention metadata an executor fills."""

    def __init__(self, pages: int = 64, max_seq: int = 1024, device: str = "cpu", keep_offsets: bool = False) -> None:
        self.keep_offsets = keep_offsets  # one offsets tensor for every step, as an executor keeps it
        spec = DFlashDecodingConfig(max_draft_len=K)
        self.draft = KVCacheManagerV2(
            KvCacheConfig(max_tokens=pages * P, max_attention_window=[WINDOW], enable_block_reuse=False),
            CacheType.SELF, num_layers=1, num_kv_heads=H, head_dim=D, tokens_per_block=P, max_seq_len=max_seq,
            max_batch_size=MAX_BATCH, mapping=Mapping(), dtype=DataType.FLOAT, spec_config=spec, is_draft=True,
            max_num_tokens=256, device=device,
        )
        self.buf = self.draft.get_buffers(0, kv_layout="HND")
        self.buf.copy_(torch.randn(self.buf.shape, device=device))  # poisoned: nothing reads as zeros by accident
        self.worker = DFlashWorker(spec, Mapping(), use_separate_draft_kv_cache=True)
        self.meta = DFlashSpecMetadata(max_num_requests=MAX_BATCH, max_draft_len=K, max_total_draft_tokens=K,
                                       layers_to_capture=[0], hidden_size=HIDDEN, max_num_tokens=512,
                                       dtype=torch.float32, device=device)
        self.attn = SimpleNamespace(draft_kv_cache_block_offsets=None, request_ids=None, max_seq_len=max_seq,
                                    num_contexts=0, seq_lens=[])
        self.drafter = ToyDrafter()
        self.worker._lazy_init_ctx_buffers(self.drafter, self.meta, self.attn, draft_kv_cache_manager=self.draft)
        self.stored: dict[tuple[int, int], torch.Tensor] = {}  # (request, position) -> K/V written

    def begin(self, batch: ScheduledRequests) -> list[int]:
        """prepare_resources, the attention metadata's offsets, spec_metadata.prepare(), the table refresh."""
        self.draft.prepare_resources(batch)
        ids = [r.py_request_id for r in batch.all_requests()]
        dst = self.attn.draft_kv_cache_block_offsets if self.keep_offsets else None
        if dst is None:
            dst = torch.full((self.draft.num_pools, MAX_BATCH, 2, self.draft.config.max_blocks_per_seq), -5,
                             dtype=torch.int32, device=self.buf.device)
        self.draft.copy_batch_block_offsets(dst, ids, 1, len(batch.context_requests), len(ids))
        self.attn.draft_kv_cache_block_offsets, self.attn.request_ids = dst, ids
        self.attn.num_contexts = len(batch.context_requests)
        self.attn.seq_lens = [r.context_chunk_size for r in batch.context_requests]
        self.meta.request_ids, self.meta.num_generations = ids, len(batch.generation_requests)
        self.meta.prepare()
        assert self.worker._refresh_ctx_block_tables(self.attn, len(ids))
        return ids

    def context_step(self, batch: ScheduledRequests) -> None:
        self.begin(batch)
        positions, hidden = [], []
        for r in batch.context_requests:
            pos = list(range(r.context_current_position, r.context_current_position + r.context_chunk_size))
            positions += pos
            h = torch.randn(len(pos), HIDDEN)
            hidden.append(h)
            self.stored.update({(r.py_request_id, p): h[i] for i, p in enumerate(pos)})
        h = torch.cat(hidden) if hidden else torch.zeros(0, HIDDEN)
        self.meta.maybe_capture_hidden_states(0, h.to(self.meta.device))
        self.worker._store_prefill_context(self.drafter, self.meta, self.attn, torch.tensor(positions), len(positions))
        self.worker.finish_step()
        for r in batch.context_requests:
            r.context_current_position += r.context_chunk_size
            if r.context_current_position >= r.prompt_len:
                r.tokens.append(1)
                r.state = LlmRequestState.GENERATION_IN_PROGRESS
        self.draft.update_context_resources(batch)
        self.draft.update_resources(batch)

    def generation_step(self, batch: ScheduledRequests, accepted: dict[int, int], *, keep: bool = True):
        for r in batch.generation_requests:
            r.py_draft_tokens = [5] * K
        self.begin(batch)
        counts = {rid: a + 1 for rid, a in accepted.items()}
        h = torch.randn(sum(counts.values()), HIDDEN)
        k, v = self.drafter.precompute_context_kv(h, None)
        i = 0
        for r in batch.generation_requests:
            n = r.max_beam_num_tokens
            for j in range(counts.get(r.py_request_id, 0)):
                self.stored[(r.py_request_id, n - 1 + j)] = h[i]
                i += 1
        preps = self.worker.store_accepted_kv(k, v, counts)
        if not keep:
            return preps
        self.worker.finish_step()
        for r in batch.generation_requests:
            r.tokens += [5] * accepted.get(r.py_request_id, 0) + [1]
            r.py_draft_tokens = []
        self.draft.update_resources(batch)
        return preps

    def read_back(self, rid: int, positions: list[int]) -> torch.Tensor:
        pages = self.draft.get_batch_cache_indices([rid])[0]
        idx = torch.tensor([pages[p // P] for p in positions], device=self.buf.device)
        off = torch.tensor([p % P for p in positions], device=self.buf.device)
        return self.buf[idx, :, :, off].reshape(len(positions), -1).cpu()

    def check_window_holds_what_was_stored(self, rid: int, end: int) -> None:
        """The last WINDOW positions before `end` read back exactly as stored, through the request's own row."""
        positions = [p for p in range(max(0, end - WINDOW), end) if (rid, p) in self.stored]
        want = torch.stack([self.stored[(rid, p)] for p in positions])
        assert torch.equal(self.read_back(rid, positions), want)


def req(rid: int, prompt: int, chunk: int) -> Req:
    return Req(rid, prompt, list(range(prompt)), context_chunk_size=chunk)


def prefill(rig: Rig, *reqs: Req, chunk: int) -> None:
    while any(r.is_context_init_state for r in reqs):
        live = [r for r in reqs if r.is_context_init_state]
        for r in live:
            r.context_chunk_size = min(chunk, r.prompt_len - r.context_current_position)
        rig.context_step(ScheduledRequests(context_requests=live))


# -- the context store ------------------------------------------------------------------------------------------
def test_chunked_prefill_is_stored_on_each_requests_own_pages_and_reads_back_exactly():
    rig = Rig()
    a, b = req(1, 100, 24), req(2, 57, 24)
    prefill(rig, a, b, chunk=24)
    for r in (a, b):
        rig.check_window_holds_what_was_stored(r.py_request_id, r.prompt_len)
    assert rig.worker._req_to_slot.keys() == {1, 2}
    assert [int(rig.worker._ctx_len[rig.worker._req_to_slot[r]]) for r in (1, 2)] == [100, 57]


def test_a_store_on_a_page_the_mirror_released_is_refused_and_writes_nothing():
    rig = Rig()
    a = req(1, 96, 96)
    prefill(rig, a, chunk=96)
    b = req(2, 8, 8)
    b.context_chunk_size = 8
    rig.begin(ScheduledRequests(generation_requests=[a]))
    before = rig.buf.clone()
    kv = torch.randn(1, 1, H, D)
    # position 0 of request 1: its window released that page (the cpp export reads it as page 0)
    with pytest.raises(DraftStoreRefused, match=r"request 1 \(batch row 0\) would store position 0 \(ordinal 0\)"):
        rig.worker._store_context_kv_paged(kv, kv, torch.tensor([0]), torch.tensor([0]))
    # a batch of stores with one bad entry writes none of them
    with pytest.raises(DraftStoreRefused):
        rig.worker._store_context_kv_paged(kv.repeat(2, 1, 1, 1), kv.repeat(2, 1, 1, 1), torch.tensor([0, 0]),
                                           torch.tensor([95, 3]))
    assert torch.equal(rig.buf, before)


def test_a_table_refreshed_from_another_requests_offsets_is_refused():
    rig = Rig()
    a, b = req(1, 40, 40), req(2, 40, 40)
    prefill(rig, a, b, chunk=40)
    batch = ScheduledRequests(generation_requests=[a, b])
    rig.begin(batch)
    src = rig.attn.draft_kv_cache_block_offsets.clone()
    src[:, [0, 1]] = src[:, [1, 0]]  # the rows of the two requests swapped
    rig.attn.draft_kv_cache_block_offsets, rig.attn.request_ids = src, None
    rig.worker._refresh_ctx_block_tables(rig.attn, 2)
    kv = torch.randn(1, 1, H, D)
    with pytest.raises(DraftStoreRefused, match="request 1"):
        rig.worker._store_context_kv_paged(kv, kv, torch.tensor([0]), torch.tensor([39]))


def test_the_refreshed_table_is_the_export_decoded():
    rig = Rig()
    a = req(1, 70, 70)
    prefill(rig, a, chunk=70)
    rig.begin(ScheduledRequests(generation_requests=[a]))
    row = rig.draft.get_batch_cache_indices([1])[0]
    table = rig.worker._ctx_block_tables[0, : len(row)].tolist()
    assert table == [max(p, 0) for p in row]  # cpp export: released entries read as page 0
    assert row[0] == -1 and row[-1] >= 0


def _decoded_whole(offsets: torch.Tensor, n: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The oracle: pool 0's rows [0, n) decoded entry by entry, and their counts of non-negative entries."""
    rows = offsets[0, :n, 0].tolist()
    return (torch.tensor([[max(e, 0) // 2 for e in row] for row in rows], dtype=torch.int32),
            torch.tensor([sum(e >= 0 for e in row) for row in rows]))


def test_tables_refreshed_from_a_kept_offsets_tensor_decode_only_what_changed():
    """An executor's kept offsets tensor: after every refresh the worker's tables (and counts) equal a whole
    decode of it, most steps decode no row whole, and a write to the tensor by anyone else (or a batch that
    changes) gets whole rows again."""
    rig = Rig(keep_offsets=True)
    a, b, c = req(1, 61, 32), req(2, 20, 32), req(3, 45, 45)
    prefill(rig, a, b, c, chunk=32)
    batch = ScheduledRequests(generation_requests=[a, b, c])
    pool = rig.worker._bound()
    quiet = 0
    for step in range(16):
        rig.generation_step(batch, {1: step % 4, 2: (step + 1) % 4, 3: 3})
        n = len(batch.generation_requests)
        tables, counts = _decoded_whole(rig.attn.draft_kv_cache_block_offsets, n)
        width = tables.shape[1]
        assert torch.equal(rig.worker._ctx_block_tables[:n, :width].cpu(), tables), step
        assert torch.equal(pool.counts[0][:n].cpu(), counts), step
        quiet += pool.rows_decoded_whole == 0
        if step == 9:  # someone else writes into the tensor: the next refresh decodes every row
            rig.attn.draft_kv_cache_block_offsets[0, 1, 0, 0] = 6
        if step == 10:
            assert pool.rows_decoded_whole == n
    assert quiet >= 10
    rig.generation_step(ScheduledRequests(generation_requests=[c, a]), {1: 1, 3: 1})  # rows swapped
    assert pool.rows_decoded_whole == 2
    tables, _ = _decoded_whole(rig.attn.draft_kv_cache_block_offsets, 2)
    assert torch.equal(rig.worker._ctx_block_tables[:2, : tables.shape[1]].cpu(), tables)


def test_several_manager_writes_between_two_refreshes_decode_to_the_last_one():
    """The manager writes the kept tensor several times (pages gained and released in between, an entry
    written more than once) before the worker decodes: the tables equal a whole decode of the tensor, taken
    from the values the manager logged (the tensor is not read back), each entry's last write holding."""
    rig = Rig(keep_offsets=True)
    a, b = req(1, 61, 32), req(2, 20, 32)
    prefill(rig, a, b, chunk=32)
    batch = ScheduledRequests(generation_requests=[a, b])
    rig.generation_step(batch, {1: 0, 2: 0})
    pool = rig.worker._bound()
    dst = rig.attn.draft_kv_cache_block_offsets
    ids = [1, 2]
    for extra in (9, 23, 40, 3):  # each write follows a resize: pages come and go, entries are rewritten
        for rid in ids:
            cache = rig.draft.get_cache(rid)
            assert cache.resize(cache.capacity + extra, cache.history_length + extra)
        rig.draft.copy_batch_block_offsets(dst, ids, 1, 0, 2)
    assert rig.draft.offset_destinations.last_full_rows == 0  # entry by entry, not whole rows
    assert pool.decoded is not None
    rig.worker._refresh_ctx_block_tables(rig.attn, 2)
    assert pool.rows_decoded_whole == 0
    tables, counts = _decoded_whole(dst, 2)
    assert torch.equal(rig.worker._ctx_block_tables[:2, : tables.shape[1]].cpu(), tables)
    assert torch.equal(pool.counts[0][:2].cpu(), counts)


def test_refresh_errors_say_what_is_missing():
    rig = Rig()
    a = req(1, 16, 16)
    prefill(rig, a, chunk=16)
    rig.begin(ScheduledRequests(generation_requests=[a]))
    with pytest.raises(RuntimeError, match="carries no draft_kv_cache_block_offsets"):
        rig.worker._refresh_ctx_block_tables(SimpleNamespace(draft_kv_cache_block_offsets=None), 1)
    stale = SimpleNamespace(draft_kv_cache_block_offsets=rig.attn.draft_kv_cache_block_offsets, request_ids=[9])
    with pytest.raises(RuntimeError, match=r"rows \[9\] are not the rows"):
        rig.worker._refresh_ctx_block_tables(stale, 1)


# -- generation, rollback ---------------------------------------------------------------------------------------
def test_accepted_tokens_continue_the_slot_and_the_read_rows_name_only_own_pages():
    rig = Rig()
    a, b = req(1, 61, 32), req(2, 20, 32)
    prefill(rig, a, b, chunk=32)
    for step in range(12):
        batch = ScheduledRequests(generation_requests=[a, b])
        preps = rig.generation_step(batch, {1: step % (K + 1), 2: (step * 3) % (K + 1)})
        prep = preps[0]
        for row, r in enumerate((a, b)):
            length = int(prep.read_lens[row])
            own = set(rig.draft.get_batch_cache_indices([r.py_request_id])[0]) - {-1}
            lo = max(0, length + K + 1 - WINDOW)
            assert {int(prep.read_rows[row, t // P]) for t in range(lo, length)} <= own
    for r in (a, b):
        rig.check_window_holds_what_was_stored(r.py_request_id, r.max_beam_num_tokens - 1)


def test_a_rolled_back_step_restores_lengths_and_bases_and_replays_identically():
    """Upstream's guided-rollback case: a forward that fails after the slots advanced."""
    rig = Rig()
    a = req(1, 90, 90)
    prefill(rig, a, chunk=90)
    d = Req(2, 70, list(range(71)), context_current_position=70, state=LlmRequestState.DISAGG_GENERATION_INIT)
    assert rig.draft.prepare_disagg_gen_init(d)
    d.state = LlmRequestState.GENERATION_IN_PROGRESS
    rig.generation_step(ScheduledRequests(generation_requests=[a, d]), {1: 1, 2: 2})
    slot = rig.worker._req_to_slot[2]
    assert int(rig.worker._base_pages[slot]) > 0  # a generation seed past position 0 has a base
    lengths, bases = rig.worker._ctx_len.clone(), rig.worker._base_pages.clone()
    batch = ScheduledRequests(generation_requests=[a, d])
    first = rig.generation_step(batch, {1: 3, 2: 0}, keep=False)
    assert not torch.equal(rig.worker._ctx_len, lengths)
    rig.worker._ensure_spec_dec_state_restored(rig.attn, rig.meta)
    assert torch.equal(rig.worker._ctx_len, lengths) and torch.equal(rig.worker._base_pages, bases)
    again = rig.worker.store_accepted_kv(*rig.drafter.precompute_context_kv(torch.randn(5, HIDDEN), None), {1: 4, 2: 1})
    for x, y in zip(first, again):
        assert torch.equal(x.read_rows, y.read_rows) and torch.equal(x.new_ctx_len, y.new_ctx_len)
        assert torch.equal(x.store_pages, y.store_pages)
    rig.worker._ensure_spec_dec_state_restored(rig.attn, rig.meta)  # nothing pending twice: a no-op
    assert torch.equal(rig.worker._ctx_len, lengths)


# -- dummies and slots ------------------------------------------------------------------------------------------
def test_warmup_dummies_draft_on_dummy_slots_and_leave_real_slots_alone():
    """Upstream's dummy-slot case: CUDA-graph padding never lands on a real request's slot."""
    rig = Rig()
    a = req(1, 40, 40)
    prefill(rig, a, chunk=40)
    floor = CUDA_GRAPH_DUMMY_REQUEST_ID - K
    dummies = rig.draft.add_dummy_requests([floor, floor + 1], [24, 24], is_gen=True, max_num_draft_tokens=K)
    assert dummies is not None
    real = rig.worker._req_to_slot[1]
    state = (rig.worker._ctx_len.clone(), rig.worker._base_pages.clone())
    batch = ScheduledRequests(generation_requests=[a, *dummies])
    rig.begin(batch)
    slots = rig.worker._batch_to_slot[:3].tolist()
    assert slots[0] == real and all(s >= MAX_BATCH for s in slots[1:]) and slots[1] != slots[2]
    assert rig.worker._dummy_slot == MAX_BATCH
    rig.worker.store_accepted_kv(torch.zeros(0, 1, H, D), None, {})
    rig.worker._ensure_spec_dec_state_restored(rig.attn, rig.meta)
    changed = [s for s in range(len(state[0])) if rig.worker._ctx_len[s] != state[0][s]
               or rig.worker._base_pages[s] != state[1][s]]
    assert changed and all(s >= MAX_BATCH for s in changed)  # only the dummy slots were seeded
    for dummy in dummies:
        rig.draft.free_resources(dummy)


def test_the_row_to_slot_table_is_copied_only_when_the_rows_change():
    """Upstream's copy-skip case: a step with the same rows as the last copies nothing to the device."""
    rig = Rig()
    a, b = req(1, 16, 16), req(2, 16, 16)
    prefill(rig, a, b, chunk=16)
    copies = rig.worker.batch_to_slot_copies
    assert copies == 1  # the prefill's rows, once
    for _ in range(3):  # the same two requests on the same slots, now as generation rows
        rig.generation_step(ScheduledRequests(generation_requests=[a, b]), {1: 0, 2: 0})
    assert rig.worker.batch_to_slot_copies == copies
    rig.generation_step(ScheduledRequests(generation_requests=[b, a]), {1: 0, 2: 0})
    assert rig.worker.batch_to_slot_copies == copies + 1
    rig.generation_step(ScheduledRequests(generation_requests=[b]), {2: 0})
    assert rig.worker.batch_to_slot_copies == copies + 2
    assert rig.worker._batch_to_slot[0].item() == rig.worker._req_to_slot[2]
    rig.generation_step(ScheduledRequests(generation_requests=[b, a]), {1: 0, 2: 0})
    assert rig.worker._batch_to_slot[:2].tolist() == [rig.worker._req_to_slot[2], rig.worker._req_to_slot[1]]


def test_assign_slot_reuses_a_slot_or_starts_over_on_reset():
    rig = Rig()
    first = rig.worker._assign_slot(7)
    assert rig.worker._assign_slot(7) == first
    rig.worker._ctx_len[first] = 5
    again = rig.worker._assign_slot(7, reset=True)
    assert int(rig.worker._ctx_len[again]) == 0
    for rid in (8, 9, 10):
        assert rig.worker._assign_slot(rid) is not None
    assert rig.worker._assign_slot(11) is None  # MAX_BATCH regular slots, all held
    assert len(rig.worker._free_slots) == 0


# -- errors and binding -----------------------------------------------------------------------------------------
def test_prepare_names_rows_the_draft_manager_never_saw_and_changes_nothing():
    rig = Rig()
    a = req(1, 16, 16)
    prefill(rig, a, chunk=16)
    held = rig.worker._req_to_slot
    rig.meta.request_ids, rig.meta.num_generations = [1, 42], 2
    with pytest.raises(KeyError, match=r"requests \[42\]"):
        rig.meta.prepare()
    assert rig.worker._req_to_slot == held
    rig.meta.request_ids = None
    with pytest.raises(ValueError, match="request_ids is not set"):
        rig.meta.prepare()


def test_binding_without_block_offsets_falls_back_to_an_arena_with_a_warning():
    rig = Rig()
    worker = DFlashWorker(DFlashDecodingConfig(max_draft_len=K), Mapping())
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        worker._lazy_init_ctx_buffers(rig.drafter, rig.meta, SimpleNamespace(max_seq_len=256), rig.draft)
    assert any("private arena" in str(w.message) for w in seen)
    assert worker._ctx_page_table is not None and worker._ctx_block_tables is None
    assert not worker._refresh_ctx_block_tables(SimpleNamespace(), 1)
    assert worker._ctx_kv_buf[0].data_ptr() != rig.buf.data_ptr()


def test_a_drafter_that_does_not_fit_the_pool_is_refused_with_the_numbers():
    rig = Rig()
    worker = DFlashWorker(DFlashDecodingConfig(max_draft_len=K), Mapping())
    wide = SimpleNamespace(_num_attn_layers=1, _num_kv_heads=H, _head_dim=D * 2, block_size=K + 1)
    with pytest.raises(ValueError, match=rf"head_dim {2 * D} \(pool {D}\)"):
        worker._lazy_init_ctx_buffers(wide, rig.meta, rig.attn, rig.draft)
    assert not worker._ctx_buf_inited


def test_the_metadata_keeps_captured_hidden_states_by_layer():
    meta = DFlashSpecMetadata(max_num_requests=2, max_draft_len=K, max_total_draft_tokens=K, layers_to_capture=[5, 2],
                              hidden_size=3, max_num_tokens=4, dtype=torch.float32, device="cpu")
    assert meta.layers_to_capture == [2, 5] and meta.is_layer_capture(5) and not meta.is_layer_capture(3)
    h, r = torch.randn(4, 3), torch.randn(4, 3)
    meta.maybe_capture_hidden_states(5, h, r)
    meta.maybe_capture_hidden_states(2, h)
    meta.maybe_capture_hidden_states(3, torch.full((4, 3), 9.0))  # not captured
    assert torch.equal(meta.get_hidden_states(4), torch.cat([h, h + r], dim=1))


# -- random workloads -------------------------------------------------------------------------------------------
@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(prompts=st.lists(st.integers(1, 90), min_size=1, max_size=3), chunk=st.integers(5, 40),
       accepted=st.lists(st.integers(0, K), min_size=4, max_size=10), seed=st.integers(0, 2**16))
def test_random_chunked_prefill_and_generation_store_only_own_pages(prompts, chunk, accepted, seed):
    run_workload(prompts, chunk, accepted, seed, "cpu")


@pytest.mark.cuda
@settings(max_examples=6, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(prompts=st.lists(st.integers(1, 90), min_size=1, max_size=3), chunk=st.integers(5, 40),
       accepted=st.lists(st.integers(0, K), min_size=4, max_size=8), seed=st.integers(0, 2**16))
def test_random_workloads_store_only_own_pages_on_the_gpu(prompts, chunk, accepted, seed):
    run_workload(prompts, chunk, accepted, seed, "cuda")


def run_workload(prompts, chunk, accepted, seed, device):
    torch.manual_seed(seed)
    rig = Rig(pages=96, device=device)
    reqs = [req(i + 1, p, chunk) for i, p in enumerate(prompts)]
    prefill(rig, *reqs, chunk=chunk)
    for step, a in enumerate(accepted):
        live = reqs[step % len(reqs):] + reqs[: step % len(reqs)]  # rows change order between steps
        rig.generation_step(ScheduledRequests(generation_requests=live), {r.py_request_id: a for r in live})
    for r in reqs:
        rig.check_window_holds_what_was_stored(r.py_request_id, r.max_beam_num_tokens - 1)
    for r in reqs:
        rig.draft.free_resources(r)
    assert all(p.num_free == p.total for p in rig.draft.pools())


def test_a_store_before_the_step_s_tables_are_refreshed_is_an_error():
    rig = Rig()
    a = req(1, 16, 16)
    prefill(rig, a, chunk=16)
    batch = ScheduledRequests(generation_requests=[a])
    rig.draft.prepare_resources(batch)
    rig.meta.request_ids, rig.meta.num_generations = [1], 1
    rig.meta.prepare()  # a new step: last step's tables no longer count
    kv = torch.randn(1, 1, H, D)
    with pytest.raises(RuntimeError, match="refreshed for 1 rows"):
        rig.begin(batch)
        rig.worker._store_context_kv_paged(kv, kv, torch.tensor([3]), torch.tensor([15]))
    rig.meta.prepare()
    with pytest.raises(RuntimeError, match="not refreshed for this step"):
        rig.worker._store_context_kv_paged(kv, kv, torch.tensor([0]), torch.tensor([15]))


# -- upstream's signatures --------------------------------------------------------------------------------------
E = inspect.Parameter.empty
UPSTREAM_WORKER = {
    "__init__": [("spec_config", E), ("mapping", E), ("use_separate_draft_kv_cache", False)],
    "_lazy_init_ctx_buffers": [("draft_model", E), ("spec_metadata", E), ("attn_metadata", E),
                               ("draft_kv_cache_manager", None)],
    "_assign_slot": [("req_id", E), ("reset", False)],
    "_refresh_ctx_block_tables": [("attn_metadata", E), ("num_seqs", E)],
    "_store_context_kv_paged": [("k", E), ("v", E), ("rows", E), ("positions", E)],
    "_store_prefill_context": [("draft_model", E), ("spec_metadata", E), ("attn_metadata", E), ("position_ids", E),
                               ("total_target_tokens", E)],
    "_ensure_spec_dec_state_restored": [("attn_metadata", E), ("spec_metadata", E)],
}


@pytest.mark.parametrize("name", sorted(UPSTREAM_WORKER))
def test_the_worker_has_upstreams_signatures(name):
    params = [p for p in inspect.signature(getattr(DFlashWorker, name)).parameters.values() if p.name != "self"]
    positional = [(p.name, p.default) for p in params if p.kind is not inspect.Parameter.KEYWORD_ONLY]
    assert positional == UPSTREAM_WORKER[name]


def test_the_metadata_has_upstreams_fields_in_upstreams_order():
    names = [f.name for f in dataclasses.fields(DFlashSpecMetadata)]
    base = ["max_num_requests", "max_draft_len", "max_total_draft_tokens", "num_generations", "is_cuda_graph",
            "spec_dec_mode", "draft_tokens", "draft_lens", "request_ids", "seq_lens", "gather_ids",
            "num_accepted_draft_tokens", "num_tokens", "num_extra_kv_tokens", "num_layers", "is_spec_dec_tree",
            "is_spec_dec_dynamic_tree", "runtime_draft_len", "runtime_tokens_per_gen_step"]
    dflash = ["batch_indices_cuda", "spec_resource_manager", "layers_to_capture", "hidden_size", "max_num_tokens",
              "dtype", "captured_hidden_states"]
    assert names == base + dflash + ["device", "scheduled_requests"]  # ours last
    assert list(inspect.signature(DFlashSpecMetadata.prepare).parameters) == ["self"]


@pytest.mark.cuda
def test_the_bound_generation_step_on_the_gpu_equals_the_checked_step_on_the_cpu():
    """The same workload on two rigs: on the GPU the generation step runs through launches bound to the
    slots' kept buffers (after the first step of a shape); every step's preparation equals the CPU rig's
    (checked interpreter launches), while rows keep their order and after they start to rotate."""
    rigs = [Rig(pages=96, device=d) for d in ("cpu", "cuda")]
    reqs = [[req(i + 1, p, 24) for i, p in enumerate((70, 33, 90))] for _ in rigs]
    for rig, rs in zip(rigs, reqs):
        prefill(rig, *rs, chunk=24)
    for step in range(14):
        preps = []
        for rig, rs in zip(rigs, reqs):
            live = rs if step < 7 else rs[step % 3:] + rs[: step % 3]
            torch.manual_seed(step)
            preps.append(rig.generation_step(ScheduledRequests(generation_requests=live),
                                             {r.py_request_id: (step + r.py_request_id) % (K + 1) for r in live}))
        for cpu, gpu in zip(*preps):
            for name, t in cpu.tensors().items():
                assert torch.equal(t, getattr(gpu, name).cpu()), (step, name)
    bound = rigs[1].worker._slots().buffers._bound.values()
    assert bound and any(b.is_bound for b in bound)


def test_a_repeated_generation_batch_keeps_its_rows_and_gives_what_a_full_plan_gives():
    """Steps over the same requests reuse the last step's rows; a twin that plans every step in full gives the
    same preparations and slot state, also across an eviction (reseeded), a rotated batch and a request that
    leaves."""
    fast, full = Rig(keep_offsets=True), Rig(keep_offsets=True)
    full.worker._slots()._repeats_last_step = lambda *args: False
    reqs = {rig: [req(i + 1, p, 24) for i, p in enumerate((70, 33, 90))] for rig in (fast, full)}
    for rig, rs in reqs.items():
        prefill(rig, *rs, chunk=24)
    reused = 0
    for step in range(16):
        got = []
        for rig, rs in reqs.items():
            live = rs if step < 10 else rs[1:] if step >= 13 else rs[::-1]
            if step == 5:
                rig.worker._slots().evict(2)
            before = rig.worker._slots().rows
            got.append(rig.generation_step(ScheduledRequests(generation_requests=live),
                                           {r.py_request_id: (step * r.py_request_id) % (K + 1) for r in live}))
            if rig is fast:
                reused += rig.worker._slots().rows is before
            rig.worker._slots().slots.check_host_mirror()
        for a, b in zip(*got):
            for name, t in a.tensors().items():
                assert torch.equal(t, getattr(b, name)), (step, name)
        assert fast.worker._slots().slots.live_requests() == full.worker._slots().slots.live_requests()
    assert reused >= 9


def test_a_slot_whose_request_left_the_pool_is_freed_by_the_next_step_that_plans():
    """A repeated batch keeps its rows without planning, so a request that left the pool meanwhile (not
    in the batch) keeps its slot until the next step that plans: then it is freed, and the worker hears."""
    rig = Rig()
    a, b, c = req(1, 40, 40), req(2, 30, 30), req(3, 20, 20)
    prefill(rig, a, b, c, chunk=40)
    slots = rig.worker._slots()
    rig.generation_step(ScheduledRequests(generation_requests=[a, b]), {1: 1, 2: 1})
    rows = slots.rows
    rig.draft.free_resources(c)  # c leaves the pool while the batch stays the same
    rig.generation_step(ScheduledRequests(generation_requests=[a, b]), {1: 1, 2: 1})
    assert slots.rows is rows and 3 in slots.slots.live_requests()
    rig.generation_step(ScheduledRequests(generation_requests=[b, a]), {1: 1, 2: 1})  # rows change: a plan
    assert 3 not in slots.slots.live_requests() and 3 not in rig.worker._req_to_slot


def test_prepare_leaves_the_batch_indices_an_arange_even_after_a_foreign_write():
    rig = Rig()
    a, b = req(1, 20, 20), req(2, 12, 12)
    prefill(rig, a, b, chunk=20)
    rig.generation_step(ScheduledRequests(generation_requests=[a, b]), {1: 0, 2: 1})
    indices = rig.meta.batch_indices_cuda
    assert indices[:2].tolist() == [0, 1]
    indices[1] = 7  # someone else's write
    rig.generation_step(ScheduledRequests(generation_requests=[a, b]), {1: 1, 2: 0})
    assert indices.tolist() == list(range(indices.numel()))
