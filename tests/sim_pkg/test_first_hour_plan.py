"""`plan` as a new user meets it: one-line errors, bounded inputs, a short budget that names its option and
the budget that would do, and target options that need target layers."""
from __future__ import annotations

import re

import pytest

from tensorrt_llm_draftkv.config import MAX_POOL_PAGES
from draftkv_sim.cli import main

PROG = "python -m tensorrt_llm_draftkv plan"


def run(capsys, *args: str) -> tuple[int, str, str]:
    try:
        code = main(["plan", *args])
    except SystemExit as exc:
        code = exc.code
    out, err = capsys.readouterr()
    return code, out, err


def one_line_error(capsys, *args: str, code: int = 2) -> str:
    got, out, err = run(capsys, *args)
    assert got == code, err
    lines = err.splitlines()
    assert len(lines) == 1 and "usage:" not in err and "Traceback" not in err, err
    assert lines[0].startswith(f"{PROG}: error: argument --"), err
    return lines[0]


@pytest.mark.parametrize(
    "args",
    [
        ("--chunk", "-8"),
        ("--pool-gib", "nan"),
        ("--num-layers", "0", "--num-full-layers", "0"),
        ("--pool-gib", "2", "--max-tokens", "1024"),
        ("--memory-fraction", "0.5"),
    ],
)
def test_usage_errors_are_one_line_without_the_usage_block(capsys, args):
    one_line_error(capsys, *args)


@pytest.mark.parametrize(
    "args, text",
    [
        (("--pool-gib", "1e30"), "argument --pool-gib: must be <= 1048576 GiB (1 PiB), got 1e30"),
        (("--target-num-layers", "1", "--target-pool-gib", "1e30"), "argument --target-pool-gib: must be <="),
        (("--memory-fraction", "1", "--device-memory-gib", "1e30"), "argument --device-memory-gib: must be <="),
        (("--num-layers", "99999999999999999999"), "argument --num-layers: must be <= 10000, got 99999999999999999999"),
        (("--num-kv-heads", "99999999999999999999"), "argument --num-kv-heads: must be <= 65536"),
        (("--head-dim", "99999999999999999999"), "argument --head-dim: must be <= 65536"),
        (("--tp", "99999999999999999999"), "argument --tp: must be <= 65536"),
        (("--max-draft-len", "99999999999999999999"), "argument --max-draft-len: must be <= 1024"),
        (("--max-seq-len", "99999999999999999999"), "argument --max-seq-len: must be <= 2147483647"),
        (("--max-tokens", "99999999999999999999"), "argument --max-tokens: must be <= 2147483647"),
    ],
)
def test_inputs_past_any_deployment_are_refused_naming_the_bound(capsys, args, text):
    assert text in one_line_error(capsys, *args)


def test_a_budget_past_what_page_indices_address_is_refused_before_any_table(capsys):
    line = one_line_error(capsys, "--pool-gib", "1000000")  # 3,276,800,000 pages of 320 KiB
    assert "argument --pool-gib:" in line and "3276800000 pages" in line and str(MAX_POOL_PAGES) in line


def test_page_counts_stay_in_their_column_at_the_largest_budget(capsys):
    code, out, err = run(capsys, "--pool-gib", "600000")
    assert code == 0, err
    head, row = out.splitlines()[1:3]
    assert len(row) == len(head)  # every cell within its column


@pytest.mark.parametrize(
    "args, option",
    [
        (("--pool-gib", "0.05"), "--pool-gib"),
        (("--max-tokens", "100"), "--max-tokens"),
        (("--memory-fraction", "0.0001", "--device-memory-gib", "80"), "--memory-fraction"),
        (("--num-full-layers", "1", "--max-tokens", "65536"), "--max-tokens"),
        (("--target-num-layers", "2", "--target-max-tokens", "1000"), "--target-max-tokens"),
        (("--target-num-layers", "2", "--target-pool-gib", "0.01"), "--target-pool-gib"),
    ],
)
def test_a_budget_too_small_names_its_option_and_the_least_budget_that_holds_one_request(capsys, args, option):
    code, out, err = run(capsys, *args)
    assert code == 1
    (line,) = err.splitlines()
    assert line.startswith(f"{PROG}: error: argument {option}: ") and "cannot hold one request" in line
    least = re.search(rf"give at least {option} ([0-9.]+)", line).group(1)
    # the budget it names is enough: the same command with it plans without an error
    fixed = list(args)
    fixed[fixed.index(option) + 1] = least
    code, _, err = run(capsys, *fixed)
    assert code == 0, err


def test_a_device_too_small_for_one_request_says_so(capsys):
    code, _, err = run(capsys, "--memory-fraction", "1", "--device-memory-gib", "0.01")
    assert code == 1 and "argument --memory-fraction:" in err and "more than the whole device" in err


@pytest.mark.parametrize(
    "args",
    [
        ("--target-window", "7"),
        ("--target-window", "4096"),  # given, even at its default value
        ("--target-num-kv-heads", "8"),
        ("--target-head-dim", "64"),
        ("--target-num-extra-kv-tokens", "8"),
        ("--target-pool-gib", "4"),
        ("--target-max-tokens", "4096"),
    ],
)
def test_target_options_without_target_layers_are_refused(capsys, args):
    line = one_line_error(capsys, *args)
    assert f"argument {args[0]}: the target pool is planned only with target layers" in line
    assert "--target-num-layers" in line


def test_a_target_window_without_windowed_target_layers_is_refused(capsys):
    line = one_line_error(capsys, "--target-num-full-layers", "2", "--target-window", "64")
    assert "argument --target-window:" in line and "--target-num-layers is 0" in line


def test_a_draft_window_without_windowed_draft_layers_is_refused(capsys):
    line = one_line_error(capsys, "--num-layers", "0", "--num-full-layers", "2", "--window", "64")
    assert "argument --window:" in line and "--num-layers is 0" in line


def test_a_target_window_below_a_page_is_refused_with_target_layers(capsys):
    line = one_line_error(capsys, "--target-num-layers", "2", "--target-window", "7")
    assert "argument --target-window: a window of 7 tokens is shorter than one page" in line
