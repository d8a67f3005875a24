"""Shared-prefix traffic with real block reuse in the simulator (docs/block_reuse.md, docs/simulator.md).

Small geometry (tests/sim/sim_support.py's SMALL: P = 16, chunks of 512, windows of 256,
64 new tokens): four prompts share a PREFIX-token text (PREFIX // P = 64 pages)
and differ in their tails, of odd lengths. Request 0 computes and publishes the
prefix; requests 1-3 each hit all of it, so each reuses exactly PREFIX tokens
(a whole number of pages, their first tail page differing) and the run saves
3 * PREFIX prefill tokens. Every run must finish clean (no resize failure, no
foreign, stale or unbacked drafter access, no drafter write to a shared page),
equal the target-only output, and leave every page free or cached-free.
"""
from __future__ import annotations

import pytest
import torch
from dataclasses import replace

from tensorrt_llm_draftkv.manager.rules import MirrorSizing, drafter_window_hit_cap
from tensorrt_llm_draftkv.request import LlmRequestState
from draftkv_sim import RunSpec
from draftkv_sim.disagg import RankPool
from draftkv_sim.toy_drafter import DFlashDrafter
from draftkv_sim.prompts import prefix_seed, shared_prefix_prompts
from draftkv_sim.scenario import Scenario, ScenarioError, SimSetup, prompt_seeds
from draftkv_sim.scheduler import Scheduler, SchedulerConfig
from draftkv_sim.report import format_pairs, format_table
from draftkv_sim.run_build import build_executor, run_prompts, target_only_outputs
from draftkv_sim.simulate import run_one, simulate

from sim_pkg.sim_support import SMALL

pytestmark = pytest.mark.usefixtures("reference_kernels")  # the kernels' torch reference: fast on CPU

PREFIX = 1024
TAILS = (37, 101, 205, 77)
EXPECTED_REUSED = {0: 0, 1: PREFIX, 2: PREFIX, 3: PREFIX}
MODES = ("off", "target", "target-all", "joint")
# `target` stops each hit short of the draft window below the prompt end, so the drafter computes what it
# reads. The target's window publishes only the pages it still holds at each chunk's end, so a hit below
# the whole prefix lands on a chunk boundary: the last one at or below the cap.
CAPPED_REUSED = {
    rid: max(
        b for b in range(0, full + 1, SMALL.chunk)
        if b <= drafter_window_hit_cap(PREFIX + tail, (SMALL.draft_window,), SMALL.tokens_per_block)
    )
    for (rid, full), tail in zip(EXPECTED_REUSED.items(), TAILS)
}


def expected_reused(reuse: str) -> dict[int, int]:
    return {"off": dict.fromkeys(EXPECTED_REUSED, 0), "target": CAPPED_REUSED}.get(reuse, EXPECTED_REUSED)


def spec_for(mode: str, reuse: str) -> RunSpec:
    name = f"{'agg' if mode == 'aggregated' else 'disagg'}-p{'' if reuse == 'off' else '-' + reuse}"
    return RunSpec(name, mode, TAILS, 4, shared_prefix=PREFIX, block_reuse=reuse, sizings=("history",))


def assert_clean(stats, reference, spec: RunSpec) -> None:
    """Every request finished, nothing the checker flags, the target-only output, every page returned."""
    keys = spec.prompt_keys()
    assert stats.finished == len(TAILS) and stats.resize_failures == 0 and stats.refused_requests == 0, stats.first_error
    ctx = stats.context_worker
    for s in (stats, ctx) if ctx is not None else (stats,):
        assert s.foreign_page_accesses == s.stale_reads == s.unbacked_accesses == s.accounting_errors == 0
        assert s.shared_page_writes == 0
    assert {keys[rid]: out for rid, out in stats.outputs.items()} == reference
    assert stats.pages_held_by_both == 0  # every pool of every worker: free or cached-free


