"""Where a draft step's host time goes: each step's phases one by one, and the calls each phase makes.

`benchmarks.draft_step` gives each phase's mean over many steps. A mean hides the shape: in lockstep most
steps change no page and a few (every request crossing a page at once) cost ten times more, and on a
GPU a phase's cost is largely its device calls (several µs of host time each). This prints, per case:

* each of `--steps` consecutive steps, phase by phase (host µs; the draft_step phases), and
  `(sync)`: how much of `gen prep` was the device sync after it (waiting for the step's queued device
  work, on CUDA; 0 on the CPU);
* per phase, the torch operators and CUDA runtime calls (`cudaLaunchKernel`, `cudaMemcpyAsync`,
  `cudaEventRecord`, ...) per step, from `torch.profiler` over 11 steps (a lockstep page cycle).

Run as ``python -m benchmarks.step_calls [--device cuda] [--cases B,PROMPT,STAG ...] [--steps N]``.
"""
from __future__ import annotations

import argparse
import collections
import gc
import os
import sys
import time

if __package__ in (None, ""):
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

from benchmarks import draft_step as d  # noqa: E402

PROFILED_STEPS = 11


def _phases(s, n: int, device: str, waits: list[float] | None = None):
    """The draft step's phases as (name, callable), in order (the executor's token append between).
    `waits`: each generation preparation's device sync is appended to it (µs): the part of that
    phase spent waiting for the device to finish the step's queued work, not running host code."""
    def gen_prep() -> None:
        s.worker._advance_ctx_len([d.ACCEPTED] * n)
        if device == "cuda":
            t = time.perf_counter()
            torch.cuda.synchronize()
            if waits is not None:
                waits.append((time.perf_counter() - t) * 1e6)
        s.worker.finish_step()

    def meta() -> None:
        s.meta.request_ids, s.meta.num_generations = s.ids, n
        s.meta.prepare()

    def refresh() -> None:
        s.attn.request_ids = s.ids
        s.worker._refresh_ctx_block_tables(s.attn, n)

    return [
        ("mgr prepare", lambda: s.draft.prepare_resources(s.batch)),
        ("offsets", lambda: s.draft.copy_batch_block_offsets(s.attn.draft_kv_cache_block_offsets, s.ids, 1, 0, n)),
        ("meta prepare", meta),
        ("refresh", refresh),
        ("gen prep", gen_prep),
        ("mgr update", lambda: s.draft.update_resources(s.batch)),
    ]


def _append_tokens(s) -> None:
    for req in s.reqs:
        req.tokens.extend([1] * d.ACCEPTED)


def run_case(batch: int, prompt: int, staggered: bool, device: str, steps: int) -> dict:
    """Per-step phase µs (a list of dicts), the sync inside each step's `gen prep` (µs, a list) and
    per-phase call counts per step (a dict of Counters)."""
    from torch.profiler import ProfilerActivity, profile, record_function

    s = d.build(batch, prompt, device, staggered)
    n = len(s.ids)
    waits: list[float] = []
    phases = _phases(s, n, device, waits)
    for _ in range(d.WARMUP):
        d.step(s, None)
    gc.collect()
    gc.freeze()
    per_step = []
    for _ in range(steps):
        row = {}
        for name, call in phases:
            if name == "mgr update":
                _append_tokens(s)
            t = time.perf_counter()
            call()
            row[name] = (time.perf_counter() - t) * 1e6
        per_step.append(row)
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device == "cuda" else [])
    with profile(activities=activities) as prof:
        for _ in range(PROFILED_STEPS):
            for name, call in phases:
                if name == "mgr update":
                    _append_tokens(s)
                with record_function("phase:" + name):
                    call()
    gc.unfreeze()
    events = prof.events()
    spans = [(e.time_range.start, e.time_range.end, e.name[len("phase:"):]) for e in events
             if e.name.startswith("phase:")]
    calls: dict[str, collections.Counter] = {name: collections.Counter() for name, _ in phases}
    for e in events:
        if not (e.name.startswith("cuda") or e.name.startswith("aten::")):
            continue
        for start, end, name in spans:
            if start <= e.time_range.start <= end:
                calls[name][e.name] += 1
                break
    sync = waits[:steps] if device == "cuda" else [0.0] * steps  # the timed steps' syncs, in order
    return {"per_step": per_step, "sync": sync, "calls": calls}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--cases", nargs="*", default=["64,524287,0", "256,524287,1"],
                        help="B,PROMPT,STAGGERED (0 or 1) per case")
    parser.add_argument("--steps", type=int, default=22, help="consecutive steps printed phase by phase")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    names = d.PHASES
    for case in args.cases:
        batch, prompt, staggered = (int(x) for x in case.split(","))
        got = run_case(batch, prompt, bool(staggered), args.device, args.steps)
        print(f"== device {args.device}, B {batch}, prompt {prompt}, {'staggered' if staggered else 'lockstep'}:"
              " host µs per step, phase by phase")
        print(" ".join(f"{p:>12}" for p in names) + f" {'step':>8} {'(sync)':>8}")
        for row, sync in zip(got["per_step"], got["sync"]):
            print(" ".join(f"{row[p]:>12.0f}" for p in names) + f" {sum(row.values()):>8.0f} {sync:>8.0f}")
        print(f"calls per step by phase (mean over {PROFILED_STEPS} profiled steps)")
        for p in names:
            for call, count in sorted(got["calls"][p].items(), key=lambda kv: -kv[1]):
                print(f"{p:>12} {call:<44} {count / PROFILED_STEPS:8.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
