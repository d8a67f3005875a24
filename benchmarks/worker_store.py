"""What the worker's checked context store costs beside an unchecked write of the same bytes.

`DFlashWorker._store_context_kv_paged` looks every page up in the refreshed block
table and compares it with the request's own mirror before writing; upstream's
store writes where the table says. The baseline here is that unchecked write, the
same index arithmetic and the same `[n, layers, heads, head_dim]` K/V into the same
pool tensors, in the same run. Rows: requests per step x tokens per request.

Run: `python -m benchmarks.worker_store [--device cuda] [--reps N] [--json FILE]`.
"""
from __future__ import annotations

import argparse
import json
import statistics
import time
from types import SimpleNamespace

import torch

from tensorrt_llm_draftkv import (CacheType, DataType, DFlashDecodingConfig, DFlashSpecMetadata, DFlashWorker,
                                  KVCacheManagerV2, KvCacheConfig, LlmRequest, LlmRequestState, Mapping,
                                  ScheduledRequests)

P, K, H, D, LAYERS = 32, 7, 8, 128, 2


def build(batch: int, tokens: int, device: str):
    spec = DFlashDecodingConfig(max_draft_len=K)
    draft = KVCacheManagerV2(
        KvCacheConfig(max_tokens=batch * (tokens + 4 * P) * 2), CacheType.SELF, num_layers=LAYERS, num_kv_heads=H,
        head_dim=D, tokens_per_block=P, max_seq_len=tokens + 4 * P, max_batch_size=batch, mapping=Mapping(),
        dtype=DataType.BF16, spec_config=spec, is_draft=True, max_num_tokens=tokens, device=device,
    )
    worker = DFlashWorker(spec, Mapping(), True)
    meta = DFlashSpecMetadata(max_num_requests=batch, max_draft_len=K, max_total_draft_tokens=K, device=device)
    attn = SimpleNamespace(draft_kv_cache_block_offsets=None, request_ids=None, max_seq_len=tokens + 4 * P)
    model = SimpleNamespace(_num_attn_layers=LAYERS, _num_kv_heads=H, _head_dim=D, block_size=K + 1)
    worker._lazy_init_ctx_buffers(model, meta, attn, draft_kv_cache_manager=draft)
    reqs = [LlmRequest(i, tokens, state=LlmRequestState.CONTEXT_INIT) for i in range(batch)]  # one chunk each
    sched = ScheduledRequests(context_requests=reqs)
    draft.prepare_resources(sched)
    ids = [r.py_request_id for r in reqs]
    dst = torch.zeros((draft.num_pools, batch, 2, draft.config.max_blocks_per_seq), dtype=torch.int32, device=device)
    draft.copy_batch_block_offsets(dst, ids, 1, batch, batch)
    attn.draft_kv_cache_block_offsets, attn.request_ids = dst, ids
    meta.request_ids, meta.num_generations = ids, 0
    meta.prepare()
    worker._refresh_ctx_block_tables(attn, batch)
    rows = torch.arange(batch, device=device).repeat_interleave(tokens)
    positions = torch.arange(tokens, device=device).repeat(batch)
    k = torch.randn(batch * tokens, LAYERS, H, D, device=device, dtype=torch.bfloat16)
    return worker, rows, positions, k


def unchecked(worker: DFlashWorker, rows, positions, k) -> None:
    table = worker._ctx_block_tables
    pages = table[rows, positions // P].long()
    offsets = positions % P
    for layer, buf in enumerate(worker._ctx_kv_buf):
        buf[pages, 0, :, offsets, :] = k[:, layer]
        buf[pages, 1, :, offsets, :] = k[:, layer]


def timed(fn, reps: int, device: str) -> float:
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    fn()
    sync()
    samples = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        sync()
        samples.append(time.perf_counter() - t0)
    return statistics.median(samples) * 1e6


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    parser.add_argument("--reps", type=int, default=20)
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    torch.set_num_threads(1)
    rows_out = []
    print(f"{'B':>4} {'tokens':>7} {'checked us':>11} {'unchecked us':>13} {'ratio':>6}")
    for batch, tokens in [(1, 1024), (4, 1024), (16, 256), (8, 4096)]:
        worker, rows, positions, k = build(batch, tokens, args.device)
        ours = timed(lambda: worker._store_context_kv_paged(k, k, rows, positions), args.reps, args.device)
        base = timed(lambda: unchecked(worker, rows, positions, k), args.reps, args.device)
        rows_out.append({"B": batch, "tokens": tokens, "checked_us": ours, "unchecked_us": base, "ratio": ours / base})
        print(f"{batch:>4} {tokens:>7} {ours:>11.1f} {base:>13.1f} {ours / base:>6.2f}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"device": args.device, "rows": rows_out}, f, indent=1)


if __name__ == "__main__":
    main()