# -- prompts and the scenario schema ------------------------------------------------------------------------
def test_shared_prefix_prompts_are_the_prefix_then_each_tail_deterministically():
    seeds = prompt_seeds(TAILS)
    prompts = shared_prefix_prompts(PREFIX, TAILS, seeds)
    again = shared_prefix_prompts(PREFIX, TAILS, seeds)
    assert [p.numel() for p in prompts] == [PREFIX + n for n in TAILS]
    assert all(torch.equal(a, b) for a, b in zip(prompts, again))
    head = prompts[0][:PREFIX]
    assert all(torch.equal(p[:PREFIX], head) for p in prompts)
    # the prefix has its own seed: not any tail's text, and independent of which tails follow it
    assert torch.equal(shared_prefix_prompts(PREFIX, [5], [123])[0][:PREFIX], head)
    assert prefix_seed(PREFIX) not in seeds
    firsts = {tuple(p[PREFIX : PREFIX + SMALL.tokens_per_block].tolist()) for p in prompts}
    assert len(firsts) == len(TAILS), "the tails differ from their first page on"
    assert all(torch.equal(a, b) for a, b in zip(shared_prefix_prompts(0, TAILS, seeds), run_prompts(SMALL, TAILS)))


def test_the_scenario_loader_accepts_shared_prefix_runs_and_names_bad_fields():
    run = {"name": "p", "mode": "aggregated", "prompts": [37, 101], "max_concurrency": 2, "shared_prefix": PREFIX,
           "block_reuse": "joint", "sizings": ["history"]}
    scenario = Scenario.from_dict({"block_reuse": "target", "runs": [run]}, base=SMALL)
    (spec,) = scenario.runs
    assert spec.prompt_lengths == (PREFIX + 37, PREFIX + 101) and spec.setup_for(scenario.setup).block_reuse == "joint"
    assert scenario.setup.block_reuse == "target"
    assert Scenario.from_dict(scenario.to_dict(), base=SMALL) == scenario
    bad = [
        ({**run, "shared_prefix": -1}, "runs[0].shared_prefix"),
        ({**run, "shared_prefix": "64k"}, "runs[0].shared_prefix"),
        ({**run, "block_reuse": "both"}, "runs[0].block_reuse"),
        ({**run, "prompts": [37]}, "runs[0].shared_prefix"),
        ({**run, "sizings": ["legacy"]}, "runs[0].sizings"),
        ({**run, "shared_prefix": SMALL.max_seq_len}, "max_seq_len"),
    ]
    for data, field in bad:
        with pytest.raises(ScenarioError) as err:
            Scenario.from_dict({"runs": [data]}, base=SMALL)
        assert err.value.field == field, err.value
    with pytest.raises(ScenarioError, match="block_reuse: must be off, target, target-all or joint"):
        SimSetup.from_dict({"block_reuse": True})
    # a reuse run runs under history only, whatever sizings are asked for
    assert not spec.runs_under("legacy", scenario.setup) and spec.runs_under("history", scenario.setup)
    assert not RunSpec("x", "aggregated", (5,), 1).runs_under("legacy", replace(SMALL, block_reuse="target"))


def test_a_fresh_prompt_waits_for_an_earlier_prefill_under_serial_prefill():
    """Block reuse: request 1 is not scheduled while request 0 (the prefix's publisher) is still in prefill."""
    executor = build_executor(replace(SMALL, block_reuse="target-all"), MirrorSizing.HISTORY, 4, 4)
    assert executor.scheduler.config.serial_prefill
    for rid, prompt in enumerate(run_prompts(SMALL, spec_for("aggregated", "off"))[:2]):
        executor.add_request(rid, prompt)
    first_chunks = []
    while executor.scheduler.has_work():
        batch = executor.scheduler.schedule()
        for req in batch.context_requests:
            if req.py_request_id == 1 and not first_chunks:
                first_chunks.append(executor.scheduler.active[0].state)
        executor.step(batch)
    assert first_chunks == [LlmRequestState.GENERATION_IN_PROGRESS]  # request 0 had finished its prefill
    assert executor.stats.reused_tokens == {0: 0, 1: PREFIX}
    plain = Scheduler(SchedulerConfig(max_num_tokens=4096, chunk_size=512))  # off: both prefill side by side
    for rid, prompt in enumerate(run_prompts(SMALL, spec_for("aggregated", "off"))[:2]):
        executor.add_request(10 + rid, prompt)
    plain.waiting.extend(executor.scheduler.waiting)
    assert len(plain.schedule().context_requests) == 2


