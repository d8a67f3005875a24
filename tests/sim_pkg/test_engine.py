"""The executor loop in one process: speculative == target-only, pages, slots, warmup, quality signal.

Small geometry (chunk 512, windows 256/256, 16-token pages, 64 new tokens) so
each run takes a fraction of a second. Most tests run the kernels' torch
reference (TRITON_INTERPRET=0); one runs the same executor through the Triton
kernels in the interpreter, and one on CUDA.

"Generation worker" tests run the disaggregated generation side in-process:
a target-only context executor computes each prompt and emits its first
token, `transfer_from` / `admit_transfer` (the functions the two ranks use
around the wire) hand the request to a generation executor with a drafter.
That is the path where requests arrive already generating, so more of them
than drafter slots can be in flight and slots are evicted and reseeded.
"""
from __future__ import annotations

import collections
import random
from collections import deque
from dataclasses import dataclass, field, replace

import pytest
import torch

from draftkv_sim import Executor, SimSetup
from draftkv_sim.disagg_transfer import admit_transfer, transfer_from
from draftkv_sim.prompts import phrase_bank, phrase_prompt
from draftkv_sim.run_build import build_executor, draft_pages_per_request, target_only_outputs
from tensorrt_llm_draftkv.manager.rules import MirrorSizing

HISTORY, LEGACY = MirrorSizing.HISTORY, MirrorSizing.LEGACY

# The small geometry and the autouse fixtures (one thread, reference kernels) are shared.
from sim_pkg.sim_support import SMALL

pytestmark = pytest.mark.usefixtures("reference_kernels")  # the kernels' torch reference: fast on CPU



Key = tuple[int, int]  # (prompt seed, prompt length)


def random_keys(seed: int, count: int, lo: int = 200, hi: int = 1600) -> list[Key]:
    rng = random.Random(seed)
    return [(1000 * seed + i, rng.randint(lo, hi)) for i in range(count)]


def prompt(setup: SimSetup, key: Key) -> torch.Tensor:
    return phrase_prompt(key[0], key[1], vocab_size=setup.vocab_size)


@dataclass
class Run:
    executor: Executor
    keys: list[Key]
    releases: collections.Counter = field(default_factory=collections.Counter)
    generation_seeds: int = 0
    checks: int = 0
    proposals: list[tuple[int, list[int], list[int]]] = field(default_factory=list)  # (rid, tokens, drafts)

    @property
    def stats(self):
        return self.executor.stats

    @property
    def outputs(self) -> dict[Key, list[int]]:
        return {self.keys[rid]: out for rid, out in self.stats.outputs.items()}

    @property
    def speculator(self):
        return self.executor.speculator


def instrument(ex: Executor, run: Run, *, check_every_step: bool = True) -> None:
    """Count slot releases by reason, seeds of generation rows, and check invariant 3 every step."""
    spec = ex.speculator
    if spec is not None:
        spec.meta.slots.add_release_listener(lambda rid, why: run.releases.update([why]))
        prepare = spec.prepare

        def counting_prepare(batch):
            prepare(batch)
            gen = {r.py_request_id for r in batch.generation_requests}
            run.generation_seeds += sum(1 for rid in spec.meta.seeds if rid in gen)

        spec.prepare = counting_prepare
        propose = spec.propose

        def recording_propose(reqs, tokens):
            out = propose(reqs, tokens)
            for req in reqs:
                run.proposals.append((req.py_request_id, list(req.tokens), list(out.get(req.py_request_id, []))))
            return out

        spec.propose = recording_propose
    if check_every_step:

        def on_step(executor: Executor) -> None:
            executor.target_manager.check_accounting()
            if executor.draft_manager is not None:
                executor.draft_manager.check_accounting()
            if executor.speculator is not None:
                executor.speculator.meta.slots.check_host_mirror()
            run.checks += 1

        ex.on_step = on_step


def run_aggregated(
    setup: SimSetup,
    sizing: MirrorSizing | None,
    keys: list[Key],
    *,
    concurrency: int = 3,
    slots: int | None = None,
    hook=None,
    warmup: int | None = None,
) -> Run:
    ex = build_executor(setup, sizing, concurrency, slots or concurrency)
    run = Run(ex, keys)
    instrument(ex, run)
    if hook is not None:
        ex.speculator.drafter.debug_read_rows_hook = hook
    if warmup is not None:
        ex.warmup(num_dummies=1, token_num=warmup)
    for rid, key in enumerate(keys):
        ex.add_request(rid, prompt(setup, key))
    ex.run()
    return run


