"""`simulate` with the engineer's own traffic and geometry, and its input checks.

Bad inputs go through the command line in-process (`draftkv_sim.cli.main`):
every one must stop before anything runs with exit status 2 and one line naming
the option, never a traceback. `--print-config` shows the scenario the options
build without running it. One small real run (`--prompts`, `--mode both`) goes
through a subprocess, as a user would start it.
"""
from __future__ import annotations

import json
import os
import importlib.util
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from tensorrt_llm_draftkv.config import SpeculativeDecodingMode
from draftkv_sim.cli import main
from draftkv_sim.scenario import (
    DEFAULT_SCENARIO,
    RunSpec,
    Scenario,
    ScenarioError,
    SimSetup,
    load_scenario,
    parse_prompt_list,
)

REPO = Path(__file__).resolve().parents[2]
HAVE_MATPLOTLIB = importlib.util.find_spec("matplotlib") is not None
PROG = "python -m tensorrt_llm_draftkv simulate"
SMALL = [
    "--tokens-per-block", "16", "--draft-window", "256", "--target-window", "256", "--chunk", "512",
    "--max-new-tokens", "16", "--pool-requests", "4",
]


def usage_error(capsys, *argv: str) -> str:
    """Run the command in-process; it must refuse with status 2 and one line. Returns that line."""
    with pytest.raises(SystemExit) as exit_info:
        main(list(argv))
    assert exit_info.value.code == 2
    out, err = capsys.readouterr()
    assert out == ""
    assert "Traceback" not in err
    lines = err.splitlines()
    assert len(lines) == 1, err
    assert lines[0].startswith(f"{PROG}: error: ")
    return lines[0]


def printed_config(capsys, *argv: str) -> dict:
    """The scenario the options build (`--print-config`: nothing runs)."""
    assert main([*argv, "--print-config"]) == 0
    out, err = capsys.readouterr()
    return json.loads(out)


# -- --prompts LIST ---------------------------------------------------------------------------------------------
def test_prompt_list_expands_copies():
    assert parse_prompt_list("131071,262144x4") == (131071, 262144, 262144, 262144, 262144)
    assert parse_prompt_list(" 1023 , 7X2,1") == (1023, 7, 7, 1)


@pytest.mark.parametrize(
    "text, item",
    [
        ("131071,x3", "'x3'"),
        ("1023,2049x", "'2049x'"),
        ("1023,abc", "'abc'"),
        ("1023,1.5", "'1.5'"),
        ("1023,-4", "'-4'"),
        ("1023,0", "'0'"),
        ("1023,12x0", "'12x0'"),
        ("1023,,2049", "empty item"),
        ("1023,", "empty item"),
        ("4x2x2", "'4x2x2'"),
    ],
)
def test_bad_prompt_items_are_named(capsys, text, item):
    with pytest.raises(ValueError, match=item):
        parse_prompt_list(text)
    line = usage_error(capsys, "--prompts", text)
    assert "argument --prompts:" in line and item in line


def test_prompts_build_one_run_per_mode(capsys):
    config = printed_config(capsys, "--prompts", "131071,262144x4", "--mode", "both", "--concurrency", "3")
    assert [(r["name"], r["mode"]) for r in config["runs"]] == [
        ("user-agg", "aggregated"),
        ("user-disagg", "disaggregated"),
    ]
    for run in config["runs"]:
        assert run["prompts"] == [131071] + [262144] * 4 and run["max_concurrency"] == 3
    (run,) = printed_config(capsys, "--prompts", "100x12", "--mode", "disaggregated")["runs"]
    assert run["name"] == "user-disagg"
    assert run["max_concurrency"] == DEFAULT_SCENARIO.setup.pool_requests  # at most what the pools are sized for


# -- every bad input is refused up front, naming the option -------------------------------------------------------
def test_a_negative_max_new_tokens_is_refused_with_the_exact_message(capsys):
    line = usage_error(capsys, "--max-new-tokens", "-5")
    assert line.endswith("error: argument --max-new-tokens: must be >= 1, got -5")


