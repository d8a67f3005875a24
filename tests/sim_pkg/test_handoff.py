"""The drafter-context handoff in the simulator: context worker -> wire -> generation worker.

Most tests run both workers in this process (`build_rank` builds them exactly
as the two ranks do, and `transfer_from` / `admit_transfer` are what the ranks
call around the wire); one runs the real two-process path over gloo.
"""
from __future__ import annotations

import dataclasses
from dataclasses import replace

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from tensorrt_llm_draftkv.config import SpeculativeDecodingMode
from tensorrt_llm_draftkv.manager.rules import MirrorSizing
from draftkv_sim import RunSpec
from draftkv_sim.disagg_transfer import admit_transfer, transfer_from
from draftkv_sim.disagg_wire import Transfer
from draftkv_sim.run_build import build_rank, run_prompts, target_only_outputs
from draftkv_sim.simulate import run_one
from draftkv_sim.scenario import prompt_seeds
from tensorrt_llm_draftkv.speculative.handoff import DrafterContextMismatch, DrafterHandoff, HandoffForm
from sim_pkg.sim_support import SMALL

pytestmark = pytest.mark.usefixtures("reference_kernels")

HISTORY = MirrorSizing.HISTORY


def context_transfers(setup, prompts: tuple[int, ...]) -> tuple[list[Transfer], object]:
    """Run the context worker over `prompts`; returns what it sends and its executor (pages freed)."""
    ctx = build_rank(0, setup, HISTORY, len(prompts), setup.drafter_slots, 0)
    sent: list[Transfer] = []
    stored: dict[int, list[torch.Tensor]] = {}

    def on_complete(req, ex):
        item = transfer_from(req, ex)
        sent.append(item)
        # what this worker's drafter holds for the sent positions, read independently of the transfer
        if item.drafter_geometry is not None:
            drafter = ex.speculator.drafter
            stored[req.py_request_id] = [
                drafter.read_stored(req.py_request_id, g, lo, hi)
                for g, (lo, hi) in enumerate(item.drafter_geometry.ranges(req.prompt_len))
            ]

    ctx.on_complete = on_complete
    for rid, prompt in enumerate(run_prompts(setup, prompts)):
        ctx.add_request(rid, prompt)
    ctx.run()
    ctx.stored = stored
    return sent, ctx


def generation_worker(setup, prompts: tuple[int, ...], *, fallback: bool = False):
    return build_rank(1, setup, HISTORY, len(prompts), setup.drafter_slots, max(prompts) + setup.max_new_tokens,
                       fallback=fallback)


def record_writes(gen) -> list[tuple[int, int, torch.Tensor, torch.Tensor]]:
    """Every drafter write of the generation worker: (request, group, positions, pages)."""
    drafter = gen.speculator.drafter
    seen: list = []
    original = drafter._write_for

    def spy(request_id, gi, positions, ordinals, pages, offsets, kv, owned_row):
        seen.append((request_id, gi, positions.clone(), pages.clone()))
        return original(request_id, gi, positions, ordinals, pages, offsets, kv, owned_row)

    drafter._write_for = spy
    return seen


