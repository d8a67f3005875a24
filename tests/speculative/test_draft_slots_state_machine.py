"""A hypothesis state machine over the draft manager and the DFlash slots together, driven by the
test executor (tests/executor_fixture.py).

Rules: chunked prefill (from position 0, or a tail after a prefix this worker
did not compute), disaggregated generation init, generation steps with random
acceptance, rejected optimistic commits rolled back, warmup dummies, slot
eviction and reseed, completion, and the explicit errors. After every step the
four invariants of docs/design.md hold:

1. every entry the drafter read or wrote is a page its own request holds;
2. every slot read exactly what it stored;
3. pages held + pages free = pool size, and a finished request returns all its pages;
4. errors are explicit and leave state as it was.
"""
from __future__ import annotations

import random

import pytest
from hypothesis import HealthCheck, settings, strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from tensorrt_llm_draftkv import ScheduledRequests
from tensorrt_llm_draftkv.speculative import NoFreeSlotError
from executor_fixture import DraftExecutor

P = 16
BS = 4
MAX_BATCH = 3


def meta_state(meta):
    return (
        meta.slots.live_requests(),
        meta.slots.free_slots,
        meta.slots.ctx_len_host,
        meta.slots.base_pages_host,
        meta.slots.ctx_len.tolist(),
        meta.slots.base_pages.tolist(),
    )


class DraftKVMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.loop: DraftExecutor | None = None
        self.next_id = 1
        self.chunks: dict[int, int] = {}
        self.lengths: dict[int, int] = {}  # tokens a request reaches before it finishes
        self.errors_checked = False

    @initialize(
        windows=st.sampled_from([(None,), (48,), (None, 40), (12,)]),
        joint=st.booleans(),
        trail=st.booleans(),
        backend=st.sampled_from(["cpp", "python"]),
        guard=st.booleans(),
        pushed=st.booleans(),
    )
    def setup(self, windows, joint, trail, backend, guard, pushed):
        self.loop = DraftExecutor.build(
            windows=windows,
            tokens_per_block=P,
            pages=400,
            block_size=BS,
            max_seq_len=2048,
            max_batch_size=MAX_BATCH,
            joint_kv_cache_reuse=joint,
            trail_page=trail,
            backend=backend,
            guard_page=guard,
            pushed_table=pushed,
        )
        self.totals = [g.pool.total for g in self.loop.dm.layer_groups]

    # ------------------------------------------------------------------ helpers
    def _new_id(self) -> int:
        self.next_id += 1
        return self.next_id

    @property
    def live(self) -> list[int]:
        return sorted(self.loop.requests)

    def _generating(self) -> list[int]:
        return [r for r in self.live if self.loop.requests[r].is_generation_in_progress_state]

    # ------------------------------------------------------------------ rules
    @precondition(lambda self: self.loop is not None and len(self.loop.requests) < 5)
    @rule(prompt=st.integers(2, 400), chunk=st.integers(8, 160), prefix_pages=st.integers(0, 6))
    def add_context_request(self, prompt, chunk, prefix_pages):
        start = min(prefix_pages * P, prompt - 1) if prefix_pages else 0
        rid = self._new_id()
        self.loop.add_context_request(rid, prompt, chunk=chunk, start=start)
        self.chunks[rid] = chunk
        self.lengths[rid] = prompt + 200

    @precondition(lambda self: self.loop is not None and len(self.loop.requests) < 5)
    @rule(prompt=st.integers(1, 1500))
    def disagg_init(self, prompt):
        rid = self._new_id()
        self.loop.add_disagg_request(rid, prompt)
        self.lengths[rid] = prompt + 200

    @precondition(lambda self: self.loop is not None and self.loop.requests)
    @rule(pick=st.integers(0, 2**16), optimistic=st.booleans())
    def step(self, pick, optimistic):
        self._step(pick, 0, 1, optimistic)

    @precondition(lambda self: self.loop is not None and self.loop.requests)
    @rule(pick=st.integers(0, 2**16))
    def step_plain(self, pick):
        self._step(pick, 0, 1, False)

    @precondition(lambda self: self.loop is not None and self.loop.requests)
    @rule(pick=st.integers(0, 2**16), dummies=st.integers(1, 2), dummy_tokens=st.integers(1, 40))
    def step_with_dummies(self, pick, dummies, dummy_tokens):
        self._step(pick, dummies, dummy_tokens, True)

    def _step(self, pick, dummies, dummy_tokens, optimistic):
        loop, rng = self.loop, random.Random(pick)
        live = self.live
        chosen = sorted(rng.sample(live, min(len(live), rng.randint(1, MAX_BATCH))))
        # the executor evicts slots of requests it does not schedule when slots run out
        need = sum(1 for r in chosen if not loop.meta.slots.has_slot(r))
        holders = [r for r in loop.meta.slots.live_requests() if r not in chosen]
        while len(loop.meta.slots.free_slots) < need and holders:
            loop.evict(holders.pop(0))
        caps = {r: rng.randrange(BS) for r in chosen}
        opt = [r for r in chosen if optimistic and rng.random() < 0.5]
        loop.step(
            chosen,
            chunks={r: self.chunks.get(r, 64) for r in chosen},
            accepted=caps,
            optimistic=opt,
            dummies=dummies,
            dummy_tokens=dummy_tokens,
        )
        # completion: a request near its length finishes
        for r in chosen:
            req = loop.requests[r]
            if req.is_generation_in_progress_state and self.lengths[r] - len(req.tokens) <= BS + 1:
                self._finish(r)

    def _finish(self, rid):
        loop = self.loop
        held = [loop.dm.get_cache(rid).num_held_pages(g) for g in range(loop.dm.num_pools)]
        free_before = loop.dm.free_pages()
        loop.finish(rid)
        assert [a + h for a, h in zip(free_before, held)] == list(loop.dm.free_pages())
        assert not loop.meta.slots.has_slot(rid) and not loop.dm.has_cache(rid)

    @precondition(lambda self: self.loop is not None and any(
        self.loop.requests[r].is_generation_in_progress_state for r in self.loop.requests))
    @rule(pick=st.integers(0, 100))
    def finish(self, pick):
        gen = self._generating()
        self._finish(gen[pick % len(gen)])

    @precondition(lambda self: self.loop is not None and self.loop.meta.slots.live_requests())
    @rule(pick=st.integers(0, 100))
    def evict(self, pick):
        holders = sorted(self.loop.meta.slots.live_requests())
        self.loop.evict(holders[pick % len(holders)])

    @precondition(lambda self: self.loop is not None and not self.errors_checked and self.loop.requests)
    @rule()
    def explicit_errors_change_nothing(self):
        self.errors_checked = True
        loop = self.loop
        before = meta_state(loop.meta)
        dm_before = {rid: loop.dm.get_cache(rid).checkpoint() for rid in loop.dm.request_ids()}
        with pytest.raises(KeyError, match="request 999999"):
            loop.meta.evict(999999)
        with pytest.raises(KeyError, match="request 999999"):
            loop.meta.free(999999)
        # more new requests than free slots: NoFreeSlotError, nothing changes
        extra = []
        for _ in range(len(loop.meta.slots.free_slots) + 1):
            rid = self._new_id()
            extra.append(loop.add_context_request(rid, 40))
        batch = ScheduledRequests(context_requests=extra)
        loop.dm.prepare_resources(batch)
        before_with_mirrors = meta_state(loop.meta)
        with pytest.raises(NoFreeSlotError, match=f"{len(extra)} needed, {len(loop.meta.slots.free_slots)} free"):
            loop.meta.prepare_step(batch, loop.dm)
        assert meta_state(loop.meta) == before_with_mirrors == before
        for req in extra:
            loop.dm.free_resources(req)
            loop.requests.pop(req.py_request_id)
        assert {rid: loop.dm.get_cache(rid).checkpoint() for rid in loop.dm.request_ids()} == dm_before

    # ------------------------------------------------------------------ invariants
    @invariant()
    def ownership(self):  # invariants 1 and 2
        if self.loop is None:
            return
        ledger = self.loop.ledger
        assert not ledger.foreign, ledger.foreign[:3]
        assert not ledger.stale, ledger.stale[:3]

    @invariant()
    def accounting(self):  # invariant 3
        if self.loop is None:
            return
        dm = self.loop.dm
        dm.check_accounting()
        for g, total in zip(dm.layer_groups, self.totals):
            held = sum(dm.get_cache(r).num_held_pages(dm.layer_groups.index(g)) for r in dm.request_ids())
            assert held + g.pool.num_free == total
        if not dm.request_ids():
            assert list(dm.free_pages()) == self.totals

    @invariant()
    def slots(self):  # slot bookkeeping and host mirrors
        if self.loop is None:
            return
        meta = self.loop.meta
        meta.slots.check_host_mirror()
        live = meta.slots.live_requests()
        assert len(live) + len(meta.slots.free_slots) == MAX_BATCH
        assert sorted(live.values()) == sorted(set(live.values()))
        assert set(live) <= set(self.loop.requests)
        for rid, slot in live.items():
            L, b = meta.slots.ctx_len_host[slot], meta.slots.base_pages_host[slot]
            assert 0 <= L <= meta.slots.max_ctx_len and b >= 0
            assert L >= b * P or L > (b - 1) * P  # page-aligned, or position-aligned with the base rounded up


DraftKVMachine.TestCase.settings = settings(
    max_examples=40,
    stateful_step_count=20,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large, HealthCheck.filter_too_much],
)


TestDraftKVMachine = DraftKVMachine.TestCase