def test_a_reused_page_that_does_not_hold_the_prefix_k_v_is_an_error():
    """The target model checks what it reads through the reused pages: corrupt them and the hit is refused."""
    executor = build_executor(replace(SMALL, block_reuse="target"), None, 4, 1)
    prompts = run_prompts(SMALL, spec_for("aggregated", "off"))
    executor.add_request(0, prompts[0])
    executor.run()
    for group in executor.target_manager.layer_groups:  # the cached-free prefix pages now hold other values
        for layer in group.pool.layers:
            layer.add_(0.5)
    executor.add_request(1, prompts[1])
    with pytest.raises(RuntimeError, match=r"request 1: reused target K at position \d+"):
        executor.run()


# -- aggregated: off, target-only and joint reuse -------------------------------------------------------------
@pytest.fixture(scope="module")
def aggregated(request):
    """`simulate` over the three aggregated runs, with every drafter write's page recorded."""
    writes: list[tuple[int, bool, bool]] = []  # (reused tokens of the writer, page writable, joint pool)
    original = DFlashDrafter._write_for

    def spy(self, request_id, gi, positions, ordinals, pages, offsets, kv, owned_row):
        dm = self.draft_manager
        if dm is not None and dm.has_cache(request_id):
            pool = dm.layer_groups[gi].pool
            stored = offsets.long() >= 0
            for page in set(pages[stored].tolist()):
                if page >= 0:
                    writes.append((page, pool.is_writable(page), dm.block_reuse))
        return original(self, request_id, gi, positions, ordinals, pages, offsets, kv, owned_row)

    def no_fake_prefix(self, *args, **kwargs):
        raise AssertionError("write_reused_prefix must not run under real joint block reuse")

    mp = pytest.MonkeyPatch()
    mp.setattr(DFlashDrafter, "_write_for", spy)
    mp.setattr(DFlashDrafter, "write_reused_prefix", no_fake_prefix)
    try:
        scenario = Scenario(SMALL, tuple(spec_for("aggregated", reuse) for reuse in MODES))
        results = simulate(scenario, [MirrorSizing.HISTORY])
    finally:
        mp.undo()
    return {r.block_reuse: r for r in results}, writes


def test_aggregated_reuse_runs_are_clean_and_save_the_expected_prefill(aggregated):
    results, _ = aggregated
    for reuse, r in results.items():
        assert r.finished == len(TAILS) and r.resize_failures == 0, r.first_error
        assert r.foreign_page_accesses == r.stale_reads == r.unbacked_accesses == r.accounting_errors == 0
        assert r.shared_page_writes == 0 and r.output_matches_target is True
        assert r.pages_held_at_end == 0
        expected = list(expected_reused(reuse).values())
        assert r.reused_tokens == expected and r.prefill_tokens_saved == sum(expected)
        record = r.to_json()
        assert record["block_reuse"] == reuse and record["reused_tokens"] == expected
        assert record["prefill_tokens_saved"] == sum(expected) and record["shared_prefix"] == PREFIX
    # the prefix pages stay published for later hits; without reuse nothing is cached
    assert results["off"].cached_free_pages_at_end == 0 < results["target"].cached_free_pages_at_end
    # joint also keeps the draft pool's prefix pages
    assert results["joint"].cached_free_pages_at_end > results["target"].cached_free_pages_at_end
    # the target read every reused page it backs, and checked them against the prompt's tokens
    assert results["off"].reused_positions_checked == 0 < results["target"].reused_positions_checked


