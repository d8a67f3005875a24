"""A small executor for library tests: a DFlash draft pool driven through the library's public calls only.

What an executor does for the drafter each step, and nothing else: warmup dummies from
`add_dummy_requests`, `prepare_resources` under the draft request context, the rows mapped
to slots by `DFlashSpecMetadata.prepare()` (through a bound `DFlashWorker`), each context
chunk stored where `advance_slot_for_context` says, each generation row committing the
tokens the test says it accepted (optimistic rows first commit every verified token and
roll back), the block written at the step's query positions and the context read through
the rebased rows, then `update_context_resources` / `update_resources`.

There is no model: every K/V written is a fresh number (`SlotLedger`), so a read that
lands on the wrong page, the wrong position or a value the slot did not store is seen.
Drafts are never judged; a generation row accepts what the test says (default: every
draft). Positions are absolute slot positions; tokens are `support.tokens`.
"""
from __future__ import annotations

from types import SimpleNamespace
from typing import Callable, Iterable, Mapping

import torch

from support import tokens
from tensorrt_llm_draftkv import (
    DFlashDecodingConfig,
    DFlashSpecMetadata,
    DFlashWorker,
    DraftKVCacheManagerV2,
    KVPoolConfig,
    LayerGroupConfig,
    LlmRequest,
    LlmRequestState,
    Mapping as ParallelMapping,
    ScheduledRequests,
    SpeculativeDecodingMode,
)
from tensorrt_llm_draftkv.manager.block_table import DeviceBlockTable
from tensorrt_llm_draftkv.request import ContextView, request_context
from tensorrt_llm_draftkv.speculative import DFlashDraftSlots, required_extra_kv_tokens

HEAD_DIM = 2
DUMMY_IDS = 1 << 40  # ids of the warmup dummies that join a step's rows

Accepted = Mapping[int, int] | Callable[[int], int] | None


class SlotLedger:
    """Every drafter access, checked: the page is the one the request's row holds at that ordinal
    (and no other live request holds it), and a read returns the last value its slot stored.

    Values stored in the current slot epoch are forgotten when the request loses its slot
    (a reseed starts empty); a joint pool's reused prefix survives evictions, not a free.
    """

    def __init__(self, dm: DraftKVCacheManagerV2, meta: DFlashDraftSlots, arena: bool) -> None:
        self.dm, self.meta, self.arena = dm, meta, arena
        self.stored: dict[tuple[int, int], dict[int, tuple[float, str]]] = {}  # (rid, group) -> pos -> value, kind
        self.foreign: list[str] = []  # accesses through entries the request does not own
        self.stale: list[str] = []  # reads of values its slot did not store
        self.read_log: list[tuple[int, list[int], list[float]]] = []  # (rid, positions, values) per read
        self.reads = self.writes = 0
        self._next = 1.0
        meta.slots.add_release_listener(self.on_release)

    def fresh_values(self, n: int) -> torch.Tensor:
        """`n` values never written before (exact in float32 up to 2**24)."""
        values = torch.arange(self._next, self._next + n, dtype=torch.float32)
        self._next += n
        return values

    def on_release(self, rid: int, reason: str) -> None:
        """The request lost its slot (`SlotTable`'s release listener): a new epoch starts."""
        for (r, g), by_pos in self.stored.items():
            if r == rid:
                keep_reused = reason not in ("free", "departed")
                self.stored[(r, g)] = {p: v for p, v in by_pos.items() if keep_reused and v[1] == "reused"}

    def _owner_page(self, rid: int, group: int, ordinal: int) -> int:
        """The page the request owns at a block ordinal (-1: none): its mirror's row, or its arena slot's pages."""
        if self.arena:
            return self.meta.slots.slot_of(rid) * self.meta.arena_pages_per_slot + ordinal
        row = self.dm.get_cache(rid).block_row(group)
        return row[ordinal] if 0 <= ordinal < len(row) else -1

    def _others_hold(self, rid: int, group: int) -> set[int]:
        if self.arena:
            return set()
        return {p for r in self.dm.request_ids() if r != rid for p in self.dm.get_cache(r).held_pages(group)}

    def check_owned(self, what: str, rid: int, group: int, ordinals: list[int], pages: list[int]) -> list[bool]:
        """Which accesses are owned; each one that is not is noted in `foreign`."""
        others = self._others_hold(rid, group)
        owned = []
        for ordinal, page in zip(ordinals, pages):
            want = self._owner_page(rid, group, ordinal)
            ok = page >= 0 and page == want and page not in others
            if not ok:
                self.foreign.append(f"request {rid} group {group}: {what} through ordinal {ordinal} -> page {page} "
                                    f"(its row has {want} there)")
            owned.append(ok)
        return owned

    def record_write(self, rid: int, group: int, positions: list[int], ordinals: list[int], pages: list[int],
                     values: torch.Tensor, kind: str) -> None:
        """`values[i]` went to slot position `positions[i]` through `pages[i]`; `kind` says which write it was."""
        self.writes += len(positions)
        self.check_owned("write", rid, group, ordinals, pages)
        by_pos = self.stored.setdefault((rid, group), {})
        for pos, page, value in zip(positions, pages, values.tolist()):
            if page >= 0:
                by_pos[pos] = (value, kind)

    def record_read(self, rid: int, group: int, positions: list[int], ordinals: list[int], pages: list[int],
                    values: list[float]) -> None:
        """`values[i]` came back from slot position `positions[i]` through `pages[i]`."""
        self.reads += len(positions)
        self.read_log.append((rid, positions, values))
        owned = self.check_owned("read", rid, group, ordinals, pages)
        by_pos = self.stored.get((rid, group), {})
        for pos, ok, value in zip(positions, owned, values):
            if ok and by_pos.get(pos, (None,))[0] != value:
                self.stale.append(f"request {rid} group {group}: read {value} at slot position {pos}, "
                                  f"its slot stored {by_pos.get(pos, ('nothing',))[0]}")

    def kind_at(self, rid: int, group: int, pos: int) -> str | None:
        """Which write last stored slot position `pos` (context, generation, trial, block, reused), or None."""
        return self.stored.get((rid, group), {}).get(pos, (None, None))[1]

    def assert_clean(self) -> None:
        assert not self.foreign, self.foreign[:3]
        assert not self.stale, self.stale[:3]