# --------------------------------------------------------------------------- pages written, bits read back
@pytest.mark.parametrize("drafter", [SpeculativeDecodingMode.DFLASH, SpeculativeDecodingMode.DSPARK])
@pytest.mark.parametrize("form", [HandoffForm.KV, HandoffForm.HIDDEN])
def test_the_received_context_lands_on_exactly_the_backed_window_and_reads_back_bit_for_bit(drafter, form):
    setup = replace(SMALL, drafter=drafter, handoff_form=form, max_new_tokens=24)
    prompts = (301, 777, 1024)  # not a page multiple, one short of nothing, a page multiple
    sent, ctx = context_transfers(setup, prompts)
    gen = generation_worker(setup, prompts)
    writes = record_writes(gen)
    dm = gen.draft_manager
    P = setup.tokens_per_block
    for item in sent:
        before = len(writes)
        admit_transfer(item, gen)
        rid, m = item.request_id, item.prompt_len
        row = dm.get_cache(rid).block_row(0)
        backed_below_m = {row[i] for i in range(len(row)) if row[i] >= 0 and i * P < m}
        written = {int(p) for _, _, _, pages in writes[before:] for p in pages}
        assert written == backed_below_m, f"request {rid}: pages written are the mirror's window below {m}"
        # bit for bit: what the generation worker's pool now holds is what the context worker's drafter stored
        lo, hi = item.drafter_geometry.group_range(0, m)
        here = gen.speculator.drafter.read_stored(rid, 0, lo, hi)
        if form is HandoffForm.KV:
            assert torch.equal(here, ctx.stored[rid][0])
        else:  # projected here from the hidden states: the same function of the same numbers
            assert torch.allclose(here, ctx.stored[rid][0], rtol=0, atol=1e-6)
        assert gen.speculator.meta.slots.pending_context_seed(rid) == (item.drafter_geometry.seed_start(m), m)
    stats = gen.run()
    assert stats.finished == len(prompts) and stats.handoff_seeds == len(prompts)
    # the slots read what was written (the checker compares every read with what was stored there)
    assert stats.foreign_page_accesses == stats.stale_reads == stats.unbacked_accesses == 0
    assert gen.speculator.checker.reads > 0
    assert stats.drafter_bytes_sent == sum(item.drafter_bytes for item in sent) > 0
    assert stats.full_drafter_bytes == sum(
        item.drafter_geometry.payload_bytes(item.prompt_len, whole_prompt=True) for item in sent
    )


