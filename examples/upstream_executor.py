"""A PyExecutor-shaped loop written only against TensorRT-LLM's names, driving this package unchanged.

    python examples/upstream_executor.py          # CPU, a few seconds, no model

What an executor written for upstream does with a DFlash drafter on its own
draft KV pool, call for call, with request objects of its own that carry only
upstream LlmRequest's attributes (`Request` below):

* construction as upstream's `_util.py` does it: a target `KVCacheManagerV2` and,
  because `should_use_separate_draft_kv_cache(spec_config)`, a draft one built with
  `is_draft=True` and the same `spec_config`; a `DFlashWorker` bound to the draft pool by
  `_lazy_init_ctx_buffers`, and its `DFlashSpecMetadata`;
* CUDA-graph warmup: generation dummies in both managers (`add_dummy_requests(...,
  draft_kv_cache_manager=draft)`), one step through them (they draft on the dummy slots),
  rolled back and freed;
* per step: the V2 scheduler's calls (`prepare_context`, `resize_context`, a chunk
  deferred by `revert_allocate_context`, `try_allocate_generation`, `suspend_request` and
  `resume_request` under pool pressure), `prepare_resources` in upstream's order, the
  attention metadata's draft block offsets (`copy_batch_block_offsets`),
  `spec_metadata.prepare()`, `_refresh_ctx_block_tables`, the target forward (random K/V
  written through `get_buffers` at the pages the block table names, hidden states captured
  by `maybe_capture_hidden_states`), the drafter's context store
  (`_store_prefill_context`, which writes through `_store_context_kv_paged`), the accepted
  tokens' K/V, verification with accepted and rejected drafts, one step rolled back
  (`_ensure_spec_dec_state_restored`), then `update_context_resources` / `update_resources`;
* a disaggregated generation-init request (`prepare_disagg_gen_init`);
* completion: `free_resources` in both managers, and every pool fully free.

There is no model: K/V are random, acceptance is drawn at random, and the
drafter's "proposals" are random tokens. What is real is every address: the worker
checks each drafter store against the request's own mirror before it writes, the
example reads every stored chunk back through the request's row, and checks that
the block decode's rebased read rows name only the request's pages.
"""
from __future__ import annotations

import dataclasses
import random
from types import SimpleNamespace

import torch

from tensorrt_llm_draftkv import (
    CUDA_GRAPH_DUMMY_REQUEST_ID,
    CacheType,
    DataType,
    DFlashDecodingConfig,
    DFlashSpecMetadata,
    DFlashWorker,
    KVCacheManagerV2,
    KvCacheConfig,
    LlmRequestState,
    Mapping,
    ScheduledRequests,
    should_use_separate_draft_kv_cache,
)

P = 32  # tokens per block
K = 7  # drafts per step (a DFlash block of K + 1)
WINDOW = 512  # the target's sliding-window layers and the drafter's window
MAX_SEQ = 16384
CHUNK = 1024  # the scheduler's chunk budget per context request
MAX_BATCH = 4
NEW_TOKENS = 64
TARGET_TOKENS = 10 * 1024  # the target pool's budget: less than the requests' whole histories
rng = random.Random(0)
gen = torch.Generator().manual_seed(0)
events = {"chunk deferred": 0, "suspended": 0, "resumed": 0, "resume refused": 0}


@dataclasses.dataclass
class Request:
    """An executor's own request: upstream LlmRequest's attributes, nothing of this package's."""

    py_request_id: int
    prompt_len: int
    tokens: list[int]
    state: LlmRequestState = LlmRequestState.CONTEXT_INIT
    context_current_position: int = 0
    context_chunk_size: int = 0
    py_draft_tokens: list[int] = dataclasses.field(default_factory=list)
    is_dummy: bool = False
    max_new_tokens: int = NEW_TOKENS
    prepopulated_prompt_len: int = 0
    use_draft_model: bool = False  # flipped by request_context; one view here (no separate draft engine)

    def get_tokens(self, beam: int) -> list[int]:
        return self.tokens

    def set_prepopulated_prompt_len(self, n: int, tokens_per_block: int) -> None:
        self.prepopulated_prompt_len = n

    @property
    def max_beam_num_tokens(self) -> int:
        return len(self.tokens)

    @property
    def is_first_context_chunk(self) -> bool:
        return self.context_current_position == 0

    @property
    def is_last_context_chunk(self) -> bool:
        return self.context_current_position + self.context_chunk_size >= self.prompt_len

    @property
    def is_context_init_state(self) -> bool:
        return self.state == LlmRequestState.CONTEXT_INIT

    @property
    def is_generation_in_progress_state(self) -> bool:
        return self.state == LlmRequestState.GENERATION_IN_PROGRESS

    @property
    def is_disagg_generation_init_state(self) -> bool:
        return self.state == LlmRequestState.DISAGG_GENERATION_INIT


