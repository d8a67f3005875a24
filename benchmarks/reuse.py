"""Block reuse: prefill tokens saved and the host cost of a prefix lookup, against the same traffic without reuse.

64 requests share a 64k-token prefix and each adds its own tail (not a page
multiple). They run one after another through a target manager (a
full-attention group and a 4096-token window group, P = 32, chunks of 8192):
prefill, one generation step, finish. The first request computes the prefix and
publishes it; with reuse every later one finds it, skips it and shares its pages.
Host times are wall-clock on this process (one thread), medians over requests
2..64; the pools are real but tiny per page (head_dim 1), so what is timed is
the bookkeeping, not memory traffic.

Run: `python -m benchmarks.reuse` (about 10 s on one CPU core).
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch

from tensorrt_llm_draftkv import (
    KVCacheManagerV2,
    KVPoolConfig,
    LayerGroupConfig,
    LlmRequest,
    LlmRequestState,
    ScheduledRequests,
)

P = 32
CHUNK = 8192
WINDOW = 4096


def _manager(reuse: bool, requests: int, prompt: int) -> KVCacheManagerV2:
    full_pages = requests * (-(-prompt // P) + 2)  # room for every request without reuse
    window_pages = requests * (-(-(WINDOW + CHUNK) // P) + 2)
    config = KVPoolConfig(
        (LayerGroupConfig(1, window=None), LayerGroupConfig(1, window=WINDOW)),
        (full_pages, window_pages),
        tokens_per_block=P, num_kv_heads=1, head_dim=1, dtype=torch.float16, max_seq_len=prompt + 64,
        enable_block_reuse=reuse,
    )
    return KVCacheManagerV2.from_pool_config(config)


def _run(reuse: bool, requests: int, prefix: list[int], tail: int) -> dict[str, list[float]]:
    """Every request in turn; per request: tokens prefilled, chunks, µs of the first prepare, of the lookup,
    of the whole prefill (prepares and updates)."""
    mgr = _manager(reuse, requests, len(prefix) + tail)
    out: dict[str, list[float]] = {"tokens": [], "chunks": [], "first_us": [], "lookup_us": [], "prefill_us": []}
    for rid in range(requests):
        tokens = prefix + [1000 + rid * tail + i for i in range(tail)]
        req = LlmRequest(rid, prompt_len=len(tokens), tokens=tokens)
        req.target_view.chunk_size = min(CHUNK, len(tokens))
        probe = LlmRequest(rid, prompt_len=len(tokens), tokens=tokens)
        t0 = time.perf_counter()
        mgr.find_prefix_hit(probe)  # what the first prepare does first (0 work without reuse)
        out["lookup_us"].append((time.perf_counter() - t0) * 1e6)
        chunks, first, total = 0, 0.0, 0.0
        while True:
            batch = ScheduledRequests([req])
            t0 = time.perf_counter()
            mgr.prepare_resources(batch)
            spent = time.perf_counter() - t0
            first = first or spent
            chunks += 1
            last = req.is_last_context_chunk
            req.advance_context_chunk(CHUNK)
            t0 = time.perf_counter()
            mgr.update_context_resources(batch)
            total += spent + time.perf_counter() - t0
            if last:
                break
        out["tokens"].append(len(tokens) - req.reused_tokens)
        out["chunks"].append(chunks)
        out["first_us"].append(first * 1e6)
        out["prefill_us"].append(total * 1e6)
        req.state = LlmRequestState.GENERATION_IN_PROGRESS
        req.tokens.append(7)
        mgr.prepare_resources(ScheduledRequests([], [req]))
        mgr.free_resources(req)
    mgr.check_accounting()
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=64)
    parser.add_argument("--prefix", type=int, default=65536, help="shared prefix in tokens")
    parser.add_argument("--tail", type=int, default=517, help="each request's own tokens after the prefix")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    prefix = [(i * 7919) % 50000 for i in range(args.prefix)]
    runs = {reuse: _run(reuse, args.requests, prefix, args.tail) for reuse in (False, True)}

    def median(reuse: bool, key: str) -> float:
        return statistics.median(runs[reuse][key][1:])  # requests 2..N: the ones that can hit

    rows = [
        ("prefill tokens per request", "tokens", "{:.0f}"),
        ("prefill chunks per request", "chunks", "{:.0f}"),
        ("host us, prefix lookup alone", "lookup_us", "{:.0f}"),
        ("host us, first prepare (lookup + adopt + tail)", "first_us", "{:.0f}"),
        ("host us, whole prefill (prepares + updates)", "prefill_us", "{:.0f}"),
    ]
    print(f"{args.requests} requests, shared prefix {args.prefix} tokens, own tail {args.tail} tokens, "
          f"P={P}, chunk {CHUNK}, groups: full + window {WINDOW} (medians over requests 2..{args.requests})")
    print(f"{'metric':<48}{'without reuse':>15}{'with reuse':>13}{'ratio':>9}")
    for label, key, fmt in rows:
        off, on = median(False, key), median(True, key)
        ratio = f"{on / off:.3f}" if off else "-"
        print(f"{label:<48}{fmt.format(off):>15}{fmt.format(on):>13}{ratio:>9}")
    saved = sum(runs[False]["tokens"]) - sum(runs[True]["tokens"])
    print(f"prefill tokens saved over the run: {saved} of {sum(runs[False]['tokens'])} "
          f"({100.0 * saved / sum(runs[False]['tokens']):.1f} %)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
