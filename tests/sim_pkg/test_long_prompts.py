"""The long-prompt acceptance of issue 6 on the embedded default scenario (CPU, tiny dimensions).

One module-scoped computation runs the default's `agg-long` and `disagg-long`
runs under both sizings through `run_one` (the function `simulate` calls for
each row) and every test reads it. Whether each run equals the target-only
output is asserted on the command's own table (test_cli.py, which runs
the whole default), and the `disagg-16k` foreign-page contrast on its JSON.
"""
from __future__ import annotations

import os
import pickle
import re

import pytest
import torch
from filelock import FileLock

from draftkv_sim.scenario import DEFAULT_SCENARIO, prompt_seeds
from draftkv_sim.run_build import draft_pages_per_request
from draftkv_sim.simulate import run_one
from tensorrt_llm_draftkv.manager.rules import MirrorSizing

pytestmark = pytest.mark.slow

SETUP = DEFAULT_SCENARIO.setup
RUNS = {spec.name: spec for spec in DEFAULT_SCENARIO.runs}
FIRST_131K = 131071  # the first long prompt: one short of 2^17, so not a page multiple
RESIZE_ERROR = re.compile(
    r"^Draft KV cache context resize failed for request (\d+): could not resize to (\d+) tokens"
)


def _compute_long_runs() -> dict:
    threads = torch.get_num_threads()
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("TRITON_INTERPRET", "0")  # the kernels' torch reference, as the command runs on a CPU
        mp.setenv("OMP_NUM_THREADS", "1")  # the spawned ranks too: no oversubscription under -n 2
        torch.set_num_threads(1)
        try:
            out = {}
            for name in ("agg-long", "disagg-long"):
                for sizing in (MirrorSizing.HISTORY, MirrorSizing.LEGACY):
                    out[name, sizing.value] = run_one(SETUP, RUNS[name], sizing)
            return out
        finally:
            torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def long_runs(tmp_path_factory):
    """Computed once per test session, also under pytest-xdist (the workers share it through a file)."""
    if not os.environ.get("PYTEST_XDIST_WORKER"):
        return _compute_long_runs()
    shared = tmp_path_factory.getbasetemp().parent / "executor_long_runs.pkl"
    with FileLock(str(shared) + ".lock"):
        if shared.is_file():
            return pickle.loads(shared.read_bytes())
        out = _compute_long_runs()
        shared.write_bytes(pickle.dumps(out))
        return out


def test_the_default_scenario_is_the_one_the_issue_describes():
    assert set(RUNS) >= {"disagg-16k", "agg-long", "disagg-long"}
    for name in ("agg-long", "disagg-long"):
        assert max(RUNS[name].prompts) == 524287
        assert {32768, 131071, 262145, 524287} <= set(RUNS[name].prompts)
        assert any(n % SETUP.tokens_per_block for n in RUNS[name].prompts)  # seeds with a nonzero lag
    evict = RUNS["disagg-evict"]
    assert evict.mode == "disaggregated" and evict.drafter_slots < evict.max_concurrency
    assert RUNS["agg-long"].mode == "aggregated"
    assert RUNS["disagg-long"].mode == "disaggregated"
    assert SETUP.draft_window < FIRST_131K


@pytest.mark.parametrize("name", ["agg-long", "disagg-long"])
def test_legacy_dies_at_the_first_131k_prompt(long_runs, name):
    stats, _ = long_runs[name, "legacy"]
    prompts = RUNS[name].prompts
    assert stats.resize_failures == 1
    assert stats.finished < len(prompts)
    m = RESIZE_ERROR.match(stats.first_error)
    assert m, stats.first_error
    rid, wanted = int(m.group(1)), int(m.group(2))
    assert rid == prompts.index(FIRST_131K), "the first 131,071-token request is the one that dies"
    # the pre-fix sizing asks for the whole prompt at once: start 0 + whole prompt + drafts + extra
    assert wanted == FIRST_131K + SETUP.max_draft_len + SETUP.draft_extra_tokens
    assert stats.first_error.endswith("(history unchanged)"), "legacy sizing never passes a history"
    assert all(prompts[r] < FIRST_131K for r in stats.outputs), "nothing at or past 131k finished"


@pytest.mark.parametrize("name", ["agg-long", "disagg-long"])
def test_history_finishes_every_prompt_up_to_524k(long_runs, name):
    stats, _ = long_runs[name, "history"]
    prompts = RUNS[name].prompts
    assert stats.resize_failures == 0, stats.first_error
    assert stats.first_error == ""
    assert stats.finished == len(prompts)
    assert sorted(stats.outputs) == list(range(len(prompts)))
    assert all(len(out) == SETUP.max_new_tokens for out in stats.outputs.values())
    assert stats.foreign_page_accesses == 0
    assert stats.skipped_warmups == 0


def test_peak_draft_pages_per_request_against_the_estimate(long_runs):
    estimate = draft_pages_per_request(SETUP)
    agg, _ = long_runs["agg-long", "history"]
    disagg, _ = long_runs["disagg-long", "history"]
    assert agg.peak_draft_pages_per_request == estimate
    assert 0 < disagg.peak_draft_pages_per_request <= estimate
    # the legacy mirror of the 32k prompt alone is already past the estimate
    legacy, _ = long_runs["agg-long", "legacy"]
    assert legacy.peak_draft_pages_per_request > estimate


def test_disaggregated_output_equals_aggregated_output(long_runs):
    agg, agg_seeds = long_runs["agg-long", "history"]
    disagg, disagg_seeds = long_runs["disagg-long", "history"]
    by_seed_agg = {agg_seeds[rid]: out for rid, out in agg.outputs.items()}
    by_seed_disagg = {disagg_seeds[rid]: out for rid, out in disagg.outputs.items()}
    common = set(by_seed_agg) & set(by_seed_disagg)
    assert common == set(prompt_seeds(RUNS["disagg-long"].prompts)), "every disaggregated prompt also ran aggregated"
    assert len(common) == 4
    for seed in common:
        assert by_seed_disagg[seed] == by_seed_agg[seed], f"prompt seed {seed}"


def test_the_drafter_helps_on_long_prompts(long_runs):
    agg, _ = long_runs["agg-long", "history"]
    disagg, _ = long_runs["disagg-long", "history"]
    assert agg.acceptance_length > 4.0
    # the generation worker starts from the handed-over drafter context: the aggregated acceptance
    assert disagg.acceptance_length >= 0.97 * agg.acceptance_length
    assert disagg.handoff_seeds == len(RUNS["disagg-long"].prompts)


def test_the_handed_over_drafter_context_is_a_small_share_of_the_whole_prompt(long_runs):
    disagg, _ = long_runs["disagg-long", "history"]
    by_request = disagg.drafter_bytes_by_request
    assert sorted(m for m, _, _ in by_request.values()) == sorted(RUNS["disagg-long"].prompts)
    assert sum(sent for _, sent, _ in by_request.values()) == disagg.drafter_bytes_sent
    assert sum(full for _, _, full in by_request.values()) == disagg.full_drafter_bytes
    # every prompt (all longer than the window) gets W + P - 1 positions; the whole prompt would be m of them
    positions = SETUP.draft_window + SETUP.tokens_per_block - 1
    for m, sent, full in by_request.values():
        per_position = sent // positions
        assert per_position > 0 and sent == per_position * positions and full == per_position * m
        if m >= 131072:  # at most 5 % of the whole prompt's drafter context from 131,072 tokens on
            assert sent <= 0.05 * full, (m, sent, full)