@pytest.mark.parametrize(
    "option, value, message",
    [
        ("--tokens-per-block", "0", "must be >= 1, got 0"),
        ("--chunk", "-512", "must be >= 1, got -512"),
        ("--max-draft-len", "0", "must be >= 1, got 0"),
        ("--pool-requests", "0", "must be >= 1, got 0"),
        ("--concurrency", "0", "must be >= 1, got 0"),
        ("--drafter-slots", "-1", "must be >= 1, got -1"),
        ("--max-seq-len", "0", "must be >= 1, got 0"),
        ("--draft-window", "-1", "must be >= 0, got -1"),
        ("--target-window", "-8", "must be >= 0, got -8"),
        ("--max-new-tokens", "ten", "must be an integer, got 'ten'"),
        ("--chunk", "1.5", "must be an integer, got '1.5'"),
        ("--drafter", "pard", "dflash or dspark"),
        ("--mode", "agg", "invalid choice"),
        ("--sizing", "new", "invalid choice"),
        ("--transport", "ucx", "must be auto, nixl or torch, got 'ucx'"),
    ],
)
def test_bad_option_values_are_refused(capsys, option, value, message):
    line = usage_error(capsys, option, value)
    assert f"argument {option}: " in line and message in line


def test_nixl_where_it_cannot_import_is_a_one_line_error_naming_why(capsys, monkeypatch):
    from tensorrt_llm_draftkv.transfer import nixl_agent

    monkeypatch.setattr(nixl_agent, "nixl_unavailable", lambda: "No module named 'nixl'")
    line = usage_error(capsys, "--transport", "nixl")
    assert "argument --transport: nixl cannot run here: No module named 'nixl'" in line


def test_the_transport_is_a_scenario_key(capsys):
    assert printed_config(capsys, "--transport", "torch")["transport"] == "torch"
    assert printed_config(capsys)["transport"] == "auto"


def test_a_missing_output_folder_fails_before_anything_runs(capsys, tmp_path, monkeypatch):
    import draftkv_sim.simulate as simulate_module

    def must_not_run(*args, **kwargs):
        raise AssertionError("the simulation started before the output path was checked")

    monkeypatch.setattr(simulate_module, "simulate", must_not_run)
    missing = tmp_path / "no-such-folder"
    for option, name in (("--json", "runs.json"), ("--plot", "occupancy.png")):
        line = usage_error(capsys, option, str(missing / name))
        assert f"argument {option}: folder {missing} does not exist" in line
    assert not missing.exists()


def test_output_paths_must_be_writable_files(capsys, tmp_path):
    line = usage_error(capsys, "--json", str(tmp_path))
    assert "argument --json:" in line and "is a folder" in line
    a_file = tmp_path / "file"
    a_file.write_text("")
    line = usage_error(capsys, "--json", str(a_file / "runs.json"))
    assert "argument --json:" in line and "is not a folder" in line
    if os.geteuid() != 0:  # root writes anywhere
        locked = tmp_path / "locked"
        locked.mkdir(mode=0o500)
        line = usage_error(capsys, "--json", str(locked / "runs.json"))
        assert "argument --json:" in line and "not writable" in line


@pytest.mark.skipif(not HAVE_MATPLOTLIB, reason="matplotlib is the optional 'plot' extra")
def test_a_plot_file_must_name_an_image_format(capsys, tmp_path):
    line = usage_error(capsys, "--plot", str(tmp_path / "occupancy.txt"))
    assert "argument --plot:" in line and "ending in .png" in line


