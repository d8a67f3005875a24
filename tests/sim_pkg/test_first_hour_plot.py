"""The plot compares like with like, and `--block-reuse` keeps each reuse run's twin without reuse."""
from __future__ import annotations

import json
from dataclasses import replace

import pytest

from draftkv_sim.cli import main


def printed_config(capsys, *argv: str) -> dict:
    assert main([*argv, "--print-config"]) == 0
    return json.loads(capsys.readouterr().out)


@pytest.mark.parametrize("mode", ["target", "target-all", "joint", "off"])
def test_block_reuse_replaces_the_mode_of_the_reuse_runs_and_keeps_their_twin(capsys, mode):
    config = printed_config(capsys, "--block-reuse", mode)
    runs = {r["name"]: r for r in config["runs"]}
    assert config["block_reuse"] == "off"
    for name in ("agg-prefix-reuse", "agg-prefix-joint", "disagg-prefix-reuse", "disagg-prefix-joint"):
        assert runs[name]["block_reuse"] == mode, name
    for name in ("agg-prefix", "disagg-prefix"):  # the twins without reuse stay without
        assert runs[name].get("block_reuse", "off") == "off", name
    for name in ("agg-16k", "disagg-long", "agg-window"):  # runs that never reused do not start to
        assert runs[name].get("block_reuse", "off") == "off", name


def test_target_all_rows_are_paired_with_the_twin_without_reuse():
    """What `pair_reuse_runs` pairs on (prompts, mode, sizing, geometry but reuse) holds for the flag's runs."""
    from draftkv_sim.cli import build_parser
    from draftkv_sim.cli_simulate import check_inputs

    scenario = check_inputs(build_parser().parse_args(["simulate", "--block-reuse", "target-all"]))
    by_name = {spec.name: spec for spec in scenario.runs}
    for name, twin in (("agg-prefix-reuse", "agg-prefix"), ("disagg-prefix-reuse", "disagg-prefix")):
        spec, base = by_name[name], by_name[twin]
        assert spec.setup_for(scenario.setup).block_reuse == "target-all"
        assert base.setup_for(scenario.setup).block_reuse == "off"
        assert (spec.prompts, spec.shared_prefix, spec.mode) == (base.prompts, base.shared_prefix, base.mode)
        assert replace(spec.setup_for(scenario.setup), block_reuse="off") == base.setup_for(scenario.setup)


def test_block_reuse_over_runs_that_never_reused_turns_it_on(capsys):
    config = printed_config(capsys, "--block-reuse", "joint", "--runs", "agg-prefix")
    assert config["runs"][0]["block_reuse"] == "joint"
    config = printed_config(capsys, "--block-reuse", "joint", "--prompts", "517,1031", "--shared-prefix", "4096")
    assert config["block_reuse"] == "joint"


# -- the estimate the plot draws -------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def clean_history_run():
    """A small aggregated history run of three requests, two in flight: clean, within its estimate."""
    from sim_pkg.sim_support import SMALL

    from tensorrt_llm_draftkv.manager.rules import MirrorSizing
    from draftkv_sim import RunSpec, Scenario
    from draftkv_sim.simulate import simulate

    scenario = Scenario(replace(SMALL, max_new_tokens=16), (RunSpec("agg", "aggregated", (700, 1500, 300), 2),))
    (result,) = simulate(scenario, [MirrorSizing.HISTORY])
    return result


def test_the_estimate_line_is_per_step_estimate_times_the_requests_holding_a_mirror(clean_history_run):
    from draftkv_sim.plot import estimate_curve

    r = clean_history_run
    assert r.finished == 3 and r.foreign_page_accesses == 0 and not r.peak_over_estimate
    curve = estimate_curve(r)
    counts = r.plot_trace.requests_per_step
    assert len(curve) == len(counts) == len(r.draft_pool_occupancy) > 0
    assert curve == [r.estimated_draft_pages_per_request * n for n in counts]
    assert max(counts) == 2  # two requests in flight: the sum over them is what the occupancy is compared with
    # a clean run never crosses the line it is drawn against (the per-request estimate alone it does cross)
    assert all(held <= charged for held, charged in zip(r.draft_pool_occupancy, curve))
    assert max(r.draft_pool_occupancy) > r.estimated_draft_pages_per_request


def test_without_a_per_step_count_the_line_is_the_estimate_times_the_requests_in_flight(clean_history_run):
    from draftkv_sim.plot import estimate_curve

    r = replace(clean_history_run, plot_trace=None)
    assert set(estimate_curve(r)) == {2 * r.estimated_draft_pages_per_request}