def make_request(rid: int, prompt_len: int, state=LlmRequestState.CONTEXT_INIT) -> Request:
    tokens = [rng.randrange(1000) for _ in range(prompt_len)]
    return Request(rid, prompt_len, tokens, state=state)


class ToyDrafter:
    """Upstream's drafter attributes and the two calls the worker's context store makes; no weights:
    the projected hidden state is the K/V itself, so a read-back can be compared exactly."""

    _num_attn_layers, _num_kv_heads, _head_dim, block_size = 1, 2, 16, K + 1

    def project_target_hidden(self, hidden: torch.Tensor) -> torch.Tensor:
        return hidden

    def precompute_context_kv(self, projected: torch.Tensor, positions: torch.Tensor):
        kv = projected.reshape(projected.shape[0], self._num_attn_layers, 2, self._num_kv_heads, self._head_dim)
        return kv[:, :, 0], kv[:, :, 1]


# -- construction, as upstream's executor builds it ----------------------------------------------------------
spec_config = DFlashDecodingConfig(max_draft_len=K)
mapping = Mapping()
common = dict(tokens_per_block=P, max_seq_len=MAX_SEQ, max_batch_size=MAX_BATCH, mapping=mapping, dtype=DataType.FLOAT,
              spec_config=spec_config, max_num_tokens=CHUNK, device="cpu")
# 4 target layers alternating a 512-token window and full attention, on a budget too small for every
# request's whole history at once: generation steps run out, requests are suspended and resumed
target = KVCacheManagerV2(KvCacheConfig(max_tokens=TARGET_TOKENS, max_attention_window=[WINDOW, MAX_SEQ],
                                        enable_block_reuse=False, max_util_for_resume=0.9),
                          CacheType.SELF, num_layers=4, num_kv_heads=2, head_dim=16, **common)
assert should_use_separate_draft_kv_cache(spec_config)
draft = KVCacheManagerV2(KvCacheConfig(max_tokens=8 * 1024, max_attention_window=[WINDOW], enable_block_reuse=False),
                         CacheType.SELF, num_layers=1, num_kv_heads=2, head_dim=16, is_draft=True, **common)
resource_managers = [target, draft]  # upstream's order: the KV cache manager, then the draft KV cache manager
drafter = ToyDrafter()
HIDDEN = 2 * drafter._num_kv_heads * drafter._head_dim
worker = DFlashWorker(spec_config, mapping, use_separate_draft_kv_cache=True)
spec_metadata = DFlashSpecMetadata(max_num_requests=MAX_BATCH, max_draft_len=K, max_total_draft_tokens=K,
                                   layers_to_capture=[1], hidden_size=HIDDEN, max_num_tokens=MAX_BATCH * CHUNK,
                                   dtype=torch.float32, device="cpu")
attn_metadata = SimpleNamespace(draft_kv_cache_block_offsets=None, request_ids=None, max_seq_len=MAX_SEQ,
                                num_contexts=0, seq_lens=[])
worker._lazy_init_ctx_buffers(drafter, spec_metadata, attn_metadata, draft_kv_cache_manager=draft)


