"""`python -m tensorrt_llm_draftkv plan`: validation, defaults, budgets, both charges, tensor parallelism, --json.

Most tests run the command in-process (`sim.cli.main`) and read stdout/stderr with
capsys; a usage error is a `SystemExit(2)` whose message names the option. One
test runs the command as a user would (a subprocess) to see that bad input never
prints a traceback.
"""
from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tensorrt_llm_draftkv.config import LayerGroupConfig
from tensorrt_llm_draftkv.manager.admission import request_charge
from tensorrt_llm_draftkv.manager.budget import bytes_per_page
from draftkv_sim.cli import main

REPO = Path(__file__).resolve().parents[2]
KIB = 1 << 10
GIB = 1 << 30

#: The upstream figure: 5 windowed layers, 4 KV heads x 128, bf16, 32-token pages, a 4096-token window.
UPSTREAM = [
    "plan", "--drafter", "dspark", "--num-layers", "5", "--num-kv-heads", "4", "--head-dim", "128",
    "--dtype", "bf16", "--tokens-per-block", "32", "--window", "4096",
]
#: The simulator's draft geometry (DFlash, the default drafter): chunks of 8192, 7 drafts, 8 extra KV tokens.
DEFAULT_GEOMETRY = [
    "plan", "--window", "4096", "--tokens-per-block", "32", "--chunk", "8192", "--max-draft-len", "7",
    "--num-extra-kv-tokens", "8",
]
PAGE_BYTES = 5 * 2 * 4 * 128 * 2 * 32  # 320 KiB: one page of the upstream drafter


def run(capsys, *args: str) -> tuple[int, str, str]:
    """(exit code, stdout, stderr) of `plan` run in-process."""
    try:
        code = main(list(args))
    except SystemExit as exc:
        code = exc.code
    out, err = capsys.readouterr()
    return code, out, err


def rows(section: str) -> list[list[str]]:
    """The table's group rows, split on runs of two or more spaces."""
    found = []
    for line in section.splitlines():
        if line.split()[:1] and line.split()[0].isdigit():
            found.append(re.split(r"\s{2,}", line.strip()))
    return found


def plan_json(capsys, tmp_path: Path, *args: str, expect: int = 0) -> dict:
    path = tmp_path / "plan.json"
    code, _, err = run(capsys, *args, "--json", str(path))
    assert code == expect, err
    return json.loads(path.read_text())


# -- bad input: exit 2, the option named, no traceback -----------------------------------------------------
BAD = [
    (["--chunk", "-8"], "--chunk", "must be >= 1, got -8"),
    (["--chunk", "0"], "--chunk", "must be >= 1, got 0"),
    (["--pool-gib", "nan"], "--pool-gib", "finite"),
    (["--pool-gib", "inf"], "--pool-gib", "finite"),
    (["--pool-gib", "-1"], "--pool-gib", "must be > 0"),
    (["--pool-gib", "0"], "--pool-gib", "must be > 0"),
    (["--pool-gib", "lots"], "--pool-gib", "must be a number"),
    (["--num-layers", "-1"], "--num-layers", "must be >= 0, got -1"),
    (["--num-full-layers", "-2"], "--num-full-layers", "must be >= 0, got -2"),
    (["--num-kv-heads", "0"], "--num-kv-heads", "must be >= 1, got 0"),
    (["--num-kv-heads", "four"], "--num-kv-heads", "must be an integer, got 'four'"),
    (["--head-dim", "0"], "--head-dim", "must be >= 1, got 0"),
    (["--tokens-per-block", "0"], "--tokens-per-block", "must be >= 1, got 0"),
    (["--window", "-5"], "--window", "must be >= 0, got -5"),
    (["--max-seq-len", "0"], "--max-seq-len", "must be >= 1, got 0"),
    (["--max-draft-len", "-1"], "--max-draft-len", "must be >= 0, got -1"),
    (["--num-extra-kv-tokens", "-1"], "--num-extra-kv-tokens", "must be >= 0, got -1"),
    (["--tp", "0"], "--tp", "must be >= 1, got 0"),
    (["--tp", "-2"], "--tp", "must be >= 1, got -2"),
    (["--dtype", "int3"], "--dtype", "unknown dtype 'int3'"),
    (["--max-tokens", "0"], "--max-tokens", "must be >= 1, got 0"),
    (["--memory-fraction", "0", "--device-memory-gib", "80"], "--memory-fraction", "must be in (0, 1]"),
    (["--memory-fraction", "1.5", "--device-memory-gib", "80"], "--memory-fraction", "must be in (0, 1]"),
    (["--memory-fraction", "0.5", "--device-memory-gib", "nan"], "--device-memory-gib", "finite"),
    (["--target-num-layers", "-1"], "--target-num-layers", "must be >= 0, got -1"),
    (["--target-pool-gib", "inf"], "--target-pool-gib", "finite"),
    (["--drafter", "bogus"], "--drafter", "unknown speculative decoding mode 'bogus'"),
    # cross-option checks (parser.error after parsing, still exit 2)
    (["--num-layers", "0", "--num-full-layers", "0"], "--num-layers", "no layers"),
    (["--window", "16", "--tokens-per-block", "32"], "--window", "shorter than one page"),
    (["--target-num-layers", "2", "--target-window", "8"], "--target-window", "shorter than one page"),
    (["--memory-fraction", "0.5"], "--memory-fraction", "needs --device-memory-gib"),
    (["--device-memory-gib", "80"], "--device-memory-gib", "only with --memory-fraction"),
    (["--pool-gib", "2", "--max-tokens", "1024"], "--max-tokens", "not allowed with argument --pool-gib"),
    (["--max-tokens", "1024", "--memory-fraction", "0.5", "--device-memory-gib", "80"], "--memory-fraction",
     "not allowed"),
    (["--target-pool-gib", "2", "--target-max-tokens", "1024"], "--target-max-tokens", "not allowed"),
]