def test_without_matplotlib_a_plot_is_refused_before_anything_runs(capsys, tmp_path, monkeypatch):
    # Hide the extra whether or not this machine has it: a None entry makes `import matplotlib` fail.
    for name in [m for m in sys.modules if m == "matplotlib" or m.startswith("matplotlib.")]:
        monkeypatch.delitem(sys.modules, name)
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    for suffix in (".png", ".txt"):  # the missing extra is named before the file's format is judged
        line = usage_error(capsys, "--plot", str(tmp_path / f"occupancy{suffix}"))
        assert "--plot needs matplotlib (pip install -e '.[plot]')" in line
    assert not (tmp_path / "occupancy.png").exists()


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has CUDA")
def test_cuda_without_cuda_is_a_one_line_error(capsys):
    line = usage_error(capsys, "--device", "cuda")
    assert "argument --device: cuda:" in line and "use --device cpu" in line
    line = usage_error(capsys, "--device", "tpu")
    assert "argument --device: unknown device 'tpu'" in line


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has CUDA")
def test_cuda_without_cuda_from_the_shell():
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(
        [sys.executable, "-m", "tensorrt_llm_draftkv", "--device", "cuda"],
        cwd=REPO, env=env, capture_output=True, text=True, timeout=120,
    )
    assert proc.returncode == 2
    assert proc.stdout == "" and "Traceback" not in proc.stderr
    assert proc.stderr.count("\n") == 1 and "error: argument --device: cuda:" in proc.stderr


def test_unknown_run_names_are_listed(capsys):
    line = usage_error(capsys, "--runs", "disagg-16k", "no-such-run")
    assert "argument --runs: unknown run(s) ['no-such-run']" in line and "disagg-long" in line
    line = usage_error(capsys, "--prompts", "1023", "--runs", "disagg-16k")
    assert "unknown run(s) ['disagg-16k']" in line and "user-agg" in line


def test_a_prompt_longer_than_max_seq_len_is_refused(capsys):
    line = usage_error(capsys, "--prompts", "600000", "--mode", "aggregated")
    assert "argument --max-seq-len:" in line and "600000" in line
    assert printed_config(capsys, "--prompts", "600000", "--max-seq-len", "600200")["max_seq_len"] == 600200


def test_contradicting_target_windows_are_refused(capsys):
    line = usage_error(capsys, "--full-attention-target", "--target-window", "512")
    assert "argument --full-attention-target:" in line


# -- --config -----------------------------------------------------------------------------------------------------
def test_the_default_scenario_is_the_shipped_config_and_unchanged():
    shipped = json.loads((REPO / "draftkv_sim" / "default_scenario.json").read_text())
    assert shipped == DEFAULT_SCENARIO.to_dict()
    # The scenario written out in Python (notes aside): every disaggregated run follows its aggregated
    # twin over exactly the same prompts (agg-long takes disagg-long's), the twins under history only.
    twin = {"sizings": ("history",)}
    before = Scenario(
        SimSetup(),
        (
            RunSpec("agg-16k", "aggregated", (1000, 16385), 2, **twin),
            RunSpec("disagg-16k", "disaggregated", (1000, 16385), 2),
            RunSpec("agg-long", "aggregated", (32768, 131071, 262145, 524287), 3, drafter_slots=2),
            RunSpec("disagg-long", "disaggregated", (32768, 131071, 262145, 524287), 2),
            RunSpec(
                "agg-evict", "aggregated", (1023, 2049, 3001, 4095, 5119), 4, drafter_slots=2, max_new_tokens=48,
                reserve_context_row=True, **twin,
            ),
            RunSpec(
                "disagg-evict", "disaggregated", (1023, 2049, 3001, 4095, 5119), 4, drafter_slots=2, max_new_tokens=48
            ),
            RunSpec("agg-window", "aggregated", (1023, 4095, 8191), 3, draft_window=256, max_new_tokens=384, **twin),
            RunSpec("disagg-window", "disaggregated", (1023, 4095, 8191), 3, draft_window=256, max_new_tokens=384),
            # Four prompts sharing a 64k-token prefix, without reuse, with target-only and with joint reuse.
            *(
                RunSpec(
                    f"{short}-prefix{suffix}", mode, (517, 1031, 2053, 4099), 4, max_new_tokens=64, shared_prefix=65536,
                    block_reuse=reuse, **twin,
                )
                for mode, short in (("aggregated", "agg"), ("disaggregated", "disagg"))
                for reuse, suffix in (("off", ""), ("target", "-reuse"), ("joint", "-joint"))
            ),
        ),
    )
    assert replace(DEFAULT_SCENARIO, runs=tuple(replace(r, note="") for r in DEFAULT_SCENARIO.runs)) == before
    assert DEFAULT_SCENARIO.setup.drafter_handoff.value == "window" and DEFAULT_SCENARIO.setup.handoff_form.value == "kv"
    assert DEFAULT_SCENARIO.setup.block_reuse == "off"


