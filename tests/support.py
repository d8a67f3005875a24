"""Helpers the test modules share (import as `from support import ...`; tests/conftest.py puts this folder on the path)."""
from __future__ import annotations

from dataclasses import replace

from tensorrt_llm_draftkv.sim import SimSetup, phrase_stream

# Chunk 512, windows 256/256, 16-token pages, 64 new tokens: each simulator run takes a fraction of a second.
SMALL = replace(
    SimSetup(),
    chunk=512,
    target_window=256,
    draft_window=256,
    tokens_per_block=16,
    max_new_tokens=64,
    pool_requests=4,
    max_seq_len=8192,
)


def ceil_div(a: int, b: int) -> int:
    return -(-a // b)


def truth(n: int, seed: int = 0) -> list[int]:
    """A ground-truth token stream of repeated phrases (64-token vocabulary)."""
    return phrase_stream(n, vocab_size=64, phrase_len=8, num_phrases=6, seed=seed)


def _digest(t) -> str:
    import hashlib

    return hashlib.sha256(t.detach().contiguous().cpu().numpy().tobytes()).hexdigest()


def handoff_probe_rank(rank: int, **build):
    """A disaggregated rank (`sim.simulate._build_rank`) that also records, per request, what crosses the wire.

    Rank 0 (context worker): a digest of every tensor of the drafter context it sends. Rank 1
    (generation worker): whether the pages its drafter wrote while importing are exactly the
    mirror's backed pages below the prompt end, and a digest of what its pool then holds for the
    received range of every group. Both land on the rank's returned stats as `handoff_probe`.
    Module-level (and in `support`) so a spawned rank can unpickle it.
    """
    from tensorrt_llm_draftkv.sim.simulate import _build_rank

    executor = _build_rank(rank, **build)
    probe: dict = {}
    speculator = executor.speculator
    if rank == 0:
        export = speculator.export_context

        def recording_export(req, tokens, geometry, *, floor=0):
            payload = export(req, tokens, geometry, floor=floor)
            probe[req.py_request_id] = [_digest(t) for t in payload]
            return payload

        speculator.export_context = recording_export
    else:
        drafter, manager = speculator.drafter, executor.draft_manager
        imported = speculator.import_context

        def checking_import(request_id, prompt_len, geometry, payload, *, floor=0):
            pages: set[int] = set()
            write = drafter._write_for

            def spy(rid, gi, positions, ordinals, pg, offsets, kv, owned_row):
                pages.update(int(p) for p in pg[offsets.long() >= 0].tolist())
                return write(rid, gi, positions, ordinals, pg, offsets, kv, owned_row)

            drafter._write_for = spy
            try:
                seeded = imported(request_id, prompt_len, geometry, payload, floor=floor)
            finally:
                del drafter._write_for  # back to the class's method
            P = manager.tokens_per_block
            backed = {
                p for g in range(manager.num_pools)
                for i, p in enumerate(manager.get_cache(request_id).block_row(g)) if p >= 0 and i * P < prompt_len
            }
            read_back = [
                _digest(drafter.read_stored(request_id, g, *geometry.group_range(g, prompt_len)))
                for g in range(geometry.num_groups)
            ]
            probe[request_id] = (pages == backed, len(backed), read_back)
            return seeded

        speculator.import_context = checking_import
    for name in ("run", "finish"):
        original = getattr(executor, name)

        def with_probe(*args, _original=original, **kwargs):
            stats = _original(*args, **kwargs)
            stats.handoff_probe = probe
            return stats

        setattr(executor, name, with_probe)
    return executor
