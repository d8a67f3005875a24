"""Block reuse on the generation worker of the disaggregated simulator (docs/block_reuse.md, "The generation
worker"; draftkv_sim/disagg_wire.py for the round trip).

Small geometry (tests/sim/sim_support.py's SMALL: P = 16, draft window 256 plus the trail page), with the target
windowed (256) and with full attention. Four prompts share a PREFIX = 1000-token text (not a page multiple:
62 whole pages, 992 tokens, then the tails differ inside page 62) followed by tails of 37, 101, 205 and 77
tokens (prompts of 1037, 1101, 1205, 1077: no page multiple). The generation worker serves request 0 with
no hit and publishes its prompt's whole pages; requests 1-3 then each adopt exactly 992 tokens there, and
the context worker sends target K/V only from max(window start, 992) (and, under joint reuse, drafter
context only from 992 too).

Measured on this geometry: acceptance 5.727 with and without reuse (windowed target; `target` and `joint`
alike), 3.036 with and without (full attention); handoff bytes, windowed: 1,493,504 without reuse, 1,310,208
with `target` (the drafter context is still sent whole), 946,432 with `joint`.
"""
from __future__ import annotations

from dataclasses import replace
from functools import partial

import pytest
import torch

from tensorrt_llm_draftkv.manager.gen_init_reuse import receive_start
from tensorrt_llm_draftkv.manager.rules import MirrorSizing
from draftkv_sim import RunSpec
from draftkv_sim.disagg import RankPool, run_disaggregated
from draftkv_sim.disagg_transfer import admit_transfer, generation_hit, offer_for, transfer_from
from draftkv_sim.disagg_wire import GenHit
from draftkv_sim.report import format_pairs, format_table
from draftkv_sim.run_build import build_rank, run_prompts, target_only_outputs, warmup_tokens
from draftkv_sim.run_result import pair_reuse_runs

from sim_pkg.sim_support import SMALL, reuse_probe_rank

pytestmark = pytest.mark.usefixtures("reference_kernels")  # the kernels' torch reference: fast on CPU

PREFIX = 1000
TAILS = (37, 101, 205, 77)
P = SMALL.tokens_per_block
HIT = PREFIX // P * P  # 992: the whole pages of the common prefix
EXPECTED_GEN = {0: 0, 1: HIT, 2: HIT, 3: HIT}
GEOMETRIES = {"windowed": SMALL, "full": replace(SMALL, target_window=None)}
MODES = ("off", "target", "joint")
HISTORY = MirrorSizing.HISTORY


def spec_for(reuse: str) -> RunSpec:
    return RunSpec(f"g-{reuse}", "disaggregated", TAILS, 4, shared_prefix=PREFIX, block_reuse=reuse, sizings=("history",))


@pytest.fixture(scope="module")
def runs():
    """Every (geometry, reuse mode): the generation worker's stats (with `reuse_probe` on both ranks) and the
    target-only reference, over two kept gloo ranks."""
    out = {}
    with RankPool("gloo") as ranks:
        for geo, base in GEOMETRIES.items():
            reference = target_only_outputs(base, spec_for("off").prompt_keys())
            for reuse in MODES:
                spec = spec_for(reuse)
                setup = spec.setup_for(base)
                build = partial(reuse_probe_rank, setup=setup, sizing=HISTORY, max_concurrency=spec.max_concurrency,
                                slots=setup.drafter_slots, warmup=warmup_tokens(setup, spec.prompt_lengths))
                out[geo, reuse] = (run_disaggregated(build, run_prompts(setup, spec), pool=ranks), reference)
    return out


def test_every_run_is_clean_matches_the_target_and_returns_every_page_on_both_workers(runs):
    keys = spec_for("off").prompt_keys()
    for (geo, reuse), (s, reference) in runs.items():
        ctx = s.context_worker
        assert s.finished == len(TAILS) and s.resize_failures == 0 and s.refused_requests == 0, (geo, reuse, s.first_error)
        for w in (s, ctx):
            assert w.foreign_page_accesses == w.stale_reads == w.unbacked_accesses == w.accounting_errors == 0, (geo, reuse)
            assert w.shared_page_writes == 0
        assert {keys[rid]: out for rid, out in s.outputs.items()} == reference, (geo, reuse)
        assert s.pages_held_by_both == 0, (geo, reuse)  # free or cached-free, both workers
        assert (s.cached_free_pages_at_end > 0) == (reuse != "off")  # the generation worker keeps the prefix


def test_the_generation_worker_adopts_the_whole_pages_of_the_common_prefix(runs):
    for (geo, reuse), (s, _) in runs.items():
        expected = dict.fromkeys(EXPECTED_GEN, 0) if reuse == "off" else EXPECTED_GEN
        assert s.gen_reused_tokens == expected, (geo, reuse)
        probe = s.reuse_probe
        assert {rid: hit for rid, (hit, _, _, _) in probe.items()} == expected
        # the draft pool adopts the hit only under joint reuse
        assert {rid: d for rid, (_, d, _, _) in probe.items()} == (expected if reuse == "joint" else dict.fromkeys(expected, 0))
        if reuse != "off":  # the adopted target pages were checked against each prompt's tokens
            assert s.gen_reused_positions_checked > 0


