"""CPU smoke run of ``benchmarks/kernels.py``: every path runs, is checked against the reference, and is reported."""
from __future__ import annotations

import json
import os
import sys

import pytest
import torch

try:  # benchmarks/ sits beside the package: on sys.path under `python -m pytest`, not under plain `pytest`
    from benchmarks import kernels as bench
except ImportError:
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
    from benchmarks import kernels as bench

pytestmark = pytest.mark.filterwarnings("ignore:Conversion of an array with ndim > 0:DeprecationWarning")


def test_benchmark_quick_cpu_run_writes_json(tmp_path, capsys):
    path = tmp_path / "bench.json"
    assert bench.main(["--quick", "--device", "cpu", "--reps", "1", "--json", str(path)]) == 0
    printed = capsys.readouterr().out
    assert "one-pass µs" in printed and "two-step µs" in printed
    result = json.loads(path.read_text())
    assert result["device"] == "cpu"
    assert result["cpu_impl"] == "triton"  # the suite sets TRITON_INTERPRET=1: the interpreted kernels ran
    sizes = {(r["B"], r["M"]) for r in result["prepare"]}
    assert sizes == {(b, m) for b in bench.CPU_BATCHES for m in bench.CPU_MAX_BLOCKS}
    for r in result["prepare"]:
        assert r["one_pass_us"] > 0 and r["two_step_us"] > 0 and r["eager_us"] > 0 and r["copy_us"] > 0
        assert r["one_pass_graph_us"] is None  # no graphs on CPU: NaN is written as null
        assert r["bytes"] > r["B"] * r["M"] * 4  # at least the read table written


def test_benchmark_paths_catch_a_wrong_result():
    """The check that guards every timing fails when a path returns a wrong field."""
    paths = bench.Paths(bench.make_step(2, 16, "cpu"), impl="reference")
    paths.check()
    good = paths.eager
    paths.eager = lambda: _off_by_one(good())
    with pytest.raises(AssertionError):
        paths.check()


def _off_by_one(prep):
    prep.read_lens = prep.read_lens + 1
    return prep


def test_window_step_benchmark_checks_its_step_on_cpu():
    """``benchmarks/window_step.py``: its step builder is backed over the window only, and the window-bounded
    call it times agrees with the reference (the check it runs before timing)."""
    import torch

    from benchmarks import window_step as ws

    step = ws.make_step(8, 32_768, torch.device("cpu"))
    k = step["offsets"][1, :, 0]
    assert ((k > 0).sum(dim=1) <= ws.window_read_width(ws.W, ws.P) + 1).all()  # the window, not the prompt
    ws.check(step)
    assert ws.step_bytes(256, ws.window_read_width(ws.W, ws.P)) < ws.step_bytes(256, step["M"]) / 5


def test_the_draft_step_benchmark_runs_every_phase_on_the_cpu():
    """`benchmarks/draft_step.py` on a tiny case: every phase is timed, and the steps keep the rows of the
    kept offsets tensor and the worker's tables what a whole export and decode give."""
    from benchmarks import draft_step as ds

    figures = ds.measure(4, 4095, "cpu", steps=14)
    assert set(ds.PHASES) <= set(figures) and all(figures[p] > 0 for p in ds.PHASES)
    s = ds.build(3, 2047, "cpu")
    for _ in range(14):
        ds.step(s, None)
        offsets = s.attn.draft_kv_cache_block_offsets
        assert torch.equal(offsets, s.draft.get_block_offsets(s.ids, "cpp"))
        decoded = (offsets[0, :, 0].clamp(min=0) // s.draft.config.kv_factor).to(torch.int32)
        assert torch.equal(s.worker._ctx_block_tables[: len(s.ids), : decoded.shape[1]], decoded)


def test_the_step_against_a_baseline_runs_a_tree_in_its_own_process():
    """`benchmarks/step_against.py`: a tree's child process times every phase of a small staggered case."""
    import os

    from benchmarks import step_against as sa

    here = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    (got,) = sa.run_tree(here, "cpu", [(3, 2047, True)], steps=5)
    assert got[:3] == [3, 2047, True] and set(got[3]) == set(sa.PHASES)
    assert all(v > 0 for v in got[3].values())


def test_step_calls_benchmark_times_every_phase_and_finds_the_step_s_operators_on_cpu():
    """``benchmarks/step_calls.py``: every step has every phase timed, and the calls it attributes to the
    phases are the ones each makes (the generation preparation's reference kernel runs torch operators; the
    managers' resizes none)."""
    from benchmarks import draft_step, step_calls

    got = step_calls.run_case(4, 4095, False, "cpu", steps=3)
    assert len(got["per_step"]) == 3
    assert all(set(row) == set(draft_step.PHASES) and min(row.values()) > 0 for row in got["per_step"])
    assert sum(got["calls"]["gen prep"].values()) > 10 * step_calls.PROFILED_STEPS
    assert not got["calls"]["mgr prepare"] and not got["calls"]["mgr update"]