def run_generation_worker(
    setup: SimSetup, sizing: MirrorSizing, keys: list[Key], *, concurrency: int = 3, slots: int | None = None
) -> Run:
    """The 1P1D split in one process: the context executor's transfers admitted by a generation executor."""
    ctx = build_executor(replace(setup, max_new_tokens=1), None, concurrency, 1)
    sent = []
    ctx.on_complete = lambda req, ex: sent.append(transfer_from(req, ex))
    for rid, key in enumerate(keys):
        ctx.add_request(rid, prompt(setup, key))
    ctx.run()
    assert len(sent) == len(keys)
    gen = build_executor(setup, sizing, concurrency, slots or concurrency)
    run = Run(gen, keys)
    instrument(gen, run)
    pending = deque(sent)
    while pending or gen.scheduler.has_work():
        while pending and len(gen.scheduler.active) < concurrency:
            admit_transfer(pending.popleft(), gen)
        if not gen.run_steps(1):
            break
    gen.finish()
    return run


_REFERENCE: dict[tuple, dict[Key, list[int]]] = {}


def reference(setup: SimSetup, keys: list[Key]) -> dict[Key, list[int]]:
    cache_key = (setup, tuple(keys))
    if cache_key not in _REFERENCE:
        _REFERENCE[cache_key] = target_only_outputs(setup, keys)
    return _REFERENCE[cache_key]


def assert_all_freed(ex: Executor) -> None:
    for manager in (ex.target_manager, ex.draft_manager):
        if manager is None:
            continue
        assert manager.request_ids() == []
        for group in manager.layer_groups:
            assert group.pool.num_free == group.pool.total
            assert group.pool.num_held == 0
        manager.check_accounting()
    if ex.speculator is not None:
        assert ex.speculator.meta.slots.live_requests() == {}
    assert ex.tokens == {}
    assert not ex.scheduler.has_work()


def assert_clean(run: Run) -> None:
    assert run.stats.resize_failures == 0, run.stats.first_error
    assert run.stats.foreign_page_accesses == 0
    assert run.speculator.stale_reads == 0
    assert run.speculator.checker.unbacked_accesses == 0


# -- speculative == target-only -------------------------------------------------------------------
def test_reference_outputs_have_the_requested_length():
    keys = random_keys(0, 3)
    ref = reference(SMALL, keys)
    assert set(ref) == set(keys)
    assert all(len(out) == SMALL.max_new_tokens for out in ref.values())


@pytest.mark.parametrize("sizing", [HISTORY, LEGACY], ids=["history", "legacy"])
@pytest.mark.parametrize("seed", [1, 2, 3])
def test_speculative_output_equals_target_only(sizing, seed):
    keys = random_keys(seed, 3)
    run = run_aggregated(SMALL, sizing, keys)
    assert run.stats.finished == len(keys)
    assert run.outputs == reference(SMALL, keys)
    assert_clean(run)
    assert run.checks == run.stats.steps
    # the drafter really drafts: most of each block is accepted on phrase prompts
    assert run.stats.acceptance_length > 4.0
    assert run.stats.generated_tokens == len(keys) * SMALL.max_new_tokens


def test_completion_frees_every_page_in_both_pools():
    keys = random_keys(4, 4)
    for sizing in (HISTORY, LEGACY):
        run = run_aggregated(SMALL, sizing, keys, concurrency=2)
        assert run.stats.finished == 4
        assert run.releases["free"] == 4
        assert_all_freed(run.executor)


def test_target_only_executor_frees_every_page():
    ex = build_executor(SMALL, None, 3, 1)
    for rid, key in enumerate(random_keys(5, 3)):
        ex.add_request(rid, prompt(SMALL, key))
    ex.run()
    assert ex.draft_manager is None and ex.speculator is None
    assert_all_freed(ex)


def test_fewer_drafter_slots_than_requests_aggregated():
    # The batch is capped at the drafter's slots; requests beyond it wait their turn.
    keys = random_keys(6, 4)
    for slots in (1, 2):
        run = run_aggregated(SMALL, HISTORY, keys, concurrency=4, slots=slots)
        assert run.stats.finished == 4
        assert run.outputs == reference(SMALL, keys)
        assert_clean(run)
        assert_all_freed(run.executor)


