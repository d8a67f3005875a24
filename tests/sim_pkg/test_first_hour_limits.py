"""One page-size rule and one window rule (`config.tokens_per_block_problem`, `config.window_problem`),
applied alike by `simulate` (flags and scenario files), `plan`, `KVPoolConfig.check_geometry` and
`PoolReport.to_pool_config`."""
from __future__ import annotations

import json

import pytest
import torch

from tensorrt_llm_draftkv.config import (
    MAX_TOKENS_PER_BLOCK,
    KVPoolConfig,
    LayerGroupConfig,
    check_pool_geometry,
    tokens_per_block_problem,
    window_problem,
)
from tensorrt_llm_draftkv.manager.planner import PoolGeometry, plan_pool
from draftkv_sim.cli import main
from draftkv_sim.scenario import ScenarioError, SimSetup


def error_line(capsys, *argv: str) -> str:
    with pytest.raises(SystemExit) as exit_info:
        main(list(argv))
    assert exit_info.value.code == 2
    out, err = capsys.readouterr()
    assert out == "" and len(err.splitlines()) == 1 and "Traceback" not in err, err
    return err.strip()


@pytest.mark.parametrize("p", [1, 2, 16, 32, 64, MAX_TOKENS_PER_BLOCK])
def test_powers_of_two_are_page_sizes(p):
    assert tokens_per_block_problem(p) is None


@pytest.mark.parametrize("p, text", [(33, "power of two"), (3, "power of two"), (0, ">= 1"), (-4, ">= 1"),
                                     (2 * MAX_TOKENS_PER_BLOCK, "power of two"), (True, "integer"), (4.0, "integer")])
def test_other_page_sizes_are_refused(p, text):
    assert text in tokens_per_block_problem(p)


def test_a_window_is_full_attention_or_at_least_one_page():
    assert window_problem(None, 32) is None and window_problem(32, 32) is None and window_problem(33, 32) is None
    assert "shorter than one page" in window_problem(16, 32)
    assert "shorter than one page" in window_problem(5, 32)


def test_simulate_and_plan_refuse_a_window_below_a_page_with_the_same_rule(capsys):
    sim = error_line(capsys, "--draft-window", "16", "--prompts", "1000")
    assert "argument --draft-window: a window of 16 tokens is shorter than one page" in sim
    assert "at least 32 tokens or 0 for full attention" in sim
    plan = error_line(capsys, "plan", "--window", "16")
    assert "argument --window: a window of 16 tokens is shorter than one page" in plan
    assert "at least 32 tokens or 0 for full attention" in plan
    sim = error_line(capsys, "--target-window", "16", "--prompts", "1000")
    assert "argument --target-window: a window of 16 tokens is shorter than one page" in sim


def test_simulate_and_plan_refuse_a_page_that_is_not_a_power_of_two(capsys):
    for argv in (("--tokens-per-block", "33", "--prompts", "1000"), ("plan", "--tokens-per-block", "33")):
        line = error_line(capsys, *argv)
        assert "argument --tokens-per-block: must be a power of two" in line and "got 33" in line


def test_a_window_below_a_page_is_refused_in_a_scenario_file(capsys, tmp_path):
    path = tmp_path / "mine.json"
    path.write_text(json.dumps({"draft_window": 16, "runs": []}))
    assert "field draft_window: a window of 16 tokens is shorter than one page" in error_line(
        capsys, "--config", str(path), "--prompts", "100"
    )
    run = {"name": "a", "mode": "aggregated", "prompts": [100], "max_concurrency": 1, "draft_window": 16}
    path.write_text(json.dumps({"runs": [run]}))
    line = error_line(capsys, "--config", str(path))
    assert "argument --config:" in line and "field runs[0].draft_window: a window of 16 tokens" in line
    path.write_text(json.dumps({"tokens_per_block": 33, "runs": [run]}))
    assert "field tokens_per_block: must be a power of two" in error_line(capsys, "--config", str(path))


def test_sim_setup_check_applies_the_rule():
    with pytest.raises(ScenarioError, match="draft_window: a window of 16 tokens is shorter than one page"):
        SimSetup(draft_window=16).check()
    with pytest.raises(ScenarioError, match="tokens_per_block: must be a power of two"):
        SimSetup(tokens_per_block=33).check()
    SimSetup(draft_window=None, tokens_per_block=64).check()


@pytest.mark.parametrize(
    "window, p, text",
    [(5, 32, "layer group 0: a window of 5 tokens is shorter than one page"),
     (None, 33, "tokens_per_block must be a power of two")],
)
def test_kv_pool_config_check_geometry_applies_the_rule(window, p, text):
    config = KVPoolConfig((LayerGroupConfig(1, window=window),), (4,), tokens_per_block=p)
    with pytest.raises(ValueError, match=text):
        config.check_geometry()
    with pytest.raises(ValueError, match=text):
        check_pool_geometry(p, (window,))


def test_kv_pool_config_check_geometry_passes_a_deployable_pool():
    config = KVPoolConfig((LayerGroupConfig(1, window=32), LayerGroupConfig(1)), (4, 4), tokens_per_block=32)
    assert config.check_geometry() is config


def test_a_plan_below_a_page_does_not_become_a_pool():
    geometry = PoolGeometry((LayerGroupConfig(1, window=8),), 1, 8, torch.float32, 32)
    report = plan_pool("draft", geometry, budget_bytes=1 << 24, max_seq_len=4096, chunk=512)
    with pytest.raises(ValueError, match="a window of 8 tokens is shorter than one page"):
        report.to_pool_config(geometry, max_seq_len=4096)