def test_joint_and_capped_target_reuse_keep_the_acceptance_and_target_all_loses_it(aggregated):
    results, _ = aggregated
    off, target, target_all, joint = (results[m] for m in MODES)
    assert joint.reuse_paired_run == target.reuse_paired_run == target_all.reuse_paired_run == off.name
    assert joint.acceptance_length >= 0.97 * off.acceptance_length
    assert joint.acceptance_vs_no_reuse == round(joint.acceptance_length / off.acceptance_length, 3)
    # Target-only, hit stopped short of the draft window: the drafter computed everything it reads.
    assert target.acceptance_length >= 0.97 * off.acceptance_length
    # Target-only taking every cached page: the drafter's context behind the prefix is empty (the collapse).
    assert target_all.acceptance_length < 0.97 * off.acceptance_length
    text = format_pairs(list(results.values()))
    assert "with block reuse vs without, over the same prompts:" in text
    assert f"{joint.name} vs {off.name} (history, aggregated, joint reuse), 3,072 of" in text
    table = format_table(list(results.values()))
    capped = sum(CAPPED_REUSED.values())
    assert " j:3072 " in table and " T:3072 " in table and f" t:{capped} " in table
    assert 0 < capped < 3 * PREFIX


def test_under_joint_reuse_the_drafter_never_writes_a_shared_page(aggregated):
    _, writes = aggregated
    joint = [w for w in writes if w[2]]
    assert joint, "the joint run's drafter wrote through the spy"
    assert all(writable for _, writable, _ in joint), "a drafter write landed on a shared or published page"


# -- disaggregated (two processes, gloo) ----------------------------------------------------------------------
@pytest.fixture(scope="module")
def disaggregated():
    specs = {reuse: spec_for("disaggregated", reuse) for reuse in MODES}
    reference = target_only_outputs(SMALL, specs["off"].prompt_keys())
    with RankPool("gloo") as ranks:
        stats = {reuse: run_one(SMALL, spec, MirrorSizing.HISTORY, ranks=ranks)[0] for reuse, spec in specs.items()}
    agg = {reuse: run_one(SMALL, replace(spec, mode="aggregated"), MirrorSizing.HISTORY)[0]
           for reuse, spec in specs.items()}
    return specs, reference, stats, agg


def test_disaggregated_reuse_runs_are_clean_and_the_context_worker_saves_the_prefill(disaggregated):
    specs, reference, stats, agg = disaggregated
    for reuse, s in stats.items():
        assert_clean(s, reference, specs[reuse])
        expected = expected_reused(reuse)
        assert s.reused_tokens == expected and s.context_worker.reused_tokens == expected
        assert s.prefill_tokens_saved == sum(expected.values())
        # both workers keep the prefix pages cached (the generation worker: see test_gen_worker_reuse.py)
        assert (s.cached_free_pages_at_end > 0) == (reuse != "off")
        assert (s.context_worker.cached_free_pages_at_end > 0) == (reuse != "off")
        # the generation worker's acceptance reaches its aggregated twin's (same reuse mode)
        assert s.acceptance_length >= 0.97 * agg[reuse].acceptance_length
    assert stats["joint"].acceptance_length >= 0.97 * stats["off"].acceptance_length
    assert stats["target"].acceptance_length >= 0.97 * stats["off"].acceptance_length
    assert stats["target-all"].acceptance_length < 0.97 * stats["off"].acceptance_length


def test_target_only_reuse_hands_over_only_the_drafter_context_it_computed(disaggregated):
    """Without joint reuse the context worker's drafter has nothing below the hit: it sends from there on."""
    _, _, stats, _ = disaggregated
    off, capped, target, joint = (stats[m] for m in MODES)
    # joint: the context worker reads the prefix's window from shared pages, but the generation worker's
    # draft pool holds the prefix too, so only the tails go (test_gen_worker_reuse.py)
    assert 0 < joint.drafter_bytes_sent < off.drafter_bytes_sent
    assert 0 < target.drafter_bytes_sent < capped.drafter_bytes_sent <= off.drafter_bytes_sent
    assert off.handoff_seeds == target.handoff_seeds == joint.handoff_seeds == len(TAILS)
    full = {rid: entry for rid, entry in off.drafter_bytes_by_request.items()}
    for rid, (m, sent, whole) in target.drafter_bytes_by_request.items():
        assert (m, whole) == full[rid][::2]
        # requests 1-3 start their drafter at the hit, PREFIX: at most the tail (and the first token's row) is sent
        if EXPECTED_REUSED[rid]:
            assert sent < full[rid][1]
        else:
            assert sent == full[rid][1]
