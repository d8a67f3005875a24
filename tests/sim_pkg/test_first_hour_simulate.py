"""A new user's first hour with `simulate`: no silent success, no nonsense limits, no hidden overruns.

Bad inputs run the command in-process (`draftkv_sim.cli.main`) and
must stop before anything runs: exit status 2, one line naming the option.
"""
from __future__ import annotations

import json

import pytest

from draftkv_sim.cli import main

PROG = "python -m tensorrt_llm_draftkv simulate"


def usage_error(capsys, *argv: str) -> str:
    """Run the command in-process; it must refuse with status 2 and one line. Returns that line."""
    with pytest.raises(SystemExit) as exit_info:
        main(list(argv))
    assert exit_info.value.code == 2
    out, err = capsys.readouterr()
    assert out == "" and "Traceback" not in err
    lines = err.splitlines()
    assert len(lines) == 1, err
    assert lines[0].startswith(f"{PROG}: error: ")
    return lines[0]


# -- 1. silent success ------------------------------------------------------------------------------------------
def test_legacy_sizing_with_block_reuse_is_refused_not_an_empty_table(capsys):
    line = usage_error(capsys, "--sizing", "legacy", "--block-reuse", "joint", "--prompts", "1000,2000")
    assert "argument --sizing: legacy leaves nothing to run" in line
    assert "user-agg has block reuse joint, which runs under history sizing only" in line
    assert "--sizing history" in line and "--block-reuse off" in line


def test_legacy_sizing_of_a_history_only_run_is_refused(capsys):
    line = usage_error(capsys, "--sizing", "legacy", "--runs", "agg-16k", "--print-config")
    assert "legacy leaves nothing to run: agg-16k runs under history sizing only" in line


def test_history_sizing_with_block_reuse_still_runs(capsys):
    assert main(["--sizing", "history", "--block-reuse", "joint", "--prompts", "1000,2000", "--print-config"]) == 0


@pytest.mark.parametrize("content", [{"runs": []}, {}, {"chunk": 4096}])
def test_a_config_file_without_runs_is_refused_not_the_built_in_scenario(capsys, tmp_path, content):
    path = tmp_path / "mine.json"
    path.write_text(json.dumps(content))
    line = usage_error(capsys, "--config", str(path))
    assert f"argument --config: {path} has no runs" in line and "--prompts" in line


def test_a_config_file_without_runs_gives_the_geometry_of_prompts(capsys, tmp_path):
    path = tmp_path / "mine.json"
    path.write_text(json.dumps({"chunk": 4096, "runs": []}))
    assert main(["--config", str(path), "--prompts", "300", "--mode", "aggregated", "--print-config"]) == 0
    config = json.loads(capsys.readouterr().out)
    assert config["chunk"] == 4096 and [r["name"] for r in config["runs"]] == ["user-agg"]


# -- 9. small things ------------------------------------------------------------------------------------------
def _scenario_of(*argv: str):
    from draftkv_sim.cli import build_parser
    from draftkv_sim.cli_simulate import check_inputs

    return check_inputs(build_parser().parse_args(["simulate", *argv]))


def test_one_request_is_not_warned_about_resize_failures():
    from draftkv_sim.cli_simulate import scenario_notes

    assert scenario_notes(_scenario_of("--prompts", "1000", "--concurrency", "100")) == []
    assert scenario_notes(_scenario_of("--prompts", "1000x8", "--concurrency", "100")) == []  # 8 fit the 8-request pools


def test_more_requests_in_flight_than_the_pools_hold_are_warned_with_the_real_number():
    from draftkv_sim.cli_simulate import scenario_notes

    notes = scenario_notes(_scenario_of("--prompts", "1000x20", "--concurrency", "100", "--mode", "aggregated"))
    assert notes == [
        "note: run user-agg keeps 20 requests in flight in pools sized for 8 (--pool-requests): expect resize failures"
    ]