def pool_config(windows: tuple, pages: int, tokens_per_block: int, num_layers: int, **geometry) -> KVPoolConfig:
    """One layer group per window: all layers but one per other window in the first group."""
    rest = len(windows) - 1
    layers = (num_layers - rest, *([1] * rest))
    return KVPoolConfig(
        layer_groups=tuple(LayerGroupConfig(n, window=w) for n, w in zip(layers, windows)),
        pages_per_group=(pages,) * len(windows), tokens_per_block=tokens_per_block, num_kv_heads=1,
        head_dim=HEAD_DIM, **geometry,
    )


def bind_worker(meta: DFlashDraftSlots, dm: DraftKVCacheManagerV2 | None) -> DFlashWorker:
    """A DFlash worker over the slots, storing into the draft pool (or a private arena without `dm`)."""
    worker = DFlashWorker(DFlashDecodingConfig(max_draft_len=meta.block_size - 1), ParallelMapping(), True)
    shape = SimpleNamespace(_num_attn_layers=meta.block_size - 1, _num_kv_heads=1, _head_dim=HEAD_DIM,
                            _kv_factor=2, dtype=torch.float32)
    worker.bind_draft_slots(meta, dm, draft_model=shape)
    return worker


class DraftExecutor:
    """A draft manager, its DFlash slots and worker, and the requests a test drives through them."""

    def __init__(self, dm: DraftKVCacheManagerV2, meta: DFlashDraftSlots, *, private_arena: bool = False) -> None:
        self.dm, self.meta = dm, meta
        self.worker = bind_worker(meta, None if private_arena else dm)
        self.spec_metadata = DFlashSpecMetadata(max_num_requests=meta.num_slots, max_draft_len=meta.block_size - 1,
                                                max_total_draft_tokens=meta.block_size - 1, device=meta.device)
        self.spec_metadata.attach_worker(self.worker)
        self.ledger = SlotLedger(dm, meta, private_arena)
        P, layer = meta.tokens_per_block, 0
        #: per draft layer group (one for a private arena): (pool group, its layers, its window)
        self.groups: list[tuple[int, list[int], int | None]] = []
        for g, group in enumerate([] if private_arena else dm.config.layer_groups):
            self.groups.append((g, list(range(layer, layer + group.num_layers)), group.window))
            layer += group.num_layers
        if private_arena:
            self.groups.append((0, list(range(meta.block_size - 1)), None))
        self.requests: dict[int, LlmRequest] = {}
        self._next_dummy = DUMMY_IDS
        self._tokens_per_block = P

    @classmethod
    def build(cls, *, windows: tuple = (None,), pages: int = 256, tokens_per_block: int = 16, block_size: int = 4,
              max_seq_len: int = 4096, max_batch_size: int = 8, joint_kv_cache_reuse: bool = False,
              trail_page: bool = True, guard_page: bool = False, backend: str = "cpp", fused: bool = False,
              private_arena: bool = False, pushed_table: bool = False) -> "DraftExecutor":
        """A DFlash draft manager of `block_size - 1` layers (one group per window) and `max_batch_size` slots.
        `pushed_table`: the manager's block table keeps its own copy that each sync pushes to, as on a GPU,
        and the worker reads that copy (`DeviceBlockTable(cpu_copy=True)`)."""
        config = pool_config(windows, pages, tokens_per_block, block_size - 1, guard_page=guard_page,
                             max_seq_len=max_seq_len)
        dm = DraftKVCacheManagerV2.from_pool_config(
            config, spec_mode=SpeculativeDecodingMode.DFLASH, max_draft_len=block_size - 1,
            num_extra_kv_tokens=required_extra_kv_tokens(block_size), joint_kv_cache_reuse=joint_kv_cache_reuse,
            trail_page=trail_page,
        )
        if pushed_table:
            dm._block_table = DeviceBlockTable(dm.num_pools, dm.config.device, cpu_copy=True)
        meta = DFlashDraftSlots(max_batch_size, block_size=block_size, tokens_per_block=tokens_per_block,
                                max_ctx_len=max_seq_len, fused=fused, backend=backend)
        return cls(dm, meta, private_arena=private_arena)

    # ------------------------------------------------------------------ requests
    def add_context_request(self, rid: int, prompt_len: int, *, chunk: int | None = None,
                            start: int = 0) -> LlmRequest:
        """A prefill request; `start > 0`: a prefix this worker did not compute (e.g. a reuse hit)."""
        req = LlmRequest(rid, prompt_len, tokens=tokens(prompt_len, rid))
        req.target_view = ContextView(start, prompt_len - start if chunk is None else min(chunk, prompt_len - start))
        self.requests[rid] = req
        return req

    def add_disagg_request(self, rid: int, prompt_len: int) -> LlmRequest:
        """A generation worker's request: prompt and first token arrive, the mirror is gen-init sized."""
        req = LlmRequest(rid, prompt_len, tokens=tokens(prompt_len + 1, rid),
                         state=LlmRequestState.DISAGG_GENERATION_INIT)
        if not self.dm.prepare_disagg_gen_init(req):
            raise self.dm.last_refusal
        req.state = LlmRequestState.GENERATION_IN_PROGRESS
        self.requests[rid] = req
        return req

    def finish(self, rid: int) -> None:
        """The request completes: its mirror and its slot are freed."""
        req = self.requests.pop(rid)
        if self.dm.has_cache(rid):
            self.dm.free_resources(req)
        self.meta.free(rid, missing_ok=True)
        self.ledger.on_release(rid, "free")

    def evict(self, rid: int) -> None:
        """Take the request's slot away; its next row is seeded afresh."""
        self.meta.evict(rid)

    # ------------------------------------------------------------------ one step
    def step(self, rids: Iterable[int] | None = None, *, chunks: Mapping[int, int] | None = None,
             accepted: Accepted = None, optimistic: Iterable[int] = (), dummies: int = 0,
             dummy_tokens: int = 1) -> dict[int, int]:
        """One executor step over `rids` (default: every live request); returns drafts accepted per generation row.

        `chunks`: each context request's next chunk size (default: the rest of its prompt).
        `accepted`: drafts a generation row accepts (a mapping or a function of the request
        id, capped at its drafts; default: all). `optimistic`: generation rows that first commit
        every verified token, then roll back to the accepted ones. `dummies`: warmup dummies of
        `dummy_tokens` tokens join the draft rows for this step.
        """
        reqs = [self.requests[r] for r in (self.requests if rids is None else rids)]
        batch = ScheduledRequests(context_requests=[r for r in reqs if r.is_context_init_state],
                                  generation_requests=[r for r in reqs if r.is_generation_in_progress_state])
        made = self._dummies(dummies, dummy_tokens)
        try:
            sized = ScheduledRequests(list(batch.context_requests), [*batch.generation_requests, *made])
            self.prepare(sized)
            for req in batch.context_requests:
                self._context_chunk(req, (chunks or {}).get(req.py_request_id))
            counts, trial = self._verify(batch.generation_requests, accepted, set(optimistic))
            self.commit(counts, trial)
            self.propose()
            with request_context(True, batch):
                self.dm.update_context_resources(batch)
                self.dm.update_resources(batch)
        finally:
            for dummy in made:
                self.dm.free_resources(dummy)
                self.meta.free(dummy.py_request_id, missing_ok=True)
        return {rid: n - 1 for rid, n in counts.items()}

    def _dummies(self, count: int, token_num: int) -> list[LlmRequest]:
        if not count:
            return []
        ids = list(range(self._next_dummy, self._next_dummy + count))
        self._next_dummy += count
        made = self.dm.add_dummy_requests(ids, [token_num] * count, is_gen=True,
                                          max_num_draft_tokens=self.meta.block_size - 1, history_hint=token_num - 1)
        if made is None:
            raise self.dm.last_refusal
        return made

    def prepare(self, batch: ScheduledRequests) -> None:
        """Size every mirror, then map the rows to slots as upstream's metadata does."""
        with request_context(True, batch):
            self.dm.prepare_resources(batch)
        md = self.spec_metadata
        md.request_ids = [r.py_request_id for r in batch.all_requests()]
        md.num_generations = len(batch.generation_requests)
        md.scheduled_requests = batch
        md.prepare()

    def _context_chunk(self, req: LlmRequest, next_chunk: int | None) -> None:
        """Store the chunk's K/V; the prompt's last chunk yields the first output token."""
        view = req.target_view
        start, end = view.position, view.position + view.chunk_size
        if self.dm.joint_kv_cache_reuse:
            self.write_reused_prefix(req.py_request_id)
        self.store_context(req, range(start, end))
        req.advance_context_chunk(next_chunk)
        if end >= req.prompt_len:
            req.tokens.append(tokens(end + 1, req.py_request_id)[end])
            req.state = LlmRequestState.GENERATION_IN_PROGRESS

    def _verify(self, reqs: list[LlmRequest], accepted: Accepted,
                optimistic: set[int]) -> tuple[dict[int, int], dict[int, int]]:
        """Tokens each generation row commits (accepted drafts + bonus), and the optimistic rows' verified ones."""
        counts, trial = {}, {}
        for req in reqs:
            rid, drafts = req.py_request_id, len(req.py_draft_tokens)
            want = drafts if accepted is None else accepted(rid) if callable(accepted) else accepted.get(rid, drafts)
            counts[rid] = min(want, drafts) + 1
            if rid in optimistic:
                trial[rid] = drafts + 1
            n = req.max_beam_num_tokens
            req.tokens.extend(tokens(n + counts[rid], rid)[n:])
        return counts, trial

    # ------------------------------------------------------------------ drafter K/V
    def _write(self, rid: int, gi: int, positions: list[int], pages: list[int], offsets: list[int],
               kind: str) -> None:
        """Fresh values at (pages, offsets) in every layer of draft group `gi`; negative offsets are skipped."""
        keep = [i for i, o in enumerate(offsets) if o >= 0]
        positions, pages, offsets = [positions[i] for i in keep], [pages[i] for i in keep], [offsets[i] for i in keep]
        group, layers, _ = self.groups[gi]
        values = self.ledger.fresh_values(len(positions))
        P = self._tokens_per_block
        self.ledger.record_write(rid, group, positions, [p // P for p in positions], pages, values, kind)
        backed = [i for i, p in enumerate(pages) if p >= 0]
        if not backed:
            return
        kv = values[backed, None, None, None, None].expand(len(backed), len(layers), 2, 1, HEAD_DIM)
        self.worker.store_kv_at_pages(layers, torch.tensor([pages[i] for i in backed], dtype=torch.int64),
                                      torch.tensor([offsets[i] for i in backed], dtype=torch.int64), kv.contiguous())

    def _value_at(self, layers: list[int], page: int, offset: int) -> float:
        """The value every layer holds at (page, offset); NaN for an unbacked page or layers that disagree."""
        if page < 0:
            return float("nan")
        seen = {float(self.worker._ctx_kv_buf[layer][page, :, :, offset, :].mean()) for layer in layers}
        return seen.pop() if len(seen) == 1 else float("nan")

    def _read(self, rid: int, gi: int, positions: list[int], ordinals: list[int], pages: list[int]) -> None:
        """Read the values at `positions` through `pages` (every layer of the group) and check them."""
        group, layers, _ = self.groups[gi]
        P = self._tokens_per_block
        values = [self._value_at(layers, page, pos % P) for pos, page in zip(positions, pages)]
        self.ledger.record_read(rid, group, positions, ordinals, pages, values)

    def store_context(self, req: LlmRequest, positions: Iterable[int]) -> None:
        """A context chunk's K/V, at the slot positions and pages `advance_slot_for_context` plans."""
        plan = self.meta.advance_slot_for_context(req, list(positions))
        pos, offsets = plan.positions.tolist(), plan.offsets.tolist()
        for gi, (group, _, _) in enumerate(self.groups):
            self._write(req.py_request_id, gi, pos, plan.pages[group].tolist(), offsets, "context")

    def write_reused_prefix(self, rid: int) -> None:
        """A joint pool's slot placed past 0 over base 0 reads the prefix `[0, L)` from the pool: put there
        what an earlier request sharing the prefix would have left, on the ordinals the mirror backs."""
        seed = self.meta.seeds.get(rid)
        if seed is None or seed.base_pages != 0 or seed.ctx_len == 0:
            return
        P = self._tokens_per_block
        for gi, (group, _, _) in enumerate(self.groups):
            row = self.dm.get_cache(rid).block_row(group)
            pos = [p for p in range(seed.ctx_len) if p // P < len(row) and row[p // P] >= 0]
            self._write(rid, gi, pos, [row[p // P] for p in pos], [p % P for p in pos], "reused")

    def commit(self, counts: Mapping[int, int], trial: Mapping[int, int] | None = None) -> None:
        """Advance the generation rows by `counts` tokens and store them; `trial` rows first commit
        their verified tokens in one trial commit of the batch, rolled back before the real one."""
        if trial:
            snap = self.meta.slots.snapshot()
            self._commit({**counts, **trial}, "trial")
            self.meta.rollback(snap)
        self._commit(counts, "generation")

    def _commit(self, counts: Mapping[int, int], kind: str) -> None:
        old = {rid: self.meta.slots.slot_state(rid)[0] for rid in counts}
        preps = self.worker._advance_ctx_len(dict(counts))
        self.worker.finish_step()
        for rid, n in counts.items():
            row, positions = self.meta.row_index(rid), list(range(old[rid], old[rid] + n))
            for gi, (group, _, _) in enumerate(self.groups):
                pages = preps[group].store_pages[row, :n].tolist()
                self._write(rid, gi, positions, pages, preps[group].store_offsets[row, :n].tolist(), kind)

    def propose(self) -> None:
        """Each proposing row writes its block at the query positions and reads its context and block."""
        P, bs = self._tokens_per_block, self.meta.block_size
        preps = self.worker.generation_prep()
        self.check_read_rows(preps)
        for i, row in enumerate(self.meta.rows):
            if not row.proposing:
                continue
            for gi, (group, _, window) in enumerate(self.groups):
                prep, table = preps[group], self.meta.tables[group].tables[i].tolist()
                q = prep.query_pos[i].tolist()
                q_pages = [table[p // P] if p // P < len(table) else -1 for p in q]
                self._write(row.request_id, gi, q, q_pages, [p % P for p in q], "block")
                rl, shift = int(prep.read_lens[i]), int(prep.shift[i])
                t0 = 0 if window is None else max(0, rl + bs - window)
                rebased = prep.read_rows[i].tolist()
                ctx = range(t0, rl)
                self._read(row.request_id, gi, [t + shift * P for t in ctx], [t // P + shift for t in ctx],
                           [rebased[t // P] for t in ctx])
                self._read(row.request_id, gi, q, [p // P for p in q], q_pages)
            if row.request.is_generation_in_progress_state:
                row.request.py_draft_tokens = [0] * (bs - 1)

    def check_read_rows(self, preps) -> None:
        """Window-bounded read rows (the default) hold only the row's own pages: every entry that is not -1,
        in every column and every row of the step (dummies and rows that do not propose included)."""
        if self.meta.read_bound != "window" or self.ledger.arena:
            return
        for i, row in enumerate(self.meta.rows):
            for gi, (group, _, window) in enumerate(self.groups):
                if window is None:
                    continue
                entries, shift = preps[group].read_rows[i].tolist(), int(preps[group].shift[i])
                live = [j for j, page in enumerate(entries) if page != -1]
                self.ledger.check_owned("read-row entry", row.request_id, group, [shift + j for j in live],
                                        [entries[j] for j in live])
