"""The disaggregated pair on both transfer agents: same figures, same bytes, and each fault costs one request.

Two-process runs use NIXL over UCX on loopback (skipped, naming the import error, only when NIXL cannot be
imported) and the torch.distributed wire. The generation worker's failure handling is also driven in this
process with a fake agent, so it is tested without NIXL too.
"""
from __future__ import annotations

import dataclasses
from dataclasses import replace
from functools import partial

import numpy as np
import pytest
import torch

from draftkv_sim import RunSpec
from draftkv_sim.disagg import run_disaggregated
from draftkv_sim.disagg_link import PageLink, admit_next, send_facts
from draftkv_sim.disagg_pages import ContextFacts, PageHandshake, check_handshake, pack_aux, rank_memory
from draftkv_sim.disagg_wire import Offer, Transfer, clipped_ranges
from draftkv_sim.run_build import build_rank, run_prompts, target_only_outputs, warmup_tokens
from draftkv_sim.scenario import prompt_seeds
from draftkv_sim.simulate import run_one
from tensorrt_llm_draftkv.manager.rules import MirrorSizing
from tensorrt_llm_draftkv.speculative.handoff import HandoffForm
from tensorrt_llm_draftkv.transfer import PeerGone, TransferError, TransferTimeout, nixl_unavailable, use_loopback

from sim_pkg.sim_support import SMALL, faulty_transfer_rank, random_pools_rank

pytestmark = pytest.mark.usefixtures("reference_kernels")
use_loopback()  # UCX_NET_DEVICES=lo and a tcp-including UCX_TLS, inherited by the spawned ranks
NIXL_MISSING = nixl_unavailable()
needs_nixl = pytest.mark.skipif(NIXL_MISSING is not None, reason=f"NIXL transport tests skipped: {NIXL_MISSING}")
TRANSPORTS = [pytest.param("nixl", marks=needs_nixl), "torch"]
HISTORY = MirrorSizing.HISTORY

# Runs that exercise every part of the handshake: drafter window pages (kv), the auxiliary slot's hidden
# states, prefix hits on both workers with joint reuse, and the legacy sizing (no drafter context).
RUNS = [
    (SMALL, RunSpec("kv", "disaggregated", (600, 900, 700), 2), HISTORY),
    (replace(SMALL, handoff_form=HandoffForm.HIDDEN), RunSpec("hidden", "disaggregated", (600, 1100), 2), HISTORY),
    (replace(SMALL, block_reuse="joint"),
     RunSpec("joint", "disaggregated", (300, 500, 400), 2, shared_prefix=1024), HISTORY),
    (SMALL, RunSpec("legacy", "disaggregated", (600, 900), 2), MirrorSizing.LEGACY),
]


def _figures(stats) -> dict:
    """Every figure of a run except its timing and the transport's own name and byte counts."""
    out = dataclasses.asdict(stats)
    for key in ("wall_s", "transport", "context_worker"):
        out.pop(key)
    return out


@needs_nixl
@pytest.mark.parametrize("setup, spec, sizing", RUNS, ids=[spec.name for _, spec, _ in RUNS])
def test_every_figure_of_a_disaggregated_run_is_the_same_under_both_transports(setup, spec, sizing):
    nixl, _ = run_one(replace(setup, transport="nixl"), spec, sizing)
    wire, _ = run_one(replace(setup, transport="torch"), spec, sizing)
    assert (nixl.transport, wire.transport) == ("nixl", "torch")
    assert nixl.finished == len(spec.prompts) or sizing is MirrorSizing.LEGACY
    assert nixl.handoff_bytes_sent > 0 and nixl.context_worker.transfer_bytes > 0
    assert _figures(nixl) == _figures(wire)
    assert _figures(nixl.context_worker) == _figures(wire.context_worker)


def _random_pool_run(transport: str, prompts: tuple[int, ...]):
    setup = replace(SMALL, transport=transport)
    spec = RunSpec("bytes", "disaggregated", prompts, 2)
    build = partial(random_pools_rank, setup=setup, sizing=HISTORY, max_concurrency=2, slots=setup.drafter_slots,
                    warmup=warmup_tokens(setup, spec.prompt_lengths))
    return run_disaggregated(build, run_prompts(setup, spec), transport=transport)


@needs_nixl
def test_the_same_requests_leave_the_generation_workers_pools_byte_for_byte_equal():
    prompts = (600, 900, 700)
    nixl, wire = _random_pool_run("nixl", prompts), _random_pool_run("torch", prompts)
    assert nixl.finished == wire.finished == len(prompts)
    assert sorted(nixl.pool_digests) == list(range(len(prompts)))
    assert nixl.pool_digests == wire.pool_digests  # after each request landed, every pool's bytes
    assert len(set(nixl.pool_digests.values())) == len(prompts)  # each transfer changed the pools


@pytest.mark.parametrize("transport", TRANSPORTS)
@pytest.mark.parametrize("fault", ["drop_sync", "bad_desc"])
def test_a_failed_transfer_costs_its_request_only_and_leaks_nothing(transport, fault):
    setup = replace(SMALL, transport=transport)
    spec = RunSpec("fault", "disaggregated", (600, 900, 700), 2)
    build = partial(faulty_transfer_rank, fault=fault, request_id=1, timeout_s=3.0, setup=setup, sizing=HISTORY,
                    max_concurrency=2, slots=setup.drafter_slots, warmup=warmup_tokens(setup, spec.prompt_lengths))
    stats = run_disaggregated(build, run_prompts(setup, spec), transport=transport)
    assert list(stats.transfer_failures) == [1], stats.first_error
    assert "request 1" in stats.transfer_failures[1]
    assert stats.finished == 2 and sorted(stats.outputs) == [0, 2]
    assert stats.pages_held_by_both == 0  # both workers' pools fully free at the end
    keys = list(zip(prompt_seeds(spec.prompts), spec.prompts))
    ref = target_only_outputs(SMALL, keys)
    assert all(ref[keys[rid]] == out for rid, out in stats.outputs.items())