def test_the_first_slot_reads_the_received_positions_through_its_base():
    setup = replace(SMALL, max_new_tokens=8)
    sent, ctx = context_transfers(setup, (555,))
    gen = generation_worker(setup, (555,))
    (item,) = sent
    admit_transfer(item, gen)
    # the context worker's first drafts travel with the first token: the first step has drafts to verify
    (req,) = gen.scheduler.active
    assert len(item.drafts) == SMALL.max_draft_len and req.py_draft_tokens == item.drafts
    reads: list[tuple[int, torch.Tensor, torch.Tensor]] = []
    checker = gen.speculator.checker
    original = checker.record_read

    def spy(request_id, group, layers, positions, ordinals, pages, kv, **kwargs):
        reads.append((request_id, positions.clone(), kv.clone()))
        return original(request_id, group, layers, positions, ordinals, pages, kv, **kwargs)

    checker.record_read = spy
    gen.run_steps(1)
    lo = item.drafter_geometry.seed_start(555)
    assert gen.speculator.meta.seeds[0] == (555, lo // SMALL.tokens_per_block, 0)
    positions = torch.cat([p for rid, p, _ in reads if rid == 0])
    values = torch.cat([kv for rid, _, kv in reads if rid == 0])
    below = positions < 555
    # the first proposal reads received positions: the last window below the prompt end, never below lo
    assert int(below.sum()) > 0 and int(positions[below].min()) >= lo
    assert int(positions[below].max()) == 554
    # and reads, bit for bit, what the context worker's drafter had stored there
    assert torch.equal(values[below], ctx.stored[0][0][positions[below] - lo])
    assert gen.stats.accepted_tokens > 1  # some of those drafts were accepted in the very first step


# --------------------------------------------------------------------------- geometry mismatch
def mismatched(item: Transfer, **change) -> Transfer:
    return dataclasses.replace(item, drafter_geometry=dataclasses.replace(item.drafter_geometry, **change))


@pytest.mark.parametrize("change", [{"windows": (512,)}, {"tokens_per_block": 32}, {"head_dim": 8}])
def test_a_context_for_another_geometry_is_refused_and_nothing_is_allocated(change):
    setup = replace(SMALL, max_new_tokens=8)
    sent, _ = context_transfers(setup, (400,))
    gen = generation_worker(setup, (400,))
    bad = mismatched(sent[0], **change)
    with pytest.raises(DrafterContextMismatch) as err:
        admit_transfer(bad, gen)
    text = str(err.value)
    assert "request 0" in text and bad.drafter_geometry.describe() in text
    assert gen.speculator.handoff_geometry().describe() in text
    assert not gen.target_manager.has_cache(0) and not gen.draft_manager.has_cache(0)
    assert gen.speculator.meta.slots.pending_context_seed(0) is None
    assert gen.scheduler.active == []


def test_fallback_takes_the_empty_seed_only_when_asked():
    setup = replace(SMALL, max_new_tokens=16)
    sent, _ = context_transfers(setup, (400,))
    gen = generation_worker(setup, (400,), fallback=True)
    admit_transfer(mismatched(sent[0], windows=(512,)), gen)
    assert gen.stats.handoff_fallbacks == 1 and gen.stats.drafter_bytes_sent == 0
    assert gen.speculator.meta.slots.pending_context_seed(0) is None
    gen.run_steps(1)
    seed = gen.speculator.meta.seeds[0]
    P = SMALL.tokens_per_block
    assert (seed.ctx_len, seed.base_pages) == ((400 // P) * P, 400 // P)  # the empty seed at the prompt end
    stats = gen.run()
    assert stats.finished == 1 and stats.handoff_seeds == 0 and stats.stale_reads == 0


# --------------------------------------------------------------------------- slot loss on the generation worker
def test_a_slot_lost_on_the_generation_worker_is_reseeded_empty_and_counted():
    setup = replace(SMALL, max_new_tokens=24)
    sent, _ = context_transfers(setup, (333, 650))
    gen = generation_worker(setup, (333, 650))
    for item in sent:
        admit_transfer(item, gen)
    gen.run_steps(2)
    spec = gen.speculator
    assert spec.handoff_seeds == 2 and spec.reseeds_without_handoff == 0
    spec.evict(1)
    gen.run_steps(1)
    assert spec.reseeds_without_handoff == 1 and spec.slot_reseeds == 1
    seed = spec.meta.seeds[1]
    assert seed.ctx_len == seed.base_pages * SMALL.tokens_per_block  # nothing to draw on: empty
    stats = gen.run()
    assert stats.finished == 2 and stats.stale_reads == stats.foreign_page_accesses == stats.unbacked_accesses == 0
    assert stats.reseeds_without_handoff == 1


# --------------------------------------------------------------------------- odd lengths and windows
@settings(max_examples=6, deadline=None)
@given(
    m=st.integers(40, 900),
    window=st.integers(9, 300),
    P=st.sampled_from([8, 16, 13]),
)
def test_odd_prompts_and_windows_get_the_aggregated_acceptance_on_their_own_pages(m, window, P):
    setup = replace(SMALL, draft_window=window, target_window=window, tokens_per_block=P, max_new_tokens=16, chunk=512)
    sent, _ = context_transfers(setup, (m,))
    gen = generation_worker(setup, (m,))
    writes = record_writes(gen)
    admit_transfer(sent[0], gen)
    row = gen.draft_manager.get_cache(0).block_row(0)
    assert {int(p) for *_, pages in writes for p in pages} == {row[i] for i in range(len(row)) if row[i] >= 0 and i * P < m}
    stats = gen.run()
    assert stats.foreign_page_accesses == stats.stale_reads == stats.unbacked_accesses == 0
    agg, _ = run_one(setup, RunSpec("twin", "aggregated", (m,), 1), HISTORY)
    assert stats.outputs == agg.outputs
    assert stats.acceptance_length >= 0.97 * agg.acceptance_length


# --------------------------------------------------------------------------- the real two-process run
def test_two_process_runs_with_and_without_the_handoff():
    prompts = (517, 1000, 777)
    spec = RunSpec("handoff", "disaggregated", prompts, 2)
    keys = list(zip(prompt_seeds(prompts), prompts))
    reference = target_only_outputs(SMALL, keys)
    window, _ = run_one(SMALL, spec, HISTORY)
    none, _ = run_one(replace(SMALL, drafter_handoff=DrafterHandoff.NONE), spec, HISTORY)
    agg, _ = run_one(SMALL, replace(spec, mode="aggregated"), HISTORY)
    for stats in (window, none):
        assert stats.finished == 3 and stats.resize_failures == 0, stats.first_error
        assert {keys[rid]: out for rid, out in stats.outputs.items()} == reference
        assert stats.foreign_page_accesses == stats.stale_reads == stats.unbacked_accesses == 0
    assert window.handoff_seeds == 3 and none.handoff_seeds == 0 and none.drafter_bytes_sent == 0
    assert window.full_drafter_bytes == none.full_drafter_bytes > window.drafter_bytes_sent > 0
    assert window.acceptance_length >= 0.97 * agg.acceptance_length
    assert none.acceptance_length < window.acceptance_length


# --------------------------------------------------------------------------- the command line and the scenario key
def test_the_command_line_selects_the_handoff_and_refuses_anything_else(capsys):
    import json

    from draftkv_sim.cli import main
    from draftkv_sim.scenario import DEFAULT_SCENARIO, Scenario, ScenarioError

    assert main(["--print-config"]) == 0
    assert json.loads(capsys.readouterr().out)["drafter_handoff"] == "window"  # the default
    assert main(["--print-config", "--drafter-handoff", "none", "--handoff-form", "hidden"]) == 0
    config = json.loads(capsys.readouterr().out)
    assert config["drafter_handoff"] == "none" and config["handoff_form"] == "hidden"
    loaded = Scenario.from_dict(config)
    assert loaded.setup.drafter_handoff is DrafterHandoff.NONE and loaded.setup.handoff_form is HandoffForm.HIDDEN
    with pytest.raises(SystemExit) as exit_info:
        main(["--drafter-handoff", "everything"])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert "--drafter-handoff" in err and "everything" in err and "Traceback" not in err
    with pytest.raises(ScenarioError, match="drafter_handoff: must be window or none"):
        Scenario.from_dict({**DEFAULT_SCENARIO.to_dict(), "drafter_handoff": "all"})


def test_a_payload_that_does_not_match_its_header_is_refused_and_every_cache_freed():
    setup = replace(SMALL, max_new_tokens=8)
    sent, _ = context_transfers(setup, (450,))
    gen = generation_worker(setup, (450,))
    (item,) = sent
    short = dataclasses.replace(item, drafter_payload=[item.drafter_payload[0][1:]])  # one position missing
    held = [gen.draft_manager.layer_groups[0].pool.num_free]
    with pytest.raises(ValueError, match=r"request 0: received drafter K/V \(.*\), expected"):
        admit_transfer(short, gen)
    assert not gen.target_manager.has_cache(0) and not gen.draft_manager.has_cache(0)
    assert [gen.draft_manager.layer_groups[0].pool.num_free] == held
    assert gen.speculator.meta.slots.pending_context_seed(0) is None and gen.scheduler.active == []
    admit_transfer(item, gen)  # the well-formed transfer of the same request still goes in
    assert gen.run().finished == 1


def test_over_the_wire_the_written_pages_are_the_backed_window_and_the_pool_holds_what_was_sent():
    """Two processes over gloo: the generation worker's drafter writes exactly its mirror's backed pages
    below the prompt end, and afterwards its pool holds, bit for bit, the drafter context the context
    worker read from its own pool and sent (digests compared here, in the parent)."""
    from functools import partial

    from sim_pkg.sim_support import handoff_probe_rank

    from draftkv_sim.disagg import run_disaggregated
    from draftkv_sim.run_build import run_prompts, warmup_tokens

    prompts = (301, 777, 1024)
    spec = RunSpec("probe", "disaggregated", prompts, 2)
    build = partial(
        handoff_probe_rank, setup=SMALL, sizing=HISTORY, max_concurrency=2, slots=SMALL.drafter_slots,
        warmup=warmup_tokens(SMALL, prompts),
    )
    stats = run_disaggregated(build, run_prompts(SMALL, spec), backend="gloo")
    assert stats.finished == len(prompts) and stats.handoff_seeds == len(prompts), stats.first_error
    sent, received = stats.context_worker.handoff_probe, stats.handoff_probe
    assert sorted(sent) == sorted(received) == list(range(len(prompts)))
    for rid in sent:
        exact, backed, read_back = received[rid]
        assert exact and backed > 0, f"request {rid}: pages written differ from the backed window"
        assert read_back == sent[rid], f"request {rid}: the pool does not hold what the context worker sent"
