"""Host cost of the managers per generation step, against the scale targets (CPU, one torch thread).

Each sweep puts B requests in generation on a windowed DFlash draft manager
(W 4096, P 32), a windowed target manager or a full-attention target manager,
then times generation steps: one `prepare_resources` plus one
`update_resources`, with three tokens accepted per step (mean over 64 steps). Two sweeps: the batch
(B = 1 .. 1024 at a 131k prompt) and the prompt (32k .. 2M at B = 64). Then,
at B = 256 with max_seq_len 528k, the block-offset export and
`DFlashDraftSlots.prepare_step`, each beside a baseline in the same run: the
baseline converts every row of the batch from scratch at max_blocks_per_seq
columns (and decodes the offsets with the torch reference), as the export did
before it kept numpy rows. A manager step runs between timed calls, so rows
change as they do in a real run. Medians in microseconds; the targets are
printed beside the figures, never asserted. Peak RSS of the process at the end. The
set-up is frozen out of the garbage collector before timing (see `_freeze_setup`).

    python -m benchmarks.host [--quick] [--json out.json]
"""
from __future__ import annotations

import argparse
import gc
import json
import resource
import statistics
import time

import numpy as np
import torch

from tensorrt_llm_draftkv import (
    DFlashDraftSlots,
    DraftKVCacheManagerV2,
    KVCacheManagerV2,
    KVPoolConfig,
    LayerGroupConfig,
    LlmRequest,
    LlmRequestState,
    ScheduledRequests,
)
from tensorrt_llm_draftkv.kernels import decode_draft_block_table_reference
from tensorrt_llm_draftkv.manager.budget import group_pages_per_request

P, W, DRAFTS, EXTRA, CHUNK = 32, 4096, 7, 8, 8192


def _config(window: int | None, requests: int, max_seq_len: int, per_request: int) -> KVPoolConfig:
    return KVPoolConfig(
        (LayerGroupConfig(1, window=window),),
        pages_per_group=(requests * per_request + 8,),
        tokens_per_block=P,
        head_dim=1,
        dtype=torch.float16,
        max_seq_len=max_seq_len,
    )


def _managers(kind: str, batch: int, prompt: int, max_seq: int | None = None):
    max_seq = max_seq or prompt + 4096
    if kind == "draft":
        pages = group_pages_per_request(
            W, P, max_seq_len=max_seq, chunk=CHUNK, max_draft_len=DRAFTS, num_extra_kv_tokens=EXTRA, trail_tokens=P
        )
        cfg = _config(W, batch, max_seq, pages)
        return DraftKVCacheManagerV2.from_pool_config(cfg, spec_mode="dflash", max_draft_len=DRAFTS, num_extra_kv_tokens=EXTRA)
    window = W if kind == "target-windowed" else None
    pages = group_pages_per_request(window, P, max_seq_len=max_seq, chunk=CHUNK, max_draft_len=DRAFTS)
    return KVCacheManagerV2.from_pool_config(_config(window, batch, max_seq, pages), max_draft_len=DRAFTS)


def _generation_requests(mgr, batch: int, prompt: int) -> list[LlmRequest]:
    reqs = []
    for rid in range(batch):
        req = LlmRequest(rid, prompt_len=prompt, state=LlmRequestState.DISAGG_GENERATION_INIT)
        req.tokens.append(1)
        assert mgr.prepare_disagg_gen_init(req)
        req.state = LlmRequestState.GENERATION_IN_PROGRESS
        reqs.append(req)
    return reqs


def _step(mgr, batch: ScheduledRequests, reqs: list[LlmRequest]) -> None:
    mgr.prepare_resources(batch)
    for req in reqs:
        req.tokens.extend([1] * 3)  # two drafts accepted and the bonus token
    mgr.update_resources(batch)


def _freeze_setup() -> None:
    """Move everything built so far out of the collector's reach (`gc.freeze`, as serving engines do
    after start-up). Each request's token list holds its whole prompt; without this, a full collection
    walks B x prompt entries whenever it runs, and that cost would be charged to whichever manager call
    allocated at the time."""
    gc.collect()
    gc.freeze()