@pytest.mark.parametrize("argv", [("--print-config",), ("plan",)])
def test_a_closed_pipe_ends_quietly(argv):
    """`... | head`: the reader is gone before the command writes; no BrokenPipeError traceback."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    repo = Path(__file__).resolve().parents[2]
    read, write = os.pipe()
    os.close(read)  # nobody will read: the first write fails with EPIPE
    env = {**os.environ, "PYTHONPATH": str(repo), "OMP_NUM_THREADS": "1"}
    env.pop("TRITON_INTERPRET", None)
    try:
        proc = subprocess.run(
            [sys.executable, "-m", "tensorrt_llm_draftkv", *argv],
            stdout=write, stderr=subprocess.PIPE, text=True, env=env, cwd=repo, timeout=120,
        )
    finally:
        os.close(write)
    assert "Traceback" not in proc.stderr and "BrokenPipeError" not in proc.stderr, proc.stderr
    assert proc.stderr == ""


def test_the_resize_diagnostic_says_its_windows_include_the_trail_page():
    from tensorrt_llm_draftkv.manager.diagnostics import pool_diagnostic

    text = pool_diagnostic({}, (1056,), (3,), (10,))
    assert "include its trail page" in text.splitlines()[0] and "[1056]" in text


# -- 2. a legacy run that only looks healthy ------------------------------------------------------------------
def test_a_request_over_its_estimate_shows_in_the_events_and_the_json(tmp_path):
    """A 70k prompt under legacy sizing finishes 2/2, but holds 7x its charge: a pool sized for 8 such
    requests holds one. The table's events and the JSON say so; the history row stays clean."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    repo = Path(__file__).resolve().parents[2]
    env = {**os.environ, "PYTHONPATH": str(repo), "OMP_NUM_THREADS": "1"}
    env.pop("TRITON_INTERPRET", None)
    out = tmp_path / "runs.json"
    proc = subprocess.run(
        [sys.executable, "-m", "tensorrt_llm_draftkv", "--prompts", "70001,5000", "--draft-window", "1024",
         "--mode", "aggregated", "--max-new-tokens", "8", "--quiet", "--json", str(out)],
        capture_output=True, text=True, env=env, cwd=repo, timeout=300,
    )
    assert proc.returncode == 0, proc.stderr
    records = {r["sizing"]: r for r in json.loads(out.read_text())}
    legacy, history = records["legacy"], records["history"]
    assert legacy["finished"] == 2 and legacy["resize_failures"] == 0  # it looks healthy...
    peak, est = legacy["peak_draft_pages_per_request"], legacy["estimated_draft_pages_per_request"]
    assert peak > est and legacy["peak_over_estimate"] is True  # ...but is not
    assert legacy["pool_requests"] == 8 and legacy["requests_pool_holds_at_peak"] == (8 * est) // peak < 8
    lines = proc.stdout.splitlines()
    at = next(i for i, line in enumerate(lines) if line.split()[:2] == ["user-agg", "legacy"])
    events = lines[at + 1]  # the compact table puts a row's events on the line below it
    assert events.startswith("    events: ") and f"over_est={peak}/{est}" in events
    assert f"pool_holds={(8 * est) // peak}/8" in events
    assert history["peak_over_estimate"] is False and history["requests_pool_holds_at_peak"] == 8
    at = next(i for i, line in enumerate(lines) if line.split()[:2] == ["user-agg", "history"])
    assert "events:" not in lines[at + 1]


def test_events_name_a_peak_over_the_estimate_first():
    from draftkv_sim.report import row_events
    from draftkv_sim.run_result import RunResult

    fields = dict(
        name="r", sizing="legacy", mode="aggregated", prompt_tokens=[1], finished=1, resize_failures=0,
        refused_requests=0, first_error="", foreign_page_accesses=0, stale_reads=0, unbacked_accesses=0,
        accounting_errors=0, slot_reseeds=0, max_seed_lag_tokens=5, peak_draft_pages_per_request=4376,
        estimated_draft_pages_per_request=578, acceptance_length=1.0, output_matches_target=True,
        skipped_warmups=0, tokens_per_s=1.0, wall_s=1.0,
    )
    r = RunResult(**fields, peak_over_estimate=True, pool_requests=8, requests_pool_holds_at_peak=1)
    assert row_events(r) == "over_est=4376/578 pool_holds=1/8 lag=5"
    within = RunResult(**{**fields, "peak_draft_pages_per_request": 578}, pool_requests=8,
                       requests_pool_holds_at_peak=8)
    assert row_events(within) == "lag=5"
