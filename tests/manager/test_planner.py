"""The `plan` verb: pages, bytes and concurrency for a geometry and a pool budget."""
from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tensorrt_llm_draftkv.__main__ import main
from tensorrt_llm_draftkv.config import LayerGroupConfig, SpeculativeDecodingMode
from tensorrt_llm_draftkv.manager.budget import bytes_per_page, group_pages_per_request
from tensorrt_llm_draftkv.manager.plan_format import format_bytes
from tensorrt_llm_draftkv.manager.planner import PoolGeometry, plan_pool, trail_tokens_for

WORKED = [
    "plan",
    "--drafter", "dspark",
    "--num-layers", "5",
    "--num-kv-heads", "4",
    "--head-dim", "128",
    "--dtype", "bfloat16",
    "--tokens-per-block", "32",
    "--window", "4096",
]
REPO = Path(__file__).resolve().parents[2]  # the repository root (tests/manager/ is two levels down)


def _row(out: str) -> list[str]:
    """The first group row of the table, split on runs of spaces."""
    for line in out.splitlines():
        cells = line.split()
        if cells and cells[0] == "0":
            return re.split(r"\s{2,}", line.strip())
    raise AssertionError(f"no group row in:\n{out}")


def test_plan_worked_figure(capsys):
    assert main(WORKED) == 0
    out = capsys.readouterr().out
    assert "320 KiB" in out
    assert "0.78 %" in out
    assert "trail tokens per window: 32" in out
    # the pages per request and the concurrency agree with the estimators (CLI defaults:
    # max seq 524288, chunk 8192, 7 drafts, 1 GiB)
    group = LayerGroupConfig(5, window=4096)
    pages = group_pages_per_request(4096, 32, max_seq_len=524288, chunk=8192, max_draft_len=7, trail_tokens=32)
    page_bytes = bytes_per_page(group, tokens_per_block=32, num_kv_heads=4, head_dim=128, dtype=torch.bfloat16)
    row = _row(out)
    assert row[3] == str(pages)
    pool_pages = (1 << 30) // page_bytes
    assert row[-2:] == [str(pool_pages), str(pool_pages // pages)]
    assert f"max concurrency {pool_pages // pages}" in out


def test_plan_without_trail_page(capsys):
    args = [a if a != "dspark" else "mtp" for a in WORKED]
    assert main(args) == 0
    out = capsys.readouterr().out
    assert "trail tokens per window: 0" in out
    assert "320 KiB" not in out and "0.78 %" not in out
    assert "of which trail page 0 B" in out


def test_plan_pages_drop_by_one_without_the_trail(capsys):
    main(WORKED)
    with_trail = int(_row(capsys.readouterr().out)[3])
    main([a if a != "dspark" else "pard" for a in WORKED])
    without = int(_row(capsys.readouterr().out)[3])
    assert with_trail == without + 1


def test_plan_subprocess():
    env = dict(os.environ)
    env["PYTHONPATH"] = str(REPO) + os.pathsep + env.get("PYTHONPATH", "")
    res = subprocess.run(
        [sys.executable, "-m", "tensorrt_llm_draftkv", *WORKED],
        capture_output=True, text=True, cwd=REPO, env=env, timeout=120,
    )
    assert res.returncode == 0, res.stderr
    assert "320 KiB" in res.stdout and "0.78 %" in res.stdout


def test_trail_tokens_for():
    windowed = PoolGeometry((LayerGroupConfig(5, window=4096),), 4, 128, torch.bfloat16, 32)
    full = PoolGeometry((LayerGroupConfig(5),), 4, 128, torch.bfloat16, 32)
    assert trail_tokens_for(SpeculativeDecodingMode.DSPARK, windowed, is_draft_pool=True) == 32
    assert trail_tokens_for(SpeculativeDecodingMode.DFLASH, windowed, is_draft_pool=True) == 32
    assert trail_tokens_for(SpeculativeDecodingMode.DFLASH, windowed, is_draft_pool=False) == 0
    assert trail_tokens_for(SpeculativeDecodingMode.DFLASH, full, is_draft_pool=True) == 0
    for mode in (SpeculativeDecodingMode.PARD, SpeculativeDecodingMode.MTP, SpeculativeDecodingMode.EAGLE3_ONE_MODEL):
        assert trail_tokens_for(mode, windowed, is_draft_pool=True) == 0
    assert trail_tokens_for(None, windowed, is_draft_pool=True) == 0


def test_plan_pool_splits_the_budget_and_charges_trail_only_on_windowed_groups():
    geometry = PoolGeometry(
        (LayerGroupConfig(5, window=4096), LayerGroupConfig(2)), 4, 128, torch.bfloat16, 32
    )
    report = plan_pool("draft", geometry, budget_bytes=8 << 30, max_seq_len=65536, chunk=8192, max_draft_len=7,
                       trail_tokens=32)
    windowed, full = report.groups
    page5 = 5 * 2 * 4 * 128 * 2 * 32
    page2 = 2 * 2 * 4 * 128 * 2 * 32
    assert windowed.trail_bytes_per_request == page5 and full.trail_bytes_per_request == 0
    assert full.pages_per_request == 65536 // 32
    assert report.bytes_per_request == windowed.pages_per_request * page5 + full.pages_per_request * page2
    # shares in proportion to per-request bytes, never above the budget
    assert windowed.pool_pages * page5 + full.pool_pages * page2 <= 8 << 30
    for g in report.groups:
        assert g.max_concurrency == g.pool_pages // g.pages_per_request
    assert report.max_concurrency == min(g.max_concurrency for g in report.groups)


@pytest.mark.parametrize(
    "n,text",
    [(0, "0 B"), (1023, "1023 B"), (1024, "1 KiB"), (320 * 1024, "320 KiB"), (int(1.5 * (1 << 20)), "1.50 MiB"),
     (1 << 30, "1 GiB")],
)
def test_format_bytes(n, text):
    assert format_bytes(n) == text


def test_plan_bad_number_is_an_explicit_error(capsys):
    with pytest.raises(SystemExit) as exc:
        main([*WORKED[:-4], "--tokens-per-block", "0", "--window", "4096"])
    assert exc.value.code == 2
    assert "argument --tokens-per-block: must be >= 1, got 0" in capsys.readouterr().err


def test_plan_reports_the_target_pool_and_the_joint_concurrency(capsys):
    """The target pool's charge follows the same estimator; both pools bound concurrency."""
    args = WORKED + ["--target-num-layers", "4", "--target-num-full-layers", "2", "--target-num-kv-heads", "2",
                     "--target-head-dim", "64", "--target-window", "1024", "--max-seq-len", "65536",
                     "--target-pool-gib", "2"]
    assert main(args) == 0
    out = capsys.readouterr().out
    assert "target pool (trail tokens per window: 0)" in out
    windowed = group_pages_per_request(1024, 32, max_seq_len=65536, chunk=8192, max_draft_len=7)
    full = group_pages_per_request(None, 32, max_seq_len=65536, chunk=8192, max_draft_len=7)
    target_lines = out.split("target pool")[1].splitlines()
    rows = [line.split() for line in target_lines if line.split()[:1] in (["0"], ["1"])]
    assert [int(r[3]) for r in rows] == [windowed, full]
    draft_conc = int(re.search(r"max concurrency (\d+)", out.split("target pool")[0]).group(1))
    target_conc = int(re.search(r"max concurrency (\d+)", out.split("target pool")[1]).group(1))
    assert f"concurrent requests both pools hold: {min(draft_conc, target_conc)}" in out
    # the 2 GiB budget is split in proportion to the groups' per-request bytes
    assert target_conc == min(int(r[-1]) for r in rows)


def test_plan_can_skip_the_target_pool(capsys):
    assert main(WORKED + ["--target-num-layers", "0", "--target-num-full-layers", "0"]) == 0
    assert "target pool" not in capsys.readouterr().out


def test_plan_rejects_an_unknown_drafter_with_a_usage_error(capsys):
    with pytest.raises(SystemExit) as exc:
        main(["plan", "--drafter", "bogus"])
    assert exc.value.code == 2
    assert "unknown speculative decoding mode 'bogus'" in capsys.readouterr().err
