"""The draft step's host cost of this tree against another checkout, in alternating processes.

Host timings on a shared or lent machine wander from process to process (up to 2x on the
lent H100 hosts), so a figure means something only beside a baseline taken in the same run.
This runs the same timed step (``benchmarks.draft_step``'s phases; the executor's token append
is not timed) over this tree and over ``--against PATH`` (any checkout of this package, for
example ``git worktree add /tmp/base <commit>``), one process per tree and round, alternating,
and prints each phase's median over the rounds. Cases: B 64 at 131,071 and 524,287 tokens and
B 256 at 524,287, lockstep (every request crosses a page on the same step) and staggered
(request i starts ``(11 i) mod P`` tokens earlier, so a few cross on every step).

The trees take turns going first from round to round. Run as ``python -m benchmarks.step_against
--against PATH [--rounds 3] [--steps 40] [--device cuda]``.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys

CASES = [(64, 131_071, False), (64, 524_287, False), (64, 524_287, True), (256, 524_287, False),
         (256, 524_287, True)]
PHASES = ("mgr prepare", "offsets", "meta prepare", "refresh", "gen prep", "mgr update")

_CHILD = r'''
import gc, json, sys, time
tree, device, cases, steps = sys.argv[1], sys.argv[2], json.loads(sys.argv[3]), int(sys.argv[4])
sys.path.insert(0, tree)
import torch
torch.set_num_threads(1)
from benchmarks import draft_step as d
from tensorrt_llm_draftkv import LlmRequest
plain = LlmRequest.__init__
stagger = [False]
def staggered_init(self, rid, prompt_len, **kw):  # works on trees whose build() has no `staggered`
    plain(self, rid, prompt_len=prompt_len - ((11 * rid) % d.P if stagger[0] else 0), **kw)
LlmRequest.__init__ = staggered_init
sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
def step(s, clock):
    n = len(s.ids)
    m = [time.perf_counter()]
    s.draft.prepare_resources(s.batch); m.append(time.perf_counter())
    s.draft.copy_batch_block_offsets(s.attn.draft_kv_cache_block_offsets, s.ids, 1, 0, n); m.append(time.perf_counter())
    s.meta.request_ids, s.meta.num_generations = s.ids, n
    s.meta.prepare(); m.append(time.perf_counter())
    s.attn.request_ids = s.ids
    s.worker._refresh_ctx_block_tables(s.attn, n); m.append(time.perf_counter())
    s.worker._advance_ctx_len([d.ACCEPTED] * n); sync(); s.worker.finish_step(); m.append(time.perf_counter())
    for r in s.reqs:
        r.tokens.extend([1] * d.ACCEPTED)
    start = time.perf_counter()
    s.draft.update_resources(s.batch); m.append(time.perf_counter())
    if clock is not None:
        for i, name in enumerate(d.PHASES):
            clock[name] += m[i + 1] - (start if i == len(d.PHASES) - 1 else m[i])
for batch, prompt, staggered in cases:
    stagger[0] = staggered
    s = d.build(batch, prompt, device)
    for _ in range(d.WARMUP):
        step(s, None)
    gc.collect(); gc.freeze()
    clock = {p: 0.0 for p in d.PHASES}
    for _ in range(steps):
        step(s, clock)
    gc.unfreeze()
    print(json.dumps([batch, prompt, staggered, {p: clock[p] * 1e6 / steps for p in d.PHASES}]), flush=True)
    del s
    gc.collect()
'''


def run_tree(tree: str, device: str, cases: list, steps: int = 40) -> list:
    env = dict(os.environ, PYTHONPATH=tree)
    out = subprocess.run([sys.executable, "-c", _CHILD, tree, device, json.dumps(cases), str(steps)], env=env, cwd=tree,
                         capture_output=True, text=True, check=True).stdout
    return [json.loads(line) for line in out.splitlines() if line.startswith("[")]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--against", required=True, help="path of the baseline checkout")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--device", default=None, help="cuda or cpu (default: cuda when available)")
    parser.add_argument("--cases", help="indices into the case list, comma-separated (default: all)")
    parser.add_argument("--steps", type=int, default=40,
                        help="timed steps per case and process (a lockstep page cycle is 11 steps)")
    args = parser.parse_args()
    if args.device is None:
        import torch

        args.device = "cuda" if torch.cuda.is_available() else "cpu"
    here = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    cases = CASES if not args.cases else [CASES[int(i)] for i in args.cases.split(",")]
    trees = {"baseline": os.path.abspath(args.against), "this tree": here}
    got: dict[tuple, list] = {}
    for i in range(args.rounds):
        # baseline first in even rounds, this tree first in odd ones: a drift of the machine over the run
        # (it warms, another job starts) then weighs on both trees alike
        for name, tree in (list(trees.items()) if i % 2 == 0 else list(trees.items())[::-1]):
            for batch, prompt, staggered, phases in run_tree(tree, args.device, cases, args.steps):
                got.setdefault((batch, prompt, staggered, name), []).append(phases)
    print(f"device {args.device}; median over {args.rounds} alternating rounds, host us per step")
    print(f"{'B':>5} {'prompt':>9} {'stag':>4} {'tree':>10} " + " ".join(f"{p:>12}" for p in PHASES)
          + f" {'step':>7}  rounds")
    for batch, prompt, staggered in cases:
        for name in trees:
            runs = got[(batch, prompt, staggered, name)]
            steps = [sum(r.values()) for r in runs]
            med = {p: statistics.median(r[p] for r in runs) for p in PHASES}
            print(f"{batch:>5} {prompt:>9} {'yes' if staggered else 'no':>4} {name:>10} "
                  + " ".join(f"{med[p]:>12.0f}" for p in PHASES)
                  + f" {statistics.median(steps):>7.0f}  " + ", ".join(f"{s:.0f}" for s in steps), flush=True)


if __name__ == "__main__":
    main()