# -- slot eviction and reseed (generation worker) ---------------------------------------------------------
def test_generation_worker_evicts_and_reseeds_slots_and_still_matches():
    keys = random_keys(7, 3, lo=300, hi=900)
    run = run_generation_worker(SMALL, HISTORY, keys, concurrency=3, slots=2)
    assert run.stats.finished == 3
    assert run.releases["evict"] > 0
    # every arriving request is seeded once, every evicted one again when it returns
    assert run.generation_seeds == len(keys) + run.releases["evict"]
    assert run.outputs == reference(SMALL, keys)
    assert_clean(run)
    assert_all_freed(run.executor)


def test_generation_worker_with_enough_slots_never_evicts():
    keys = random_keys(7, 3, lo=300, hi=900)
    run = run_generation_worker(SMALL, HISTORY, keys, concurrency=3, slots=3)
    assert run.releases["evict"] == 0
    assert run.generation_seeds == len(keys)
    assert run.outputs == reference(SMALL, keys)
    assert_clean(run)


def test_legacy_generation_worker_touches_foreign_pages_but_output_still_matches():
    # Prompts longer than the draft window: the absolute mirror released its low pages,
    # the slot-local drafter writes and reads there anyway.
    keys = random_keys(8, 3, lo=600, hi=1200)
    history = run_generation_worker(SMALL, HISTORY, keys)
    legacy = run_generation_worker(SMALL, LEGACY, keys)
    assert history.stats.foreign_page_accesses == 0
    assert legacy.stats.foreign_page_accesses > 0
    assert history.outputs == legacy.outputs == reference(SMALL, keys)
    assert_all_freed(legacy.executor)


# -- history vs legacy, trail page --------------------------------------------------------------------------
@pytest.mark.parametrize("seed", [11, 12])
def test_history_acceptance_equals_legacy_where_legacy_survives(seed):
    keys = random_keys(seed, 3)
    history = run_aggregated(SMALL, HISTORY, keys)
    legacy = run_aggregated(SMALL, LEGACY, keys)
    assert legacy.stats.finished == history.stats.finished == 3
    assert history.stats.acceptance_length == legacy.stats.acceptance_length
    assert history.stats.accepted_tokens == legacy.stats.accepted_tokens
    assert history.outputs == legacy.outputs


def test_history_acceptance_equals_legacy_on_a_generation_worker_inside_the_window():
    # Prompt + output fit the draft window: nothing is released, so legacy's slot-local
    # numbering stays on the request's own pages.
    keys = [(31, 150), (32, 180), (33, 120)]
    history = run_generation_worker(SMALL, HISTORY, keys)
    legacy = run_generation_worker(SMALL, LEGACY, keys)
    assert legacy.stats.foreign_page_accesses == 0
    assert history.stats.acceptance_length == legacy.stats.acceptance_length
    assert history.outputs == legacy.outputs == reference(SMALL, keys)


@pytest.mark.parametrize("seed", [13, 14])
def test_trail_page_off_changes_neither_output_nor_acceptance(seed):
    keys = random_keys(seed, 3, lo=800, hi=2500)
    on = run_aggregated(SMALL, HISTORY, keys)
    off_setup = replace(SMALL, trail_page=False)
    off = run_aggregated(off_setup, HISTORY, keys)
    assert on.executor.draft_manager._draft_slot_trail_tokens == SMALL.tokens_per_block
    assert off.executor.draft_manager._draft_slot_trail_tokens == 0
    assert draft_pages_per_request(off_setup) == draft_pages_per_request(SMALL) - 1
    assert on.outputs == off.outputs == reference(SMALL, keys)
    assert on.stats.acceptance_length == off.stats.acceptance_length
    assert_clean(off)


def test_trail_page_off_on_a_generation_worker_keeps_the_output():
    keys = random_keys(15, 2, lo=600, hi=1500)
    off = run_generation_worker(replace(SMALL, trail_page=False), HISTORY, keys)
    assert off.outputs == reference(SMALL, keys)
    assert_clean(off)


# -- the quality signal ----------------------------------------------------------------------------------------
def _other_requests_rows(group: int, read_rows: torch.Tensor) -> torch.Tensor:
    """Hand every row the (rebased) block-table row of the next request in the batch."""
    return read_rows.roll(1, dims=0)


def test_misaddressed_drafter_reads_lower_acceptance():
    keys = random_keys(16, 4, lo=400, hi=900)
    good = run_aggregated(SMALL, HISTORY, keys, concurrency=2)
    bad = run_aggregated(SMALL, HISTORY, keys, concurrency=2, hook=_other_requests_rows)
    assert good.stats.acceptance_length > 4.0
    assert bad.stats.acceptance_length < 0.5 * good.stats.acceptance_length
    # verification is greedy: wrong drafts cost speed, never correctness
    assert bad.outputs == good.outputs == reference(SMALL, keys)
    # and the ownership checker sees the misaddressing
    assert bad.stats.foreign_page_accesses > 0