def test_config_round_trip(capsys, tmp_path):
    path = tmp_path / "scenario.json"
    path.write_text(json.dumps(DEFAULT_SCENARIO.to_dict(), indent=2))
    assert load_scenario(path) == DEFAULT_SCENARIO
    assert printed_config(capsys, "--config", str(path)) == DEFAULT_SCENARIO.to_dict()
    assert printed_config(capsys) == DEFAULT_SCENARIO.to_dict()  # no --config: the same scenario


def test_flags_override_the_config_file_and_the_runs_own_values(capsys, tmp_path):
    path = tmp_path / "mine.json"
    path.write_text(json.dumps({
        "tokens_per_block": 16, "draft_window": 0, "drafter": "dspark",
        "runs": [{"name": "mine", "mode": "aggregated", "prompts": "300x2,700", "max_concurrency": 2,
                  "max_new_tokens": 8, "drafter_slots": 1}],
    }))
    scenario = load_scenario(path)
    assert scenario.setup.draft_window is None and scenario.setup.drafter is SpeculativeDecodingMode.DSPARK
    assert scenario.runs[0].prompts == (300, 300, 700)
    config = printed_config(capsys, "--config", str(path), "--chunk", "512", "--max-new-tokens", "4")
    assert config["chunk"] == 512 and config["tokens_per_block"] == 16 and config["drafter"] == "dspark"
    assert config["max_new_tokens"] == 4
    (run,) = config["runs"]
    assert "max_new_tokens" not in run and run["drafter_slots"] == 1  # the flag wins over the run's own
    # A file without runs gives the geometry of --prompts' runs (and is refused without --prompts).
    path.write_text(json.dumps({"chunk": 4096}))
    config = printed_config(capsys, "--config", str(path), "--prompts", "300", "--drafter-slots", "3")
    assert [r["name"] for r in config["runs"]] == ["user-agg", "user-disagg"]
    assert config["chunk"] == 4096 and config["drafter_slots"] == 3


def test_shared_prefix_and_block_reuse_flags(capsys):
    config = printed_config(
        capsys, "--prompts", "517,1031x2", "--shared-prefix", "65536", "--block-reuse", "joint", "--mode", "aggregated"
    )
    (run,) = config["runs"]
    assert config["block_reuse"] == "joint"
    assert run["shared_prefix"] == 65536 and run["prompts"] == [517, 1031, 1031]
    # the flag wins over the runs' own block_reuse (the default's shared-prefix runs), on the runs themselves
    config = printed_config(capsys, "--block-reuse", "target", "--runs", "agg-prefix-joint")
    assert config["block_reuse"] == "off" and config["runs"][0]["block_reuse"] == "target"
    line = usage_error(capsys, "--shared-prefix", "1024")
    assert "argument --shared-prefix: needs --prompts" in line
    line = usage_error(capsys, "--prompts", "517", "--shared-prefix", "1024")
    assert "argument --shared-prefix:" in line and "needs >= 2 prompts" in line
    line = usage_error(capsys, "--block-reuse", "on")
    assert "argument --block-reuse: must be off, target, target-all or joint, got 'on'" in line
    line = usage_error(capsys, "--prompts", "517,1031", "--shared-prefix", "600000")
    assert "argument --max-seq-len:" in line and "600000" not in line and "601031" in line


RUN = {"name": "a", "mode": "aggregated", "prompts": [10], "max_concurrency": 1}


