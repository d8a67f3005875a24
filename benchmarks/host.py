"""Host cost of the managers per generation step, against the scale targets (CPU, one torch thread).

For each batch size B and prompt length, B requests are put in generation on
a windowed draft manager (DFlash, W 4096, P 32) and on a target manager (the
same window, or full attention), then timed over generation steps: one
`prepare_resources` plus one `update_resources` per step, with 1 + drafts
accepted each step. Also timed at one size: the block-offset export and
`DFlashSpecMetadata.prepare`. Medians of the steps, in microseconds; the
targets are printed beside the figures, never asserted.

    python -m benchmarks.host [--quick]
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch

from tensorrt_llm_draftkv import (
    DFlashSpecMetadata,
    DraftKVCacheManagerV2,
    KVCacheManagerV2,
    KVPoolConfig,
    LayerGroupConfig,
    LlmRequest,
    LlmRequestState,
    ScheduledRequests,
)
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


def _managers(kind: str, batch: int, prompt: int):
    max_seq = prompt + 4096
    if kind == "draft":
        pages = group_pages_per_request(
            W, P, max_seq_len=max_seq, chunk=CHUNK, max_draft_len=DRAFTS, num_extra_kv_tokens=EXTRA, trail_tokens=P
        )
        cfg = _config(W, batch, max_seq, pages)
        return DraftKVCacheManagerV2(cfg, spec_mode="dflash", max_draft_len=DRAFTS, num_extra_kv_tokens=EXTRA)
    window = W if kind == "target-windowed" else None
    pages = group_pages_per_request(window, P, max_seq_len=max_seq, chunk=CHUNK, max_draft_len=DRAFTS)
    return KVCacheManagerV2(_config(window, batch, max_seq, pages), max_draft_len=DRAFTS)


def _generation_requests(mgr, batch: int, prompt: int) -> list[LlmRequest]:
    reqs = []
    for rid in range(batch):
        req = LlmRequest(rid, prompt_len=prompt, state=LlmRequestState.DISAGG_GENERATION_INIT)
        req.tokens.append(1)
        mgr.prepare_disagg_gen_init(req)
        req.state = LlmRequestState.GENERATION_IN_PROGRESS
        reqs.append(req)
    return reqs


def step_us(kind: str, batch: int, prompt: int, steps: int) -> float:
    """Median µs per request of one prepare_resources + update_resources step."""
    mgr = _managers(kind, batch, prompt)
    reqs = _generation_requests(mgr, batch, prompt)
    batch_ = ScheduledRequests(generation_requests=reqs)
    times = []
    for _ in range(steps):
        t0 = time.perf_counter()
        mgr.prepare_resources(batch_)
        for req in reqs:
            req.tokens.extend([1] * 3)  # two drafts accepted and the bonus token
        mgr.update_resources(batch_)
        times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1e6 / batch


def export_and_prepare_us(batch: int, prompt: int, max_seq_len: int, steps: int) -> tuple[float, float]:
    pages = group_pages_per_request(
        W, P, max_seq_len=max_seq_len, chunk=CHUNK, max_draft_len=DRAFTS, num_extra_kv_tokens=EXTRA, trail_tokens=P
    )
    dm = DraftKVCacheManagerV2(
        _config(W, batch, max_seq_len, pages), spec_mode="dflash", max_draft_len=DRAFTS, num_extra_kv_tokens=EXTRA
    )
    reqs = _generation_requests(dm, batch, prompt)
    ids = [r.py_request_id for r in reqs]
    export = []
    for _ in range(steps):
        t0 = time.perf_counter()
        dm.get_block_offsets(ids, "cpp")
        export.append(time.perf_counter() - t0)
    meta = DFlashSpecMetadata(batch, block_size=DRAFTS + 1, tokens_per_block=P, max_ctx_len=max_seq_len, fused=False)
    batch_ = ScheduledRequests(generation_requests=reqs)
    prep = []
    for _ in range(steps):
        t0 = time.perf_counter()
        meta.prepare(batch_, dm)
        prep.append(time.perf_counter() - t0)
    return statistics.median(export) * 1e6, statistics.median(prep) * 1e6


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer sizes and steps")
    args = parser.parse_args()
    torch.set_num_threads(1)
    steps = 5 if args.quick else 15
    batches = (8, 64) if args.quick else (1, 8, 64, 256)
    prompts = (32768, 131072) if args.quick else (32768, 131072, 524288)
    print(f"{'manager':<17} {'B':>5} {'prompt':>8} {'us/req/step':>12}")
    for kind in ("draft", "target-windowed"):
        for batch in batches:
            for prompt in prompts:
                print(f"{kind:<17} {batch:>5} {prompt:>8} {step_us(kind, batch, prompt, steps):>12.1f}", flush=True)
    for prompt in (16384, 131072) if args.quick else (16384, 131072, 524288):
        print(f"{'target-full':<17} {8:>5} {prompt:>8} {step_us('target-full', 8, prompt, steps):>12.1f}", flush=True)
    b = 64 if args.quick else 256
    exp, prep = export_and_prepare_us(b, 131072, 524288 + 4096, steps)
    print(f"\nexport (B {b}, max_seq_len 528k): {exp:.0f} us (target <= 2000 at B 256)")
    print(f"DFlashSpecMetadata.prepare, torch path (B {b}): {prep:.0f} us (target <= 3000 at B 256)")
    print("targets: windowed draft manager <= 15 us/request/step at B 256, flat within +-25 % over B and prompt;")
    print("         full-attention target flat within +-25 % from 16k to 1M tokens")


if __name__ == "__main__":
    main()