def draft_check(setup: SimSetup, run: Run, *, from_prompt: bool = True) -> tuple[int, int]:
    """(right, wrong) drafts among those the phrase bank decides, derived from the prompts alone.

    The drafter's query j finds an earlier occurrence q of the bonus token in its context
    and drafts the token j places after q. When the bonus is token i of a phrase and
    i + j < phrase length, that token is the phrase's token i + j whichever occurrence
    was found. A draft is decided when such an occurrence lies well inside the drafter's
    window (and, on a generation worker whose slot starts empty, after the prompt).
    """
    margin = setup.draft_window - setup.block_size - 8
    places = {}
    for rid, (seed, _) in enumerate(run.keys):
        bank = phrase_bank(seed, setup.vocab_size, 6, 24).tolist()
        places[rid] = (bank, {t: (k, i) for k, row in enumerate(bank) for i, t in enumerate(row)})
    right = wrong = 0
    for rid, seq, drafts in run.proposals:
        bank, where = places[rid]
        p = len(seq) - 1
        if seq[p] not in where:
            continue  # the target left the bank (a phrase end never seen in its window)
        k, i = where[seq[p]]
        first = max(0, p - margin) if from_prompt else max(run.keys[rid][1], p - margin)
        for j, d in enumerate(drafts, start=1):
            if i + j >= len(bank[k]):
                break
            if not any(seq[q] == seq[p] for q in range(first, p - j + 1)):
                continue
            if d == bank[k][i + j]:
                right += 1
            else:
                wrong += 1
    return right, wrong


@pytest.mark.parametrize("sizing", [HISTORY, LEGACY], ids=["history", "legacy"])
def test_drafts_continue_the_requests_own_phrases(sizing):
    keys = random_keys(22, 4, lo=400, hi=1400)
    run = run_aggregated(SMALL, sizing, keys, concurrency=2)
    right, wrong = draft_check(SMALL, run)
    assert right > 100
    assert wrong == 0
    bad = run_aggregated(SMALL, sizing, keys, concurrency=2, hook=_other_requests_rows)
    right, wrong = draft_check(SMALL, bad)
    assert wrong > 10 * right


def test_seeded_slots_on_a_generation_worker_draft_the_right_phrases():
    keys = random_keys(23, 3, lo=600, hi=1400)
    history = run_generation_worker(SMALL, HISTORY, keys)
    right, wrong = draft_check(SMALL, history, from_prompt=False)
    assert right > 20 and wrong == 0
    # the pre-fix slot-local drafter on the same worker reads pages it does not own
    legacy = run_generation_worker(SMALL, LEGACY, keys)
    right, wrong = draft_check(SMALL, legacy, from_prompt=False)
    assert wrong > 0


def test_the_read_rows_hook_sees_every_proposal():
    keys = random_keys(17, 2)
    calls = []

    def identity(group, rows):
        calls.append(tuple(rows.shape))
        return rows

    run = run_aggregated(SMALL, HISTORY, keys, concurrency=2, hook=identity)
    assert run.outputs == reference(SMALL, keys)
    assert len(calls) >= run.stats.generation_steps / 2
    assert_clean(run)


# -- warmup dummies -----------------------------------------------------------------------------------------
def test_history_sizing_warms_up_long_dummies():
    keys = random_keys(18, 2)
    run = run_aggregated(SMALL, HISTORY, keys, warmup=8000)
    assert run.stats.skipped_warmups == 0
    assert run.outputs == reference(SMALL, keys)
    assert_all_freed(run.executor)


def test_legacy_skips_a_long_warmup_on_a_windowed_draft_pool():
    ex = build_executor(SMALL, LEGACY, 2, 2)
    draft_total = ex.draft_manager.layer_groups[0].pool.total
    assert 8000 // SMALL.tokens_per_block > draft_total, "the legacy dummy cannot fit the whole length"
    assert ex.warmup(num_dummies=1, token_num=8000) is False
    assert ex.stats.skipped_warmups == 1
    assert_all_freed(ex)  # the target dummies made before the failure are freed too
    # a short warmup still runs, and the executor serves requests afterwards
    assert ex.warmup(num_dummies=2, token_num=200) is True
    assert ex.stats.skipped_warmups == 1
    keys = random_keys(19, 2)
    for rid, key in enumerate(keys):
        ex.add_request(rid, prompt(SMALL, key))
    ex.run()
    assert {keys[r]: o for r, o in ex.stats.outputs.items()} == reference(SMALL, keys)
    assert_all_freed(ex)