def step_us(kind: str, batch: int, prompt: int, steps: int) -> float:
    """Mean µs per request of one prepare_resources + update_resources step, over `steps` steps: a
    mean, not a median, so the steps that cross a page (about one in ten) are counted at their share."""
    mgr = _managers(kind, batch, prompt)
    reqs = _generation_requests(mgr, batch, prompt)
    batch_ = ScheduledRequests(generation_requests=reqs)
    for _ in range(3):
        _step(mgr, batch_, reqs)  # warm
    _freeze_setup()
    t0 = time.perf_counter()
    for _ in range(steps):
        _step(mgr, batch_, reqs)
    elapsed = time.perf_counter() - t0
    gc.unfreeze()  # this set-up may go now
    return elapsed * 1e6 / (steps * batch)


# --------------------------------------------------------------------------- baselines
def baseline_export(mgr, ids: list[int], backend: str) -> torch.Tensor:
    """Every row converted from its Python list at max_blocks_per_seq columns (the former export)."""
    kv = mgr.config.kv_factor
    width = mgr.config.max_blocks_per_seq
    out = np.full((mgr.num_pools, len(ids), 2, width), -1, dtype=np.int64)
    for b, rid in enumerate(ids):
        for p in range(mgr.num_pools):
            row = np.asarray(mgr.get_cache(rid).block_row(p), dtype=np.int64)
            out[p, b, 0, : row.size] = np.where(row >= 0, row * kv, -1)
            out[p, b, 1, : row.size] = np.where(row >= 0, row * kv + 1, -1)
    if backend == "cpp":
        out[out < 0] = 0
    return torch.from_numpy(out.astype(np.int32))


def baseline_tables(mgr, ids: list[int], backend: str):
    offsets = baseline_export(mgr, ids, backend)
    return [decode_draft_block_table_reference(offsets, p, len(ids), mgr.config.kv_factor, backend)
            for p in range(mgr.num_pools)]


def export_and_prepare(batch: int, prompt: int, max_seq_len: int, steps: int) -> dict[str, float]:
    """Median µs of each export form and of prepare (ours and the baseline), a manager step between calls."""
    dm = _managers("draft", batch, prompt, max_seq_len)
    reqs = _generation_requests(dm, batch, prompt)
    ids = [r.py_request_id for r in reqs]
    batch_ = ScheduledRequests(generation_requests=reqs)
    meta = DFlashDraftSlots(batch, block_size=DRAFTS + 1, tokens_per_block=P, max_ctx_len=max_seq_len, fused=False)
    kept = torch.zeros((dm.num_pools, batch, 2, dm.config.max_blocks_per_seq), dtype=torch.int32)
    _freeze_setup()
    timed = {
        "export_baseline_full": lambda: baseline_export(dm, ids, "cpp"),
        "export_full": lambda: dm.get_block_offsets(ids, "cpp"),
        "export_live": lambda: dm.get_block_offsets(ids, "cpp", width="live"),
        # upstream's per-step call, into the executor's kept buffer, at the live width
        "export_into_buffer": lambda: dm.copy_batch_block_offsets(
            kept, ids, 1, 0, len(ids), max_blocks=max(dm.get_cache(i).num_blocks for i in ids)
        ),
        "prepare_baseline_tables": lambda: baseline_tables(dm, ids, "cpp"),
        "prepare": lambda: meta.prepare_step(batch_, dm),
    }
    times: dict[str, list[float]] = {name: [] for name in timed}
    for _ in range(steps):
        _step(dm, batch_, reqs)  # rows change between calls, as in a run
        for name, call in timed.items():  # interleaved: drift hits every column alike
            t0 = time.perf_counter()
            call()
            times[name].append(time.perf_counter() - t0)
    gc.unfreeze()
    # Same tables from both paths (the benchmark would time the wrong thing otherwise).
    ours = dm.block_tables(ids, "cpp", width=None)
    for (t, e), ref in zip(ours, baseline_tables(dm, ids, "cpp")):
        assert torch.equal(t, ref.tables) and torch.equal(e, ref.extents)
    return {name: statistics.median(v) * 1e6 for name, v in times.items()}


def peak_rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # kB on Linux