@pytest.mark.parametrize("args,option,text", BAD, ids=[" ".join(a) for a, _, _ in BAD])
def test_bad_input_is_a_usage_error_naming_the_option(capsys, args, option, text):
    code, out, err = run(capsys, "plan", *args)
    assert code == 2
    assert f"argument {option}:" in err
    assert text in err
    assert "Traceback" not in err
    assert out == ""  # refused before anything is computed


def test_a_missing_json_folder_is_refused_before_anything_is_computed(capsys, tmp_path):
    target = tmp_path / "no-such-folder" / "plan.json"
    code, out, err = run(capsys, *UPSTREAM, "--json", str(target))
    assert code == 2
    assert "argument --json" in err and str(target.parent) in err
    assert out == "" and not target.parent.exists()


def test_a_json_path_that_is_a_folder_is_refused(capsys, tmp_path):
    code, out, err = run(capsys, *UPSTREAM, "--json", str(tmp_path))
    assert code == 2 and "argument --json" in err and out == ""


@pytest.mark.parametrize("args", [["--chunk", "-8"], ["--pool-gib", "nan"], ["--num-layers", "0", "--num-full-layers", "0"]])
def test_bad_input_never_prints_a_traceback_from_the_real_command(args):
    env = dict(os.environ)
    env["PYTHONPATH"] = str(REPO) + os.pathsep + env.get("PYTHONPATH", "")
    proc = subprocess.run(
        [sys.executable, "-m", "tensorrt_llm_draftkv", "plan", *args],
        capture_output=True, text=True, cwd=REPO, env=env, timeout=120,
    )
    assert proc.returncode == 2
    assert f"argument {args[0]}:" in proc.stderr
    assert "Traceback" not in proc.stderr


def test_help_shows_the_defaults(capsys):
    code, out, _ = run(capsys, "plan", "--help")
    assert code == 0
    out = " ".join(out.split())  # help wraps to the terminal's width
    for text in ("(default: dflash)", "(default: 5)", "(default: 4096)", "(default: 8192)", "(default: 1.0)",
                 "(default: bfloat16)", "(default: 524288)", "(default: 7)", "--num-extra-kv-tokens", "--tp",
                 "--max-tokens", "--memory-fraction", "--device-memory-gib", "--json"):
        assert text in out, text
    # the target pool is off unless asked for
    assert "--target-num-layers TARGET_NUM_LAYERS windowed target layers (default: 0)" in out