# -- the generation worker's failure paths, in this process ------------------------------------------------
class _Channel:
    """The control channel as the generation worker reads it: scripted offers and facts, replies kept."""

    def __init__(self, items) -> None:
        self.script: list = []
        for item in items:
            self.script.append(Offer(item.request_id, item.prompt_len, item.tokens))
            facts = _Recorder()
            send_facts(facts, ContextFacts(item.reused_tokens, item.drafter_lo, item.drafter_geometry))
            self.script.append(facts.sent)
        self.script.append(None)
        self.replies: list = []

    def recv_offer(self):
        return self.script.pop(0)

    def recv_array(self):
        return self.script.pop(0)

    def send_array(self, values) -> None:
        self.replies.append(np.asarray(values))


class _Recorder:
    def send_array(self, values) -> None:
        self.sent = list(values)


class _Agent:
    """Lands each request as the context worker's transfer would (its tensors written onto the pages the
    handshake named), or raises the fault set for it."""

    def __init__(self, items, faults) -> None:
        self.items = {item.request_id: item for item in items}
        self.faults = faults
        self.gen = self.link = None

    def wait_sync_message(self, message: bytes, timeout_s: float) -> None:
        rid = int(message.split()[-1])
        if rid in self.faults:
            raise self.faults[rid]
        item, gen = self.items[rid], self.gen
        for g, (lo, k, v) in enumerate(zip(item.group_lo, item.keys, item.values)):
            gen.target_model.write_kv_values(rid, lo, k, v, groups=[g])
        for gi, ((lo, _), kv) in enumerate(zip(clipped_ranges(item.drafter_geometry, item.prompt_len),
                                               item.drafter_payload)):
            gen.speculator.drafter.write_received(rid, gi, lo, kv)
        aux = pack_aux(item, None)
        self.link.aux[0, : aux.numel()] = aux


@pytest.mark.parametrize("error", [TransferTimeout("request 1: not done after 3 s"),
                                   TransferError("request 1: the engine reports the transfer failed"),
                                   PeerGone("request 1: connection closed")], ids=lambda e: type(e).__name__)
def test_the_generation_worker_releases_a_failed_request_and_serves_the_others(error):
    from sim_pkg.test_handoff import context_transfers

    prompts = (600, 900, 700)
    items, _ = context_transfers(SMALL, prompts)
    gen = build_rank(1, SMALL, HISTORY, 2, SMALL.drafter_slots, max(prompts) + SMALL.max_new_tokens)
    agent = _Agent(items, {1: error})
    aux = torch.zeros(1, 4096, dtype=torch.uint8)
    memory = rank_memory(gen, aux)
    link = PageLink(agent, _Channel(items), memory, memory, aux, "rank0", timeout_s=3.0)
    agent.gen, agent.link = gen, link
    pending, dead = True, False
    while pending or gen.scheduler.has_work():
        while pending and len(gen.scheduler.active) < 2:
            pending, dead = admit_next(link, gen, dead)
        if gen.scheduler.has_work():
            gen.run_steps(1)
    stats = gen.finish()
    assert list(stats.transfer_failures) == [1] and str(error) in stats.transfer_failures[1]
    served = [0] if isinstance(error, PeerGone) else [0, 2]  # a peer that is gone sends no more offers
    assert sorted(stats.outputs) == served and stats.finished == len(served)
    assert stats.pages_held_at_end == 0
    for manager in (gen.target_manager, gen.draft_manager):
        assert all(g.pool.num_free == g.pool.total for g in manager.layer_groups)
    keys = list(zip(prompt_seeds(prompts), prompts))
    ref = target_only_outputs(SMALL, keys)
    assert all(ref[keys[rid]] == out for rid, out in stats.outputs.items())


def test_the_handshake_round_trips_through_ints():
    hs = PageHandshake(7, True, True, 64, 32, 0, (10, 0), (np.array([3, 4, 5]), np.array([9])), (40,),
                       (np.array([1, 2]),))
    back = PageHandshake.from_wire(hs.to_wire())
    assert (back.request_id, back.accepted, back.drafter_context, back.gen_reused_tokens, back.gen_drafter_reused,
            back.aux_slot, back.target_lo, back.draft_lo) == (7, True, True, 64, 32, 0, (10, 0), (40,))
    assert [p.tolist() for p in back.target_pages] == [[3, 4, 5], [9]]
    assert [p.tolist() for p in back.draft_pages] == [[1, 2]]
    declined = PageHandshake.from_wire(PageHandshake(8, False).to_wire())
    assert not declined.accepted and declined.target_pages == ()


def test_a_handshake_for_other_ranges_is_refused_naming_the_request():
    item = Transfer(5, 100, torch.arange(101), [60], [], [])
    with pytest.raises(ValueError, match=r"request 5: .*target positions from \(50,\)"):
        check_handshake(item, PageHandshake(5, True, target_lo=(50,), target_pages=(np.array([1]),)))
    check_handshake(item, PageHandshake(5, True, target_lo=(60,), target_pages=(np.array([1, 2]),)))