def test_the_context_worker_sends_target_k_v_only_from_the_hit_and_fewer_bytes(runs):
    for geo, base in GEOMETRIES.items():
        off = runs[geo, "off"][0]
        for reuse in ("target", "joint"):
            s = runs[geo, reuse][0]
            m = {rid: PREFIX + t for rid, t in enumerate(TAILS)}
            for rid, (hit, _, _, group_lo) in s.reuse_probe.items():
                assert group_lo == [receive_start(base.target_window, m[rid], hit)], (geo, reuse, rid)
                if hit:
                    assert group_lo[0] == HIT  # above the window's start: nothing below the hit crossed
            assert 0 < s.handoff_bytes_sent < s.handoff_bytes_without_gen_reuse, (geo, reuse)
            assert s.handoff_bytes_sent < off.handoff_bytes_sent
            assert s.handoff_bytes_saved == s.handoff_bytes_without_gen_reuse - s.handoff_bytes_sent
        assert off.handoff_bytes_sent == off.handoff_bytes_without_gen_reuse  # no hit, nothing saved
        # joint: the drafter context below the hit stays home too; target: it is still sent whole
        assert runs[geo, "joint"][0].drafter_bytes_sent < off.drafter_bytes_sent
        assert runs[geo, "target"][0].drafter_bytes_sent == runs[geo, "target"][0].handoff_bytes_sent - sum(
            _target_bytes(base, PREFIX + t, h) for t, h in zip(TAILS, EXPECTED_GEN.values()))


def _target_bytes(setup, m: int, hit: int) -> int:
    return (m - receive_start(setup.target_window, m, hit)) * setup.target_dim * 2 * 8  # K + V, float64


def test_the_generation_workers_adopted_pages_hold_bit_for_bit_what_the_context_worker_computed(runs):
    for (geo, reuse), (s, _) in runs.items():
        if reuse == "off":
            continue
        sent, held = s.context_worker.reuse_probe, s.reuse_probe
        hits = {rid for rid, (hit, _, _, _) in held.items() if hit}
        assert hits == {1, 2, 3} and set(sent) == hits, (geo, reuse)
        for rid in hits:
            digests = held[rid][2]
            assert digests and digests == sent[rid][2], f"{geo} {reuse} request {rid}: adopted pages differ"
            assert len(digests) == 1 + (reuse == "joint")  # the target group, and the draft group under joint


def test_acceptance_with_generation_worker_reuse_keeps_at_least_097_of_without(runs):
    for geo in GEOMETRIES:
        off = runs[geo, "off"][0].acceptance_length
        assert off > 0
        for reuse in ("target", "joint"):
            assert runs[geo, reuse][0].acceptance_length >= 0.97 * off, (geo, reuse)


# -- in one process: the round trip by hand ------------------------------------------------------------------
def _workers(reuse: str):
    setup = spec_for(reuse).setup_for(SMALL)
    build = partial(build_rank, setup=setup, sizing=HISTORY, max_concurrency=4, slots=setup.drafter_slots,
                    warmup=warmup_tokens(setup, spec_for(reuse).prompt_lengths))
    return build(0), build(1), run_prompts(setup, spec_for(reuse))


def test_the_round_trip_in_one_process_and_a_corrupted_cached_page_is_refused_leaving_nothing_held():
    ctx, gen, prompts = _workers("joint")
    hits = []

    def hand_over(req, ex):
        hit = generation_hit(offer_for(req), gen)
        hits.append(hit)
        admit_transfer(transfer_from(req, ex, hit), gen)

    ctx.on_complete = hand_over
    for rid, prompt in enumerate(prompts[:2]):
        ctx.add_request(rid, prompt)
    ctx.run()
    assert hits == [GenHit(0), GenHit(1, HIT, HIT)]
    assert gen.run().finished == 2 and gen.stats.gen_reused_tokens == {0: 0, 1: HIT}
    # The generation worker's cached prefix pages now hold other values: the next hit is refused by the
    # check against the tokens, and the admission leaves nothing behind.
    for manager in (gen.target_manager, gen.draft_manager):
        for group in manager.layer_groups:
            for layer in group.pool.layers:
                layer.add_(0.5)
    ctx.add_request(2, prompts[2])
    errors = []

    def refused(req, ex):
        try:
            hand_over(req, ex)
        except RuntimeError as err:
            errors.append(str(err))

    ctx.on_complete = refused
    ctx.run()
    assert errors and "request 2: reused target K at position" in errors[0]
    assert not gen.target_manager.has_cache(2) and not gen.draft_manager.has_cache(2)
    assert all(p.num_held == 0 for m in (gen.target_manager, gen.draft_manager) for p in m.pools())


def test_the_table_and_json_show_the_generation_workers_hits_and_the_bytes_saved(runs):
    from draftkv_sim.simulate import RunProgress, result_row
    from draftkv_sim.scenario import Scenario

    specs = [spec_for(r) for r in MODES]
    scenario = Scenario(SMALL, tuple(specs))
    references = {SMALL.max_new_tokens: runs["windowed", "off"][1]}
    results = []
    for spec, reuse in zip(specs, MODES):
        bar = RunProgress(spec.name, len(TAILS), False)
        results.append(result_row(scenario, spec, HISTORY, runs["windowed", reuse][0], references, bar))
        bar.close()
    pair_reuse_runs(results)
    joint = results[2].to_json(scenario)
    assert joint["gen_reused_tokens"] == list(EXPECTED_GEN.values())
    assert joint["handoff_bytes_saved"] == joint["handoff_bytes_without_gen_reuse"] - joint["handoff_bytes_sent"] > 0
    table = format_table(results)
    assert f" j:{3 * 512}/g:{3 * HIT} " in table or f"/g:{3 * HIT} " in table
    text = format_pairs(results)
    assert f"generation worker reused {3 * HIT:,}, handoff {joint['handoff_bytes_sent']:,} of" in text
    assert torch.equal(torch.tensor(joint["gen_reused_tokens"]), torch.tensor([0, HIT, HIT, HIT]))