# -- the upstream figure: just the draft pool -------------------------------------------------------------
def test_the_upstream_figure_prints_just_the_draft_pool(capsys):
    code, out, err = run(capsys, *UPSTREAM)
    assert code == 0, err
    assert "draft (dspark) pool (trail tokens per window: 32)" in out
    assert "target pool" not in out and "both pools" not in out
    ((row),) = rows(out)
    assert row[7] == "320 KiB" and row[8] == "0.78 %"
    assert "of which trail page 320 KiB" in out
    # 1 GiB buys 3276 pages of 320 KiB; 387 pages (unaligned) each: 8 requests
    assert row[-2:] == [str(GIB // PAGE_BYTES), str(GIB // PAGE_BYTES // 387)]
    assert f"max concurrency {GIB // PAGE_BYTES // 387} (unaligned charge; {GIB // PAGE_BYTES // 386} with the aligned)" in out


def test_the_target_pool_appears_when_asked_for(capsys):
    code, out, err = run(capsys, *UPSTREAM, "--target-num-layers", "2", "--target-pool-gib", "4")
    assert code == 0, err
    draft, target = out.split("target pool")
    assert "concurrent requests both pools hold:" in target
    draft_conc = int(re.search(r"max concurrency (\d+)", draft).group(1))
    target_conc = int(re.search(r"max concurrency (\d+)", target).group(1))
    assert f"concurrent requests both pools hold: {min(draft_conc, target_conc)}" in out


# -- a pool that cannot hold one request ---------------------------------------------------------------------
def test_a_pool_too_small_for_one_request_exits_1_naming_both_numbers(capsys):
    # 100 MiB buys 320 pages of 320 KiB; one request needs 387 (unaligned charge)
    code, out, err = run(capsys, *UPSTREAM, "--pool-gib", str(100 / 1024))
    assert code == 1
    assert "cannot hold one request" in err
    assert "the budget buys 320 pages" in err and "needs 387 pages" in err and "386 with the aligned" in err
    assert "group 0" in err and "Traceback" not in err
    assert "max concurrency 0" in out  # the report is still printed


def test_a_full_attention_group_too_big_for_max_tokens_is_named(capsys):
    code, _, err = run(capsys, *UPSTREAM, "--num-full-layers", "1", "--max-tokens", "65536")
    assert code == 1
    # the windowed group fits (2048 pages), the full-attention group (524288 / 32 pages) does not
    assert "group 1 (full attention, 1 layers): the budget buys 2048 pages" in err
    assert "needs 16384 pages" in err and "group 0" not in err


def test_a_target_pool_too_small_exits_1(capsys):
    code, _, err = run(capsys, *UPSTREAM, "--target-num-layers", "4", "--target-max-tokens", "1024")
    assert code == 1
    assert "the target pool cannot hold one request" in err and "the budget buys 32 pages" in err


# -- both charges --------------------------------------------------------------------------------------------
def test_the_default_geometry_shows_aligned_386_and_unaligned_387(capsys):
    group = LayerGroupConfig(5, window=4096)
    kw = dict(chunk=8192, max_seq_len=524288, max_draft_len=7, num_extra_kv_tokens=8, trail_tokens=32)
    (aligned,) = request_charge([group], 32, aligned=True, **kw)
    (unaligned,) = request_charge([group], 32, aligned=False, **kw)
    assert (aligned, unaligned) == (386, 387)  # the manager's own charge, both ways
    code, out, err = run(capsys, *DEFAULT_GEOMETRY)
    assert code == 0, err
    ((row),) = rows(out)
    assert row[3:5] == ["387", "386"]  # pages/req (unaligned, what concurrency uses), aligned
    aligned_line = next(line for line in out.splitlines() if line.strip().startswith("aligned charge"))
    unaligned_line = next(line for line in out.splitlines() if line.strip().startswith("unaligned charge"))
    assert "386 pages/request" in aligned_line
    assert "multiple of the chunk" in aligned_line and "from position 0" in aligned_line
    assert "fixed-chunk prefill" in aligned_line
    assert "387 pages/request" in unaligned_line
    assert "anywhere" in unaligned_line and "prefix computed elsewhere" in unaligned_line
    pool = GIB // PAGE_BYTES
    assert row[-2:] == [str(pool), str(pool // 387)]
    assert f"max concurrency {pool // 387} (unaligned charge; {pool // 386} with the aligned)" in out


def test_plans_aligned_charge_is_the_simulators(capsys):
    """The simulator sizes its draft pool with the aligned charge: plan shows that number beside the safe one."""
    from draftkv_sim.scenario import DEFAULT_SCENARIO
    from draftkv_sim.run_build import draft_pages_per_request

    s = DEFAULT_SCENARIO.setup
    code, out, err = run(
        capsys, "plan", "--drafter", s.drafter.label, "--window", str(s.draft_window),
        "--tokens-per-block", str(s.tokens_per_block), "--chunk", str(s.chunk), "--max-draft-len", str(s.max_draft_len),
        "--num-extra-kv-tokens", str(s.draft_extra_tokens), "--max-seq-len", str(s.max_seq_len),
    )
    assert code == 0, err
    ((row),) = rows(out)
    assert int(row[4]) == draft_pages_per_request(s)
    assert int(row[3]) - int(row[4]) in (0, 1)


def test_concurrency_uses_the_unaligned_charge_where_the_two_differ(capsys, tmp_path):
    # 386 pages hold one request at the aligned charge and none at the unaligned one
    report = plan_json(capsys, tmp_path, *DEFAULT_GEOMETRY, "--max-tokens", str(386 * 32), expect=1)
    (group,) = report["draft"]["groups"]
    assert group["pool_pages"] == 386
    assert group["max_concurrency"] == 0 and group["max_concurrency_aligned"] == 1
    assert report["max_concurrency"] == 0 and report["max_concurrency_aligned"] == 1
    assert report["errors"] and "needs 387 pages" in report["errors"][0]


# -- tensor parallelism ----------------------------------------------------------------------------------------
def test_tp_4_divides_the_per_request_bytes_by_4_for_4_heads(capsys, tmp_path):
    one = plan_json(capsys, tmp_path, *UPSTREAM)
    four = plan_json(capsys, tmp_path, *UPSTREAM, "--tp", "4")
    g1, g4 = one["draft"]["groups"][0], four["draft"]["groups"][0]
    assert g4["bytes_per_request"] == g1["bytes_per_request"] == 387 * PAGE_BYTES  # unsharded, unchanged
    assert g4["bytes_per_request_per_rank"] * 4 == g1["bytes_per_request_per_rank"] == 387 * PAGE_BYTES
    assert g4["page_bytes_per_rank"] == PAGE_BYTES // 4
    assert four["draft"]["kv_heads_per_rank"] == 1 and four["draft"]["tp"] == 4
    # the same GiB per rank buys four times the pages of a quarter of the size
    assert (g1["pool_pages"], g4["pool_pages"]) == (GIB // PAGE_BYTES, GIB // (PAGE_BYTES // 4))
    # the text shows both, side by side
    code, out, _ = run(capsys, *UPSTREAM, "--tp", "4")
    ((row),) = rows(out)
    assert row[5:7] == ["120.94 MiB", "30.23 MiB"]
    assert "per rank at tp 4: 30.23 MiB, 1 of 4 KV heads" in out


def test_tp_rounds_heads_per_rank_up(capsys, tmp_path):
    report = plan_json(capsys, tmp_path, *UPSTREAM, "--num-kv-heads", "6", "--tp", "4")
    assert report["draft"]["kv_heads_per_rank"] == 2
    g = report["draft"]["groups"][0]
    assert g["page_bytes_per_rank"] * 3 == g["page_bytes"]
    report = plan_json(capsys, tmp_path, *UPSTREAM, "--tp", "8")  # more ranks than heads: one head each
    assert report["draft"]["kv_heads_per_rank"] == 1


def test_extra_kv_tokens_widen_the_charge(capsys, tmp_path):
    plain = plan_json(capsys, tmp_path, *UPSTREAM, "--window", "4000")["draft"]["groups"][0]["pages_per_request"]
    extra = plan_json(capsys, tmp_path, *UPSTREAM, "--window", "4000", "--num-extra-kv-tokens", "64")
    assert extra["draft"]["groups"][0]["pages_per_request"]["unaligned"] == plain["unaligned"] + 2  # 64 tokens: 2 pages
    assert extra["inputs"]["num_extra_kv_tokens"] == 64


# -- budget forms ------------------------------------------------------------------------------------------------
def test_max_tokens_equal_to_what_pool_gib_buys_gives_the_same_pool(capsys, tmp_path):
    by_bytes = plan_json(capsys, tmp_path, *UPSTREAM, "--pool-gib", "2")
    pages = by_bytes["draft"]["groups"][0]["pool_pages"]
    assert pages == 2 * GIB // PAGE_BYTES
    by_tokens = plan_json(capsys, tmp_path, *UPSTREAM, "--max-tokens", str(pages * 32))
    assert by_tokens["draft"]["groups"][0]["pool_pages"] == pages
    assert by_tokens["max_concurrency"] == by_bytes["max_concurrency"]
    # token slots are rounded up to whole pages
    rounded = plan_json(capsys, tmp_path, *UPSTREAM, "--max-tokens", str(pages * 32 - 31))
    assert rounded["draft"]["groups"][0]["pool_pages"] == pages
    assert by_tokens["draft"]["budget"] == {"form": "max_tokens", "max_tokens": pages * 32}


def test_memory_fraction_of_a_device_equals_the_same_gib(capsys, tmp_path):
    by_bytes = plan_json(capsys, tmp_path, *UPSTREAM, "--pool-gib", "36")
    by_fraction = plan_json(capsys, tmp_path, *UPSTREAM, "--memory-fraction", "0.25", "--device-memory-gib", "144")
    assert by_fraction["draft"]["groups"] == by_bytes["draft"]["groups"]
    assert by_fraction["draft"]["budget"]["budget_bytes_per_rank"] == 36 * GIB
    assert by_fraction["draft"]["budget"]["form"] == "memory_fraction"


def test_max_tokens_gives_every_group_that_many_slots(capsys, tmp_path):
    report = plan_json(capsys, tmp_path, *UPSTREAM, "--num-full-layers", "2", "--max-seq-len", "65536",
                       "--max-tokens", "1000000")
    assert [g["pool_pages"] for g in report["draft"]["groups"]] == [31250, 31250]
    assert report["max_concurrency"] == min(31250 // 387, 31250 // 2048)


# -- --json --------------------------------------------------------------------------------------------------------
def test_json_holds_the_whole_report(capsys, tmp_path):
    path = tmp_path / "plan.json"
    code, out, err = run(capsys, *DEFAULT_GEOMETRY, "--target-num-layers", "3", "--target-num-full-layers", "1",
                         "--max-seq-len", "65536", "--tp", "2", "--json", str(path))
    assert code == 0, err
    report = json.loads(path.read_text())
    assert set(report) == {"inputs", "draft", "target", "max_concurrency", "max_concurrency_aligned", "errors"}
    inputs = report["inputs"]
    assert inputs["drafter"] == "dflash" and inputs["dtype"] == "bfloat16" and inputs["tp"] == 2
    assert inputs["window"] == 4096 and inputs["chunk"] == 8192 and inputs["num_extra_kv_tokens"] == 8
    assert inputs["target_num_layers"] == 3 and inputs["json"] == str(path)
    draft, target = report["draft"], report["target"]
    (g,) = draft["groups"]
    assert g["pages_per_request"] == {"aligned": 386, "unaligned": 387, "charged": 387}
    assert g["page_bytes"] == PAGE_BYTES and g["page_bytes_per_rank"] == PAGE_BYTES // 2
    assert g["bytes_per_request"] == 387 * PAGE_BYTES and g["bytes_per_request_per_rank"] == 387 * PAGE_BYTES // 2
    assert g["bytes_per_request_aligned"] == 386 * PAGE_BYTES
    assert g["trail_bytes_per_request"] == 320 * KIB and g["window"] == 4096 and g["num_layers"] == 5
    assert g["pool_pages"] == GIB // (PAGE_BYTES // 2) and draft["pool_pages"] == [g["pool_pages"]]
    assert g["max_concurrency"] == g["pool_pages"] // 387 and g["max_concurrency_aligned"] == g["pool_pages"] // 386
    assert draft["trail_tokens"] == 32 and draft["charge"] == "unaligned"
    assert draft["budget"] == {"form": "pool_gib", "pool_gib": 1.0, "budget_bytes_per_rank": GIB}
    assert [t["window"] for t in target["groups"]] == [4096, None]
    assert target["trail_tokens"] == 0 and target["kv_heads_per_rank"] == 4
    assert target["groups"][1]["pages_per_request"]["unaligned"] == 65536 // 32
    assert report["max_concurrency"] == min(draft["max_concurrency"], target["max_concurrency"])
    assert report["errors"] == []
    # the text says the same
    assert f"concurrent requests both pools hold: {report['max_concurrency']}" in out


def test_json_without_a_target_pool(capsys, tmp_path):
    report = plan_json(capsys, tmp_path, *UPSTREAM)
    assert report["target"] is None
    assert report["max_concurrency"] == report["draft"]["max_concurrency"] == GIB // PAGE_BYTES // 387


def test_json_is_written_when_the_pool_is_too_small(capsys, tmp_path):
    report = plan_json(capsys, tmp_path, *UPSTREAM, "--max-tokens", "32", expect=1)
    assert report["max_concurrency"] == 0
    assert "the budget buys 1 pages" in report["errors"][0]


@pytest.mark.parametrize(
    "args, text",
    [
        (("--pool-gib", "1e300"), "argument --pool-gib: must be <= 1048576 GiB (1 PiB), got 1e300"),
        (("--num-layers", "10" * 20), f"argument --num-layers: must be <= 10000, got {'10' * 20}"),
    ],
)
def test_huge_values_are_refused_naming_the_bound(capsys, args, text):
    code, out, err = run(capsys, *UPSTREAM, *args)
    assert code == 2 and out == "" and err.strip().endswith(text), err


def test_budget_bytes_of_plan_pool_and_the_page_size_agree():
    """The JSON's page bytes are the estimator's own."""
    page = bytes_per_page(LayerGroupConfig(5, window=4096), tokens_per_block=32, num_kv_heads=4, head_dim=128,
                          dtype=torch.bfloat16)
    assert page == PAGE_BYTES == 320 * KIB
