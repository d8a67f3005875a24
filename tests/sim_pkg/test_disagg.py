"""Disaggregated 1P1D over torch.distributed (gloo): two spawned ranks, small prompts.

The long-prompt acceptance lives in test_long_prompts.py; here a small run
checks that the two-process path gives the target-only output, and that a rank
that dies without reporting makes the parent raise instead of waiting forever.
"""
from __future__ import annotations

import os
import threading
import time
from dataclasses import replace
from functools import partial

import pytest
import torch

from draftkv_sim import RunSpec
from draftkv_sim.disagg import run_disaggregated
from draftkv_sim.run_build import target_only_outputs
from draftkv_sim.simulate import run_one
from tensorrt_llm_draftkv.manager.rules import MirrorSizing

# The small geometry and the autouse fixtures (one thread, reference kernels) are shared.
from sim_pkg.sim_support import SMALL

pytestmark = pytest.mark.usefixtures("reference_kernels")  # the kernels' torch reference: fast on CPU



def test_two_process_run_equals_target_only():
    spec = RunSpec("small-disagg", "disaggregated", (600, 900, 700), 2)
    stats, seeds = run_one(SMALL, spec, MirrorSizing.HISTORY)
    keys = list(zip(seeds, spec.prompts))
    ref = target_only_outputs(SMALL, keys)
    assert stats.finished == 3
    assert stats.resize_failures == 0, stats.first_error
    assert stats.foreign_page_accesses == 0
    assert {keys[rid]: out for rid, out in stats.outputs.items()} == ref
    # the same prompts aggregated give the same outputs
    agg, _ = run_one(SMALL, replace(spec, mode="aggregated"), MirrorSizing.HISTORY)
    assert agg.outputs == stats.outputs


def _die_silently(rank: int):
    """Rank 1 vanishes without reporting (as if killed); rank 0 just waits on its peer."""
    if rank == 1:
        os._exit(3)
    time.sleep(3600)  # far past the guard below: only a run that stops waiting on it can pass


def test_a_rank_that_dies_without_reporting_is_an_error_not_a_hang():
    outcome: dict = {}

    def call():
        try:
            run_disaggregated(partial(_die_silently), [torch.arange(8)], backend="gloo")
        except BaseException as err:  # noqa: BLE001 - recorded for the assertion
            outcome["error"] = err

    thread = threading.Thread(target=call, daemon=True)
    thread.start()
    thread.join(timeout=240)  # a hang guard: rank 0 sleeps an hour, so only giving up on it passes
    assert not thread.is_alive(), "run_disaggregated still waits for a rank that is gone"
    err = outcome.get("error")
    assert isinstance(err, RuntimeError), err
    assert "exited without reporting" in str(err) and "1" in str(err)


def test_kept_ranks_run_several_disaggregated_runs_with_the_same_processes():
    from draftkv_sim.disagg import RankPool

    spec = RunSpec("kept-ranks", "disaggregated", (600, 700), 2)
    setup = replace(SMALL, max_new_tokens=8)
    with RankPool("gloo") as ranks:
        assert os.path.isdir(ranks.meet.directory)  # the ranks met through a file there, not a port
        pids = [p.pid for p in ranks.procs]
        first, _ = run_one(setup, spec, MirrorSizing.HISTORY, ranks=ranks)
        second, _ = run_one(setup, spec, MirrorSizing.LEGACY, ranks=ranks)
        third, _ = run_one(setup, spec, MirrorSizing.HISTORY, ranks=ranks)
        assert [p.pid for p in ranks.procs] == pids and all(p.is_alive() for p in ranks.procs)
    assert first.finished == third.finished == 2 and first.outputs == third.outputs
    assert second.finished == 2  # the legacy run in between leaves the ranks usable
    assert all(p.exitcode == 0 for p in ranks.procs)  # closed cleanly
    assert not os.path.exists(ranks.meet.directory)  # and its rendezvous removed


def test_each_rank_pair_meets_in_a_directory_of_its_own():
    """Two pools started at once (two tests under `pytest -n 2`) cannot meet at the same place: each
    rendezvous is a fresh directory, where a port found free could be taken by the other."""
    from tensorrt_llm_draftkv.transfer import Rendezvous

    a, b = Rendezvous.create(), Rendezvous.create()
    try:
        assert a.directory != b.directory and a.tag != b.tag
        assert a.init_method == "file://" + os.path.join(a.directory, "store")
        assert os.listdir(a.directory) == []  # the store file does not exist yet: the ranks create it
    finally:
        a.remove()
        b.remove()
    assert not os.path.exists(a.directory) and not os.path.exists(b.directory)