def write_kv(manager: KVCacheManagerV2, rid: int, positions: list[int]) -> None:
    """The target forward's K/V: random values of these absolute positions into every layer, through
    `get_buffers`, at the pages the request's block table names (positions a window released are skipped)."""
    for layer in range(manager.num_local_layers):
        pages = manager.get_batch_cache_indices([rid], layer_idx=layer)[0]
        keep = [p for p in positions if p // P < len(pages) and pages[p // P] >= 0]
        if keep:
            buf = manager.get_buffers(layer)  # [pages, 2, P, heads, head_dim]
            idx, off = torch.tensor([pages[p // P] for p in keep]), torch.tensor([p % P for p in keep])
            buf[idx, :, off] = torch.randn(len(keep), 2, buf.shape[3], buf.shape[4], generator=gen)


def read_back(rid: int, positions: list[int]) -> torch.Tensor:
    """The drafter K/V the draft pool holds for these absolute positions, read through the request's own row."""
    pages = draft.get_batch_cache_indices([rid])[0]
    buf = draft.get_buffers(0, kv_layout="HND")  # [pages, 2, heads, P, head_dim]
    idx, off = torch.tensor([pages[p // P] for p in positions]), torch.tensor([p % P for p in positions])
    return buf[idx, :, :, off].reshape(len(positions), -1)


def schedule(requests: list[Request]) -> ScheduledRequests:
    """The V2 scheduler's part: room for every request it schedules, suspending what does not fit."""
    batch = ScheduledRequests()
    for req in requests:
        if len(batch.context_requests) + len(batch.generation_requests) == MAX_BATCH:
            break
        if req.is_context_init_state:
            if not target.prepare_context(req):
                continue
            size = min(CHUNK, req.prompt_len - req.context_current_position)
            if not target.resize_context(req, size):
                target.revert_allocate_context(req)  # suspended (it held pages) or dropped; retried next step
                events["chunk deferred"] += 1
                continue
            req.context_chunk_size = size
            batch.context_requests.append(req)
        elif req.is_generation_in_progress_state:
            if not target.is_request_active(req.py_request_id):
                if not target.resume_request(req):
                    events["resume refused"] += 1
                    continue  # still suspended: the pool is above max_util_for_resume
                events["resumed"] += 1
            req.py_draft_tokens = [rng.randrange(1000) for _ in range(K)]
            if not target.try_allocate_generation(req):
                target.suspend_request(req)  # under pressure: it keeps its pages and waits
                events["suspended"] += 1
                req.py_draft_tokens = []
                continue
            batch.generation_requests.append(req)
    return batch


def check_block_decode_reads(batch: ScheduledRequests) -> None:
    """The block decode's rebased read rows: every page in the window a generation row reads is its own."""
    prep = worker.generation_prep()[0]
    rows = worker.draft_slots.request_ids
    for req in batch.generation_requests:
        r = rows.index(req.py_request_id)
        length = int(prep.read_lens[r])
        lo = max(0, length + K + 1 - WINDOW)
        read = {int(prep.read_rows[r, t // P]) for t in range(lo, length)}
        own = set(draft.get_batch_cache_indices([req.py_request_id])[0]) - {-1}
        assert read <= own, (req.py_request_id, sorted(read - own))


def run_step(batch: ScheduledRequests, *, reject: bool = False, warmup: bool = False) -> None:
    """One executor iteration over `batch` (`reject`: the step is thrown away after the drafter ran)."""
    for manager in resource_managers:
        manager.prepare_resources(batch)
    ids = [r.py_request_id for r in batch.all_requests()]
    num_ctx = len(batch.context_requests)
    # what upstream's attention metadata carries for the drafter: the draft pool's block offsets
    offsets = torch.zeros((draft.num_pools, MAX_BATCH, 2, draft.config.max_blocks_per_seq), dtype=torch.int32)
    draft.copy_batch_block_offsets(offsets, ids, 1, num_ctx, len(ids))
    attn_metadata.draft_kv_cache_block_offsets, attn_metadata.request_ids = offsets, ids
    attn_metadata.num_contexts = num_ctx
    attn_metadata.seq_lens = [r.context_chunk_size for r in batch.context_requests]
    spec_metadata.request_ids, spec_metadata.num_generations = ids, len(batch.generation_requests)
    spec_metadata.prepare()
    worker._refresh_ctx_block_tables(attn_metadata, len(ids))
    worker.save_step_state()
    # the target forward: its K/V, and the captured hidden states of the context tokens
    positions = []
    for req in batch.context_requests:
        start = req.context_current_position
        positions += list(range(start, start + req.context_chunk_size))
        write_kv(target, req.py_request_id, positions[-req.context_chunk_size:])
    hidden = torch.randn(len(positions), HIDDEN, generator=gen)
    spec_metadata.maybe_capture_hidden_states(1, hidden)
    accepted = {}
    for req in batch.generation_requests:  # verification: 0..K drafts accepted
        if req.is_dummy:
            continue
        n = req.max_beam_num_tokens
        write_kv(target, req.py_request_id, list(range(n - 1, n + len(req.py_draft_tokens))))
        accepted[req.py_request_id] = rng.randrange(len(req.py_draft_tokens) + 1)
    # the drafter: context chunks into its pool, then the accepted tokens, then the block decode's reads
    worker._store_prefill_context(drafter, spec_metadata, attn_metadata, torch.tensor(positions), len(positions))
    done = 0
    for req in batch.context_requests:
        n = req.context_chunk_size
        start = req.context_current_position
        tail = [p for p in range(start, start + n) if p >= start + n - WINDOW]  # what the window keeps
        assert torch.equal(read_back(req.py_request_id, tail), hidden[done + n - len(tail): done + n])
        done += n
    # dummies draft on the dummy slots, never on a real request's
    assert all(int(worker._batch_to_slot[i]) >= MAX_BATCH for i, r in enumerate(batch.all_requests()) if r.is_dummy)
    counts = {rid: a + 1 for rid, a in accepted.items()}
    gen_hidden = torch.randn(sum(counts.values()), HIDDEN, generator=gen)
    k, v = drafter.precompute_context_kv(gen_hidden, None)
    worker.store_accepted_kv(k, v, counts)
    check_block_decode_reads(batch)
    if warmup:  # a CUDA-graph warmup step changes nothing
        worker._ensure_spec_dec_state_restored(attn_metadata, spec_metadata)
        return
    if reject:  # e.g. a guided-decoding failure after the drafter ran: the slots go back, nothing advances
        before = worker._ctx_len.clone()
        worker._ensure_spec_dec_state_restored(attn_metadata, spec_metadata)
        assert not torch.equal(before, worker._ctx_len), "the rolled-back step had advanced the slots"
        for req in batch.all_requests():
            req.py_draft_tokens = []
        return
    worker.finish_step()
    for req in batch.context_requests:
        req.context_current_position += req.context_chunk_size
        if req.context_current_position >= req.prompt_len:
            req.tokens.append(rng.randrange(1000))
            req.state = LlmRequestState.GENERATION_IN_PROGRESS
    for req in batch.generation_requests:
        a = accepted[req.py_request_id]
        req.tokens += req.py_draft_tokens[:a] + [rng.randrange(1000)]
        req.py_draft_tokens = []
        if req.max_beam_num_tokens - req.prompt_len >= req.max_new_tokens:
            req.state = LlmRequestState.GENERATION_COMPLETE
    for manager in resource_managers:
        manager.update_context_resources(batch)
        manager.update_resources(batch)


def main() -> None:
    # CUDA-graph warmup: generation dummies in both pools at once, one step through them, then freed
    floor = CUDA_GRAPH_DUMMY_REQUEST_ID - K
    dummies = target.add_dummy_requests([floor, floor + 1], [64, 64], is_gen=True, max_num_draft_tokens=K,
                                        draft_kv_cache_manager=draft)
    assert dummies is not None, target.last_refusal
    run_step(ScheduledRequests(generation_requests=dummies), warmup=True)
    for manager in resource_managers:
        for dummy in dummies:
            manager.free_resources(dummy)

    live = [make_request(3, 9000), make_request(1, 3000), make_request(2, 700)]
    # a generation worker's request: its prompt was computed elsewhere
    disagg = make_request(4, 5000, state=LlmRequestState.DISAGG_GENERATION_INIT)
    disagg.context_current_position = disagg.prompt_len
    disagg.tokens.append(rng.randrange(1000))
    assert target.prepare_disagg_gen_init(disagg) and draft.prepare_disagg_gen_init(disagg)
    write_kv(target, 4, list(range(max(0, disagg.prompt_len + 1 - WINDOW), disagg.prompt_len)))
    disagg.state = LlmRequestState.GENERATION_IN_PROGRESS
    live.append(disagg)

    steps = 0
    rejected = False
    while live:
        batch = schedule(live)
        if batch.batch_size:
            reject = not rejected and bool(batch.generation_requests) and steps >= 3
            run_step(batch, reject=reject)
            rejected = rejected or reject
            if reject:  # the rejected step's room is given back and it runs again
                for req in batch.generation_requests:
                    target.revert_allocate_generation(req)
        steps += 1
        for req in [r for r in live if r.state == LlmRequestState.GENERATION_COMPLETE]:
            for manager in resource_managers:
                manager.free_resources(req)
            live.remove(req)
        assert steps < 500, "the loop made no progress"
    for manager in resource_managers:
        manager.check_accounting()
        assert manager.request_ids() == [] and all(p.num_free == p.total for p in manager.pools())
    # the run must show what it claims: a rollback, a suspension, a refused and a granted resume
    assert rejected and events["suspended"] and events["resume refused"] and events["resumed"], events
    print(f"{steps} steps, 4 requests and 2 warmup dummies served; one step rejected and rolled back; "
          f"under pool pressure: {events}; every pool is fully free")


if __name__ == "__main__":
    main()