def _flat(values: list[float]) -> str:
    lo, hi = min(values), max(values)
    mid = (lo + hi) / 2
    return f"spread {lo:.1f}..{hi:.1f} us = +-{100 * (hi - lo) / (2 * mid):.0f} % around the middle"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer sizes and steps")
    parser.add_argument("--json", help="write every figure to this file")
    parser.add_argument("--managers", action="store_true",
                        help="the manager sweeps only (no export or prepare): what a before/after of the managers needs")
    args = parser.parse_args()
    torch.set_num_threads(1)
    steps = 5 if args.quick else 15
    manager_steps = 10 if args.quick else 64
    batches = (8, 64) if args.quick else (1, 8, 64, 256, 1024)
    prompts = (32768, 131072) if args.quick else (32768, 131072, 524288, 2097152)
    full_prompts = (16384, 131072) if args.quick else (16384, 131072, 1048576)
    results: dict = {"batch_sweep": [], "prompt_sweep": [], "full_attention": []}
    print(f"{'manager':<17} {'B':>5} {'prompt':>8} {'us/req/step':>12}")
    for kind in ("draft", "target-windowed"):
        for batch in batches:
            # at least 4,096 request-steps a point: a B 8 run of 64 steps lasts about a millisecond, too
            # short to time steadily
            us = step_us(kind, batch, 131072, max(manager_steps, (4096 if not args.quick else 256) // batch))
            results["batch_sweep"].append({"manager": kind, "B": batch, "prompt": 131072, "us_per_req": us})
            print(f"{kind:<17} {batch:>5} {131072:>8} {us:>12.1f}", flush=True)
        for prompt in prompts:
            us = step_us(kind, 64, prompt, manager_steps)
            results["prompt_sweep"].append({"manager": kind, "B": 64, "prompt": prompt, "us_per_req": us})
            print(f"{kind:<17} {64:>5} {prompt:>8} {us:>12.1f}", flush=True)
    for prompt in full_prompts:
        us = step_us("target-full", 8, prompt, manager_steps)
        results["full_attention"].append({"B": 8, "prompt": prompt, "us_per_req": us})
        print(f"{'target-full':<17} {8:>5} {prompt:>8} {us:>12.1f}", flush=True)
    b = 64 if args.quick else 256
    if args.managers:
        _summary(results, batches)
        if args.json:
            with open(args.json, "w") as f:
                json.dump(results, f, indent=1)
        return
    ep = export_and_prepare(b, 131072, 524288 + 4096, steps)
    results["export_prepare"] = {"B": b, "prompt": 131072, "max_seq_len": 524288 + 4096, **ep}
    print(f"\nB {b}, 131k prompts, max_seq_len 528k (median us; baseline = every row converted at full width):")
    print(f"  export  baseline {ep['export_baseline_full']:>9.0f}   ours full width {ep['export_full']:>8.0f} "
          f"({ep['export_baseline_full'] / ep['export_full']:.1f}x)   ours live width {ep['export_live']:>7.0f} "
          f"({ep['export_baseline_full'] / ep['export_live']:.1f}x)   ours into a kept buffer "
          f"{ep['export_into_buffer']:>6.0f} ({ep['export_baseline_full'] / ep['export_into_buffer']:.1f}x)   "
          "target <= 2000 at B 256")
    print(f"  prepare baseline {ep['prepare_baseline_tables']:>9.0f}   ours {ep['prepare']:>8.0f} "
          f"({ep['prepare_baseline_tables'] / ep['prepare']:.1f}x)   target <= 3000 at B 256")
    _summary(results, batches)
    results["peak_rss_mb"] = peak_rss_mb()
    print(f"peak RSS of this process: {results['peak_rss_mb']:.0f} MB")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)


def _summary(results: dict, batches: tuple[int, ...]) -> None:
    """The flatness of the manager sweeps and the draft manager at B 256, beside the targets."""
    draft_b = [r["us_per_req"] for r in results["batch_sweep"] if r["manager"] == "draft" and r["B"] >= 8]
    draft_p = [r["us_per_req"] for r in results["prompt_sweep"] if r["manager"] == "draft"]
    full = [r["us_per_req"] for r in results["full_attention"]]
    print("\nflatness (target: within +-25 %):")
    print(f"  draft manager over B 8..{batches[-1]}:    {_flat(draft_b)}")
    print(f"  draft manager over prompts:   {_flat(draft_p)}")
    print(f"  full-attention target:        {_flat(full)}")
    at256 = [r["us_per_req"] for r in results["batch_sweep"] if r["manager"] == "draft" and r["B"] == 256]
    if at256:
        print(f"  draft manager at B 256: {at256[0]:.1f} us/request/step (target <= 5, issue 26)")


if __name__ == "__main__":
    main()