def test_history_warmup_is_not_skipped_where_legacy_is():
    hist = build_executor(SMALL, HISTORY, 2, 2)
    assert hist.warmup(num_dummies=2, token_num=8000) is True
    assert hist.stats.skipped_warmups == 0
    assert_all_freed(hist)


# -- pages per request ----------------------------------------------------------------------------------------
def test_peak_draft_pages_per_request_reaches_the_estimate_and_never_exceeds_it():
    keys = [(41, 3000), (42, 2100)]
    run = run_aggregated(SMALL, HISTORY, keys, concurrency=2)
    assert run.stats.peak_draft_pages_per_request == draft_pages_per_request(SMALL)
    gen = run_generation_worker(SMALL, HISTORY, keys, concurrency=2)
    assert 0 < gen.stats.peak_draft_pages_per_request <= draft_pages_per_request(SMALL)


# -- the Triton kernels in the loop ---------------------------------------------------------------------------
def test_executor_through_interpreted_triton_kernels(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    from tensorrt_llm_draftkv.kernels import _dispatch

    launches = []
    launch = _dispatch.launch
    monkeypatch.setattr(_dispatch, "launch", lambda name, *a, **k: (launches.append(name), launch(name, *a, **k))[1])
    keys = random_keys(20, 2, lo=200, hi=600)
    run = run_aggregated(replace(SMALL, max_new_tokens=24), HISTORY, keys, concurrency=2)
    assert launches, "the executor went through the Triton kernels"
    assert run.outputs == reference(replace(SMALL, max_new_tokens=24), keys)
    assert_clean(run)


@pytest.mark.cuda
def test_small_aggregated_scenario_on_cuda():
    setup = replace(SMALL, device="cuda")
    keys = random_keys(21, 3)
    for sizing in (HISTORY, LEGACY):
        run = run_aggregated(setup, sizing, keys)
        assert run.executor.target_manager.layer_groups[0].pool.layers[0].is_cuda
        assert run.stats.finished == 3
        assert run.outputs == reference(SMALL, keys)  # the CPU target-only reference
        assert_clean(run)
        assert run.stats.acceptance_length > 4.0
        assert_all_freed(run.executor)


# -- slot eviction and reseed (aggregated) ------------------------------------------------------------------
def test_aggregated_executor_evicts_and_reseeds_when_prompts_wait_for_a_row():
    """One batch row kept for prefill while prompts wait: generating requests take turns in the
    other row, so their drafter slots are evicted for the newcomers and reseeded when they return."""
    keys = random_keys(9, 5, lo=900, hi=1600)
    ex = build_executor(SMALL, HISTORY, 4, 2, reserve_context_row=True)
    run = Run(ex, keys)
    instrument(ex, run)
    for rid, key in enumerate(keys):
        ex.add_request(rid, prompt(SMALL, key))
    ex.run()
    assert run.stats.finished == len(keys)
    assert run.releases["evict"] > 0
    # every evicted request came back as a generation row and was seeded again
    assert run.generation_seeds >= run.releases["evict"]
    assert run.outputs == reference(SMALL, keys)
    assert_clean(run)
    assert_all_freed(run.executor)


def test_reserving_a_context_row_never_lets_generation_take_the_whole_batch():
    from draftkv_sim import Scheduler, SchedulerConfig
    from tensorrt_llm_draftkv.request import LlmRequest, LlmRequestState

    sched = Scheduler(SchedulerConfig(max_num_tokens=4096, max_num_requests=4, max_batch_size=2,
                                      chunk_size=512, max_draft_len=3, reserve_context_row=True))
    for rid in range(3):
        req = LlmRequest(rid, prompt_len=10, state=LlmRequestState.GENERATION_IN_PROGRESS)
        sched.active.append(req)
    sched.add(LlmRequest(9, prompt_len=2048))
    for _ in range(4):
        batch = sched.schedule()
        assert len(batch.generation_requests) == 1
        assert [r.py_request_id for r in batch.context_requests] == [9]
        batch.context_requests[0].advance_context_chunk(512)
    # the prompt is done: generation may use both rows again
    sched.active[-1].state = LlmRequestState.GENERATION_IN_PROGRESS
    assert len(sched.schedule().generation_requests) == 2
