"""Host cost of the draft side's whole generation step, through upstream's calls, phase by phase.

B generation requests of a disaggregated generation worker (prompt m tokens,
the drafter's window W 4096, P 32, DFlash block 8) on a draft
``KVCacheManagerV2(is_draft=True)`` bound to a ``DFlashWorker`` and its
``DFlashSpecMetadata``. One step is what an executor calls for the draft side:

* ``mgr prepare``: ``draft.prepare_resources(batch)``;
* ``offsets``: ``draft.copy_batch_block_offsets`` into the attention metadata's kept tensor;
* ``meta prepare``: ``spec_metadata.prepare()`` (rows to slots, the step's tables);
* ``refresh``: ``worker._refresh_ctx_block_tables`` (the store's tables);
* ``gen prep``: ``worker._advance_ctx_len(counts)`` (the block decode's rows), then a device sync;
* ``mgr update``: ``draft.update_resources(batch)`` after 3 tokens per request were accepted (the
  executor's append of those tokens to each request is not timed).

Host wall clock per phase, mean over the timed steps (a step that crosses a page is
counted at its share), in microseconds, and the whole step per request. Run as
``python -m benchmarks.draft_step [--quick] [--device cuda] [--json FILE] [--profile B,PROMPT]``.

In lockstep (the default rows) every request crosses a page on the same step, about one step in
eleven, and the steps between change no page; the staggered rows spread the crossings over every step.
"""
from __future__ import annotations

import argparse
import gc
import json
import os
import sys
import time
from types import SimpleNamespace

if __package__ in (None, ""):
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

from tensorrt_llm_draftkv import (  # noqa: E402
    CacheType,
    DataType,
    DFlashDecodingConfig,
    DFlashSpecMetadata,
    DFlashWorker,
    KVCacheManagerV2,
    KvCacheConfig,
    LlmRequest,
    LlmRequestState,
    Mapping,
    ScheduledRequests,
)
from tensorrt_llm_draftkv.manager.budget import group_pages_per_request  # noqa: E402

P, W, K = 32, 4096, 7
ACCEPTED = 3  # tokens each request takes per step (two drafts and the bonus token)
#: untimed steps first: every path (a page crossed, a page released) and every kernel specialisation seen once
WARMUP = 12
PHASES = ("mgr prepare", "offsets", "meta prepare", "refresh", "gen prep", "mgr update")


class _Drafter:
    """Upstream's drafter attributes, smallest shape: the benchmark times addressing, not K/V."""

    _num_attn_layers, _num_kv_heads, _head_dim, block_size = 1, 1, 8, K + 1


def build(batch: int, prompt: int, device: str, staggered: bool = False) -> SimpleNamespace:
    """A draft manager, worker and metadata with `batch` requests in generation at `prompt` tokens.

    `staggered`: request i starts `(11 i) mod P` tokens earlier, so the requests cross pages on
    different steps (a few every step, as in real traffic) instead of all on the same one."""
    max_seq = prompt + 4096
    spec = DFlashDecodingConfig(max_draft_len=K)
    pages = group_pages_per_request(W, P, max_seq_len=max_seq, chunk=8192, max_draft_len=K,
                                    num_extra_kv_tokens=K + 1, trail_tokens=P)
    draft = KVCacheManagerV2(
        KvCacheConfig(max_tokens=(batch * pages + 8) * P, max_attention_window=[W], enable_block_reuse=False),
        CacheType.SELF, num_layers=1, num_kv_heads=1, head_dim=8, tokens_per_block=P, max_seq_len=max_seq,
        max_batch_size=batch, mapping=Mapping(), dtype=DataType.HALF, spec_config=spec, is_draft=True,
        device=device,
    )
    worker = DFlashWorker(spec, Mapping(), use_separate_draft_kv_cache=True)
    meta = DFlashSpecMetadata(max_num_requests=batch, max_draft_len=K, max_total_draft_tokens=K, device=device)
    offsets = torch.zeros((draft.num_pools, batch, 2, draft.config.max_blocks_per_seq), dtype=torch.int32,
                          device=device)
    attn = SimpleNamespace(draft_kv_cache_block_offsets=offsets, request_ids=None, max_seq_len=max_seq,
                           num_contexts=0, seq_lens=[])
    worker._lazy_init_ctx_buffers(_Drafter(), meta, attn, draft_kv_cache_manager=draft)
    reqs = []
    for rid in range(batch):
        req = LlmRequest(rid, prompt_len=prompt - (11 * rid % P if staggered else 0),
                         state=LlmRequestState.DISAGG_GENERATION_INIT)
        req.tokens.append(1)
        assert draft.prepare_disagg_gen_init(req), draft.last_refusal
        req.state = LlmRequestState.GENERATION_IN_PROGRESS
        reqs.append(req)
    return SimpleNamespace(draft=draft, worker=worker, meta=meta, attn=attn, reqs=reqs,
                           batch=ScheduledRequests(generation_requests=reqs), ids=[r.py_request_id for r in reqs])