@pytest.mark.parametrize(
    "content, field",
    [
        ('{"chunk": 512,', "not valid JSON"),
        ([1, 2], "JSON object"),
        ({"tokens_per_blok": 16}, "field tokens_per_blok: unknown field"),
        ({"tokens_per_block": 0}, "field tokens_per_block: must be >= 1, got 0"),
        ({"max_new_tokens": "8"}, "field max_new_tokens: must be an integer"),
        ({"trail_page": "yes"}, "field trail_page:"),
        ({"drafter": "mtp"}, "field drafter:"),
        ({"vocab_size": 100}, "field vocab_size: must be >= 144"),
        ({"runs": {}}, "field runs:"),
        ({"runs": [{k: v for k, v in RUN.items() if k != "max_concurrency"}]}, "field runs[0].max_concurrency"),
        ({"runs": [{**RUN, "mode": "agg"}]}, "field runs[0].mode"),
        ({"runs": [{**RUN, "prompts": "10,x"}]}, "field runs[0].prompts: bad item 'x'"),
        ({"runs": [{**RUN, "prompts": [10, 0]}]}, "field runs[0].prompts[1]: must be >= 1"),
        ({"runs": [{**RUN, "color": 1}]}, "field runs[0].color: unknown field"),
        ({"runs": [RUN, RUN]}, "field runs[1].name: run name 'a' is used twice"),
    ],
)
def test_a_bad_config_file_is_refused_naming_the_field(capsys, tmp_path, content, field):
    path = tmp_path / "bad.json"
    path.write_text(content if isinstance(content, str) else json.dumps(content))
    line = usage_error(capsys, "--config", str(path))
    assert f"argument --config: {path}" in line and field in line
    if "field " in field:
        with pytest.raises(ScenarioError):
            load_scenario(path)


def test_an_unreadable_config_file_is_refused(capsys, tmp_path):
    line = usage_error(capsys, "--config", str(tmp_path / "none.json"))
    assert "argument --config: cannot read" in line and "No such file" in line
    line = usage_error(capsys, "--config", str(tmp_path))
    assert "argument --config: cannot read" in line


# -- a small real run -----------------------------------------------------------------------------------------------
def test_own_prompts_in_both_modes_finish_clean_under_history(tmp_path):
    js = tmp_path / "runs.json"
    env = os.environ.copy()
    env.pop("TRITON_INTERPRET", None)  # the kernels' torch reference, as the command runs outside pytest
    env["OMP_NUM_THREADS"] = "1"
    proc = subprocess.run(
        [sys.executable, "-m", "tensorrt_llm_draftkv", "--prompts", "1023,2049", "--mode", "both", *SMALL,
         "--sizing", "history", "--wide", "--json", str(js)],
        cwd=REPO, env=env, capture_output=True, text=True, timeout=240,
    )
    assert proc.returncode == 0, proc.stderr
    assert "Traceback" not in proc.stderr
    rows = {}
    for line in proc.stdout.splitlines():
        cells = line.split()
        if len(cells) >= 11 and cells[0].startswith("user-"):
            rows[cells[0], cells[1]] = cells
    assert list(rows) == [("user-agg", "history"), ("user-disagg", "history")]
    for cells in rows.values():
        assert cells[3] == "2/2" and cells[4] == "0" and cells[5] == "0"  # finished, resize fail, foreign
        peak, est = map(int, cells[6].split("/"))
        assert peak <= est
        assert cells[10] == "yes"
    records = json.loads(js.read_text())
    assert [(r["name"], r["mode"]) for r in records] == [("user-agg", "aggregated"), ("user-disagg", "disaggregated")]
    for r in records:
        assert r["sizing"] == "history" and r["drafter"] == "dflash" and r["trail_page"] is True
        assert r["device"] == "cpu" and r["max_concurrency"] == 2 and r["prompt_tokens"] == [1023, 2049]
        assert r["finished"] == 2 and r["foreign_page_accesses"] == 0 and r["output_matches_target"] is True
        setup = r["setup"]
        assert setup["tokens_per_block"] == 16 and setup["draft_window"] == 256 and setup["target_window"] == 256
        assert setup["chunk"] == 512 and setup["max_new_tokens"] == 16 and setup["pool_requests"] == 4
        assert setup["max_draft_len"] == 7 and setup["drafter"] == "dflash"
        assert SimSetup.from_dict(setup).to_dict() == setup  # the record's geometry is a --config setup