def step(s: SimpleNamespace, clock: dict[str, float] | None) -> None:
    """One draft-side generation step; adds each phase's seconds to `clock` (None: untimed)."""
    sync = torch.cuda.synchronize if s.attn.draft_kv_cache_block_offsets.is_cuda else (lambda: None)
    n = len(s.ids)
    marks = [time.perf_counter()]
    s.draft.prepare_resources(s.batch)
    marks.append(time.perf_counter())
    s.draft.copy_batch_block_offsets(s.attn.draft_kv_cache_block_offsets, s.ids, 1, 0, n)
    marks.append(time.perf_counter())
    s.meta.request_ids, s.meta.num_generations = s.ids, n
    s.meta.prepare()
    marks.append(time.perf_counter())
    s.attn.request_ids = s.ids
    s.worker._refresh_ctx_block_tables(s.attn, n)
    marks.append(time.perf_counter())
    s.worker._advance_ctx_len([ACCEPTED] * n)
    sync()
    s.worker.finish_step()
    marks.append(time.perf_counter())
    for req in s.reqs:  # the executor's own token append: not the draft side's work, not timed
        req.tokens.extend([1] * ACCEPTED)
    update_start = time.perf_counter()
    s.draft.update_resources(s.batch)
    marks.append(time.perf_counter())
    if clock is not None:
        starts = marks[:-1]
        starts[-1] = update_start
        for name, a, b in zip(PHASES, starts, marks[1:]):
            clock[name] += b - a


def measure(batch: int, prompt: int, device: str, steps: int, staggered: bool = False) -> dict[str, float]:
    """Mean µs per step of each phase, and of the whole step (also per request)."""
    s = build(batch, prompt, device, staggered)
    for _ in range(WARMUP):
        step(s, None)
    gc.collect()
    gc.freeze()  # the set-up (B x prompt token ids) out of the collector's walks, as serving engines do
    clock = {name: 0.0 for name in PHASES}
    for _ in range(steps):
        step(s, clock)
    gc.unfreeze()
    out = {name: clock[name] * 1e6 / steps for name in PHASES}
    out["step"] = sum(out[name] for name in PHASES)
    out["per_request"] = out["step"] / batch
    return out


def profile(batch: int, prompt: int, device: str, steps: int = 20) -> None:
    """Where one case's host time goes, function by function (cProfile, after the warm-up steps)."""
    import cProfile
    import pstats

    s = build(batch, prompt, device)
    for _ in range(WARMUP):
        step(s, None)
    gc.collect()
    gc.freeze()
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(steps):
        step(s, None)
    prof.disable()
    gc.unfreeze()
    print(f"device {device}, B {batch}, prompt {prompt}, {steps} steps")
    pstats.Stats(prof).sort_stats("tottime").print_stats(25)
    pstats.Stats(prof).sort_stats("cumulative").print_stats(40)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer sizes and steps")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--json", help="write every figure to this file")
    parser.add_argument("--profile", metavar="B,PROMPT",
                        help="instead of the table: cProfile 20 steps of this one case (top functions by own and by total time)")
    args = parser.parse_args()
    torch.set_num_threads(1)
    if args.profile:
        batch, prompt = (int(x) for x in args.profile.split(","))
        profile(batch, prompt, args.device)
        return
    steps = 10 if args.quick else 40
    cases = [(64, 131_071, False), (64, 524_287, False), (64, 524_287, True)] if args.quick else [
        (8, 131_071, False), (64, 32_767, False), (64, 131_071, False), (64, 524_287, False),
        (64, 2_097_151, False), (256, 32_767, False), (256, 524_287, False), (256, 2_097_151, False),
        (64, 131_071, True), (64, 524_287, True), (256, 524_287, True)]
    rows = []
    print(f"device {args.device}, W {W}, P {P}, block {K + 1}; mean host us per step "
          "(stag: requests cross pages on different steps)")
    print(f"{'B':>5} {'prompt':>9} {'stag':>4} " + " ".join(f"{p:>12}" for p in PHASES) + f" {'step':>9} {'us/req':>7}")
    for batch, prompt, staggered in cases:
        r = measure(batch, prompt, args.device, steps, staggered)
        rows.append({"B": batch, "prompt": prompt, "staggered": staggered, **r})
        print(f"{batch:>5} {prompt:>9} {'yes' if staggered else 'no':>4} " + " ".join(f"{r[p]:>12.0f}" for p in PHASES)
              + f" {r['step']:>9.0f} {r['per_request']:>7.1f}", flush=True)
    print("target: the whole step <= 300 us at B 64 x 524,287 tokens, within +-25 % of that at 131,071")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
